"""The router's state and what every part of it shares: the request book and its flights (:class:`Inflight`),
the worker registry, the policy, the queue, the tenants' books; a request's end (retire, settle, fail), the
stream it is followed on, and the views the policy reads. The parts (intake, dispatch, migration, queued
ends, peers, admin) are mixins over :class:`RouterCore`; :class:`~.service.RouterService` puts them together.
Time is ``self.clock`` (monotonic seconds), so tests drive the router on a clock of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import SpanContext

from splitserve import proto
from splitserve.cache.index import PrefixIndex
from splitserve.obs import tracing
from splitserve.obs.rates import EventRate
from splitserve.proto import (
    DecodeJob,
    ErrorCode,
    GenerateRequest,
    Heartbeat,
    RequestFinished,
    RequestRecord,
    Route,
    StreamDelta,
    StreamError,
    Subjects,
    WorkerLoad,
)
from splitserve.routing import Decision, WorkerView
from splitserve.routing.book import RECENT_ENDS_KEPT, Flight, RequestBook
from splitserve.routing.live import live_disagg, view_from_load
from splitserve.routing.policies import PolicySet
from splitserve.runtime.registry import WorkerRegistry
from splitserve.runtime.service import Service
from splitserve.runtime.workqueue import WorkQueue
from splitserve.services.router.inputs import routing_inputs
from splitserve.services.router.models import ModelTable
from splitserve.services.router.shared import CorruptRecord, RequestRegistry, SharedQuota
from splitserve.tenancy import TenantsConfig, load_tenants
from splitserve.tenancy.contracts import ContractGate
from splitserve.tenancy.fairshare import FairScheduler
from splitserve.tenancy.intake_rate import IntakeBudget
from splitserve.tenancy.quota import QuotaBook

if TYPE_CHECKING:
    from splitserve.services.router.tokenize import PromptTokenizer

DROPPED_KEPT = 100_000  # requests ended without their queue message, remembered until it comes up
REGISTRY_WARMUP_S = 1.5  # three heartbeat intervals: a router that just started has heard every live worker


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


class RouterCore(Service):
    """The router's state and shared steps; the parts add intake, dispatch, migration and the rest."""

    # Made by RouterService.setup / make_policy: they need the NATS connection, or load the model's tokenizer.
    wq: WorkQueue
    requests: RequestRegistry
    shared_quota: SharedQuota
    index: PrefixIndex
    policy: PolicySet

    def __init__(
        self,
        worker_id: str,
        nats_url: str,
        *,
        model: str | list[str] | None = None,
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
        lora_affinity: bool = True,
        model_policies: dict[str, tuple[str | None, int | None]] | None = None,
        **kw: object,
    ) -> None:
        super().__init__(worker_id, nats_url, **kw)  # type: ignore[arg-type]
        self.clock: Callable[[], float] = time.monotonic  # every part's notion of now (tests set their own)
        self.max_migrations = max_migrations
        self.lora_affinity = lora_affinity  # prefer workers with a request's adapter loaded (routing.adapters)
        self._intake_subs: list[Any] = []
        self.models = ModelTable([model] if isinstance(model, str) or model is None else list(model))  # --model
        self.strategy_name = strategy
        self.model_policies = self.models.check_policies(model_policies or {})  # model -> (strategy, threshold)
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
        self.contracts = ContractGate(self.tenants.contract, self.tenants.priority, self._own_running,
                                      self.tenants.contracts(), self._router_share)
        self.contracts_on = bool(self.tenants.contracts()) or self.tenants.defaults.contract is not None
        self._remote_running: dict[str, tuple[float, dict[str, int]]] = {}  # router -> (heard at, running)
        self._contract_problems: list[str] = []  # what the live workers cannot honour now (peers' check)
        self.use_queue = queue
        self.queue_ack_wait_s = queue_ack_wait_s
        self._dispatch_wake = asyncio.Event()
        # Requests that ended without their queue message in hand: acked when it comes up (_drop_queue_message)
        self.dropped: OrderedDict[str, None] = OrderedDict()
        self._deadlines: list[tuple[float, str, str]] = []  # (deadline ms, tenant, request id) accepted here
        self._accepted_meta: dict[str, tuple[str, str, int]] = {}  # key -> (tenant, stream subject, prompt len)
        self._rates: dict[tuple[str, str], EventRate] = {}  # only tenants that passed _tenant_slot: bounded
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

    def _own_running(self, tenant: str) -> int:
        return self.book.by_tenant.get(tenant, 0)

    def _router_share(self) -> tuple[int, int]:
        """This router's rank among the live routers (itself included) and their number: contract caps are
        split between them."""
        ids = sorted({hb.worker_id for hb in self.registry.live("router", self.clock())} | {self.worker_id})
        return ids.index(self.worker_id), len(ids)

    @property
    def inflight(self) -> dict[str, Inflight]:
        """The request book's flights (read only: every change goes through ``self.book``)."""
        return self.book.flights

    def load(self) -> WorkerLoad:
        return WorkerLoad(active_seqs=len(self.inflight))

    def active_requests(self) -> list[str]:
        return list(self.inflight)

    @property
    def tokenizer(self) -> PromptTokenizer:
        """The default model's tokenizer."""
        return self.models.default.tok

    def heartbeat_extra(self) -> dict[str, object]:
        return {"model": self.models.default.name}

    async def _registry_warmup(self) -> None:
        """Wait until this router has heard every live worker (three heartbeat intervals since start): a request
        routed before would miss the workers not heard yet (every prompt sent direct while no prefiller is)."""
        warm = REGISTRY_WARMUP_S - (self.clock() - self._started)
        if warm > 0:
            await asyncio.sleep(warm)

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
            self.quota.finish(ev.tenant, ev.request_id, used, self.clock())

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
        if msg is None:  # dispatched by intake (the queue's fast path) before its queue message was pulled
            self._drop_queue_message(inf.key)

        async def settle() -> None:
            if inf.record is not None:
                await self._settle(inf.record, inf.record_rev, status, used_tokens)
            if msg is not None:
                with contextlib.suppress(Exception):
                    await msg.ack()

        self.b.spawn(settle())

    def _drop_queue_message(self, key: str) -> None:  # (it ended in the queue, or intake dispatched it)
        self.dropped[key] = None
        while len(self.dropped) > DROPPED_KEPT:
            self.dropped.popitem(last=False)

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
                await self._publish_failure(inf.request_id, inf.tenant, inf.stream_subject, code, message, worker,
                                            inf.request)
            return
        await self._publish_failure(inf.request_id, inf.tenant, inf.stream_subject, code, message, worker, inf.request)

    async def _publish_failure(self, request_id: str, tenant: str, stream_subject: str, code: ErrorCode,
                               message: str, worker: str | None = None, req: GenerateRequest | None = None) -> None:
        err = StreamError(request_id=request_id, code=code, message=message, worker=worker,
                          retryable=code in (ErrorCode.WORKER_DIED, ErrorCode.NO_WORKERS))
        await self.b.publish(stream_subject, err)
        await self.b.publish(
            Subjects.finished(tenant, request_id),
            RequestFinished(request_id=request_id, tenant=tenant, worker_id=self.worker_id, status="error",
                            error_code=code, model=req.model if req else None, lora=req.lora if req else None))

    async def _track(self, inf: Inflight, req: GenerateRequest, job: DecodeJob) -> None:
        """Remember the job and follow the request's stream (before the job goes out, so no delta is missed): the
        tokens the caller has received are what a migration resumes from (heartbeats carrying tokens would lag, and
        a resume from an older point would send the caller tokens twice). Non-streaming: no deltas, it restarts."""
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
        else:  # it ended: its load is off its workers now, not when its stored RequestFinished comes back
            inf.started = inf.confirmed = True
            self.policy.release(inf.key)

    def _rate(self, tenant: str, what: str) -> EventRate:
        r = self._rates.get((tenant, what))
        if r is None:
            r = self._rates[(tenant, what)] = EventRate()
        return r

    def _live(self, role: str, model: str, now: float, lora: str | None = None) -> list[Heartbeat]:
        """The live workers of a role that serve ``model`` (and have the LoRA adapter ``lora`` loaded)."""
        of = self.models.model_of
        return [hb for hb in self.registry.live(role, now) if of(hb) == model
                and (lora is None or lora in hb.adapters or lora in hb.adapters_available)]

    async def _wait_for_decoders(self, model: str) -> list[Heartbeat]:
        """Live decoders of ``model``, waiting (bounded) for one to appear, so "no workers" is a clear, early
        answer."""
        deadline = self.clock() + self.no_worker_wait_s
        while True:
            now = self.clock()
            decoders = self._live("decode", model, now)
            if decoders or now >= deadline:
                return decoders
            self._worker_change.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._worker_change.wait(), timeout=max(0.05, deadline - now))

    def free_slots(self, now: float, model: str | None = None) -> int:
        """Decode slots this router may fill now: the request book's slot ledger (``RequestBook.free_slots``), over
        the decoders the registry counts live (ready, reachable, heard within their heartbeat timeout); of one
        served model's decoders, or of all (None)."""
        return self.book.free_slots(now, model)

    def _cache_salt(self, req: GenerateRequest) -> str:
        """The salt keying this request's prefix-cache blocks (index lookups here, the workers' stores and KV
        events): from the tenant the router trusts (``req.tenant``, the one its subject is authorised for) and
        the request's own optional salt, never from the request alone (``TenantsConfig.cache_salt``). With
        several models, or a LoRA adapter, it is scoped to the request's model and adapter too (``|m:`` and a
        digest of both; a tenant's salt holds no ``|``: unambiguous), so no prompt hits another model's or
        adapter's blocks."""
        salt = self.tenants.cache_salt(req.tenant, req.cache_salt)
        if self.models.single and not req.lora:
            return salt
        # 12 hex digits of (model, adapter): the salt stays within what vLLM takes as a cache_salt (128)
        scope = f"{self.models.served(req.model).name}\0{req.lora or ''}".encode("utf-8", "surrogatepass")
        return f"{salt}|m:{hashlib.sha256(scope).hexdigest()[:12]}"

    def _decide(self, req: GenerateRequest, token_ids: list[int], salt: str, now: float,
                pin: str | None = None) -> Decision:
        """The policy's decision for ``req`` over ``token_ids`` (its prompt, or prompt + tokens so far when it
        moves) among the workers live now (``pin``: on that decoder if it is one of them); raises NoWorkers."""
        rreq, views, model, affinity = routing_inputs(self, req, token_ids, salt, now, pin)
        decision = self.policy.decide(rreq, views, now, model)
        if req.lora is not None:  # the route explanation says which adapter, and why these workers
            decision.detail["adapter"] = {"name": req.lora, "affinity": affinity or "off"}
        return decision

    @staticmethod
    def _view(hb: Heartbeat) -> WorkerView:
        return view_from_load(hb.worker_id, hb.role, hb.pool, hb.load)

    # --- provided by the parts (declared here so each part type-checks on its own) ---------------------------
    async def _route(self, req: GenerateRequest, ids: list[int], msg: Msg | None, sp: trace.Span,
                     queue_msg: Msg | None = None, record: tuple[RequestRecord, int] | None = None,
                     guaranteed: bool = False, pin: str | None = None) -> Inflight | None:
        """Route a request and hand it to its worker(s): :mod:`.dispatch`."""
        raise NotImplementedError

    async def _reject(self, req: GenerateRequest, msg: Msg, code: ErrorCode, message: str,
                      retry_after_s: float | None = None, limit: str | None = None,
                      detail: dict[str, object] | None = None) -> None:
        """Refuse a request to its caller (``detail``: more for its log line): :mod:`.intake`."""
        raise NotImplementedError

    async def _send_job(self, inf: Inflight, route: Route, decoder: str, prefiller: str | None,
                        job: DecodeJob) -> None:
        """Publish a job to its worker: :mod:`.migration`."""
        raise NotImplementedError

    async def _end_queued(self, key: str, reason: str, why: str) -> None:
        """End a request that never left the queue: :mod:`.queued_ends`."""
        raise NotImplementedError

    async def _expire_queued(self) -> None:
        """End the queued requests whose deadline passed: :mod:`.queued_ends`."""
        raise NotImplementedError
