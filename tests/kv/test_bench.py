"""The benchmark helper runs end to end (tiny sizes; the real figures come from ``python -m
splitserve.kv.bench``)."""

from __future__ import annotations

import pytest

from splitserve.kv import KvLayout
from splitserve.kv.bench import measure_push_bandwidth, memcpy_bandwidth


def test_memcpy_bandwidth_reports_rate() -> None:
    r = memcpy_bandwidth(1 << 20, repeats=2)
    assert r["bytes"] == 1 << 20 and r["gbps_median"] > 0


@pytest.mark.timeout(120)
async def test_measure_push_bandwidth_tcp() -> None:
    layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    r = await measure_push_bandwidth("tcp", 100_000, repeats=2, layout=layout, fragmented=True)
    assert r["verified"] is True
    assert r["bytes"] >= 100_000 and r["bytes"] % layout.bytes_per_block == 0
    assert r["gbps_median"] > 0 and r["first_push_s"] > 0
