"""LMCache PD mode (GPU only at run time): the configs and per-request params the workers generate."""

from __future__ import annotations

from pathlib import Path

import yaml

from splitserve.engines.lmcache_pd import Peer, load_peers, peer_for, prefill_params, worker_config


def test_disagg_spec_names_the_routers_decoder(tmp_path: Path) -> None:
    peers = tmp_path / "peers.yaml"
    peers.write_text("decode-3: {host: 10.0.0.7, init_port: 7301, alloc_port: 7401}\n")
    table = load_peers(peers)
    assert table == {"decode-3": Peer("10.0.0.7", 7301, 7401)}
    p = prefill_params("req-1", "decode-3", tp_size=2, peers=table)
    assert p == {"ret_first_tok": True, "disagg_spec": {"req_id": "req-1", "receiver_host": "10.0.0.7",
                                                        "receiver_init_port": [7301, 7302],
                                                        "receiver_alloc_port": [7401, 7402]}}
    # not in the file: single-host default ports by worker index
    assert peer_for("decode-2", table) == Peer("127.0.0.1", 7320, 7420)


def test_worker_configs_sender_and_receiver(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("SPLITSERVE_LMCACHE_PEERS", raising=False)
    monkeypatch.setenv("SPLITSERVE_LMCACHE_HOST", "10.1.1.1")
    s = yaml.safe_load(worker_config("prefill", "prefill-1", tmp_path, backends=("LIBFABRIC",)).read_text())
    assert s["pd_role"] == "sender" and s["enable_pd"] and s["pd_proxy_port"] == 7501
    assert s["pd_proxy_host"] == "10.1.1.1" and s["nixl_backends"] == ["LIBFABRIC"]
    r = yaml.safe_load(worker_config("decode", "decode-1", tmp_path).read_text())
    assert r["pd_role"] == "receiver" and (r["pd_peer_init_port"], r["pd_peer_alloc_port"]) == (7310, 7410)
    assert r["transfer_channel"] == "nixl"
