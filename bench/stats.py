"""Small helpers shared by the benchmarks: percentiles, and the CPU time of groups of processes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import psutil


def pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def summary(values: Sequence[float]) -> dict[str, float | None]:
    return {"n": len(values), "p50": pct(values, 50), "p90": pct(values, 90), "p99": pct(values, 99),
            "max": max(values) if values else None, "mean": float(np.mean(values)) if len(values) else None}


def fmt(v: float | None, unit: str = "ms") -> str:
    return "-" if v is None else f"{v:,.1f} {unit}"


def cpu_seconds(groups: Mapping[str, Iterable[int]]) -> dict[str, float]:
    """CPU seconds (user + system, children not included) used so far by each named group of processes (by pid;
    a process already gone counts nothing)."""
    out: dict[str, float] = {}
    for name, group in groups.items():
        total = 0.0
        for pid in group:
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
        out[name] = total
    return out
