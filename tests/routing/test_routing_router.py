"""Router.decide end to end over pure objects: pools, routes, prefiller choice, records, failures."""

from __future__ import annotations

import json

import pytest

from splitserve.cache import PrefixIndex, batch, hash_token_blocks, stored
from splitserve.routing import (
    DIRECT,
    DISAGGREGATED,
    DisaggPolicy,
    NoWorkers,
    RoundRobinStrategy,
    Router,
    RoutingRequest,
    WorkerView,
    available,
)

BS = 16


def pool(nd: int = 3, np_: int = 2) -> list[WorkerView]:
    return [WorkerView(f"d{i}", "decode") for i in range(nd)] + [
        WorkerView(f"p{i}", "prefill") for i in range(np_)
    ]


def tokens(seed: int, n: int) -> list[int]:
    return [seed * 1_000_000 + i for i in range(n)]


def test_no_decoders_raises_typed_error() -> None:
    with pytest.raises(NoWorkers) as exc:
        Router("roundrobin").decide(RoutingRequest("r", token_ids=tokens(1, 10)), pool(0, 2), 0.0)
    assert exc.value.role == "decode"
    dead = [WorkerView("d0", "decode", live=False)]
    with pytest.raises(NoWorkers):
        Router("kvaware").decide(RoutingRequest("r", token_ids=tokens(1, 10)), dead, 0.0)


def test_pools_are_separate_and_dead_workers_ignored() -> None:
    ws = pool(2, 2) + [WorkerView("d9", "decode", live=False), WorkerView("r0", "router")]
    router = Router("roundrobin", disagg_threshold=0)
    seen_d, seen_p = set(), set()
    for i in range(20):
        d = router.decide(RoutingRequest(str(i), token_ids=tokens(i, 100)), ws, float(i))
        assert d.route == DISAGGREGATED
        seen_d.add(d.decoder)
        seen_p.add(d.prefiller)
    assert seen_d == {"d0", "d1"} and seen_p == {"p0", "p1"}


@pytest.mark.parametrize("strategy", available())
def test_every_strategy_routes_short_direct_and_long_disaggregated(strategy: str) -> None:
    router = Router(strategy, disagg_threshold=512)
    short = router.decide(RoutingRequest("s", token_ids=tokens(1, 100), session_key="k"), pool(), 0.0)
    long = router.decide(RoutingRequest("l", token_ids=tokens(2, 3000), session_key="k"), pool(), 1.0)
    assert (short.route, short.prefiller, short.reason) == (DIRECT, None, "short_uncached")
    assert long.route == DISAGGREGATED and long.prefiller in {"p0", "p1"} and long.reason == "long_uncached"
    for d in (short, long):
        rec = json.loads(json.dumps(d.to_dict()))
        assert rec["strategy"] == strategy and rec["decoder"] == d.decoder
        assert rec["candidates"][0]["worker"] == d.decoder


def test_cached_prefix_on_decoder_makes_a_long_prompt_direct() -> None:
    idx = PrefixIndex()
    toks = tokens(3, 3000)
    hs = hash_token_blocks(toks, BS)
    idx.apply(batch("d1", 0, ts_ms=0.0, events=[stored(hs[:180], block_size=BS)]))  # 2880 of 3000 cached
    router = Router("kvaware", index=idx, disagg_threshold=512)
    d = router.decide(RoutingRequest("r", token_ids=toks), pool(), 0.0)
    assert (d.decoder, d.route, d.reason) == ("d1", DIRECT, "short_uncached")
    assert (d.cached_tokens, d.uncached_tokens) == (2880, 120)


def test_cache_blind_strategy_still_uses_the_index_for_the_route() -> None:
    idx = PrefixIndex()
    toks = tokens(4, 3000)
    idx.store("d0", hash_token_blocks(toks, BS))
    router = Router("roundrobin", index=idx)
    d = router.decide(RoutingRequest("r", token_ids=toks), pool(), 0.0)  # roundrobin starts at d0
    assert d.decoder == "d0" and d.route == DIRECT and d.cached_tokens == 3000 - 3000 % BS


def test_prefiller_chosen_by_cache_and_load() -> None:
    idx = PrefixIndex()
    toks = tokens(5, 4000)
    idx.store("p1", hash_token_blocks(toks, BS)[:200])
    ws = pool(2, 3)
    router = Router("kvaware", index=idx, disagg_threshold=512)
    d = router.decide(RoutingRequest("r", token_ids=toks), ws, 0.0)
    assert d.route == DISAGGREGATED and d.prefiller == "p1"
    assert d.prefill_candidates[0].worker_id == "p1" and d.prefill_candidates[0].cached_blocks == 200
    ws = [w if w.worker_id != "p1" else WorkerView("p1", "prefill", queued_prefill_tokens=50_000) for w in ws]
    d = router.decide(RoutingRequest("r2", token_ids=toks), ws, 1.0)
    assert d.prefiller != "p1"


