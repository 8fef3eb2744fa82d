"""The router's prefix-index replica: fed live by the workers' KV events (``ss.kv.*``), warm-started from the
cache index.

A router that just (re)started would know nothing of the cluster's cache until each worker next emits events
(an idle worker's cache stays invisible: kvaware sends the repeat of a prompt anywhere). So before it reports
ready, the router loads the cache-index service's snapshot and replays ``SS_KV_EVENTS`` after it, then goes on
with its live core subscription; batches arriving meanwhile are held back and handed off exactly once (the
proof is in :mod:`splitserve.cache.warmstart`). The time is bounded (:data:`WARM_START_S`): past it the
router goes ready with what it has, and a worker whose batches then show a gap is resynced from its own dump
as always. Without a cache index (no stream) it subscribes and goes on at once, as before.
"""

from __future__ import annotations

from nats.aio.msg import Msg

from splitserve.cache.warmstart import WarmStart
from splitserve.proto import KvEventBatch, Subjects
from splitserve.services.common.resync import resync_index
from splitserve.services.router.core import RouterCore

# Runs within the registry warm-up (REGISTRY_WARMUP_S) when it is quick, which it is (tens of ms for a snapshot
# and thousands of batches); a stream too long to replay in this bound is left to the gap resyncs.
WARM_START_S = 3.0


class IndexFeed(RouterCore):
    """The KV-event subscription and its warm start."""

    warm_start_s: float = WARM_START_S
    _warm: WarmStart | None = None  # while a warm start runs: holds the live batches back

    async def subscribe_kv_events(self) -> None:
        """Warm-start the index replica from the cache index, subscribing to the live events part-way."""
        nc = self.b.nc
        warm = self._warm = WarmStart(nc, self.policy.apply_events, self.index.restore)

        async def subscribe_live() -> None:
            await self.b.subscribe(Subjects.KV_EVENTS_ALL, KvEventBatch, self.on_kv_events)
            await nc.flush()  # the server has the SUB: the replay's end is read after this

        try:
            rep = await warm.run(subscribe_live, self.warm_start_s)
        finally:
            self._warm = None
        for worker in sorted(rep.gaps):
            self.b.spawn(resync_index(self.b, self.index, worker, self.log))
        fields = rep.to_log()
        if rep.snapshot_seq is None and not rep.replayed:
            self.log.info("index_warm_start_skipped", **fields)  # e.g. no cache index: cold, as before
        else:
            self.log.info("index_warm_start", blocks=len(self.index), workers=len(self.index.workers()), **fields)

    def forget_unheard_index_workers(self) -> None:
        """After the registry warm-up (every live worker heard): workers the snapshot named that no heartbeat did
        are gone. Routing never picks them (it reads heartbeats), but the registry's reaper does not know them,
        so their residency would stay in the replica for good."""
        for worker in self.index.workers():
            if worker not in self.registry.workers:
                self.index.remove_worker(worker)

    async def on_kv_events(self, batch: KvEventBatch, msg: Msg) -> None:
        warm = self._warm
        if warm is not None and warm.hold(batch, msg.data):
            return
        if self.policy.apply_events(batch):
            self.b.spawn(resync_index(self.b, self.index, batch.worker_id, self.log))
