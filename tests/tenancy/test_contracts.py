"""Tenant contracts (pure): the tenants file's spelling, the dispatch rule (guaranteed first, burst within its caps
and the unreserved slots, priority classes, weights), the token buckets, the other routers' counts, and the
capacity check."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from splitserve import cli
from splitserve.tenancy.config import TenantsConfig
from splitserve.tenancy.contracts import ContractGate, Funding, overcommitted
from splitserve.tenancy.fairshare import FairScheduler


def _cfg(tenants: dict) -> TenantsConfig:
    return TenantsConfig.model_validate({"tenants": tenants})


class _Cluster:
    """One router's gate over its own running counts (what its request book would hold)."""

    def __init__(self, cfg: TenantsConfig) -> None:
        self.cfg = cfg
        self.running: dict[str, int] = {}
        self.fair = FairScheduler(cfg.weight)
        self.gate = ContractGate(cfg.contract, cfg.priority, lambda t: self.running.get(t, 0), cfg.contracts())

    def pick(self, pending: Mapping[str, int], free: int, now: float = 0.0) -> tuple[str, Funding] | None:
        return self.gate.pick(pending, free, self.fair.pick, now)

    def dispatch(self, tenant: str, prefill: int = 0, now: float = 0.0, tokens: int = 100) -> None:
        self.running[tenant] = self.running.get(tenant, 0) + 1
        self.gate.dispatched(tenant, prefill, now)
        self.fair.charge(tenant, tokens)


def test_the_issue_spelling_loads() -> None:
    cfg = _cfg({"search": {"priority": 1, "contract": {
        "prefill_tokens_per_s": {"guaranteed": 20000, "burst": 60000},
        "decode_slots": {"guaranteed": 32, "burst": 128},
        "slo": {"ttft_p99_ms": 800, "itl_p99_ms": 60}}}})
    c = cfg.contract("search")
    assert c is not None and c.decode_slots is not None and c.prefill_tokens_per_s is not None
    assert (c.decode_slots.guaranteed, c.decode_slots.burst) == (32, 128)
    assert c.prefill_tokens_per_s.burst == 60000
    assert cfg.priority("search") == 1 and cfg.priority("other") == 0
    slo = cfg.slo("search")
    assert slo is not None and (slo.ttft_p99_ms, slo.itl_p99_ms) == (800, 60)


@pytest.mark.parametrize("bad, where", [
    ({"a": {"contract": {"decode_slots": {"guaranteed": 8, "burst": 4}}}}, "below guaranteed"),
    ({"a": {"contract": {"prefill_tokens_per_s": {"guaranteed": -1}}}}, "greater than or equal"),
    ({"a": {"contract": {"decode_slots": {"guarnteed": 8}}}}, "Extra inputs"),
    ({"a": {"priority": 10}}, "less than or equal"),
    ({"a": {"priority": "1"}}, "valid integer"),
])
def test_a_contract_that_makes_no_sense_is_refused(bad: dict, where: str) -> None:
    with pytest.raises(ValueError, match=where):
        _cfg(bad)


def test_a_guarantee_in_the_defaults_is_refused() -> None:
    with pytest.raises(ValueError, match="per tenant"):
        TenantsConfig.model_validate({"tenants": {"a": {}},
                                      "defaults": {"contract": {"decode_slots": {"guaranteed": 2}}}})


def test_a_tenant_inside_its_guarantee_goes_before_a_heavier_tenant_in_burst() -> None:
    c = _Cluster(_cfg({"gold": {"contract": {"decode_slots": {"guaranteed": 2}}},
                       "flood": {"weight": 100}}))
    c.fair.charge("gold", 10_000)  # gold has been served far more by weighted tokens: fairness alone picks flood
    assert c.pick({"gold": 5, "flood": 50}, free=10) == ("gold", Funding.GUARANTEED)
    c.dispatch("gold")
    c.dispatch("gold")
    # past its guarantee, gold is a burst tenant like the rest, and the weights decide
    assert c.pick({"gold": 5, "flood": 50}, free=10) == ("flood", Funding.BURST)


