"""What-if: would a proposed change to the tenants or the pools keep every tenant's latency promises?

``splitserve sim what-if --tenants FILE --change FILE --trace FILE`` (:func:`what_if`) simulates the same
requests twice with the same seed: **before** (the current tenants file and pools) and **after** (the change
applied), and checks each tenant's figures against its SLO targets (``slo:`` in the tenants file,
:class:`~splitserve.tenancy.config.TenantSlo`: p99 TTFT and p99 ITL in milliseconds).

Traffic. The public traces' rows have no tenant, so each request of the trace is given one of the *current*
tenants by a seeded draw (``random.Random("splitserve-whatif:traffic:<seed>")``) with the change file's
``traffic:`` shares, in the tenants file's order (default: equal shares; a tenant left out of ``traffic:`` gets
none). The draw does not depend on the change, so both runs see the same requests with the same tenants. A
tenant the change adds brings *extra* requests: Poisson arrivals at ``rate_rps`` (or at ``share`` times the
trace's request rate) over the trace's span, each a copy of one of the trace's rows (lengths and prefix ids; the
rows in a seeded random order, none used twice before all are used). "After" is "before"'s requests, unchanged,
plus the new tenants'. Each request's prefix cache is scoped to its tenant's cache salt in that run (its own, or
its ``cache_group``'s), as the live router scopes it, so tenants reuse each other's prefixes only in a group.

The change file (YAML or JSON) holds one or more of ``add_tenant``, ``set_tenant`` and ``pools`` (and optionally
``traffic``)::

    traffic: {search: 3, batch: 1}       # the current tenants' shares of the trace (default: equal)
    add_tenant:                           # one, or a list
      name: analytics
      spec: {weight: 1, max_inflight: 32, slo: {ttft_p99_ms: 5000}}   # as under tenants: in the tenants file
      rate_rps: 0.5                       # or share: 0.25 (of the trace's request rate)
    set_tenant:                           # one, or a list: tenants-file fields to replace
      name: search
      weight: 3
      slo: {ttft_p99_ms: 600}
    pools: {prefill: 2, decode: 8}        # resize (either or both)

A tenant **holds** in a run when none of its requests failed or was left unfinished and its p99 TTFT and p99 ITL
(over its finished requests; ITL over every gap between two of its streams' tokens) are within its targets (a
tenant without targets holds when it is served). The change is **accepted** when every tenant that held before
still holds after and was refused no more requests by its limits than before, and every tenant the change adds,
or gives new targets (``set_tenant`` with ``slo``), holds after; otherwise **refused**, naming the tenants that
break and by how much. A tenant that already failed before does not refuse the change (it is reported). A change
after which the tenants' contract guarantees (``contract:``, :mod:`splitserve.tenancy.contracts`) sum past the
pools' decode slots or prefill speed is refused too, naming the resource; the simulation itself dispatches
through the live router's contract gate, so guarantees, caps and priority classes shape every tenant's figures.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from splitserve.proto.subjects import check_token
from splitserve.sim.cluster import Sim, SimConfig
from splitserve.sim.metrics import _pcts
from splitserve.sim.workload import SimRequest
from splitserve.tenancy.config import TenantsConfig, TenantSlo, TenantSpec, read_yaml_file
from splitserve.tenancy.contracts import overcommitted

__all__ = [
    "EXIT_ACCEPTED",
    "EXIT_REFUSED",
    "AddTenant",
    "Change",
    "Pools",
    "SetTenant",
    "WhatIf",
    "WhatIfError",
    "apply_change",
    "load_change",
    "tenant_requests",
    "what_if",
]

EXIT_ACCEPTED = 0
EXIT_REFUSED = 3  # 1 is a runtime failure and 2 a usage error for every splitserve command


class WhatIfError(ValueError):
    """A change file, or a change, that cannot be applied (the message says where)."""


class AddTenant(BaseModel):
    """A tenant to add, its tenants-file entry, and its traffic (exactly one of ``rate_rps`` and ``share``)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    spec: TenantSpec = Field(default_factory=TenantSpec)
    rate_rps: float | None = Field(default=None, gt=0.0, allow_inf_nan=False, strict=True)
    share: float | None = Field(default=None, gt=0.0, allow_inf_nan=False, strict=True)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_token(v, "tenant")

    @field_validator("spec", mode="before")
    @classmethod
    def _spec(cls, v: Any) -> Any:
        return {} if v is None else v  # ``spec:`` left empty in YAML: the defaults, as ``name: {}`` in a tenants file

    @model_validator(mode="after")
    def _traffic(self) -> AddTenant:
        if (self.rate_rps is None) == (self.share is None):
            raise ValueError("give the new tenant's traffic as exactly one of rate_rps (req/s) and share "
                             "(of the trace's request rate)")
        return self


