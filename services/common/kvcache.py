"""The worker side of prefix caching: a worker's :class:`PrefixKvStore` plus the publisher of its KV events.

The store (pure, in ``splitserve.cache.store``) is driven on the engine thread; this module drains its
events on that same thread and publishes them as sequenced :class:`proto.KvEventBatch` messages on
``ss.kv.{worker}``, and answers ``ss.kv.{worker}.held`` so an index that saw a gap can resync.
Batch seq 0 is always an ``AllBlocksCleared``: a restarted worker resets what indexes believe it holds.
"""

from __future__ import annotations

from nats.aio.msg import Msg

from splitserve.cache.events import KvEvent, cleared
from splitserve.cache.store import PrefixKvStore
from splitserve.engines.base import ModelInfo
from splitserve.kv import KvLayout
from splitserve.proto import KvEventBatch, KvHeld, KvHeldRequest, Subjects
from splitserve.runtime.bus import Bus
from splitserve.services.common.engine_thread import EngineThread


def kv_layout(info: ModelInfo, block_size: int) -> KvLayout:
    """The paged KV layout of the served model: the same on every worker, so blocks move between them."""
    import torch

    return KvLayout(num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                    block_size=block_size, dtype=getattr(torch, info.dtype))


def make_store(info: ModelInfo, *, block_size: int, cache_tokens: int, l1_tokens: int) -> PrefixKvStore | None:
    if cache_tokens <= 0:
        return None
    import torch

    return PrefixKvStore(
        num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
        dtype=getattr(torch, info.dtype), block_size=block_size,
        capacity_blocks=max(1, cache_tokens // block_size), l1_capacity_blocks=max(0, l1_tokens // block_size),
    )


class KvEventPublisher:
    @classmethod
    def for_worker(cls, bus: Bus, worker_id: str, info: ModelInfo, thread: EngineThread, *, block_size: int,
                   cache_tokens: int, l1_tokens: int) -> KvEventPublisher | None:
        """The worker's prefix cache and its event publisher; None when caching is off."""
        store = make_store(info, block_size=block_size, cache_tokens=cache_tokens, l1_tokens=l1_tokens)
        return None if store is None else cls(bus, worker_id, store, thread)

    def __init__(self, bus: Bus, worker_id: str, store: PrefixKvStore, thread: EngineThread) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.store = store
        self.thread = thread
        self.seq = 0

    async def start(self) -> None:
        await self.bus.subscribe(Subjects.kv_held(self.worker_id), KvHeldRequest, self.on_held)
        await self._publish([cleared()])

    async def _publish(self, events: list[KvEvent]) -> None:
        batch = KvEventBatch(worker_id=self.worker_id, seq=self.seq, events=events)
        self.seq += 1
        await self.bus.publish(Subjects.kv_events(self.worker_id), batch)

    async def flush(self) -> None:
        await self.send(await self.thread.run(self.store.drain_events))

    async def send(self, events: list[KvEvent]) -> None:
        """Publish events the caller drained from the store on the engine thread (nothing when there are none)."""
        if events:
            await self._publish(events)

    async def on_held(self, _: KvHeldRequest, msg: Msg) -> None:
        # Drain first so the reported state and seq agree: everything up to seq-1 is included.
        await self.flush()
        held = await self.thread.run(self.store.held)
        await self.bus.respond(msg, KvHeld(worker_id=self.worker_id, seq=self.seq - 1,
                                           held={k: list(v) for k, v in held.items()}))
