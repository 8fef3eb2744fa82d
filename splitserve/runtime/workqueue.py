"""The durable request queue between the router's intake and its dispatch: JetStream mechanics only.

One work-queue stream (``SS_QUEUE``) with a subject per tenant, model pool and priority class
(``ss.q.{tenant}.{pool}.p{c}``; ``pool`` is ``proto.model_pool`` of the served model's name). Intake publishes
each accepted request with ``Nats-Msg-Id`` = ``tenant.request``, so a re-sent request is de-duplicated by the
server. Dispatch pulls from the (tenant, pool, class) lanes of a model whose decoders have free slots, the
tenant as the fair scheduler picks, through one durable pull consumer per lane shared by every router; a message
stays un-acked while its request runs (kept alive with in-progress acks) and is acked when it finishes, so a
router that dies mid-request has its messages redelivered to another router (or to itself, restarted) after
the ack wait.

Also here: the ``SS_USAGE`` stream that keeps every ``RequestFinished`` (usage metering, and the "did this
request already finish?" lookup a redelivery needs), and the per-(tenant, class) pending counts the
scheduler picks from (per model pool): exact after each fetch (the server reports what is left), refreshed from consumer
info periodically to see what other routers enqueued.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

import structlog
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NotFoundError

from splitserve import proto
from splitserve.obs import tracing
from splitserve.proto import GenerateRequest, QueuedRequest, Subjects
from splitserve.runtime import natsnext
from splitserve.runtime.bus import Bus
from splitserve.runtime.jetstream import ensure_stream, replicas_for

log = structlog.get_logger("splitserve.router.queue")
# How long one attempt to make a lane's consumer waits for the server; the dispatch loop's refresh (every 0.5 s)
# tries again, so an unanswered attempt holds dispatch for this long, not for nats-py's default 5 s.
LANE_CREATE_TIMEOUT_S = 1.0

NUM_CLASSES = Subjects.QUEUE_CLASSES  # the lanes' naming is the contract's (proto.subjects)
PULL_TIMEOUT_S = 2.0  # a no-wait pull is answered at once; this only bounds a lost answer
_CLASS_TOKENS = frozenset(f"p{k}" for k in range(NUM_CLASSES))  # the last token of a lane's subject


async def pull_now(sub: JetStreamContext.PullSubscription, want: int) -> list[Msg]:
    """Up to ``want`` messages that are waiting now, never waiting for more: one no-wait pull request (the server
    answers with what it has, then "404 no messages"). nats-py's ``fetch`` sends its pull with an expiry, which
    the server holds open until that many messages arrive or it expires: with several routers a lane's pending
    count is often stale (another router took what was there), and every such fetch blocked for its whole
    timeout (2 routers served half of what 1 did). Uses the pull subscription's inbox and subject (nats-py is
    pinned)."""
    inner = sub._sub
    assert inner is not None
    msgs: list[Msg] = []
    while not inner._pending_queue.empty() and len(msgs) < want:  # delivered by an earlier pull after it gave up
        m = await natsnext.next_msg(inner, PULL_TIMEOUT_S)  # (buffered: at once)
        if not JetStreamContext.is_status_msg(m):
            msgs.append(m)
    if len(msgs) >= want:
        return msgs
    await sub._nc.publish(sub._nms, json.dumps({"batch": want - len(msgs), "no_wait": True}).encode(),
                          sub._deliver)
    deadline = time.monotonic() + PULL_TIMEOUT_S
    while len(msgs) < want:
        try:
            m = await natsnext.next_msg(inner, max(0.01, deadline - time.monotonic()))
        except (NatsTimeout, TimeoutError):
            break
        status = JetStreamContext.is_status_msg(m)
        if status is None:
            msgs.append(m)
        elif status != "100":  # 404 no messages, 408 expired, 409...: the answer is complete (100: heartbeat)
            break
    return msgs


priority_class = Subjects.priority_class
consumer_name = Subjects.queue_consumer


@dataclass
class _Lane:
    tenant: str
    pool: str
    klass: int
    sub: JetStreamContext.PullSubscription
    pending: int = 0  # not yet delivered to any router
    ack_pending: int = 0  # delivered and not acked: running (here or at another router), or due for redelivery
    checked: float = 0.0

    @property
    def subject(self) -> str:
        return Subjects.queue(self.tenant, self.klass, self.pool)

    def waiting(self) -> int:
        # Messages a pull that timed out client-side still brought in sit in the subscription's buffer: they
        # are this router's to dispatch (the next fetch returns them first), so they count as waiting here.
        return max(0, self.pending) + self.sub.pending_msgs


class WorkQueue:
    def __init__(self, bus: Bus, *, ack_wait_s: float = 30.0, usage_ttl_s: float = 7 * 86400.0,
                 dedupe_window_s: float = 600.0) -> None:
        self.bus = bus
        self.js = bus.nc.jetstream()
        self.ack_wait_s = ack_wait_s
        self.usage_ttl_s = usage_ttl_s
        self.dedupe_window_s = dedupe_window_s
        self._lanes: dict[tuple[str, str, int], _Lane] = {}  # (tenant, pool, class)
        self._lane_lock = asyncio.Lock()

    async def setup(self) -> None:
        await self._ensure_stream(StreamConfig(
            name=Subjects.QUEUE_STREAM, subjects=[Subjects.QUEUE_ALL], retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE, duplicate_window=self.dedupe_window_s, max_bytes=1 << 30,
            # A full queue refuses new requests (intake answers "busy") rather than dropping accepted ones.
            discard=DiscardPolicy.NEW))
        await self._ensure_stream(StreamConfig(
            name=Subjects.USAGE_STREAM, subjects=[Subjects.FINISHED_ALL], storage=StorageType.FILE,
            max_age=self.usage_ttl_s, max_bytes=512 << 20, discard=DiscardPolicy.OLD, allow_direct=True))
        await self.refresh(force=True)

    async def _ensure_stream(self, cfg: StreamConfig) -> None:
        # R3 on a cluster (splitserve.runtime.jetstream); an existing stream is updated in place (an older
        # config, or R1 from before the cluster grew)
        try:
            await ensure_stream(self.js, cfg, replicas_for(self.bus.nc))
        except Exception as exc:
            raise RuntimeError(f"cannot create JetStream stream {cfg.name}: {exc!r} (JetStream storage limits "
                               "of the nats-server?)") from exc

    # --- intake ----------------------------------------------------------------------------------------
    async def enqueue(self, q: QueuedRequest, pool: str) -> bool:
        """Store an accepted request durably in its model ``pool``'s lane. Returns False if it was a duplicate
        (already queued)."""
        req = q.request
        klass = priority_class(req.priority)
        subject = Subjects.queue(req.tenant, klass, pool)
        data = self.bus._payload(q)
        headers = tracing.inject(proto.headers_for(q, {"Nats-Msg-Id": req.key}))
        ack = await self.js.publish(subject, data, headers=headers, timeout=5.0)
        if ack.duplicate:
            return False
        # Stored, so accepted, whatever follows. A tenant's first request also makes its lane (a durable
        # consumer); on a degraded cluster that call can go unanswered while the stream's leader is elected
        # (measured: 5 s, then a timeout, on a 3-node cluster with the leader killed). It is not the caller's
        # business: refresh() finds the lane from the stored message and makes it on a later pass.
        existed = (req.tenant, pool, klass) in self._lanes
        try:
            lane = await self.lane(req.tenant, klass, pool)
        except Exception as exc:
            log.warning("lane_deferred", tenant=req.tenant, pool=pool, klass=klass, error=repr(exc))
            return True
        if existed:  # (a lane made just now read its pending count from the server: this message included)
            lane.pending += 1
        return True

    def taken(self, req: GenerateRequest, pool: str) -> None:
        """A request this router stored was dispatched without being pulled (the queue's fast path): it does not
        wait, so it no longer counts as waiting here. Its message stays in the queue until a pull brings it (the
        periodic refresh counts it again), and the router acks it then."""
        lane = self._lanes.get((req.tenant, pool, priority_class(req.priority)))
        if lane is not None and lane.pending > 0:
            lane.pending -= 1

    # --- dispatch --------------------------------------------------------------------------------------
    async def lane(self, tenant: str, klass: int, pool: str) -> _Lane:
        key = (tenant, pool, klass)
        lane = self._lanes.get(key)
        if lane is not None:
            return lane
        async with self._lane_lock:
            lane = self._lanes.get(key)
            if lane is None:
                name = consumer_name(tenant, klass, pool)
                cfg = ConsumerConfig(durable_name=name, filter_subject=Subjects.queue(tenant, klass, pool),
                                     ack_policy=AckPolicy.EXPLICIT, ack_wait=self.ack_wait_s, max_deliver=-1,
                                     deliver_policy=DeliverPolicy.ALL, max_ack_pending=100_000)
                # create, or update ack wait; a short wait: unanswered (a leader election), it is tried again
                info = await self.js.add_consumer(Subjects.QUEUE_STREAM, cfg, timeout=LANE_CREATE_TIMEOUT_S)
                sub = await self.js.pull_subscribe_bind(name, Subjects.QUEUE_STREAM)
                lane = _Lane(tenant, pool, klass, sub, pending=int(info.num_pending or 0),
                             checked=time.monotonic())
                self._lanes[key] = lane
        return lane

    def pending_by_tenant(self, pool: str | None = None) -> dict[str, int]:
        """Requests waiting per tenant: in one model ``pool``'s lanes, or in all (None)."""
        out: dict[str, int] = {}
        for (tenant, p, _), lane in self._lanes.items():
            if pool is None or p == pool:
                out[tenant] = out.get(tenant, 0) + lane.waiting()
        return out

    def pools_waiting(self) -> set[str]:
        """The model pools with a request waiting in any lane."""
        return {p for (_, p, _), lane in self._lanes.items() if lane.waiting() > 0}

    def pending_by_class(self, tenant: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for (t, _, k), lane in sorted(self._lanes.items()):
            if t == tenant:
                out[f"p{k}"] = out.get(f"p{k}", 0) + max(0, lane.pending)
        return out

    async def fetch(self, tenant: str, max_msgs: int, pool: str) -> list[Msg]:
        """Up to ``max_msgs`` waiting messages of this tenant in this model pool, from its highest class that
        has any; [] if it has none after all."""
        for klass in range(NUM_CLASSES):
            lane = self._lanes.get((tenant, pool, klass))
            if lane is None or lane.waiting() <= 0:
                continue
            want = max(1, min(max_msgs, lane.waiting()))
            msgs = await pull_now(lane.sub, want)
            if not msgs:
                lane.pending = 0  # someone else took it; the periodic refresh will correct if not
                continue
            lane.pending = int(msgs[-1].metadata.num_pending)
            return msgs
        return []

    def lanes(self) -> list[_Lane]:
        return list(self._lanes.values())

    async def fetch_redelivered(self, lane: _Lane) -> list[Msg]:
        """One pull on a lane with nothing new waiting: the server hands out messages whose ack wait ran out
        (their router died) before anything else."""
        try:
            return await lane.sub.fetch(1, timeout=0.2)
        except (NatsTimeout, TimeoutError):
            return []

    async def refresh(self, force: bool = False) -> None:
        """Re-read pending counts from the server: finds tenants' lanes this router has not seen yet (enqueued
        by another router, or before a restart) and corrects drift."""
        try:
            info = await self.js.stream_info(Subjects.QUEUE_STREAM, subjects_filter=Subjects.QUEUE_ALL)
        except Exception as exc:
            log.warning("queue_refresh_failed", error=str(exc))
            return
        for subject in (info.state.subjects or {}):
            parts = subject.split(".")
            # Only the priority classes' lanes: fetch() pulls from those alone, so a lane beyond them (a message
            # on ss.q.T.P.p7, which no router writes) would count as waiting forever and dispatch would spin on it.
            if len(parts) == 5 and parts[4] in _CLASS_TOKENS:
                with contextlib.suppress(Exception):
                    await self.lane(parts[2], int(parts[4][1:]), parts[3])
        now = time.monotonic()
        for lane in list(self._lanes.values()):
            if force or now - lane.checked > 0.5:
                with contextlib.suppress(Exception):
                    ci = await lane.sub.consumer_info()
                    lane.pending = int(ci.num_pending or 0)
                    lane.ack_pending = int(ci.num_ack_pending or 0)
                    lane.checked = now

    async def oldest_wait_ms(self, tenant: str) -> float | None:
        """How long the oldest still-waiting request of this tenant has waited (any class)."""
        oldest: float | None = None
        for (t, pool, klass), lane in self._lanes.items():
            if t != tenant or lane.pending <= 0:
                continue
            with contextlib.suppress(Exception):
                ci = await lane.sub.consumer_info()
                first_waiting = int(ci.delivered.stream_seq if ci.delivered else 0) + 1
                raw = await self.js.get_msg(Subjects.QUEUE_STREAM, seq=first_waiting,
                                            subject=Subjects.queue(tenant, klass, pool), next=True)
                q = proto.decode(raw.data or b"", QueuedRequest)
                oldest = q.accepted_ms if oldest is None else min(oldest, q.accepted_ms)
        return None if oldest is None else max(0.0, proto.now_ms() - oldest)

    async def finished_record(self, tenant: str, request_id: str) -> proto.RequestFinished | None:
        """The request's RequestFinished if it already ended (kept in SS_USAGE)."""
        try:
            raw = await self.js.get_last_msg(Subjects.USAGE_STREAM, Subjects.finished(tenant, request_id))
        except NotFoundError:
            return None
        return proto.decode(raw.data or b"", proto.RequestFinished)
