"""SLO-aware routing: the latency predictor, the ``slo`` strategy, ``Router.slo_estimate`` and SLO admission."""

from __future__ import annotations

import math
import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from splitserve.cache import PrefixIndex, hash_token_blocks
from splitserve.routing import (
    DECODE,
    CostModel,
    KvAwareStrategy,
    LatencyPredictor,
    Router,
    RoutingRequest,
    SloEstimate,
    SloStrategy,
    WorkerView,
)
from splitserve.routing.admission import (
    Admit,
    Refuse,
    SloAdmission,
    drain_rps,
    first_end_ms,
    free_now,
    queue_wait_for,
    queue_wait_ms,
    weighted_share,
)
from splitserve.routing.live import build_policies, live_disagg

BS = 16


def tokens(seed: int, n: int) -> list[int]:
    return [seed * 1_000_000 + i for i in range(n)]


# ---------------------------------------------------------------------------------------------- predictor


def test_predictor_converges_to_the_step_line_from_noisy_samples() -> None:
    rng = random.Random(1)
    p = LatencyPredictor()
    for t in range(600):
        seqs = rng.randint(1, 64)
        step = 20.0 + 1.5 * seqs + rng.gauss(0.0, 2.0)
        p.observe([WorkerView("d0", DECODE, active_seqs=seqs, step_ms=step)], float(t))
    a, b = p.step_fit("d0")
    assert a == pytest.approx(20.0, abs=2.5) and b == pytest.approx(1.5, abs=0.08)
    assert p.step_ms("d0", 40) == pytest.approx(80.0, rel=0.05)
    # a worker never heard of gets the pooled line (learned from d0), not the defaults
    assert p.step_ms("new", 40) == pytest.approx(80.0, rel=0.1)


def test_a_new_worker_borrows_the_pooled_slope_and_follows_its_own_level() -> None:
    p = LatencyPredictor()
    rng = random.Random(2)
    for t in range(300):
        for w in ("d0", "d1"):
            seqs = rng.randint(1, 64)
            p.observe([WorkerView(w, DECODE, active_seqs=seqs, step_ms=30.0 + 1.0 * seqs)], float(t))
    for t in range(40):  # a slower worker, only ever seen at batch 8
        p.observe([WorkerView("d2", DECODE, active_seqs=8, step_ms=60.0 + 0.01 * (t % 2))], 300.0 + t)
    assert p.step_ms("d2", 8) == pytest.approx(60.0, rel=0.05)
    assert p.step_fit("d2")[1] > 0.3  # the pool's slope, not an undetermined one


def test_observe_learns_from_a_view_only_when_it_changed() -> None:
    p = LatencyPredictor()
    v = WorkerView("d0", DECODE, active_seqs=4, step_ms=30.0)
    assert p.observe([v], 0.0) == 1
    for t in range(10):
        assert p.observe([v, WorkerView("d0", DECODE, active_seqs=4, step_ms=30.0)], float(t)) == 0
    assert p.samples == 1
    assert p.observe([WorkerView("d0", DECODE, active_seqs=5, step_ms=31.0)], 11.0) == 1
    assert p.samples == 2
    # an empty batch's (stale) step time teaches nothing about the line
    p.observe([WorkerView("d0", DECODE, active_seqs=0, step_ms=99.0)], 12.0)
    assert p.samples == 2


def test_memory_is_bounded_and_remove_worker_forgets() -> None:
    p = LatencyPredictor(max_workers=8)
    for i in range(50):
        p.observe([WorkerView(f"d{i}", DECODE, active_seqs=1, step_ms=30.0)], float(i))
    assert len(p) == 8 and "d49" in p.workers() and "d0" not in p.workers()
    p.remove_worker("d49")
    assert "d49" not in p.workers()


@settings(max_examples=60, deadline=None)
@given(q1=st.integers(0, 200_000), dq=st.integers(1, 200_000), prompt=st.integers(1, 32_000),
       cached=st.integers(0, 32_000), rate=st.one_of(st.none(), st.floats(10.0, 1e6)))
