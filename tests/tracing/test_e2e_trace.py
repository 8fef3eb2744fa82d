"""End to end on a real stack (``splitserve up``, real model): one request is one trace across client,
router, prefiller (KV push) and decoder; ``splitserve trace`` draws it; a decoder killed mid-stream shows up
as an error span in the request's trace."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from splitserve import errors
from splitserve.client import Client
from splitserve.stackproc import StackProc, start_stack
from tests.procs import kill_worker_mid_stream

pytestmark = pytest.mark.slow

SPLITSERVE = str(Path(sys.executable).parent / "splitserve")
LONG = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
        "Constantinople. ") * 3 + "Summarise this in one sentence:"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProc]:
    # no migration: the killed decoder's request ends in an error span (see tests/e2e/test_stack.py)
    sp = start_stack(Path(tmp_path_factory.mktemp("stack")), "--disagg-threshold", "32", "--max-migrations", "0")
    try:
        yield sp
    finally:
        sp.stop()


def _trace(stack: StackProc, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SPLITSERVE, "trace", "--nats-url", stack.nats_url, *args], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, COLUMNS="250"))


def _spans(stack: StackProc, rid: str, want: set[str], timeout: float = 15.0) -> list[dict[str, Any]]:
    """Spans leave each process in batches (~0.5 s): poll until the expected names are all there."""
    deadline = time.monotonic() + timeout
    while True:
        cp = _trace(stack, rid, "--json")
        spans = json.loads(cp.stdout) if cp.returncode == 0 else []
        if want <= {s["name"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.5)


def test_one_trace_across_every_hop(stack: StackProc) -> None:
    async def go() -> str:
        async with Client(stack.nats_url) as c:
            res = await c.complete(LONG, max_tokens=6)
            assert res.route == "disaggregated", res
            return res.request_id

    rid = asyncio.run(go())
    want = {"client.generate", "router.request", "router.dispatch", "prefill.job", "prefill.compute", "kv.push",
            "decode.admit", "decode.stream"}
    spans = _spans(stack, rid, want)
    names = {s["name"] for s in spans}
    assert want <= names, names
    assert len({s["trace_id"] for s in spans}) == 1
    assert {"client", "router", "prefill", "decode"} <= {s["service"] for s in spans}
    by = {s["name"]: s for s in spans}
    ids = {s["span_id"] for s in spans}
    assert all(s["parent_id"] in ids for s in spans if s["name"] != "client.generate")  # one connected tree
    # intake stored the request in the durable queue; dispatch (a child of intake) made the routing decision
    assert by["router.dispatch"]["parent_id"] == by["router.request"]["span_id"]
    assert by["router.request"]["attributes"]["prompt_tokens"] > 32
    r = by["router.dispatch"]["attributes"]
    assert "queue_wait_ms" in r
    assert r["decision.route"] == "disaggregated" and r["decision.strategy"] and "decision.candidates" in r
    assert json.loads(r["decision_json"])["request_id"] == rid
    assert "decision.thresholds" in r and r["prompt_tokens"] > 32
    push = by["kv.push"]["attributes"]
    assert push["kv.bytes"] > 0 and push["kv.transport"] and "kv.bandwidth_mbps" in push
    assert "kv.layerwise" in push
    assert by["prefill.compute"]["attributes"]["prefill.tokens"] == r["prompt_tokens"]
    adm = by["decode.admit"]["attributes"]
    assert adm["prompt_tokens"] == r["prompt_tokens"] and "first_token_ms" in adm and "cached_tokens" in adm
    st = by["decode.stream"]["attributes"]
    assert st["completion_tokens"] == 6 and st["finish_reason"] == "length" and "itl_p50_ms" in st
    # The decoder's log line for this request carries the same trace id.
    tid = spans[0]["trace_id"]
    assert any(f'"trace_id": "{tid}"' in line and rid in line for line in stack.logs("decode-0").splitlines())

    cp = _trace(stack, rid)
    assert cp.returncode == 0, cp.stderr
    for text in ("router.request", "router.dispatch", "kv.push", "decode.stream", "decision.strategy=",
                 "kv.bytes="):
        assert text in cp.stdout, cp.stdout
    cp = _trace(stack, "--slowest", "3")
    assert cp.returncode == 0 and rid in cp.stdout, cp.stdout + cp.stderr


def test_front_door_continues_the_callers_traceparent(stack: StackProc) -> None:
    import urllib.request

    assert stack.http_url
    tid, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    req = urllib.request.Request(
        f"{stack.http_url}/v1/completions", method="POST",
        data=json.dumps({"prompt": "Hello", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json", "traceparent": f"00-{tid}-{parent}-01"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        rid = resp.headers["X-Request-Id"]
        assert resp.status == 200
    spans = _spans(stack, rid, {"client.generate", "router.request", "decode.stream"})
    assert {s["trace_id"] for s in spans} == {tid}, spans
    # the caller's span is the parent of the front door's first span (the ASGI server span, whose child is
    # client.generate): follow client.generate's parents up to the caller
    by_id = {s["span_id"]: s for s in spans}
    hop = next(s for s in spans if s["name"] == "client.generate")
    while hop["parent_id"] in by_id:
        hop = by_id[hop["parent_id"]]
        assert hop["service"] == "frontend", hop
    assert hop["parent_id"] == parent and hop["service"] == "frontend", hop


def test_decoder_killed_mid_stream_shows_error_span(stack: StackProc) -> None:
    async def go() -> str:
        async with Client(stack.nats_url, idle_timeout=60) as c:
            rid, err = await kill_worker_mid_stream(c, stack.nats_url)
            assert isinstance(err, errors.WorkerDied), err
            return rid

    rid = asyncio.run(go())
    spans = _spans(stack, rid, {"router.fail", "client.generate"})
    errs = {s["name"]: s for s in spans if s["status"] == "error"}
    assert "router.fail" in errs and "client.generate" in errs, spans
    assert "decode-0" in (errs["router.fail"]["attributes"].get("failed_worker") or "")
    assert len({s["trace_id"] for s in spans}) == 1
    cp = _trace(stack, rid)
    assert cp.returncode == 0 and "ERROR" in cp.stdout and "router.fail" in cp.stdout, cp.stdout
