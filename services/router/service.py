"""Router service: the front of the pipeline.

Intake (``ss.req.{tenant}``, request/reply): tokenize, check the model's and the tenant's limits (unknown
tenant, max prompt / max_tokens, in-flight, queued, tokens per minute: a precise refusal with a retry-after),
store the request durably in its tenant's queue (``services.router.workqueue``) and answer Accepted.

Dispatch: while decoders have free slots, the fair scheduler (``splitserve.tenancy.fairshare``) picks the
tenant to serve next by weighted tokens; the router pulls that tenant's next request, asks the routing
policy for a decision, and publishes a PrefillJob (disaggregated) or DecodeJob (direct). It tracks every
request it dispatched until the worker reports it finished (then acks its queue message), so that when a
worker dies the caller gets a terminal ``worker_died`` error instead of a hang, and when the router itself
dies its requests are redelivered: one still running is adopted, one already finished is dropped, the
rest are dispatched again.

``--no-queue`` dispatches at intake instead (no durability, no fair share), for comparison.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import structlog
from nats.aio.msg import Msg
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
    KvEventBatch,
    PrefillJob,
    QueuedRequest,
    QueueReport,
    QueueReportRequest,
    RequestFinished,
    Route,
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
from splitserve.routing import NoWorkers, RoutingRequest, WorkerView
from splitserve.routing.live import build_router, decoder_free_slots, dispatch_batch, live_disagg, view_from_load
from splitserve.runtime.bus import PayloadTooLarge
from splitserve.runtime.jetstream import ensure_stream, replicas_for
from splitserve.runtime.registry import WorkerRegistry
from splitserve.runtime.service import Service
from splitserve.tenancy import TenantsConfig, load_tenants
from splitserve.tenancy.fairshare import FairScheduler
from splitserve.tenancy.quota import QuotaBook

_REFUSAL_CODES = {"unknown_tenant": ErrorCode.UNKNOWN_TENANT, "quota_exceeded": ErrorCode.QUOTA_EXCEEDED,
                  "prompt_too_long": ErrorCode.PROMPT_TOO_LONG, "bad_request": ErrorCode.BAD_REQUEST}
MAX_DELIVERIES = 5  # a request that took down this many routers is failed instead of tried again
REGISTRY_WARMUP_S = 1.5  # three heartbeat intervals
# A job no heartbeat of its worker listed this long after it was sent (or after this router's connection came
# back: what it published meanwhile was flushed then), while that worker kept heartbeating, never reached it:
# the NATS node between them died with it in flight. Workers list a request until its end is stored.
LOST_JOB_S = 2.0


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
    seen: bool = False  # a heartbeat of its worker listed it: the job reached the worker
    charged: int = 0  # tokens the fair scheduler charged at dispatch (settled at finish)


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
        **kw: object,
    ) -> None:
        super().__init__(worker_id, nats_url, **kw)  # type: ignore[arg-type]
        self.model = model
        self.strategy_name = strategy
        self.disagg_threshold = disagg_threshold
        self.results_ttl_s = results_ttl_s
        self.disagg = live_disagg(disagg_threshold, max_stall_ms, decoder_prefill_tps)
        self.long_prompt_tokens = long_prompt_tokens
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
        await ensure_stream(js, cfg, replicas_for(self.b.nc))  # R3 on a cluster

        self.wq = WorkQueue(self.b, ack_wait_s=self.queue_ack_wait_s)
        await self.wq.setup()  # also the usage stream, which --no-queue keeps too
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
        await b.subscribe(Subjects.FINISHED_ALL, RequestFinished, self.on_finished)
        await b.subscribe(Subjects.KV_EVENTS_ALL, KvEventBatch, self.on_kv_events)
        await b.subscribe(Subjects.CANCEL_ALL, CancelRequest, self.on_cancel)
        await b.subscribe(Subjects.ADMIN_QUEUES, QueueReportRequest, self.on_queue_report,
                          queue=Subjects.ROUTER_QUEUE, concurrent=True)
        await b.subscribe(Subjects.ADMIN_ROUTE_EXPLAIN, proto.RouteExplainRequest, self.on_route_explain,
                          queue=Subjects.ROUTER_QUEUE)
        await b.subscribe(
            Subjects.REQUEST_ALL, GenerateRequest, self.on_request, queue=Subjects.ROUTER_QUEUE, concurrent=True
        )
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
                inf.seen = True
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
        if inf.charged:
            self.fair.settle(inf.tenant, inf.charged, used_tokens if used_tokens is not None else 0)
            inf.charged = 0
        if inf.queue_msg is not None:
            msg, inf.queue_msg = inf.queue_msg, None
            with contextlib.suppress(Exception):
                await msg.ack()
        self._dispatch_wake.set()

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            for wid, reason in self.registry.reap(time.monotonic(), observer=self.worker_id):
                self.log.warning("worker_dead", dead_worker=wid, reason=reason)
                self.policy.remove_worker(wid)
                for inf in [i for i in self.inflight.values() if i.holder == wid]:
                    await self._fail(inf, ErrorCode.WORKER_DIED, f"{reason} while serving this request", wid)
            await self._expire_queued()
            try:
                await self._check_lost_jobs()
            except Exception as exc:  # e.g. SS_USAGE electing a leader: checked again next round
                self.log.warning("lost_job_check_failed", error=str(exc))

    async def _check_lost_jobs(self) -> None:
        """Jobs lost in transit (see LOST_JOB_S): one that ended meanwhile is retired from its stored
        RequestFinished; the rest go back to the queue (nak: redelivered now, run once more) or, without a
        queue, fail as retryable."""
        now = time.monotonic()
        since = max(0.0, now - LOST_JOB_S)
        for inf in [i for i in self.inflight.values() if not i.seen]:
            if max(inf.routed_at, self.b.last_reconnect) > since:
                continue
            st = self.registry.workers.get(inf.holder)
            if st is None or st.last_seen <= max(inf.routed_at, self.b.last_reconnect) + LOST_JOB_S:
                continue  # no heartbeat from its worker since: not known to be lost (a dead one is reaped)
            inf.seen = True  # checked once
            done = await self.wq.finished_record(inf.tenant, inf.request_id)
            if done is not None:
                await self.on_finished(done, None)  # type: ignore[arg-type]
                continue
            self.log.warning("job_lost_in_transit", request_id=inf.request_id, worker=inf.holder)
            if inf.queue_msg is None:
                await self._fail(inf, ErrorCode.WORKER_DIED, "the job never reached its worker (a NATS node "
                                 "died with it in flight)", inf.holder)
                continue
            self.inflight.pop(inf.request_id, None)
            self.policy.release(inf.request_id)
            self.quota.finish(inf.tenant, inf.request_id, None, now)
            if inf.charged:
                self.fair.settle(inf.tenant, inf.charged, 0)
                inf.charged = 0
            msg, inf.queue_msg = inf.queue_msg, None
            with contextlib.suppress(Exception):
                await msg.nak()

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

    # --- requests that end while still queued ----------------------------------------------------------
    async def on_cancel(self, c: CancelRequest, _: Msg) -> None:
        # A dispatched request is stopped by its worker; one still waiting in the queue is ended here, now,
        # and skipped when it reaches dispatch.
        if c.request_id in self.inflight or c.request_id not in self._accepted_meta:
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
        return sum(decoder_free_slots(hb.load.max_seqs, hb.load.active_seqs + hb.load.queued_requests,
                                      mine.get(hb.worker_id, 0), hb.pool)
                   for hb in self.registry.live("decode", now))

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
        while (free := self.free_slots(time.monotonic())) > 0:
            tenant = self.fair.pick(self.wq.pending_by_tenant())
            if tenant is None:
                break
            # A few at a time when many slots are free (one round trip to the server for several requests);
            # few enough that the fair scheduler still decides at a fine grain.
            qmsgs = await self.wq.fetch(tenant, dispatch_batch(free))
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
            sp.set_attributes(tracing.gen_ai_of(req, self._model_name()))
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

    async def on_route_explain(self, req: proto.RouteExplainRequest, msg: Msg) -> None:
        """What each strategy would decide for this prompt now: a dry run that dispatches nothing and leaves
        every routing state as it was (``services.router.explain``)."""
        from services.router import explain

        try:
            ids = explain.prompt_ids(self.tokenizer.token_ids, req)
        except Exception as exc:
            await self.b.reply_error(msg, ErrorCode.BAD_REQUEST, f"could not tokenize the prompt: {exc}")
            return
        now = time.monotonic()
        live = self.registry.live("decode", now) + self.registry.live("prefill", now)
        await self.b.respond(msg, explain.answer(self.worker_id, self.policy, req, ids, live, self._view, now))

    @staticmethod
    def _view(hb: Heartbeat) -> WorkerView:
        ld = hb.load
        return view_from_load(hb.worker_id, hb.role, hb.pool, active_seqs=ld.active_seqs,
                              queued_prefill_tokens=ld.queued_prefill_tokens, free_blocks=ld.free_blocks,
                              total_blocks=ld.total_blocks, used_blocks=ld.used_blocks,
                              prefill_tokens_per_s=ld.prefill_tokens_per_s, step_ms=ld.step_ms)
