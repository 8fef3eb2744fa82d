"""LMCache in PD mode (``LMCacheConnectorV1``, GPU only): configs and per-request params from the router's choice.

LMCache's PD protocol (what its own proxy does, done here by the workers over NATS):

* the prefill pool runs vLLM with ``kv_role=kv_producer`` and an LMCache config with ``pd_role: sender``;
  the decode pool ``kv_consumer`` with ``pd_role: receiver``, each receiver listening on its
  ``pd_peer_host`` / ``pd_peer_init_port`` / ``pd_peer_alloc_port``;
* a prefill request carries ``kv_transfer_params = {ret_first_tok: True, disagg_spec: {req_id,
  receiver_host, receiver_init_port: [...], receiver_alloc_port: [...]}}`` naming the decoder the router
  chose, and ``max_tokens=1``; LMCache pushes the KV into that decoder's PD buffer and every TP rank sends a
  done message (``ProxyNotif{req_id}``, msgpack) to ``pd_proxy_host:pd_proxy_port``, which here is a ZMQ
  PULL socket in the prefill worker itself;
* the decoder then runs ``prompt + [first_token]`` with ``max_tokens - 1`` (no params): LMCache's receiver
  finds the pushed KV by its token hash.

The receivers' addresses come from a peers file (``SPLITSERVE_LMCACHE_PEERS``, YAML: decoder id -> host,
init_port, alloc_port; deploy/vllm/lmcache-peers.yaml), or are derived from the decoder's index
(``decode-N``: base ports + N*10 on ``SPLITSERVE_LMCACHE_HOST``) on a single host.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PEERS_ENV = "SPLITSERVE_LMCACHE_PEERS"
HOST_ENV = "SPLITSERVE_LMCACHE_HOST"
BASE_INIT_PORT = 7300
BASE_ALLOC_PORT = 7400
BASE_PROXY_PORT = 7500


@dataclass(frozen=True)
class Peer:
    host: str
    init_port: int
    alloc_port: int


def _index(worker_id: str) -> int:
    m = re.search(r"(\d+)$", worker_id)
    return int(m.group(1)) if m else 0


def load_peers(path: str | Path | None = None) -> dict[str, Peer]:
    path = path or os.environ.get(PEERS_ENV)
    if not path:
        return {}
    import yaml

    raw = yaml.safe_load(Path(path).read_text()) or {}
    return {str(k): Peer(str(v["host"]), int(v["init_port"]), int(v["alloc_port"])) for k, v in raw.items()}


def peer_for(decoder_id: str, peers: dict[str, Peer] | None = None) -> Peer:
    peers = load_peers() if peers is None else peers
    if decoder_id in peers:
        return peers[decoder_id]
    i = _index(decoder_id)
    return Peer(os.environ.get(HOST_ENV, "127.0.0.1"), BASE_INIT_PORT + 10 * i, BASE_ALLOC_PORT + 10 * i)


def proxy_port(prefill_id: str) -> int:
    return int(os.environ.get("SPLITSERVE_LMCACHE_PROXY_PORT", BASE_PROXY_PORT + _index(prefill_id)))


def sender_config(*, proxy_host: str, proxy_port: int, buffer_bytes: int = 1 << 30, device: str = "cuda",
                  backends: tuple[str, ...] = ("UCX",), chunk_size: int = 256) -> dict[str, Any]:
    """The prefill pool's LMCache config (pd_role sender)."""
    return {"chunk_size": chunk_size, "local_cpu": False, "max_local_cpu_size": 0, "enable_pd": True,
            "pd_role": "sender", "transfer_channel": "nixl", "pd_proxy_host": proxy_host,
            "pd_proxy_port": proxy_port, "pd_buffer_size": buffer_bytes, "pd_buffer_device": device,
            "nixl_backends": list(backends)}


def receiver_config(peer: Peer, *, buffer_bytes: int = 1 << 30, device: str = "cuda",
                    backends: tuple[str, ...] = ("UCX",), chunk_size: int = 256) -> dict[str, Any]:
    """A decode worker's LMCache config (pd_role receiver) listening on its peer ports."""
    return {"chunk_size": chunk_size, "local_cpu": False, "max_local_cpu_size": 0, "enable_pd": True,
            "pd_role": "receiver", "transfer_channel": "nixl", "pd_peer_host": peer.host,
            "pd_peer_init_port": peer.init_port, "pd_peer_alloc_port": peer.alloc_port,
            "pd_buffer_size": buffer_bytes, "pd_buffer_device": device, "nixl_backends": list(backends)}


def write_config(cfg: dict[str, Any], path: str | Path) -> Path:
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def worker_config(role: str, worker_id: str, out_dir: str | Path, *, backends: tuple[str, ...] = ("UCX",)) -> Path:
    """Write this worker's LMCache config (sender for prefill, receiver for decode) and return its path."""
    if role == "prefill":
        cfg = sender_config(proxy_host=os.environ.get(HOST_ENV, "127.0.0.1"), proxy_port=proxy_port(worker_id),
                            backends=backends)
    else:
        cfg = receiver_config(peer_for(worker_id), backends=backends)
    return write_config(cfg, Path(out_dir) / f"lmcache-{worker_id}.yaml")


def prefill_params(request_id: str, decoder_id: str, *, tp_size: int = 1,
                   peers: dict[str, Peer] | None = None) -> dict[str, Any]:
    """kv_transfer_params of a prefill request whose KV goes to ``decoder_id`` (the router's choice)."""
    peer = peer_for(decoder_id, peers)
    return {"ret_first_tok": True,
            "disagg_spec": {"req_id": request_id, "receiver_host": peer.host,
                            "receiver_init_port": [peer.init_port + r for r in range(tp_size)],
                            "receiver_alloc_port": [peer.alloc_port + r for r in range(tp_size)]}}


class DoneListener:
    """The prefill worker's end of LMCache's done messages (a ZMQ PULL socket at its pd_proxy_port)."""

    def __init__(self, port: int, host: str = "0.0.0.0") -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.bind(f"tcp://{host}:{port}")
        self._done: dict[str, int] = {}

    async def wait(self, request_id: str, ranks: int = 1, timeout: float = 60.0) -> None:
        import asyncio

        import msgpack

        async def pump() -> None:
            while self._done.get(request_id, 0) < ranks:
                raw = await self._sock.recv()
                msg = msgpack.unpackb(raw, raw=False)
                rid = msg.get("req_id") if isinstance(msg, dict) else (msg[0] if msg else None)
                if isinstance(rid, str):
                    self._done[rid] = self._done.get(rid, 0) + 1

        await asyncio.wait_for(pump(), timeout)
        self._done.pop(request_id, None)

    def close(self) -> None:
        self._ctx.destroy(linger=0)
