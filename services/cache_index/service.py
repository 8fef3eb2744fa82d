"""Cache-index service: keeps prefix residency per worker and tier from the workers' KV events and answers
"how many leading blocks of this prompt does each worker hold" over request/reply.

Thin by design: the index itself is :class:`splitserve.cache.index.PrefixIndex` (pure code). Workers
that stop heartbeating are dropped from the index.
"""

from __future__ import annotations

import time

from nats.aio.msg import Msg

from proto import CacheQuery, CacheQueryReply, Heartbeat, KvEventBatch, Subjects, WorkerLoad
from splitserve.cache import events as cache_events
from splitserve.cache.index import PrefixIndex
from splitserve.runtime.registry import WorkerRegistry
from splitserve.runtime.service import Service


class CacheIndexService(Service):
    role = "cache_index"

    def __init__(self, worker_id: str, nats_url: str, **kw: object) -> None:
        super().__init__(worker_id, nats_url, **kw)  # type: ignore[arg-type]
        self.index = PrefixIndex()
        self.registry = WorkerRegistry()
        self.gaps = 0

    async def start(self) -> None:
        await self.b.subscribe(Subjects.KV_EVENTS_ALL, KvEventBatch, self.on_events)
        await self.b.subscribe(Subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        await self.b.subscribe(Subjects.CACHE_QUERY, CacheQuery, self.on_query, queue="cache_index")
        self.b.spawn(self._reaper())

    def load(self) -> WorkerLoad:
        return WorkerLoad(used_blocks=self.index.stats().blocks if hasattr(self.index.stats(), "blocks") else 0)

    async def on_events(self, batch: KvEventBatch, _: Msg) -> None:
        gap = self.index.apply(cache_events.KvEventBatch.from_dict(batch.model_dump()))
        if gap:
            self.gaps += 1
            self.log.warning("kv_event_gap", worker=batch.worker_id, seq=batch.seq)

    async def on_heartbeat(self, hb: Heartbeat, _: Msg) -> None:
        self.registry.observe(hb, time.monotonic())

    async def on_query(self, q: CacheQuery, msg: Msg) -> None:
        await self.b.respond(msg, CacheQueryReply(matched_blocks=self.index.lookup(q.block_hashes)))

    async def _reaper(self) -> None:
        import asyncio

        while True:
            await asyncio.sleep(0.5)
            for wid, reason in self.registry.reap(time.monotonic()):
                if self.index.remove_worker(wid):
                    self.log.info("worker_dropped_from_index", dropped_worker=wid, reason=reason)
