"""Many LoRA adapters at GPU scale, in the simulator: adapter-affinity routing against no affinity, same run.

``bench.lora`` measures the live stack (mock engine, 4 decoders); this runs the simulator
(:mod:`splitserve.sim`: the live router's policy, request book and affinity rule around simulated engines) at
the size of a GPU deployment, in two scenarios, each with three arms on the same requests:

* **one model**: 4 prefill + 16 decode workers of one GPU each, 64 adapters with Zipf popularity (``--zipf``),
  every worker with room for 4 (``--max-loras 4``, loaded on demand, the least recently used one not in use
  evicted);
* **two models**: the same 20 GPUs split into pools ``a`` (3 prefill + 12 decode, 75% of the requests) and ``b``
  (1 + 4, 25%), each with its own 64 adapters; a request is routed only among its model's workers.

Arms: ``affinity`` (the router's ``--lora-affinity``, kvaware), ``no-affinity`` (``--no-lora-affinity``, kvaware:
``bench.lora``'s "round_robin" arm) and ``roundrobin`` (the roundrobin strategy, no affinity). Reported per arm and
model: adapter loads per finished request (a disaggregated request loads on its prefiller and its decoder, so up
to 2), TTFT p50/p99, throughput (finished requests over first arrival to last finish).

Assumptions, stated: step times are DistServe's published OPT-13B fit on one A100-80G (``distserve:opt-13b:tp1``;
``shared/data/calib`` holds no published 8B-on-H100 fit, and a 13B model on an A100 is the slower, conservative
stand-in); the workload is ShareGPT lengths within OPT's 2,048-token context, Poisson arrivals at ``--rate``; one
adapter load costs ``--load-ms`` (50 ms by default: an assumption - a rank-16 adapter of an 8-13B model is tens of
MB to read and copy to the GPU; no published per-load figure is quoted here), paid by the step that admits it
(every stream of that worker waits), and LoRA's extra compute per step is not modelled.

    python -m bench.lora_sim [--requests 4000] [--rate 8] [--adapters 64] [--zipf 1.1] [--max-loras 4]
                             [--load-ms 50] [--share 1.0] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from splitserve.sim import SimConfig, load_sharegpt, simulate
from splitserve.sim.cluster import ModelPool
from splitserve.sim.workload import SimRequest, assign_adapters, assign_models

LATENCY = "distserve:opt-13b:tp1"
ARMS = {"affinity": ("kvaware", True), "no-affinity": ("kvaware", False), "roundrobin": ("roundrobin", False)}


def scenarios(a: argparse.Namespace) -> dict[str, tuple[list[ModelPool], dict[str, float]]]:
    load_s = a.load_ms / 1000.0
    return {
        "one model": ([ModelPool("a", 4, 16, a.max_loras, load_s)], {"a": 1.0}),
        "two models": ([ModelPool("a", 3, 12, a.max_loras, load_s), ModelPool("b", 1, 4, a.max_loras, load_s)],
                       {"a": 0.75, "b": 0.25}),
    }


def workload(a: argparse.Namespace, mix: dict[str, float]) -> list[SimRequest]:
    reqs = load_sharegpt("sharegpt", a.requests, rate=a.rate, seed=a.seed, max_total_tokens=2048)
    return assign_adapters(assign_models(reqs, mix, a.seed + 1), a.adapters, a.zipf, a.share, a.seed + 2)


def run_arm(pools: list[ModelPool], reqs: list[SimRequest], strategy: str, affinity: bool) -> dict[str, Any]:
    cfg = SimConfig(model="opt-13b", prefill_latency=LATENCY, fabric="efa", gpus_per_prefill=1, gpus_per_decode=1,
                    max_seqs=128, strategy=strategy, pools=pools, lora_affinity=affinity, ttft_slo_s=2.0,
                    tpot_slo_s=0.1)
    t0 = time.perf_counter()
    s = simulate(cfg, reqs).summary
    out: dict[str, Any] = {"wall_s": round(time.perf_counter() - t0, 2), "finished": s["finished"],
                           "loads_per_request": s["adapters"]["loads_per_request"], "models": {}}
    for name, m in s["models"].items():
        t = m["ttft_s"]
        out["models"][name] = {"finished": m["finished"], "loads_per_request": m["loads_per_request"],
                               "ttft_p50_ms": round(t["p50"] * 1000, 1) if t.get("n") else None,
                               "ttft_p99_ms": round(t["p99"] * 1000, 1) if t.get("n") else None,
                               "req_per_s": m["throughput_rps"], "peak_loaded": m["peak_loaded"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rate", type=float, default=8.0, help="req/s, Poisson")
    ap.add_argument("--adapters", type=int, default=64, help="per model")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--load-ms", type=float, default=50.0)
    ap.add_argument("--share", type=float, default=1.0, help="share of requests for an adapter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    result: dict[str, Any] = {"config": {**vars(a), "latency": LATENCY}}
    for name, (pools, mix) in scenarios(a).items():
        reqs = workload(a, mix)
        result[name] = {arm: run_arm(pools, reqs, strategy, aff) for arm, (strategy, aff) in ARMS.items()}
    if a.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{a.requests} ShareGPT requests at {a.rate:g} req/s, {a.share:.0%} for one of {a.adapters} adapters per "
          f"model (Zipf {a.zipf}), {a.max_loras} slots per worker, {a.load_ms:g} ms per load; {LATENCY}, 1 GPU per "
          "worker, 4 prefill + 16 decode GPUs")
    for name, pools_ in scenarios(a).items():
        print(f"\n{name}: " + ", ".join(f"{p.name} {p.prefill}P+{p.decode}D" for p in pools_[0]))
        print(f"{'arm':<12} {'model':<6} {'done':>6} {'loads/req':>10} {'TTFT p50':>10} {'TTFT p99':>10} "
              f"{'req/s':>8} {'peak':>5}")
        for arm, r in result[name].items():
            for model, m in r["models"].items():
                print(f"{arm:<12} {model:<6} {m['finished']:>6} {m['loads_per_request']:>10.3f} "
                      f"{_ms(m['ttft_p50_ms']):>10} {_ms(m['ttft_p99_ms']):>10} {m['req_per_s']:>8.2f} "
                      f"{m['peak_loaded']:>5}")
        aff, off = result[name]["affinity"], result[name]["no-affinity"]
        if off["loads_per_request"]:
            print(f"affinity: {aff['loads_per_request'] / off['loads_per_request']:.2f}x the adapter loads of "
                  "no affinity")
    print(f"\n(simulated in {sum(r['wall_s'] for k, v in result.items() if k != 'config' for r in v.values()):.1f} s)")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


if __name__ == "__main__":
    main()
