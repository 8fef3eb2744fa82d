"""The simulator with several models and LoRA adapters: pools per model, scoped caches, adapter slots, affinity."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from splitserve.cli import app
from splitserve.routing.adapter_lru import AdapterLru
from splitserve.sim import SimConfig, SimRequest, simulate, synthetic
from splitserve.sim.cli import parse_mix, parse_pools
from splitserve.sim.cluster import ModelPool, Sim
from splitserve.sim.latency import StepFit
from splitserve.sim.workload import assign_adapters, assign_models

FLAT = StepFit("flat", (10.0, 0.1, 0.0), (20.0, 0.0, 1.0))  # prefill 10 ms + 0.1 ms/token; decode 20 ms + 1 ms/seq


def cfg(pools: list[ModelPool] | None = None, **kw: object) -> SimConfig:
    base = SimConfig(prefill=1, decode=1, model="smollm2-135m", prefill_latency=FLAT, fabric="none",
                     gpus_per_prefill=1, gpus_per_decode=1, kv_tokens=1 << 20, bus_delay_s=0.0, max_stall_ms=None,
                     max_seqs=16, pools=pools)
    return dataclasses.replace(base, **kw)


def zipf_workload(n: int = 500, rate: float = 40.0, seed: int = 1) -> list[SimRequest]:
    reqs = synthetic(n, rate, prompt=(64, 600), output=(8, 48), seed=seed)
    return assign_adapters(assign_models(reqs, {"a": 0.7, "b": 0.3}, seed + 1), 16, 1.1, 0.9, seed + 2)


# --- workload ---------------------------------------------------------------------------------------------------
def test_model_mix_and_adapter_popularity_are_seeded() -> None:
    reqs = synthetic(2000, 10.0, seed=4)
    a1 = assign_adapters(assign_models(reqs, {"a": 0.7, "b": 0.3}, 5), 8, 1.1, 0.8, 6)
    a2 = assign_adapters(assign_models(reqs, {"a": 0.7, "b": 0.3}, 5), 8, 1.1, 0.8, 6)
    assert [(r.model, r.lora) for r in a1] == [(r.model, r.lora) for r in a2]
    share_a = sum(r.model == "a" for r in a1) / len(a1)
    assert 0.65 < share_a < 0.75
    with_lora = [r for r in a1 if r.lora]
    assert 0.75 < len(with_lora) / len(a1) < 0.85
    assert all(r.lora is not None and r.lora.startswith(f"{r.model}/") for r in with_lora)  # per model
    top = sum(r.lora == "a/lora-000" for r in with_lora)
    assert top > sum(r.lora == "a/lora-007" for r in with_lora)  # Zipf: the first is the most popular
    assert all(r.model is None and r.lora is None for r in reqs)  # the input is left as it was


# --- adapter slots ----------------------------------------------------------------------------------------------
def test_adapter_lru_evicts_the_least_recently_used_one_not_held() -> None:
    lru = AdapterLru(2)
    assert lru.admit("x", set()) and lru.admit("y", {"x"})
    assert not lru.admit("x", set())  # loaded: no load, and x is the most recently used now
    assert lru.admit("z", set()) and lru.loaded() == ["x", "z"]  # y went (least recently used)
    assert lru.admit("w", {"x"}) and lru.loaded() == ["x", "w"]  # z went: x is held
    assert not lru.can_admit("v", {"x", "w"})  # every slot held: it waits
    with pytest.raises(RuntimeError):
        lru.admit("v", {"x", "w"})
    assert lru.loads == 4 and lru.evictions == 2 and lru.peak == 2
    assert AdapterLru(0).can_admit("any", {"a"}) and not AdapterLru(0).admit("any", set())  # no limit: no loads


def test_an_adapter_load_delays_the_first_token_and_a_full_worker_makes_it_wait() -> None:
    one = [ModelPool("m", 0, 1, max_loras=1, lora_load_s=0.5)]
    base = simulate(cfg(one), [SimRequest("r0", 0.0, 100, 5, model="m")]).requests[0]["ttft_s"]
    loaded = simulate(cfg(one), [SimRequest("r0", 0.0, 100, 5, model="m", lora="x")]).requests[0]["ttft_s"]
    assert loaded >= base + 0.5
    # one slot, two adapters at once: the second waits for the first sequence to finish, then loads
    res = simulate(cfg(one), [SimRequest("r0", 0.0, 100, 20, model="m", lora="x"),
                              SimRequest("r1", 0.0, 100, 20, model="m", lora="y")])
    rows = {r["id"]: r for r in res.requests}
    assert rows["r1"]["ttft_s"] > rows["r0"]["e2e_s"] + 0.5
    assert res.summary["adapters"]["loads"] == 2 and res.summary["models"]["m"]["peak_loaded"] == 1


def test_adapter_loads_are_counted_and_never_exceed_the_slots() -> None:
    pools = [ModelPool("a", 1, 3, max_loras=2), ModelPool("b", 1, 2, max_loras=3)]
    sim = Sim(cfg(pools), zipf_workload())
    res = sim.run()
    s = res.summary
    assert s["finished"] == 500
    for w in sim.workers:
        assert w.lru is not None and w.lru.peak <= w.lru.capacity
    assert s["models"]["a"]["peak_loaded"] == 2 and s["models"]["b"]["peak_loaded"] == 3
    assert s["adapters"]["loads"] == sum(w.lru.loads for w in sim.workers if w.lru) > 0
    assert s["models"]["a"]["adapter_loads"] + s["models"]["b"]["adapter_loads"] == s["adapters"]["loads"]
    assert s["adapters"]["loads_per_request"] == pytest.approx(s["adapters"]["loads"] / 500, abs=1e-4)


# --- models -----------------------------------------------------------------------------------------------------
def test_a_model_mix_is_routed_only_to_its_models_workers_and_reports_both_pools() -> None:
    # uneven pools: a load-balancing router without the model filter would send a's requests to b's idle workers
    pools = [ModelPool("a", 1, 1), ModelPool("b", 2, 4)]
    reqs = assign_models(synthetic(300, 60.0, prompt=(64, 900), output=(8, 48), seed=2), {"a": 0.8, "b": 0.2}, 3)
    sim = Sim(cfg(pools), reqs)
    res = sim.run()
    assert res.summary["finished"] == 300
    for s in sim.done:
        model = s.req.model
        assert sim.model_of[s.decoder] == model
        assert s.prefiller is None or sim.model_of[s.prefiller] == model
    models = res.summary["models"]
    assert set(models) == {"a", "b"}
    assert models["a"]["finished"] + models["b"]["finished"] == 300
    assert models["a"]["finished"] == sum(r.model == "a" for r in reqs)
    for m in models.values():
        assert m["ttft_s"]["p50"] > 0 and m["ttft_s"]["p99"] >= m["ttft_s"]["p50"] and m["throughput_rps"] > 0
    assert res.summary["ttft_s"]["n"] == 300  # the cluster-wide keys are still there


def test_each_pool_routes_by_its_own_threshold_and_strategy() -> None:
    """The live router's per-model policies (routing.policies): b disaggregates every prompt, a none."""
    pools = [ModelPool("a", 1, 2), ModelPool("b", 1, 2, strategy="roundrobin", disagg_threshold=0)]
    reqs = assign_models(synthetic(200, 20.0, prompt=(64, 300), output=(4, 8), seed=7), {"a": 0.5, "b": 0.5}, 8)
    sim = Sim(cfg(pools, disagg_threshold=10**6, strategy="kvaware"), reqs)
    res = sim.run()
    routes = {(r["model"], r["route"]) for r in res.requests}
    assert routes == {("a", "direct"), ("b", "disaggregated")}, routes
    assert sim.router.of("b").strategy_name == "roundrobin" and sim.router.of("a").strategy_name == "kvaware"