def test_ttft_grows_with_queued_tokens_and_shrinks_with_the_cached_prefix(
        q1: int, dq: int, prompt: int, cached: int, rate: float | None) -> None:
    p = LatencyPredictor()
    cached = min(cached, prompt)

    def ttft(queued: int, uncached: int) -> float:
        return p.ttft_ms(WorkerView("d0", DECODE, queued_prefill_tokens=queued, prefill_tokens_per_s=rate), uncached)

    assert ttft(q1 + dq, prompt) > ttft(q1, prompt)
    if cached:
        assert ttft(q1, prompt - cached) < ttft(q1, prompt)
    r = rate or 1000.0
    assert ttft(q1, prompt) == pytest.approx(1000.0 * (q1 + prompt) / r + p.step_ms("d0", 1), rel=1e-9)


def test_observed_outcomes_correct_a_worker_within_bounds() -> None:
    p = LatencyPredictor()
    v = WorkerView("d0", DECODE, queued_prefill_tokens=1000, prefill_tokens_per_s=1000.0)
    p.observe([v], 0.0)
    base = p.ttft_ms(v, 0)
    for _ in range(200):
        p.observe_outcome("d0", p.ttft_ms(v, 0), 2.0 * base)
    assert p.ttft_ms(v, 0) == pytest.approx(2.0 * base, rel=0.02)
    for _ in range(200):
        p.observe_outcome("d0", p.ttft_ms(v, 0), 1000.0 * base)
    assert p.correction("d0") == pytest.approx(p.config.correction_max)
    p.observe_outcome("unknown", 10.0, 20.0)  # ignored, not an error


# ---------------------------------------------------------------------------------------------- strategy


def _cached_pair(queued0: int = 0, active0: int = 0) -> tuple[PrefixIndex, RoutingRequest, list[WorkerView]]:
    """d0 holds the whole prompt (and has some load), d1 is cold but carries decode KV (so costs more)."""
    toks = tokens(1, 2048)
    idx = PrefixIndex()
    idx.store("d0", hash_token_blocks(toks, BS))
    ws = [WorkerView("d0", DECODE, queued_prefill_tokens=queued0, active_seqs=active0, prefill_tokens_per_s=1000.0),
          WorkerView("d1", DECODE, used_blocks=300, prefill_tokens_per_s=1000.0)]
    return idx, RoutingRequest("r", token_ids=toks), ws


def _select(idx: PrefixIndex, req: RoutingRequest, ws: list[WorkerView], ttft: float | None,
            itl: float | None) -> tuple[str, str, dict]:  # type: ignore[type-arg]
    req.ttft_slo_ms, req.itl_slo_ms = ttft, itl
    # (no imbalance guard: it would pick the least-loaded worker whatever the targets, as kvaware does)
    s = SloStrategy(index=idx, cost=CostModel(balance_abs_threshold=10_000)).select(req, ws, DECODE, 0.0, BS)
    return s.worker_id, s.reason, s.detail


def test_a_loaded_but_cached_worker_wins_only_while_it_meets_the_ttft_target() -> None:
    idx, req, ws = _cached_pair(queued0=5000)
    assert KvAwareStrategy(idx).select(req, ws, DECODE, 0.0, BS).worker_id == "d0"  # cheapest by cost
    # d0: 5,000 queued tokens at 1,000 tok/s (~5 s); d1: the 2,048-token prompt itself (~2 s)
    assert _select(idx, req, ws, 6000.0, None)[:2] == ("d0", "lowest_cost")
    wid, reason, detail = _select(idx, req, ws, 3000.0, None)
    assert (wid, reason) == ("d1", "slo_lowest_cost")
    slo = detail["slo"]
    assert slo["meeting"] == 1 and slo["met"] and slo["predicted_ttft_ms"] < 3000.0
    assert {c["worker"]: c["met"] for c in slo["candidates"]} == {"d0": False, "d1": True}


def test_a_loaded_but_cached_worker_wins_only_while_it_meets_the_itl_target() -> None:
    idx, req, ws = _cached_pair(active0=100)  # d0's batch: ~80 ms steps with the default line
    assert _select(idx, req, ws, 3000.0, 100.0)[0] == "d0"
    assert _select(idx, req, ws, 3000.0, 50.0)[:2] == ("d1", "slo_lowest_cost")


def test_when_nobody_meets_the_target_the_fastest_wins() -> None:
    idx, req, ws = _cached_pair(queued0=5000)
    wid, reason, detail = _select(idx, req, ws, 100.0, None)
    assert (wid, reason) == ("d1", "slo_unmet") and detail["slo"]["meeting"] == 0


@settings(max_examples=40, deadline=None)
@given(loads=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 20_000), st.integers(0, 500),
                                st.sampled_from([None, 500.0, 2000.0])), min_size=1, max_size=9),
       prompts=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 3000)), min_size=1, max_size=8))
