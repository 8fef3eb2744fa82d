"""Cache-index service: prefix residency per worker and tier, fed by the workers' own KV events, answering
"how many leading blocks of this prompt does each worker hold" over request/reply (``ss.cache.query``).

Durability: the workers' event batches are captured by a JetStream stream (``SS_KV_EVENTS``); the index
is snapshotted into a JetStream object store every few seconds together with the stream sequence it
covers. On start the service restores the snapshot and replays the stream from the next sequence, so a
restart loses nothing. A worker whose batches skip a sequence number is resynced from its own dump
(``ss.kv.{worker}.held``); a worker that stops heartbeating is dropped. The index itself is the pure
:class:`splitserve.cache.index.PrefixIndex`; this service only moves messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgpack
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy, ObjectStoreConfig, StreamConfig
from nats.js.errors import NotFoundError, ObjectNotFoundError

from splitserve import proto
from splitserve.cache.index import PrefixIndex
from splitserve.cache.warmstart import BUCKET, SNAPSHOT_KEY, STREAM
from splitserve.proto import (
    CacheQuery,
    CacheQueryReply,
    CacheStatsReply,
    CacheStatsRequest,
    CacheWorkerStats,
    Heartbeat,
    KvEventBatch,
    Subjects,
    WorkerLoad,
)
from splitserve.runtime.jetstream import ensure_replicas, ensure_stream, replicas_for
from splitserve.runtime.registry import WorkerRegistry
from splitserve.runtime.service import Service
from splitserve.services.common.resync import resync_index

__all__ = ["BUCKET", "SNAPSHOT_KEY", "STREAM", "CacheIndexService"]  # the names are splitserve.cache.warmstart's


class CacheIndexService(Service):
    role = "cache_index"

    def __init__(self, worker_id: str, nats_url: str, *, snapshot_interval_s: float = 5.0,
                 stream_max_age_s: float = 3600.0, **kw: Any) -> None:
        super().__init__(worker_id, nats_url, **kw)
        self.index = PrefixIndex()
        self.registry = WorkerRegistry()
        self.snapshot_interval_s = snapshot_interval_s
        self.stream_max_age_s = stream_max_age_s
        self.applied_seq = 0  # last JetStream stream sequence applied to the index
        self.snapshot_seq = 0
        self.gaps = 0
        self.restored_from: int | None = None
        self.indexed_blocks = 0  # blocks in the index as of the last snapshot (reported in heartbeats)

    async def setup(self) -> None:
        self.js = self.b.nc.jetstream()
        cfg = StreamConfig(name=STREAM, subjects=[Subjects.KV_EVENTS_ALL], max_age=self.stream_max_age_s,
                           max_msgs=2_000_000)
        replicas = replicas_for(self.b.nc)  # R3 on a cluster, for the stream and the snapshot store alike
        await ensure_stream(self.js, cfg, replicas)
        try:
            self.store = await self.js.object_store(BUCKET)
            await ensure_replicas(self.js, f"OBJ_{BUCKET}", replicas)
        except NotFoundError:
            self.store = await self.js.create_object_store(BUCKET, config=ObjectStoreConfig(replicas=replicas))
        await self._restore()

    async def _restore(self) -> None:
        try:
            obj = await self.store.get(SNAPSHOT_KEY)
        except (ObjectNotFoundError, NotFoundError):
            return
        data = msgpack.unpackb(obj.data or b"", raw=False)
        self.index.restore(data["index"])
        self.applied_seq = self.snapshot_seq = int(data["stream_seq"])
        self.restored_from = self.applied_seq
        self.indexed_blocks = self.index.stats().blocks
        self.log.info("index_restored", stream_seq=self.applied_seq, blocks=self.index.stats().to_dict())

    async def start(self) -> None:
        # Replay everything after the snapshot, then keep consuming live (one ordered consumer does both).
        start = self.applied_seq + 1
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
        await self.js.subscribe(Subjects.KV_EVENTS_ALL, cb=self.on_event_msg, ordered_consumer=True, config=config)
        await self.b.subscribe(Subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        await self.b.subscribe(Subjects.CACHE_QUERY, CacheQuery, self.on_query, queue="cache_index")
        await self.b.subscribe(Subjects.ADMIN_CACHE_STATS, CacheStatsRequest, self.on_stats, queue="cache_index")
        self.b.spawn(self._reaper())
        self.b.spawn(self._snapshotter())

    async def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            await self._snapshot()

    def load(self) -> WorkerLoad:
        # stats() walks the whole index: counted when the index is snapshotted, not on every heartbeat.
        return WorkerLoad(cached_blocks=self.indexed_blocks)

    def heartbeat_extra(self) -> dict[str, Any]:
        return {}

    async def on_event_msg(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.applied_seq:
            return
        self.applied_seq = seq
        try:
            batch = proto.decode(msg.data, KvEventBatch)
        except proto.ProtocolError as exc:
            self.log.warning("bad_kv_event_batch", error=exc.message, stream_seq=seq)
            return
        if self.index.apply(batch):
            self.gaps += 1
            self.log.warning("kv_event_gap", target=batch.worker_id, seq=batch.seq)
            self.b.spawn(resync_index(self.b, self.index, batch.worker_id, self.log))

    async def on_heartbeat(self, hb: Heartbeat, _: Msg) -> None:
        self.registry.observe(hb, time.monotonic())

    async def on_query(self, q: CacheQuery, msg: Msg) -> None:
        await self.b.respond(msg, CacheQueryReply(matched_blocks=self.index.lookup(q.block_hashes)))

    async def on_stats(self, _: CacheStatsRequest, msg: Msg) -> None:
        """``splitserve cache stats``: blocks per worker and tier, and how far the index has read the stream.
        O(blocks), like a snapshot: an operator's request, not a hot path."""
        st = self.index.stats()
        workers = [CacheWorkerStats(worker_id=w, blocks=self.index.worker_blocks(w), blocks_by_medium=by,
                                    last_batch_seq=self.index.expected_seq(w) - 1)
                   for w, by in sorted(st.worker_blocks.items())]
        await self.b.respond(msg, CacheStatsReply(
            index_id=self.worker_id, blocks=st.blocks, blocks_by_medium=st.blocks_by_medium, workers=workers,
            batches=st.batches, events=st.events, gaps=self.gaps, stale_batches=st.stale_batches,
            restarts=st.restarts, applied_seq=self.applied_seq, snapshot_seq=self.snapshot_seq,
            restored_from=self.restored_from))

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            for wid, reason in self.registry.reap(time.monotonic(), observer=self.worker_id):
                if self.index.remove_worker(wid):
                    self.log.info("worker_dropped_from_index", dropped_worker=wid, reason=reason)

    async def _snapshot(self) -> None:
        if self.applied_seq == self.snapshot_seq:
            return
        seq = self.applied_seq
        data = msgpack.packb({"stream_seq": seq, "index": self.index.snapshot()}, use_bin_type=True)
        await self.store.put(SNAPSHOT_KEY, data)
        self.snapshot_seq = seq
        self.indexed_blocks = self.index.stats().blocks

    async def _snapshotter(self) -> None:
        while True:
            await asyncio.sleep(self.snapshot_interval_s)
            try:
                await self._snapshot()
            except Exception as exc:
                self.log.warning("snapshot_failed", error=str(exc))
