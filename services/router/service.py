"""Router service: the front of the pipeline.

Intake (``ss.req.{tenant}``, request/reply): tokenize, check the model's and the tenant's limits (unknown
tenant, max prompt / max_tokens, in-flight, queued, tokens per minute: a precise refusal with a retry-after),
store the request durably in its tenant's queue (``services.router.workqueue``) and answer Accepted.

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

``--no-queue`` dispatches at intake instead (no durability, no fair share), for comparison.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import DiscardPolicy, StreamConfig
from opentelemetry import trace
from opentelemetry.trace import SpanContext

import proto
from proto import (
    Accepted,
    CancelRequest,
    DecodeJob,
    ErrorCode,
    GenerateRequest,
    Heartbeat,
    JobBounced,
    KvEventBatch,
    PrefillJob,
    QueuedRequest,
    QueueReport,
    QueueReportRequest,
    RequestFinished,
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
from services.common.resync import resync_index
from services.router.workqueue import WorkQueue
from splitserve.cache import events as cache_events
from splitserve.cache.index import PrefixIndex
from splitserve.obs import tracing
from splitserve.routing import ContextPools, DisaggPolicy, NoWorkers, Router, RoutingRequest, WorkerView
from splitserve.runtime.bus import PayloadTooLarge
from splitserve.runtime.registry import WorkerRegistry
from splitserve.runtime.service import Service
from splitserve.tenancy import TenantsConfig, load_tenants
from splitserve.tenancy.fairshare import FairScheduler
from splitserve.tenancy.quota import QuotaBook

_REFUSAL_CODES = {"unknown_tenant": ErrorCode.UNKNOWN_TENANT, "quota_exceeded": ErrorCode.QUOTA_EXCEEDED,
                  "prompt_too_long": ErrorCode.PROMPT_TOO_LONG, "bad_request": ErrorCode.BAD_REQUEST}
MAX_DELIVERIES = 5  # a request that took down this many routers is failed instead of tried again
DEFAULT_DECODER_SLOTS = 16
DISPATCH_BATCH = 8  # most queue messages pulled from one tenant per scheduling decision
REGISTRY_WARMUP_S = 1.5  # three heartbeat intervals
UNCONFIRMED_S = 5.0  # a dispatched job that no worker reports within this long is sent again


class _Rate:
    """Events per second over the last ``window_s``."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._t: deque[float] = deque()

    def add(self, now: float) -> None:
        self._t.append(now)

    def per_s(self, now: float) -> float:
        while self._t and self._t[0] < now - self.window_s:
            self._t.popleft()
        return len(self._t) / self.window_s


