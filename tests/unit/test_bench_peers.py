"""The side-by-side bench's own pieces (``bench/peers.py``): its zero-cost worker speaks the OpenAI streaming
shape the routers and the load generator expect, the load generator measures it, and a peer that is not
installed is reported as skipped rather than failing the run."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from bench import peers


def test_the_zero_cost_worker_streams_and_the_load_generator_measures_it(tmp_path: Path) -> None:
    port = peers.free_port()
    proc = peers.spawn("worker", [sys.executable, "-m", "bench.peers", "worker", "--port", str(port)], tmp_path)
    try:
        url = f"http://127.0.0.1:{port}"
        peers.wait_http(url, proc, timeout=60)
        args = argparse.Namespace(prompt_chars=400, max_tokens=16, ttft_requests=5, requests=40, concurrency=[4])
        res = asyncio.run(peers.measure("direct", [url], peers.MODEL, args))
        assert res.errors == 0
        assert res.ttft_ms["n"] == 5 and (res.ttft_ms["p50"] or 0) > 0
        assert res.rps[4] > 0
    finally:
        proc.stop()


def test_a_missing_peer_is_skipped_with_the_reason(tmp_path: Path) -> None:
    args = argparse.Namespace()
    res = peers.run_target("vllm-ca", args, tmp_path, ["http://127.0.0.1:9"], tmp_path / "no-venv" / "bin")
    assert res.skipped is not None and "missing" in res.skipped


def test_prompts_share_prefixes_and_have_the_asked_length() -> None:
    ps = peers.prompts(16, 400, "t")
    assert all(len(p) == 400 for p in ps) and len(set(ps)) == 16
    assert ps[0][:200] == ps[8][:200] != ps[1][:200]  # eight groups of shared prefixes


def test_the_floor_streams_every_token_through_its_hops(tmp_path: Path) -> None:
    """The design's floor (bench/floor.py) is a real pipeline: a request goes front door -> router -> decoder over
    a real nats-server and every token comes back, in order, as an OpenAI stream."""
    import json
    import urllib.request

    from splitserve.natsserver import start_nats

    nats = start_nats(tmp_path / "nats")
    procs = []
    try:
        base = [sys.executable, "-m", "bench.floor"]
        procs.append(peers.spawn("w", [*base, "worker", "--nats-url", nats.url, "--index", "0"], tmp_path))
        procs.append(peers.spawn("r", [*base, "router", "--nats-url", nats.url, "--workers", "1"], tmp_path))
        for p in procs:
            peers.wait_line(p, "ready")
        port = peers.free_port()
        procs.append(peers.spawn("f", [*base, "front", "--nats-url", nats.url, "--port", str(port)], tmp_path))
        url = f"http://127.0.0.1:{port}"
        peers.wait_http(url, procs[-1], timeout=60)
        body = json.dumps({"model": "floor", "prompt": "hello", "max_tokens": 7, "stream": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            events = [line[6:] for line in r.read().decode().split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0]["text"] for c in chunks] == ["x "] * 7
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 6 + ["length"]
    finally:
        for p in procs:
            p.stop()
        nats.stop()


def test_the_floor_targets_measure_and_count_each_process_kind(tmp_path: Path) -> None:
    args = argparse.Namespace(prompt_chars=400, max_tokens=16, ttft_requests=5, requests=40, concurrency=[4],
                              workers=2)
    one = peers.run_target("floor-1hop", args, tmp_path, [], None)
    two = peers.run_target("floor-2hop", args, tmp_path, [], None)
    for res in (one, two):
        assert res.errors == 0 and res.rps[4] > 0 and (res.ttft_ms["p50"] or 0) > 0
    assert set(one.cpu_us_per_request) == {"front", "worker", "nats"}
    assert set(two.cpu_us_per_request) == {"front", "router", "worker", "nats"}
