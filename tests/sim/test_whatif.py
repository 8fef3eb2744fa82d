"""``splitserve sim what-if``: SLO targets in the tenants file, the change file, the verdict, the CLI (fast: small
synthetic traces)."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from splitserve.cli import app
from splitserve.sim import SimConfig, synthetic
from splitserve.sim.latency import StepFit
from splitserve.sim.whatif import EXIT_REFUSED, Change, WhatIfError, apply_change, load_change, tenant_requests, what_if
from splitserve.tenancy import TenantsConfig, TenantSlo, load_tenants

FLAT = StepFit("flat", (10.0, 0.1, 0.0), (20.0, 0.0, 1.0))  # prefill 10 ms + 0.1 ms/token; decode 20 ms + 1 ms/seq
CFG = SimConfig(prefill=0, decode=1, model="smollm2-135m", prefill_latency=FLAT, fabric="none", gpus_per_prefill=1,
                gpus_per_decode=1, kv_tokens=1 << 20, bus_delay_s=0.0, max_stall_ms=None)
# a: TTFT and ITL targets; b: none, but a max_inflight a slower cluster makes it hit
TENANTS = TenantsConfig.model_validate({"tenants": {
    "a": {"weight": 2, "slo": {"ttft_p99_ms": 1000, "itl_p99_ms": 200}},
    "b": {"max_inflight": 8}}})
# 200 requests at 5 req/s on one colocated decoder: TTFT p99 ~0.1 s, ITL p99 ~70 ms (both hold with a wide margin)
REQS = synthetic(200, 5.0, prompt=(200, 400), output=(20, 40), seed=3)
runner = CliRunner()


def _change(d: dict[str, Any]) -> Change:
    return Change.model_validate(d)


# --- the slo targets in the tenants file ------------------------------------------------------------------------
def test_slo_targets_parse_and_merge_with_the_defaults(tmp_path: Path) -> None:
    f = tmp_path / "tenants.yaml"
    f.write_text("defaults: {slo: {ttft_p99_ms: 2000, itl_p99_ms: 80}}\n"
                 "tenants:\n"
                 "  search: {slo: {ttft_p99_ms: 800, itl_p99_ms: 60.5}}\n"
                 "  chat: {slo: {itl_p99_ms: 100}}\n"
                 "  batch: {}\n"
                 "  free: {slo: {ttft_p99_ms: null, itl_p99_ms: null}}\n")
    t = load_tenants(f)
    assert t.slo("search") == TenantSlo(ttft_p99_ms=800, itl_p99_ms=60.5)
    assert t.slo("chat") == TenantSlo(ttft_p99_ms=2000, itl_p99_ms=100)  # target by target
    assert t.slo("batch") == TenantSlo(ttft_p99_ms=2000, itl_p99_ms=80)
    assert t.slo("free") is None  # an explicit null drops a default target
    assert t.limits("chat").slo == t.slo("chat")  # type: ignore[union-attr]
    assert t.limits("chat").max_inflight is None  # type: ignore[union-attr]  # the limits are untouched
    assert TenantsConfig.model_validate({"tenants": {"x": {}}}).slo("x") is None


@pytest.mark.parametrize("slo, msg", [
    ("{ttft_p99_ms: 0}", "greater than 0"),
    ("{ttft_p99_ms: -5}", "greater than 0"),
    ("{itl_p99_ms: .nan}", "finite"),
    ("{itl_p99_ms: .inf}", "finite"),
    ("{ttft_p99_ms: '800'}", "valid number"),
    ("{ttft_p99_ms: true}", "valid number"),
    ("{ttft_p99_ms: 800, guaranteed_rps: 5}", "Extra inputs"),  # no contract keys that would do nothing
    ("{tpot_p99_ms: 50}", "Extra inputs"),
])
def test_bad_slo_values_are_refused(tmp_path: Path, slo: str, msg: str) -> None:
    f = tmp_path / "tenants.yaml"
    f.write_text(f"tenants:\n  search: {{slo: {slo}}}\n")
    with pytest.raises(ValueError, match=msg) as err:
        load_tenants(f)
    assert "tenants.search.slo" in str(err.value)
    f.write_text(f"defaults: {{slo: {slo}}}\ntenants:\n  search: {{}}\n")
    with pytest.raises(ValueError, match="defaults.slo"):
        load_tenants(f)


# --- the change file --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, msg", [
    ("traffic: {a: 1}\n", "at least one of add_tenant"),
    ("add_tenant: {name: x}\n", "exactly one of rate_rps"),
    ("add_tenant: {name: x, rate_rps: 1, share: 0.5}\n", "exactly one of rate_rps"),
    ("add_tenant: {name: x, rate_rps: 0}\n", "greater than 0"),
    ("add_tenant: {name: 'a b', rate_rps: 1}\n", "tenant"),
    ("add_tenant: {name: x, rate_rps: 1, spec: {slo: {ttft_p99_ms: -1}}}\n", "add_tenant.0.spec.slo.ttft_p99_ms"),
    ("add_tenant: {name: x, rate_rps: 1, spec: {wieght: 2}}\n", "Extra inputs"),
    ("pools: {decode: 0}\n", "greater than or equal to 1"),
    ("pools: {}\n", "give prefill and/or decode"),
    ("pools: {prefill: 2, gpus: 9}\n", "Extra inputs"),
    ("resize: {decode: 2}\n", "Extra inputs"),
    ("pools: {decode: 2}\ntraffic: {a: -1}\n", "traffic shares"),
    ("- pools\n", "expected a mapping"),
    ("add_tenant: [{name: x, rate_rps: 1}, {name: x, rate_rps: 2}]\n", "added or set once"),
])
def test_bad_change_files_are_clear_errors(tmp_path: Path, text: str, msg: str) -> None:
    f = tmp_path / "change.yaml"
    f.write_text(text)
    with pytest.raises(WhatIfError, match=msg) as err:
        load_change(f)
    assert str(f) in str(err.value)


def test_applying_a_change_validates_it_against_the_tenants() -> None:
    with pytest.raises(WhatIfError, match="no tenant 'zz'"):
        apply_change(TENANTS, _change({"set_tenant": {"name": "zz", "weight": 2}}))
    with pytest.raises(WhatIfError, match="already in the tenants file"):
        apply_change(TENANTS, _change({"add_tenant": {"name": "a", "rate_rps": 1}}))
    with pytest.raises(WhatIfError, match=r"set_tenant\[0\] \(a\): weight"):
        apply_change(TENANTS, _change({"set_tenant": {"name": "a", "weight": -1}}))
    with pytest.raises(WhatIfError, match="Extra inputs"):
        apply_change(TENANTS, _change({"set_tenant": {"name": "a", "sloo": {}}}))
    with pytest.raises(WhatIfError, match="name the fields"):
        apply_change(TENANTS, _change({"set_tenant": {"name": "a"}}))
    after = apply_change(TENANTS, _change({"set_tenant": [{"name": "a", "slo": {"ttft_p99_ms": 50}}],
                                           "add_tenant": {"name": "c", "rate_rps": 1, "spec": {"weight": 3}}}))
    assert after.slo("a") == TenantSlo(ttft_p99_ms=50)  # the field replaced whole
    assert after.weight("a") == 2 and after.weight("c") == 3 and after.limits("b").max_inflight == 8  # type: ignore[union-attr]
    assert list(TENANTS.tenants) == ["a", "b"]  # the current tenants are untouched


def test_traffic_is_split_by_seed_and_the_same_before_and_after() -> None:
    ch = _change({"traffic": {"a": 3, "b": 1}, "add_tenant": {"name": "c", "rate_rps": 2.0}})
    after = apply_change(TENANTS, ch)
    before_reqs, after_reqs = tenant_requests(REQS, TENANTS, after, ch, seed=0)
    assert [r.request_id for r in before_reqs] == [r.request_id for r in REQS]
    share_a = sum(r.tenant == "a" for r in before_reqs) / len(before_reqs)
    assert 0.65 < share_a < 0.85
    old = [(r.request_id, r.tenant, r.arrival_s) for r in after_reqs if r.tenant != "c"]
    assert old == [(r.request_id, r.tenant, r.arrival_s) for r in before_reqs]
    new = [r for r in after_reqs if r.tenant == "c"]
    span = max(r.arrival_s for r in REQS)
    assert 0.6 * 2.0 * span < len(new) < 1.4 * 2.0 * span  # ~rate_rps over the trace's span
    assert all(r.cache_scope == after.cache_salt(r.tenant) and r.kind == r.tenant for r in after_reqs)
    assert [r.arrival_s for r in after_reqs] == sorted(r.arrival_s for r in after_reqs)
    again = tenant_requests(REQS, TENANTS, after, ch, seed=0)
    assert [(r.request_id, r.tenant) for r in again[1]] == [(r.request_id, r.tenant) for r in after_reqs]
    other = tenant_requests(REQS, TENANTS, after, ch, seed=1)[0]
    assert [r.tenant for r in other] != [r.tenant for r in before_reqs]
    with pytest.raises(WhatIfError, match="c not in the tenants file"):
        tenant_requests(REQS, TENANTS, after, _change({"traffic": {"c": 1}, "pools": {"decode": 2}}), seed=0)
    only_b = tenant_requests(REQS, TENANTS, TENANTS, _change({"traffic": {"b": 1}, "pools": {"decode": 2}}), 0)[0]
    assert {r.tenant for r in only_b} == {"b"}  # a tenant left out of traffic: gets none


# --- the verdict ------------------------------------------------------------------------------------------------
def test_a_heavy_tenant_on_a_small_cluster_is_refused_naming_who_breaks() -> None:
    w = what_if(CFG, TENANTS, _change({"add_tenant": {"name": "heavy", "share": 10.0,
                                                       "spec": {"slo": {"ttft_p99_ms": 1000}}}}), REQS)
    assert w.verdict == "refused" and w.exit_code == EXIT_REFUSED == 3
    rows = {r["tenant"]: r for r in w.tenants}
    assert rows["a"]["before"]["holds"] and not rows["a"]["after"]["holds"]
    assert rows["a"]["before"]["ttft_p99_ms"] < 1000 < rows["a"]["after"]["ttft_p99_ms"]
    breaks = {b["tenant"]: b for b in w.breaks}
    assert set(breaks) == {"a", "b", "heavy"}
    assert any(r.startswith("TTFT p99 ") and "> 1000 ms (+" in r for r in breaks["a"]["reasons"])
    assert any(r.startswith("ITL p99 ") and "> 200 ms (+" in r for r in breaks["a"]["reasons"])
    # b has no targets: its guarantee is to be served as before, and its max_inflight now refuses requests
    assert rows["b"]["before"]["refused"] == 0 < rows["b"]["after"]["refused"]
    assert breaks["b"]["reasons"] == [f"refused {rows['b']['after']['refused']} requests by its limits (was 0)"]
    assert rows["heavy"]["before"] is None and rows["heavy"]["status"] == "added"
    assert w.runs["before"]["requests"] == 200 < w.runs["after"]["requests"]


def test_a_light_tenant_or_a_bigger_pool_is_accepted() -> None:
    light = what_if(CFG, TENANTS, _change({"add_tenant": {"name": "light", "share": 0.05,
                                                           "spec": {"slo": {"ttft_p99_ms": 1000}}}}), REQS)
    assert light.verdict == "accepted" and light.exit_code == 0 and light.breaks == []
    assert all(r["after"]["holds"] for r in light.tenants)
    assert {r["tenant"]: r["status"] for r in light.tenants} == {"a": "same", "b": "same", "light": "added"}
    # the heavy tenant on eight decoders instead of one: every SLO holds
    both = what_if(CFG, TENANTS, _change({"add_tenant": {"name": "heavy", "share": 10.0,
                                                          "spec": {"slo": {"ttft_p99_ms": 1000}}},
                                          "pools": {"decode": 8}}), REQS)
    assert both.verdict == "accepted", both.breaks
    assert both.runs["after"]["decode"] == 8 and both.runs["before"]["decode"] == 1


def test_tenants_failing_before_and_new_contracts() -> None:
    tight = TenantsConfig.model_validate({"tenants": {"a": {"slo": {"ttft_p99_ms": 1}}, "b": {}}})
    # a misses already (1 ms); a resize that does not fix it is no reason to refuse
    w = what_if(CFG, tight, _change({"pools": {"decode": 2}}), REQS)
    assert w.verdict == "accepted" and w.already_failing == ["a"]
    # but promising a new target the cluster cannot meet is refused, with the figures
    w = what_if(CFG, TENANTS, _change({"set_tenant": {"name": "b", "slo": {"ttft_p99_ms": 5}}}), REQS)
    assert w.verdict == "refused" and [b["tenant"] for b in w.breaks] == ["b"]
    assert "> 5 ms" in w.breaks[0]["summary"] and "(before: TTFT p99 " in w.breaks[0]["summary"]
    row = next(r for r in w.tenants if r["tenant"] == "b")
    assert row["slo_before"] == {"ttft_p99_ms": None, "itl_p99_ms": None}
    assert row["slo_after"] == {"ttft_p99_ms": 5.0, "itl_p99_ms": None}
    # a weight change with no new target, on a cluster that holds: accepted
    w = what_if(CFG, TENANTS, _change({"set_tenant": {"name": "b", "weight": 4}}), REQS)
    assert w.verdict == "accepted", w.breaks


def test_what_if_is_deterministic() -> None:
    ch = _change({"add_tenant": {"name": "c", "rate_rps": 1.5, "spec": {"slo": {"itl_p99_ms": 300}}}})
    a = json.dumps(what_if(CFG, TENANTS, ch, REQS).to_dict(), sort_keys=True)
    b = json.dumps(what_if(CFG, TENANTS, ch, REQS).to_dict(), sort_keys=True)
    assert a == b
    c = json.dumps(what_if(dataclasses.replace(CFG, seed=7), TENANTS, ch, REQS).to_dict(), sort_keys=True)
    assert c != a  # the seed splits the traffic


def test_what_if_refuses_what_it_cannot_simulate() -> None:
    with pytest.raises(WhatIfError, match="names its tenants"):
        what_if(CFG, TenantsConfig.open_mode(), _change({"pools": {"decode": 2}}), REQS)


def test_the_committed_examples_are_valid() -> None:
    root = Path(__file__).resolve().parents[2] / "deploy" / "whatif"
    tenants = load_tenants(root / "tenants.yaml")
    assert tenants.slo("search") == TenantSlo(ttft_p99_ms=20000, itl_p99_ms=80)
    for name in ("add-analytics.yaml", "add-analytics-resized.yaml", "add-analytics-search-guaranteed.yaml"):
        after = apply_change(tenants, load_change(root / name))
        assert "analytics" in after.tenants
    guaranteed = apply_change(tenants, load_change(root / "add-analytics-search-guaranteed.yaml"))
    contract = guaranteed.contract("search")
    assert contract is not None and contract.prefill_tokens_per_s is not None


# --- the CLI ----------------------------------------------------------------------------------------------------
def _files(tmp_path: Path) -> dict[str, Path]:
    """A small Mooncake-style trace (shared prefixes), a tenants file and three change files."""
    rng = random.Random(5)
    rows = []
    for i in range(60):
        n_in = rng.randint(600, 3000)
        head = [rng.randrange(3)] if rng.random() < 0.5 else []
        ids = head + [1000 + i * 10 + k for k in range(-(-n_in // 512) - len(head))]
        rows.append(json.dumps({"timestamp": i * 500, "input_length": n_in, "output_length": rng.randint(10, 40),
                                "hash_ids": ids}))
    f = {"trace": tmp_path / "trace.jsonl", "tenants": tmp_path / "tenants.yaml", "heavy": tmp_path / "heavy.yaml",
         "light": tmp_path / "light.yaml", "bad": tmp_path / "bad.yaml"}
    f["trace"].write_text("\n".join(rows) + "\n")
    f["tenants"].write_text("defaults: {slo: {ttft_p99_ms: 3000}}\ntenants:\n  search: {weight: 2}\n"
                            "  chat: {slo: {itl_p99_ms: 500}}\n")
    f["heavy"].write_text("add_tenant: {name: bulk, share: 12.0}\n")
    f["light"].write_text("add_tenant: {name: trial, rate_rps: 0.1, spec: {slo: {ttft_p99_ms: 3000}}}\n")
    f["bad"].write_text("set_tenant: {name: nobody, weight: 2}\n")
    return f


def _cli(f: dict[str, Path], change: str, *extra: str) -> Any:
    return runner.invoke(app, ["sim", "what-if", "--tenants", str(f["tenants"]), "--change", str(f[change]),
                               "--trace", str(f["trace"]), "--prefill", "1", "--decode", "1", *extra])


def test_cli_exit_codes_and_output(tmp_path: Path) -> None:
    f = _files(tmp_path)
    r = _cli(f, "light")
    assert r.exit_code == 0, r.output
    assert "verdict: ACCEPTED" in r.output and "trial (added)" in r.output
    r = _cli(f, "heavy")
    assert r.exit_code == 3, r.output
    # the heavy tenant cannot meet its own SLO; the prefillers' fair queue keeps search's (it held before)
    assert "verdict: REFUSED" in r.output and "  bulk: TTFT p99 " in r.output
    r = _cli(f, "heavy", "--json")
    assert r.exit_code == 3
    out = json.loads(r.output)
    assert out["verdict"] == "refused" and [b["tenant"] for b in out["breaks"]] == ["bulk"]
    assert _cli(f, "heavy", "--json").output == r.output  # deterministic
    # usage errors: exit 2 with the reason
    r = _cli(f, "bad")
    assert r.exit_code == 2 and "no tenant 'nobody'" in r.output
    f["bad"].write_text("pools: {decode: 0}\n")
    r = _cli(f, "bad")
    assert r.exit_code == 2 and "pools.decode" in r.output
    r = runner.invoke(app, ["sim", "what-if", "--tenants", str(f["tenants"]), "--trace", str(f["trace"])])
    assert r.exit_code == 2 and "--change" in r.output
    r = runner.invoke(app, ["sim", "what-if", "--tenants", str(tmp_path / "none.yaml"), "--change", str(f["light"]),
                            "--trace", str(f["trace"])])
    assert r.exit_code == 2 and "cannot read tenants file" in r.output


def test_a_guarantee_the_pools_cannot_honour_is_refused_and_a_resize_that_fits_it_accepted() -> None:
    # one decoder of CFG's 256 slots: a tenant buying 300 guaranteed slots cannot be honoured
    big = {"name": "big", "share": 0.05, "spec": {"contract": {"decode_slots": {"guaranteed": 300}}}}
    w = what_if(CFG, TENANTS, _change({"add_tenant": big}), REQS)
    assert w.verdict == "refused"
    assert [b["summary"] for b in w.breaks] == [
        "contracts: guaranteed decode slots sum to 300 (big 300) but the decoders run 256"]
    assert w.runs["after"]["capacity"] == {"decode_slots": 256, "prefill_tokens_per_s": None}
    grown = what_if(CFG, TENANTS, _change({"add_tenant": big, "pools": {"decode": 2}}), REQS)
    assert grown.verdict == "accepted", grown.breaks
    assert grown.runs["after"]["contract_problems"] == []
