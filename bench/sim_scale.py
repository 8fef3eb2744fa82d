"""Simulator speed at cluster scale: 1,000 workers on a 12,000-request trace, wall-clock seconds.

The Azure conversation trace's first 12,000 requests (~2,200 s of arrivals) sped up ``--rate-factor`` times,
on 250 prefill + 750 decode workers (Llama-2-70B, Splitwise H100 TP8 step times, EFA), routed by the live
``kvaware`` router with the live fair scheduler and quota book. Baseline in the same run: the same trace on
a 10-worker cluster at the same per-worker load, so the per-event cost at 1,000 workers can be compared.

    python -m bench.sim_scale [--workers 1000] [--requests 12000] [--rate-factor 100] [--profile] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from splitserve.sim import SimConfig, load_trace, scale_rate, simulate


def run_one(workers: int, requests: int, factor: float, strategy: str) -> dict[str, Any]:
    reqs = scale_rate(load_trace("azure-conv", requests), factor)
    p = workers // 4
    cfg = SimConfig(prefill=p, decode=workers - p, model="llama2-70b", prefill_latency="splitwise:llama2-70b:h100:tp8",
                    fabric="efa", strategy=strategy, ttft_slo_s=2.0, tpot_slo_s=0.1)
    started, cpu0 = time.perf_counter(), time.process_time()
    res = simulate(cfg, reqs)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu0
    s = res.summary
    return {"workers": workers, "requests": requests, "rate_rps": s["rate_rps"], "strategy": strategy,
            "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "sim_s": s["sim_s"], "finished": s["finished"],
            "events": s["events_processed"], "events_per_s": round(s["events_processed"] / cpu),
            "ttft_p50_s": round(s["ttft_s"]["p50"], 4), "tpot_p50_s": round(s["tpot_s"]["p50"], 4),
            "slo_met": s["slo"]["met"], "utilisation": {k: v for k, v in s["utilisation"].items() if k != "per_worker"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=12000)
    ap.add_argument("--rate-factor", type=float, default=100.0)
    ap.add_argument("--strategy", default="kvaware")
    ap.add_argument("--profile", action="store_true", help="run under pyinstrument and print where time goes")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    base = run_one(10, max(1, a.requests * 10 // a.workers), a.rate_factor * 10 / a.workers, a.strategy)
    if a.profile:
        from pyinstrument import Profiler

        prof = Profiler()
        prof.start()
    big = run_one(a.workers, a.requests, a.rate_factor, a.strategy)
    if a.profile:
        prof.stop()
        print(prof.output_text(unicode=False, color=False, show_all=False))
    out = {"baseline_10_workers": base, "scale": big}
    if a.json:
        print(json.dumps(out, indent=2))
        return
    for name, r in (("baseline", base), ("scale", big)):
        print(f"{name:9} {r['workers']:5} workers {r['requests']:6} requests at {r['rate_rps']:8.1f} req/s: "
              f"{r['wall_s']:7.2f} s wall ({r['cpu_s']:.2f} s CPU; the machine is shared) for "
              f"{r['sim_s']:7.1f} s simulated, {r['events']:9} events "
              f"({r['events_per_s']:,}/s); finished {r['finished']}; TTFT p50 {r['ttft_p50_s']} s, "
              f"TPOT p50 {r['tpot_p50_s']} s")


if __name__ == "__main__":
    main()
