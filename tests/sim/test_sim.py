"""Unit tests of the simulator's parts and of whole small runs (pure Python, fast)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.cache.events import BlockRemoved, BlockStored, batch
from splitserve.cache.index import PrefixIndex
from splitserve.sim import (
    SimConfig,
    SimRequest,
    SimResult,
    WorkloadError,
    distserve,
    load_azure,
    load_mooncake,
    load_sharegpt,
    scale_rate,
    simulate,
    splitwise,
    synthetic,
)
from splitserve.sim.clock import EventLoop
from splitserve.sim.fabric import fabric, model_spec
from splitserve.sim.latency import StepFit, calibrated
from splitserve.sim.workers import PrefixCache

FLAT = StepFit("flat", (10.0, 0.1, 0.0), (20.0, 0.0, 1.0))  # prefill 10 ms + 0.1 ms/token; decode 20 ms + 1 ms/seq


def cpu_cfg(**kw: object) -> SimConfig:
    base = SimConfig(prefill=1, decode=1, model="smollm2-135m", prefill_latency=FLAT, fabric="none",
                     gpus_per_prefill=1, gpus_per_decode=1, kv_tokens=1 << 20, bus_delay_s=0.0, max_stall_ms=None)
    return dataclasses.replace(base, **kw)


# --- clock ----------------------------------------------------------------------------------------------------
def test_event_loop_orders_by_time_then_schedule_order() -> None:
    loop = EventLoop()
    seen: list[str] = []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")
    loop.at(0.5, lambda _: loop.after(0.25, seen.append, "first"))
    loop.run()
    assert seen == ["first", "a", "b", "c"]
    assert loop.now == 2.0


# --- workloads -------------------------------------------------------------------------------------------------
def test_mooncake_rows_that_share_hash_ids_share_leading_block_hashes() -> None:
    reqs = load_mooncake("mooncake", limit=200)
    assert len(reqs) == 200 and all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:], strict=False))
    by_first: dict[int, list[SimRequest]] = {}
    for r in reqs:
        by_first.setdefault(r.hash_ids[0], []).append(r)
    a, b = next(v for v in by_first.values() if len(v) > 1)[:2]
    shared = 0
    while shared < min(len(a.hash_ids), len(b.hash_ids)) and a.hash_ids[shared] == b.hash_ids[shared]:
        shared += 1
    ha, hb = a.hashes(16), b.hashes(16)
    assert len(ha) == a.prompt_tokens // 16
    assert ha[: shared * 32] == hb[: shared * 32]
    if len(ha) > shared * 32 and len(hb) > shared * 32:
        assert ha[shared * 32] != hb[shared * 32]


def test_azure_and_sharegpt_loaders() -> None:
    az = load_azure("azure-conv", limit=50)
    assert az[0].arrival_s == 0.0 and az[-1].arrival_s > 0 and az[0].prompt_tokens == 374
    sg = load_sharegpt(limit=100, rate=5.0, seed=1, max_total_tokens=2048)
    assert len(sg) == 100 and all(r.prompt_tokens + r.output_tokens <= 2048 for r in sg)
    assert 10 < sg[-1].arrival_s < 40  # ~100 / 5 req/s
    fast = scale_rate(az, 4.0)
    assert fast[-1].arrival_s == pytest.approx(az[-1].arrival_s / 4)


def test_bad_traces_fail_clearly(tmp_path: Path) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2}\n{"timestamp": "x"}\n')
    with pytest.raises(WorkloadError, match=r"t\.jsonl:2"):
        load_mooncake(bad)
    with pytest.raises(WorkloadError, match="no trace"):
        load_azure(tmp_path / "missing.csv")
    with pytest.raises(WorkloadError, match="positive"):
        scale_rate([], 0)


# --- latency and fabric ------------------------------------------------------------------------------------------
def test_distserve_fit_is_their_formula() -> None:
    f = distserve("opt-13b", 1)
    a, b, c = 18.10254647486372, 0.1019122572698738, 7.122264314252114e-06
    assert f.prefill_ms([500, 300]) == pytest.approx(a + 1.0 + b * 800 + c * (500**2 + 300**2))
    a, b, c = 19.934702624895458, 0.0006269356524350583, 0.03850697740828398
    assert f.decode_ms(10, 5000) == pytest.approx(a + b * 5000 + c * 10)
    assert f.decode_ms(100, 5000) != pytest.approx(a + b * 5000 + c * 100)  # the large-batch fit
    with pytest.raises(ValueError, match="TP 3"):
        distserve("opt-13b", 3)


def test_distserve_worker_overhead_is_their_ray_overhead() -> None:
    """simdistserve's Worker.add_ray_overhead: 2 ms + 1e-4 ms per context token on every prefill and decode step."""
    f0, f = distserve("opt-13b", 1), distserve("opt-13b", 1, worker_overhead=True)
    assert f.prefill_ms([500, 300]) == pytest.approx(f0.prefill_ms([500, 300]) + 2.0 + 1e-4 * 800)
    assert f.decode_ms(10, 5000) == pytest.approx(f0.decode_ms(10, 5000) + 2.0 + 1e-4 * 5000)
    assert f.decode_ms(100, 50000) == pytest.approx(f0.decode_ms(100, 50000) + 2.0 + 5.0)
    assert f.scaled(2.0).decode_ms(10, 5000) == pytest.approx(2 * f.decode_ms(10, 5000))