@dataclass
class Inflight:
    request_id: str
    tenant: str
    stream_subject: str
    decoder: str
    prefiller: str | None
    holder: str  # the worker currently responsible for the request
    routed_at: float = field(default_factory=time.monotonic)
    trace_ctx: SpanContext | None = None  # router.request's span: a later failure is recorded under it
    queue_msg: Msg | None = None  # its durable queue message, acked when the request ends
    charged: int = 0  # tokens the fair scheduler charged at dispatch (settled at finish)
    # Migration state. ``job`` is the last job sent (None: adopted after a router restart, not movable);
    # tokens/text/next_seq: what the caller has received, from the stream this router follows.
    request: GenerateRequest | None = None
    job: DecodeJob | None = None
    attempt: int = 0
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    next_seq: int = 0
    tracked: bool = True  # False once a delta was missed: the tokens so far are not known exactly
    started: bool = False  # the current attempt's decoder has produced output
    migrating: bool = False
    confirmed: bool = False  # a worker of the current attempt reported it (heartbeat or stream): the job arrived
    cancelled: bool = False  # a cancel arrived (it may have reached no worker while the request moved)
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
        # Direct prefill on a decoder pauses its other streams: above this pause, use a prefiller instead.
        self.disagg = DisaggPolicy(min_uncached_tokens=disagg_threshold, max_stall_ms=max_stall_ms,
                                   decoder_prefill_tokens_per_s=decoder_prefill_tps)
        self.context = ContextPools(long_prompt_tokens=long_prompt_tokens)
        self.no_worker_wait_s = no_worker_wait_s
        self.max_inflight = max_inflight
        self.registry = WorkerRegistry()
        self.inflight: dict[str, Inflight] = {}
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
        self._accepted_meta: dict[str, tuple[str, str, int]] = {}  # rid -> (tenant, stream subject, prompt len)
        self._rates: dict[tuple[str, str], _Rate] = {}
        self._started = time.monotonic()  # reset at start(): setup may take long

    async def setup(self) -> None:
        from services.router.tokenize import PromptTokenizer

        # Async jobs' results are kept (per tenant subject, with a TTL) in JetStream for later fetching.
        js = self.b.nc.jetstream()
        cfg = StreamConfig(name=Subjects.RESULTS_STREAM, subjects=[Subjects.RESULTS_ALL],
                           max_age=self.results_ttl_s, max_bytes=1 << 30, discard=DiscardPolicy.OLD,
                           allow_direct=True)
        try:
            await js.add_stream(cfg)
        except Exception:
            await js.update_stream(cfg)

        self.wq = WorkQueue(self.b, ack_wait_s=self.queue_ack_wait_s)
        await self.wq.setup()  # also the usage stream, which --no-queue keeps too
        self.tokenizer = await asyncio.to_thread(PromptTokenizer, self.model)
        # The router always keeps an in-process replica of the cache index, fed by the workers' own KV
        # events: kvaware routes on it, and every strategy's disaggregation rule counts *uncached* tokens.
        self.index = PrefixIndex()
        self.policy = Router(strategy=self.strategy_name, disagg=self.disagg, index=self.index,
                             context=self.context)

    async def start(self) -> None:
        self._started = time.monotonic()
        b = self.b
        await b.subscribe(Subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        await b.subscribe(Subjects.FINISHED_ALL, RequestFinished, self.on_finished)
        await b.subscribe(Subjects.KV_EVENTS_ALL, KvEventBatch, self.on_kv_events)
        await b.subscribe(Subjects.CANCEL_ALL, CancelRequest, self.on_cancel)
        await b.subscribe(Subjects.BOUNCED_ALL, JobBounced, self.on_bounced)
        self._intake_subs.append(await b.subscribe(Subjects.ADMIN_QUEUES, QueueReportRequest, self.on_queue_report,
                                                   queue=Subjects.ROUTER_QUEUE, concurrent=True))
        self._intake_subs.append(await b.subscribe(
            Subjects.REQUEST_ALL, GenerateRequest, self.on_request, queue=Subjects.ROUTER_QUEUE, concurrent=True
        ))
        b.spawn(self._reaper())
        if self.use_queue:
            b.spawn(self._dispatch_loop())
            b.spawn(self._keepalive())
            b.spawn(self._redelivery_sweep())

    def load(self) -> WorkerLoad:
        return WorkerLoad(active_seqs=len(self.inflight))

    def active_requests(self) -> list[str]:
        return list(self.inflight)

    def heartbeat_extra(self) -> dict[str, object]:
        return {"model": self.tokenizer.name if hasattr(self, "tokenizer") else None}

    # --- heartbeats and failure detection ------------------------------------------------------------
    async def on_heartbeat(self, hb: Heartbeat, _: Msg) -> None:
        self.registry.observe(hb, time.monotonic())
        if hb.role in ("decode", "prefill"):
            for rid in hb.active_requests:
                inf = self.inflight.get(rid)
                if inf is None:
                    continue
                if hb.worker_id in (inf.decoder, inf.prefiller):
                    inf.confirmed = True
                if hb.role == "decode" and inf.decoder == hb.worker_id:
                    inf.holder = hb.worker_id  # a request handed from prefiller to decoder is the decoder's now
                self.policy.release(rid, hb.worker_id)  # this worker's own load report now counts it
        self._worker_change.set()

    async def on_kv_events(self, batch: KvEventBatch, _: Msg) -> None:
        gap = self.policy.apply_events(cache_events.KvEventBatch.from_dict(batch.model_dump()))
        if gap:
            self.b.spawn(resync_index(self.b, self.index, batch.worker_id, self.log))

    async def on_finished(self, ev: RequestFinished, _: Msg) -> None:
        inf = self.inflight.pop(ev.request_id, None)
        used = (ev.usage.prompt_tokens + ev.usage.completion_tokens) if ev.usage is not None else None
        if inf is not None:
            await self._retire(inf, used)
        self.policy.release(ev.request_id)
        self._accepted_meta.pop(ev.request_id, None)
        self.quota.finish(ev.tenant, ev.request_id, used, time.monotonic())

    async def _retire(self, inf: Inflight, used_tokens: int | None) -> None:
        """The request ended (any outcome): ack its queue message and settle its fair-share charge."""
        if inf.sub is not None:
            sub, inf.sub = inf.sub, None
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if inf.charged:
            self.fair.settle(inf.tenant, inf.charged, used_tokens if used_tokens is not None else 0)
            inf.charged = 0
        if inf.queue_msg is not None:
            msg, inf.queue_msg = inf.queue_msg, None
            with contextlib.suppress(Exception):
                await msg.ack()
        self._dispatch_wake.set()

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
            self._check_unconfirmed(time.monotonic())
            await self._expire_queued()

    async def _fail(self, inf: Inflight, code: ErrorCode, message: str, worker: str | None = None) -> None:
        self.inflight.pop(inf.request_id, None)
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
        rid = req.request_id

        async def on_msg(raw: Msg) -> None:
            if self.inflight.get(rid) is inf:
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
        inf.started = inf.confirmed = True
        if not isinstance(msg, StreamDelta):
            return
        if msg.seq == inf.next_seq:
            inf.tokens.extend(msg.token_ids)
            inf.text.append(msg.text)
            inf.next_seq += 1
        elif msg.seq > inf.next_seq:
            inf.tracked = False  # a delta went missing here: resuming would skip or repeat tokens

    async def on_bounced(self, ev: JobBounced, _: Msg) -> None:
        inf = self.inflight.get(ev.request_id)
        if inf is None or inf.tenant != ev.tenant or inf.attempt != ev.attempt:
            return
        self.log.warning("job_bounced", request_id=ev.request_id, worker=ev.worker_id, code=str(ev.code),
                         reason=ev.message)
        self.b.spawn(self._migrate(inf, inf.attempt, f"{ev.message} (from {ev.worker_id})", ev.worker_id,
                                   decoder_failed=False))

    def _check_unconfirmed(self, now: float) -> None:
        """A job no worker reported within a few heartbeats never arrived (published while the connection to
        NATS was down, or to a worker that stopped just then): send it again rather than wait forever."""
        for inf in list(self.inflight.values()):
            if inf.confirmed or inf.migrating or inf.job is None or now - inf.routed_at < UNCONFIRMED_S:
                continue
            inf.routed_at = now  # once per window
            reason = (f"no worker reported job attempt {inf.attempt} within {UNCONFIRMED_S:.0f}s (sent to "
                      f"{inf.prefiller or inf.decoder}; lost in transit?)")
            self.b.spawn(self._migrate(inf, inf.attempt, reason, inf.holder, decoder_failed=False))

    def _worker_lost(self, wid: str, reason: str) -> None:
        for inf in list(self.inflight.values()):
            if inf.decoder == wid or (inf.holder == wid and inf.prefiller != wid):
                self.b.spawn(self._migrate(inf, inf.attempt, reason, wid, decoder_failed=True))
            elif inf.prefiller == wid and not inf.started:
                # Its KV may never come: unless the decoder already has it, send the request again.
                self.b.spawn(self._migrate(inf, inf.attempt, reason, wid, decoder_failed=False))

    async def _migrate(self, inf: Inflight, attempt: int, reason: str, failed: str, *, decoder_failed: bool) -> None:
        """Move one attempt of a request to another worker (idempotent per attempt: several signals of the
        same failure move it once)."""
        if self.inflight.get(inf.request_id) is not inf or inf.attempt != attempt or inf.migrating:
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
                await self._migrate_once(inf, attempt, reason, failed, decoder_failed, sp)
        except Exception as exc:  # never leave the caller waiting on a bug here
            self.log.exception("migration_failed", request_id=inf.request_id, error=str(exc))
            if self.inflight.get(inf.request_id) is inf:
                await self._fail(inf, ErrorCode.INTERNAL, f"{reason}; moving the request failed: {exc}", failed)
        finally:
            inf.migrating = False

    async def _migrate_once(self, inf: Inflight, attempt: int, reason: str, failed: str, decoder_failed: bool,
                            sp: trace.Span) -> None:
        log = self.log.bind(request_id=inf.request_id, tenant=inf.tenant)
        if inf.job is None or inf.request is None or not inf.tracked:
            why = ("adopted after a router restart" if inf.job is None
                   else "a stream message was missed, so the tokens so far are not known exactly")
            tracing.set_attrs(sp, migrated=False, not_movable=why)
            await self._fail(inf, ErrorCode.WORKER_DIED, f"{reason} while serving this request (not moved: {why})",
                             failed)
            return
        if attempt >= self.max_migrations:
            tracing.set_attrs(sp, migrated=False, exhausted=True)
            await self._fail(inf, ErrorCode.WORKER_DIED,
                             f"{reason} while serving this request, after {attempt} migration(s) "
                             f"(--max-migrations {self.max_migrations})", failed)
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
            inf.holder = inf.decoder
            return
        if inf.cancelled:
            await self._end_moved_cancelled(inf)
            return
        decoders = await self._wait_for_decoders()
        if self.inflight.get(inf.request_id) is not inf:
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
        rreq = RoutingRequest(request_id=req.request_id, tenant=req.tenant, token_ids=context,
                              session_key=req.session_id, force_route=None if req.route == "auto" else req.route)
        try:
            decision = self.policy.decide(rreq, views, now)
        except NoWorkers as exc:
            await self._fail(inf, ErrorCode.WORKER_DIED, f"{reason} while serving this request; {exc}", failed)
            return
        route = Route(decision.route)
        ddict = decision.to_dict()
        job = old.model_copy(update=dict(
            attempt=attempt + 1, resume_token_ids=list(inf.tokens), resume_text="".join(inf.text),
            start_seq=inf.next_seq, route=route, decoder_id=decision.decoder, prefill_worker=decision.prefiller,
            routed_ms=now_ms(), decision=ddict))
        inf.job, inf.attempt, inf.started, inf.confirmed = job, attempt + 1, False, False
        inf.routed_at = time.monotonic()
        inf.decoder, inf.prefiller = decision.decoder, decision.prefiller
        inf.holder = decision.prefiller or decision.decoder
        tracing.set_attrs(sp, migrated=True, route=str(route.value), decoder=decision.decoder,
                          prefiller=decision.prefiller, decision_json=ddict)
        log.warning("migrated", attempt=attempt + 1, failed_worker=failed, reason=reason, decoder=decision.decoder,
                    prefiller=decision.prefiller, resumed_tokens=len(inf.tokens), start_seq=inf.next_seq)
        try:
            if route is Route.DISAGGREGATED:
                assert decision.prefiller is not None
                await self.b.publish(Subjects.prefill_job(decision.prefiller), PrefillJob(decode=job))
            else:
                await self.b.publish(Subjects.decode_job(decision.decoder), job)
        except PayloadTooLarge as exc:
            await self._fail(inf, ErrorCode.PAYLOAD_TOO_LARGE, str(exc))

    async def _end_moved_cancelled(self, inf: Inflight) -> None:
        """Cancelled while it had no worker: end it here with what the caller already has."""
        self.inflight.pop(inf.request_id, None)
        await self._retire(inf, None)
        job = inf.job
        assert job is not None
        usage = Usage(prompt_tokens=len(job.prompt_token_ids), completion_tokens=len(inf.tokens))
        await self.b.publish(inf.stream_subject, StreamFinal(
            request_id=inf.request_id, seq=inf.next_seq, token_ids=list(inf.tokens), text="".join(inf.text),
            finish_reason="cancelled", usage=usage, route=job.route, prefill_worker=job.prefill_worker,
            decode_worker="", decision=job.decision))
        await self.b.publish(Subjects.finished(inf.tenant, inf.request_id), RequestFinished(
            request_id=inf.request_id, tenant=inf.tenant, worker_id=self.worker_id, status="cancelled",
            usage=usage, route=job.route))

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
        inf = self.inflight.get(c.request_id)
        if inf is not None:
            if inf.tenant == c.tenant:
                inf.cancelled = True  # its worker ends it; a migration in between ends it instead of moving it
            return
        if c.request_id not in self._accepted_meta:
            return
        await self._end_queued(c.request_id, "cancelled", c.reason)

    async def _expire_queued(self) -> None:
        now = now_ms()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _tenant, rid = heapq.heappop(self._deadlines)
            if rid in self._accepted_meta and rid not in self.inflight:
                await self._end_queued(rid, "expired", "the deadline passed while the request waited in the queue")

    async def _end_queued(self, rid: str, reason: str, why: str) -> None:
        tenant, stream_subject, prompt_tokens = self._accepted_meta.pop(rid)
        self.dropped[rid] = None
        while len(self.dropped) > 100_000:
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

    # --- requests ------------------------------------------------------------------------------------
    async def on_request(self, req: GenerateRequest, msg: Msg) -> None:
        with tracing.span_from(msg.headers, "router.request", request_id=req.request_id, tenant=req.tenant) as sp, \
                structlog.contextvars.bound_contextvars(request_id=req.request_id, tenant=req.tenant):
            tracing.set_attrs(sp, route_requested=req.route, max_tokens=req.sampling.max_tokens,
                              priority=req.priority)
            await self._intake(req, msg, sp)

    async def _reject(self, req: GenerateRequest, msg: Msg, code: ErrorCode, message: str,
                      retry_after_s: float | None = None, limit: str | None = None) -> None:
        self.log.info("rejected", request_id=req.request_id, code=str(code), reason=message, limit=limit)
        self._rate(req.tenant, "refused").add(time.monotonic())
        sp = trace.get_current_span()
        sp.set_attribute("error.code", str(code))
        tracing.record_error(sp, message)
        err = StreamError(request_id=req.request_id, code=code, message=message,
                          retryable=retry_after_s is not None,
                          retry_after_ms=None if retry_after_s is None else round(retry_after_s * 1000, 1))
        if msg.reply:
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
        dup = self.inflight.get(req.request_id)
        if dup is None and req.request_id in self._accepted_meta:
            dup_tenant: str | None = self._accepted_meta[req.request_id][0]
        else:
            dup_tenant = dup.tenant if dup is not None else None
        if dup_tenant is not None:
            # Idempotent: a client that reconnected re-sends its request; it is the same request, so accept it
            # again (it keeps streaming on the same subject) instead of running it twice.
            if dup_tenant == req.tenant:
                log.info("duplicate_request_reattached")
                await self.b.respond(msg, Accepted(request_id=req.request_id, router_id=self.worker_id,
                                                   prompt_tokens=0))
            else:
                await self._reject(req, msg, ErrorCode.BAD_REQUEST,
                                   f"request id {req.request_id} is in use by another tenant")
            return
        if not self.tenants.known(req.tenant):
            await self._reject(req, msg, ErrorCode.UNKNOWN_TENANT, f"tenant {req.tenant!r} is not in the tenants "
                               "file")
            return
        if not self.use_queue and len(self.inflight) >= self.max_inflight:
            await self._reject(req, msg, ErrorCode.BUSY, f"router {self.worker_id} has {self.max_inflight} "
                               "requests in flight; retry later", retry_after_s=1.0)
            return
        try:
            ids = self.tokenizer.token_ids(req)
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
        refusal = self.quota.check(req.tenant, len(ids), req.sampling.max_tokens, queued, now)
        if refusal is not None:
            sp.set_attribute("quota.limit", refusal.limit or "")
            await self._reject(req, msg, _REFUSAL_CODES[refusal.code], refusal.message,
                               retry_after_s=refusal.retry_after_s, limit=refusal.limit)
            return
        if not self.use_queue:
            await self._route(req, ids, msg, sp)
            self.quota.admit(req.tenant, req.request_id, len(ids), req.sampling.max_tokens, now)
            return
        q = QueuedRequest(request=req, prompt_token_ids=ids, router_id=self.worker_id)
        try:
            fresh = await self.wq.enqueue(q)
        except PayloadTooLarge as exc:
            await self._reject(req, msg, ErrorCode.PAYLOAD_TOO_LARGE, str(exc))
            return
        except Exception as exc:
            # Not stored, so not accepted: the caller may retry (the queue stream full or unreachable).
            await self._reject(req, msg, ErrorCode.BUSY, f"the request queue did not take the request: {exc}",
                               retry_after_s=1.0)
            return
        if not fresh:
            # The queue already holds (or held) this request id: a re-send, to another router or after a
            # restart. Still queued or running: accepted again, it streams on the same subject. Already ended:
            # running it again would serve it twice, so say so.
            done = await self.wq.finished_record(req.tenant, req.request_id)
            if done is not None:
                await self._reject(req, msg, ErrorCode.BAD_REQUEST,
                                   f"request {req.request_id} already ended ({done.status}); use a new request id")
                return
            log.info("duplicate_request_reattached")
            await self.b.respond(msg, Accepted(request_id=req.request_id, router_id=self.worker_id,
                                               prompt_tokens=len(ids)))
            return
        self.quota.admit(req.tenant, req.request_id, len(ids), req.sampling.max_tokens, now)
        self._accepted_meta[req.request_id] = (req.tenant, req.stream_subject, len(ids))
        if req.deadline_ms is not None:
            heapq.heappush(self._deadlines, (req.deadline_ms, req.tenant, req.request_id))
        self._rate(req.tenant, "accepted").add(now)
        tracing.set_attrs(sp, prompt_tokens=len(ids), queued_ahead=queued)
        log.info("queued", prompt_tokens=len(ids), queued_ahead=queued)
        await self.b.respond(msg, Accepted(request_id=req.request_id, router_id=self.worker_id,
                                           prompt_tokens=len(ids)))
        self._dispatch_wake.set()

    # --- dispatch ------------------------------------------------------------------------------------
    def free_slots(self, now: float) -> int:
        """Decode slots this router may fill now: each live decoder's batch size (plus a little, so a worker
        never idles between one request finishing and the next arriving) less what it runs or was sent."""
        mine: dict[str, int] = {}
        for inf in self.inflight.values():
            mine[inf.decoder] = mine.get(inf.decoder, 0) + 1
        free = 0
        for hb in self.registry.live("decode", now):
            cap = hb.load.max_seqs or DEFAULT_DECODER_SLOTS
            used = max(mine.get(hb.worker_id, 0), hb.load.active_seqs + hb.load.queued_requests)
            slots = max(0, cap + max(1, cap // 4) - used)
            # A long-context decoder only takes long prompts: counting all its slots would pull short
            # requests off the fair queue for the general decoders to hold. One slot lets a long one through.
            free += min(slots, 1) if hb.pool == "long" else slots
        return free

    async def _dispatch_loop(self) -> None:
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
            qmsgs = await self.wq.fetch(tenant, max(1, min(free // 2, DISPATCH_BATCH)))
            if not qmsgs:
                continue
            progressed = True
            for qmsg in qmsgs:
                await self._dispatch(qmsg)
        return progressed

    async def _dispatch(self, qmsg: Msg) -> None:
        try:
            q = proto.decode(qmsg.data, QueuedRequest)
        except proto.ProtocolError as exc:
            self.log.error("queue_message_undecodable", error=exc.message, subject=qmsg.subject)
            await qmsg.term()
            return
        req = q.request
        rid = req.request_id
        with tracing.span_from(qmsg.headers, "router.dispatch", request_id=rid, tenant=req.tenant) as sp, \
                structlog.contextvars.bound_contextvars(request_id=rid, tenant=req.tenant):
            delivered = int(qmsg.metadata.num_delivered)
            wait_ms = max(0.0, now_ms() - q.accepted_ms)
            tracing.set_attrs(sp, queue_wait_ms=round(wait_ms, 2), deliveries=delivered)
            if rid in self.inflight:  # redelivered while we still run it (a missed keep-alive): keep the newest
                self.inflight[rid].queue_msg = qmsg
                return
            if rid in self.dropped:
                await qmsg.ack()
                return
            # Delivered before (its router died), or accepted by another router (or this one before a restart,
            # which may have ended it while queued): check whether it already ended or still runs.
            if (delivered > 1 or rid not in self._accepted_meta) and await self._recover(q, qmsg, sp):
                return
            if req.deadline_ms is not None and now_ms() >= req.deadline_ms:
                self._accepted_meta.setdefault(rid, (req.tenant, req.stream_subject, len(q.prompt_token_ids)))
                await self._end_queued(rid, "expired", "the deadline passed while the request waited in the queue")
                await qmsg.ack()
                return
            self._rate(req.tenant, "dispatched").add(time.monotonic())
            inf = await self._route(req, list(q.prompt_token_ids), None, sp, queue_msg=qmsg)
            if inf is None:
                await qmsg.ack()  # answered with a terminal error

    async def _recover(self, q: QueuedRequest, qmsg: Msg, sp: trace.Span) -> bool:
        """A request this router did not accept, or a redelivered one (its previous router stopped keeping
        it): True if handled here (it already ended, or still runs on a worker and is adopted, or failed too
        often), False to dispatch it."""
        req = q.request
        rid = req.request_id
        # A redelivered request is checked against the workers' heartbeats before it is run again: a router
        # that just started first hears every live worker a few times.
        warmup = REGISTRY_WARMUP_S - (time.monotonic() - self._started)
        if warmup > 0:
            await asyncio.sleep(warmup)
        done = await self.wq.finished_record(req.tenant, rid)
        if done is not None:
            self.log.info("redelivered_already_finished", status=done.status)
            await qmsg.ack()
            return True
        now = time.monotonic()
        for hb in self.registry.live("decode", now) + self.registry.live("prefill", now):
            if rid in hb.active_requests:
                self.log.info("redelivered_adopted", holder=hb.worker_id)
                tracing.set_attrs(sp, adopted_from=hb.worker_id)
                is_decoder = hb.role == "decode"
                self.inflight[rid] = Inflight(
                    request_id=rid, tenant=req.tenant, stream_subject=req.stream_subject,
                    decoder=hb.worker_id if is_decoder else "", prefiller=None if is_decoder else hb.worker_id,
                    holder=hb.worker_id, queue_msg=qmsg)
                self.quota.admit(req.tenant, rid, len(q.prompt_token_ids), req.sampling.max_tokens, now)
                return True
        if int(qmsg.metadata.num_delivered) > MAX_DELIVERIES:
            self._accepted_meta.pop(rid, None)
            await self._publish_failure(rid, req.tenant, req.stream_subject, ErrorCode.INTERNAL,
                                        f"the request was handed to a router {MAX_DELIVERIES} times and none "
                                        "finished dispatching it")
            await qmsg.ack()
            return True
        self.log.info("recovered_dispatching", deliveries=int(qmsg.metadata.num_delivered))
        self.quota.admit(req.tenant, rid, len(q.prompt_token_ids), req.sampling.max_tokens, now)
        return False

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
                     queue_msg: Msg | None = None) -> Inflight | None:
        """Decide where the request runs and hand it to the worker(s). With ``msg`` (no queue), answers the
        caller's request; otherwise a failure goes to the request's stream subject."""
        log = self.log.bind(request_id=req.request_id, tenant=req.tenant)
        now = time.monotonic()
        views = [self._view(hb) for hb in self.registry.live("decode", now) + self.registry.live("prefill", now)]
        rreq = RoutingRequest(request_id=req.request_id, tenant=req.tenant, token_ids=ids,
                              session_key=req.session_id, force_route=None if req.route == "auto" else req.route)
        try:
            decision = self.policy.decide(rreq, views, now)
        except NoWorkers as exc:
            if msg is not None:
                await self._reject(req, msg, ErrorCode.NO_WORKERS, str(exc))
            else:
                self._accepted_meta.pop(req.request_id, None)
                await self._publish_failure(req.request_id, req.tenant, req.stream_subject, ErrorCode.NO_WORKERS,
                                            str(exc))
            return None
        if msg is not None:
            await self.b.respond(msg, Accepted(request_id=req.request_id, router_id=self.worker_id,
                                               prompt_tokens=len(ids)))
        route = Route(decision.route)
        job = DecodeJob(
            request_id=req.request_id, tenant=req.tenant, prompt_token_ids=ids, sampling=req.sampling,
            stream_subject=req.stream_subject, route=route, decoder_id=decision.decoder,
            prefill_worker=decision.prefiller, created_ms=req.created_ms, routed_ms=now_ms(),
            deadline_ms=req.deadline_ms, decision=decision.to_dict(), stream=req.stream,
        )
        charge = len(ids) + req.sampling.max_tokens
        inf = Inflight(request_id=req.request_id, tenant=req.tenant, stream_subject=req.stream_subject,
                       decoder=decision.decoder, prefiller=decision.prefiller,
                       holder=decision.prefiller or decision.decoder, queue_msg=queue_msg, charged=charge)
        self.fair.charge(req.tenant, charge)
        self.inflight[req.request_id] = inf
        inf.trace_ctx = sp.get_span_context() if sp.get_span_context().is_valid else None
        ddict = decision.to_dict()
        # The routing decision, flattened (scalars) and whole (JSON), so a waterfall can show why.
        tracing.set_attrs(sp, prompt_tokens=len(ids), route=str(route.value), decoder=decision.decoder,
                          prefiller=decision.prefiller, decision_json=ddict)
        tracing.set_attrs(sp, "decision.", **{k: v for k, v in ddict.items() if k != "request_id"})
        log.info("routed", decision=ddict, prompt_tokens=len(ids))
        await self._track(inf, req, job)
        try:
            if route is Route.DISAGGREGATED:
                assert decision.prefiller is not None
                await self.b.publish(Subjects.prefill_job(decision.prefiller), PrefillJob(decode=job))
            else:
                await self.b.publish(Subjects.decode_job(decision.decoder), job)
        except PayloadTooLarge as exc:
            await self._fail(inf, ErrorCode.PAYLOAD_TOO_LARGE, str(exc))
        return inf

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

    @staticmethod
    def _view(hb: Heartbeat) -> WorkerView:
        return WorkerView(
            worker_id=hb.worker_id, role=hb.role, live=True,
            active_seqs=hb.load.active_seqs, queued_prefill_tokens=hb.load.queued_prefill_tokens,
            free_blocks=hb.load.free_blocks, total_blocks=hb.load.total_blocks,
            used_blocks=hb.load.used_blocks, prefill_tokens_per_s=hb.load.prefill_tokens_per_s,
            step_ms=hb.load.step_ms, pool=hb.pool,
        )
