"""Goodput under SLO on a mixed-SLO workload: ``slo`` routing vs ``kvaware``, with and without SLO admission.

Two tenants share one cluster (ShareGPT lengths from ``../shared/data/traces``, Poisson arrivals, seeded):

* ``interactive``: the trace's short prompts (<= 1,024 tokens), tight targets (TTFT 400 ms, ITL 80 ms);
* ``batch``: the trace's long prompts (>= 3,072 tokens), loose targets (TTFT 15 s, ITL 150 ms).

The very same requests run under four router settings: kvaware, slo, kvaware + admission, slo + admission.
A request is *good* when its TTFT and its ITL (time per output token after the first: its mean inter-token gap)
both meet its tenant's targets; goodput is good requests per second of arrivals; a refused request is not good.
Printed per setting: goodput, its ratio to kvaware's, per-tenant attainment (TTFT ok, ITL ok, both), refusals.

``--mode sim`` runs the capacity-planning simulator (the live routing policy over simulated workers: 8 H100s as
four TP2 instances of a 70B model by default, colocated or ``--prefill N`` disaggregated). ``--mode live`` replays
the same requests, scaled to this machine (:mod:`bench.slo_live`), against a real ``splitserve up`` stack of mock
workers per setting (``--decode`` defaults to 2 there). Each mode is a :data:`Runner`: it takes the
:class:`Workload` and a :class:`Setting` and returns one :class:`Outcome` per request; :func:`compare` does the
rest, identically for both modes.

    python -m bench.slo_goodput [--mode sim] [--duration 120] [--interactive-rate 6] [--batch-rate 1.2]
                                [--prefill 0] [--decode 4] [--seed 0] [--json]
    python -m bench.slo_goodput --mode live --duration 30 --interactive-rate 8 --batch-rate 1 --decode 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.sim import SimConfig, SimRequest, simulate
from splitserve.sim.workload import load_sharegpt, poisson_arrivals
from splitserve.tenancy.config import TenantsConfig


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    ttft_ms: float
    itl_ms: float


@dataclass(frozen=True, slots=True)
class Workload:
    requests: list[SimRequest]
    tenants: dict[str, Tenant]
    duration_s: float

    def tenants_config(self) -> TenantsConfig:
        return TenantsConfig.model_validate({"tenants": {
            t.name: {"slo": {"ttft_p99_ms": t.ttft_ms, "itl_p99_ms": t.itl_ms}} for t in self.tenants.values()}})


@dataclass(frozen=True, slots=True)
class Setting:
    strategy: str
    admission: bool

    @property
    def label(self) -> str:
        return self.strategy + (" + admission" if self.admission else "")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's fate: ``ttft_s`` / ``itl_s`` (mean inter-token gap) when it finished, else None."""

    request_id: str
    tenant: str
    refused: bool
    ttft_s: float | None = None
    itl_s: float | None = None


Runner = Callable[[Workload, Setting], list[Outcome]]

SETTINGS = (Setting("kvaware", False), Setting("slo", False), Setting("kvaware", True), Setting("slo", True))


def mixed_workload(duration_s: float, interactive_rate: float, batch_rate: float, seed: int = 0,
                   interactive: Tenant = Tenant("interactive", 400.0, 80.0),
                   batch: Tenant = Tenant("batch", 15_000.0, 150.0)) -> Workload:
    """ShareGPT lengths split by prompt length into the two tenants, Poisson arrivals per tenant."""
    rows = load_sharegpt("sharegpt", rate=1.0, seed=seed)
    short = [(r.prompt_tokens, r.output_tokens) for r in rows if r.prompt_tokens <= 1024]
    long = [(r.prompt_tokens, r.output_tokens) for r in rows if r.prompt_tokens >= 3072]
    rng = random.Random(seed)
    out: list[SimRequest] = []
    for k, (tenant, rate, pool) in enumerate(((interactive, interactive_rate, short), (batch, batch_rate, long))):
        if rate <= 0:
            continue
        times = poisson_arrivals(int(rate * duration_s * 1.5) + 10, rate, seed + 11 * (k + 1))
        for t in times:
            if t >= duration_s:
                break
            p, o = rng.choice(pool)
            out.append(SimRequest("", t, p, o, tenant=tenant.name, kind=tenant.name))
    out.sort(key=lambda r: r.arrival_s)
    for i, r in enumerate(out):
        r.request_id = f"{r.tenant[0]}{i}"
    return Workload(out, {interactive.name: interactive, batch.name: batch}, duration_s)


def sim_config(prefill: int = 0, decode: int = 4) -> SimConfig:
    """8 H100s as four TP2 instances of a 70B GQA model (Splitwise's measured llama2-70b step times)."""
    return SimConfig(prefill=prefill, decode=decode, model="llama-3.3-70b",
                     prefill_latency="splitwise:llama2-70b:h100:tp2", fabric="nvlink-h100", gpus_per_prefill=2,
                     gpus_per_decode=2, max_seqs=256, decode_token_budget=2048)