def test_decode_ctx_budget_decodes_streams_in_turn() -> None:
    """A step reads at most ``decode_ctx_budget`` context tokens (DistServe's decoder: 50,000); the streams that
    do not fit wait a step, and the line rotates so that every stream keeps moving."""
    # a short first request takes the idle prefiller alone, so the four long ones are prefilled in one batch
    reqs = [SimRequest("short", 0.0, 1, 2)] + [SimRequest(f"r{i}", 0.0, 1000, 11) for i in range(4)]
    free = simulate(cpu_cfg(strategy="roundrobin", disagg_threshold=0), reqs)
    capped = simulate(cpu_cfg(strategy="roundrobin", disagg_threshold=0, decode_ctx_budget=2100), reqs)
    assert free.summary["finished"] == capped.summary["finished"] == 5

    def tpots(res: SimResult) -> list[float]:
        return [r["tpot_s"] for r in res.requests if r["prompt"] == 1000]

    # free: the four streams share 20 ms + 1 ms/stream steps; capped, two 1,001-token streams fit a step, so each
    # gets a token every other (22 ms) step
    assert all(0.021 <= t <= 0.026 for t in tpots(free))
    assert all(0.040 <= t <= 0.046 for t in tpots(capped))
    roomy = simulate(cpu_cfg(strategy="roundrobin", disagg_threshold=0, decode_ctx_budget=10**6), reqs)
    assert tpots(roomy) == tpots(free)


@given(st.lists(st.integers(1, 700), min_size=1, max_size=12))
def test_chunks_of_a_prompt_cost_what_the_whole_prompt_costs(chunks: list[int]) -> None:
    f = distserve("opt-13b", 2)
    done, total = 0, 0.0
    for n in chunks:
        total += f.chunk_ms([(n, done)]) - f.prefill[0]
        done += n
    assert total == pytest.approx(f.prefill_ms([done]) - f.prefill[0])


def test_splitwise_and_calibrated_fits_grow_with_work() -> None:
    f = splitwise("llama2-70b", "h100", 8)
    assert f.prefill_ms([512]) < f.prefill_ms([2048]) < f.prefill_ms([8192])
    assert 600 < f.prefill_ms([8192]) < 1200  # the table's 8k prompt at TP8 is ~0.9 s
    assert f.decode_ms(1, 600) < f.decode_ms(64, 64 * 600)
    c = calibrated([(128, 160.0), (512, 640.0), (1024, 1300.0)], [(1, 300, 40.0), (4, 1200, 70.0), (8, 2400, 110.0)])
    assert c.prefill_tokens_per_s(512) == pytest.approx(800, rel=0.1)
    assert c.decode_ms(4, 1200) == pytest.approx(70, rel=0.1)


def test_fabric_transfer_times() -> None:
    kv = model_spec("llama-3.3-70b").kv_bytes_per_token
    assert kv == 327_680
    nbytes = 8000 * kv  # 2.62 GB
    efa = dataclasses.replace(fabric("efa"), layerwise=False)
    assert efa.transfer_s(nbytes) == pytest.approx(2.62144e9 / 45e9, rel=0.01)
    assert fabric("tcp100").transfer_s(nbytes) > efa.transfer_s(nbytes) > fabric("nvlink").transfer_s(nbytes)
    # layerwise: overlapped with the prefill's compute, only the rest (and at least one layer) is exposed
    assert fabric("efa").transfer_s(nbytes, compute_s=10.0, layers=80) == pytest.approx(efa.transfer_s(nbytes) / 80,
                                                                                        rel=0.05)


# --- KV pool and events ------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "reserve", "release", "pin"]), st.integers(0, 30)),
                max_size=60))