def test_require_prefiller() -> None:
    router = Router("roundrobin", require_prefiller=True)
    with pytest.raises(NoWorkers) as exc:
        router.decide(RoutingRequest("r", token_ids=tokens(1, 5000)), pool(2, 0), 0.0)
    assert exc.value.role == "prefill"
    # A request that would go direct anyway does not need one.
    assert router.decide(RoutingRequest("r", token_ids=tokens(1, 50)), pool(2, 0), 0.0).route == DIRECT
    lenient = Router("roundrobin").decide(RoutingRequest("r", token_ids=tokens(1, 5000)), pool(2, 0), 0.0)
    assert (lenient.route, lenient.reason) == (DIRECT, "no_prefillers")


def test_stall_rule_through_the_router() -> None:
    ws = [WorkerView("d0", "decode", active_seqs=3, prefill_tokens_per_s=800.0), WorkerView("p0", "prefill")]
    router = Router("roundrobin", disagg=DisaggPolicy(min_uncached_tokens=2048, max_stall_ms=250))
    d = router.decide(RoutingRequest("r", token_ids=tokens(1, 1000)), ws, 0.0)
    assert (d.route, d.reason) == (DISAGGREGATED, "would_stall")
    assert d.thresholds["stall_ms"] == 1250.0


def test_prefixaware_learns_both_ends_of_a_disaggregated_request() -> None:
    router = Router("prefixaware", disagg_threshold=512)
    toks = tokens(6, 2000)
    first = router.decide(RoutingRequest("a", token_ids=toks), pool(), 0.0)
    assert first.route == DISAGGREGATED
    again = router.decide(RoutingRequest("b", token_ids=toks + [1] * 40), pool(), 1.0)
    assert again.decoder == first.decoder and again.route == DIRECT  # 40 uncached tokens


def test_observe_false_leaves_strategy_state_alone() -> None:
    router = Router("prefixaware", observe=False)
    toks = tokens(7, 2000)
    router.decide(RoutingRequest("a", token_ids=toks), pool(), 0.0)
    assert router.decide(RoutingRequest("b", token_ids=toks), pool(), 1.0).cached_tokens == 0


def test_service_style_construction_and_views() -> None:
    # The live router service builds the policy and the views exactly like this.
    router = Router(strategy="roundrobin", disagg_threshold=512)
    views = [
        WorkerView(
            worker_id="d0",
            role="decode",
            live=True,
            active_seqs=1,
            queued_prefill_tokens=0,
            free_blocks=100,
            total_blocks=200,
            used_blocks=100,
        )
    ]
    d = router.decide(
        RoutingRequest(request_id="r", tenant="acme", token_ids=tokens(1, 64), session_key=None), views, 12.5
    )
    assert (d.decoder, d.prefiller, d.route) == ("d0", None, "direct")
    assert d.to_dict()["now"] == 12.5


def test_router_validates_arguments() -> None:
    with pytest.raises(ValueError):
        Router("kvaware", disagg=DisaggPolicy(), disagg_threshold=5)
    with pytest.raises(ValueError):
        Router(RoundRobinStrategy(), temperature=1.0)
    with pytest.raises(ValueError):
        Router("kvaware", block_size=0)


def test_apply_events_feeds_the_replica() -> None:
    router = Router("kvaware")
    toks = tokens(8, 1024)
    hs = hash_token_blocks(toks, BS)
    assert router.apply_events(batch("d2", 0, ts_ms=0.0, events=[stored(hs, block_size=BS)])) is False
    assert router.decide(RoutingRequest("r", token_ids=toks), pool(), 0.0).decoder == "d2"
    assert router.apply_events(batch("d2", 5, ts_ms=0.0, events=[])) is True
    router.remove_worker("d2")
    assert router.decide(RoutingRequest("r2", token_ids=toks), pool(), 1.0).cached_tokens == 0


def test_block_hashes_given_directly() -> None:
    idx = PrefixIndex()
    idx.store("d1", [11, 12, 13])
    router = Router("kvaware", index=idx, block_size=512, disagg_threshold=1024)
    d = router.decide(RoutingRequest("r", block_hashes=[11, 12, 13, 14], prompt_tokens=2000), pool(), 0.0)
    assert (d.decoder, d.cached_tokens, d.uncached_tokens, d.route) == ("d1", 1536, 464, DIRECT)