def test_requests_without_targets_route_exactly_as_kvaware(
        loads: list[tuple[int, int, int, float | None]], prompts: list[tuple[int, int]]) -> None:
    idx = PrefixIndex()
    for i in range(0, len(loads), 2):
        idx.store(f"d{i}", hash_token_blocks(tokens(i % 3, 1024), BS))
    ws = [WorkerView(f"d{i}", DECODE, active_seqs=a, queued_prefill_tokens=q, used_blocks=u, prefill_tokens_per_s=r,
                     step_ms=20.0 + a)
          for i, (a, q, u, r) in enumerate(loads)]
    kv, slo = KvAwareStrategy(idx), SloStrategy(idx)
    for j, (seed, n) in enumerate(prompts):
        a = kv.select(RoutingRequest(f"r{j}", token_ids=tokens(seed, n)), ws, DECODE, 0.0, BS)
        b = slo.select(RoutingRequest(f"r{j}", token_ids=tokens(seed, n)), ws, DECODE, 0.0, BS)
        assert (a.worker_id, a.reason, a.view_index, [c.to_dict() for c in a.candidates]) == (
            b.worker_id, b.reason, b.view_index, [c.to_dict() for c in b.candidates])
        assert b.detail == {}


# ---------------------------------------------------------------------------------------------- router


def _pool(queued: tuple[int, ...] = (0, 0), prefillers: int = 1) -> list[WorkerView]:
    return [WorkerView(f"d{i}", DECODE, active_seqs=2, step_ms=25.0, queued_prefill_tokens=q,
                       prefill_tokens_per_s=2000.0) for i, q in enumerate(queued)] + [
        WorkerView(f"p{i}", "prefill", prefill_tokens_per_s=8000.0) for i in range(prefillers)]


def test_the_router_owns_one_predictor_that_learns_on_every_decision() -> None:
    r = Router("slo", disagg_threshold=512)
    assert r.strategy.predictor is r.predictor  # type: ignore[attr-defined]
    own = LatencyPredictor()
    assert Router(SloStrategy(), predictor=own).strategy.predictor is own  # type: ignore[attr-defined]
    r.decide(RoutingRequest("a", token_ids=tokens(1, 100)), _pool(), 0.0)
    assert r.predictor.samples == 2
    r.remove_worker("d0")
    assert "d0" not in r.predictor.workers()
    kv = Router("kvaware")
    kv.slo_estimate(RoutingRequest("a", token_ids=tokens(1, 100)), _pool(), 0.0)
    assert kv.predictor.samples == 2  # every policy learns, whatever its strategy


def test_slo_decisions_record_predictions_for_both_pools() -> None:
    r = Router("slo", disagg_threshold=512)
    d = r.decide(RoutingRequest("a", token_ids=tokens(1, 3000), ttft_slo_ms=5000.0, itl_slo_ms=100.0),
                 _pool((0, 4000), 2), 0.0)
    assert d.disaggregated and d.decoder == "d0"
    rec = d.to_dict()["detail"]
    assert rec["slo"]["met"] and rec["prefill"]["slo"]["predicted_ttft_ms"] > 3000 / 8000 * 1000
    assert rec["prefill"]["slo"]["itl_slo_ms"] is None  # a prefiller cannot change ITL


def test_slo_estimate_predicts_without_routing_anything() -> None:
    ws = _pool((6000, 0))
    a, b = Router("slo", disagg_threshold=512), Router("slo", disagg_threshold=512)
    short = RoutingRequest("s", token_ids=tokens(1, 200), ttft_slo_ms=500.0, itl_slo_ms=100.0)
    est = a.slo_estimate(short, ws, 0.0)
    assert isinstance(est, SloEstimate)
    assert (est.decoder, est.route, est.prefiller, est.met, est.candidates, est.meeting) == (
        "d1", "direct", None, True, 2, 1)
    assert est.ttft_ms == pytest.approx(1000.0 * 200 / 2000.0 + est.itl_ms)
    long = RoutingRequest("l", token_ids=tokens(2, 4000), ttft_slo_ms=100.0)
    est = a.slo_estimate(long, ws, 0.0)
    assert (est.route, est.prefiller, est.met) == ("disaggregated", "p0", False)
    assert est.ttft_ms == pytest.approx(1000.0 * 4000 / 8000.0 + est.itl_ms)
    # estimating leaves the pending ledger and tie-break rotation alone: both routers decide alike afterwards
    for i in range(6):
        req = RoutingRequest(f"r{i}", token_ids=tokens(10 + i, 100))
        assert a.decide(req, _pool(), float(i)).decoder == b.decide(
            RoutingRequest(f"r{i}", token_ids=tokens(10 + i, 100)), _pool(), float(i)).decoder
        a.slo_estimate(RoutingRequest("x", token_ids=tokens(99, 100)), _pool(), float(i))
    assert a.pending is not None and b.pending is not None and len(a.pending) == len(b.pending)