def test_prefix_cache_events_keep_the_index_equal_to_the_cache(ops: list[tuple[str, int]]) -> None:
    cache = PrefixCache(total_blocks=24, block_size=16)
    index = PrefixIndex()
    seq = -1
    reserved: list[int] = []
    pinned: list[list[int]] = []
    for op, n in ops:
        if op == "insert":
            cache.insert([1000 + (n % 7) * 100 + k for k in range(n % 9)])
        elif op == "reserve" and cache.reserve(n % 10):
            reserved.append(n % 10)
        elif op == "release" and reserved:
            cache.release(reserved.pop())
        elif op == "pin":
            held = list(cache.lru)[: n % 4]
            cache.pin(held)
            pinned.append(held)
        assert cache.used + len(cache.lru) <= cache.total
        assert all(h in cache.lru for h in cache.pins)  # pinned blocks are never evicted
        if cache.events:
            seq += 1
            index.apply(batch("w", seq, ts_ms=0.0, events=cache.events))
            cache.events = []
    ever = {1000 + g * 100 + k for g in range(7) for k in range(9)}
    assert {h for h in ever if index.holders(h)} == set(cache.lru)  # evictions reached the index too


def test_prefix_cache_evicts_lru_with_a_removed_event() -> None:
    cache = PrefixCache(total_blocks=4, block_size=16)
    cache.insert([1, 2, 3])
    assert isinstance(cache.events[-1], BlockStored)
    cache.pin([3])
    assert cache.reserve(3)  # evicts 1 and 2 (3 is pinned)
    assert isinstance(cache.events[-1], BlockRemoved) and cache.events[-1].block_hashes == [1, 2]
    assert not cache.reserve(1)


def test_prefix_cache_reserve_keeps_the_blocks_the_caller_will_reuse() -> None:
    cache = PrefixCache(total_blocks=4, block_size=16)
    cache.insert([1, 2, 3])
    cache.events = []
    assert not cache.reserve(3, keep=[1, 2])  # only 3 may go: one block is not enough room
    assert list(cache.lru) == [1, 2, 3] and not cache.pins and not cache.events  # no side effects
    assert cache.reserve(2, keep=[1, 2])  # the LRU blocks 1 and 2 are the prefix being reused: 3 goes instead
    assert list(cache.lru) == [1, 2] and not cache.pins
    assert isinstance(cache.events[-1], BlockRemoved) and cache.events[-1].block_hashes == [3]
    cache.pin([1, 2])  # what admission does next: the blocks are still there to pin


def test_admission_never_evicts_the_prefix_it_reuses() -> None:
    # Regression: with no prefillers and a small pool, a direct request's reserve evicted (as LRU) the
    # cached prefix blocks it had just matched, and pinning them raised KeyError.
    from splitserve.sim.cluster import Sim
    from splitserve.sim.workers import DecodeWorker

    reqs = synthetic(120, 12.0, prompt=(40, 1200), output=(4, 40), prefix_groups=3, prefix_tokens=256,
                     tenants=("alpha", "beta"), seed=11)
    sim = Sim(SimConfig(prefill=0, decode=2, kv_tokens=6000, max_seqs=6), reqs)

    def checked(w: DecodeWorker) -> None:
        step = w._step

        def run(arg: object) -> None:
            step(arg)
            c = w.cache
            assert c.used >= 0 and c.used + len(c.lru) <= c.total  # KV accounting within the pool
            assert all(h in c.lru for h in c.pins)  # a pinned block is never evicted
            assert all(h in c.pins for s in w.running + w.prefilling for h in s.pinned)

        w._step = run  # type: ignore[method-assign]

    for w in sim.decoders:
        checked(w)
    res = sim.run()
    assert res.summary["finished"] == 120 and res.summary["unfinished"] == 0
    assert res.summary["cache_hit_ratio"] > 0
    for w in sim.decoders:  # drained: every block and pin was given back
        assert w.cache.used == 0 and not w.cache.pins and len(w.cache.lru) <= w.cache.total
        assert w.cache.evicted > 0  # the pool was small enough to evict


# --- whole runs --------------------------------------------------------------------------------------------------
def test_one_direct_request_has_the_model_latencies() -> None:
    r = SimRequest("r0", 0.0, 100, 5)
    res = simulate(cpu_cfg(prefill=0, disagg_threshold=10_000), [r])
    row = res.requests[0]
    assert row["route"] == "direct"
    assert row["ttft_s"] == pytest.approx((10 + 0.1 * 100) / 1000)  # one prefill step
    assert row["tpot_s"] == pytest.approx((20 + 1) / 1000)  # decode steps of a batch of one
    assert res.summary["finished"] == 1 and res.meets_slo


def test_long_prompt_goes_through_the_prefiller_and_moves_kv() -> None:
    reqs = [SimRequest("long", 0.0, 3000, 4), SimRequest("short", 0.0, 50, 4)]
    res = simulate(cpu_cfg(disagg_threshold=512, fabric="local"), reqs)
    routes = {row["id"]: row["route"] for row in res.requests}
    assert routes == {"long": "disaggregated", "short": "direct"}
    kv = model_spec("smollm2-135m").kv_bytes_per_token
    assert res.summary["kv_bytes_moved"] == 3000 * kv == 138_240_000


