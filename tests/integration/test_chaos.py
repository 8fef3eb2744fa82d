"""The chaos harness (bench/chaos.py) as a bounded test: steady load from several tenants (streaming and async)
while routers, prefillers, decoders, the cache index and nats-server are SIGKILLed and restarted at random
(seeded). Nothing accepted is lost or duplicated, and every completed output equals its reference."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import chaos

pytestmark = pytest.mark.slow


async def test_chaos_bounded_run(tmp_path: Path) -> None:
    seconds = float(os.environ.get("SPLITSERVE_CHAOS_S", "60"))
    report = await chaos.run(duration=seconds, seed=23, kill_every=6.0, restart_after=1.0, clients=4, engine="mock",
                             step_ms=10, baseline_s=0, root=tmp_path)
    print("\n" + json.dumps(report))
    r = report["chaos"]
    assert sum(report["kills"].values()) >= 3, report
    assert r["completed"] > 20, report
    assert r["lost"] == 0, report
    assert r["duplicated"] == 0, report
    assert r["mismatched"] == 0, report
