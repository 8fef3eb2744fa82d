"""The fair scheduler (weighted virtual token counters): shares follow weights, a light tenant is never starved
by a flood, an idle tenant banks no credit, and the choice is deterministic."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.tenancy.fairshare import FairScheduler


def _serve(sched: FairScheduler, backlog: dict[str, int], cost: dict[str, int], n: int) -> Counter[str]:
    got: Counter[str] = Counter()
    for _ in range(n):
        t = sched.pick(backlog)
        if t is None:
            break
        sched.charge(t, cost[t])
        backlog[t] -= 1
        got[t] += cost[t]
    return got


def test_token_shares_follow_weights() -> None:
    w = {"a": 3.0, "b": 1.0}
    sched = FairScheduler(w.__getitem__)
    got = _serve(sched, {"a": 10_000, "b": 10_000}, {"a": 100, "b": 100}, 400)
    assert abs(got["a"] / got["b"] - 3.0) < 0.05


def test_shares_are_by_tokens_not_requests() -> None:
    # b sends requests 4x as large: with equal weights it gets 1/4 of a's request count, equal tokens.
    sched = FairScheduler()
    backlog = {"a": 10_000, "b": 10_000}
    got = _serve(sched, backlog, {"a": 50, "b": 200}, 500)
    assert abs(got["a"] / got["b"] - 1.0) < 0.05
    assert (10_000 - backlog["a"]) > 3.5 * (10_000 - backlog["b"])


def test_flood_does_not_starve_a_late_light_tenant() -> None:
    sched = FairScheduler()
    backlog = {"flood": 500, "light": 0}
    _serve(sched, backlog, {"flood": 100, "light": 100}, 200)  # flood alone for a while
    backlog["light"] = 3
    picks = []
    for _ in range(6):
        t = sched.pick(backlog)
        assert t is not None
        sched.charge(t, 100)
        backlog[t] -= 1
        picks.append(t)
    # served alternately with the flood from now on, not after its remaining 300
    assert picks.count("light") == 3 and picks.index("light") <= 1


def test_idle_tenant_banks_no_credit() -> None:
    sched = FairScheduler()
    backlog = {"a": 1000, "b": 0}
    _serve(sched, backlog, {"a": 100, "b": 100}, 100)  # a served 10,000 tokens alone
    backlog["b"] = 1000
    got = _serve(sched, backlog, {"a": 100, "b": 100}, 100)
    # b does not get the next 100 requests in a row to "catch up": the two alternate from here.
    assert 45 <= got["b"] // 100 <= 55


def test_settle_corrects_estimates() -> None:
    sched = FairScheduler()
    sched.charge("a", 1000)
    sched.settle("a", 1000, 10)
    assert sched.counters()["a"] == 10
    assert sched.served()["a"] == 10


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.integers(min_value=1, max_value=8), min_size=2, max_size=5),
       cost=st.integers(min_value=1, max_value=500))
def test_long_run_shares_match_weights_for_any_weights(weights: list[int], cost: int) -> None:
    names = [f"t{i}" for i in range(len(weights))]
    w = dict(zip(names, map(float, weights), strict=True))
    sched = FairScheduler(w.__getitem__)
    n = 60 * sum(weights)
    got = _serve(sched, dict.fromkeys(names, 10**9), dict.fromkeys(names, cost), n)
    total = sum(got.values())
    for t in names:
        # within one request of the exact weighted share
        assert abs(got[t] - total * w[t] / sum(w.values())) <= cost * 1.01 + 1e-9


@given(st.dictionaries(st.sampled_from("abcdef"), st.integers(min_value=0, max_value=3), min_size=1))
def test_pick_is_deterministic_and_only_backlogged(backlog: dict[str, int]) -> None:
    a, b = FairScheduler(), FairScheduler()
    ta, tb = a.pick(backlog), b.pick(backlog)
    assert ta == tb
    if any(backlog.values()):
        assert ta is not None and backlog[ta] > 0
    else:
        assert ta is None


def test_several_routers_sharing_counters_keep_the_weighted_split() -> None:
    # Three router replicas take turns dispatching from the same backlog (they pull from one shared queue),
    # at uneven rates; each adds the others' published charges to its counters. The cluster-wide split
    # follows the 3:1 weights, and after exchanging reports every replica compares the same counters, so
    # they agree on who is behind.
    w = {"heavy": 3.0, "slim": 1.0}
    routers = [FairScheduler(w.__getitem__) for _ in range(3)]
    got: Counter[str] = Counter()
    backlog = {"heavy": 100_000, "slim": 100_000}
    turns = [0, 0, 0, 1, 2, 0, 1]  # router 0 dispatches most
    for i in range(1400):
        me = routers[turns[i % len(turns)]]
        me.set_remote(_sum(r.virtual() for r in routers if r is not me))
        t = me.pick(backlog)
        assert t is not None
        me.charge(t, 100 if t == "heavy" else 50)  # requests of different sizes: shares are by tokens
        got[t] += 100 if t == "heavy" else 50
    assert abs(got["heavy"] / got["slim"] - 3.0) < 0.05, got
    for me in routers:
        me.set_remote(_sum(r.virtual() for r in routers if r is not me))
    views = [r.counters() for r in routers]
    # equal up to each replica's own catch-up lifts when the tenants first became backlogged (< one request)
    for t in w:
        assert max(v[t] for v in views) - min(v[t] for v in views) <= 100, views


def _sum(dicts: object) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:  # type: ignore[attr-defined]
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out