def test_runs_are_deterministic_and_colocated_differs() -> None:
    reqs = synthetic(60, rate=20.0, prompt=(50, 2000), output=(5, 40), seed=2)
    a = simulate(cpu_cfg(decode=2), reqs).summary
    b = simulate(cpu_cfg(decode=2), reqs).summary
    assert json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)
    col = simulate(cpu_cfg(prefill=0, decode=2), reqs).summary
    assert col["routes"] == {"direct": 60}
    assert "disaggregated" in a["routes"]


def test_prefix_hits_with_kvaware_routing() -> None:
    reqs = synthetic(80, rate=4.0, prompt=(300, 600), output=(2, 6), prefix_groups=2, prefix_tokens=256, seed=5)
    kv = simulate(cpu_cfg(prefill=0, decode=4, strategy="kvaware"), reqs).summary
    rr = simulate(cpu_cfg(prefill=0, decode=4, strategy="roundrobin"), reqs).summary
    assert kv["cache_hit_ratio"] > rr["cache_hit_ratio"] > 0
    assert kv["index"]["events"] > 0


def test_small_kv_pool_preempts_and_still_finishes_everything() -> None:
    reqs = synthetic(30, rate=50.0, prompt=(200, 400), output=(50, 80), seed=1)
    from splitserve.sim.cluster import Sim

    sim = Sim(cpu_cfg(prefill=0, kv_tokens=2048, max_seqs=64), reqs)
    res = sim.run()
    assert res.summary["finished"] == 30
    assert sim.decoders[0].preemptions > 0


def test_quotas_and_fair_share_are_the_live_objects(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("defaults: {max_prompt_tokens: 1000}\ntenants:\n  big: {weight: 3}\n  small: {weight: 1}\n")
    reqs = []
    for i in range(60):
        reqs.append(SimRequest(f"b{i}", 0.0, 200, 20, tenant="big"))
        reqs.append(SimRequest(f"s{i}", 0.0, 200, 20, tenant="small"))
    reqs.append(SimRequest("huge", 0.0, 5000, 20, tenant="small"))
    reqs.append(SimRequest("stranger", 0.0, 10, 2, tenant="nobody"))
    from splitserve.sim.cluster import Sim

    sim = Sim(cpu_cfg(prefill=0, tenants_file=str(tenants), max_seqs=4), reqs)
    res = sim.run()
    refused = {r.request_id: why for r, why in sim.refused}
    assert refused == {"huge": "prompt_too_long", "stranger": "unknown_tenant"}
    assert res.summary["finished"] == 120
    first = sorted(sim.done, key=lambda s: s.dispatched_s)[:40]
    big = sum(1 for s in first if s.req.tenant == "big")
    assert 27 <= big <= 33  # weight 3:1 -> ~30 of the first 40 dispatches


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="at least one decoder"):
        simulate(cpu_cfg(decode=0), [SimRequest("r", 0.0, 10, 2)])
    with pytest.raises(ValueError, match="unknown fabric"):
        simulate(cpu_cfg(fabric="carrier-pigeon"), [SimRequest("r", 0.0, 10, 2)])
    with pytest.raises(ValueError, match="unknown latency model"):
        simulate(cpu_cfg(prefill_latency="nope"), [SimRequest("r", 0.0, 10, 2)])


def test_contracts_are_the_live_gate(tmp_path: Path) -> None:
    """The simulator dispatches through the live router's contract gate: a guaranteed tenant's requests go first
    however the weights lean, held-back slots stay free for it, and a capped tenant never runs past its burst."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  gold:\n    contract: {decode_slots: {guaranteed: 2}}\n"
                       "  flood:\n    weight: 50\n    contract: {decode_slots: {burst: 3}}\n")
    reqs = [SimRequest(f"f{i}", 0.0, 200, 40, tenant="flood") for i in range(40)]
    reqs += [SimRequest(f"g{i}", 0.5 + 0.2 * i, 200, 10, tenant="gold") for i in range(10)]
    from splitserve.sim.cluster import Sim

    sim = Sim(cpu_cfg(prefill=0, tenants_file=str(tenants), max_seqs=8), reqs)
    res = sim.run()
    assert res.summary["finished"] == 50
    done = {s.req.request_id: s for s in sim.done}
    # gold waited for no flood request: each was dispatched as it arrived
    assert all(done[f"g{i}"].dispatched_s - (0.5 + 0.2 * i) < 1e-6 for i in range(10))
    # the flood never ran more than its cap of 3 slots at once
    spans = sorted([(s.dispatched_s, 1) for s in sim.done if s.req.tenant == "flood"]
                   + [(s.finish_s, -1) for s in sim.done if s.req.tenant == "flood"], key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, d in spans:
        running += d
        peak = max(peak, running)
    assert peak == 3