def test_a_request_for_a_model_not_served_is_refused() -> None:
    res = simulate(cfg([ModelPool("a", 0, 1)]), [SimRequest("r0", 0.0, 10, 2, model="zzz"),
                                                 SimRequest("r1", 0.0, 10, 2)])  # none named: the default
    assert res.summary["refused"] == 1 and res.summary["finished"] == 1


def test_no_prefix_cache_hit_crosses_models_or_adapters() -> None:
    prompt = list(range(1000, 1512))
    scopes = [("a", None), ("a", "x"), ("a", "y"), ("b", None), ("b", "x")]
    # one decoder per model, no prefillers: every prompt meets the same cache as the one before in its model
    reqs = [SimRequest(f"r{i}", i * 1.0, len(prompt), 4, token_ids=prompt, model=m, lora=lo)
            for i, (m, lo) in enumerate(scopes)]
    reqs.append(SimRequest("again", len(scopes) * 1.0, len(prompt), 4, token_ids=prompt, model="a", lora="x"))
    res = simulate(cfg([ModelPool("a", 0, 1), ModelPool("b", 0, 1)]), reqs)
    cached = {r["id"]: r["cached_tokens"] for r in res.requests}
    assert all(cached[f"r{i}"] == 0 for i in range(len(scopes))), cached
    assert cached["again"] > 0  # the same (model, adapter) does hit
    hashes = {(m, lo): SimRequest("h", 0.0, len(prompt), 1, token_ids=prompt, lora=lo).hashes(16, m)
              for m, lo in scopes}
    assert len({h[0] for h in hashes.values()}) == len(scopes)
    moon = [SimRequest("m", 0.0, 1024, 1, hash_ids=(7, 8), lora=lo).hashes(16, m) for m, lo in scopes]
    assert len({h[0] for h in moon}) == len(scopes)
    unscoped = SimRequest("u", 0.0, len(prompt), 1, token_ids=prompt)
    assert unscoped.hashes(16) != hashes[("a", None)]  # a single-model cluster's salts stay as they were


