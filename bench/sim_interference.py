"""The interference question at GPU scale, simulated: colocated with chunked prefill vs disaggregated.

A long-context RAG-like mix on 8 H100s: short chat streams (200-800-token prompts, 300 output tokens) at a
steady rate, and long retrieval-augmented prompts (8k-16k tokens, 200 output tokens) at a rising rate. The
model is a 70B GQA model (Llama-3.3-70B's KV: 320 KiB/token; Splitwise's measured llama2-70b H100 TP2 step
times, which share the architecture, extrapolated past their 8k-token table by the fit), four TP2
instances, KV over NVLink. Each row is one long-prompt rate:

* colocated: 4 instances, every prompt prefilled on its decoder in 2,048-token chunks riding with the decodes;
* disaggregated at each P:D split (1:3, 2:2, 3:1), routed by the live router (kvaware, its stall rule).

Printed: long-prompt TTFT p50/p99 and short-stream ITL p99 per deployment, the winner per row (the
disaggregated split whose worse metric, relative to colocated, is best; it wins only if better on both), the
crossovers (the long-prompt rate from which disaggregation stays better) and the P:D split that wins most.

    python -m bench.sim_interference [--duration 120] [--short-rate 6] [--long-rates 0.05,0.1,0.2,0.3,0.4,0.6,0.8]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from splitserve.sim import SimConfig, rag_mix, simulate

SPLITS = ((1, 3), (2, 2), (3, 1))


def base() -> SimConfig:
    return SimConfig(model="llama-3.3-70b", prefill_latency="splitwise:llama2-70b:h100:tp2", fabric="nvlink-h100",
                     gpus_per_prefill=2, gpus_per_decode=2, max_seqs=256, decode_token_budget=2048,
                     strategy="kvaware", ttft_slo_s=2.0, tpot_slo_s=0.1)


def one(cfg: SimConfig, reqs: list[Any]) -> dict[str, Any]:
    s = simulate(cfg, reqs).summary
    lg, sh = s["by_kind"].get("long", {}), s["by_kind"].get("short", {})
    return {"long_ttft_p50_s": lg.get("ttft", {}).get("p50"), "long_ttft_p99_s": lg.get("ttft", {}).get("p99"),
            "short_itl_p99_s": sh.get("itl", {}).get("p99"), "short_ttft_p99_s": sh.get("ttft", {}).get("p99"),
            "routes": s["routes"], "unfinished": s["unfinished"]}


def run(duration: float, short_rate: float, long_rates: list[float], seed: int) -> dict[str, Any]:
    import dataclasses

    rows = []
    wins: dict[str, int] = {}
    started = time.perf_counter()
    for lr in long_rates:
        reqs = rag_mix(duration, long_rate=lr, short_rate=short_rate, long_tokens=(8000, 16000), seed=seed)
        col = one(dataclasses.replace(base(), prefill=0, decode=4), reqs)
        row: dict[str, Any] = {"long_rate": lr, "colocated": col}
        for p, d in SPLITS:
            row[f"{p}:{d}"] = one(dataclasses.replace(base(), prefill=p, decode=d), reqs)

        def key(r: dict[str, Any], col: dict[str, Any] = col) -> float:
            # both metrics matter: the worse of the two, relative to colocated
            return max(r["long_ttft_p99_s"] / col["long_ttft_p99_s"], r["short_itl_p99_s"] / col["short_itl_p99_s"])

        best = min((f"{p}:{d}" for p, d in SPLITS), key=lambda k: key(row[k]))
        b, c = row[best], row["colocated"]
        dis_wins = b["long_ttft_p99_s"] < c["long_ttft_p99_s"] and b["short_itl_p99_s"] < c["short_itl_p99_s"]
        row["best_split"] = best
        row["winner"] = f"disaggregated {best}" if dis_wins else "colocated"
        wins[best] = wins.get(best, 0) + 1
        row["disagg_wins_both"] = dis_wins
        row["disagg_better_ttft"] = b["long_ttft_p99_s"] < c["long_ttft_p99_s"]
        row["disagg_better_itl"] = b["short_itl_p99_s"] < c["short_itl_p99_s"]
        rows.append(row)

    def from_rate(flag: str) -> float | None:
        # the lowest long-prompt rate from which disaggregation stays better at every higher rate
        out = None
        for r in reversed(rows):
            if not r[flag]:
                break
            out = r["long_rate"]
        return out

    crossover = from_rate("disagg_wins_both")
    return {"rows": rows, "crossover_long_rate": crossover, "ttft_crossover": from_rate("disagg_better_ttft"),
            "itl_crossover": from_rate("disagg_better_itl"),
            "winning_split": max(wins, key=lambda k: wins[k]) if wins else None,
            "seconds": round(time.perf_counter() - started, 1), "short_rate": short_rate, "duration_s": duration}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--short-rate", type=float, default=6.0)
    ap.add_argument("--long-rates", default="0.05,0.1,0.2,0.3,0.4,0.6,0.8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    out = run(a.duration, a.short_rate, [float(x) for x in a.long_rates.split(",")], a.seed)
    if a.json:
        print(json.dumps(out, indent=2))
        return
    cols = ["colocated", *[f"{p}:{d}" for p, d in SPLITS]]
    print(f"8 H100 (4 x TP2), short streams {out['short_rate']} req/s, {out['duration_s']:.0f} s; "
          "cells: long TTFT p50 / p99 (s) | short ITL p99 (ms)")
    print(f"{'long/s':>7} " + " ".join(f"{c:>27}" for c in cols) + "   winner")
    for r in out["rows"]:
        cells = []
        for c in cols:
            x = r[c]
            itl = x["short_itl_p99_s"] * 1000
            cells.append(f"{x['long_ttft_p50_s']:6.2f} /{x['long_ttft_p99_s']:6.2f} | {itl:7.1f}")
        print(f"{r['long_rate']:>7.3f} " + " ".join(f"{c:>27}" for c in cells) + f"   {r['winner']}")
    print(f"crossover (disaggregated better at this long-prompt rate and every higher one): both metrics from "
          f"{out['crossover_long_rate']}/s, long TTFT p99 from {out['ttft_crossover']}/s, short ITL p99 from "
          f"{out['itl_crossover']}/s; best P:D split in most rows: {out['winning_split']}; {out['seconds']} s")


if __name__ == "__main__":
    main()
