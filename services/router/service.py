"""Router service: the front of the pipeline.

For each GenerateRequest: tokenize, check limits, answer Accepted, wait (bounded) for live workers, ask the
routing policy for a decision, and publish a PrefillJob (disaggregated) or DecodeJob (direct). It tracks
every request it routed until the worker reports it finished, so that when a worker dies the caller gets
a terminal ``worker_died`` error instead of a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import structlog
from nats.aio.msg import Msg
from nats.js.api import DiscardPolicy, StreamConfig
from opentelemetry import trace
from opentelemetry.trace import SpanContext

from proto import (
    Accepted,
    DecodeJob,
    ErrorCode,
    GenerateRequest,
    Heartbeat,
    KvEventBatch,
    PrefillJob,
    RequestFinished,
    Route,
    StreamError,
    Subjects,
    WorkerLoad,
    now_ms,
)
from services.common.resync import resync_index
from splitserve.cache import events as cache_events
from splitserve.cache.index import PrefixIndex
from splitserve.obs import tracing
from splitserve.routing import DisaggPolicy, NoWorkers, Router, RoutingRequest, WorkerView
from splitserve.runtime.bus import PayloadTooLarge
from splitserve.runtime.registry import WorkerRegistry
from splitserve.runtime.service import Service


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
        max_stall_ms: float | None = 250.0,
        results_ttl_s: float = 86400.0,
        decoder_prefill_tps: float = 800.0,
        **kw: object,
    ) -> None:
        super().__init__(worker_id, nats_url, **kw)  # type: ignore[arg-type]
        self.model = model
        self.strategy_name = strategy
        self.disagg_threshold = disagg_threshold
        self.results_ttl_s = results_ttl_s
        # Direct prefill on a decoder pauses its other streams: above this pause, use a prefiller instead.
        self.disagg = DisaggPolicy(min_uncached_tokens=disagg_threshold, max_stall_ms=max_stall_ms,
                                   decoder_prefill_tokens_per_s=decoder_prefill_tps)
        self.no_worker_wait_s = no_worker_wait_s
        self.max_inflight = max_inflight
        self.registry = WorkerRegistry()
        self.inflight: dict[str, Inflight] = {}
        self._worker_change = asyncio.Event()

    async def setup(self) -> None:
        from services.router.tokenize import PromptTokenizer

        # Async jobs' results are kept (per tenant subject, with a TTL) in JetStream for later fetching.
        js = self.b.nc.jetstream()
        cfg = StreamConfig(name=Subjects.RESULTS_STREAM, subjects=[Subjects.RESULTS_ALL],
                           max_age=self.results_ttl_s, max_bytes=1 << 30, discard=DiscardPolicy.OLD)
        try:
            await js.add_stream(cfg)
        except Exception:
            await js.update_stream(cfg)

        self.tokenizer = await asyncio.to_thread(PromptTokenizer, self.model)
        # The router always keeps an in-process replica of the cache index, fed by the workers' own KV
        # events: kvaware routes on it, and every strategy's disaggregation rule counts *uncached* tokens.
        self.index = PrefixIndex()
        self.policy = Router(strategy=self.strategy_name, disagg=self.disagg, index=self.index)

    async def start(self) -> None:
        b = self.b
        await b.subscribe(Subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        await b.subscribe(Subjects.FINISHED_ALL, RequestFinished, self.on_finished)
        await b.subscribe(Subjects.KV_EVENTS_ALL, KvEventBatch, self.on_kv_events)
        await b.subscribe(
            Subjects.REQUEST_ALL, GenerateRequest, self.on_request, queue=Subjects.ROUTER_QUEUE, concurrent=True
        )
        b.spawn(self._reaper())

    def load(self) -> WorkerLoad:
        return WorkerLoad(active_seqs=len(self.inflight))

    def active_requests(self) -> list[str]:
        return list(self.inflight)

    def heartbeat_extra(self) -> dict[str, object]:
        return {"model": self.tokenizer.name if hasattr(self, "tokenizer") else None}

    # --- heartbeats and failure detection ------------------------------------------------------------
    async def on_heartbeat(self, hb: Heartbeat, _: Msg) -> None:
        self.registry.observe(hb, time.monotonic())
        if hb.role == "decode":
            # A request handed from prefiller to decoder now belongs to the decoder.
            for rid in hb.active_requests:
                inf = self.inflight.get(rid)
                if inf is not None and inf.decoder == hb.worker_id:
                    inf.holder = hb.worker_id
                    self.policy.release(rid)  # the decoder's own load report now counts it
        self._worker_change.set()

    async def on_kv_events(self, batch: KvEventBatch, _: Msg) -> None:
        gap = self.policy.apply_events(cache_events.KvEventBatch.from_dict(batch.model_dump()))
        if gap:
            self.b.spawn(resync_index(self.b, self.index, batch.worker_id, self.log))

    async def on_finished(self, ev: RequestFinished, _: Msg) -> None:
        self.inflight.pop(ev.request_id, None)
        self.policy.release(ev.request_id)

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            for wid, reason in self.registry.reap(time.monotonic(), observer=self.worker_id):
                self.log.warning("worker_dead", dead_worker=wid, reason=reason)
                self.policy.remove_worker(wid)
                for inf in [i for i in self.inflight.values() if i.holder == wid]:
                    await self._fail(inf, ErrorCode.WORKER_DIED, f"{reason} while serving this request", wid)

    async def _fail(self, inf: Inflight, code: ErrorCode, message: str, worker: str | None = None) -> None:
        self.inflight.pop(inf.request_id, None)
        if inf.trace_ctx is not None and trace.get_current_span().get_span_context() != inf.trace_ctx:
            # router.request ended long ago (e.g. the decoder died mid-stream): record the failure in the
            # same trace so the waterfall shows where and why the request ended.
            parent = trace.set_span_in_context(trace.NonRecordingSpan(inf.trace_ctx))
            with tracing.tracer().start_as_current_span("router.fail", context=parent) as sp:
                tracing.set_attrs(sp, request_id=inf.request_id, tenant=inf.tenant, error_code=str(code),
                                  failed_worker=worker)
                tracing.record_error(sp, message)
                await self._publish_failure(inf, code, message, worker)
            return
        await self._publish_failure(inf, code, message, worker)

    async def _publish_failure(self, inf: Inflight, code: ErrorCode, message: str, worker: str | None) -> None:
        err = StreamError(request_id=inf.request_id, code=code, message=message, worker=worker,
                          retryable=code in (ErrorCode.WORKER_DIED, ErrorCode.NO_WORKERS))
        await self.b.publish(inf.stream_subject, err)
        await self.b.publish(
            Subjects.finished(inf.tenant),
            RequestFinished(request_id=inf.request_id, tenant=inf.tenant, worker_id=self.worker_id,
                            status="error", error_code=code),
        )

    # --- requests ------------------------------------------------------------------------------------
    async def on_request(self, req: GenerateRequest, msg: Msg) -> None:
        with tracing.span_from(msg.headers, "router.request", request_id=req.request_id, tenant=req.tenant) as sp, \
                structlog.contextvars.bound_contextvars(request_id=req.request_id, tenant=req.tenant):
            # Queue wait: client send -> this router picking the request up.
            tracing.set_attrs(sp, queue_wait_ms=round(max(0.0, now_ms() - req.created_ms), 2),
                              route_requested=req.route, max_tokens=req.sampling.max_tokens)
            await self._handle(req, msg, sp)

    async def _reject(self, req: GenerateRequest, msg: Msg, code: ErrorCode, message: str) -> None:
        self.log.info("rejected", request_id=req.request_id, code=str(code), reason=message)
        sp = trace.get_current_span()
        sp.set_attribute("error.code", str(code))
        tracing.record_error(sp, message)
        err = StreamError(request_id=req.request_id, code=code, message=message)
        if msg.reply:
            await self.b.respond(msg, err)
        else:
            await self.b.publish(req.stream_subject, err)

    async def _handle(self, req: GenerateRequest, msg: Msg, sp: trace.Span) -> None:
        log = self.log.bind(request_id=req.request_id, tenant=req.tenant)
        dup = self.inflight.get(req.request_id)
        if dup is not None:
            # Idempotent: a client that reconnected re-sends its request; it is the same request, so accept it
            # again (it keeps streaming on the same subject) instead of running it twice.
            if dup.tenant == req.tenant:
                log.info("duplicate_request_reattached")
                await self.b.respond(msg, Accepted(request_id=req.request_id, router_id=self.worker_id,
                                                   prompt_tokens=0))
            else:
                await self._reject(req, msg, ErrorCode.BAD_REQUEST,
                                   f"request id {req.request_id} is in use by another tenant")
            return
        if len(self.inflight) >= self.max_inflight:
            await self._reject(req, msg, ErrorCode.BUSY, f"router {self.worker_id} has {self.max_inflight} "
                               "requests in flight; retry later")
            return
        try:
            ids = self.tokenizer.token_ids(req)
        except Exception as exc:
            await self._reject(req, msg, ErrorCode.BAD_REQUEST, f"could not tokenize the prompt: {exc}")
            return
        if not ids:
            await self._reject(req, msg, ErrorCode.BAD_REQUEST, "the prompt is empty after tokenization")
            return
        # Wait (bounded) for live workers before accepting, so "no workers" is a clear, early answer.
        deadline = time.monotonic() + self.no_worker_wait_s
        while True:
            now = time.monotonic()
            decoders = self.registry.live("decode", now)
            if decoders or now >= deadline:
                break
            self._worker_change.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._worker_change.wait(), timeout=max(0.05, deadline - now))
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
        views = [self._view(hb) for hb in self.registry.live("decode", now) + self.registry.live("prefill", now)]
        rreq = RoutingRequest(request_id=req.request_id, tenant=req.tenant, token_ids=ids,
                              session_key=req.session_id, force_route=None if req.route == "auto" else req.route)
        try:
            decision = self.policy.decide(rreq, views, now)
        except NoWorkers as exc:
            await self._reject(req, msg, ErrorCode.NO_WORKERS, str(exc))
            return
        await self.b.respond(msg, Accepted(request_id=req.request_id, router_id=self.worker_id,
                                           prompt_tokens=len(ids)))
        route = Route(decision.route)
        job = DecodeJob(
            request_id=req.request_id, tenant=req.tenant, prompt_token_ids=ids, sampling=req.sampling,
            stream_subject=req.stream_subject, route=route, decoder_id=decision.decoder,
            prefill_worker=decision.prefiller, created_ms=req.created_ms, routed_ms=now_ms(),
            deadline_ms=req.deadline_ms, decision=decision.to_dict(), stream=req.stream,
        )
        inf = Inflight(request_id=req.request_id, tenant=req.tenant, stream_subject=req.stream_subject,
                       decoder=decision.decoder, prefiller=decision.prefiller,
                       holder=decision.prefiller or decision.decoder)
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

    @staticmethod
    def _view(hb: Heartbeat) -> WorkerView:
        return WorkerView(
            worker_id=hb.worker_id, role=hb.role, live=True,
            active_seqs=hb.load.active_seqs, queued_prefill_tokens=hb.load.queued_prefill_tokens,
            free_blocks=hb.load.free_blocks, total_blocks=hb.load.total_blocks,
            used_blocks=hb.load.used_blocks, prefill_tokens_per_s=hb.load.prefill_tokens_per_s,
        )