def test_the_estimate_counts_a_decoders_queue_and_full_kv() -> None:
    r = Router("kvaware", disagg_threshold=10_000)
    req = RoutingRequest("s", token_ids=tokens(1, 200), ttft_slo_ms=500.0)
    assert r.slo_estimate(req, _pool((4000, 4000), 0), 0.0).ttft_ms > 2000.0  # the queue ahead counts
    full = [WorkerView("d0", DECODE, total_blocks=100, free_blocks=2, queued_requests=3)]
    est = r.slo_estimate(req, full, 0.0)
    assert est.ttft_ms >= 4 * r.predictor.config.kv_wait_ms and est.met is False


def test_policy_sets_reach_each_models_estimate() -> None:
    disagg = live_disagg()
    table = build_policies("slo", disagg, PrefixIndex(), per_model={"big": ("slo", disagg)})
    req = RoutingRequest("s", token_ids=tokens(1, 200), ttft_slo_ms=500.0)
    assert table.slo_estimate(req, _pool(), 0.0, "big").decoder in {"d0", "d1"}
    assert table.predictor_of("big").samples == 2 and table.predictor.samples == 0
    table.observe_outcome("d0", 100.0, 150.0, "big")
    assert table.predictor_of("big").correction("d0") > 1.0


# ---------------------------------------------------------------------------------------------- admission


def _est(ttft: float, itl: float = 30.0) -> SloEstimate:
    return SloEstimate(ttft, itl, "d0")


def test_admission_admits_at_the_boundary_and_refuses_past_it_with_retry_after() -> None:
    adm = SloAdmission()
    assert isinstance(adm.check(_est(400.0), 500.0, 50.0, queue_wait_ms=100.0), Admit)
    v = adm.check(_est(400.0), 500.0, 50.0, queue_wait_ms=100.001)
    assert isinstance(v, Refuse) and (v.reason, v.retry_after_s) == ("ttft_unmeetable", 1)
    v = adm.check(_est(3000.0), 500.0, None)
    assert isinstance(v, Refuse) and v.retry_after_s == 3  # 2.5 s over: back in 3 s
    assert adm.check(_est(1e9), 500.0, None).retry_after_s == 60  # type: ignore[union-attr]
    assert adm.check(_est(100.0), 500.0, None, queue_wait_ms=math.inf).retry_after_s == 60  # type: ignore[union-attr]
    v = adm.check(_est(100.0, itl=80.0), 500.0, 50.0)
    assert isinstance(v, Refuse) and v.reason == "itl_unmeetable" and v.retry_after_s == 5
    assert adm.check(_est(1e9, 1e9), None, None) == Admit("no_targets")
    assert isinstance(SloAdmission(slack=1.5).check(_est(700.0), 500.0, None), Admit)
    with pytest.raises(ValueError):
        SloAdmission(slack=0.0)


@settings(max_examples=80, deadline=None)
@given(ttft=st.floats(0.0, 1e6), wait=st.floats(0.0, 1e6), target=st.floats(1.0, 1e5))
def test_admission_refuses_exactly_what_would_be_late(ttft: float, wait: float, target: float) -> None:
    v = SloAdmission().check(_est(ttft), target, None, wait)
    assert v.admitted == (ttft + wait <= target)
    if isinstance(v, Refuse):
        assert 1 <= v.retry_after_s <= 60 and v.retry_after_s >= min(60, math.ceil((ttft + wait - target) / 1000))


def test_queue_wait_from_what_is_ahead_and_the_dispatch_rate() -> None:
    assert queue_wait_ms(0, None) == 0.0
    assert queue_wait_ms(10, 5.0) == pytest.approx(2000.0)
    assert queue_wait_ms(10, 5.0, share=0.5) == pytest.approx(4000.0)
    assert queue_wait_ms(1, 100.0, ahead_prompt_tokens=50_000, prefill_tokens_per_s=10_000.0) == pytest.approx(5000.0)
    assert queue_wait_ms(3, 0.0) == math.inf and queue_wait_ms(3, None) == math.inf


