"""Each strategy's behaviour, the shared cost's guard and tie-breaking, and the registry."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from splitserve.cache import PrefixIndex, hash_token_blocks
from splitserve.routing import (
    CostConfig,
    CostModel,
    HashRing,
    KvAwareStrategy,
    PrefixAwareStrategy,
    RoundRobinStrategy,
    Router,
    RoutingRequest,
    SessionStrategy,
    WorkerView,
    available,
    make_strategy,
)

BS = 16


def decoders(n: int, **kw: int) -> list[WorkerView]:
    return [WorkerView(f"d{i}", "decode", **kw) for i in range(n)]


def req(rid: str, tokens: list[int], session: str | None = None, tenant: str = "t") -> RoutingRequest:
    return RoutingRequest(rid, tenant=tenant, token_ids=tokens, session_key=session)


def prompt(seed: int, n: int = 64 * BS) -> list[int]:
    return [seed * 100_000 + i for i in range(n)]


# ---------------------------------------------------------------------------------------------- roundrobin


def test_roundrobin_is_fair_and_order_independent() -> None:
    rr = RoundRobinStrategy()
    ws = decoders(5)
    picks = [
        rr.select(req(str(i), []), list(reversed(ws)) if i % 2 else ws, "decode", 0.0, BS).worker_id
        for i in range(500)
    ]
    assert Counter(picks) == {f"d{i}": 100 for i in range(5)}
    assert picks[:5] == ["d0", "d1", "d2", "d3", "d4"]


def test_roundrobin_pools_rotate_independently() -> None:
    rr = RoundRobinStrategy()
    d, p = decoders(2), [WorkerView("p0", "prefill"), WorkerView("p1", "prefill")]
    assert rr.select(req("a", []), d, "decode", 0, BS).worker_id == "d0"
    assert rr.select(req("a", []), p, "prefill", 0, BS).worker_id == "p0"
    assert rr.select(req("b", []), d, "decode", 0, BS).worker_id == "d1"


# ---------------------------------------------------------------------------------------------- session


def test_session_is_sticky_and_scoped_by_tenant() -> None:
    s = SessionStrategy()
    ws = decoders(8)
    first = {k: s.select(req("x", [], f"sess-{k}"), ws, "decode", 0, BS).worker_id for k in range(50)}
    for _ in range(3):
        for k in range(50):
            sel = s.select(req("y", [], f"sess-{k}"), ws, "decode", 1.0, BS)
            assert sel.worker_id == first[k] and sel.reason == "session_sticky"
    assert len(set(first.values())) > 4  # keys spread over the ring
    other = {
        k: s.select(req("x", [], f"sess-{k}", tenant="u"), ws, "decode", 0, BS).worker_id for k in range(50)
    }
    assert other != first


def test_session_without_key_falls_back_to_load() -> None:
    s = SessionStrategy()
    ws = [WorkerView("d0", "decode", used_blocks=500), WorkerView("d1", "decode", used_blocks=10)]
    sel = s.select(req("x", prompt(1)), ws, "decode", 0, BS)
    assert sel.worker_id == "d1" and sel.reason.startswith("no_session_key")


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=12),
    vnodes=st.sampled_from([16, 64, 160]),
    keys=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=200, unique=True),
)
def test_ring_adding_a_worker_moves_only_keys_to_it(n: int, vnodes: int, keys: list[str]) -> None:
    before = HashRing([f"w{i}" for i in range(n)], vnodes)
    after = HashRing([f"w{i}" for i in range(n + 1)], vnodes)
    for k in keys:
        a, b = before.owner(k), after.owner(k)
        assert a == b or b == f"w{n}"


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=12),
    gone=st.integers(min_value=0, max_value=11),
    keys=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=200, unique=True),
)
def test_ring_removing_a_worker_moves_only_its_keys(n: int, gone: int, keys: list[str]) -> None:
    gone %= n
    ids = [f"w{i}" for i in range(n)]
    before = HashRing(ids)
    after = HashRing([w for w in ids if w != f"w{gone}"])
    for k in keys:
        a, b = before.owner(k), after.owner(k)
        assert a == b or a == f"w{gone}"


def test_ring_remap_share_is_about_one_over_n() -> None:
    keys = [f"session-{i}" for i in range(20_000)]
    before, after = HashRing([f"w{i}" for i in range(10)]), HashRing([f"w{i}" for i in range(11)])
    moved = sum(before.owner(k) != after.owner(k) for k in keys) / len(keys)
    assert 0.05 < moved < 0.14  # ideal 1/11 = 0.091
    share = Counter(after.owner(k) for k in keys)
    assert max(share.values()) / min(share.values()) < 1.6  # 160 vnodes keep shares within a narrow band


# ---------------------------------------------------------------------------------------------- prefixaware


def test_prefixaware_sends_a_repeated_prefix_to_the_same_worker() -> None:
    router = Router("prefixaware", disagg_threshold=10**9)
    ws = decoders(4)
    first = router.decide(req("a", prompt(7)), ws, 0.0)
    again = [router.decide(req(f"b{i}", prompt(7) + [1, 2, 3] * i), ws, float(i)) for i in range(1, 6)]
    assert all(d.decoder == first.decoder for d in again)
    assert all(d.cached_tokens == 64 * BS for d in again)
    other = router.decide(req("c", prompt(8)), ws, 9.0)
    assert other.cached_tokens == 0


def test_prefixaware_evicts_lru_beyond_capacity() -> None:
    pa = PrefixAwareStrategy(capacity_blocks=100, use_reported_capacity=False)
    ws = decoders(1)
    hashes = [hash_token_blocks(prompt(k), BS) for k in range(4)]  # 64 blocks each
    pa.record("d0", hashes[0])
    pa.record("d0", hashes[1])  # 128 > 100: the oldest 28 blocks (tail of prompt 0) go
    assert pa.tracked_blocks("d0") == 100
    assert pa.tree.lookup(hashes[0]) == {"d0": 36}
    assert pa.tree.lookup(hashes[1]) == {"d0": 64}
    pa.record("d0", hashes[2])
    assert pa.tree.lookup(hashes[0]) == {}
    assert pa.evicted_blocks == 92
    sel = pa.select(RoutingRequest("q", block_hashes=hashes[2], prompt_tokens=64 * BS), ws, "decode", 0, BS)
    assert sel.chosen.cached_blocks == 64


def test_prefixaware_uses_reported_pool_size() -> None:
    pa = PrefixAwareStrategy(capacity_blocks=10_000)
    ws = [WorkerView("d0", "decode", total_blocks=50, free_blocks=50)]
    pa.select(req("a", prompt(1)), ws, "decode", 0, BS)
    pa.record("d0", hash_token_blocks(prompt(1), BS))
    assert pa.tracked_blocks("d0") == 50


def test_prefixaware_forgets_removed_worker() -> None:
    router = Router("prefixaware", disagg_threshold=10**9)
    ws = decoders(2)
    d = router.decide(req("a", prompt(3)), ws, 0.0)
    router.remove_worker(d.decoder)
    assert router.decide(req("b", prompt(3)), ws, 1.0).cached_tokens == 0


# ---------------------------------------------------------------------------------------------- kvaware


def test_kvaware_picks_the_worker_holding_the_prefix() -> None:
    idx = PrefixIndex()
    toks = prompt(5)
    hs = hash_token_blocks(toks, BS)
    idx.store("d2", hs[:40])
    idx.store("d1", hs[:10])
    router = Router("kvaware", index=idx, disagg_threshold=10**9)
    d = router.decide(req("a", toks), decoders(4), 0.0)
    assert d.decoder == "d2" and d.cached_tokens == 40 * BS and d.decoder_reason == "lowest_cost"
    assert [c.worker_id for c in d.candidates][:2] == ["d2", "d1"]


def test_kvaware_credits_cpu_tier_partially() -> None:
    idx = PrefixIndex()
    hs = hash_token_blocks(prompt(5), BS)
    idx.store("d0", hs[:40], "cpu")  # whole prefix, but only in host memory
    idx.store("d1", hs[:30], "gpu")
    kv = KvAwareStrategy(idx, CostModel(cpu_tier_weight=0.5))
    sel = kv.select(req("a", prompt(5)), decoders(2), "decode", 0, BS)
    assert sel.worker_id == "d1"  # 30 fast blocks beat 40 slow ones worth 20
    kv_full = KvAwareStrategy(idx, CostModel(cpu_tier_weight=1.0))
    assert kv_full.select(req("a", prompt(5)), decoders(2), "decode", 0, BS).worker_id == "d0"


def test_kvaware_with_empty_index_is_load_aware() -> None:
    ws = [WorkerView("d0", "decode", queued_prefill_tokens=5000), WorkerView("d1", "decode")]
    sel = KvAwareStrategy().select(req("a", prompt(1)), ws, "decode", 0, BS)
    assert sel.worker_id == "d1"


def test_kvaware_queue_outweighs_a_small_hit() -> None:
    idx = PrefixIndex()
    hs = hash_token_blocks(prompt(5), BS)
    idx.store("d0", hs[:4])  # 64 tokens cached...
    ws = [WorkerView("d0", "decode", queued_prefill_tokens=20_000), WorkerView("d1", "decode")]
    assert KvAwareStrategy(idx).select(req("a", prompt(5)), ws, "decode", 0, BS).worker_id == "d1"


# ---------------------------------------------------------------------------------------------- cost


def test_imbalance_guard_overrides_affinity() -> None:
    idx = PrefixIndex()
    hs = hash_token_blocks(prompt(5), BS)
    idx.store("d0", hs)
    hot = WorkerView("d0", "decode", active_seqs=60)
    ws = [hot, WorkerView("d1", "decode", active_seqs=2), WorkerView("d2", "decode", active_seqs=20)]
    sel = KvAwareStrategy(idx).select(req("a", prompt(5)), ws, "decode", 0, BS)
    assert sel.worker_id == "d1" and sel.reason == "imbalance_guard"
    # Within the thresholds affinity wins again.
    ws[0] = WorkerView("d0", "decode", active_seqs=30)
    sel = KvAwareStrategy(idx).select(req("a", prompt(5)), ws, "decode", 0, BS)
    assert sel.worker_id == "d0" and sel.reason == "lowest_cost"


def test_guard_thresholds_follow_sglang_rule() -> None:
    cm = CostModel(balance_abs_threshold=32, balance_rel_threshold=1.1)
    ws = [WorkerView("a", active_seqs=400), WorkerView("b", active_seqs=370)]  # diff 30: balanced
    assert not cm.imbalanced(cm.score(ws, 100, BS))
    ws = [WorkerView("a", active_seqs=400), WorkerView("b", active_seqs=367)]  # diff 33 but 400 < 1.1*367
    assert not cm.imbalanced(cm.score(ws, 100, BS))
    ws = [WorkerView("a", active_seqs=40), WorkerView("b", active_seqs=7)]
    assert cm.imbalanced(cm.score(ws, 100, BS))


def test_ties_rotate_fairly() -> None:
    router = Router("kvaware", disagg_threshold=10**9)
    ws = decoders(4)
    picks = Counter(router.decide(req(str(i), prompt(i)), ws, float(i)).decoder for i in range(400))
    assert picks == {f"d{i}": 100 for i in range(4)}


def test_ties_random_is_seeded() -> None:
    def run(seed: int) -> list[str]:
        cm = CostModel(tie_break="random", seed=seed)
        return [cm.choose(cm.score(decoders(5), 100, BS), "decode").worker_id for _ in range(50)]

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert len(set(run(1))) == 5


def test_softmax_sampling_is_seeded_and_prefers_cheap() -> None:
    ws = [
        WorkerView("cheap", used_blocks=0),
        WorkerView("mid", used_blocks=50),
        WorkerView("dear", used_blocks=100),
    ]

    def run(seed: int) -> Counter[str]:
        cm = CostModel(temperature=0.3, seed=seed)
        return Counter(cm.choose(cm.score(ws, 100, BS), "decode").worker_id for _ in range(2000))

    a = run(7)
    assert a == run(7)
    assert a["cheap"] > a["mid"] > a["dear"] > 0


def test_memory_overflow_is_penalised() -> None:
    ws = [
        WorkerView("full", free_blocks=2, total_blocks=1000),
        WorkerView("roomy", used_blocks=40, free_blocks=900, total_blocks=1000),
    ]
    cm = CostModel()
    scores = cm.score(ws, 64 * BS, BS)
    scored = {c.worker_id: c for c in scores.candidates()}
    assert scored["full"].cost > scored["roomy"].cost
    assert cm.choose(scores, "decode").worker_id == "roomy"


def test_faster_worker_is_preferred_for_equal_queues() -> None:
    ws = [
        WorkerView("slow", queued_prefill_tokens=4000, prefill_tokens_per_s=1000),
        WorkerView("fast", queued_prefill_tokens=6000, prefill_tokens_per_s=4000),
    ]
    cm = CostModel()
    assert cm.choose(cm.score(ws, 1000, BS), "decode").worker_id == "fast"


@settings(max_examples=100, deadline=None)
@given(
    loads=st.lists(
        st.tuples(st.integers(0, 50), st.integers(0, 50_000), st.integers(0, 5000)), min_size=1, max_size=10
    ),
    cached=st.lists(st.integers(0, 80), min_size=10, max_size=10),
    prompt_tokens=st.integers(0, 2000),
)
def test_choice_is_a_minimum_cost_candidate_unless_guarded(
    loads: list[tuple[int, int, int]], cached: list[int], prompt_tokens: int
) -> None:
    ws = [
        WorkerView(f"w{i}", active_seqs=a, queued_prefill_tokens=q, used_blocks=u)
        for i, (a, q, u) in enumerate(loads)
    ]
    cm = CostModel()
    scores = cm.score(ws, prompt_tokens, BS, {f"w{i}": c for i, c in enumerate(cached)})
    scored = scores.candidates()
    sel = cm.choose(scores, "decode")
    if sel.reason == "imbalance_guard":
        assert sel.chosen.load == min(c.load for c in scored)
    else:
        assert sel.chosen.cost == pytest.approx(min(c.cost for c in scored))
    for c in scored:
        assert c.cost >= 0 and 0 <= c.uncached_tokens <= prompt_tokens
    assert sel.candidates[0] is sel.chosen and len(sel.candidates) <= cm.config.max_recorded


# ---------------------------------------------------------------------------------------------- registry


def test_registry_builds_every_strategy() -> None:
    assert available() == ["kvaware", "prefixaware", "roundrobin", "session", "slo"]
    assert make_strategy("session", vnodes=8, temperature=0.5).config()["temperature"] == 0.5
    assert isinstance(make_strategy("kvaware", index=PrefixIndex()), KvAwareStrategy)
    with pytest.raises(ValueError, match="unknown routing strategy"):
        make_strategy("nope")
    with pytest.raises(ValueError):
        make_strategy("roundrobin", temperature=1.0)
    with pytest.raises(ValueError):
        CostConfig(tie_break="first")


def test_kvaware_lookup_memo_follows_index_changes() -> None:
    idx = PrefixIndex()
    kv = KvAwareStrategy(idx)
    r = req("a", prompt(5))
    assert kv.select(r, decoders(2), "decode", 0, BS).chosen.cached_blocks == 0
    idx.store("d1", r.hashes(BS)[:10])
    sel = kv.select(r, decoders(2), "decode", 0, BS)  # same request object, newer index
    assert sel.worker_id == "d1" and sel.chosen.cached_blocks == 10
