"""The simulator routes with ``slo`` on each tenant's targets, and applies SLO admission at intake when asked."""

from __future__ import annotations

import dataclasses
from typing import Any

from splitserve.sim import SimConfig, SimRequest, simulate
from splitserve.sim.cluster import Sim
from splitserve.sim.latency import StepFit
from splitserve.tenancy.config import TenantsConfig

FLAT = StepFit("flat", (10.0, 0.1, 0.0), (20.0, 0.0, 1.0))  # prefill 10 ms + 0.1 ms/token; decode 20 ms + 1 ms/seq


def cfg(**kw: Any) -> SimConfig:
    base = SimConfig(prefill=0, decode=3, model="smollm2-135m", prefill_latency=FLAT, fabric="none",
                     gpus_per_prefill=1, gpus_per_decode=1, kv_tokens=1 << 20, bus_delay_s=0.0, max_stall_ms=None)
    return dataclasses.replace(base, **kw)


def mixed(n: int = 90, gap: float = 0.1, every: int = 7) -> list[SimRequest]:
    """A 20,000-token batch prompt (2 s of prefill) every ``every``-th request, short interactive ones between:
    the three decoders are busy ~95% of the time prefilling, so where an interactive request lands decides its
    TTFT."""
    out = []
    for i in range(n):
        if i % every == 0:
            out.append(SimRequest(f"b{i}", i * gap, 20_000, 20, tenant="batch", kind="batch"))
        else:
            out.append(SimRequest(f"i{i}", i * gap, 200, 10, tenant="interactive", kind="interactive"))
    return out


TENANTS = TenantsConfig.model_validate({"tenants": {
    "interactive": {"slo": {"ttft_p99_ms": 500.0, "itl_p99_ms": 100.0}},
    "batch": {"slo": {"ttft_p99_ms": 60_000.0}}}})


def test_slo_strategy_runs_in_the_sim_on_each_tenants_targets() -> None:
    sim = Sim(cfg(strategy="slo", tenants=TENANTS, record=True), mixed())
    res = sim.run()
    assert res.summary["finished"] == 90 and "admission" not in res.summary
    assert sim.slo_targets("interactive") == (500.0, 100.0)
    assert sim.slo_targets("batch") == (60_000.0, 100.0)  # the run's tpot_slo_s fills the target it lacks
    decisions = [e[6] for e in sim.log if e[0] == "route"]
    assert decisions and all("slo" in d["detail"] for d in decisions)
    slo = {d["request_id"]: d["detail"]["slo"] for d in decisions}
    assert slo["i1"]["ttft_slo_ms"] == 500.0 and slo["b0"]["ttft_slo_ms"] == 60_000.0


def test_slo_keeps_interactive_requests_off_long_queues() -> None:
    kv = simulate(cfg(strategy="kvaware", tenants=TENANTS), mixed()).by_kind("interactive")
    slo = simulate(cfg(strategy="slo", tenants=TENANTS), mixed()).by_kind("interactive")
    assert slo["ttft"]["p90"] < kv["ttft"]["p90"]


def test_without_a_tenants_file_the_runs_targets_apply() -> None:
    sim = Sim(cfg(strategy="slo", ttft_slo_s=2.0, tpot_slo_s=0.05), mixed(9))
    assert sim.run().summary["finished"] == 9
    assert sim.slo_targets("interactive") == (2000.0, 50.0)


def test_admission_refuses_what_cannot_be_served_in_time_and_counts_it() -> None:
    res = simulate(cfg(strategy="slo", tenants=TENANTS, slo_admission=True), mixed())
    s = res.summary
    adm = s["admission"]
    assert adm["refused"] > 0 and set(adm["by_tenant"]) == {"interactive"}
    assert s["refused"] == adm["refused"] and s["finished"] + s["refused"] == 90
    assert adm["by_reason"] == {"ttft_unmeetable": adm["refused"]}
    assert adm["retry_after_s"]["n"] == adm["refused"] and adm["retry_after_s"]["p50"] >= 1
    # the admitted interactive requests are the ones that could be on time
    off = simulate(cfg(strategy="slo", tenants=TENANTS), mixed()).by_kind("interactive")
    assert res.by_kind("interactive")["ttft"]["p99"] <= off["ttft"]["p99"]