def test_the_queue_drains_at_the_decoders_pace_for_the_tenants_share() -> None:
    """Two decoders of 16 slots at 10 + 2/seq ms a step: a 50-token request takes 50 x 42 ms = 2.1 s at a full
    batch, so together they finish 32 / 2.1 s = 15.2 requests/s; a tenant with a third of the weight waiting gets a
    third of that, unless it was measured faster."""
    pred = LatencyPredictor(prior_weight=1e-6, default_weight=1e-6)
    for wid in ("d0", "d1"):
        for n in range(1, 17):
            pred.observe([WorkerView(wid, active_seqs=n, step_ms=10.0 + 2.0 * n, max_seqs=16)], float(n))
    views = [WorkerView("d0", max_seqs=16), WorkerView("d1", max_seqs=16), WorkerView("p0", role="prefill"),
             WorkerView("d2")]  # a prefiller and a decoder of unknown batch size add nothing
    assert drain_rps(views, pred, 50, 1.0) == pytest.approx(32 / 2.1, rel=0.02)
    share = weighted_share("a", {"a": 3, "b": 5, "idle": 0}, {"a": 1.0, "b": 2.0, "idle": 5.0}.__getitem__)
    assert share == pytest.approx(1 / 3)
    assert drain_rps(views, pred, 50, share) == pytest.approx(32 / 2.1 / 3, rel=0.02)
    assert drain_rps(views, pred, 50, share, measured_rps=9.0) == 9.0
    assert drain_rps([WorkerView("d2")], pred, 50, 1.0) == 0.0  # nothing known: the caller does not guess


def test_a_request_behind_a_full_batch_waits_for_the_first_to_end() -> None:
    """free_now: the ledger's free slots (20 on an idle 16-slot decoder: it overfills by 4) within the batch (16);
    one dispatched that the heartbeat does not show yet leaves 15. first_end_ms: a request that must wait for a
    slot waits until the running one with the fewest tokens left ends (at the decoder's predicted ITL)."""
    idle = [WorkerView("d0", max_seqs=16), WorkerView("p0", role="prefill")]
    assert free_now(idle, 20) == 16 and free_now(idle, 19) == 15 and free_now(idle, 2) == 0
    assert free_now([WorkerView("d0", max_seqs=16, active_seqs=10, waiting=2)], 20) == 4
    assert free_now([WorkerView("d9")], 7) == 7  # a batch size nobody reported: the ledger says
    pred = LatencyPredictor(prior_weight=1e-6, default_weight=1e-6)
    for n in range(1, 17):
        pred.observe([WorkerView("d0", active_seqs=n, step_ms=10.0 + 2.0 * n, max_seqs=16)], float(n))
    views = [WorkerView("d0", max_seqs=16, active_seqs=16)]
    assert first_end_ms([("d0", 60), ("d0", 5), ("gone", 1), ("d0", 0)], views, pred) == pytest.approx(5 * 42.0,
                                                                                                      rel=0.02)
    assert first_end_ms([], views, pred) == 0.0


def test_the_request_one_past_the_free_slots_waits_for_a_slot() -> None:
    """An idle 16-slot decoder and 16 of the tenant's requests ahead: they take every slot, so this one waits for
    the first of them to end, at the full batch's pace (it was counted as starting at once, and one request past a
    burst was admitted a whole batch late: 2.6 s against a 400 ms target). 15 ahead: its slot is free, no wait."""
    pred = LatencyPredictor(prior_weight=1e-6, default_weight=1e-6)
    for n in range(1, 17):
        pred.observe([WorkerView("d0", active_seqs=n, step_ms=10.0 + 2.0 * n, max_seqs=16)], float(n))
    views = [WorkerView("d0", max_seqs=16)]

    def wait(before: int) -> float:
        return queue_wait_for(before, 20, views, pred, 60, 1.0, 0.0, [], "d0")

    assert wait(0) == 0.0 and wait(15) == 0.0
    # the first of the 16 ahead ends: 60 tokens at a full batch's step (42 ms), not at the idle step the decoder's
    # view still shows (10 ms: 600 ms, which a target between the two would have admitted late)
    assert wait(16) == pytest.approx(60 * 42.0, rel=0.02)
    assert wait(17) >= wait(16)
