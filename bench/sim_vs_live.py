"""The simulator calibrated to this machine, against a live run of the CPU stack on the same requests.

1. Calibrate: time the bundled model with the hf engine on one thread (each pool of ``splitserve up`` has one
   core here) - prefill at three prompt lengths, decode steps at three batch sizes - and fit the step model
   (:func:`splitserve.sim.latency.measure_hf`).
2. Live: start the stack (``splitserve up``: 1 prefill + 1 decode worker, its defaults) and replay a slice
   of a real trace through it over NATS (``bench.replay``, open loop).
3. Simulate the same requests (same send times, prompt lengths and the completion lengths the live run
   produced) on a simulated 1 prefill + 1 decode cluster with the calibrated model and the live router's
   settings, and print TTFT and ITL percentiles side by side.

The machine is shared: calibration and the live run are measured back to back so they see similar load.

    python -m bench.sim_vs_live [--trace azure-conv] [--limit 30] [--speedup 0.2] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.replay import Scaling, read_trace, replay, results, scale
from splitserve.sim import SimConfig, SimRequest, simulate
from splitserve.sim.latency import StepFit, latency_model, measure_hf


def sim_config(fit: StepFit, bus_delay_s: float) -> SimConfig:
    # The live stack's defaults (splitserve up / splitserve.services.decode): roundrobin, threshold 512, stall rule
    # 100 ms
    # at 400 tok/s, decoders of 16 sequences prefilling locally in 256-token chunks between decode steps.
    return SimConfig(prefill=1, decode=1, model="smollm2-135m", prefill_latency=fit, fabric="local",
                     gpus_per_prefill=1, gpus_per_decode=1, kv_tokens=65536, max_seqs=16, decode_token_budget=256 + 16,
                     fused_steps=False, strategy="roundrobin", disagg_threshold=512, max_stall_ms=100.0,
                     decoder_prefill_tps=400.0, bus_delay_s=bus_delay_s, ttft_slo_s=2.0, tpot_slo_s=0.2)


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * p
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="azure-conv")
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--speedup", type=float, default=0.2)
    ap.add_argument("--prompt-scale", type=float, default=0.3)
    ap.add_argument("--max-prompt", type=int, default=400)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--calibration", default=None, help="a saved calibration JSON (skip measuring)")
    ap.add_argument("--bus-delay-ms", type=float, default=5.0, help="control-plane delay per hop in the model")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    started = time.perf_counter()
    if a.calibration:
        fit = latency_model(a.calibration)
    else:
        fit = measure_hf(threads=1)
        home = Path(os.environ.get("SPLITSERVE_HOME") or tempfile.mkdtemp(prefix="sim-calib-"))
        home.mkdir(parents=True, exist_ok=True)
        (home / "sim-calibration.json").write_text(json.dumps(fit.describe()))
    calib_s = time.perf_counter() - started

    sc = Scaling(a.speedup, a.prompt_scale, 16, a.max_prompt, 1.0, a.max_output, int(time.time()))
    requests = scale(read_trace(a.trace, a.limit), sc)
    from splitserve.stackproc import start_stack

    stack = start_stack(Path(tempfile.mkdtemp(prefix="bench-sim-vs-live-")))
    try:
        outcomes, wall, _ = asyncio.run(replay(requests, "nats", stack.nats_url, None, None, 300.0))
    finally:
        stack.stop()
    live = results(requests, outcomes, wall)

    # Every request loaded the live cluster, including any that failed at the client: simulate them all (a
    # failed one with its max_tokens).
    sim_reqs = [SimRequest(f"r{r.index}", r.send_at_s, len(r.prompt), max(1, o.completion_tokens or r.max_tokens))
                for r, o in zip(requests, outcomes, strict=True)]
    res = simulate(sim_config(fit, a.bus_delay_ms / 1000), sim_reqs)
    s = res.summary
    rows = {
        "ttft_p50_ms": (live["ttft_ms"]["p50"], s["ttft_s"]["p50"] * 1000),
        "ttft_p90_ms": (live["ttft_ms"]["p90"], s["ttft_s"]["p90"] * 1000),
        "itl_p50_ms": (live["itl_ms"]["p50"], s["itl_s"]["p50"] * 1000),
        "itl_p90_ms": (live["itl_ms"]["p90"], s["itl_s"]["p90"] * 1000),
    }
    out: dict[str, Any] = {
        "calibration": fit.describe(), "calibration_s": round(calib_s, 1),
        "requests": len(requests), "live_ok": live["ok"], "live_errors": live["error_kinds"],
        "compare": {k: {"live": round(x, 1), "sim": round(y, 1), "error": round((y - x) / x, 3)} for k, (x, y) in
                    rows.items()},
        "sim_routes": s["routes"],
        "prefill_tok_s_at_256": round(fit.prefill_tokens_per_s(256), 1),
    }
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"calibrated ({out['calibration_s']} s): prefill {fit.prefill} ms-fit, decode {fit.decode_small} ms-fit")
    print(f"live: {live['ok']}/{len(requests)} ok over {wall:.1f} s; sim routes {s['routes']}")
    print(f"{'':14}{'live':>10}{'sim':>10}{'error':>9}")
    for k, v in out["compare"].items():
        print(f"{k:14}{v['live']:>10.1f}{v['sim']:>10.1f}{v['error']:>+9.1%}")


if __name__ == "__main__":
    main()
