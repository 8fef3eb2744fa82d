"""``splitserve sim``: run the capacity-planning simulator from the command line.

    splitserve sim run  --trace azure-conv --limit 2000 --rate-factor 4 --prefill 2 --decode 6 [--plots DIR] [--json]
    splitserve sim plan --trace mooncake --limit 1000 --sizes 2-8 --ttft-slo 2 --tpot-slo 0.1 [--json]

    splitserve sim what-if --tenants T.yaml --change C.yaml --trace mooncake --prefill 2 --decode 6 [--json]

``what-if`` (:mod:`splitserve.sim.whatif`) simulates the trace before and after a change to the tenants (a new
tenant, new SLO targets or weights) or the pools and says whether every tenant's SLO still holds: exit 0 accepted,
3 refused, 2 a usage error.

Several models and LoRA adapters (``run``): ``--models a:2:6,b:1:3`` (one pool per model: name:prefill:decode;
then --prefill/--decode are unused) with ``--mix a=0.7,b=0.3`` (each request's model, seeded; default: equal),
and ``--adapters 64 --zipf 1.1 --adapter-share 0.8`` (that share of requests for one of 64 adapters of its model,
Zipf popularity) on workers with ``--max-loras 4`` slots loaded on demand, ``--lora-load-ms 50`` per load,
routed with ``--lora-affinity`` (default) or ``--no-lora-affinity``. The report adds per-model figures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import typer

sim_app = typer.Typer(no_args_is_help=True, help="capacity planning: simulate a cluster running the live policies")


@dataclass
class _Base:
    trace: str
    limit: int | None
    rate_factor: float
    rate: float
    model: str
    latency: str
    decode_latency: str | None
    tp: int
    fabric: str
    kv_tokens: int | None
    max_seqs: int
    chunked: bool
    strategy: str
    disagg_threshold: int
    max_stall_ms: float
    long_decode: int
    tenants: str | None
    ttft_slo: float
    tpot_slo: float
    attainment: float
    seed: int


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _load(b: _Base) -> list[Any]:
    from splitserve.sim.workload import WorkloadError, load_sharegpt, load_trace, scale_rate

    try:
        if b.trace == "sharegpt" or b.trace.endswith("sharegpt_8k_filtered_stats_llama2_tokenizer.csv"):
            reqs = load_sharegpt(b.trace, b.limit, rate=b.rate, seed=b.seed)
        else:
            reqs = load_trace(b.trace, b.limit)
        if not reqs:
            _fail(f"trace {b.trace!r} has no requests")
        return scale_rate(reqs, b.rate_factor)
    except (WorkloadError, OSError) as exc:
        _fail(str(exc))
    raise AssertionError


def _config(b: _Base, prefill: int, decode: int) -> Any:
    from splitserve.sim.cluster import SimConfig
    from splitserve.sim.latency import latency_model

    try:
        latency_model(b.latency)
        if b.decode_latency:
            latency_model(b.decode_latency)
        from splitserve.sim.fabric import fabric, model_spec

        fabric(b.fabric)
        model_spec(b.model)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    return SimConfig(prefill=prefill, decode=decode, long_decode=b.long_decode, model=b.model,
                     prefill_latency=b.latency, decode_latency=b.decode_latency, fabric=b.fabric,
                     gpus_per_prefill=b.tp, gpus_per_decode=b.tp, kv_tokens=b.kv_tokens, max_seqs=b.max_seqs,
                     chunked_prefill=b.chunked, strategy=b.strategy, disagg_threshold=b.disagg_threshold,
                     max_stall_ms=None if b.max_stall_ms < 0 else b.max_stall_ms, tenants_file=b.tenants,
                     ttft_slo_s=b.ttft_slo, tpot_slo_s=b.tpot_slo, attainment=b.attainment, seed=b.seed)


def _base(trace: str, limit: int | None, rate_factor: float, rate: float, model: str, latency: str,
          decode_latency: str | None, tp: int, fabric: str, kv_tokens: int | None, max_seqs: int, chunked: bool,
          strategy: str, disagg_threshold: int, max_stall_ms: float, long_decode: int, tenants: str | None,
          ttft_slo: float, tpot_slo: float, attainment: float, seed: int) -> _Base:
    from splitserve.routing import available

    if strategy not in available():
        _fail(f"unknown strategy {strategy!r}; available: {', '.join(available())}")
    if rate_factor <= 0:
        _fail("--rate-factor must be positive")
    return _Base(trace, limit, rate_factor, rate, model, latency, decode_latency, tp, fabric, kv_tokens, max_seqs,
                 chunked, strategy, disagg_threshold, max_stall_ms, long_decode, tenants, ttft_slo, tpot_slo,
                 attainment, seed)


TraceOpt = typer.Option("azure-conv", "--trace",
                        help="mooncake | azure-conv | azure-code | sharegpt | a .jsonl/.csv file")
LimitOpt = typer.Option(None, "--limit", help="first N requests of the trace")
RateFactorOpt = typer.Option(1.0, "--rate-factor", help="multiply the trace's arrival rate")
RateOpt = typer.Option(1.0, "--rate", help="ShareGPT (lengths only): Poisson arrivals, req/s")
ModelOpt = typer.Option("llama2-70b", "--model", help="KV bytes per token and memory: opt-13b, llama2-70b, ...")
LatencyOpt = typer.Option("splitwise:llama2-70b:h100:tp8", "--latency",
                          help="distserve:MODEL:tpN | splitwise:MODEL:GPU:tpN | a saved calibration JSON")
DecodeLatencyOpt = typer.Option(None, "--decode-latency", help="decoders' model (default: --latency)")
TpOpt = typer.Option(8, "--gpus-per-worker", help="GPUs per worker (cost and KV memory)")
FabricOpt = typer.Option("efa", "--fabric", help="nvlink | nvlink-h100 | efa | tcp100 | local")
KvOpt = typer.Option(None, "--kv-tokens", help="KV capacity per worker (default: GPU memory left after weights)")
MaxSeqsOpt = typer.Option(256, "--max-seqs", help="most sequences a decoder runs at once")
ChunkOpt = typer.Option(True, "--chunked/--no-chunked", help="chunked prefill on decoders")
StrategyOpt = typer.Option("kvaware", "--strategy")
ThresholdOpt = typer.Option(512, "--disagg-threshold")
StallOpt = typer.Option(100.0, "--max-stall-ms", help="the live router's stall rule (negative: off)")
LongOpt = typer.Option(0, "--long-decode", help="long-context decoders")
TenantsOpt = typer.Option(None, "--tenants", help="a tenants file (weights and quotas)")
TtftOpt = typer.Option(1.0, "--ttft-slo", help="seconds")
TpotOpt = typer.Option(0.1, "--tpot-slo", help="seconds per output token")
AttOpt = typer.Option(0.9, "--attainment", help="share of requests that must meet each SLO")
SeedOpt = typer.Option(0, "--seed")


@sim_app.command("run")
def run_cmd(
    prefill: int = typer.Option(1, "--prefill", min=0, help="prefill workers (0: colocated)"),
    decode: int = typer.Option(1, "--decode", min=0),
    rates: str | None = typer.Option(None, "--rates", help="also sweep these rate factors (goodput vs rate)"),
    plots: Path | None = typer.Option(None, "--plots", help="write PNG plots to this folder"),
    as_json: bool = typer.Option(False, "--json"),
    models: str | None = typer.Option(None, "--models", help="model pools name:prefill:decode, comma-separated "
                                      "(replaces --prefill/--decode)"),
    mix: str | None = typer.Option(None, "--mix", help="each request's model: name=weight, comma-separated "
                                   "(default: equal)"),
    adapters: int = typer.Option(0, "--adapters", min=0, help="LoRA adapters per model (0: none)"),
    zipf: float = typer.Option(1.1, "--zipf", help="Zipf exponent of the adapters' popularity"),
    adapter_share: float = typer.Option(1.0, "--adapter-share", min=0.0, max=1.0,
                                        help="share of requests for an adapter (the rest: the base model)"),
    max_loras: int = typer.Option(0, "--max-loras", min=0, help="adapter slots per worker, loaded on demand "
                                  "(0: every adapter loaded)"),
    lora_load_ms: float = typer.Option(50.0, "--lora-load-ms", min=0.0, help="one adapter load"),
    lora_affinity: bool = typer.Option(True, "--lora-affinity/--no-lora-affinity",
                                       help="prefer workers with the adapter loaded (the live router's rule)"),
    slo_admission: bool = typer.Option(False, "--slo-admission/--no-slo-admission",
                                       help="refuse at intake a request no worker can serve within its SLO targets "
                                       "(the tenant's, else --ttft-slo/--tpot-slo)"),
    admission_slack: float = typer.Option(1.0, "--admission-slack", min=0.01,
                                          help="refuse when predicted TTFT > target x this"),
    trace: str = TraceOpt, limit: int | None = LimitOpt, rate_factor: float = RateFactorOpt, rate: float = RateOpt,
    model: str = ModelOpt, latency: str = LatencyOpt, decode_latency: str | None = DecodeLatencyOpt, tp: int = TpOpt,
    fabric: str = FabricOpt, kv_tokens: int | None = KvOpt, max_seqs: int = MaxSeqsOpt, chunked: bool = ChunkOpt,
    strategy: str = StrategyOpt, disagg_threshold: int = ThresholdOpt, max_stall_ms: float = StallOpt,
    long_decode: int = LongOpt, tenants: str | None = TenantsOpt, ttft_slo: float = TtftOpt,
    tpot_slo: float = TpotOpt, attainment: float = AttOpt, seed: int = SeedOpt,
) -> None:
    """Simulate one deployment on a trace: latency percentiles, SLO attainment, goodput, utilisation."""
    from splitserve.sim.cluster import simulate
    from splitserve.sim.planner import rate_sweep

    b = _base(trace, limit, rate_factor, rate, model, latency, decode_latency, tp, fabric, kv_tokens, max_seqs,
              chunked, strategy, disagg_threshold, max_stall_ms, long_decode, tenants, ttft_slo, tpot_slo,
              attainment, seed)
    if decode + long_decode < 1 and not models:
        _fail("the cluster needs at least one decoder (--decode or --long-decode)")
    reqs = _load(b)
    base = replace(_config(b, prefill, decode), slo_admission=slo_admission, admission_slack=admission_slack)
    cfg, reqs = _apply_models(_Models(models, mix, adapters, zipf, adapter_share, max_loras, lora_load_ms,
                                      lora_affinity), base, reqs, seed)
    try:
        res = simulate(cfg, reqs)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    curve = None
    if rates:
        try:
            factors = [float(x) for x in rates.split(",") if x.strip()]
        except ValueError:
            _fail(f"--rates must be comma-separated numbers, not {rates!r}")
        curve = rate_sweep(cfg, reqs, factors)
    out = res.to_dict()
    if len(res.summary["utilisation"]["per_worker"]) > 64:  # thousands of rows help nobody on a terminal
        out["utilisation"] = {k: v for k, v in out["utilisation"].items() if k != "per_worker"}
    if curve is not None:
        out["goodput_vs_rate"] = curve
    if plots is not None:
        from splitserve.sim.plots import plot_all

        label = models or f"{prefill}P:{decode}D {strategy}"
        try:
            out["plots"] = [str(p) for p in plot_all(res, plots, {label: curve} if curve else None, label)]
        except RuntimeError as exc:
            _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(out, default=float))
        return
    _print_summary(res.summary, cfg.gpus)
    _print_models(res.summary)
    if curve:
        typer.echo("goodput vs rate:")
        for r in curve:
            typer.echo(f"  {r['rate_rps']:8.3f} req/s -> goodput {r['goodput_rps']:8.3f} req/s  SLO met {r['met']}")
    for p in out.get("plots", []):
        typer.echo(f"plot: {p}")


def _fmt(d: dict[str, Any], unit: float = 1000.0) -> str:
    if not d.get("n"):
        return "-"
    return f"p50 {d['p50'] * unit:9.1f}  p90 {d['p90'] * unit:9.1f}  p99 {d['p99'] * unit:9.1f} ms"


def _print_summary(s: dict[str, Any], gpus: int) -> None:
    typer.echo(f"requests {s['requests']} (finished {s['finished']}, refused {s['refused']}, failed {s['failed']}) "
               f"at {s['rate_rps']:.3f} req/s on {gpus} GPUs; simulated {s['sim_s']:.1f} s")
    typer.echo(f"TTFT  {_fmt(s['ttft_s'])}")
    typer.echo(f"ITL   {_fmt(s['itl_s'])}")
    typer.echo(f"TPOT  {_fmt(s['tpot_s'])}")
    typer.echo(f"e2e   {_fmt(s['e2e_s'])}")
    slo = s["slo"]
    typer.echo(f"SLO TTFT<={slo['ttft_s']}s: {slo['ttft_ok']:.1%}  TPOT<={slo['tpot_s']}s: {slo['tpot_ok']:.1%}  "
               f"met at {slo['attainment']:.0%}: {slo['met']}  goodput {s['goodput_rps']:.3f} req/s "
               f"({s['goodput_per_gpu_rps']:.4f} per GPU)")
    adm = s.get("admission")
    if adm is not None:
        typer.echo(f"SLO admission refused {adm['refused']} {adm['by_reason']} by tenant {adm['by_tenant']}")
    u = s["utilisation"]
    typer.echo(f"routes {s['routes']}  cache hit {s['cache_hit_ratio']:.1%}  "
               f"KV moved {s['kv_bytes_moved'] / 1e9:.1f} GB  "
               f"utilisation prefill {u['prefill']:.1%} decode {u['decode']:.1%}")


def parse_pools(spec: str) -> list[tuple[str, int, int]]:
    """``--models a:2:6,b:1:3`` -> [(name, prefill, decode), ...] (a name may hold ``:``; the counts are last)."""
    out: list[tuple[str, int, int]] = []
    for part in (x.strip() for x in spec.split(",")):
        if not part:
            continue
        bits = part.rsplit(":", 2)
        name = bits[0] if len(bits) == 3 else ""
        try:
            prefill, decode = int(bits[1]), int(bits[2])
        except (ValueError, IndexError):
            prefill = decode = -1
        if not name or prefill < 0 or decode < 1:
            raise ValueError(f"--models takes name:prefill:decode (decode >= 1), not {part!r}")
        out.append((name, prefill, decode))
    names = [n for n, _, _ in out]
    if not out or len(set(names)) != len(names):
        raise ValueError(f"--models must name each model once: {spec!r}")
    return out


def parse_mix(spec: str | None, names: list[str]) -> dict[str, float]:
    """``--mix a=0.7,b=0.3`` -> {name: weight} over the pools' ``names`` (None: equal weights; a model left out
    gets no requests)."""
    if not spec:
        return dict.fromkeys(names, 1.0)
    out: dict[str, float] = {}
    for part in (x.strip() for x in spec.split(",")):
        if not part:
            continue
        name, _, w = part.rpartition("=")
        try:
            weight = float(w)
        except ValueError:
            weight = -1.0
        if name not in names or weight < 0:
            raise ValueError(f"--mix takes model=weight for the models of --models ({', '.join(names)}), "
                             f"not {part!r}")
        out[name] = weight
    if not out or sum(out.values()) <= 0:
        raise ValueError("--mix needs a positive weight")
    return out


@dataclass
class _Models:
    """The multi-model and adapter options of ``run``."""

    models: str | None
    mix: str | None
    adapters: int
    zipf: float
    adapter_share: float
    max_loras: int
    lora_load_ms: float
    lora_affinity: bool


def _apply_models(m: _Models, cfg: Any, reqs: list[Any], seed: int) -> tuple[Any, list[Any]]:
    """The config with its model pools and adapter slots, and the requests with their models and adapters."""
    from dataclasses import replace

    from splitserve.sim.cluster import ModelPool
    from splitserve.sim.workload import WorkloadError, assign_adapters, assign_models

    load_s = m.lora_load_ms / 1000.0
    try:
        if m.models:
            pools = parse_pools(m.models)
            if cfg.long_decode:
                _fail("--long-decode is not simulated with --models")
            cfg = replace(cfg, pools=[ModelPool(n, p, d, m.max_loras, load_s) for n, p, d in pools])
            reqs = assign_models(reqs, parse_mix(m.mix, [n for n, _, _ in pools]), seed)
        elif m.mix:
            _fail("--mix needs --models")
        cfg = replace(cfg, max_loras=m.max_loras, lora_load_s=load_s, lora_affinity=m.lora_affinity)
        if m.adapters:
            reqs = assign_adapters(reqs, m.adapters, m.zipf, m.adapter_share, seed)
    except (ValueError, WorkloadError) as exc:
        _fail(str(exc))
    return cfg, reqs


def _print_models(s: dict[str, Any]) -> None:
    if "models" not in s:
        return
    typer.echo(f"{'model':<16} {'P':>3} {'D':>3} {'done':>6} {'TTFT p50':>10} {'TTFT p99':>10} {'req/s':>8} "
               f"{'loads':>6} {'loads/req':>9} {'peak':>4}")
    for name, m in s["models"].items():
        t = m["ttft_s"]
        p50 = f"{t['p50'] * 1000:.1f}" if t.get("n") else "-"
        p99 = f"{t['p99'] * 1000:.1f}" if t.get("n") else "-"
        typer.echo(f"{name:<16} {m['prefill']:>3} {m['decode']:>3} {m['finished']:>6} {p50:>10} {p99:>10} "
                   f"{m['throughput_rps']:>8.2f} {m['adapter_loads']:>6} {m['loads_per_request']:>9.3f} "
                   f"{m['peak_loaded']:>4}")
    a = s["adapters"]
    typer.echo(f"adapters: {a['requests']} requests, {a['loads']} loads ({a['loads_per_request']:.3f} per request), "
               f"affinity {'on' if a['affinity'] else 'off'}  (TTFT in ms)")


def _sizes(spec: str) -> list[int]:
    out: list[int] = []
    try:
        for part in spec.split(","):
            if "-" in part:
                a, b = part.split("-")
                out.extend(range(int(a), int(b) + 1))
            elif part.strip():
                out.append(int(part))
    except ValueError:
        _fail(f"--sizes takes counts like 2-8 or 2,4,8, not {spec!r}")
    if not out or min(out) < 1:
        _fail("--sizes must name worker counts >= 1")
    return out


@sim_app.command("plan")
def plan_cmd(
    sizes: str = typer.Option("2-8", "--sizes", help="worker counts to try (e.g. 2-8 or 4,8,16)"),
    strategies: str = typer.Option("kvaware", "--strategies", help="comma-separated"),
    thresholds: str = typer.Option("512", "--thresholds", help="disaggregation thresholds, comma-separated"),
    colocated: bool = typer.Option(True, "--colocated/--no-colocated", help="also try 0 prefillers"),
    as_json: bool = typer.Option(False, "--json"),
    trace: str = TraceOpt, limit: int | None = LimitOpt, rate_factor: float = RateFactorOpt, rate: float = RateOpt,
    model: str = ModelOpt, latency: str = LatencyOpt, decode_latency: str | None = DecodeLatencyOpt, tp: int = TpOpt,
    fabric: str = FabricOpt, kv_tokens: int | None = KvOpt, max_seqs: int = MaxSeqsOpt, chunked: bool = ChunkOpt,
    max_stall_ms: float = StallOpt, long_decode: int = LongOpt, tenants: str | None = TenantsOpt,
    ttft_slo: float = TtftOpt, tpot_slo: float = TpotOpt, attainment: float = AttOpt, seed: int = SeedOpt,
) -> None:
    """Sweep P:D splits (and strategies, thresholds) and print the cheapest configuration meeting the SLO."""
    from splitserve.routing import available
    from splitserve.sim.planner import plan

    strats = [s.strip() for s in strategies.split(",") if s.strip()]
    bad = [s for s in strats if s not in available()]
    if bad or not strats:
        _fail(f"unknown strategies {bad}; available: {', '.join(available())}")
    try:
        ths = [int(x) for x in thresholds.split(",") if x.strip()]
    except ValueError:
        _fail(f"--thresholds must be integers, not {thresholds!r}")
    b = _base(trace, limit, rate_factor, rate, model, latency, decode_latency, tp, fabric, kv_tokens, max_seqs,
              chunked, strats[0], ths[0], max_stall_ms, long_decode, tenants, ttft_slo, tpot_slo, attainment, seed)
    reqs = _load(b)
    p = plan(_config(b, 1, 1), reqs, sizes=_sizes(sizes), strategies=strats, thresholds=ths, colocated=colocated)
    if as_json:
        typer.echo(json.dumps(p.to_dict(), default=float))
    else:
        typer.echo(f"{'P':>3} {'D':>3} {'GPUs':>5} {'strategy':>11} {'thresh':>7} {'TTFT ok':>8} {'TPOT ok':>8} "
                   f"{'goodput':>9}  met")
        for r in p.rows:
            typer.echo(f"{r['prefill']:>3} {r['decode']:>3} {r['gpus']:>5} {r['strategy']:>11} "
                       f"{r['disagg_threshold']:>7} "
                       f"{r['ttft_ok']:>8.1%} {r['tpot_ok']:>8.1%} {r['goodput_rps']:>9.3f}  {r['met']}")
        if p.best is None:
            typer.echo("no configuration in the sweep meets the SLO: try larger --sizes")
        else:
            bb = p.best
            typer.echo(f"cheapest: {bb['prefill']} prefill + {bb['decode']} decode workers ({bb['gpus']} GPUs), "
                       f"{bb['strategy']}, threshold {bb['disagg_threshold']}: goodput {bb['goodput_rps']:.3f} req/s")
    if p.best is None:
        raise typer.Exit(1)


@sim_app.command("what-if")
def whatif_cmd(
    tenants: str = typer.Option(..., "--tenants", help="the current tenants file (weights, limits, slo targets)"),
    change: str = typer.Option(..., "--change", help="the proposed change (YAML: add_tenant, set_tenant, pools, "
                               "traffic; see splitserve.sim.whatif)"),
    trace: str = typer.Option(..., "--trace", help="mooncake | azure-conv | azure-code | sharegpt | a .jsonl/.csv "
                              "file"),
    prefill: int = typer.Option(1, "--prefill", min=0, help="the current prefill workers (0: colocated)"),
    decode: int = typer.Option(1, "--decode", min=0, help="the current decode workers"),
    as_json: bool = typer.Option(False, "--json"),
    limit: int | None = LimitOpt,
    rate_factor: float = typer.Option(1.0, "--rate-factor", "--rate-scale", help="multiply the trace's arrival rate"),
    rate: float = RateOpt, model: str = ModelOpt, latency: str = LatencyOpt,
    decode_latency: str | None = DecodeLatencyOpt, tp: int = TpOpt, fabric: str = FabricOpt,
    kv_tokens: int | None = KvOpt, max_seqs: int = MaxSeqsOpt, chunked: bool = ChunkOpt, strategy: str = StrategyOpt,
    disagg_threshold: int = ThresholdOpt, max_stall_ms: float = StallOpt, long_decode: int = LongOpt,
    seed: int = SeedOpt,
) -> None:
    """Would a change (a new tenant, a new contract, the pools resized) keep every tenant's SLO? Simulates the trace
    before and after it and prints each tenant's TTFT / ITL against its slo targets. Exit 0: accepted, 3: refused
    (a tenant that held its SLO before would not), 2: a usage error."""
    import time

    from splitserve.sim.whatif import WhatIfError, load_change, what_if
    from splitserve.tenancy.config import load_tenants

    b = _base(trace, limit, rate_factor, rate, model, latency, decode_latency, tp, fabric, kv_tokens, max_seqs,
              chunked, strategy, disagg_threshold, max_stall_ms, long_decode, None, 1.0, 0.1, 0.9, seed)
    if decode + long_decode < 1:
        _fail("the cluster needs at least one decoder (--decode or --long-decode)")
    try:
        current = load_tenants(tenants)
        proposed = load_change(change)
    except ValueError as exc:  # WhatIfError included
        _fail(str(exc))
    reqs = _load(b)
    cfg = _config(b, prefill, decode)
    t0 = time.perf_counter()
    try:
        w = what_if(cfg, current, proposed, reqs)
    except WhatIfError as exc:
        _fail(str(exc))
    except (ValueError, OSError) as exc:  # the simulator's own config checks
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(w.to_dict(), default=float))
    else:
        _print_whatif(w.to_dict(), time.perf_counter() - t0)
    raise typer.Exit(w.exit_code)


def _n(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _print_whatif(w: dict[str, Any], wall_s: float) -> None:
    c, rb, ra = w["change"], w["runs"]["before"], w["runs"]["after"]
    what = [f"add {a['name']} ({a['requests']} requests)" for a in c["add_tenant"]]
    what += [f"set {s['name']} ({', '.join(s['fields'])})" for s in c["set_tenant"]]
    if c["pools"]:
        what.append(f"pools {rb['prefill']}P:{rb['decode']}D -> {ra['prefill']}P:{ra['decode']}D")
    typer.echo(f"what-if: {'; '.join(what)}")
    for label, r in (("before", rb), ("after", ra)):
        typer.echo(f"  {label:<6} {r['prefill']}P:{r['decode']}D ({r['gpus']} GPUs): {r['requests']} requests, "
                   f"finished {r['finished']}, refused {r['refused']}, failed {r['failed']}; "
                   f"utilisation prefill {r['utilisation']['prefill']:.0%} decode {r['utilisation']['decode']:.0%}")
    typer.echo(f"{'tenant':<18} {'run':<6} {'reqs':>5} {'done':>5} {'refused':>7} {'req/s':>7} {'TTFT p50':>9} "
               f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  {'SLO TTFT/ITL p99':>16}  holds")
    for row in w["tenants"]:
        name = row["tenant"] + ("" if row["status"] == "same" else f" ({row['status']})")
        if len(name) > 18:  # keep the columns; the name gets a line of its own
            typer.echo(name)
            name = ""
        for label in ("before", "after"):
            r, slo = row[label], row[f"slo_{label}"]
            if r is None:
                continue
            target = "-" if slo is None else f"{_n(slo['ttft_p99_ms'], 'g')}/{_n(slo['itl_p99_ms'], 'g')}"
            miss = row["breaks"] if label == "after" and row["breaks"] else r["misses"]  # a break says why
            held = "NO: " + "; ".join(miss) if miss else "yes"
            typer.echo(f"{name:<18} {label:<6} {r['requests']:>5} {r['finished']:>5} {r['refused']:>7} "
                       f"{r['throughput_rps']:>7.3f} {_n(r['ttft_p50_ms']):>9} {_n(r['ttft_p99_ms']):>9} "
                       f"{_n(r['itl_p50_ms']):>8} {_n(r['itl_p99_ms']):>8}  {target:>16}  {held}")
            name = ""
    typer.echo("(latencies in ms; SLO targets from the tenants file, '-': none)")
    for t in w["already_failing"]:
        typer.echo(f"note: {t} already missed its SLO before the change (not held against it)")
    if w["verdict"] == "accepted":
        typer.echo(f"verdict: ACCEPTED - every tenant that held its SLO before still holds after "
                   f"(2 simulations, {wall_s:.1f} s)")
    else:
        typer.echo(f"verdict: REFUSED - {len(w['breaks'])} promise(s) would break (2 simulations, {wall_s:.1f} s):")
        for br in w["breaks"]:
            typer.echo(f"  {br['summary']}")
