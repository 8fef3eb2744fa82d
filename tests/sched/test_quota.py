"""Quota accounting: each limit of the tenants file refuses precisely (which limit, when to retry), the
sliding minute frees tokens on time, and a finished request's real usage replaces its reservation."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.tenancy import TenantLimits, TenantsConfig, TenantSpec, load_tenants
from splitserve.tenancy.quota import QuotaBook


def _book(**limits: int) -> QuotaBook:
    return QuotaBook(TenantsConfig(tenants={"a": TenantSpec(**limits), "b": TenantSpec()}))


def test_unknown_tenant_is_refused_when_a_file_is_given() -> None:
    r = _book().check("zed", 10, 10, 0, 0.0)
    assert r is not None and r.code == "unknown_tenant" and r.retry_after_s is None


def test_open_mode_serves_anyone_with_defaults() -> None:
    book = QuotaBook(TenantsConfig.open_mode(TenantLimits(max_tokens=5)))
    assert book.check("anyone", 10, 5, 0, 0.0) is None
    r = book.check("anyone", 10, 6, 0, 0.0)
    assert r is not None and r.limit == "max_tokens"


def test_max_prompt_and_max_tokens() -> None:
    book = _book(max_prompt_tokens=100, max_tokens=50)
    r = book.check("a", 101, 1, 0, 0.0)
    assert r is not None and r.code == "prompt_too_long" and r.limit == "max_prompt_tokens" and "101" in r.message
    r = book.check("a", 10, 51, 0, 0.0)
    assert r is not None and r.limit == "max_tokens" and r.retry_after_s is None
    assert book.check("b", 10_000, 10_000, 0, 0.0) is None  # b has no limits


def test_max_inflight_and_release() -> None:
    book = _book(max_inflight=2)
    for rid in ("r1", "r2"):
        assert book.check("a", 1, 1, 0, 0.0) is None
        book.admit("a", rid, 1, 1, 0.0)
    r = book.check("a", 1, 1, 0, 0.0)
    assert r is not None and r.limit == "max_inflight" and r.retry_after_s is not None
    assert book.check("b", 1, 1, 0, 0.0) is None  # one tenant's refusal does not touch another
    assert book.finish("a", "r1", 2, 1.0)
    assert book.check("a", 1, 1, 0, 1.0) is None


def test_admit_is_idempotent() -> None:
    book = _book(max_inflight=1)
    book.admit("a", "r1", 1, 1, 0.0)
    book.admit("a", "r1", 1, 1, 0.0)
    assert book.inflight("a") == 1
    assert not book.finish("a", "nope", 1, 0.0)


def test_max_queued() -> None:
    r = _book(max_queued=3).check("a", 1, 1, 3, 0.0)
    assert r is not None and r.limit == "max_queued"


def test_tokens_per_minute_window_and_retry_after() -> None:
    book = _book(tokens_per_minute=1000)
    book.admit("a", "r1", 300, 300, 0.0)  # reserves 600
    r = book.check("a", 300, 200, 0, 10.0)
    assert r is not None and r.limit == "tokens_per_minute"
    assert r.retry_after_s == pytest.approx(50.0)  # when r1's charge leaves the minute
    book.finish("a", "r1", 350, 20.0)  # it used 350, not 600
    assert book.check("a", 300, 200, 0, 20.0) is None
    assert book.tokens_in_window("a", 59.0) == 350
    assert book.tokens_in_window("a", 60.5) == 0


def test_request_larger_than_the_whole_minute_is_not_retryable() -> None:
    r = _book(tokens_per_minute=100).check("a", 80, 30, 0, 0.0)
    assert r is not None and r.retry_after_s is None and "lower max_tokens" in r.message


@given(st.lists(st.tuples(st.integers(1, 200), st.integers(0, 200), st.floats(0, 5)), max_size=40))
def test_window_total_never_negative_and_matches_recent_charges(reqs: list[tuple[int, int, float]]) -> None:
    book = _book(tokens_per_minute=10**9)
    now = 0.0
    for i, (reserve, used, dt) in enumerate(reqs):
        now += dt
        book.admit("a", f"r{i}", reserve, 0, now)
        book.finish("a", f"r{i}", used, now + dt)
    total = book.tokens_in_window("a", now + 5)
    assert total >= 0
    assert total <= sum(u for _, u, _ in reqs)


def test_load_tenants_file(tmp_path: Path) -> None:
    f = tmp_path / "t.yaml"
    f.write_text("defaults: {max_inflight: 5}\ntenants:\n  a: {weight: 3, max_tokens: 10}\n  b:\n")
    cfg = load_tenants(f)
    a = cfg.limits("a")
    assert a is not None and a.weight == 3 and a.max_inflight == 5 and a.max_tokens == 10
    assert cfg.limits("c") is None and not cfg.known("c")
    f.write_text("tenants:\n  'bad.name': {}\n")
    with pytest.raises(ValueError, match="tenant"):
        load_tenants(f)
    f.write_text("tenants:\n  a: {weight: -1}\n")
    with pytest.raises(ValueError, match="weight"):
        load_tenants(f)
    with pytest.raises(ValueError, match="cannot read"):
        load_tenants(tmp_path / "missing.yaml")


# --- one tenant's usage shared by several routers (export / load; compare-and-set in the service) ----------


def test_export_load_round_trip_keeps_the_decisions() -> None:
    a = _book(max_inflight=3, tokens_per_minute=1000)
    a.admit("a", "r1", 100, 100, 10.2)
    a.admit("a", "r2", 100, 100, 10.5)
    a.finish("a", "r1", 150, 11.0)
    snap = a.export("a", 12.0)
    assert set(snap["inflight"]) == {"r2"} and sum(t for _, t in snap["settled"]) == 150
    b = _book(max_inflight=3, tokens_per_minute=1000)
    b.load("a", snap, 12.0)
    assert b.inflight("a") == 1 and b.tokens_in_window("a", 12.0) == 350 == a.tokens_in_window("a", 12.0)
    # a finished request's tokens count for at least the minute (merged per second, rounded up, never down)
    assert b.tokens_in_window("a", 70.9) == 350 - 200  # r2's reservation (at 10.5) left the window
    b.load("a", snap, 12.0)
    assert b.tokens_in_window("a", 71.1) == 0


def test_routers_sharing_snapshots_never_exceed_max_inflight() -> None:
    # Three routers admit in turn, each deciding on the latest snapshot (what compare-and-set guarantees):
    # together they admit exactly the limit, not three times it.
    books = [_book(max_inflight=5) for _ in range(3)]
    snap = None
    admitted = 0
    for i in range(30):
        book = books[i % 3]
        book.load("a", snap, 1.0)
        if book.check("a", 10, 10, 0, 1.0, request_id=f"r{i}") is None:
            book.admit("a", f"r{i}", 10, 10, 1.0)
            admitted += 1
        snap = book.export("a", 1.0)
    assert admitted == 5
    # a re-sent request already in flight is not refused, nor counted twice
    books[0].load("a", snap, 2.0)
    assert books[0].check("a", 10, 10, 0, 2.0, request_id="r0") is None
    books[0].admit("a", "r0", 10, 10, 2.0)
    assert books[0].inflight("a") == 5


def test_stale_reservations_and_idempotent_finish() -> None:
    book = _book(max_inflight=2)
    book.admit("a", "old", 1, 1, 0.0)
    book.admit("a", "new", 1, 1, 50.0)
    assert book.stale("a", 30.0, 60.0) == ["old"] and book.stale("b", 30.0, 60.0) == []
    assert book.finish("a", "old", None, 60.0) is True
    assert book.finish("a", "old", None, 61.0) is False  # a second finish changes nothing
    assert book.inflight("a") == 1 and book.has_dynamic_limits("a") and not book.has_dynamic_limits("b")


def test_a_corrupt_snapshot_cannot_block_a_tenant() -> None:
    """Times no router writes (far in the future, infinite) and negative token counts in a shared snapshot (a
    corrupt or forged record) count from now and as nothing: they neither block the tenant until some far date
    nor open a hole in its limit."""
    now = 1_000.0
    b = _book(tokens_per_minute=1000)
    b.load("a", {"inflight": {"x": [now + 10**9, 900]}, "settled": [[float("inf"), 50], [now, -10**6]],
                 "finishes": [now + 10**9]}, now)
    assert b.tokens_in_window("a", now) == 950
    assert b.check("a", 10, 10, 0, now) is None
    assert b.tokens_in_window("a", now + 61) == 0  # all of it leaves the window a minute later, as any charge
    # within the skew routers' clocks may have, a time ahead is kept as written
    c = _book(tokens_per_minute=1000)
    c.load("a", {"settled": [[now + 30, 100]]}, now)
    assert c.tokens_in_window("a", now + 80) == 100