def test_unused_guarantees_are_held_back_from_burst() -> None:
    c = _Cluster(_cfg({"gold": {"contract": {"decode_slots": {"guaranteed": 3}}}, "flood": {}}))
    # gold is idle: 3 of the 4 free slots are its, so flood may take one
    assert c.pick({"flood": 50}, free=4) == ("flood", Funding.BURST)
    c.dispatch("flood")
    assert c.pick({"flood": 50}, free=3) is None
    c.dispatch("gold")  # gold uses one of its slots: two stay held
    assert c.pick({"flood": 50}, free=2) is None
    assert c.pick({"flood": 50, "gold": 1}, free=2) == ("gold", Funding.GUARANTEED)


def test_a_tenant_at_its_burst_waits_with_capacity_to_spare() -> None:
    c = _Cluster(_cfg({"capped": {"contract": {"decode_slots": {"burst": 2}}}}))
    c.dispatch("capped")
    assert c.pick({"capped": 9}, free=50) == ("capped", Funding.BURST)
    c.dispatch("capped")
    assert c.pick({"capped": 9}, free=50) is None
    c.running["capped"] = 1  # one ended
    assert c.pick({"capped": 9}, free=50) == ("capped", Funding.BURST)


def test_prefill_buckets_fund_guaranteed_then_burst_then_wait_and_refill() -> None:
    c = _Cluster(_cfg({"t": {"contract": {"prefill_tokens_per_s": {"guaranteed": 1000, "burst": 3000}}}}))
    assert c.gate.funding("t", 0.0) is Funding.GUARANTEED
    c.dispatch("t", prefill=1000, now=0.0)  # the guaranteed bucket (one second: 1,000) is spent
    assert c.gate.funding("t", 0.0) is Funding.BURST
    c.dispatch("t", prefill=2000, now=0.0)  # and the burst bucket (3,000)
    assert c.gate.funding("t", 0.0) is None
    # the guarantee is the first 1,000 tokens/s of the tenant's whole rate: 3,000 in one second used it for 3 s
    assert c.gate.funding("t", 0.5) is Funding.BURST
    assert c.gate.funding("t", 2.5) is Funding.GUARANTEED
    # idle for a minute banks one second, no more
    assert c.gate.funding("t", 60.0) is Funding.GUARANTEED
    c.dispatch("t", prefill=1001, now=60.0)
    assert c.gate.funding("t", 60.0) is Funding.BURST


def test_priority_classes_go_first_within_a_band() -> None:
    c = _Cluster(_cfg({"urgent": {"priority": 0}, "bulk": {"priority": 5, "weight": 50}}))
    c.fair.charge("urgent", 1_000_000)
    assert c.pick({"urgent": 1, "bulk": 9}, free=4) == ("urgent", Funding.BURST)
    # ... but a guarantee goes before any class
    c2 = _Cluster(_cfg({"urgent": {"priority": 0},
                        "bulk": {"priority": 5, "contract": {"decode_slots": {"guaranteed": 1}}}}))
    assert c2.pick({"urgent": 1, "bulk": 9}, free=4) == ("bulk", Funding.GUARANTEED)


def test_other_routers_running_requests_count_and_go_stale_with_them() -> None:
    c = _Cluster(_cfg({"t": {"contract": {"decode_slots": {"guaranteed": 2, "burst": 4}}}}))
    c.gate.set_remote({"t": 2})
    assert c.gate.running("t") == 2
    assert c.pick({"t": 5}, free=8) == ("t", Funding.BURST)  # its guarantee is used on another router
    c.gate.set_remote({"t": 4})
    assert c.pick({"t": 5}, free=8) is None  # and its burst too
    c.gate.set_remote({})
    assert c.pick({"t": 5}, free=8) == ("t", Funding.GUARANTEED)


