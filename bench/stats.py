"""Small percentile helpers shared by the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def summary(values: Sequence[float]) -> dict[str, float | None]:
    return {"n": len(values), "p50": pct(values, 50), "p90": pct(values, 90), "p99": pct(values, 99),
            "max": max(values) if values else None, "mean": float(np.mean(values)) if len(values) else None}


def fmt(v: float | None, unit: str = "ms") -> str:
    return "-" if v is None else f"{v:,.1f} {unit}"
