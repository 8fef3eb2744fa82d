"""The simulator against DistServe's published answer (OPT-13B, ShareGPT, one node of 4 A100-80G).

DistServe's simulator README: SLO TTFT 0.2 s and TPOT 0.1 s, each met by 90% of requests; best per-GPU rate
1.56 req/s, config prefill TP 2 + decode TP 1 (3 GPUs), found by bisection on the per-GPU rate in (0, 5]
stopping when hi - lo < 0.25, with 300 requests. This runs the same search over the same placements (one
prefill and one decode instance, TP 1/2/4 each, at most 4 GPUs) on splitserve's simulator with DistServe's
own A100 fits, and prints our best per-GPU rate and config beside the published figure. The same search
refined to a 0.01 step is printed too (the bisection's answer is only resolved to 0.25).

    python -m bench.sim_distserve [--n 300] [--seeds 4] [--json]

What differs from DistServe's run (the reasons the figures need not agree exactly):

* the data: DistServe samples its own ShareGPT file tokenized for OPT; here the only ShareGPT lengths are
  sarathi-serve's (llama2 tokenizer, whole multi-turn conversations, p50 1,730 prompt tokens), filtered to
  conversations that fit OPT's 2,048-token context (mean 627 prompt / 416 output tokens);
* DistServe's ``DisaggCluster`` builds every worker with ``TP_Decode = TP_Prefill`` (simulate_dist.py), so
  its "prefill TP 2 + decode TP 1" decodes with the TP-2 fit while counting 3 GPUs; here a decoder uses its
  own TP's fit;
* attainment is pooled over ``--seeds`` samples of ``--n`` requests (DistServe: one sample, seed 0); its
  decode runs ``output_lens`` steps after the prefill's token, here ``output - 1``; KV moves over NVLink
  (DistServe: free); neither bounds the decode batch by KV memory (``kv_limited`` shows ours).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from splitserve.sim import SimConfig, distserve, load_sharegpt, simulate

PUBLISHED = {"per_gpu_rate": 1.56, "tp_prefill": 2, "tp_decode": 1}
OPT_CONTEXT = 2048


def config(tp_p: int, tp_d: int, kv_limited: bool = False) -> SimConfig:
    # DistServe's simulator does not bound a decode batch by KV memory; kv_limited=True applies ours
    # (paged blocks in what the GPUs have left after the weights, preempt-and-recompute when full).
    return SimConfig(kv_tokens=None if kv_limited else 1 << 30,
        prefill=1, decode=1, model="opt-13b", prefill_latency=distserve("opt-13b", tp_p),
        decode_latency=distserve("opt-13b", tp_d), fabric="nvlink", gpus_per_prefill=tp_p, gpus_per_decode=tp_d,
        max_seqs=1024, strategy="roundrobin", disagg_threshold=0, max_stall_ms=None,
        prefill_token_budget=OPT_CONTEXT, ttft_slo_s=0.2, tpot_slo_s=0.1, attainment=0.9)


def attains(tp_p: int, tp_d: int, per_gpu_rate: float, n: int, seeds: int, kv_limited: bool = False) -> bool:
    """DistServe's test (P90 TTFT <= 0.2 s and P90 TPOT <= 0.1 s), over ``seeds`` samples of ``n`` requests
    pooled (one 300-request sample is noisy: seeds alone moved the answer by a bisection step)."""
    ttft_ok = tpot_ok = 0.0
    for seed in range(seeds):
        reqs = load_sharegpt(limit=n, rate=per_gpu_rate * (tp_p + tp_d), seed=seed, max_total_tokens=OPT_CONTEXT)
        slo = simulate(config(tp_p, tp_d, kv_limited), reqs).summary["slo"]
        ttft_ok += slo["ttft_ok"]
        tpot_ok += slo["tpot_ok"]
    return ttft_ok / seeds >= 0.9 and tpot_ok / seeds >= 0.9


def bisect(tp_p: int, tp_d: int, n: int, seeds: int, hi: float = 5.0, esp: float = 0.25,
           kv_limited: bool = False) -> float:
    lo = 0.0
    while hi - lo >= esp:
        mid = (lo + hi) / 2
        if attains(tp_p, tp_d, mid, n, seeds, kv_limited):
            lo = mid
        else:
            hi = mid
    return lo


def search(n: int, seeds: int, esp: float, kv_limited: bool = False) -> dict[str, Any]:
    rows = []
    for tp_p in (1, 2, 4):
        for tp_d in (1, 2, 4):
            if tp_p + tp_d > 4:
                continue
            rows.append({"tp_prefill": tp_p, "tp_decode": tp_d, "per_gpu_rate": bisect(tp_p, tp_d, n, seeds, esp=esp,
                                                                                     kv_limited=kv_limited)})
    best = max(rows, key=lambda r: r["per_gpu_rate"])
    return {"configs": rows, "best": best}


def run(n: int, seeds: int) -> dict[str, Any]:
    started = time.perf_counter()
    coarse = search(n, seeds, 0.25)
    fine = search(n, seeds, 0.01)
    limited = search(n, seeds, 0.01, kv_limited=True)
    b = coarse["best"]
    err = abs(b["per_gpu_rate"] - PUBLISHED["per_gpu_rate"]) / PUBLISHED["per_gpu_rate"]
    pub = next(r for r in coarse["configs"] if (r["tp_prefill"], r["tp_decode"]) == (2, 1))["per_gpu_rate"]
    return {"published": PUBLISHED, "bisection_esp_0.25": coarse, "refined_esp_0.01": fine,
            "kv_limited_esp_0.01": limited,
            "relative_error": round(err, 4), "within_10pct": err <= 0.10,
            "published_config_rate": pub, "published_config_error": round((pub - 1.56) / 1.56, 4),
            "same_config": (b["tp_prefill"], b["tp_decode"]) == (2, 1),
            "mean_prompt": statistics.mean(r.prompt_tokens
                                           for r in load_sharegpt(limit=n, max_total_tokens=OPT_CONTEXT)),
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=300, help="requests per run (DistServe's README: 300)")
    ap.add_argument("--seeds", type=int, default=4, help="samples per rate (attainment pooled)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    out = run(a.n, a.seeds)
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print("config (prefill TP + decode TP)   per-GPU rate, bisection 0.25   refined 0.01")
    fine = {(r["tp_prefill"], r["tp_decode"]): r["per_gpu_rate"] for r in out["refined_esp_0.01"]["configs"]}
    for r in out["bisection_esp_0.25"]["configs"]:
        refined = fine[(r["tp_prefill"], r["tp_decode"])]
        print(f"  TP{r['tp_prefill']} + TP{r['tp_decode']:<26} {r['per_gpu_rate']:>8.2f}   {refined:>20.2f}")
    b = out["bisection_esp_0.25"]["best"]
    print(f"best (ours):      {b['per_gpu_rate']:.2f} req/s/GPU with prefill TP {b['tp_prefill']}, "
          f"decode TP {b['tp_decode']}")
    print(f"best (DistServe): {PUBLISHED['per_gpu_rate']:.2f} req/s/GPU with prefill TP 2, decode TP 1")
    lb = out["kv_limited_esp_0.01"]["best"]
    print(f"with our KV-capacity model (DistServe's simulator has none): {lb['per_gpu_rate']:.2f} req/s/GPU, "
          f"prefill TP {lb['tp_prefill']}, decode TP {lb['tp_decode']}")
    print(f"the published config (prefill TP 2 + decode TP 1) here: {out['published_config_rate']:.2f} req/s/GPU "
          f"({out['published_config_error']:+.1%})")
    print(f"relative error {out['relative_error']:.1%} (within 10%: {out['within_10pct']}); {out['seconds']} s")


if __name__ == "__main__":
    main()
