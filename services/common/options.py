"""Command-line options shared by the worker entry points (``python -m splitserve.services.prefill|decode``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from splitserve.cpus import parse_cpus
from splitserve.engines.model_files import parse_lora_modules

__all__ = ["EngineOptions", "parse_cpus", "parse_lora_modules"]


@dataclass(frozen=True)
class EngineOptions:
    engine: str = "hf"
    model: str | None = None
    dtype: str = "float32"
    threads: int | None = None
    block_size: int = 16
    transport: str = "nixl"
    cpus: tuple[int, ...] | None = None  # pin the process (and torch's threads) to these cores
    # The name the worker serves its model under (heartbeats' ``model``, which routers match a request's model
    # against; final messages; traces). None: the engine's own name (``engine.info.name``).
    served_model_name: str | None = None
    # LoRA adapters loaded at start, (name, path) each (``--lora-modules NAME=PATH``, as vLLM spells it)
    lora_modules: tuple[tuple[str, str], ...] = ()
    # At most this many loaded at once, each on first use (LRU; services.common.adapters); 0: all, at start
    max_loras: int = 0

    def model_name(self, engine_name: str) -> str:
        """The served model's name: ``served_model_name`` when set, else the engine's own name."""
        return self.served_model_name or engine_name

    def apply_threads(self) -> None:
        # Pinning is the CPU analogue of separate GPU pools: prefill and decode compute never share a core.
        # Called from the engine thread, this pins it and the torch threads it starts, not the process: the
        # asyncio thread (NATS, KV push coroutines, heartbeats) stays free, like a GPU worker's host thread.
        # Pinning it too was measured worse on 2 cores: it then competed with its own engine thread for the
        # pool's core (decode step p50 ~100 -> ~109 ms, short-prompt TTFT p50 ~0.35 -> ~0.5 s).
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)
        threads = self.threads or (len(self.cpus) if self.cpus else None)
        if threads:
            torch.set_num_threads(threads)

    def load(self):  # type: ignore[no-untyped-def]
        from splitserve.engines import load_engine

        self.apply_threads()
        engine = load_engine(self.engine, model=self.model, dtype=self.dtype)
        if not self.max_loras:
            for name, path in self.lora_modules:
                engine.load_lora(name, path)
        return engine

