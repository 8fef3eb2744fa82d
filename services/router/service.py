"""Router service: the front of the pipeline.

Intake (``ss.req.{tenant}``, request/reply): tokenize, check the model's and the tenant's limits (unknown
tenant, max prompt / max_tokens, in-flight, queued, tokens per minute: a precise refusal with a retry-after),
store the request durably in its tenant's queue (``splitserve.runtime.workqueue``) and answer Accepted.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import os
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import structlog
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import DiscardPolicy, StreamConfig
from opentelemetry import trace
from opentelemetry.trace import SpanContext

from splitserve import proto
from splitserve.cache import events as cache_events
from splitserve.cache.index import PrefixIndex
from splitserve.obs import tracing
from splitserve.proto import (
    Accepted,
    CancelRequest,
    DecodeJob,
    DispatchNote,
    ErrorCode,
    FairShareReport,
    GenerateRequest,
    Heartbeat,
    JobBounced,
    KvEventBatch,
    PrefillJob,
    QueuedRequest,
    QueueReport,
    QueueReportRequest,
    RequestFinished,
    RequestRecord,
    RevokeJob,
    RevokeReply,
    Route,
    StreamDelta,
    StreamError,
    StreamFinal,
    Subjects,
    TenantQueue,
    Usage,
    WorkerLoad,
    now_ms,
)
from splitserve.routing import NoWorkers, RoutingRequest, WorkerView
from splitserve.routing.book import RECENT_ENDS_KEPT, Flight, LossCheck, Move, RequestBook
from splitserve.routing.live import build_router, dispatch_batch, live_disagg, view_from_load
from splitserve.runtime.bus import PayloadTooLarge, identity_refusal, reply_allowed
from splitserve.runtime.jetstream import ensure_stream, replicas_for
from splitserve.runtime.registry import WorkerRegistry
from splitserve.runtime.service import Service
from splitserve.runtime.workqueue import WorkQueue
from splitserve.services.common.resync import resync_index
from splitserve.services.router.shared import CorruptRecord, RequestRegistry, SharedQuota
from splitserve.tenancy import TenantsConfig, load_tenants
from splitserve.tenancy.fairshare import FairScheduler
from splitserve.tenancy.intake_rate import IntakeBudget
from splitserve.tenancy.quota import QuotaBook

_REFUSAL_CODES = {"unknown_tenant": ErrorCode.UNKNOWN_TENANT, "quota_exceeded": ErrorCode.QUOTA_EXCEEDED,
                  "prompt_too_long": ErrorCode.PROMPT_TOO_LONG, "bad_request": ErrorCode.BAD_REQUEST}
MAX_DELIVERIES = 5  # a request that took down this many routers is failed instead of tried again
REGISTRY_WARMUP_S = 1.5  # three heartbeat intervals
FAIR_REPORT_S = 0.25  # how often a router tells the others what it charged each tenant
RECONCILE_S = 10.0  # how often a router checks old quota reservations against the request registry
RECONCILE_AFTER_S = 30.0  # reservations younger than this are never questioned (their intake may be running)


INLINE_TOKENIZE_BYTES = 16_384  # prompts up to this size are tokenized on the event loop (~100 us)
TOKENIZE_WAITING = 8  # large prompts tokenizing or waiting for the tokenizer thread at once; more: busy
OPEN_MODE_MAX_TENANTS = 1024  # distinct tenant names served without a tenants file
DROPPED_KEPT = 100_000  # requests ended in the queue, remembered until their queue message comes up


class _TokenizerBusy(Exception):
    pass


class _Rate:
    """Events per second over the last ``window_s``."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._t: deque[float] = deque()

    def add(self, now: float) -> None:
        self._t.append(now)
        if len(self._t) > 64 and self._t[0] < now - self.window_s:
            self.per_s(now)  # drop what left the window: nobody may ask for a while (only reports do)

    def per_s(self, now: float) -> float:
        while self._t and self._t[0] < now - self.window_s:
            self._t.popleft()
        return len(self._t) / self.window_s


@dataclass(eq=False)
class Inflight(Flight):
    """A flight of the request book, with what this service needs to drive it (its book state: :class:`Flight`)."""

    stream_subject: str = ""
    trace_ctx: SpanContext | None = None  # router.request's span: a later failure is recorded under it
    queue_msg: Msg | None = None  # its durable queue message, acked when the request ends
    record: RequestRecord | None = None  # its registry record (queue mode) and that record's revision
    record_rev: int = 0
    # ``job`` is the last job sent (None: adopted after a router restart, not movable)
    request: GenerateRequest | None = None
    job: DecodeJob | None = None
    sub: Any = None  # the stream subscription


