"""Warm-starting a prefix-index replica (a router's) from the cache-index service's durable state.

The cache-index service keeps every worker's KV event batches in the JetStream stream ``SS_KV_EVENTS`` and
snapshots its :class:`~splitserve.cache.index.PrefixIndex` into the object store ``ss-cache-index`` (key
``snapshot``: msgpack ``{stream_seq, index}``) every few seconds. A replica that starts late loads that snapshot
and replays the stream after it, so it knows the cluster's cache at once, instead of learning a worker's blocks
only when that worker next emits events (an idle worker's cache would stay invisible).

:class:`WarmStart` does this beside the replica's own live core subscription on ``ss.kv.*``, which it
subscribes part-way (``subscribe_live``). Live batches that arrive meanwhile are *held back* (:meth:`WarmStart.hold`)
and applied at the hand-off, so each batch is applied exactly once and in each worker's order:

1. ``L0`` := the stream's last sequence, read *before* the live subscription exists. A message stored at or
   below ``L0`` was received by nats-server before our SUB was (the server stores what it received; core
   delivery only reaches subscriptions that exist when a message is routed), so no held batch has a stream
   sequence <= ``L0``.
2. The replay records the raw bytes of every message it applied with a sequence > ``L0`` (the only ones that
   can also have been held). A batch's bytes identify it: they hold its worker, per-worker seq and timestamp.
3. Hand-off (synchronous: no live callback runs in between): every held batch whose bytes the replay applied
   is skipped, every other one is applied, in arrival order; later batches are applied live. So nothing is
   applied twice (``PrefixIndex.apply`` would drop a repeat by its per-worker seq anyway, except a repeated
   ``seq == 0``, which it takes for a restarted worker and would clear: hence the exact dedupe), and a worker's
   batches stay in its publish order (core NATS and the stream both keep one publisher's order; the replayed
   ones precede the held ones not replayed).
4. Nothing is lost: every batch is either in the stream up to where the replay stopped, or held. The replay
   reads at least up to the last sequence read *after* the live subscription was registered, and when a live
   batch was held by then it goes on until it meets one (nats-server stores messages in the order it
   received them, so every batch received before our SUB precedes it). The one residual case, a batch received
   just before our SUB but still queued for storage when an idle stream's end was read (twice), is what
   the per-worker sequence check catches anyway: that worker's next batch shows a gap and is resynced.

Whatever goes wrong (no stream: no cache index runs; no snapshot yet; the time bound runs out), the replica
keeps what it loaded, the live subscription is made regardless, and a gap resyncs the worker as before.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import nats.errors
from nats.aio.client import Client as NATS
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError, ObjectNotFoundError

from splitserve import proto
from splitserve.proto import KvEventBatch, Subjects

__all__ = ["BUCKET", "SNAPSHOT_KEY", "STREAM", "WarmStart", "WarmStartReport", "read_snapshot"]

STREAM = "SS_KV_EVENTS"  # the workers' KV event batches (the cache-index service creates it)
BUCKET = "ss-cache-index"  # the cache-index service's object store (its stream: OBJ_ss-cache-index)
SNAPSHOT_KEY = "snapshot"
IDLE_S = 0.5  # no message for this long while replaying: the stream has nothing more stored
YIELD_EVERY = 256  # replayed messages between two turns of the event loop
API_TIMEOUT_S = 2.0  # one JetStream API call (a missing stream answers at once; no JetStream: no responders)


async def read_snapshot(nc: NATS, timeout: float = API_TIMEOUT_S) -> tuple[int, bytes] | None:
    """The cache index's last snapshot: (stream sequence it covers, ``PrefixIndex.snapshot()`` bytes), or None.

    Reads the object store without ``ObjectStore.get``, which looks the chunks' stream up by subject
    (``$JS.API.STREAM.NAMES``): binding the stream by name keeps a reader's rights to this one store's
    stream info, message get and an ordered consumer.
    """
    js = nc.jetstream(timeout=timeout)
    try:
        store = await js.object_store(BUCKET)
        info = await store.get_info(SNAPSHOT_KEY)
    except (NotFoundError, ObjectNotFoundError):
        return None
    if info.deleted or not info.nuid:
        return None
    data = bytearray()
    if info.size:
        sub = await js.subscribe(f"$O.{BUCKET}.C.{info.nuid}", stream=f"OBJ_{BUCKET}", ordered_consumer=True)
        try:
            while len(data) < info.size:
                msg = await sub.next_msg(timeout=timeout)
                data += msg.data
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
    digest = (info.digest or "").split("=", 1)[-1]
    if len(data) != info.size or hashlib.sha256(data).digest() != base64.urlsafe_b64decode(digest):
        raise ValueError(f"the {BUCKET}/{SNAPSHOT_KEY} object is incomplete or corrupt")
    doc = msgpack.unpackb(bytes(data), raw=False)
    return int(doc["stream_seq"]), doc["index"]


@dataclass
class WarmStartReport:
    """What a warm start did (logged by the router as ``index_warm_start``)."""

    snapshot_seq: int | None = None  # the stream sequence the loaded snapshot covers (None: no snapshot)
    snapshot_ms: float = 0.0  # time to read and restore it
    replayed: int = 0  # batches applied from the stream after the snapshot
    last_seq: int = 0  # the last stream sequence replayed
    held: int = 0  # live batches that arrived during the warm start
    duplicates: int = 0  # ... of which the replay had applied already (skipped at the hand-off)
    complete: bool = False  # replayed up to the live subscription (not cut short by the time bound)
    skipped: str | None = None  # why it loaded nothing (or stopped), e.g. no stream
    total_ms: float = 0.0
    gaps: set[str] = field(default_factory=set)  # workers whose sequence jumped: resync them

    def to_log(self) -> dict[str, Any]:
        return {"snapshot_seq": self.snapshot_seq, "snapshot_ms": round(self.snapshot_ms, 1),
                "replayed": self.replayed, "last_seq": self.last_seq, "held": self.held,
                "duplicates": self.duplicates, "complete": self.complete, "skipped": self.skipped,
                "total_ms": round(self.total_ms, 1), "gaps": len(self.gaps)}


class WarmStart:
    """One warm start of an index replica; see the module docstring for the hand-off and why it is exact.

    ``apply`` feeds one batch to the replica (True: a sequence gap), ``restore`` replaces it with a snapshot."""

    def __init__(self, nc: NATS, apply: Callable[[KvEventBatch], bool], restore: Callable[[bytes], None]) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=API_TIMEOUT_S)
        self.apply = apply
        self.restore = restore
        self.held: list[tuple[KvEventBatch, bytes]] | None = []  # None once handed off
        self._held_bytes: set[bytes] = set()
        self._replayed_after_l0: set[bytes] = set()
        self.report = WarmStartReport()

    def hold(self, batch: KvEventBatch, data: bytes) -> bool:
        """The live subscription's batch: held back (True) until the hand-off, or False once live."""
        if self.held is None:
            return False
        self.held.append((batch, data))
        self._held_bytes.add(data)
        return True

    async def run(self, subscribe_live: Callable[[], Awaitable[Any]], budget_s: float) -> WarmStartReport:
        """Load the snapshot, subscribe live (``subscribe_live`` must return once nats-server has the SUB, e.g.
        after a flush), replay the stream, hand off. Bounded by ``budget_s`` (the subscription is made anyway)."""
        rep = self.report
        t0 = time.perf_counter()
        deadline = t0 + budget_s
        start: tuple[int, int] | None = None
        try:
            start = await asyncio.wait_for(self._load_snapshot(), budget_s)
        except NotFoundError:
            rep.skipped = f"no stream {STREAM} (no cache index)"
        except (TimeoutError, nats.errors.NoRespondersError):
            rep.skipped = "JetStream did not answer"
        except Exception as exc:  # a corrupt snapshot, a missing right: start cold, as without a cache index
            rep.skipped = f"{type(exc).__name__}: {exc}"
        await subscribe_live()
        if start is not None:
            try:
                await asyncio.wait_for(self._replay(*start, deadline), max(0.01, deadline - time.perf_counter()))
            except TimeoutError:
                rep.skipped = f"time bound ({budget_s:g} s) reached while replaying"
            except Exception as exc:
                rep.skipped = f"{type(exc).__name__}: {exc}"
        self._hand_off()
        rep.total_ms = (time.perf_counter() - t0) * 1000
        return rep

    async def _load_snapshot(self) -> tuple[int, int]:
        """Restore the snapshot; returns (first sequence to replay, L0). Raises NotFoundError without a stream."""
        info = await self.js.stream_info(STREAM)  # L0: before the live subscription (module docstring, 1.)
        l0 = int(info.state.last_seq or 0)
        t = time.perf_counter()
        snap = await read_snapshot(self.nc)
        if snap is None:
            return 1, l0
        seq, data = snap
        self.restore(data)
        self.report.snapshot_seq = seq
        self.report.snapshot_ms = (time.perf_counter() - t) * 1000
        return seq + 1, l0

    async def _replay(self, start: int, l0: int, deadline: float) -> None:
        rep = self.report
        target = int((await self.js.stream_info(STREAM)).state.last_seq or 0)  # read after the SUB (4.)
        if target < start:
            rep.complete = True
            return
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
        sub = await self.js.subscribe(Subjects.KV_EVENTS_ALL, stream=STREAM, ordered_consumer=True, config=cfg)
        rechecked = False
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=IDLE_S)
                except nats.errors.TimeoutError:
                    rep.complete = rep.last_seq >= target
                    return
                seq, data = msg.metadata.sequence.stream, msg.data
                rep.last_seq = seq
                if not seq % YIELD_EVERY:
                    # Buffered messages never suspend next_msg: let heartbeats (and the time bound) in.
                    await asyncio.sleep(0)
                    if time.perf_counter() > deadline:
                        raise TimeoutError
                if seq > l0:
                    self._replayed_after_l0.add(data)
                self._apply(data)
                if seq < target:
                    continue
                if data in self._held_bytes:  # met the live feed: everything received before our SUB is behind
                    break
                if not self.held:
                    if rechecked:
                        break
                    rechecked = True  # idle: read the end once more (a batch may have been queued for storage)
                    target = max(target, int((await self.js.stream_info(STREAM)).state.last_seq or 0))
                    if target <= seq:
                        break
            rep.complete = True
        finally:
            await sub.unsubscribe()  # the ephemeral consumer goes away with its interest (no delete right needed)

    def _apply(self, data: bytes) -> None:
        try:
            batch = proto.decode(data, KvEventBatch)
        except proto.ProtocolError:
            return  # the live path drops it too
        self.report.replayed += 1
        if self.apply(batch):
            self.report.gaps.add(batch.worker_id)

    def _hand_off(self) -> None:
        """Apply the held batches the replay did not (module docstring, 3.); from now on batches apply live."""
        held, self.held = self.held or [], None
        rep = self.report
        rep.held = len(held)
        replayed = self._replayed_after_l0
        for batch, data in held:
            if data in replayed:
                replayed.discard(data)
                rep.duplicates += 1
                continue
            if self.apply(batch):
                rep.gaps.add(batch.worker_id)
        self._held_bytes.clear()
        replayed.clear()
