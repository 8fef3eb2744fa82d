"""The pure benchmarks still run (small slices of the Mooncake trace), and their indexes agree."""

from __future__ import annotations

import pytest

from bench.workload import DEFAULT_TRACE

pytestmark = pytest.mark.skipif(not DEFAULT_TRACE.exists(), reason="reference traces not present")


def test_index_bench_smoke() -> None:
    from bench import index_bench

    res = index_bench.run(workers=4, capacity_blocks=64, passes=1, limit=150)
    for shape in ("vllm", "coarse"):
        r = res["by_shape"][shape]
        assert r["lookups_verified_against_baseline"] == r["lookups"] > 0
        assert r["index"]["ops_per_s"] > 0 and r["baseline"]["ops_per_s"] > 0
        assert r["removed_events"] > 0  # the small capacity forces evictions
    assert res["index"] is res["by_shape"]["vllm"]["index"]


def test_route_bench_smoke() -> None:
    from bench import route_bench

    res = route_bench.run(workers=8, prefillers=2, limit=120)
    assert set(res["strategies"]) == {"kvaware", "prefixaware", "roundrobin", "session", "slo"}
    for r in res["strategies"].values():
        assert r["decisions_per_s"] > 0 and r["decision_p99_us"] >= r["decision_p50_us"]
    # Cache-aware routing finds the trace's reuse; round robin mostly does not.
    assert (
        res["strategies"]["kvaware"]["cached_token_share"]
        > res["strategies"]["roundrobin"]["cached_token_share"]
    )