class SetTenant(BaseModel):
    """An existing tenant's tenants-file fields to replace (``weight``, ``slo``, limits, ...): the extra keys."""

    model_config = ConfigDict(extra="allow")

    name: str

    @property
    def fields(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class Pools(BaseModel):
    """The cluster resized: prefill and decode worker counts (either or both)."""

    model_config = ConfigDict(extra="forbid")

    prefill: int | None = Field(default=None, ge=0, strict=True)
    decode: int | None = Field(default=None, ge=1, strict=True)

    @model_validator(mode="after")
    def _some(self) -> Pools:
        if self.prefill is None and self.decode is None:
            raise ValueError("pools: give prefill and/or decode")
        return self


def _listed(v: Any) -> Any:
    return [] if v is None else [v] if isinstance(v, dict) else v


class Change(BaseModel):
    """A proposed change (the change file)."""

    model_config = ConfigDict(extra="forbid")

    traffic: dict[str, float] | None = None
    add_tenant: list[AddTenant] = Field(default_factory=list)
    set_tenant: list[SetTenant] = Field(default_factory=list)
    pools: Pools | None = None

    @field_validator("add_tenant", "set_tenant", mode="before")
    @classmethod
    def _one_or_list(cls, v: Any) -> Any:
        return _listed(v)

    @field_validator("traffic")
    @classmethod
    def _shares(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if any(not math.isfinite(x) or x < 0 for x in v.values()) or sum(v.values()) <= 0:
            raise ValueError("traffic shares must be finite numbers >= 0, not all 0")
        return v

    @model_validator(mode="after")
    def _something(self) -> Change:
        if not (self.add_tenant or self.set_tenant or self.pools):
            raise ValueError("a change needs at least one of add_tenant, set_tenant, pools")
        names = [a.name for a in self.add_tenant] + [s.name for s in self.set_tenant]
        if len(names) != len(set(names)):
            raise ValueError("each tenant may be added or set once in a change")
        return self


def _errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(x) for x in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors())


def load_change(path: str | Path) -> Change:
    """Parse and validate a change file; raises :class:`WhatIfError` naming the file and the problem."""
    p = Path(path)
    raw = read_yaml_file(p, "change file", WhatIfError)
    if not isinstance(raw, dict):
        raise WhatIfError(f"change file {p}: expected a mapping with add_tenant, set_tenant and/or pools")
    try:
        return Change.model_validate(raw)
    except ValidationError as exc:
        raise WhatIfError(f"change file {p}: {_errors(exc)}") from None


def apply_change(tenants: TenantsConfig, change: Change) -> TenantsConfig:
    """The tenants file with the change's tenants added and set (validated as a tenants file is)."""
    specs = dict(tenants.tenants)
    for i, s in enumerate(change.set_tenant):
        old = specs.get(s.name)
        if old is None:
            raise WhatIfError(f"set_tenant[{i}]: no tenant {s.name!r} in the tenants file")
        if not s.fields:
            raise WhatIfError(f"set_tenant[{i}] ({s.name}): name the fields to change")
        try:  # each named field replaces the tenant's (slo included, whole)
            specs[s.name] = TenantSpec.model_validate({**old.model_dump(exclude_unset=True), **s.fields})
        except ValidationError as exc:
            raise WhatIfError(f"set_tenant[{i}] ({s.name}): {_errors(exc)}") from None
    for i, a in enumerate(change.add_tenant):
        if a.name in specs:
            raise WhatIfError(f"add_tenant[{i}]: tenant {a.name!r} is already in the tenants file (set_tenant "
                              "changes it)")
        specs[a.name] = a.spec
    try:
        return TenantsConfig.model_validate({"defaults": tenants.defaults, "tenants": specs, "open": tenants.open})
    except ValidationError as exc:
        raise WhatIfError(f"the changed tenants file: {_errors(exc)}") from None


def _scoped(r: SimRequest, tenant: str, request_id: str, arrival_s: float, tenants: TenantsConfig) -> SimRequest:
    # ``kind`` is the tenant: the simulator keeps ITL gaps per kind, which is how the per-tenant ITL is read.
    return replace(r, request_id=request_id, tenant=tenant, kind=tenant, arrival_s=arrival_s,
                   cache_scope=tenants.cache_salt(tenant), _hashes=None, _hash_bs=0, _hash_scope=None)


def tenant_requests(requests: Sequence[SimRequest], before: TenantsConfig, after: TenantsConfig, change: Change,
                    seed: int) -> tuple[list[SimRequest], list[SimRequest]]:
    """The requests of the two runs (see the module docstring): the trace's, each given a current tenant, and
    those plus the added tenants' own."""
    names = list(before.tenants)
    shares = change.traffic
    if shares is not None:
        unknown = sorted(set(shares) - set(names))
        if unknown:
            raise WhatIfError(f"traffic: {', '.join(unknown)} not in the tenants file (the trace is split among "
                              "the current tenants; an added tenant's traffic is its rate_rps or share)")
    weights = [1.0] * len(names) if shares is None else [float(shares.get(n, 0.0)) for n in names]
    rng = random.Random(f"splitserve-whatif:traffic:{seed}")
    picks = rng.choices(names, weights=weights, k=len(requests)) if requests else []
    base = list(zip(requests, picks, strict=True))
    runs: list[list[SimRequest]] = []
    for cfg in (before, after):
        runs.append([_scoped(r, t, r.request_id, r.arrival_s, cfg) for r, t in base])
    if not requests:
        return runs[0], runs[1]
    t0 = min(r.arrival_s for r in requests)
    span = max(r.arrival_s for r in requests) - t0
    trace_rate = len(requests) / span if span > 0 else float(len(requests))
    extra: list[SimRequest] = []
    for a in change.add_tenant:
        rate = a.rate_rps if a.rate_rps is not None else (a.share or 0.0) * trace_rate
        arng = random.Random(f"splitserve-whatif:add:{seed}:{a.name}")
        times: list[float] = []
        t = t0 + arng.expovariate(rate)
        while t <= t0 + max(span, 1.0):  # a trace of one instant still gets a second of the new traffic
            times.append(t)
            t += arng.expovariate(rate)
        # Rows in seeded random order, each used once before any is used again: a copied row is a whole prompt
        # the tenant's cache already holds, so drawing with replacement would flatter the new tenant.
        rows: list[int] = []
        while len(rows) < len(times):
            perm = list(range(len(requests)))
            arng.shuffle(perm)
            rows.extend(perm)
        for i, (t, k) in enumerate(zip(times, rows, strict=False)):
            extra.append(_scoped(requests[k], a.name, f"{a.name}-{i}", t, after))
    after_reqs = sorted(runs[1] + extra, key=lambda r: r.arrival_s)  # stable: the trace's first at a tie
    return runs[0], after_reqs


def _ms(d: dict[str, Any], key: str) -> float | None:
    return round(d[key] * 1000.0, 1) if d.get("n") else None


@dataclass
class TenantRun:
    """One tenant's figures in one run, and whether its targets held."""

    requests: int
    finished: int
    refused: int
    refused_by: dict[str, int]
    failed: int
    unfinished: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    throughput_rps: float
    holds: bool = True
    misses: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _judge(run: TenantRun, slo: TenantSlo | None) -> None:
    """Sets ``holds`` and says each miss with its figures."""
    miss = run.misses
    lost = run.failed + run.unfinished
    if lost:
        miss.append(f"{lost} of {run.requests} requests failed or never finished")
    if slo is not None and run.requests:
        for what, got, target in (("TTFT", run.ttft_p99_ms, slo.ttft_p99_ms), ("ITL", run.itl_p99_ms, slo.itl_p99_ms)):
            if target is None:
                continue
            if got is None:
                if what == "TTFT":  # no request finished: nothing met the target (an ITL needs 2+ tokens)
                    miss.append(f"{what} p99: no request finished (target {target:g} ms)")
            elif got > target:
                miss.append(f"{what} p99 {got:.1f} ms > {target:g} ms (+{got - target:.1f} ms, "
                            f"{got / target:.2f}x the target)")
    run.holds = not miss


def _per_tenant(sim: Sim, tenants: TenantsConfig) -> dict[str, TenantRun]:
    asked: dict[str, list[SimRequest]] = {}
    for r in sim.requests:
        asked.setdefault(r.tenant, []).append(r)
    done: dict[str, list[Any]] = {}
    for s in sim.done:
        done.setdefault(s.req.tenant, []).append(s)
    refused: dict[str, Counter[str]] = {}
    for r, why in sim.refused:
        refused.setdefault(r.tenant, Counter())[why] += 1
    failed = Counter(r.tenant for r, _ in sim.failed)
    out: dict[str, TenantRun] = {}
    for name in tenants.tenants:
        reqs, fin = asked.get(name, []), done.get(name, [])
        ttft = _pcts([s.first_token_s - s.req.arrival_s for s in fin])
        itl = _pcts(sim.itl_by_kind.get(name, ()))
        span = (max(s.finish_s for s in fin) - min(r.arrival_s for r in reqs)) if fin else 0.0
        ref = refused.get(name, Counter())
        nref = sum(ref.values())
        run = TenantRun(
            requests=len(reqs), finished=len(fin), refused=nref, refused_by=dict(sorted(ref.items())),
            failed=failed[name], unfinished=len(reqs) - len(fin) - nref - failed[name],
            ttft_p50_ms=_ms(ttft, "p50"), ttft_p99_ms=_ms(ttft, "p99"), itl_p50_ms=_ms(itl, "p50"),
            itl_p99_ms=_ms(itl, "p99"), throughput_rps=round(len(fin) / span, 4) if span > 0 else 0.0)
        _judge(run, tenants.slo(name))
        out[name] = run
    return out


def _slo_dict(slo: TenantSlo | None) -> dict[str, float | None]:
    return {"ttft_p99_ms": slo.ttft_p99_ms if slo else None, "itl_p99_ms": slo.itl_p99_ms if slo else None}


@dataclass
class WhatIf:
    """The answer: per tenant before and after, the verdict, and the tenants that break (and why)."""

    verdict: str  # "accepted" | "refused"
    tenants: list[dict[str, Any]]
    breaks: list[dict[str, Any]]
    already_failing: list[str]
    runs: dict[str, dict[str, Any]]
    change: dict[str, Any]
    seed: int

    @property
    def accepted(self) -> bool:
        return self.verdict == "accepted"

    @property
    def exit_code(self) -> int:
        return EXIT_ACCEPTED if self.accepted else EXIT_REFUSED

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "breaks": self.breaks, "already_failing": self.already_failing,
                "change": self.change, "runs": self.runs, "tenants": self.tenants, "seed": self.seed}


