"""Command-line options shared by the worker entry points (``python -m services.prefill|decode``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EngineOptions:
    engine: str = "hf"
    model: str | None = None
    dtype: str = "float32"
    threads: int | None = None
    block_size: int = 16
    transport: str = "nixl"

    def apply_threads(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)

    def load(self):  # type: ignore[no-untyped-def]
        from splitserve.engines import load_engine

        self.apply_threads()
        return load_engine(self.engine, model=self.model, dtype=self.dtype)