def test_hashes_follow_salt() -> None:
    toks = tokens(9, 512)
    a = RoutingRequest("a", token_ids=toks, cache_salt="tenant-a")
    b = RoutingRequest("b", token_ids=toks)
    assert a.hashes(BS) != b.hashes(BS) and a.hashes(BS) is a.hashes(BS)
    assert len(a.hashes(32)) == 16  # another block size re-hashes


def test_pending_load_spreads_a_burst_between_heartbeats() -> None:
    # d0 looks slightly cheaper in the (stale) heartbeat views; a burst must not all land on it.
    ws = [
        WorkerView("d0", "decode", queued_prefill_tokens=0),
        WorkerView("d1", "decode", queued_prefill_tokens=300),
        WorkerView("d2", "decode", queued_prefill_tokens=600),
    ]
    herd = Router("kvaware", disagg_threshold=10**9, pending_ttl_s=None)
    assert {
        herd.decide(RoutingRequest(str(i), token_ids=tokens(i, 400)), ws, 0.01 * i).decoder for i in range(12)
    } == {"d0"}
    router = Router("kvaware", disagg_threshold=10**9, pending_ttl_s=1.0)
    picks = [
        router.decide(RoutingRequest(str(i), token_ids=tokens(i, 400)), ws, 0.01 * i).decoder
        for i in range(12)
    ]
    assert set(picks) == {"d0", "d1", "d2"}
    assert router.pending is not None and router.pending.pending_for("d0")[0] == picks.count("d0")
    # Released requests stop counting; after the TTL everything has expired.
    for i in range(12):
        router.release(str(i))
    assert router.pending.pending_for("d0") == (0, 0, 0)
    router.decide(RoutingRequest("x", token_ids=tokens(99, 400)), ws, 5.0)
    router.decide(RoutingRequest("y", token_ids=tokens(98, 400)), ws, 7.0)
    assert len(router.pending) == 1


def test_pending_load_counts_prefill_on_the_prefiller() -> None:
    router = Router("roundrobin", disagg_threshold=100)
    d = router.decide(RoutingRequest("r", token_ids=tokens(1, 1000)), pool(1, 1), 0.0)
    assert d.route == DISAGGREGATED and router.pending is not None
    assert router.pending.pending_for("p0") == (1, 1000, 0)
    assert router.pending.pending_for("d0") == (1, 0, -(-1000 // BS))
    router.remove_worker("p0")
    assert router.pending.pending_for("p0") == (0, 0, 0)


def test_pending_release_is_per_worker() -> None:
    # The decoder's heartbeat (its KV reservation) lists a disaggregated request long before the prefiller's
    # next one shows the prefill: releasing both then made a busy prefiller look idle to the next request.
    router = Router("kvaware", disagg_threshold=100)
    d = router.decide(RoutingRequest("long", token_ids=tokens(1, 3000)), pool(1, 2), 0.0)
    busy = d.prefiller
    assert busy is not None and router.pending is not None
    router.release("long", "d0")
    assert router.pending.pending_for(busy) == (1, 3000, 0)
    assert router.pending.pending_for("d0") == (0, 0, 0)
    for i in range(3):
        nxt = router.decide(RoutingRequest(f"s{i}", token_ids=tokens(2 + i, 200)), pool(1, 2), 0.1)
        assert nxt.prefiller != busy, nxt.prefill_candidates
    router.release("long", busy)
    assert router.pending.pending_for(busy) == (0, 0, 0)
    assert len(router.pending) == 3


def test_pending_load_book() -> None:
    from splitserve.routing import PendingLoad

    book = PendingLoad(ttl_s=1.0)
    book.add("a", "r1", 100, 5, now=0.0)
    book.add("a", "r2", 50, 2, now=0.5)
    book.add("b", "r2", 50, 0, now=0.5)
    assert book.pending_for("a") == (2, 150, 7)
    views = [
        WorkerView("a", "decode", active_seqs=1, free_blocks=6, total_blocks=10),
        WorkerView("c", "decode"),
    ]
    over = book.overlay(views, now=0.9)
    assert over[0].active_seqs == 3 and over[0].queued_prefill_tokens == 150 and over[0].free_blocks == 0
    assert over[1] is views[1]
    book.expire(1.0)  # r1 is a second old
    assert book.pending_for("a") == (1, 50, 2) and len(book) == 1
    book.release("r2")
    assert book.pending_for("a") == (0, 0, 0) and book.pending_for("b") == (0, 0, 0) and len(book) == 0
    assert book.overlay(views, now=2.0) is views
    with pytest.raises(ValueError):
        PendingLoad(ttl_s=0)


def test_policy_layer_imports_nothing_heavy() -> None:
    import subprocess
    import sys

    code = (
        "import sys, splitserve.cache, splitserve.routing\n"
        "heavy = {'asyncio', 'nats', 'torch', 'transformers', 'vllm', 'nixl'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
