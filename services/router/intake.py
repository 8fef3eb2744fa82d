"""Intake (``ss.req.{tenant}``, request/reply): the cheap checks first (known tenant, the tenant's byte budget,
prompt size), then tokenizing (large prompts off the event loop, bounded), the model's and the tenant's
limits, and, with the durable queue, quota reservation, the request's registry record and its queue message
before Accepted: a step that fails undoes the ones before it. A re-sent id is reattached, never run twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq

import structlog
from nats.aio.msg import Msg
from opentelemetry import trace

from splitserve import proto
from splitserve.obs import tracing
from splitserve.proto import (
    Accepted,
    ErrorCode,
    GenerateRequest,
    QueuedRequest,
    RequestRecord,
    StreamError,
)
from splitserve.runtime.bus import PayloadTooLarge, reply_allowed
from splitserve.services.router.core import REGISTRY_WARMUP_S
from splitserve.services.router.direct import DirectDispatch
from splitserve.services.router.models import ServedModel
from splitserve.services.router.slo_gate import SloGate, refusal_message
from splitserve.services.router.tokenize import PromptTokenizer

_REFUSAL_CODES = {"unknown_tenant": ErrorCode.UNKNOWN_TENANT, "quota_exceeded": ErrorCode.QUOTA_EXCEEDED,
                  "prompt_too_long": ErrorCode.PROMPT_TOO_LONG, "bad_request": ErrorCode.BAD_REQUEST}
INLINE_TOKENIZE_BYTES = 16_384  # prompts up to this size are tokenized on the event loop (~100 us)
TOKENIZE_WAITING = 8  # large prompts tokenizing or waiting for the tokenizer thread at once; more: busy
OPEN_MODE_MAX_TENANTS = 1024  # distinct tenant names served without a tenants file


class _TokenizerBusy(Exception):
    pass


class Intake(SloGate, DirectDispatch):
    """Admission of a request: checks, tokenizing, limits, the durable queue, Accepted."""

    async def on_request(self, req: GenerateRequest, msg: Msg) -> None:
        with tracing.span_from(msg.headers, "router.request", request_id=req.request_id, tenant=req.tenant) as sp, \
                structlog.contextvars.bound_contextvars(request_id=req.request_id, tenant=req.tenant):
            tracing.set_attrs(sp, route_requested=req.route, max_tokens=req.sampling.max_tokens,
                              priority=req.priority)
            sp.set_attributes(tracing.gen_ai_of(req, self.models.served(req.model).name))
            await self._intake(req, msg, sp)

    async def _reject(self, req: GenerateRequest, msg: Msg, code: ErrorCode, message: str,
                      retry_after_s: float | None = None, limit: str | None = None,
                      detail: dict[str, object] | None = None) -> None:
        self.log.info("rejected", request_id=req.request_id, code=str(code), reason=message, limit=limit,
                      **(detail or {}))
        if self.tenants.known(req.tenant) and (not self.tenants.open or req.tenant in self._open_tenants):
            self._rate(req.tenant, "refused").add(self.clock())
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
        resolved = self._resolve_model(req)
        deadline = self.clock() + self.no_worker_wait_s
        while isinstance(resolved, str) and self._cold() and self.clock() < deadline:
            # Just started, or no decoder heard yet: the name may be one the decoders announce in a moment (a
            # restarted router must not refuse the model the front door names), so wait as for a decoder.
            self._worker_change.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._worker_change.wait(), timeout=max(0.05, deadline - self.clock()))
            resolved = self._resolve_model(req)
        if isinstance(resolved, str):
            await self._reject(req, msg, ErrorCode.MODEL_NOT_FOUND, resolved)
            return
        served, lora = resolved
        asked = lora or served.name
        if not self.tenants.allows_model(req.tenant, asked):
            await self._reject(req, msg, ErrorCode.MODEL_NOT_ALLOWED, f"tenant {req.tenant!r} may not use model "
                               f"{asked!r} (its models in the tenants file)")
            return
        req.model, req.lora = served.name, lora  # what dispatch, migration and a re-send read from here on
        tok = served.tok
        # Cheap checks first: a prompt whose size alone puts it over a limit is refused before any tokenizer
        # work (three 6 MB prompts once stalled this loop for 16 s), and a large one is tokenized off the loop.
        nbytes = tok.text_bytes(req)
        floor, limit = tok.min_tokens(req, nbytes), self._prompt_limit(req.tenant, served.name)
        if limit is not None and floor > limit[0]:
            await self._reject(req, msg, ErrorCode.PROMPT_TOO_LONG,
                               f"prompt has at least {floor:,} tokens ({nbytes:,} bytes); "
                               f"{limit[1]} accepts at most {limit[0]:,}")
            return
        try:
            ids = await self._tokenize(req, nbytes, tok)
        except _TokenizerBusy as exc:
            await self._reject(req, msg, ErrorCode.BUSY, str(exc), retry_after_s=0.5)
            return
        except Exception as exc:
            await self._reject(req, msg, ErrorCode.BAD_REQUEST, f"could not tokenize the prompt: {exc}")
            return
        if not ids:
            await self._reject(req, msg, ErrorCode.BAD_REQUEST, "the prompt is empty after tokenization")
            return
        decoders = await self._wait_for_decoders(served.name)
        if not decoders:
            of = "" if self.models.single else f" of model {served.name!r}"
            await self._reject(req, msg, ErrorCode.NO_WORKERS,
                               f"no live decode worker{of} within {self.no_worker_wait_s:.1f}s")
            return
        max_len = min(hb.max_model_len or 1 << 30 for hb in decoders)
        if len(ids) >= max_len:
            await self._reject(req, msg, ErrorCode.PROMPT_TOO_LONG,
                               f"prompt has {len(ids):,} tokens; the model accepts at most {max_len - 1:,} "
                               f"(max_model_len {max_len:,} includes at least one generated token)")
            return
        now = self.clock()
        queued = self.wq.pending_by_tenant().get(req.tenant, 0)
        if (refused := self._slo_refusal(req, ids, queued)) is not None:
            (late, why), slo = refused, self.tenants.slo(req.tenant)
            assert slo is not None
            await self._reject(req, msg, ErrorCode.SLO_UNATTAINABLE,
                               refusal_message(req.tenant, slo.ttft_p99_ms, slo.itl_p99_ms, late),
                               retry_after_s=late.retry_after_s, limit="slo", detail=why)
            return
        if self.use_queue:
            with self._slo_entering(req.tenant):  # ahead of the tenant's next requests until it is stored
                await self._intake_queued(req, msg, sp, ids, queued, served.pool)
            return
        refusal = self.quota.check(req.tenant, len(ids), req.sampling.max_tokens, queued, now)
        if refusal is not None:
            sp.set_attribute("quota.limit", refusal.limit or "")
            await self._reject(req, msg, _REFUSAL_CODES[refusal.code], refusal.message,
                               retry_after_s=refusal.retry_after_s, limit=refusal.limit)
            return
        await self._route(req, ids, msg, sp)
        self.quota.admit(req.tenant, req.request_id, len(ids), req.sampling.max_tokens, now)

    def _resolve_model(self, req: GenerateRequest) -> tuple[ServedModel, str | None] | str:
        """(served model, LoRA adapter or None) of a request, or why it names nothing served: ``model`` names a
        served model, else an adapter a live decoder has loaded (its base model is that decoder's); with one
        served model, also the name its decoders announce (a mock engine's, a folder's: the front door passes
        what the decoders announce). A ``lora`` the caller set itself must
        be loaded on a worker of ``model``. (The router serves only after it has heard every live worker.)"""
        now = self.clock()
        served, lora = None, req.lora
        if lora:
            served = self.models.resolve(req.model)
        elif not req.model:
            served = self.models.default
        elif (named := self.models.named(req.model)) is not None:
            served = named
        elif (base := self._adapter_base(req.model, now)) is not None:
            served, lora = self.models.served(base), req.model
        elif self.models.single and any(hb.model == req.model for hb in self.registry.live("decode", now)):
            served = self.models.default  # the one model, by the name its decoders announce (mock-..., a path)
        if served is not None and lora is not None and not self._live("decode", served.name, now, lora):
            return f"LoRA adapter {lora!r} is not loaded on any live worker of model {served.name!r}"
        if served is None:
            return (f"model {req.model!r} is not served here; served models and adapters: "
                    f"{', '.join(self.served_names(now))}")
        return served, lora

    def _cold(self) -> bool:
        """Whether this router may not have heard every live worker yet (its warm-up, or no decoder at all)."""
        now = self.clock()
        return now - self._started < REGISTRY_WARMUP_S or not self.registry.live("decode", now)

    def _adapter_base(self, name: str, now: float) -> str | None:
        """The served model a LoRA adapter of that name is loaded on (a live decoder's), or None."""
        for hb in self.registry.live("decode", now):
            if (name in hb.adapters or name in hb.adapters_available) and (model := self.models.model_of(hb)):
                return model
        return None

    def served_names(self, now: float) -> list[str]:
        """The names a request may ask for: the served models, then the adapters live decoders have loaded."""
        adapters = {a for hb in self.registry.live("decode", now) if self.models.model_of(hb)
                    for a in (*hb.adapters, *hb.adapters_available)}
        return self.models.names() + sorted(adapters - set(self.models.names()))

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
        wait = self._intake_budget.take(tenant, len(raw.data), self.clock(), rate)
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

    def _prompt_limit(self, tenant: str, model: str) -> tuple[int, str] | None:
        """The most prompt tokens a request of ``tenant`` for ``model`` may have, and whose limit that is."""
        best: tuple[int, str] | None = None
        lim = self.tenants.limits(tenant)
        if lim is not None and lim.max_prompt_tokens is not None:
            best = (lim.max_prompt_tokens, f"tenant {tenant!r} (max_prompt_tokens)")
        lens = [hb.max_model_len for hb in self._live("decode", model, self.clock()) if hb.max_model_len]
        if lens and (best is None or min(lens) - 1 < best[0]):
            best = (min(lens) - 1, "the model")
        return best

    async def _tokenize(self, req: GenerateRequest, text_bytes: int, tok: PromptTokenizer) -> list[int]:
        """Token ids of the prompt: a small one here (microseconds), a large one on the tokenizer thread, at most
        TOKENIZE_WAITING of them waiting at once (then ``busy``), so neither the event loop (heartbeats, every
        other tenant's intake and streams) nor memory is held by a few huge prompts."""
        # A conversation's template renders every message (a 100k-message list is slow with tiny contents).
        work = text_bytes + 64 * len(req.messages or ())
        if work <= INLINE_TOKENIZE_BYTES:
            return tok.token_ids(req)
        if self._tokenizing >= TOKENIZE_WAITING:
            raise _TokenizerBusy(f"{self._tokenizing} large prompts are being tokenized; retry shortly")
        self._tokenizing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, tok.token_ids, req)
        finally:
            self._tokenizing -= 1

    async def _intake_queued(self, req: GenerateRequest, msg: Msg, sp: trace.Span, ids: list[int],
                             queued: int, pool: str) -> None:
        """Reserve quota (global), register the request id (create-only: once cluster-wide), store it in the
        queue, answer Accepted; then dispatch it at once when nothing waits (:meth:`_direct_ok`). A step that fails
        undoes the ones before it, so a refused request holds nothing."""
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
        # The queue's fast path: with nothing waiting in its lanes and a decode slot free, the request is still
        # stored first (accepted means stored), then claimed and routed here at once instead of when the dispatch
        # loop pulls it (a loop wake-up and a pull's round trip off its time to first token). Held in _claiming
        # from before it is stored, so that the loop, pulling its queue message meanwhile, leaves it to this.
        direct = self._direct_ok(pool, req.model or "")
        if direct:
            self._claiming.add(req.key)
            self._direct_pending += 1
        try:
            await self._store_and_accept(req, msg, sp, ids, queued, pool, reserved, direct)
        finally:
            if direct:
                self._claiming.discard(req.key)
                self._direct_pending -= 1

    async def _store_and_accept(self, req: GenerateRequest, msg: Msg, sp: trace.Span, ids: list[int], queued: int,
                                pool: str, reserved: bool, direct: bool) -> None:
        rid, tenant = req.request_id, req.tenant
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
            await self._reattach(req, msg, ids, pool)
            return
        q = QueuedRequest(request=req, prompt_token_ids=ids, router_id=self.worker_id, record_revision=rev)
        try:
            await self.wq.enqueue(q, pool)
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
        self._rate(tenant, "accepted").add(self.clock())
        tracing.set_attrs(sp, prompt_tokens=len(ids), queued_ahead=queued, direct_dispatch=direct)
        self.log.info("queued", request_id=rid, tenant=tenant, prompt_tokens=len(ids), queued_ahead=queued,
                      direct=direct)
        await self.b.respond(msg, Accepted(request_id=rid, router_id=self.worker_id, prompt_tokens=len(ids)))
        dispatched = False
        if direct:
            try:
                dispatched = await self._dispatch_direct(q, rec, rev)
            except Exception as exc:  # stored all the same: the loop pulls it, and claims or recovers it
                self.log.warning("direct_dispatch_failed", request_id=rid, error=str(exc))
        if not dispatched:
            self._dispatch_wake.set()

    async def _unreserve(self, tenant: str, rid: str, reserved: bool) -> None:
        if reserved:
            with contextlib.suppress(Exception):  # else the reconciliation sweep releases it
                await self.shared_quota.finish(tenant, rid, None)

    async def _reattach(self, req: GenerateRequest, msg: Msg, ids: list[int], pool: str) -> None:
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
                                                    accepted_ms=rec.accepted_ms, record_revision=rev), pool)
            except Exception as exc:
                await self._reject(req, msg, ErrorCode.BUSY, f"the request queue did not take the re-sent request: "
                                   f"{exc}", retry_after_s=1.0)
                return
        self.log.info("duplicate_request_reattached", request_id=rid, tenant=req.tenant, state=rec.state,
                      owner=rec.owner)
        await self.b.respond(msg, Accepted(request_id=rid, router_id=self.worker_id, prompt_tokens=len(ids)))