class RouterService(Service):
    role = "router"

    def __init__(
        self,
        worker_id: str,
        nats_url: str,
        *,
        model: str | None = None,
        strategy: str = "roundrobin",
        disagg_threshold: int = 512,
        no_worker_wait_s: float = 5.0,
        max_inflight: int = 1024,
        max_stall_ms: float | None = 100.0,
        results_ttl_s: float = 86400.0,
        decoder_prefill_tps: float = 400.0,
        tenants_file: str | None = None,
        queue: bool = True,
        queue_ack_wait_s: float = 30.0,
        long_prompt_tokens: int = 2048,
        request_ttl_s: float = 900.0,
        max_migrations: int = 2,
        **kw: object,
    ) -> None:
        super().__init__(worker_id, nats_url, **kw)  # type: ignore[arg-type]
        self.max_migrations = max_migrations
        self._intake_subs: list[Any] = []
        self.model = model
        self.strategy_name = strategy
        self.disagg_threshold = disagg_threshold
        self.results_ttl_s = results_ttl_s
        self.disagg = live_disagg(disagg_threshold, max_stall_ms, decoder_prefill_tps)
        self.long_prompt_tokens = long_prompt_tokens
        self.no_worker_wait_s = no_worker_wait_s
        self.max_inflight = max_inflight
        self.registry = WorkerRegistry()
        # Every map of requests is keyed by ``proto.request_key(tenant, id)``: an id is unique only within its
        # tenant, so tenant A using B's id (before or after B) must find nothing of B's.
        self.book: RequestBook[Inflight] = RequestBook(recent_ends_kept=RECENT_ENDS_KEPT)
        self._worker_change = asyncio.Event()
        self.tenants_file = tenants_file
        self.tenants = load_tenants(tenants_file) if tenants_file else TenantsConfig.open_mode()
        self.quota = QuotaBook(self.tenants)
        self.fair = FairScheduler(self.tenants.weight)
        self.use_queue = queue
        self.queue_ack_wait_s = queue_ack_wait_s
        self._dispatch_wake = asyncio.Event()
        # Requests cancelled (or expired) while waiting in the queue: dropped when they reach dispatch.
        self.dropped: OrderedDict[str, None] = OrderedDict()
        self._deadlines: list[tuple[float, str, str]] = []  # (deadline ms, tenant, request id) accepted here
        self._accepted_meta: dict[str, tuple[str, str, int]] = {}  # key -> (tenant, stream subject, prompt len)
        self._rates: dict[tuple[str, str], _Rate] = {}  # only tenants that passed _tenant_slot: bounded
        self._open_tenants: set[str] = set()  # open mode: the tenant names seen (at most OPEN_MODE_MAX_TENANTS)
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._tokenizing = 0
        self._intake_budget = IntakeBudget()
        self._started = time.monotonic()  # reset at start(): setup may take long
        self.request_ttl_s = request_ttl_s
        self.incarnation = uuid.uuid4().hex[:12]  # this process, in fair-share reports
        self._remote_fair: dict[tuple[str, str], dict[str, float]] = {}  # (router, incarnation) -> its charges
        # router -> tenant -> virtual tokens of its DispatchNotes since its last FairShareReport
        self._remote_recent: dict[str, dict[str, float]] = {}
        self._claiming: set[str] = set()  # requests this router is claiming/dispatching now

    async def setup(self) -> None:
        from splitserve.services.router.tokenize import PromptTokenizer

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
        self.tokenizer = await asyncio.to_thread(PromptTokenizer, self.model)
        self.make_policy()

    def make_policy(self) -> None:
        """The routing policy objects (the simulator builds its router with the same ``build_router``)."""
        # The router always keeps an in-process replica of the cache index, fed by the workers' own KV
        # events: kvaware routes on it, and every strategy's disaggregation rule counts *uncached* tokens.
        self.index = PrefixIndex()
        self.policy = build_router(self.strategy_name, self.disagg, self.index, self.long_prompt_tokens)

    async def start(self) -> None:
        self._started = time.monotonic()
        b = self.b
        await b.subscribe(Subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        await b.subscribe(Subjects.FINISHED_ALL, RequestFinished, self.on_finished, scoped=True)
        await b.subscribe(Subjects.KV_EVENTS_ALL, KvEventBatch, self.on_kv_events)
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

    async def _registry_warmup(self) -> None:
        """Wait until this router has heard every live worker (three heartbeat intervals since start): a request
        routed before would miss the workers not heard yet (every prompt sent direct while no prefiller is)."""
        warm = REGISTRY_WARMUP_S - (time.monotonic() - self._started)
        if warm > 0:
            await asyncio.sleep(warm)

    @property
    def inflight(self) -> dict[str, Inflight]:
        """The request book's flights (read only: every change goes through ``self.book``)."""
        return self.book.flights

    def load(self) -> WorkerLoad:
        return WorkerLoad(active_seqs=len(self.inflight))

    def active_requests(self) -> list[str]:
        return list(self.inflight)

    def heartbeat_extra(self) -> dict[str, object]:
        return {"model": self.tokenizer.name if hasattr(self, "tokenizer") else None}

    # --- heartbeats and failure detection ------------------------------------------------------------
    async def on_heartbeat(self, hb: Heartbeat, _: Msg) -> None:
        now = time.monotonic()
        self.registry.observe(hb, now)
        st = self.registry.workers.get(hb.worker_id)
        if hb.role in ("decode", "prefill") and st is not None and st.hb is hb:  # not an out-of-order report
            load = hb.load
            held = self.book.heartbeat(hb.worker_id, hb.role, hb.active_requests, now,
                                       running=load.active_seqs + load.queued_requests, max_seqs=load.max_seqs,
                                       pool=hb.pool, ready=hb.state == "ready",
                                       live_until=now + self.registry.timeout_for(st))
            for key in held:
                self.policy.release(key, hb.worker_id)  # this worker's own load report now counts it
            if hb.role == "decode":
                self._dispatch_wake.set()
        self._worker_change.set()

    async def on_kv_events(self, batch: KvEventBatch, _: Msg) -> None:
        gap = self.policy.apply_events(cache_events.KvEventBatch.from_dict(batch.model_dump()))
        if gap:
            self.b.spawn(resync_index(self.b, self.index, batch.worker_id, self.log))

    async def on_finished(self, ev: RequestFinished, _: Msg) -> None:
        # Every router hears every RequestFinished; only the request's owner (the router holding it in
        # flight) settles it, so its quota and registry record are settled once.
        key = ev.key
        inf = self.book.ended(key, ev.worker_id)
        self._dispatch_wake.set()  # a slot its decoder's last heartbeat showed taken is free now
        used = (ev.usage.prompt_tokens + ev.usage.completion_tokens) if ev.usage is not None else None
        if inf is not None:
            await self._retire(inf, used, ev.status)
        self.policy.release(key)
        self._accepted_meta.pop(key, None)
        if not self.use_queue:
            self.quota.finish(ev.tenant, ev.request_id, used, time.monotonic())

    async def _retire(self, inf: Inflight, used_tokens: int | None, status: str = "error") -> None:
        """The request ended (any outcome): settle its fair-share charge, its registry record and quota, then
        ack its queue message (after: a router dying in between leaves a redelivery that finds it finished)."""
        if inf.sub is not None:
            sub, inf.sub = inf.sub, None
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if inf.charged:
            self.fair.settle(inf.tenant, inf.charged, used_tokens if used_tokens is not None else 0)
            inf.charged = 0
        msg, inf.queue_msg = inf.queue_msg, None
        self._dispatch_wake.set()
        if not self.use_queue:
            if msg is not None:
                with contextlib.suppress(Exception):
                    await msg.ack()
            return

        async def settle() -> None:
            if inf.record is not None:
                await self._settle(inf.record, inf.record_rev, status, used_tokens)
            if msg is not None:
                with contextlib.suppress(Exception):
                    await msg.ack()

        self.b.spawn(settle())

    async def _settle(self, rec: RequestRecord, rev: int, status: str, used_tokens: int | None) -> None:
        """Mark the request's record ended (unless another router took it over meanwhile) and release its
        quota reservation (idempotent: a router that adopted it may do the same)."""
        try:
            ended = rec.model_copy(update={"state": "ended", "status": status, "used_tokens": used_tokens})
            if rev and await self.requests.cas(ended, rev) is None:
                try:
                    got = await self.requests.get(rec.tenant, rec.request_id)
                except CorruptRecord as exc:  # not a router's value: this end replaces it
                    await self.requests.cas(ended, exc.revision)
                    got = None
                if got is not None and got[0].state != "ended" and got[0].owner in (None, self.worker_id):
                    await self.requests.cas(ended, got[1])
            if self.quota.has_dynamic_limits(rec.tenant):
                await self.shared_quota.finish(rec.tenant, rec.request_id, used_tokens)
        except Exception as exc:  # NATS away: the reconciliation sweep releases the reservation later
            self.log.warning("settle_failed", request_id=rec.request_id, error=str(exc))

    async def _reaper(self) -> None:
        seen_reconnects, hold_until = self.b.reconnects, 0.0
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            if self.b.reconnects != seen_reconnects:
                # The connection to NATS was down: every worker's heartbeats were missed alike, and they come
                # back over the next interval. Declaring them dead now would move requests that are fine.
                seen_reconnects, hold_until = self.b.reconnects, now + 2 * self.registry.min_timeout_s
            if now < hold_until:
                continue
            for wid, reason in self.registry.reap(time.monotonic(), observer=self.worker_id):
                self.log.warning("worker_dead", dead_worker=wid, reason=reason)
                self.policy.remove_worker(wid)
                self._worker_lost(wid, reason)
            await self._expire_queued()
            try:
                await self._check_lost_jobs()
            except Exception as exc:  # e.g. SS_USAGE electing a leader: checked again next round
                self.log.warning("lost_job_check_failed", error=str(exc))

    async def _check_lost_jobs(self) -> None:
        """Jobs lost in transit and jobs orphaned after they arrived (the book's ``lost`` check): each is settled
        or sent again by :meth:`_send_again`."""
        workers = self.registry.workers

        def last_heard(wid: str) -> float | None:
            st = workers.get(wid)
            return st.last_seen if st is not None else None

        for lost in self.book.lost(time.monotonic(), last_heard, self.b.last_reconnect):
            if self.book.get(lost.flight.key) is not lost.flight:
                continue  # ended meanwhile (a settle below ran on_finished)
            fields = {"quiet_s": lost.quiet_s} if lost.check is LossCheck.ORPHANED else {}
            await self._send_again(lost.flight, lost.check.value, lost.reason, **fields)

    async def _send_again(self, inf: Flight, event: str, reason: str, **fields: Any) -> None:
        """A job no worker holds (lost in transit, or orphaned): retired from its stored RequestFinished if it
        ended meanwhile (only its end notice was lost), else sent again as one more attempt (``_migrate``)."""
        done = await self.wq.finished_record(inf.tenant, inf.request_id)
        if done is not None:
            await self.on_finished(done, None)  # type: ignore[arg-type]
            return
        self.log.warning(event, request_id=inf.request_id, worker=inf.holder, **fields)
        assert isinstance(inf, Inflight)
        self.b.spawn(self._migrate(inf, inf.attempt, reason, inf.holder, decoder_failed=False))

    async def _fail(self, inf: Inflight, code: ErrorCode, message: str, worker: str | None = None) -> None:
        self.book.remove(inf.key)
        await self._retire(inf, None)
        if inf.trace_ctx is not None and trace.get_current_span().get_span_context() != inf.trace_ctx:
            # router.request ended long ago (e.g. the decoder died mid-stream): record the failure in the
            # same trace so the waterfall shows where and why the request ended.
            parent = trace.set_span_in_context(trace.NonRecordingSpan(inf.trace_ctx))
            with tracing.tracer().start_as_current_span("router.fail", context=parent) as sp:
                tracing.set_attrs(sp, request_id=inf.request_id, tenant=inf.tenant, error_code=str(code),
                                  failed_worker=worker)
                tracing.record_error(sp, message)
                await self._publish_failure(inf.request_id, inf.tenant, inf.stream_subject, code, message, worker)
            return
        await self._publish_failure(inf.request_id, inf.tenant, inf.stream_subject, code, message, worker)

    async def _publish_failure(self, request_id: str, tenant: str, stream_subject: str, code: ErrorCode,
                               message: str, worker: str | None = None) -> None:
        err = StreamError(request_id=request_id, code=code, message=message, worker=worker,
                          retryable=code in (ErrorCode.WORKER_DIED, ErrorCode.NO_WORKERS))
        await self.b.publish(stream_subject, err)
        await self.b.publish(
            Subjects.finished(tenant, request_id),
            RequestFinished(request_id=request_id, tenant=tenant, worker_id=self.worker_id,
                            status="error", error_code=code),
        )

    # --- migration: a request whose worker died continues elsewhere ------------------------------------
    async def _track(self, inf: Inflight, req: GenerateRequest, job: DecodeJob) -> None:
        """Remember the job and follow the request's stream (before the job goes out, so no delta is missed):
        the tokens the caller has received are what a migration resumes from. Deltas cost the router one
        more delivery each; heartbeats carrying tokens would be cheaper but lag, and a resume from an older
        point would send the caller tokens twice. A non-streaming request has no deltas: it restarts."""
        inf.request, inf.job = req, job
        if not req.stream:
            return
        rid, key = req.request_id, req.key

        async def on_msg(raw: Msg) -> None:
            if self.inflight.get(key) is inf:
                self._on_stream(inf, raw.data)

        try:
            inf.sub = await self.b.nc.subscribe(req.stream_subject, cb=on_msg)
        except Exception as exc:  # not fatal: the request just cannot be moved
            inf.tracked = False
            self.log.warning("stream_follow_failed", request_id=rid, error=str(exc))

    def _on_stream(self, inf: Inflight, data: bytes) -> None:
        try:
            msg = proto.decode_stream(data)
        except proto.ProtocolError:
            return
        if isinstance(msg, StreamDelta):
            inf.delta(msg.seq, msg.token_ids, msg.text)
        else:
            inf.started = inf.confirmed = True

    async def on_bounced(self, ev: JobBounced, _: Msg) -> None:
        inf = self.inflight.get(ev.key)
        if inf is None or inf.attempt != ev.attempt:
            return
        self.log.warning("job_bounced", request_id=ev.request_id, worker=ev.worker_id, code=str(ev.code),
                         reason=ev.message)
        if ev.code == ErrorCode.WORKER_DIED and ev.decoder == inf.decoder:
            # The prefiller found the decoder unreachable: do not send the request (or any other) back there on
            # the strength of a heartbeat its process may not outlive (SIGKILLed, restarting): wait for the next.
            self.registry.unreachable(inf.decoder)
            self.book.unreachable(inf.decoder)
        self.b.spawn(self._migrate(inf, inf.attempt, f"{ev.message} (from {ev.worker_id})", ev.worker_id,
                                   decoder_failed=False, code=ev.code))

    def _worker_lost(self, wid: str, reason: str) -> None:
        # A worker id whose process was replaced by a new one: requests routed since the new one appeared are
        # the new process's (a request waiting for a live decoder goes there at once), not the dead one's.
        st = self.registry.workers.get(wid)
        fresh = st.first_seen if st is not None and st.dead_reason is None else float("inf")
        for inf, how in self.book.worker_lost(wid, fresh):
            # a prefiller that died before any output: unless the decoder already has the KV, send it again
            self.b.spawn(self._migrate(inf, inf.attempt, reason, wid, decoder_failed=how is Move.DECODER_FAILED))

    async def _migrate(self, inf: Inflight, attempt: int, reason: str, failed: str, *, decoder_failed: bool,
                       code: ErrorCode = ErrorCode.WORKER_DIED) -> None:
        """Move one attempt of a request to another worker (idempotent per attempt: several signals of the
        same failure move it once)."""
        if self.inflight.get(inf.key) is not inf or inf.attempt != attempt or inf.migrating:
            return
        inf.migrating = True
        try:
            parent = None
            if inf.trace_ctx is not None:
                parent = trace.set_span_in_context(trace.NonRecordingSpan(inf.trace_ctx))
            with tracing.tracer().start_as_current_span("router.migrate", context=parent) as sp, \
                    structlog.contextvars.bound_contextvars(request_id=inf.request_id, tenant=inf.tenant):
                tracing.set_attrs(sp, request_id=inf.request_id, tenant=inf.tenant, failed_worker=failed,
                                  reason=reason, attempt=attempt + 1, resumed_tokens=len(inf.tokens),
                                  start_seq=inf.next_seq, from_decoder=inf.decoder, from_prefiller=inf.prefiller)
                await self._migrate_once(inf, attempt, reason, failed, decoder_failed, sp, code)
        except Exception as exc:  # never leave the caller waiting on a bug here
            self.log.exception("migration_failed", request_id=inf.request_id, error=str(exc))
            if self.inflight.get(inf.key) is inf:
                await self._fail(inf, ErrorCode.INTERNAL, f"{reason}; moving the request failed: {exc}", failed)
        finally:
            inf.migrating = False

    async def _migrate_once(self, inf: Inflight, attempt: int, reason: str, failed: str, decoder_failed: bool,
                            sp: trace.Span, code: ErrorCode = ErrorCode.WORKER_DIED) -> None:
        """``code``: what the request ends with when it cannot be moved again (the failure's own code: a KV
        hand-off that keeps failing is ``kv_transfer_failed``, not a dead worker)."""
        log = self.log.bind(request_id=inf.request_id, tenant=inf.tenant)
        if inf.job is None or inf.request is None or not inf.tracked:
            why = ("adopted after a router restart" if inf.job is None
                   else "a stream message was missed, so the tokens so far are not known exactly")
            tracing.set_attrs(sp, migrated=False, not_movable=why)
            await self._fail(inf, ErrorCode.WORKER_DIED, f"{reason} while serving this request (not moved: {why})",
                             failed)
            return
        # Fence the previous decoder: a dead one does not answer; one only thought dead (or whose prefiller
        # died) drops the attempt, or, when the KV has landed there and it was not the one that failed, keeps it.
        try:
            reply = await self.b.request(Subjects.revoke(inf.decoder), RevokeJob(
                request_id=inf.request_id, tenant=inf.tenant, attempt=attempt, force=decoder_failed,
                reason=reason), RevokeReply, timeout=1.0)
        except (NoRespondersError, NatsTimeout, TimeoutError):
            reply = None
        if isinstance(reply, RevokeReply) and reply.running:
            log.info("migration_not_needed", decoder=inf.decoder, reason=reason)
            tracing.set_attrs(sp, migrated=False, kept_on=inf.decoder)
            self.book.kept_on(inf, inf.decoder)
            return
        if inf.cancelled:
            await self._end_here(inf, "cancelled")
            return
        if len(inf.tokens) >= inf.request.sampling.max_tokens:
            # Its worker stopped between the last token and the final message: the output is complete. (Sent
            # on, a decoder would have to produce at least one token more than max_tokens.)
            tracing.set_attrs(sp, migrated=False, complete=True)
            log.info("ended_without_migration", reason=reason, completion_tokens=len(inf.tokens))
            await self._end_here(inf, "length")
            return
        if attempt >= self.max_migrations:
            tracing.set_attrs(sp, migrated=False, exhausted=True)
            await self._fail(inf, code,
                             f"{reason} while serving this request, after {attempt} migration(s) "
                             f"(--max-migrations {self.max_migrations})", failed)
            return
        decoders = await self._wait_for_decoders()
        if self.inflight.get(inf.key) is not inf:
            return
        if not decoders:
            tracing.set_attrs(sp, migrated=False)
            await self._fail(inf, ErrorCode.WORKER_DIED, f"{reason} while serving this request; no live decoder "
                             f"to move it to within {self.no_worker_wait_s:.1f}s", failed)
            return
        req, old = inf.request, inf.job
        context = [*old.prompt_token_ids, *inf.tokens]
        now = time.monotonic()
        views = [self._view(hb) for hb in self.registry.live("decode", now) + self.registry.live("prefill", now)]
        salt = self._cache_salt(req)
        rreq = RoutingRequest(request_id=req.key, tenant=req.tenant, token_ids=context,
                              session_key=req.session_id, force_route=None if req.route == "auto" else req.route,
                              cache_salt=salt)
        try:
            decision = self.policy.decide(rreq, views, now)
        except NoWorkers as exc:
            await self._fail(inf, ErrorCode.WORKER_DIED, f"{reason} while serving this request; {exc}", failed)
            return
        route = Route(decision.route)
        ddict = {**decision.to_dict(), "request_id": req.request_id}  # the policy knows it by its key
        job = old.model_copy(update=dict(
            attempt=attempt + 1, resume_token_ids=list(inf.tokens), resume_text="".join(inf.text),
            start_seq=inf.next_seq, route=route, decoder_id=decision.decoder, prefill_worker=decision.prefiller,
            routed_ms=now_ms(), decision=ddict, cache_salt=salt))
        inf.job = job
        self.book.moved(inf, decision.decoder, decision.prefiller, time.monotonic())
        tracing.set_attrs(sp, migrated=True, route=str(route.value), decoder=decision.decoder,
                          prefiller=decision.prefiller, decision_json=ddict)
        log.warning("migrated", attempt=attempt + 1, failed_worker=failed, reason=reason, decoder=decision.decoder,
                    prefiller=decision.prefiller, resumed_tokens=len(inf.tokens), start_seq=inf.next_seq)
        await self._send_job(inf, route, decision.decoder, decision.prefiller, job)

    async def _send_job(self, inf: Inflight, route: Route, decoder: str, prefiller: str | None,
                        job: DecodeJob) -> None:
        """Publish the job to its prefiller (disaggregated) or its decoder (direct)."""
        try:
            if route is Route.DISAGGREGATED:
                assert prefiller is not None
                await self.b.publish(Subjects.prefill_job(prefiller), PrefillJob(decode=job))
            else:
                await self.b.publish(Subjects.decode_job(decoder), job)
        except PayloadTooLarge as exc:
            await self._fail(inf, ErrorCode.PAYLOAD_TOO_LARGE, str(exc))

    async def _end_here(self, inf: Inflight, reason: Literal["cancelled", "length"]) -> None:
        """End a request whose worker is gone here, with what the caller already has: it was cancelled while
        it had no worker, or its output was already complete."""
        self.book.remove(inf.key)
        job = inf.job
        assert job is not None
        usage = Usage(prompt_tokens=len(job.prompt_token_ids), completion_tokens=len(inf.tokens))
        status: Literal["cancelled", "ok"] = "cancelled" if reason == "cancelled" else "ok"
        await self._retire(inf, usage.prompt_tokens + usage.completion_tokens, status)
        await self.b.publish(inf.stream_subject, StreamFinal(
            request_id=inf.request_id, seq=inf.next_seq, token_ids=list(inf.tokens), text="".join(inf.text),
            finish_reason=reason, usage=usage, route=job.route, prefill_worker=job.prefill_worker,
            decode_worker="", decision=job.decision))
        await self.b.publish(Subjects.finished(inf.tenant, inf.request_id), RequestFinished(
            request_id=inf.request_id, tenant=inf.tenant, worker_id=self.worker_id, status=status, usage=usage,
            route=job.route, finish_reason=reason))

    # --- drain -----------------------------------------------------------------------------------------
    async def drain(self) -> None:
        # New requests go to the other routers of the queue group (drain() answers what was already
        # delivered here); dispatch stops (self.draining); running requests are followed until they end.
        for sub in self._intake_subs:
            with contextlib.suppress(Exception):
                await sub.drain()
        while self.inflight:
            await asyncio.sleep(0.05)

    # --- requests that end while still queued ----------------------------------------------------------
    async def on_cancel(self, c: CancelRequest, _: Msg) -> None:
        # A dispatched request is stopped by its worker; one still waiting in the queue is ended here, now,
        # and skipped when it reaches dispatch.
        # c.tenant is the tenant the cancel's subject names (the bus refused a body that disagrees): a request
        # of any other tenant is not touched, whatever its id.
        inf = self.inflight.get(c.key)
        if inf is not None:
            inf.cancelled = True  # its worker ends it; a migration in between ends it instead of moving it
            return
        if not self.use_queue:
            if c.key in self._accepted_meta:
                await self._end_queued(c.key, "cancelled", c.reason)
            return
        # Every router hears the cancel and any may hold the request's queue message: the one whose
        # compare-and-set moves the record from queued to ended sends the final; dispatch can no longer win it.
        await self._end_if_queued(c.tenant, c.request_id, "cancelled", c.reason)

    async def _end_if_queued(self, tenant: str, rid: str, reason: str, why: str) -> None:
        try:
            got = await self.requests.get(tenant, rid)
            while got is not None and got[0].state == "queued":
                rec, rev = got
                ended = rec.model_copy(update={"state": "ended", "status": reason,
                                               "used_tokens": rec.prompt_tokens})
                if await self.requests.cas(ended, rev) is not None:
                    self._accepted_meta[rec.key] = (rec.tenant, rec.stream_subject, rec.prompt_tokens)
                    await self._end_queued(rec.key, reason, why)
                    if self.quota.has_dynamic_limits(rec.tenant):
                        await self.shared_quota.finish(rec.tenant, rid, rec.prompt_tokens)
                    return
                got = await self.requests.get(tenant, rid)
        except Exception as exc:
            self.log.warning("end_queued_failed", request_id=rid, reason=reason, error=str(exc))

    async def _expire_queued(self) -> None:
        now = now_ms()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, tenant, rid = heapq.heappop(self._deadlines)
            key = proto.request_key(tenant, rid)
            if key in self._accepted_meta and key not in self.inflight:
                why = "the deadline passed while the request waited in the queue"
                if self.use_queue:
                    self.b.spawn(self._end_if_queued(tenant, rid, "expired", why))
                else:
                    await self._end_queued(key, "expired", why)

    async def _end_queued(self, key: str, reason: str, why: str) -> None:
        tenant, stream_subject, prompt_tokens = self._accepted_meta.pop(key)
        rid = key[len(tenant) + 1:]
        self.dropped[key] = None
        while len(self.dropped) > DROPPED_KEPT:
            self.dropped.popitem(last=False)
        self.log.info("queued_request_ended", request_id=rid, tenant=tenant, reason=reason, why=why)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=0)
        await self.b.publish(stream_subject, StreamFinal(
            request_id=rid, seq=0, token_ids=[], text="", finish_reason=reason,  # type: ignore[arg-type]
            usage=usage, route=Route.DIRECT, prefill_worker=None, decode_worker="",
            decision={"ended_in_queue": True, "reason": why}))
        await self.b.publish(Subjects.finished(tenant, rid), RequestFinished(
            request_id=rid, tenant=tenant, worker_id=self.worker_id, status=reason,  # type: ignore[arg-type]
            usage=usage))

    def _model_name(self) -> str | None:
        return self.tokenizer.name if hasattr(self, "tokenizer") else None

    # --- requests ------------------------------------------------------------------------------------
    async def on_request(self, req: GenerateRequest, msg: Msg) -> None:
        with tracing.span_from(msg.headers, "router.request", request_id=req.request_id, tenant=req.tenant) as sp, \
                structlog.contextvars.bound_contextvars(request_id=req.request_id, tenant=req.tenant):
            tracing.set_attrs(sp, route_requested=req.route, max_tokens=req.sampling.max_tokens,
                              priority=req.priority)
            sp.set_attributes(tracing.gen_ai_of(req, self._model_name()))
            await self._intake(req, msg, sp)

    async def _reject(self, req: GenerateRequest, msg: Msg, code: ErrorCode, message: str,
                      retry_after_s: float | None = None, limit: str | None = None) -> None:
        self.log.info("rejected", request_id=req.request_id, code=str(code), reason=message, limit=limit)
        if self.tenants.known(req.tenant) and (not self.tenants.open or req.tenant in self._open_tenants):
            self._rate(req.tenant, "refused").add(time.monotonic())
        sp = trace.get_current_span()
        sp.set_attribute("error.code", str(code))
        tracing.record_error(sp, message)
        err = StreamError(request_id=req.request_id, code=code, message=message,
                          retryable=retry_after_s is not None,
                          retry_after_ms=None if retry_after_s is None else round(retry_after_s * 1000, 1))
        if reply_allowed(msg.reply):
            await self.b.respond(msg, err)
        else:
            await self.b.publish(req.stream_subject, err)

    def _rate(self, tenant: str, what: str) -> _Rate:
        r = self._rates.get((tenant, what))
        if r is None:
            r = self._rates[(tenant, what)] = _Rate()
        return r

    async def _wait_for_decoders(self) -> list[Heartbeat]:
        """Live decoders, waiting (bounded) for one to appear, so "no workers" is a clear, early answer."""
        deadline = time.monotonic() + self.no_worker_wait_s
        while True:
            now = time.monotonic()
            decoders = self.registry.live("decode", now)
            if decoders or now >= deadline:
                return decoders
            self._worker_change.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._worker_change.wait(), timeout=max(0.05, deadline - now))

    async def _intake(self, req: GenerateRequest, msg: Msg, sp: trace.Span) -> None:
        log = self.log.bind(request_id=req.request_id, tenant=req.tenant)
        if req.key in self.inflight or req.key in self._accepted_meta:
            # Idempotent: a client that reconnected re-sends its request; it is the same request, so accept it
            # again (it keeps streaming on the same subject) instead of running it twice. (Keyed by tenant: the
            # same id of another tenant is another request.)
            log.info("duplicate_request_reattached")
            await self.b.respond(msg, Accepted(request_id=req.request_id, router_id=self.worker_id,
                                               prompt_tokens=0))
            return
        if not self.tenants.known(req.tenant):
            await self._reject(req, msg, ErrorCode.UNKNOWN_TENANT, f"tenant {req.tenant!r} is not in the tenants "
                               "file")
            return
        if not self.use_queue and len(self.inflight) >= self.max_inflight:
            await self._reject(req, msg, ErrorCode.BUSY, f"router {self.worker_id} has {self.max_inflight} "
                               "requests in flight; retry later", retry_after_s=1.0)
            return
        if not self._tenant_slot(req.tenant):
            await self._reject(req, msg, ErrorCode.BUSY, f"the router serves at most {OPEN_MODE_MAX_TENANTS:,} "
                               "distinct tenants without a tenants file", retry_after_s=5.0)
            return
        # Cheap checks first: a prompt whose size alone puts it over a limit is refused before any tokenizer
        # work (three 6 MB prompts once stalled this loop for 16 s), and a large one is tokenized off the loop.
        nbytes = self.tokenizer.text_bytes(req)
        floor, limit = self.tokenizer.min_tokens(req, nbytes), self._prompt_limit(req.tenant)
        if limit is not None and floor > limit[0]:
            await self._reject(req, msg, ErrorCode.PROMPT_TOO_LONG,
                               f"prompt has at least {floor:,} tokens ({nbytes:,} bytes); "
                               f"{limit[1]} accepts at most {limit[0]:,}")
            return
        try:
            ids = await self._tokenize(req, nbytes)
        except _TokenizerBusy as exc:
            await self._reject(req, msg, ErrorCode.BUSY, str(exc), retry_after_s=0.5)
            return
        except Exception as exc:
            await self._reject(req, msg, ErrorCode.BAD_REQUEST, f"could not tokenize the prompt: {exc}")
            return
        if not ids:
            await self._reject(req, msg, ErrorCode.BAD_REQUEST, "the prompt is empty after tokenization")
            return
        decoders = await self._wait_for_decoders()
        if not decoders:
            await self._reject(req, msg, ErrorCode.NO_WORKERS,
                               f"no live decode worker within {self.no_worker_wait_s:.1f}s")
            return
        max_len = min(hb.max_model_len or 1 << 30 for hb in decoders)
        if len(ids) >= max_len:
            await self._reject(req, msg, ErrorCode.PROMPT_TOO_LONG,
                               f"prompt has {len(ids):,} tokens; the model accepts at most {max_len - 1:,} "
                               f"(max_model_len {max_len:,} includes at least one generated token)")
            return
        now = time.monotonic()
        queued = self.wq.pending_by_tenant().get(req.tenant, 0)
        if self.use_queue:
            await self._intake_queued(req, msg, sp, ids, queued)
            return
        refusal = self.quota.check(req.tenant, len(ids), req.sampling.max_tokens, queued, now)
        if refusal is not None:
            sp.set_attribute("quota.limit", refusal.limit or "")
            await self._reject(req, msg, _REFUSAL_CODES[refusal.code], refusal.message,
                               retry_after_s=refusal.retry_after_s, limit=refusal.limit)
            return
        await self._route(req, ids, msg, sp)
        self.quota.admit(req.tenant, req.request_id, len(ids), req.sampling.max_tokens, now)

    def _intake_gate(self, raw: Msg) -> StreamError | None:
        """Before a request is decoded: charge its size to the tenant its subject names, and refuse (busy, with
        when to retry) what the tenant's byte budget cannot pay, so no tenant spends this router's CPU on
        decoding and tokenizing faster than its budget."""
        try:
            tenant, _ = proto.subject_identity(raw.subject)
        except ValueError:
            return None  # decoding refuses it
        lim = self.tenants.limits(tenant)
        rate = lim.request_bytes_per_s if lim is not None else None
        wait = self._intake_budget.take(tenant, len(raw.data), time.monotonic(), rate)
        if wait is None:
            return None
        self.log.info("intake_budget_exceeded", tenant=tenant, size=len(raw.data), retry_after_s=round(wait, 3))
        return StreamError(code=ErrorCode.BUSY, retryable=True, retry_after_ms=round(wait * 1000 + 1, 1),
                           message=f"tenant {tenant!r} is sending more request bytes than this router reads for it "
                                   f"({rate or self._intake_budget.rate:,.0f} bytes/s); retry later")

    def _tenant_slot(self, tenant: str) -> bool:
        """Whether a tenant may have state here: always with a tenants file (its names are the bound); without
        one (open mode, any name) at most OPEN_MODE_MAX_TENANTS distinct names, so a caller inventing names
        cannot grow the router's per-tenant maps or the queue's per-tenant lanes without bound."""
        if not self.tenants.open or tenant in self._open_tenants:
            return True
        if len(self._open_tenants) >= OPEN_MODE_MAX_TENANTS:
            return False
        self._open_tenants.add(tenant)
        return True

    def _prompt_limit(self, tenant: str) -> tuple[int, str] | None:
        """The most prompt tokens a request of ``tenant`` may have, and whose limit that is."""
        best: tuple[int, str] | None = None
        lim = self.tenants.limits(tenant)
        if lim is not None and lim.max_prompt_tokens is not None:
            best = (lim.max_prompt_tokens, f"tenant {tenant!r} (max_prompt_tokens)")
        lens = [hb.max_model_len for hb in self.registry.live("decode", time.monotonic()) if hb.max_model_len]
        if lens and (best is None or min(lens) - 1 < best[0]):
            best = (min(lens) - 1, "the model")
        return best

    async def _tokenize(self, req: GenerateRequest, text_bytes: int) -> list[int]:
        """Token ids of the prompt: a small one here (microseconds), a large one on the tokenizer thread, at most
        TOKENIZE_WAITING of them waiting at once (then ``busy``), so neither the event loop (heartbeats, every
        other tenant's intake and streams) nor memory is held by a few huge prompts."""
        # A conversation's template renders every message (a 100k-message list is slow with tiny contents).
        work = text_bytes + 64 * len(req.messages or ())
        if work <= INLINE_TOKENIZE_BYTES:
            return self.tokenizer.token_ids(req)
        if self._tokenizing >= TOKENIZE_WAITING:
            raise _TokenizerBusy(f"{self._tokenizing} large prompts are being tokenized; retry shortly")
        self._tokenizing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, self.tokenizer.token_ids,
                                                                    req)
        finally:
            self._tokenizing -= 1

    async def _intake_queued(self, req: GenerateRequest, msg: Msg, sp: trace.Span, ids: list[int],
                             queued: int) -> None:
        """Reserve quota (global), register the request id (create-only: once cluster-wide), store it in the
        queue, answer Accepted. A step that fails undoes the ones before it, so a refused request holds
        nothing."""
        rid, tenant = req.request_id, req.tenant
        refusal = self.quota.check_static(tenant, len(ids), req.sampling.max_tokens)
        reserved = False
        if refusal is None and self.quota.has_dynamic_limits(tenant):
            try:
                refusal, reserved = await self.shared_quota.admit(tenant, rid, len(ids), req.sampling.max_tokens,
                                                                  queued)
            except Exception as exc:
                # Usage cannot be read or written (JetStream away, or a partition): refuse rather than admit on
                # a guess; the caller may retry.
                await self._reject(req, msg, ErrorCode.BUSY, f"tenant usage is unreachable, so the request "
                                   f"cannot be admitted: {exc}", retry_after_s=1.0)
                return
        if refusal is not None:
            sp.set_attribute("quota.limit", refusal.limit or "")
            await self._reject(req, msg, _REFUSAL_CODES[refusal.code], refusal.message,
                               retry_after_s=refusal.retry_after_s, limit=refusal.limit)
            return
        rec = RequestRecord(request_id=rid, tenant=tenant, state="queued", stream_subject=req.stream_subject,
                            prompt_tokens=len(ids), max_tokens=req.sampling.max_tokens,
                            deadline_ms=req.deadline_ms, accepted_by=self.worker_id)
        try:
            rev = await self.requests.create(rec)
        except Exception as exc:
            await self._unreserve(tenant, rid, reserved)
            await self._reject(req, msg, ErrorCode.BUSY, f"the request registry did not take the request: {exc}",
                               retry_after_s=1.0)
            return
        if rev is None:
            # The id is known cluster-wide: a re-send, to this or another router, or after a restart.
            await self._unreserve(tenant, rid, reserved)
            await self._reattach(req, msg, ids)
            return
        q = QueuedRequest(request=req, prompt_token_ids=ids, router_id=self.worker_id, record_revision=rev)
        try:
            await self.wq.enqueue(q)
        except Exception as exc:
            # Not stored, so not accepted: the caller may retry (the queue stream full or unreachable).
            await self.requests.delete(rec, rev)
            await self._unreserve(tenant, rid, reserved)
            if isinstance(exc, PayloadTooLarge):
                await self._reject(req, msg, ErrorCode.PAYLOAD_TOO_LARGE, str(exc))
            else:
                await self._reject(req, msg, ErrorCode.BUSY, f"the request queue did not take the request: {exc}",
                                   retry_after_s=1.0)
            return
        self._accepted_meta[req.key] = (tenant, req.stream_subject, len(ids))
        if req.deadline_ms is not None:
            heapq.heappush(self._deadlines, (req.deadline_ms, tenant, rid))
        self._rate(tenant, "accepted").add(time.monotonic())
        tracing.set_attrs(sp, prompt_tokens=len(ids), queued_ahead=queued)
        self.log.info("queued", request_id=rid, tenant=tenant, prompt_tokens=len(ids), queued_ahead=queued)
        await self.b.respond(msg, Accepted(request_id=rid, router_id=self.worker_id, prompt_tokens=len(ids)))
        self._dispatch_wake.set()

    async def _unreserve(self, tenant: str, rid: str, reserved: bool) -> None:
        if reserved:
            with contextlib.suppress(Exception):  # else the reconciliation sweep releases it
                await self.shared_quota.finish(tenant, rid, None)

    async def _reattach(self, req: GenerateRequest, msg: Msg, ids: list[int]) -> None:
        """A re-sent request id: still queued or running, it is accepted again (it keeps streaming on the same
        subject); already ended, running it again would serve it twice, so say so."""
        rid = req.request_id
        try:
            got = await self.requests.get(req.tenant, rid)
        except Exception as exc:
            await self._reject(req, msg, ErrorCode.BUSY, f"the request registry is unreachable: {exc}",
                               retry_after_s=1.0)
            return
        if got is None:  # its first intake failed and let it go a moment ago
            await self._reject(req, msg, ErrorCode.BUSY, f"request {rid} is being admitted elsewhere; retry",
                               retry_after_s=0.5)
            return
        rec, rev = got
        if rec.state == "ended":
            await self._reject(req, msg, ErrorCode.BAD_REQUEST,
                               f"request {rid} already ended ({rec.status}); use a new request id")
            return
        if rec.state == "queued":
            # Its router may have died between registering and queueing it (or its store timed out): store it
            # again. The queue's Nats-Msg-Id dedupe makes this a no-op when it is there; a second copy is harmless
            # anyway (dispatch takes a request only by moving its record from queued to dispatched). Not stored
            # means not accepted: the caller hears so and may retry, rather than wait for a request no queue holds.
            try:
                await self.wq.enqueue(QueuedRequest(request=req, prompt_token_ids=ids, router_id=rec.accepted_by,
                                                    accepted_ms=rec.accepted_ms, record_revision=rev))
            except Exception as exc:
                await self._reject(req, msg, ErrorCode.BUSY, f"the request queue did not take the re-sent request: "
                                   f"{exc}", retry_after_s=1.0)
                return
        self.log.info("duplicate_request_reattached", request_id=rid, tenant=req.tenant, state=rec.state,
                      owner=rec.owner)
        await self.b.respond(msg, Accepted(request_id=rid, router_id=self.worker_id, prompt_tokens=len(ids)))

    # --- dispatch ------------------------------------------------------------------------------------
    def free_slots(self, now: float) -> int:
        """Decode slots this router may fill now: the request book's slot ledger (``RequestBook.free_slots``), over
        the decoders the registry counts live (ready, reachable, heard within their heartbeat timeout)."""
        return self.book.free_slots(now)

    async def _dispatch_loop(self) -> None:
        await self._registry_warmup()
        last_refresh = 0.0
        while True:
            try:
                now = time.monotonic()
                if now - last_refresh > 0.5:
                    await self.wq.refresh()
                    last_refresh = now
                progressed = await self._dispatch_some()
            except Exception as exc:  # a NATS hiccup must not end dispatch
                self.log.exception("dispatch_error", error=str(exc))
                progressed = False
                await asyncio.sleep(0.5)
            if not progressed:
                self._dispatch_wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._dispatch_wake.wait(), timeout=0.5)

    async def _dispatch_some(self) -> bool:
        progressed = False
        while not self.draining and (free := self.free_slots(time.monotonic())) > 0:
            tenant = self.fair.pick(self.wq.pending_by_tenant())
            if tenant is None:
                break
            # A few at a time when many slots are free (one round trip to the server for several requests);
            # few enough that the fair scheduler still decides at a fine grain.
            qmsgs = await self.wq.fetch(tenant, dispatch_batch(free))
            if not qmsgs:
                continue
            progressed = True
            # Each dispatch claims its request with one compare-and-set on the registry: the batch's round
            # trips overlap.
            await asyncio.gather(*(self._dispatch(qmsg) for qmsg in qmsgs))
        return progressed

    async def _dispatch(self, qmsg: Msg) -> None:
        try:
            q = proto.decode(qmsg.data, QueuedRequest)
        except proto.ProtocolError as exc:
            self.log.error("queue_message_undecodable", error=exc.message, subject=qmsg.subject)
            await qmsg.term()
            return
        req = q.request
        rid, key = req.request_id, req.key
        if (refusal := identity_refusal(qmsg.subject, q)) is not None:
            # Only routers may write the queue; a message whose body disagrees with its lane was not written by
            # one (or the lane was mis-named): it must not run as the tenant it claims.
            self.log.error("queue_message_forbidden", subject=qmsg.subject, error=refusal)
            await qmsg.term()
            return
        with tracing.span_from(qmsg.headers, "router.dispatch", request_id=rid, tenant=req.tenant) as sp, \
                structlog.contextvars.bound_contextvars(request_id=rid, tenant=req.tenant):
            delivered = int(qmsg.metadata.num_delivered)
            wait_ms = max(0.0, now_ms() - q.accepted_ms)
            tracing.set_attrs(sp, queue_wait_ms=round(wait_ms, 2), deliveries=delivered)
            sp.set_attributes(tracing.gen_ai_of(req, self._model_name()))
            if key in self.inflight:  # redelivered while we still run it (a missed keep-alive): keep the newest
                self.inflight[key].queue_msg = qmsg
                return
            if key in self.dropped:
                await qmsg.ack()
                return
            if key in self._claiming:  # a second copy of a request this router is dispatching right now
                return
            self._claiming.add(key)
            try:
                await self._dispatch_claimed(q, qmsg, sp)
            finally:
                self._claiming.discard(key)

    async def _dispatch_claimed(self, q: QueuedRequest, qmsg: Msg, sp: trace.Span) -> None:
        req = q.request
        claimed = await self._claim(q, qmsg, sp)
        if claimed is None:
            return
        rec, rev = claimed
        if req.deadline_ms is not None and now_ms() >= req.deadline_ms:
            self._accepted_meta.setdefault(req.key, (req.tenant, req.stream_subject, len(q.prompt_token_ids)))
            await self._end_queued(req.key, "expired", "the deadline passed while the request waited in the queue")
            await self._settle(rec, rev, "expired", len(q.prompt_token_ids))
            await qmsg.ack()
            return
        self._rate(req.tenant, "dispatched").add(time.monotonic())
        inf = await self._route(req, list(q.prompt_token_ids), None, sp, queue_msg=qmsg, record=(rec, rev))
        if inf is None:
            await qmsg.ack()  # answered with a terminal error (and settled)

    def _owner_alive(self, rec: RequestRecord) -> bool:
        if rec.owner is None:
            return False
        for hb in self.registry.live("router", time.monotonic()):
            if hb.worker_id == rec.owner:
                return rec.owner_pid is None or hb.pid == rec.owner_pid
        return False

    async def _claim(self, q: QueuedRequest, qmsg: Msg, sp: trace.Span) -> tuple[RequestRecord, int] | None:
        """Win the right to run this request: move its registry record to ``dispatched`` by this router, with
        compare-and-set. Returns the record and its revision, or None when it is not this router's to run (it
        ended, another live router runs it, or it was handled here: adopted from a worker, failed)."""
        req = q.request
        rid = req.request_id
        mine = RequestRecord(request_id=rid, tenant=req.tenant, state="dispatched", stream_subject=req.stream_subject,
                             prompt_tokens=len(q.prompt_token_ids), max_tokens=req.sampling.max_tokens,
                             accepted_ms=q.accepted_ms, deadline_ms=req.deadline_ms, accepted_by=q.router_id,
                             owner=self.worker_id, owner_pid=os.getpid())
        rev: int | None = q.record_revision
        if rev:  # the usual case, one round trip: the record is still as intake left it
            new_rev = await self.requests.cas(mine, rev)
            if new_rev is not None:
                return mine, new_rev
        for _ in range(8):
            try:
                got = await self.requests.get(req.tenant, rid)
            except CorruptRecord as exc:
                # Nothing a router wrote. The queue still holds the request, so it was accepted and has not been
                # settled: recover it as one whose owner died (ended per the usage stream, running per the
                # workers' heartbeats, else run here), replacing the value by compare-and-set on its revision.
                self.log.error("request_record_corrupt", request_id=rid, error=str(exc))
                return await self._recover(q, qmsg, sp, mine.model_copy(update={"owner": None, "owner_pid": None}),
                                           exc.revision, mine)
            if got is None:
                # No record (it outlived the registry's TTL, or an older router queued it): register it now.
                new_rev = await self.requests.create(mine)
                if new_rev is not None:
                    if self.quota.has_dynamic_limits(req.tenant):
                        await self.shared_quota.admit(req.tenant, rid, len(q.prompt_token_ids),
                                                      req.sampling.max_tokens, 0)
                    return mine, new_rev
                continue
            rec, rev = got
            if rec.state == "queued":
                new_rev = await self.requests.cas(mine, rev)
                if new_rev is not None:
                    return mine, new_rev
                continue
            if rec.state == "ended":
                self.log.info("queued_request_already_ended", request_id=rid, status=rec.status)
                await self._settle(rec, 0, rec.status or "ok", rec.used_tokens)  # its quota, if that was missed
                await qmsg.ack()
                return None
            # Dispatched already. By a live router (this message is a second copy, or its owner missed a
            # keep-alive): leave it to that router, un-acked. By a dead one: recover it here.
            warmup = REGISTRY_WARMUP_S - (time.monotonic() - self._started)
            if warmup > 0:
                await asyncio.sleep(warmup)  # a router that just started first hears every live router
            if self._owner_alive(rec) and not (rec.owner == self.worker_id and rec.owner_pid == os.getpid()):
                self.log.info("request_held_by_live_router", request_id=rid, owner=rec.owner)
                return None
            return await self._recover(q, qmsg, sp, rec, rev, mine)
        self.log.warning("claim_contended", request_id=rid)
        return None

    async def _recover(self, q: QueuedRequest, qmsg: Msg, sp: trace.Span, rec: RequestRecord, rev: int,
                       mine: RequestRecord) -> tuple[RequestRecord, int] | None:
        """A request whose router died after dispatching it: it already ended (settle it), or still runs on a
        worker (adopt it), or failed too often; else dispatch it again (return the record, now ours)."""
        req = q.request
        rid = req.request_id
        done = await self.wq.finished_record(req.tenant, rid)
        if done is not None:
            self.log.info("redelivered_already_finished", request_id=rid, status=done.status)
            used = (done.usage.prompt_tokens + done.usage.completion_tokens) if done.usage is not None else None
            await self._settle(rec, rev, done.status, used)
            await qmsg.ack()
            return None
        new_rev = await self.requests.cas(mine, rev)  # this router owns it from now on
        if new_rev is None:
            self.log.info("recovery_lost_race", request_id=rid)
            return None
        now = time.monotonic()
        for hb in self.registry.live("decode", now) + self.registry.live("prefill", now):
            if req.key in hb.active_requests:
                self.log.info("redelivered_adopted", request_id=rid, holder=hb.worker_id, previous_owner=rec.owner)
                tracing.set_attrs(sp, adopted_from=hb.worker_id)
                is_decoder = hb.role == "decode"
                self.book.add(Inflight(
                    request_id=rid, tenant=req.tenant, stream_subject=req.stream_subject,
                    decoder=hb.worker_id if is_decoder else "", prefiller=None if is_decoder else hb.worker_id,
                    holder=hb.worker_id, queue_msg=qmsg, record=mine, record_rev=new_rev,
                    confirmed=True), now)  # its worker's heartbeat lists it
                return None
        if int(qmsg.metadata.num_delivered) > MAX_DELIVERIES:
            self._accepted_meta.pop(req.key, None)
            await self._publish_failure(rid, req.tenant, req.stream_subject, ErrorCode.INTERNAL,
                                        f"the request was handed to a router {MAX_DELIVERIES} times and none "
                                        "finished dispatching it")
            await self._settle(mine, new_rev, "error", None)
            await qmsg.ack()
            return None
        self.log.info("recovered_dispatching", request_id=rid, deliveries=int(qmsg.metadata.num_delivered),
                      previous_owner=rec.owner)
        return mine, new_rev

    async def _redelivery_sweep(self) -> None:
        """Pick up requests whose router died. Dispatch pulls only where requests wait undelivered, so a lane
        whose only messages are un-acked ones held by no live router needs a pull of its own: when more are
        un-acked than this router holds, one pull returns any whose ack wait has run out."""
        while True:
            await asyncio.sleep(max(0.5, self.queue_ack_wait_s / 3))
            held: dict[str, int] = {}
            for inf in self.inflight.values():
                if inf.queue_msg is not None:
                    held[inf.queue_msg.subject] = held.get(inf.queue_msg.subject, 0) + 1
            for lane in self.wq.lanes():
                if lane.pending > 0 or lane.ack_pending <= held.get(lane.subject, 0):
                    continue
                try:
                    for qmsg in await self.wq.fetch_redelivered(lane):
                        await self._dispatch(qmsg)
                except Exception as exc:
                    self.log.warning("redelivery_sweep_failed", error=str(exc), lane=lane.subject)

    async def _keepalive(self) -> None:
        """Keep the queue messages of running requests from being redelivered while this router lives."""
        while True:
            await asyncio.sleep(max(0.5, self.queue_ack_wait_s / 3))
            for inf in list(self.inflight.values()):
                if inf.queue_msg is not None:
                    with contextlib.suppress(Exception):
                        await inf.queue_msg.in_progress()

    async def _route(self, req: GenerateRequest, ids: list[int], msg: Msg | None, sp: trace.Span,
                     queue_msg: Msg | None = None,
                     record: tuple[RequestRecord, int] | None = None) -> Inflight | None:
        """Decide where the request runs and hand it to the worker(s). With ``msg`` (no queue), answers the
        caller's request; otherwise a failure goes to the request's stream subject."""
        log = self.log.bind(request_id=req.request_id, tenant=req.tenant)
        now = time.monotonic()
        views = [self._view(hb) for hb in self.registry.live("decode", now) + self.registry.live("prefill", now)]
        salt = self._cache_salt(req)
        rreq = RoutingRequest(request_id=req.key, tenant=req.tenant, token_ids=ids,
                              session_key=req.session_id, force_route=None if req.route == "auto" else req.route,
                              cache_salt=salt)
        try:
            decision = self.policy.decide(rreq, views, now)
        except NoWorkers as exc:
            if msg is not None:
                await self._reject(req, msg, ErrorCode.NO_WORKERS, str(exc))
            else:
                self._accepted_meta.pop(req.key, None)
                await self._publish_failure(req.request_id, req.tenant, req.stream_subject, ErrorCode.NO_WORKERS,
                                            str(exc))
                if record is not None:
                    await self._settle(record[0], record[1], "error", None)
            return None
        if msg is not None:
            await self.b.respond(msg, Accepted(request_id=req.request_id, router_id=self.worker_id,
                                               prompt_tokens=len(ids)))
        route = Route(decision.route)
        job = DecodeJob(
            request_id=req.request_id, tenant=req.tenant, prompt_token_ids=ids, sampling=req.sampling,
            stream_subject=req.stream_subject, route=route, decoder_id=decision.decoder,
            prefill_worker=decision.prefiller, created_ms=req.created_ms, routed_ms=now_ms(),
            deadline_ms=req.deadline_ms,
            # the policy knows the request by its key (tenant.id); the caller by its id
            decision={**decision.to_dict(), "request_id": req.request_id, "router": self.worker_id},
            stream=req.stream, cache_salt=salt,
        )
        charge = len(ids) + req.sampling.max_tokens
        inf = Inflight(request_id=req.request_id, tenant=req.tenant, stream_subject=req.stream_subject,
                       decoder=decision.decoder, prefiller=decision.prefiller, queue_msg=queue_msg, charged=charge)
        if record is not None:
            inf.record, inf.record_rev = record
        self.fair.charge(req.tenant, charge)
        self.book.add(inf, now)
        inf.trace_ctx = sp.get_span_context() if sp.get_span_context().is_valid else None
        ddict = job.decision
        if self.use_queue:
            # The other routers count it on these workers until the workers' heartbeats do.
            ent = self.policy.pending_entries(decision)
            with contextlib.suppress(Exception):
                await self.b.publish(Subjects.routed(self.worker_id), DispatchNote(
                    router_id=self.worker_id, request_id=req.request_id, decoder=ent[0][0],
                    decoder_tokens=ent[0][1], blocks=ent[0][2], prefiller=ent[1][0] if len(ent) > 1 else None,
                    prefiller_tokens=ent[1][1] if len(ent) > 1 else 0, tenant=req.tenant,
                    virtual_tokens=charge / self.fair.weight(req.tenant)))
        # The routing decision, flattened (scalars) and whole (JSON), so a waterfall can show why.
        tracing.set_attrs(sp, prompt_tokens=len(ids), route=str(route.value), decoder=decision.decoder,
                          prefiller=decision.prefiller, decision_json=ddict)
        tracing.set_attrs(sp, "decision.", **{k: v for k, v in ddict.items() if k != "request_id"})
        log.info("routed", decision=ddict, prompt_tokens=len(ids))
        await self._track(inf, req, job)
        await self._send_job(inf, route, decision.decoder, decision.prefiller, job)
        return inf

    # --- sharing with the other routers ----------------------------------------------------------------
    async def on_dispatch_note(self, note: DispatchNote, _: Msg) -> None:
        if note.router_id == self.worker_id:
            return
        entries = [(note.decoder, note.decoder_tokens, note.blocks)]
        if note.prefiller is not None:
            entries.append((note.prefiller, note.prefiller_tokens, 0))
        now = time.monotonic()
        self.policy.on_remote_routed(note.key, entries, now)
        self.book.remote_dispatched(note.key, note.decoder, now)
        if note.tenant and note.virtual_tokens:
            recent = self._remote_recent.setdefault(note.router_id, {})
            recent[note.tenant] = recent.get(note.tenant, 0.0) + note.virtual_tokens
            self._apply_remote_fair()

    async def on_fair_report(self, rep: FairShareReport, _: Msg) -> None:
        if rep.incarnation == self.incarnation:
            return
        # Keyed by process: a restarted router reports from zero, and the tokens its previous process charged
        # still count.
        self._remote_fair[(rep.router_id, rep.incarnation)] = rep.virtual_tokens
        # The report includes every dispatch note it sent before it (one connection: NATS keeps their order).
        self._remote_recent.pop(rep.router_id, None)
        self._apply_remote_fair()

    def _apply_remote_fair(self) -> None:
        total: dict[str, float] = {}
        for counters in [*self._remote_fair.values(), *self._remote_recent.values()]:
            for t, v in counters.items():
                total[t] = total.get(t, 0.0) + v
        self.fair.set_remote(total)

    async def _fair_reports(self) -> None:
        last: dict[str, float] | None = None
        while True:
            await asyncio.sleep(FAIR_REPORT_S)
            virtual = self.fair.virtual()
            if virtual == last:
                continue
            with contextlib.suppress(Exception):
                await self.b.publish(Subjects.fair(self.worker_id), FairShareReport(
                    router_id=self.worker_id, incarnation=self.incarnation, virtual_tokens=virtual))
                last = virtual

    async def _reconcile_quota(self) -> None:
        """Release reservations nobody will finish: a router that died between reserving quota and registering
        the request, or between ending a request and releasing its quota, left them behind."""
        while True:
            await asyncio.sleep(RECONCILE_S)
            for tenant in self.shared_quota.tenants():
                for rid in self.quota.stale(tenant, RECONCILE_AFTER_S, time.time())[:256]:
                    try:
                        got = await self.requests.get(tenant, rid)
                        if got is None or got[0].state == "ended":
                            self.log.info("quota_reservation_reconciled", request_id=rid, tenant=tenant,
                                          record="missing" if got is None else "ended")
                            await self.shared_quota.finish(tenant, rid, got[0].used_tokens if got else None)
                    except Exception as exc:
                        self.log.warning("quota_reconcile_failed", tenant=tenant, error=str(exc))
                        break

    # --- operators -----------------------------------------------------------------------------------
    async def on_queue_report(self, _: QueueReportRequest, msg: Msg) -> None:
        now = time.monotonic()
        await self.wq.refresh()
        pending = self.wq.pending_by_tenant()
        running: dict[str, int] = {}
        for inf in self.inflight.values():
            running[inf.tenant] = running.get(inf.tenant, 0) + 1
        served = self.fair.served()
        names = sorted(set(pending) | set(running) | set(served) | set(self.tenants.tenants)
                       | {t for t, _ in self._rates})
        rows = []
        for t in names:
            rows.append(TenantQueue(
                tenant=t, weight=self.tenants.weight(t), queued=pending.get(t, 0),
                queued_by_class=self.wq.pending_by_class(t), running=running.get(t, 0),
                inflight=self.quota.inflight(t),
                oldest_wait_ms=await self.wq.oldest_wait_ms(t) if pending.get(t) else None,
                accepted_per_s=self._rate(t, "accepted").per_s(now),
                dispatched_per_s=self._rate(t, "dispatched").per_s(now),
                refused_per_s=self._rate(t, "refused").per_s(now),
                served_tokens=served.get(t, 0), tokens_last_minute=self.quota.tokens_in_window(t, now)))
        await self.b.respond(msg, QueueReport(router_id=self.worker_id, capacity=self.free_slots(now),
                                              running=len(self.inflight), tenants=rows))

    async def on_route_explain(self, req: proto.RouteExplainRequest, msg: Msg) -> None:
        """What each strategy would decide for this prompt now: a dry run that dispatches nothing and leaves
        every routing state as it was (``splitserve.services.router.explain``)."""
        from splitserve.services.router import explain

        try:
            ids = explain.prompt_ids(self.tokenizer.token_ids, req)
        except Exception as exc:
            await self.b.reply_error(msg, ErrorCode.BAD_REQUEST, f"could not tokenize the prompt: {exc}")
            return
        now = time.monotonic()
        live = self.registry.live("decode", now) + self.registry.live("prefill", now)
        await self.b.respond(msg, explain.answer(self.worker_id, self.policy, req, ids, live, self._view, now,
                                                 cache_salt=self.tenants.cache_salt(req.tenant, req.cache_salt)))

    def _cache_salt(self, req: GenerateRequest) -> str:
        """The salt keying this request's prefix-cache blocks (index lookups here, the workers' stores and KV
        events): from the tenant the router trusts (``req.tenant``, the one its subject is authorised for) and
        the request's own optional salt, never from the request alone (``TenantsConfig.cache_salt``)."""
        return self.tenants.cache_salt(req.tenant, req.cache_salt)

    @staticmethod
    def _view(hb: Heartbeat) -> WorkerView:
        ld = hb.load
        return view_from_load(hb.worker_id, hb.role, hb.pool, active_seqs=ld.active_seqs,
                              queued_prefill_tokens=ld.queued_prefill_tokens, free_blocks=ld.free_blocks,
                              total_blocks=ld.total_blocks, used_blocks=ld.used_blocks,
                              prefill_tokens_per_s=ld.prefill_tokens_per_s, step_ms=ld.step_ms)
