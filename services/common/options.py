"""Command-line options shared by the worker entry points (``python -m services.prefill|decode``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def parse_cpus(spec: str | None) -> tuple[int, ...] | None:
    """'0', '0,2', '0-3' or '0-1,4' -> a tuple of core ids; None or '' -> None."""
    if not spec:
        return None
    out: list[int] = []
    for part in spec.split(","):
        a, _, b = part.strip().partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class EngineOptions:
    engine: str = "hf"
    model: str | None = None
    dtype: str = "float32"
    threads: int | None = None
    block_size: int = 16
    transport: str = "nixl"
    cpus: tuple[int, ...] | None = None  # pin the process (and torch's threads) to these cores

    def apply_threads(self) -> None:
        # Pinning is the CPU analogue of separate GPU pools: prefill and decode never share a core.
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)
        threads = self.threads or (len(self.cpus) if self.cpus else None)
        if threads:
            torch.set_num_threads(threads)

    def load(self):  # type: ignore[no-untyped-def]
        from splitserve.engines import load_engine

        self.apply_threads()
        return load_engine(self.engine, model=self.model, dtype=self.dtype)
