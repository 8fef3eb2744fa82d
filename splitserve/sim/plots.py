"""PNG plots of simulation results (matplotlib, the ``sim`` extra): TTFT and ITL CDFs, goodput against
arrival rate, pool utilisation over time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from splitserve.sim.metrics import SimResult

__all__ = ["plot_all", "plot_cdfs", "plot_goodput", "plot_utilisation"]


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - the message is the point
        raise RuntimeError("plots need matplotlib: pip install 'splitserve[sim]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, xs: Sequence[float], label: str) -> None:
    s = sorted(xs)
    if not s:
        return
    n = len(s)
    step = max(1, n // 2000)  # a few thousand points draw the same curve as millions
    pts = s[::step] + [s[-1]]
    ax.plot(pts, [min(1.0, i * step / n) for i in range(len(pts) - 1)] + [1.0], label=label)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cdfs(results: Mapping[str, SimResult], path: Path) -> Path:
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        _cdf(a, r.ttft, name)
        _cdf(b, r.itl, name)
    a.set_xlabel("TTFT (s)")
    b.set_xlabel("inter-token latency (s)")
    for ax in (a, b):
        ax.set_ylabel("fraction of requests" if ax is a else "fraction of tokens")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(plt, fig, path)


def plot_goodput(curves: Mapping[str, Sequence[Mapping[str, Any]]], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in curves.items():
        ax.plot([r["rate_rps"] for r in rows], [r["goodput_rps"] for r in rows], marker="o", label=name)
    lim = max((r["rate_rps"] for rows in curves.values() for r in rows), default=1.0)
    ax.plot([0, lim], [0, lim], ls=":", color="grey", label="offered")
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("goodput (req/s meeting the SLO)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_utilisation(result: SimResult, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for pool, series in result.util_series.items():
        if any(series):
            ax.plot([i * result.util_dt for i in range(len(series))], series, label=f"{pool} pool")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("busy fraction")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_all(result: SimResult, out_dir: Path, curves: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
             label: str = "sim") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_cdfs({label: result}, out_dir / "latency_cdf.png"),
             plot_utilisation(result, out_dir / "utilisation.png")]
    if curves:
        paths.append(plot_goodput(curves, out_dir / "goodput_vs_rate.png"))
    return paths