def test_affinity_needs_fewer_adapter_loads_than_none() -> None:
    pools = [ModelPool("a", 1, 4, max_loras=2), ModelPool("b", 1, 2, max_loras=2)]
    reqs = zipf_workload()
    on = simulate(cfg(pools, lora_affinity=True), reqs).summary["adapters"]
    off = simulate(cfg(pools, lora_affinity=False), reqs).summary["adapters"]
    assert on["affinity"] and not off["affinity"]
    assert on["loads_per_request"] < off["loads_per_request"]


def test_one_model_with_adapters_uses_the_slots_too() -> None:
    reqs = assign_adapters(synthetic(200, 30.0, seed=3), 8, 1.1, 1.0, 4)
    res = simulate(cfg(None, decode=2, max_loras=2), reqs)
    assert res.summary["finished"] == 200
    assert set(res.summary["models"]) == {"smollm2-135m"} and res.summary["adapters"]["loads"] > 0
    assert "models" not in simulate(cfg(None, decode=2), synthetic(50, 30.0, seed=3)).summary  # as it always was


def test_a_multi_model_run_is_deterministic() -> None:
    pools = [ModelPool("a", 1, 3, max_loras=2), ModelPool("b", 1, 2, max_loras=2)]
    one = simulate(cfg(pools), zipf_workload(300))
    two = simulate(cfg(pools), zipf_workload(300))
    assert json.dumps(one.to_dict(requests=True), default=float) == json.dumps(two.to_dict(requests=True),
                                                                                default=float)


def test_bad_pools_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        Sim(cfg([ModelPool("a"), ModelPool("a")]), [])
    with pytest.raises(ValueError, match="decoder"):
        Sim(cfg([ModelPool("a", 1, 0)]), [])


# --- CLI --------------------------------------------------------------------------------------------------------
def test_models_and_mix_parse() -> None:
    assert parse_pools("a:2:6, org/m:x:1:3") == [("a", 2, 6), ("org/m:x", 1, 3)]
    assert parse_mix("a=0.7,b=0.3", ["a", "b"]) == {"a": 0.7, "b": 0.3}
    assert parse_mix(None, ["a", "b"]) == {"a": 1.0, "b": 1.0}
    for bad in ("a:1", "a:1:0", "a:x:2", "a:1:2,a:1:2", ""):
        with pytest.raises(ValueError):
            parse_pools(bad)
    with pytest.raises(ValueError):
        parse_mix("c=1", ["a", "b"])


def test_sim_run_cli_with_models_and_adapters() -> None:
    r = CliRunner().invoke(app, ["sim", "run", "--trace", "azure-conv", "--limit", "150", "--models", "a:1:2,b:0:1",
                                 "--mix", "a=0.7,b=0.3", "--adapters", "8", "--zipf", "1.2", "--adapter-share", "0.8",
                                 "--max-loras", "2", "--lora-load-ms", "40", "--no-lora-affinity", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["finished"] == 150 and set(out["models"]) == {"a", "b"}
    assert out["adapters"]["loads"] > 0 and out["adapters"]["affinity"] is False
    assert [p["name"] for p in out["config"]["pools"]] == ["a", "b"] and out["config"]["pools"][0]["max_loras"] == 2
    assert out["config"]["pools"][0]["lora_load_s"] == pytest.approx(0.04)
    text = CliRunner().invoke(app, ["sim", "run", "--trace", "azure-conv", "--limit", "60", "--models", "a:1:1,b:1:1",
                                    "--adapters", "4", "--max-loras", "2"])
    assert text.exit_code == 0, text.output
    assert "loads/req" in text.output and "affinity on" in text.output
    bad = CliRunner().invoke(app, ["sim", "run", "--trace", "azure-conv", "--limit", "10", "--models", "a:1"])
    assert bad.exit_code == 2 and "name:prefill:decode" in bad.output
