"""The per-tenant intake byte budget (pure): what it lets through over any interval is bounded by its burst plus
its rate times the interval, a message it refuses passes once its retry-after has passed, and its memory is
bounded whatever names it sees."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from splitserve.tenancy.intake_rate import MIN_COST, IntakeBudget

RATE = 1_000_000.0


@given(st.lists(st.tuples(st.floats(0.0, 2.0), st.integers(0, 3_000_000)), max_size=200))
def test_admitted_bytes_never_exceed_burst_plus_rate_times_time(msgs: list[tuple[float, int]]) -> None:
    b = IntakeBudget(RATE)
    now, admitted = 0.0, 0.0
    for gap, size in msgs:
        now += gap
        if b.take("t", size, now) is None:
            admitted += max(size, MIN_COST)
        assert admitted <= b.burst + RATE * now + 1e-6


@given(st.integers(0, 9_000_000), st.integers(0, 50))
def test_a_refused_message_passes_after_its_retry_after(size: int, before: int) -> None:
    b = IntakeBudget(RATE)
    for _ in range(before):  # drain the bucket
        b.take("t", 1_000_000, 0.0)
    wait = b.take("t", size, 0.0)
    if wait is not None:
        assert wait > 0
        assert b.take("t", size, wait + 1e-6) is None


def test_tenants_do_not_share_a_budget_and_a_tenant_rate_overrides() -> None:
    b = IntakeBudget(RATE)
    while b.take("a", 1_000_000, 0.0) is None:
        pass
    assert b.take("b", 1_000_000, 0.0) is None  # a's flood leaves b's budget whole
    assert b.take("c", 50 * 1024 * 1024, 0.0, rate=100 * 1024 * 1024) is None  # c's own, larger budget


def test_buckets_are_bounded() -> None:
    b = IntakeBudget(RATE, max_keys=100)
    for i in range(10_000):
        b.take(f"t{i}", 10, float(i))
    assert len(b) == 100
