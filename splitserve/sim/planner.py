"""Planner: for a workload and an SLO, the cheapest deployment that meets it.

Sweeps cluster sizes from small to large; at each size every prefill:decode split (``0:N`` is colocated:
every prompt prefilled on the decoders, chunked), each strategy and disaggregation threshold. The first size
with any configuration that meets the SLO is the cheapest (in GPUs); among its configurations the one with
the best goodput wins. Every run is kept in the returned table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from splitserve.sim.cluster import SimConfig, simulate
from splitserve.sim.workload import SimRequest

__all__ = ["Plan", "plan", "rate_sweep"]


@dataclass
class Plan:
    best: dict[str, Any] | None
    rows: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"best": self.best, "rows": self.rows}


def _row(cfg: SimConfig, s: dict[str, Any]) -> dict[str, Any]:
    return {"prefill": cfg.prefill, "decode": cfg.decode, "gpus": cfg.gpus, "strategy": cfg.strategy,
            "disagg_threshold": cfg.disagg_threshold, "met": s["slo"]["met"], "ttft_ok": round(s["slo"]["ttft_ok"], 4),
            "tpot_ok": round(s["slo"]["tpot_ok"], 4), "ttft_p90_s": round(s["ttft_s"].get("p90", float("nan")), 4),
            "tpot_p90_s": round(s["tpot_s"].get("p90", float("nan")), 4), "goodput_rps": s["goodput_rps"],
            "routes": s["routes"]}


def plan(
    base: SimConfig, requests: Sequence[SimRequest], *, sizes: Iterable[int], strategies: Sequence[str] = ("kvaware",),
    thresholds: Sequence[int] = (512,), colocated: bool = True, min_prefill: int = 0,
) -> Plan:
    """``sizes``: worker counts to try, smallest first (each worker costs its ``gpus_per_*``)."""
    rows: list[dict[str, Any]] = []
    cands: list[tuple[SimConfig, dict[str, Any]]] = []
    for n in sorted(set(sizes)):
        splits = [(p, n - p) for p in range(max(min_prefill, 0 if colocated else 1), n)]
        for p, d in splits:
            for strat in strategies:
                for th in thresholds if p else (base.disagg_threshold,):
                    cfg = dataclasses.replace(base, prefill=p, decode=d, strategy=strat, disagg_threshold=th)
                    r = _row(cfg, simulate(cfg, requests).summary)
                    rows.append(r)
                    if r["met"]:
                        cands.append((cfg, r))
        if cands:
            break
    if not cands:
        return Plan(None, rows)
    cheapest = min(r["gpus"] for _, r in cands)
    best = max((r for _, r in cands if r["gpus"] == cheapest), key=lambda r: (r["goodput_rps"], -r["prefill"]))
    return Plan(best, rows)


def rate_sweep(cfg: SimConfig, requests: Sequence[SimRequest], factors: Sequence[float]) -> list[dict[str, Any]]:
    """Goodput and latency at each arrival-rate factor (the goodput-vs-rate curve)."""
    from splitserve.sim.workload import scale_rate

    out = []
    for f in factors:
        s = simulate(cfg, scale_rate(requests, f)).summary
        out.append({"factor": f, "rate_rps": s["rate_rps"], "goodput_rps": s["goodput_rps"], "met": s["slo"]["met"],
                    "both_ok": s["slo"]["both_ok"], "ttft_p90_s": s["ttft_s"].get("p90"),
                    "tpot_p90_s": s["tpot_s"].get("p90")})
    return out