def sim_runner(base: SimConfig) -> Runner:
    def run(w: Workload, s: Setting) -> list[Outcome]:
        reqs = [dataclasses.replace(r, _hashes=None, _hash_bs=0) for r in w.requests]  # fresh per run
        cfg = dataclasses.replace(base, strategy=s.strategy, slo_admission=s.admission, tenants=w.tenants_config())
        sim_res = simulate(cfg, reqs)
        rows = {row["id"]: row for row in sim_res.requests}
        refused = {r.request_id for r in reqs} - set(rows)
        out = []
        for r in reqs:
            row = rows.get(r.request_id)
            if row is None:
                out.append(Outcome(r.request_id, r.tenant, r.request_id in refused))
            else:
                out.append(Outcome(r.request_id, r.tenant, False, row["ttft_s"], row["tpot_s"]))
        return out
    return run


def score(w: Workload, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Goodput under SLO and per-tenant attainment (each request against its own tenant's targets)."""
    per: dict[str, dict[str, int]] = {t: {"n": 0, "ttft_ok": 0, "itl_ok": 0, "both_ok": 0, "refused": 0,
                                          "unfinished": 0} for t in w.tenants}
    for o in outcomes:
        d = per[o.tenant]
        d["n"] += 1
        if o.refused:
            d["refused"] += 1
            continue
        if o.ttft_s is None or o.itl_s is None:
            d["unfinished"] += 1
            continue
        t = w.tenants[o.tenant]
        a, b = o.ttft_s * 1000 <= t.ttft_ms, o.itl_s * 1000 <= t.itl_ms
        d["ttft_ok"] += a
        d["itl_ok"] += b
        d["both_ok"] += a and b
    good = sum(d["both_ok"] for d in per.values())
    return {"goodput_rps": good / w.duration_s, "good": good, "requests": len(outcomes),
            "refused": sum(d["refused"] for d in per.values()),
            "tenants": {t: {**d, "attainment": d["both_ok"] / d["n"] if d["n"] else 0.0} for t, d in per.items()}}


def compare(w: Workload, runner: Runner, settings: Sequence[Setting] = SETTINGS) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for s in settings:
        t0 = time.perf_counter()
        rows[s.label] = {**score(w, runner(w, s)), "wall_s": round(time.perf_counter() - t0, 2)}
    base = rows.get("kvaware", {}).get("goodput_rps") or 0.0
    for r in rows.values():
        r["vs_kvaware"] = r["goodput_rps"] / base if base else None
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["sim", "live"], default="sim")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--interactive-rate", type=float, default=6.0)
    ap.add_argument("--batch-rate", type=float, default=1.2)
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-scale", type=float, default=4.0, help="live: prompts this many times shorter")
    ap.add_argument("--max-output", type=int, default=48, help="live: outputs capped at this many tokens")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    w = mixed_workload(a.duration, a.interactive_rate, a.batch_rate, a.seed)
    if a.mode == "live":  # a real stack per setting, the workload scaled to what this machine replays
        from bench.slo_live import live_runner, scaled

        w = scaled(w, a.prompt_scale, a.max_output)
        runner = live_runner(a.prefill, a.decode)
    else:
        runner = sim_runner(sim_config(a.prefill, a.decode))
    rows = compare(w, runner)
    out = {"mode": a.mode, "duration_s": a.duration, "interactive_rate": a.interactive_rate,
           "batch_rate": a.batch_rate, "prefill": a.prefill, "decode": a.decode, "seed": a.seed,
           "requests": len(w.requests), "tenants": {t.name: dataclasses.asdict(t) for t in w.tenants.values()},
           "settings": rows}
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    tn = list(w.tenants)
    print(f"mode {a.mode}: {len(w.requests)} requests over {a.duration:.0f} s "
          f"({a.interactive_rate}/s interactive, {a.batch_rate}/s batch), {a.prefill}P:{a.decode}D, seed {a.seed}")
    print("targets: " + ", ".join(f"{t.name} TTFT {t.ttft_ms:.0f} ms ITL {t.itl_ms:.0f} ms"
                                  for t in w.tenants.values()))
    head = " ".join(f"{t + ' ttft/itl/both':>30}" for t in tn)
    print(f"{'setting':>20} {'goodput/s':>9} {'vs kv':>6} {'refused':>7} {head}")
    for label, r in rows.items():
        cells = []
        for t in tn:
            d = r["tenants"][t]
            n = d["n"] or 1
            cells.append(f"{d['ttft_ok'] / n:8.1%} {d['itl_ok'] / n:8.1%} {d['both_ok'] / n:8.1%}    ")
        vs = f"{r['vs_kvaware']:.2f}" if r["vs_kvaware"] is not None else "-"
        print(f"{label:>20} {r['goodput_rps']:9.3f} {vs:>6} {r['refused']:7d} " + " ".join(f"{c:>30}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