@pytest.mark.parametrize("cap, routers", [(5, 2), (5, 3), (2, 3), (7, 1), (9, 4)])
def test_routers_dispatching_at_once_never_pass_a_cap_together(cap: int, routers: int) -> None:
    cfg = _cfg({"t": {"contract": {"decode_slots": {"burst": cap}}}})
    clusters = []
    for rank in range(routers):
        c = _Cluster(cfg)
        c.gate = ContractGate(cfg.contract, cfg.priority, lambda t, c=c: c.running.get(t, 0), cfg.contracts(),
                              lambda rank=rank: (rank, routers))
        clusters.append(c)
    # every router pulls from the shared queue before any has heard the others' counts
    for c in clusters:
        while c.pick({"t": 100}, free=100) is not None:
            c.dispatch("t")
    assert sum(c.running.get("t", 0) for c in clusters) == cap


def test_each_router_meters_its_part_of_the_rates() -> None:
    cfg = _cfg({"t": {"contract": {"prefill_tokens_per_s": {"guaranteed": 1000, "burst": 2000}}}})
    c = _Cluster(cfg)
    c.gate = ContractGate(cfg.contract, cfg.priority, lambda t: 0, cfg.contracts(), lambda: (1, 2))
    c.gate.dispatched("t", 1000, 0.0)  # this router's half of the burst: 1,000 a second
    assert c.gate.funding("t", 0.0) is None
    assert c.gate.funding("t", 0.6) is Funding.BURST  # 600 back in its burst half; its guarantee half is -400


@settings(max_examples=200, deadline=None)
@given(g=st.lists(st.integers(0, 6), min_size=1, max_size=4), flood=st.integers(1, 40),
       free=st.integers(1, 30), steps=st.integers(1, 60))
def test_burst_never_takes_a_slot_an_idle_guarantee_holds(g: list[int], flood: int, free: int, steps: int) -> None:
    tenants = {f"g{i}": {"contract": {"decode_slots": {"guaranteed": n}}} for i, n in enumerate(g)}
    tenants["flood"] = {"weight": 10}
    c = _Cluster(_cfg(tenants))
    pending = {"flood": flood}
    for _ in range(steps):
        picked = c.pick(pending, free)
        if picked is None:
            break
        tenant, band = picked
        assert tenant == "flood" and band is Funding.BURST
        c.dispatch(tenant)
        free -= 1
        # what is left always covers every idle guarantee
        assert free >= sum(g)


def test_overcommitted_names_each_resource_and_who_asks() -> None:
    cfg = _cfg({"a": {"contract": {"decode_slots": {"guaranteed": 20}, "prefill_tokens_per_s": {"guaranteed": 5000}}},
                "b": {"contract": {"decode_slots": {"guaranteed": 16}}}})
    assert overcommitted(cfg.contracts(), 64, 8000) == []
    problems = overcommitted(cfg.contracts(), 32, 4000)
    assert problems == ["guaranteed decode slots sum to 36 (a 20, b 16) but the decoders run 32",
                        "guaranteed prefill sums to 5000 tokens/s (a 5000) but the prefillers do 4000"]
    assert overcommitted(cfg.contracts(), None, None) == []


def test_up_refuses_contracts_its_workers_cannot_honour(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  a:\n    contract:\n      decode_slots: {guaranteed: 20}\n"
                       "  b:\n    contract:\n      decode_slots: {guaranteed: 16}\n")
    args = ["up", "--engine", "mock", "--tenants", str(tenants), "--state-dir", str(tmp_path / "state")]
    res = CliRunner().invoke(cli.app, [*args, "--decode", "2"], env={"COLUMNS": "300"})
    assert res.exit_code == 2
    assert "guaranteed decode slots sum to 36 (a 20, b 16) but the decoders run 32" in res.output
    assert not (tmp_path / "state").exists()  # refused before anything started


def test_a_guarantee_holds_back_only_the_slots_of_models_its_tenant_may_use() -> None:
    cfg = _cfg({"gold": {"models": ["alpha"], "contract": {"decode_slots": {"guaranteed": 3}}}, "flood": {}})
    c = _Cluster(cfg)

    def pick(model: str) -> tuple[str, Funding] | None:
        return c.gate.pick({"flood": 9}, 3, c.fair.pick, 0.0, lambda t: cfg.allows_model(t, model))

    assert pick("alpha") is None  # alpha's 3 free slots are gold's
    assert pick("beta") == ("flood", Funding.BURST)  # gold may not use beta: nothing held back there
