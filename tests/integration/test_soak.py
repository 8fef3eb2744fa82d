"""A short run of the soak harness (bench/soak.py; the long run's figures are in the issue note): the whole
control plane under load (mock engine) leaves no subscription, connection or queue consumer behind, and every
accepted request completes."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import soak

pytestmark = pytest.mark.slow


async def test_short_soak_leaves_nothing_behind(tmp_path: Path) -> None:
    r = await soak.run(minutes=0.5, clients=3, engine="mock", step_ms=5, sample_s=5.0, warmup_s=10.0, root=tmp_path)
    print({k: v for k, v in r.items() if k != "samples"})
    assert len(r["samples"]) >= 5
    assert r["accepted"] > 50 and r["completed"] == r["accepted"]
    before, after = r["idle_subscriptions"]
    assert after == before, r["idle_subscriptions"]  # every request's subscriptions are gone again
    assert r["idle_connections"][1] == r["idle_connections"][0]
    assert r["consumers"][1] == r["consumers"][0]
    assert all(g["end_mib"] > 0 for g in r["rss"].values())  # every service alive and measured
