"""A worker's LoRA adapters: the ones it may serve (``--lora-modules NAME=PATH``) and the ones loaded now.

With no capacity (``--max-loras 0``, the default) every adapter is loaded at start and stays. With a capacity
N, at most N are loaded at once: an adapter is loaded when a job first needs it, and the least recently used
one that no running sequence holds is unloaded to make room (the engine refuses to unload one in use). When
all N are in use, the job waits for one to be released (bounded), as vLLM's ``--max-loras`` holds a request
until its adapter fits the batch. The heartbeat lists both sets, so routers prefer a worker that has the
adapter loaded (``splitserve.routing.adapters``) and can still send it to one that only has it available.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from nats.aio.msg import Msg

from splitserve.engines import UnknownAdapter
from splitserve.proto.admin import LoraAdminReply, LoraAdminRequest

log = structlog.get_logger("splitserve.adapters")

LOAD_WAIT_S = 60.0  # the longest a job waits for an adapter slot to free up
_POLL_S = 0.02


class AdapterBusy(Exception):
    """Every adapter slot stayed held by running sequences for the whole wait."""


class AdapterSlots:
    def __init__(self, modules: tuple[tuple[str, str], ...], capacity: int,
                 run: Callable[..., Awaitable[Any]]) -> None:
        """``run``: runs an engine call on the engine thread (``EngineThread.run``)."""
        self.paths = dict(modules)
        self.capacity = capacity
        self._run = run
        self._loaded: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._lock = asyncio.Lock()
        self.loads = 0  # adapters loaded on demand since start (the benchmark's measure)

    @property
    def on_demand(self) -> bool:
        return self.capacity > 0

    def available(self) -> list[str]:
        return sorted(self.paths)

    def loaded(self) -> list[str]:
        return list(self._loaded)

    def started(self, loaded: list[str]) -> None:
        """What the engine loaded at start (everything, without a capacity)."""
        self._loaded = OrderedDict.fromkeys(loaded)

    def can_admit(self, name: str | None, held: set[str]) -> bool:
        """Whether ``name`` can be ready without waiting, ``held`` being the adapters running sequences use: the
        base model, loaded already, a free slot, one to evict, or not served here (refused at once)."""
        if name is None or name in self._loaded or name not in self.paths or not self.on_demand:
            return True
        return len(self._loaded) < self.capacity or any(a not in held for a in self._loaded)

    async def ensure(self, engine: Any, name: str | None) -> None:
        """Make sure ``name`` is loaded (None: the base model, nothing to do); raises UnknownAdapter for a name
        this worker does not serve and AdapterBusy when no slot frees up within LOAD_WAIT_S."""
        if name is None:
            return
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return
        if name not in self.paths:
            raise UnknownAdapter(f"LoRA adapter {name!r} is not served by this worker (its adapters: "
                                 f"{', '.join(self.available()) or 'none'})")
        async with self._lock:
            deadline = time.monotonic() + LOAD_WAIT_S
            while name not in self._loaded:
                if len(self._loaded) < self.capacity or not self.on_demand:
                    t0 = time.perf_counter()
                    await self._run(engine.load_lora, name, self.paths[name])
                    self._loaded[name] = None
                    self.loads += 1
                    log.info("adapter_loaded", adapter=name, load_ms=round((time.perf_counter() - t0) * 1000, 1),
                             loaded=len(self._loaded))
                    break
                if not await self._evict_one(engine):
                    if time.monotonic() > deadline:
                        raise AdapterBusy(f"all {self.capacity} LoRA slots stayed in use for {LOAD_WAIT_S:.0f}s")
                    await asyncio.sleep(_POLL_S)
        self._loaded.move_to_end(name)

    async def add(self, engine: Any, name: str, path: str) -> None:
        """Make an adapter available at runtime (an operator's load); loaded now unless loaded on demand. A folder
        the engine refuses is not kept (ValueError with the engine's reason)."""
        if name in self.paths and self.paths[name] != path:
            raise ValueError(f"LoRA adapter {name!r} is served already from another path; unload it first")
        self.paths[name] = path
        if self.on_demand:
            return
        try:
            await self.ensure(engine, name)
        except BaseException:
            self.paths.pop(name, None)
            raise

    async def remove(self, engine: Any, name: str) -> None:
        """An operator's unload: ValueError while a sequence decodes with it (it stays); UnknownAdapter if not
        served here."""
        if name not in self.paths:
            raise UnknownAdapter(f"LoRA adapter {name!r} is not served by this worker")
        async with self._lock:
            if name in self._loaded:
                await self._run(engine.unload_lora, name)
                del self._loaded[name]
            del self.paths[name]

    async def _evict_one(self, engine: Any) -> bool:
        for victim in list(self._loaded):  # least recently used first
            try:
                await self._run(engine.unload_lora, victim)
            except ValueError:  # a running sequence holds it
                continue
            del self._loaded[victim]
            log.info("adapter_unloaded", adapter=victim, reason="lru")
            return True
        return False


async def on_lora_admin(svc: Any, req: LoraAdminRequest, msg: Msg) -> None:
    """A worker's answer to ``ss.admin.lora`` (only the workers of the named model act; the others stay silent)."""
    if req.model is not None and req.model != svc.model_name:
        return
    slots: AdapterSlots = svc.adapters
    try:
        if req.action == "load":
            assert req.lora_path is not None  # (the model checks it)
            await slots.add(svc.engine, req.lora_name, req.lora_path)
        else:
            await slots.remove(svc.engine, req.lora_name)
        ok, message = True, f"{req.action}ed {req.lora_name!r}"
    except (ValueError, OSError, UnknownAdapter, AdapterBusy) as exc:
        ok, message = False, str(exc)
    log.info("lora_admin", action=req.action, adapter=req.lora_name, ok=ok, reason=None if ok else message)
    await svc.b.respond(msg, LoraAdminReply(worker_id=svc.worker_id, ok=ok, message=message,
                                            adapters=slots.loaded()))
