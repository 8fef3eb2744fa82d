"""Router service: the front of the pipeline.

Intake (``ss.req.{tenant}``, request/reply): tokenize, check the model's and the tenant's limits (unknown
tenant, max prompt / max_tokens, in-flight, queued, tokens per minute: a precise refusal with a retry-after),
store the request durably in its tenant's queue (``splitserve.runtime.workqueue``) and answer Accepted. When
nothing waits in the queue and a decoder has a free slot (and no other router is live), intake then dispatches
it itself, at once (:mod:`.direct`).

Dispatch: while decoders have free slots, the fair scheduler (``splitserve.tenancy.fairshare``) picks the
tenant to serve next by weighted tokens; the router pulls that tenant's next request, asks the routing
policy for a decision, and publishes a PrefillJob (disaggregated) or DecodeJob (direct). It tracks every
request it dispatched until the worker reports it finished (then acks its queue message), and when the
router itself dies its requests are redelivered: one still running is adopted, one already finished is
dropped, the rest are dispatched again.

Migration (``_worker_lost`` / ``_migrate``): the router listens to the stream of every request it dispatched,
so it knows the tokens the caller has received. When the decoder holding a request dies (heartbeats stop, or
it stops after a drain), or its prefiller dies before the KV landed, or a prefiller bounces the job (the KV
hand-off failed), the request is routed again by the usual rules over prompt + tokens so far, and the new
decoder continues the stream at the next seq number: the caller sees one unbroken stream. After
``max_migrations`` moves the request ends with ``worker_died`` naming the count.

Drain (SIGTERM): intake stops (other routers of the queue group take new requests), dispatch stops (queued
requests wait for the other routers), and in-flight requests are followed until they end or the drain
bound runs out (their queue messages are then redelivered to another router, which adopts them).

Several routers (``splitserve up --routers N``) share one behaviour through JetStream
(``splitserve.services.router.shared``): a request id is registered once cluster-wide at intake and every state change
(dispatched, ended, adopted) is a compare-and-set on its record, so it runs at most once and ends with exactly
one terminal message whichever replica a client (re-)sends it to; quota usage is one compare-and-set snapshot
per tenant, so limits are global; each router publishes the virtual tokens it charged (fair share) and the
requests it just dispatched (the other routers' pending-load ledgers count them until the workers report them).

``--no-queue`` dispatches at intake instead (no durability, no fair share, one router's own quotas), for
comparison.

The parts: :mod:`.core` (state, a request's end), :mod:`.intake`, :mod:`.direct` (the queue's fast path),
:mod:`.dispatch`, :mod:`.migration`, :mod:`.preempt`, :mod:`.slo_gate` (SLO admission),
:mod:`.queued_ends`, :mod:`.peers`, :mod:`.admin`, :mod:`.warmstart` (the index replica's KV events, warm-started
from the cache index before the router reports ready).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

from nats.aio.msg import Msg
from nats.js.api import DiscardPolicy, StreamConfig

from splitserve import proto
from splitserve.cache.index import PrefixIndex
from splitserve.proto import (
    CancelRequest,
    DispatchNote,
    FairShareReport,
    GenerateRequest,
    Heartbeat,
    JobBounced,
    QueueReportRequest,
    RequestFinished,
    Subjects,
)
from splitserve.routing.book import RECENT_ENDS_KEPT
from splitserve.routing.live import build_policies
from splitserve.runtime.jetstream import ensure_stream, replicas_for
from splitserve.runtime.workqueue import WorkQueue
from splitserve.services.router.admin import Admin
from splitserve.services.router.core import Inflight, RouterCore
from splitserve.services.router.dispatch import Dispatch
from splitserve.services.router.intake import Intake
from splitserve.services.router.migration import Migration
from splitserve.services.router.peers import Peers
from splitserve.services.router.preempt import Preempt
from splitserve.services.router.queued_ends import QueuedEnds
from splitserve.services.router.shared import RequestRegistry, SharedQuota
from splitserve.services.router.slo_gate import SloGate
from splitserve.services.router.warmstart import IndexFeed

__all__ = ["RECENT_ENDS_KEPT", "Inflight", "RouterService"]


class RouterService(Intake, SloGate, Preempt, Dispatch, Migration, QueuedEnds, Peers, Admin, IndexFeed, RouterCore):
    role = "router"

    async def setup(self) -> None:
        # Async jobs' results are kept (per tenant subject, with a TTL) in JetStream for later fetching.
        js = self.b.nc.jetstream()
        cfg = StreamConfig(name=Subjects.RESULTS_STREAM, subjects=[Subjects.RESULTS_ALL],
                           max_age=self.results_ttl_s, max_bytes=1 << 30, discard=DiscardPolicy.OLD,
                           allow_direct=True)
        await ensure_stream(js, cfg, replicas_for(self.b.nc))  # R3 on a cluster

        self.wq = WorkQueue(self.b, ack_wait_s=self.queue_ack_wait_s)
        await self.wq.setup()  # also the usage stream, which --no-queue keeps too
        if self.use_queue:
            self.requests = RequestRegistry(js, ttl_s=self.request_ttl_s, replicas=replicas_for(self.b.nc))
            await self.requests.setup()
            self.shared_quota = SharedQuota(js, self.tenants, self.quota, replicas=replicas_for(self.b.nc))
            await self.shared_quota.setup()
        await asyncio.to_thread(self.models.load_tokenizers)
        self.make_policy()

    def make_policy(self) -> None:
        """The routing policy objects (the simulator builds its router with the same ``build_router``)."""
        # The router always keeps an in-process replica of the cache index, fed by the workers' own KV
        # events: kvaware routes on it, and every strategy's disaggregation rule counts *uncached* tokens.
        self.index = PrefixIndex()
        per_model = {name: (strategy or self.strategy_name,
                            self.disagg if threshold is None else replace(self.disagg, min_uncached_tokens=threshold))
                     for name, (strategy, threshold) in self.model_policies.items()}
        self.policy = build_policies(self.strategy_name, self.disagg, self.index, self.long_prompt_tokens, per_model)

    async def start(self) -> None:
        self._started = self.clock()
        b = self.b
        await b.subscribe(Subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        await b.subscribe(Subjects.FINISHED_ALL, RequestFinished, self.on_finished, scoped=True)
        # First, before intake: the index replica warm-starts from the cache index (bounded; runs within the
        # registry warm-up below, which counts from _started) and then follows the live KV events.
        await self.subscribe_kv_events()
        await b.subscribe(Subjects.CANCEL_ALL, CancelRequest, self.on_cancel, scoped=True)
        await b.subscribe(Subjects.BOUNCED_ALL, JobBounced, self.on_bounced, scoped=True)
        self._intake_subs.append(await b.subscribe(Subjects.ADMIN_QUEUES, QueueReportRequest, self.on_queue_report,
                                                   queue=Subjects.ROUTER_QUEUE, concurrent=True))
        self._intake_subs.append(await b.subscribe(Subjects.ADMIN_ROUTE_EXPLAIN, proto.RouteExplainRequest,
                                                   self.on_route_explain, queue=Subjects.ROUTER_QUEUE))
        self._intake_subs.append(await b.subscribe(
            Subjects.REQUEST_ALL, GenerateRequest, self.on_request, queue=Subjects.ROUTER_QUEUE, concurrent=True,
            scoped=True, gate=self._intake_gate,
        ))
        b.spawn(self._reaper())
        if self.use_queue:
            await b.subscribe(Subjects.ROUTED_ALL, DispatchNote, self.on_dispatch_note)
            await b.subscribe(Subjects.FAIR_ALL, FairShareReport, self.on_fair_report)
            b.spawn(self._dispatch_loop())
            b.spawn(self._keepalive())
            b.spawn(self._redelivery_sweep())
            b.spawn(self._fair_reports())
            b.spawn(self._reconcile_quota())
        await self._registry_warmup()  # "ready" once the worker set is known
        self.forget_unheard_index_workers()

    async def on_heartbeat(self, hb: Heartbeat, _: Msg) -> None:
        now = self.clock()
        self.registry.observe(hb, now)
        st = self.registry.workers.get(hb.worker_id)
        if hb.role in ("decode", "prefill") and st is not None and st.hb is hb:  # not an out-of-order report
            load = hb.load
            held = self.book.heartbeat(hb.worker_id, hb.role, hb.active_requests, now,
                                       running=load.active_seqs + load.queued_requests, max_seqs=load.max_seqs,
                                       pool=hb.pool, ready=hb.state == "ready",
                                       live_until=now + self.registry.timeout_for(st),
                                       model=self.models.model_of(hb))
            for key in held:
                self.policy.release(key, hb.worker_id)  # this worker's own load report now counts it
            if hb.role == "decode":
                self._dispatch_wake.set()
        self._worker_change.set()

    async def drain(self) -> None:
        # New requests go to the other routers of the queue group (drain() answers what was already
        # delivered here); dispatch stops (self.draining); running requests are followed until they end.
        for sub in self._intake_subs:
            with contextlib.suppress(Exception):
                await sub.drain()
        while self.inflight:
            await asyncio.sleep(0.05)
