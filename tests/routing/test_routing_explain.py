"""Routing on paper (``splitserve.routing.explain``): each strategy's dry run predicts the live decision and
leaves every piece of routing state exactly as it was."""

from __future__ import annotations

import pytest

from splitserve.cache import PrefixIndex, hash_token_blocks
from splitserve.routing import DISAGGREGATED, Router, RoutingRequest, WorkerView, available
from splitserve.routing.explain import explain

BS = 16


def pool(nd: int = 3, np_: int = 2) -> list[WorkerView]:
    return [WorkerView(f"d{i}", "decode") for i in range(nd)] + [WorkerView(f"p{i}", "prefill") for i in range(np_)]


def tokens(seed: int, n: int) -> list[int]:
    return [seed * 1_000_000 + i for i in range(n)]


def _key(d: dict) -> tuple:  # type: ignore[type-arg]
    return (d["decoder"], d["prefiller"], d["route"], d["reason"], [c["worker"] for c in d["candidates"]])


@pytest.mark.parametrize("strategy", available())
def test_the_live_strategys_dry_run_predicts_its_next_decision(strategy: str) -> None:
    live = Router(strategy, disagg_threshold=512)
    ws = pool()
    for i in range(7):  # several turns: roundrobin's rotation and the cost's tie-break rotation must be copied
        req = RoutingRequest(f"r{i}", token_ids=tokens(i % 3, 40 + 700 * (i % 2)), session_key=f"s{i % 2}")
        ex = explain(live, req, ws, float(i))
        assert ex[0].strategy == strategy and ex[0].live and ex[0].decision is not None
        again = explain(live, req, ws, float(i))  # asking twice changes nothing
        assert again[0].decision == ex[0].decision
        real = live.decide(RoutingRequest(f"r{i}", token_ids=req.token_ids, session_key=req.session_key), ws, float(i))
        assert _key(ex[0].decision) == _key(real.to_dict())


def test_a_dry_run_leaves_ledger_tree_index_and_rotation_alone() -> None:
    idx = PrefixIndex()
    live = Router("prefixaware", index=idx, disagg_threshold=512)
    ws = pool(2, 1)
    toks = tokens(1, 1000)
    first = live.decide(RoutingRequest("a", token_ids=toks), ws, 0.0)
    assert live.pending is not None
    before = (len(live.pending), live.pending.pending_for("d0"), live.pending.pending_for("d1"),
              live.strategy.tree.version, idx.version,  # type: ignore[attr-defined]
              dict(live.strategy.cost._turn), live.strategy.tracked_blocks(first.decoder))  # type: ignore[attr-defined]
    for _ in range(3):
        ex = explain(live, RoutingRequest("b", token_ids=toks), ws, 0.1)
    after = (len(live.pending), live.pending.pending_for("d0"), live.pending.pending_for("d1"),
             live.strategy.tree.version, idx.version,  # type: ignore[attr-defined]
             dict(live.strategy.cost._turn), live.strategy.tracked_blocks(first.decoder))  # type: ignore[attr-defined]
    assert before == after
    # the live prefixaware tree (shared, read-only) knows where the prompt went
    d = ex[0].decision
    assert d is not None
    held = {c["worker"]: c["cached_blocks"] for c in d["candidates"]}
    assert held[first.decoder] == 1000 // BS


def test_the_pending_ledger_is_seen_as_the_live_decision_would_see_it() -> None:
    live = Router("kvaware", disagg_threshold=10_000)
    ws = pool(2, 0)
    first = live.decide(RoutingRequest("a", token_ids=tokens(1, 100)), ws, 0.0)
    ex = explain(live, RoutingRequest("b", token_ids=tokens(2, 100)), ws, 0.1)
    d = ex[0].decision
    assert d is not None and d["decoder"] != first.decoder  # the dispatched request still counts on its decoder
    assert len(live.pending) == 1  # type: ignore[arg-type]


def test_other_strategies_are_fresh_and_kvaware_reads_the_live_index() -> None:
    idx = PrefixIndex()
    toks = tokens(7, 2000)
    idx.store("d2", hash_token_blocks(toks, BS))
    live = Router("roundrobin", index=idx, disagg_threshold=512)
    ex = {e.strategy: e for e in explain(live, RoutingRequest("x", token_ids=toks), pool(), 0.0)}
    assert set(ex) == set(available())
    kv = ex["kvaware"].decision
    assert kv is not None and (kv["decoder"], kv["route"], kv["reason"]) == ("d2", "direct", "fully_cached")
    assert kv["candidates"][0]["cached_blocks"] == 2000 // BS
    rr = ex["roundrobin"].decision
    assert ex["roundrobin"].live and rr is not None and rr["decoder"] == "d0" and rr["route"] == DISAGGREGATED
    assert ex["prefixaware"].note and "empty" in ex["prefixaware"].note
    assert idx.worker_blocks("d2") == 2000 // BS


def test_failures_are_entries_not_exceptions() -> None:
    live = Router("session")
    ex = explain(live, RoutingRequest("x", token_ids=tokens(1, 10)), pool(0, 1), 0.0, ["session", "nope"])
    by = {e.strategy: e for e in ex}
    assert by["session"].decision is None and "no live decode workers" in (by["session"].error or "")
    assert "unknown routing strategy 'nope'" in (by["nope"].error or "")
