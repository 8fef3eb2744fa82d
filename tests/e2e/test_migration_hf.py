"""Request migration with the real model (hf engine) through the real stack (``splitserve up``): a decoder
SIGKILLed mid-stream, the caller's stream continues on the other decoder, seq numbers unbroken, and the greedy
output is token-identical to an unkilled run; ``splitserve trace`` shows the move as a ``router.migrate`` span."""

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

from splitserve.client import Client, Delta
from splitserve.stackproc import StackProc, start_stack
from tests.integration.test_migration import _check_unbroken, _kill, _stream, holder

pytestmark = pytest.mark.slow

SPLITSERVE = str(Path(sys.executable).parent / "splitserve")
PROMPT = "Write a very long story about a dragon."


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProc]:
    # Two decoders, no prefiller: every prompt is prefilled on its decoder (and re-prefilled on the new one).
    sp = start_stack(Path(tmp_path_factory.mktemp("mig")), "--decode", "2", "--prefill", "0")
    try:
        yield sp
    finally:
        sp.stop()


def _spans(stack: StackProc, rid: str, want: set[str], timeout: float = 20.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        cp = subprocess.run([SPLITSERVE, "trace", "--nats-url", stack.nats_url, rid, "--json"], capture_output=True,
                            text=True, timeout=60, env=dict(os.environ, COLUMNS="250"))
        spans = json.loads(cp.stdout) if cp.returncode == 0 else []
        if want <= {s["name"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.5)


def test_decoder_killed_mid_stream_real_model_token_identical(stack: StackProc) -> None:
    async def go() -> tuple[str, str, list[Delta]]:
        async with Client(stack.nats_url, idle_timeout=120) as c:
            reference = await c.generate(PROMPT, chat=True, max_tokens=40).collect()
            assert len(reference.token_ids) == 40, reference  # a long story: no early EOS
            gen = c.generate(PROMPT, chat=True, max_tokens=40)
            killed: list[str] = []

            async def kill_at_8(d: Delta) -> None:
                if d.seq == 8 and not killed:
                    hb = await holder(stack.nats_url, gen.request.key)
                    _kill(hb)
                    killed.append(hb.worker_id)

            deltas, result = await _stream(gen, kill_at_8)
            _check_unbroken(deltas, result, reference)
            assert killed and result.decode_worker != killed[0]
            print(f"\nreference: {reference.text!r}\nmigrated:  {result.text!r}\nkilled {killed[0]} at seq 8, "
                  f"continued on {result.decode_worker}")
            return gen.request_id, killed[0], deltas

    t0 = time.monotonic()
    rid, killed, _ = asyncio.run(go())
    assert time.monotonic() - t0 < 400
    spans = _spans(stack, rid, {"router.migrate", "client.generate"})
    mig = [s for s in spans if s["name"] == "router.migrate"]
    assert len(mig) == 1, spans
    attrs = mig[0]["attributes"]
    assert attrs["failed_worker"] == killed and attrs["migrated"] is True and attrs["start_seq"] >= 9
    assert len({s["trace_id"] for s in spans}) == 1
    assert not [s for s in spans if s["name"] == "client.generate" and s["status"] == "error"]