def _run(cfg: SimConfig, reqs: list[SimRequest], tenants: TenantsConfig) -> tuple[dict[str, TenantRun],
                                                                                    dict[str, Any]]:
    sim = Sim(replace(cfg, tenants=tenants, tenants_file=None), reqs)
    res = sim.run()
    s = res.summary
    slots = sum(w.max_seqs for w in sim.decoders)
    rate = sum(w.rate for w in sim.prefillers) if sim.prefillers else None
    return _per_tenant(sim, tenants), {
        # what the contracts' guarantees are checked against (splitserve.tenancy.contracts.overcommitted)
        "capacity": {"decode_slots": slots, "prefill_tokens_per_s": rate},
        "contract_problems": overcommitted(tenants.contracts(), slots, rate),
        "prefill": cfg.prefill, "decode": cfg.decode, "long_decode": cfg.long_decode, "gpus": cfg.gpus,
        "requests": s["requests"], "finished": s["finished"], "refused": s["refused"], "failed": s["failed"],
        "sim_s": s["sim_s"], "cache_hit_ratio": s["cache_hit_ratio"],
        "utilisation": {k: v for k, v in s["utilisation"].items() if k != "per_worker"}}


def what_if(cfg: SimConfig, tenants: TenantsConfig, change: Change, requests: Sequence[SimRequest]) -> WhatIf:
    """Simulate ``requests`` (a trace's, tenants not yet given) before and after ``change`` on ``cfg`` (the
    current pools; its seed seeds the traffic split too) and judge it (see the module docstring)."""
    if cfg.pools:
        raise WhatIfError("the what-if simulates one model's pools (not --models)")
    if tenants.open or not tenants.tenants:
        raise WhatIfError("the what-if needs a tenants file that names its tenants")
    after_tenants = apply_change(tenants, change)
    after_cfg = cfg
    if change.pools is not None:
        p = change.pools
        after_cfg = replace(cfg, prefill=cfg.prefill if p.prefill is None else p.prefill,
                            decode=cfg.decode if p.decode is None else p.decode)
    before_reqs, after_reqs = tenant_requests(requests, tenants, after_tenants, change, cfg.seed)
    before, run_b = _run(cfg, before_reqs, tenants)
    after, run_a = _run(after_cfg, after_reqs, after_tenants)

    added = {a.name for a in change.add_tenant}
    promised = added | {s.name for s in change.set_tenant if "slo" in s.fields}  # must hold after
    rows: list[dict[str, Any]] = []
    breaks: list[dict[str, Any]] = []
    failing: list[str] = []
    for name in after_tenants.tenants:
        b, a = before.get(name), after[name]
        why: list[str] = []
        if name in promised or (b is not None and b.holds):
            why = list(a.misses)
            if b is not None and b.holds and a.refused > b.refused:
                why.append(f"refused {a.refused} requests by its limits (was {b.refused})")
        elif b is not None:  # failed before and promised nothing new: reported, not held against the change
            failing.append(name)
        if why:
            was = ""
            if b is not None and b.requests:
                was = f" (before: TTFT p99 {b.ttft_p99_ms} ms, ITL p99 {b.itl_p99_ms} ms)"
            breaks.append({"tenant": name, "reasons": why, "summary": f"{name}: {'; '.join(why)}{was}"})
        status = "added" if name in added else "set" if any(s.name == name for s in change.set_tenant) else "same"
        rows.append({"tenant": name, "status": status, "breaks": why,
                     "slo_before": _slo_dict(tenants.slo(name)) if b else None,
                     "slo_after": _slo_dict(after_tenants.slo(name)),
                     "before": b.to_dict() if b is not None else None, "after": a.to_dict()})
    # Guarantees the pools cannot honour after the change break the change (those already over capacity before
    # are reported, as a tenant already failing is).
    for problem in run_a["contract_problems"]:
        if problem not in run_b["contract_problems"]:
            breaks.append({"tenant": None, "reasons": [problem], "summary": f"contracts: {problem}"})
    desc: dict[str, Any] = {
        "add_tenant": [{"name": a.name, "rate_rps": a.rate_rps, "share": a.share,
                        "requests": after[a.name].requests} for a in change.add_tenant],
        "set_tenant": [{"name": s.name, "fields": sorted(s.fields)} for s in change.set_tenant],
        "pools": None if change.pools is None else {"prefill": after_cfg.prefill, "decode": after_cfg.decode},
        "traffic": change.traffic,
    }
    return WhatIf("refused" if breaks else "accepted", rows, breaks, failing, {"before": run_b, "after": run_a},
                  desc, cfg.seed)
