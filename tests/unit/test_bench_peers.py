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
