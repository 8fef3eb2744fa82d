"""A restarted router knows the cluster's cache at once (issue 25): ``splitserve up`` (mock engine, kvaware, two
decoders), one long prompt fills a decoder's prefix cache, the decoders then stay idle (no KV events), the router
is SIGKILLed and comes back: the first repeat of the prompt is routed to the holder *because the router's index
says so* (``decision.cached_tokens`` > 0), with the KV reused. Before the warm start from the cache index, the
restarted router's index was empty until the holder's next events: the decision said 0 cached tokens and the
holder was hit only by chance (one decoder in two).

Prints what it measured: kill -> router ready, and the warm start's own cost from the router's log."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve.client import Client
from splitserve.stackproc import StackProc, start_stack
from tests.procs import ready_pid

pytestmark = pytest.mark.slow

PROMPT = ("In a quiet village by the sea there lived an old lighthouse keeper who kept a journal of every ship "
          "that passed. ") * 30 + "What did the keeper write about?"
SNAPSHOT_WAIT_S = 6.0  # the cache index snapshots every 5 s: the restarted router loads it (and replays the rest)


def _warm_start_line(sp: StackProc) -> dict[str, object]:
    for line in reversed(sp.logs("router-0").splitlines()):
        if '"index_warm_start"' in line:
            return json.loads(line)  # type: ignore[no-any-return]
    raise AssertionError("the restarted router logged no index_warm_start")


def test_restarted_router_routes_to_the_idle_holder_of_a_prompt(tmp_path: Path) -> None:
    sp = start_stack(tmp_path / "stack", "--engine", "mock", "--strategy", "kvaware", "--prefill", "0",
                     "--decode", "2")
    try:
        async def go() -> str:
            url = sp.nats_url
            async with Client(url) as c:
                first = await c.complete(PROMPT, max_tokens=4)
            holder = first.decode_worker
            assert holder is not None
            await asyncio.sleep(SNAPSHOT_WAIT_S)
            pid = await ready_pid(url, "router-0", "router", None)
            t_kill = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            await ready_pid(url, "router-0", "router", pid)
            ready_s = time.monotonic() - t_kill
            async with Client(url) as c:
                second = await c.complete(PROMPT, max_tokens=4)
            print(f"\nrouter SIGKILL -> ready {ready_s:.2f} s (supervisor restart + warm start + registry warm-up); "
                  f"repeat after restart: decoder {second.decode_worker} (holder {holder}), decision cached_tokens "
                  f"{second.decision.get('cached_tokens')}, usage cached_tokens {second.usage.cached_tokens}")
            assert second.decision["cached_tokens"] > 0, second.decision  # the router knew the holder's blocks
            assert second.decode_worker == holder
            assert second.usage.cached_tokens > 0
            warm = _warm_start_line(sp)
            print(f"warm start: {warm}")
            assert warm["snapshot_seq"] is not None and warm["complete"] is True
            return holder

        holder = asyncio.run(go())
        # The operator's view of the same: the cache index's stats, and the router's lookup of the prompt.
        splitserve = str(Path(sys.executable).parent / "splitserve")

        def cli(*args: str) -> dict:  # type: ignore[type-arg]
            cp = subprocess.run([splitserve, "cache", *args, "--json", "--nats-url", sp.nats_url],
                                capture_output=True, text=True, timeout=60)
            assert cp.returncode == 0, cp.stderr
            return json.loads(cp.stdout)  # type: ignore[no-any-return]

        stats = cli("stats")
        assert any(w["worker_id"] == holder and w["blocks"] > 0 for w in stats["workers"]), stats
        lookup = cli("lookup", PROMPT)
        assert lookup["workers"][0]["worker_id"] == holder and lookup["workers"][0]["cached_blocks"] > 0, lookup
    finally:
        assert sp.stop() == 0, "\n".join(sp.output[-40:])
