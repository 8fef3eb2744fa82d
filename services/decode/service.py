"""Decode worker service.

Inputs: DecodeJob (direct path: prefill locally), KvReserveRequest (lease landing blocks for a
prefiller's push), PrefillDone (the KV landed: continue from it). One engine loop admits new sequences
between batched decode steps and streams every token to the request's stream subject in order
(``seq`` 0, 1, ...), then one StreamFinal, or one StreamError. A RequestFinished event closes the
router's in-flight record.

Migration: a DecodeJob may continue a request whose previous decoder died (``resume_token_ids``,
``start_seq``): the KV covers prompt + those tokens, they count as output already sent, and the stream goes
on at ``start_seq``. A RevokeJob from the router drops an attempt silently (the request moved elsewhere).
KV that fails to land is not an error for the caller: the decoder prefills the request locally instead.
On SIGTERM the decoder takes no new work (heartbeats say ``draining``), finishes its streams within the
drain bound, and hands the rest over (they stop here without a terminal message; the router migrates them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
from nats.aio.msg import Msg
from opentelemetry import trace

from splitserve.cache.events import KvEvent
from splitserve.cache.store import PrefixKvStore
from splitserve.engines import KvSource, PrefillResult, PromptTooLong, Sampling, TokenLogprobs, UnknownAdapter
from splitserve.engines.detok import IncrementalDetokenizer, StopChecker
from splitserve.kv import BlockPool, make_receiver
from splitserve.kv.transport import usable_transport
from splitserve.obs import tracing
from splitserve.proto import (
    CancelRequest,
    DecodeJob,
    ErrorCode,
    KvReserveReply,
    KvReserveRequest,
    PrefillDone,
    RequestFinished,
    RevokeJob,
    RevokeReply,
    StageCost,
    StreamDelta,
    StreamError,
    StreamFinal,
    Subjects,
    Timings,
    TokenLogprob,
    Usage,
    WorkerLoad,
    now_ms,
)
from splitserve.proto.admin import LoraAdminRequest
from splitserve.routing.load import decoder_load
from splitserve.runtime.service import Service
from splitserve.services.common.adapters import AdapterBusy, AdapterSlots, on_lora_admin
from splitserve.services.common.engine_thread import EngineThread
from splitserve.services.common.handoff import Handoffs
from splitserve.services.common.kvcache import KvEventPublisher, kv_layout
from splitserve.services.common.options import EngineOptions
from splitserve.services.common.sampling import engine_sampling, wire_logprob

# hand_over waits this long for the engine loop to finish the step it is in before cancelling it.
HAND_OVER_STEP_S = 2.0
# A reservation whose KV landed this long ago with no hand-off (the prefiller sends it at once, and again while
# unanswered: handoff.TRIES x ACK_TIMEOUT_S = 8 s) never gets one: it is dropped and no longer listed, so the
# routers move the request (their orphan check) instead of it waiting out the 300 s lease.
HANDOFF_GRACE_S = 20.0


@dataclass
class Reservation:
    transfer_id: str
    key: str  # proto.request_key(tenant, id) of the request it is for
    block_ids: list[int]
    num_tokens: int
    expires: float
    landed: float | None = None  # when its KV had all landed (the prefiller's hand-off follows at once)


@dataclass
class Admission:
    job: DecodeJob
    kv: torch.Tensor | KvSource | None = None  # landed KV (disaggregated) or None (prefill locally)
    blocks: list[int] | None = None  # landing blocks holding kv, freed once the engine has copied it
    first_token: int | None = None
    cached_tokens: int = 0
    prefill_ms: float | None = None
    transfer_ms: float | None = None
    compute_ms: float | None = None  # its share of the prefiller's compute (None: prefill_ms)
    headers: dict[str, str] | None = None
    started_ms: float | None = None  # when the first worker started the job
    kv_bytes: int | None = None  # KV bytes pushed by the prefiller
    first_logprob: TokenLogprob | None = None  # the prefiller's, when the request asked for logprobs


def _seconds(x: float) -> float:
    return x if math.isfinite(x) and x > 0 else 0.0


@dataclass
class Sequence:
    job: DecodeJob
    detok: IncrementalDetokenizer
    stop: StopChecker
    generated: list[int] = field(default_factory=list)
    text: str = ""
    seq_no: int = 0
    cached_tokens: int = 0
    kv_bytes: int | None = None
    timings: Timings = field(default_factory=Timings)
    started: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)  # perf_counter per emitted token (ITL summary)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per generated token, when asked for
    cost: StageCost = field(default_factory=StageCost)  # the worker-seconds it caused (chargeback)
    # Generated but not yet published (``--stream-interval`` above 1): sent together as one delta. The caller
    # and the routers have seen exactly the tokens published, so a sequence handed over with some unsent is
    # resumed from the last published token (the next decoder makes those tokens again).
    unsent_ids: list[int] = field(default_factory=list)
    unsent_text: str = ""
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)


class DecodeService(Service):
    role = "decode"

    def __init__(
        self,
        worker_id: str,
        nats_url: str,
        *,
        opts: EngineOptions,
        landing_tokens: int = 16384,
        max_batch: int = 16,
        # A reservation is taken before the prefill computes (so layers can be pushed as they finish); the
        # lease must outlast the slowest prefill of a max-length prompt, or a late push could land in blocks
        # already leased to someone else.
        lease_s: float = 300.0,
        handoff_grace_s: float = HANDOFF_GRACE_S,
        cache_tokens: int = 8192,
        l1_tokens: int = 0,
        prefill_chunk: int = 256,
        max_retire_copy_tokens: int = 1024,
        pool: str = "general",
        stream_interval: int = 1,
        **kw: Any,
    ) -> None:
        super().__init__(worker_id, nats_url, **kw)
        self.opts = opts
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        # Tokens per stream delta, as vLLM's --stream-interval: 1 sends each token at once; N sends the first at
        # once, then N at a time (the last ones with the final), for 1/N of the per-token messages and work here,
        # in NATS, the routers and the front doors.
        self.stream_interval = stream_interval
        self.pool_name = pool  # context pool: "long" decoders take the long prompts
        self.prefill_chunk = prefill_chunk
        self.max_retire_copy_tokens = max_retire_copy_tokens
        self.step_ms: float | None = None  # EWMA of decode step time
        # Seconds computing, per stage, since start: what its requests' StageCost sum to (heartbeat busy_s)
        self.busy_s = {"prefill": 0.0, "decode": 0.0}
        self._prefill_compute_s = 0.0  # the last local prefill's compute (its chunks' steps excluded)
        self.prefill_tps: float | None = None  # EMA of local prefill speed, reported in heartbeats
        self.cache_tokens = cache_tokens
        self.l1_tokens = l1_tokens
        self.store: PrefixKvStore | None = None
        self.kv_events: KvEventPublisher | None = None
        self.landing_tokens = landing_tokens
        self.max_batch = max_batch
        self.lease_s = lease_s
        self.handoff_grace_s = handoff_grace_s
        self.pending: deque[Admission] = deque()
        self.active: dict[str, Sequence] = {}
        self.reservations: dict[str, Reservation] = {}
        self.handoffs = Handoffs()  # PrefillDone: answered at once, each transfer taken once
        # Recently cancelled requests (``proto.request_key``: a cancel names its tenant's request only),
        # insertion-ordered, bounded.
        self.cancelled: dict[str, None] = {}
        # Requests are keyed by ``proto.request_key(tenant, id)`` everywhere here (maps, the engine's sequence ids,
        # heartbeats): a request id is unique only within its tenant.
        self.revoked: dict[str, int] = {}  # request key -> highest attempt revoked here (bounded, insertion-ordered)
        # Sequences whose last token or final message is being sent: a forced revoke (priority preemption) then
        # keeps them, since the router would otherwise move a request that is ending here (two finals).
        self.ending: set[str] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self.admitting: str | None = None  # the request being admitted (prefilled) now: held, though in no list
        self._admitting_prefill = 0  # its tokens still to compute here (0: its KV came from a prefiller)
        self._wake = asyncio.Event()
        self._stopping = False  # hand_over: the engine loop ends after the step it is in
        self.thread = EngineThread(f"decode-{worker_id}")
        # One decode.stream span per admitted sequence, open until it finishes or fails: decode jobs arrive
        # as NATS messages, so the trace context is kept per sequence, not in a task's context.
        self.stream_spans: dict[str, trace.Span] = {}

    # --- lifecycle ------------------------------------------------------------------------------------
    async def setup(self) -> None:
        self.engine = await self.thread.run(self.opts.load)
        self.thread.inline = not self.engine.blocking  # a zero-cost engine: no thread hand-offs (engine_thread)
        self.log.info("engine_loaded", model=self.engine.info.name,
                      engine_calls="inline" if self.thread.inline else "thread")
        self.adapters = AdapterSlots(self.opts.lora_modules, self.opts.max_loras, self.thread.run)
        self.adapters.started(self.engine.loras())
        info = self.engine.info
        self.layout = kv_layout(info, self.opts.block_size)
        self.pool = BlockPool(self.layout, self.layout.blocks_for_tokens(self.landing_tokens))
        transport, why = usable_transport(self.opts.transport)
        if why is not None:
            self.log.warning("kv_transport_fallback", transport=transport, reason=why)
            self.opts = dataclasses.replace(self.opts, transport=transport)
        self.receiver = await asyncio.to_thread(make_receiver, self.opts.transport, self.pool)
        self.kv_events = KvEventPublisher.for_worker(self.b, self.worker_id, info, self.thread,
                                                     block_size=self.opts.block_size, cache_tokens=self.cache_tokens,
                                                     l1_tokens=self.l1_tokens)
        self.store = self.kv_events.store if self.kv_events is not None else None

    async def start(self) -> None:
        b = self.b
        await b.subscribe(Subjects.decode_job(self.worker_id), DecodeJob, self.on_job)
        await b.subscribe(Subjects.kv_reserve(self.worker_id), KvReserveRequest, self.on_reserve)
        await b.subscribe(Subjects.kv_ready(self.worker_id), PrefillDone, self.on_kv_ready, concurrent=True)
        await b.subscribe(Subjects.CANCEL_ALL, CancelRequest, self.on_cancel, scoped=True)
        await b.subscribe(Subjects.ADMIN_LORA, LoraAdminRequest, self.on_lora_admin)
        await b.subscribe(Subjects.revoke(self.worker_id), RevokeJob, self.on_revoke)
        if self.kv_events is not None:
            await self.kv_events.start()
        self._loop_task = b.spawn(self._engine_loop())
        b.spawn(self._lease_sweeper())

    async def drain(self) -> None:
        # Jobs routed before the routers saw "draining" still arrive and are served like the rest.
        while self.active or self.pending or self.reservations or self.admitting:
            await asyncio.sleep(0.05)

    async def hand_over(self) -> None:
        # Stop the engine loop first: no delta may follow the "stopped" heartbeat the routers migrate on (NATS
        # keeps one connection's messages in order, so the router has seen every token the caller has). It
        # stops between steps: cancelled inside one, a request could publish its last delta and not its final,
        # and the decoder it moves to would be asked to go on past max_tokens. A step that takes longer than
        # the bound (a long local prefill) is cancelled.
        if self._loop_task is not None:
            self._stopping = True
            self._wake.set()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(self._loop_task), HAND_OVER_STEP_S)
            self._loop_task.cancel()
            with contextlib.suppress(BaseException):
                await self._loop_task
        ids = self.active_requests()
        for rid in list(self.active):
            sp = self.stream_spans.pop(rid, None)
            if sp is not None:
                sp.set_attribute("handed_over", True)
                sp.end()
        self.log.info("handed_over", requests=ids)
        self.active.clear()
        for adm in list(self.pending):
            self._release(adm)
        self.pending.clear()
        for res in self.reservations.values():
            self.pool.free(res.block_ids)
        self.reservations.clear()

    async def shutdown(self) -> None:
        # Anything still held was handed over at the end of the drain (the routers migrate it).
        self.receiver.close()
        self.thread.close()

    def load(self) -> WorkerLoad:
        reserved = sum(len(r.block_ids) for r in self.reservations.values())
        # The request being admitted is a stream already (as the simulator's decoder counts its prefilling
        # sequences): heartbeats list it, so the routers stop counting it as their own pending load, and
        # leaving it out here made a stream in its local prefill invisible to the stall rule.
        admitting = self.admitting is not None and self.admitting not in self.active
        return decoder_load(
            decoding=len(self.active), prefilling=int(admitting), waiting=len(self.pending),
            prefill_tokens_left=self._admitting_prefill if admitting else 0,
            waiting_prefill_tokens=sum(len(a.job.context_token_ids()) for a in self.pending if a.kv is None),
            max_seqs=self.max_batch,
            free_blocks=self.pool.num_free if hasattr(self, "pool") else 0,
            total_blocks=self.pool.num_blocks if hasattr(self, "pool") else 0,
            reserved_blocks=reserved,
            used_blocks=sum(len(s.job.prompt_token_ids) + len(s.generated) for s in self.active.values())
            // max(1, self.opts.block_size),
            cached_blocks=sum(self.store.stats().blocks.values()) if self.store is not None else 0,
            prefill_tokens_per_s=self.prefill_tps, step_ms=self.step_ms,
            busy_s={k: round(v, 6) for k, v in self.busy_s.items()},
        )

    def active_requests(self) -> list[str]:
        return [*self.active, *(a.job.key for a in self.pending), *([self.admitting] if self.admitting else []),
                *(r.key for r in self.reservations.values())]

    @property
    def model_name(self) -> str:
        """The name this worker serves its model under (``--served-model-name``, else the engine's): what its
        heartbeats announce, and what routers match a request's model against."""
        return self.opts.model_name(self.engine.info.name)

    def heartbeat_extra(self) -> dict[str, Any]:
        if not hasattr(self, "engine"):
            return {"engine": self.opts.engine, "transport": self.opts.transport, "pool": self.pool_name}
        return {"engine": self.opts.engine, "model": self.model_name,
                "max_model_len": self.engine.info.max_model_len, "transport": self.opts.transport,
                "block_size": self.opts.block_size, "pool": self.pool_name, "adapters": self.adapters.loaded(),
                "adapters_available": self.adapters.available()}

    # --- inputs ---------------------------------------------------------------------------------------
    def _is_revoked(self, job: DecodeJob) -> bool:
        return job.attempt <= self.revoked.get(job.key, -1)

    async def on_revoke(self, r: RevokeJob, msg: Msg) -> None:
        """The router moves the request elsewhere: drop this attempt (and older ones) without a word to the
        caller. A sequence already decoding is kept unless forced: the router then leaves it here."""
        rid, key = r.request_id, r.key
        seq = self.active.get(key)
        landed = [a for a in self.pending if a.job.key == key and a.kv is not None]
        if (not r.force and ((seq is not None and seq.job.attempt >= r.attempt) or landed or key == self.admitting)
                or (r.force and key in self.ending)):
            await self.b.respond(msg, RevokeReply(request_id=rid, revoked=False, running=True))
            return
        self.revoked[key] = max(r.attempt, self.revoked.get(key, -1))
        while len(self.revoked) > 4096:
            self.revoked.pop(next(iter(self.revoked)))
        if seq is not None and seq.job.attempt <= r.attempt:
            self.active.pop(key, None)
            with contextlib.suppress(Exception):
                await self.thread.run(self._retire, key, [], False)
            sp = self.stream_spans.pop(key, None)
            if sp is not None:
                sp.set_attribute("revoked", True)
                sp.end()
        for adm in [a for a in self.pending if a.job.key == key and a.job.attempt <= r.attempt]:
            self.pending.remove(adm)
            self._release(adm)
        for tid, res in list(self.reservations.items()):
            if res.key == key:
                # Its prefiller is gone (or the router gave up on it): no push is coming any more.
                self.reservations.pop(tid, None)
                self.pool.free(res.block_ids)
        self.log.info("revoked", request_id=rid, attempt=r.attempt, force=r.force, reason=r.reason)
        await self.b.respond(msg, RevokeReply(request_id=rid, revoked=True))

    async def on_job(self, job: DecodeJob, msg: Msg) -> None:
        if self._is_revoked(job):
            return
        self.pending.append(Admission(job=job, headers=dict(msg.headers or {})))
        self._wake.set()

    async def on_reserve(self, req: KvReserveRequest, msg: Msg) -> None:
        if req.transport != self.opts.transport:
            await self.b.respond(msg, KvReserveReply(
                request_id=req.request_id, ok=False,
                error=f"decoder {self.worker_id} receives KV over {self.opts.transport!r}, not {req.transport!r}"))
            return
        need = self.layout.blocks_for_tokens(req.num_tokens)
        if need > self.pool.num_blocks:
            await self.b.respond(msg, KvReserveReply(
                request_id=req.request_id, ok=False, capacity_tokens=self.pool.num_blocks * self.opts.block_size,
                error=f"{req.num_tokens} tokens need {need} blocks; decoder {self.worker_id} has only "
                      f"{self.pool.num_blocks} landing blocks in total"))
            return
        blocks = self.pool.try_allocate(need)
        if blocks is None:
            # Full: the prefiller waits and retries; the request is never dropped for it.
            await self.b.respond(msg, KvReserveReply(request_id=req.request_id, ok=False, retry_after_ms=50.0))
            return
        tid = uuid.uuid4().hex
        res = self.reservations[tid] = Reservation(tid, req.key, blocks, req.num_tokens,
                                                   time.monotonic() + self.lease_s)
        self.b.spawn(self._watch_landing(res))
        desc = self.receiver.descriptor(blocks)
        await self.b.respond(msg, KvReserveReply(request_id=req.request_id, ok=True, transfer_id=tid,
                                                 block_ids=blocks, descriptor=desc,
                                                 lease_ms=self.lease_s * 1000))

    async def on_lora_admin(self, req: LoraAdminRequest, msg: Msg) -> None:
        await on_lora_admin(self, req, msg)

    async def on_cancel(self, c: CancelRequest, _: Msg) -> None:
        key = c.key
        self.cancelled[key] = None  # remembered: its KV may still be on its way
        while len(self.cancelled) > 4096:
            self.cancelled.pop(next(iter(self.cancelled)))
        seq = self.active.get(key)
        if seq is not None:
            await self._finish(seq, "cancelled")
            return
        for adm in list(self.pending):
            if adm.job.key == key:
                self.pending.remove(adm)
                self._release(adm)
                await self._finish_unstarted(adm.job, "cancelled")
                return

    async def _finish_unstarted(self, job: DecodeJob, reason: str) -> None:
        """Final message for a request cancelled or expired before it produced a token."""
        usage = Usage(prompt_tokens=len(job.prompt_token_ids), completion_tokens=len(job.resume_token_ids))
        await self.b.publish(job.stream_subject, StreamFinal(
            request_id=job.request_id, seq=job.start_seq, token_ids=job.resume_token_ids, text=job.resume_text,
            finish_reason=reason,  # type: ignore[arg-type]
            usage=usage, route=job.route, prefill_worker=job.prefill_worker, decode_worker=self.worker_id,
            decision=job.decision, model=self.model_name))
        await self.b.publish(Subjects.finished(job.tenant, job.request_id), RequestFinished(
            request_id=job.request_id, tenant=job.tenant, worker_id=self.worker_id,
            status=reason,  # type: ignore[arg-type]
            usage=usage, route=job.route, model=self.model_name, lora=job.lora))

    async def on_kv_ready(self, done: PrefillDone, msg: Msg) -> None:
        if not await self.handoffs.take(self.b, done, msg):
            return  # a repeat of a hand-off taken already (the prefiller did not hear the answer)
        res = self.reservations.pop(done.kv.transfer_id, None)
        if self._is_revoked(done.decode):
            if res is not None:
                with contextlib.suppress(Exception):
                    await self.receiver.wait(res.transfer_id, timeout=10.0)
                self.pool.free(res.block_ids)
            return
        if res is not None and done.decode.key in self.cancelled:
            # Cancelled while prefilling: the push is complete, so its landing blocks can be reused safely.
            with contextlib.suppress(Exception):
                await self.receiver.wait(res.transfer_id, timeout=10.0)
            self.pool.free(res.block_ids)
            await self._finish_unstarted(done.decode, "cancelled")
            return
        if res is None:
            # The KV cannot be trusted (lease expired, maybe reused): the job itself is intact, so prefill here.
            self.log.warning("kv_unusable_prefilling_locally", request_id=done.request_id,
                             reason=f"KV reservation {done.kv.transfer_id} is unknown or expired "
                                    f"(lease {self.lease_s:.0f}s)")
            self.pending.append(Admission(job=done.decode, headers=dict(msg.headers or {})))
            self._wake.set()
            return
        try:
            await self.receiver.wait(res.transfer_id, timeout=10.0)
            # The engine copies the KV straight from the landing blocks into its batch, layer by layer, when
            # it admits the sequence (one copy); the blocks are held until then.
            kv = self.pool.source(res.block_ids, done.kv.num_tokens)
        except Exception as exc:
            self.pool.free(res.block_ids)
            self.log.warning("kv_unusable_prefilling_locally", request_id=done.request_id,
                             reason=f"KV did not land: {exc}")
            self.pending.append(Admission(job=done.decode, headers=dict(msg.headers or {})))
            self._wake.set()
            return
        self.pending.append(Admission(job=done.decode, kv=kv, blocks=list(res.block_ids),
                                      first_token=done.first_token,
                                      cached_tokens=done.kv.cached_tokens, prefill_ms=done.kv.prefill_ms,
                                      compute_ms=done.kv.compute_ms,
                                      transfer_ms=done.kv.transfer_ms, headers=dict(msg.headers or {}),
                                      started_ms=done.kv.started_ms, kv_bytes=done.kv.kv_bytes,
                                      first_logprob=done.first_logprob))
        self._wake.set()

    async def _watch_landing(self, res: Reservation) -> None:
        with contextlib.suppress(Exception):  # not landed within the lease: the sweeper's business
            await self.receiver.wait(res.transfer_id, timeout=self.lease_s)
            res.landed = time.monotonic()

    async def _lease_sweeper(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for tid, res in list(self.reservations.items()):
                if res.expires < now:
                    self.reservations.pop(tid, None)
                    self.pool.free(res.block_ids)
                    self.log.warning("reservation_expired", request=res.key, transfer_id=tid)
                elif res.landed is not None and now - res.landed > self.handoff_grace_s:
                    # The hand-off never came (lost every time, or its prefiller died right after the push).
                    # A late one still finds no reservation and prefills here (on_kv_ready): nothing is lost.
                    self.reservations.pop(tid, None)
                    self.pool.free(res.block_ids)
                    self.log.warning("handoff_missing", request=res.key, transfer_id=tid,
                                     landed_s_ago=round(now - res.landed, 1))

    # --- the engine loop ------------------------------------------------------------------------------
    async def _engine_loop(self) -> None:
        while not self._stopping:
            try:
                if self.pending and len(self.active) < self.max_batch and (adm := self._next_admissible()):
                    await self._admit(adm)
                    continue
                if self.active:
                    await self._step()
                    continue
                self._wake.clear()
                await self._wake.wait()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # engine failure: fail what it held, keep serving
                self.log.exception("engine_loop_error", error=str(exc))
                for seq in list(self.active.values()):
                    with contextlib.suppress(Exception):  # the engine may be what is broken
                        await self._drop(seq.job.key)
                    await self._error(seq.job, ErrorCode.INTERNAL, f"decode engine failed: {exc}")

    def _next_admissible(self) -> Admission | None:
        """The first pending job whose LoRA adapter can be made ready without waiting (loaded, a free slot, or one
        to evict that no running sequence holds): the others stay pending while the batch steps on, which is
        what frees their slots (admitting one that has to wait would stall every stream; --max-loras)."""
        held = {seq.job.lora for seq in self.active.values() if seq.job.lora is not None}
        order: Iterable[int] = range(len(self.pending))
        if any(a.job.priority_class for a in self.pending):
            # Contract priority classes: the most urgent class first, first come first within a class (a slot a
            # preemption freed goes to the request that preempted, not to a less urgent job queued before it).
            order = sorted(order, key=lambda i: self.pending[i].job.priority_class)
        for i in order:
            adm = self.pending[i]
            if self.adapters.can_admit(adm.job.lora, held):
                del self.pending[i]
                return adm
        return None

    def _release(self, adm: Admission) -> None:
        if adm.blocks is not None:
            self.pool.free(adm.blocks)
            adm.blocks, adm.kv = None, None

    async def _admit(self, adm: Admission) -> None:
        self.admitting = adm.job.key
        self._admitting_prefill = len(adm.job.context_token_ids()) if adm.kv is None else 0
        try:
            await self._admit_one(adm)
        finally:
            self.admitting = None
            self._admitting_prefill = 0
            self._release(adm)

    async def _admit_one(self, adm: Admission) -> None:
        job = adm.job
        started_ms = adm.started_ms or now_ms()
        if self._is_revoked(job):
            return
        if job.key in self.active:
            # A duplicate (or a stray job for a running request): the engine holds one sequence per id, and
            # adding it again would fail the whole batch.
            self.log.warning("duplicate_job_ignored", request_id=job.request_id, attempt=job.attempt)
            return
        if job.key in self.cancelled:
            await self._finish_unstarted(job, "cancelled")
            return
        if job.deadline_ms is not None and now_ms() > job.deadline_ms:
            await self._finish_unstarted(job, "expired")
            return
        try:
            await self.adapters.ensure(self.engine, job.lora)  # (loaded on first use: --max-loras)
        except UnknownAdapter as exc:
            await self._error(job, ErrorCode.MODEL_NOT_FOUND, str(exc))
            return
        except AdapterBusy as exc:
            await self._error(job, ErrorCode.BUSY, str(exc))
            return
        sampling = engine_sampling(job.sampling, len(job.prompt_token_ids), self.engine.info.eos_token_ids)
        kv, first, prefill_ms = adm.kv, adm.first_token, adm.prefill_ms
        local_compute_s = 0.0
        first_lp = adm.first_logprob
        context = job.context_token_ids()
        with tracing.span_from(adm.headers, "decode.admit", request_id=job.request_id, tenant=job.tenant,
                               route=str(job.route), prompt_tokens=len(job.prompt_token_ids),
                               attempt=job.attempt, resumed_tokens=len(job.resume_token_ids),
                               queue_wait_ms=round(max(0.0, now_ms() - (adm.started_ms or job.routed_ms)), 2),
                               prefill_worker=job.prefill_worker) as asp, \
                structlog.contextvars.bound_contextvars(request_id=job.request_id, tenant=job.tenant):
            if kv is None:
                t0 = time.perf_counter()
                try:
                    # the sequence joins the batch in the prefill's own engine call (added below otherwise)
                    res = await self._local_prefill(context, sampling, job.cache_salt, job.lora, add_key=job.key)
                except PromptTooLong as exc:
                    await self._error(job, ErrorCode.PROMPT_TOO_LONG, str(exc))
                    return
                prefill_ms = (time.perf_counter() - t0) * 1000
                local_compute_s = self._prefill_compute_s
                kv, first = res.kv, res.first_token
                first_lp = self._wire_lp(res.first_logprobs)
                adm.cached_tokens = max(0, len(job.prompt_token_ids) - res.num_computed_tokens)
            assert first is not None
            if adm.kv is not None:  # its KV came from a prefiller
                await self.thread.run(self.engine.add_sequence, job.key, kv, first, sampling, lora=job.lora)
            tracing.set_attrs(asp, cached_tokens=adm.cached_tokens,
                              prefill_ms=None if prefill_ms is None else round(prefill_ms, 2),
                              local_prefill=adm.kv is None, transfer_ms=adm.transfer_ms,
                              first_token_ms=round(now_ms() - job.created_ms, 2))
            self.stream_spans[job.key] = tracing.tracer().start_span(
                "decode.stream", context=tracing.extract(adm.headers),
                attributes={"request_id": job.request_id, "tenant": job.tenant, "route": str(job.route),
                            **self._gen_ai(job)})
        # a resumed job's tokens so far count towards min_tokens
        stop = StopChecker(job.sampling.stop, () if job.sampling.ignore_eos else self.engine.info.eos_token_ids,
                           self._max_new(job), min_tokens=max(0, job.sampling.min_tokens - len(job.resume_token_ids)))
        if job.resume_token_ids:
            stop.pending = self._withheld_text(job)
        seq = Sequence(
            job=job,
            detok=IncrementalDetokenizer(self.engine, context),
            stop=stop,
            generated=list(job.resume_token_ids),
            text=job.resume_text,
            seq_no=job.start_seq,
            cached_tokens=adm.cached_tokens,
            kv_bytes=adm.kv_bytes,
            timings=Timings(queue_ms=job.routed_ms - job.created_ms, dispatch_ms=started_ms - job.created_ms,
                            prefill_ms=prefill_ms,
                            transfer_ms=adm.transfer_ms),
        )
        seq.cost = self._admission_cost(adm, local_compute_s if adm.kv is None else None)
        if self._is_revoked(job):  # revoked while it prefilled: it runs elsewhere now
            await self.thread.run(self._retire, job.key, [], False)
            self.stream_spans.pop(job.key, trace.INVALID_SPAN).end()
            return
        self.active[job.key] = seq
        ended = stop.resumed_end(job.resume_token_ids[-1]) if job.resume_token_ids else None
        if ended is not None:
            # the previous decoder published the token that ended the output and died before its final
            # message: end it as that decoder would have, with no token more
            seq.text += ended.text
            if job.stream and ended.text:
                await self.b.publish(job.stream_subject, StreamDelta(request_id=job.request_id, seq=seq.seq_no,
                                                                     token_ids=[], text=ended.text))
                seq.seq_no += 1
            await self._finish(seq, "stop")
            return
        await self._emit(seq, first, first_lp)

    def _admission_cost(self, adm: Admission, local_compute_s: float | None) -> StageCost:
        """What a request's prefill and KV transfer cost (its decode steps are added as they run). The cached
        tokens are valued at the rate its own prefill ran (else this worker's measured rate)."""
        if local_compute_s is not None:
            prefill_s, transfer_s = local_compute_s, 0.0
        else:  # the prefiller's compute and the push left after it, as its PrefillDone reported them
            compute_ms = adm.compute_ms if adm.compute_ms is not None else adm.prefill_ms
            prefill_s, transfer_s = (compute_ms or 0.0) / 1000, (adm.transfer_ms or 0.0) / 1000
        # A prefiller's figures are another process's word: anything not a finite, non-negative time counts 0
        prefill_s, transfer_s = _seconds(prefill_s), _seconds(transfer_s)
        cached = max(0, adm.cached_tokens)
        computed = len(adm.job.context_token_ids()) - cached
        rate = computed / prefill_s if computed >= 64 and prefill_s > 0 else self.prefill_tps
        saved = _seconds(cached / rate) if rate else 0.0
        return StageCost(prefill_s=prefill_s, transfer_s=transfer_s, cached_tokens=cached, saved_s=saved)

    async def _local_prefill(self, ids: list[int], sampling: Sampling, cache_salt: str | None = None,
                             lora: str | None = None, add_key: str | None = None) -> PrefillResult:
        """Prefill on this decoder, reusing the longest cached prefix. While other streams are active, a
        long prompt is computed in chunks with one decode step between chunks, so no stream waits more
        than one chunk (the router's stall rule sends prompts that would stall too long to a prefiller).
        ``cache_salt`` (the job's, from the router) scopes the prefix lookup to the request's tenant / group.
        ``add_key``: the last chunk's engine call also adds the sequence to the batch under that key.

        The prefix lookup, the first chunk and the add run in one engine-thread call when they can: each hop
        to the engine thread costs a few hundred microseconds of CPU on a busy machine (two thread wake-ups and
        the GIL's hand-overs), which was most of what a short request cost a decoder."""
        past, cached = None, 0
        pos, compute_s, chunks = 0, 0.0, 0
        while True:
            self._admitting_prefill = len(ids) - pos  # what load() reports: a cached prefix costs nothing
            chunk = self.prefill_chunk if self.active and self.prefill_chunk > 0 else 0
            res, end, step_s, matched = await self.thread.run(
                self._prefill_chunk, ids, pos, chunk, sampling, past, lora, add_key, cache_salt, chunks == 0)
            if matched is not None:
                cached = matched
            compute_s += step_s
            chunks += 1
            if end >= len(ids):
                break
            past, pos = res.kv, end
            await self._step()
        self._admitting_prefill = 0
        self._prefill_compute_s = compute_s
        self.busy_s["prefill"] += compute_s
        computed = len(ids) - cached
        self.log.info("local_prefill", tokens=len(ids), cached_tokens=cached, chunks=chunks,
                      compute_ms=round(compute_s * 1000, 1), streams=len(self.active))
        if computed >= 64 and compute_s > 0:  # tiny prompts say more about overhead than speed
            rate = computed / compute_s
            self.prefill_tps = rate if self.prefill_tps is None else 0.7 * self.prefill_tps + 0.3 * rate
        return PrefillResult(first_token=res.first_token, kv=res.kv, num_computed_tokens=computed,
                             first_logprobs=res.first_logprobs)

    def _prefill_chunk(self, ids: list[int], pos: int, chunk: int, sampling: Sampling, past: torch.Tensor | None,
                       lora: str | None, add_key: str | None, cache_salt: str | None,
                       match: bool) -> tuple[PrefillResult, int, float, int | None]:
        """Engine thread: one chunk of a local prefill from ``pos`` (``chunk`` tokens at most; 0: to the end),
        first looking up the cached prefix when ``match`` (then ``pos`` starts past it), and adding the sequence
        under ``add_key`` when this chunk ends the prompt. Returns the prefill's result, where the chunk ended,
        its compute seconds and the cached prefix's length when it was looked up."""
        matched: int | None = None
        if match and self.store is not None:
            m = self.store.match(ids, cache_salt=cache_salt)
            matched = m.num_tokens
            if m.num_tokens:
                past, pos = m.kv, m.num_tokens
                # what load() reports from now on (heartbeats read it meanwhile): the cached prefix costs nothing
                # (reported whole, it made this decoder look a whole prompt busier to the next request's router)
                self._admitting_prefill = len(ids) - pos
        end = min(len(ids), pos + chunk) if chunk else len(ids)
        t0 = time.perf_counter()
        res = self.engine.prefill(ids[:end], sampling, past_kv=past, lora=lora)
        compute_s = time.perf_counter() - t0
        if add_key is not None and end >= len(ids):
            self.engine.add_sequence(add_key, res.kv, res.first_token, sampling, lora=lora)
        return res, end, compute_s, matched

    def _retire(self, key: str, tokens: list[int], keep: bool, cache_salt: str | None = None) -> None:
        """Engine thread: drop a sequence, keeping its KV as reusable prefix blocks when it ended well, keyed
        by its job's cache salt (so only its own tenant / cache group can hit them)."""
        kv = self.engine.remove_sequence(key, keep_kv=keep and self.store is not None)
        if kv is not None and self.store is not None:
            self.store.insert(tokens[: kv.shape[3]], kv, cache_salt=cache_salt)

    def _retire_and_drain(self, key: str, tokens: list[int], keep: bool, cache_salt: str | None) -> list[KvEvent]:
        """Engine thread: :meth:`_retire`, then the prefix cache's pending KV events (none without a cache)."""
        self._retire(key, tokens, keep, cache_salt)
        return self.store.drain_events() if self.store is not None else []

    def _max_new(self, job: DecodeJob) -> int:
        # Cap at the model's context: one sequence at the limit would stop the whole batch (ContextFull). A
        # resumed job has already produced resume_token_ids of its max_tokens.
        left = job.sampling.max_tokens - len(job.resume_token_ids)
        return max(1, min(left, self.engine.room_for(len(job.context_token_ids()))))

    def _withheld_text(self, job: DecodeJob) -> str:
        """Text of the resumed tokens the caller has not seen: the previous decoder withheld it as a possible
        start of a stop string. Decoded as the detokenizer would have (a few prompt tokens of left context);
        empty when it cannot be told apart reliably (a character still incomplete)."""
        from splitserve.engines.detok import CONTEXT_TOKENS, REPLACEMENT_CHAR

        if not job.sampling.stop:
            return ""
        left = job.prompt_token_ids[-CONTEXT_TOKENS:]
        full = self.engine.decode([*left, *job.resume_token_ids])[len(self.engine.decode(left)):]
        if full.endswith(REPLACEMENT_CHAR) or not full.startswith(job.resume_text):
            return ""
        return full[len(job.resume_text):]

    async def _step(self) -> None:
        t0 = time.perf_counter()
        out = await self.thread.run(self.engine.step)
        lps = dict(self.engine.step_logprobs())
        ms = (time.perf_counter() - t0) * 1000
        self.step_ms = ms if self.step_ms is None else 0.8 * self.step_ms + 0.2 * ms
        if out:  # the step's time is shared by the sequences it advanced (chargeback: StageCost.decode_s)
            self.busy_s["decode"] += ms / 1000
            share = ms / 1000 / len(out)
            for key in out:
                if (charged := self.active.get(key)) is not None:
                    charged.cost.decode_s += share
        for key, tok in out.items():
            seq = self.active.get(key)
            if seq is not None:
                await self._emit(seq, tok, self._wire_lp(lps.get(key)))

    def _gen_ai(self, job: DecodeJob) -> dict[str, Any]:
        p = job.sampling
        return tracing.gen_ai_request(chat=False, model=self.model_name, max_tokens=p.max_tokens,
                                      temperature=p.temperature, top_p=p.top_p, seed=p.seed, stop=p.stop,
                                      request_id=job.request_id)

    def _wire_lp(self, lp: TokenLogprobs | None) -> TokenLogprob | None:
        return wire_logprob(self.engine, lp)

    async def _emit(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> None:
        job = seq.job
        if job.deadline_ms is not None and now_ms() > job.deadline_ms:
            await self._finish(seq, "expired")  # stop decoding and free the KV; the caller keeps what it got
            return
        if seq.seq_no == 0 and not job.resume_token_ids:
            seq.timings.ttft_server_ms = now_ms() - job.created_ms
        seq.generated.append(token)
        seq.token_times.append(time.perf_counter())
        if logprob is not None:
            seq.logprobs.append(logprob)
        upd = seq.stop.update(token, seq.detok.feed(token))
        text, reason = upd.text, upd.finish_reason
        if reason == "length":
            text += seq.detok.flush()  # release a character still waiting for bytes that will never come
        seq.text += text
        if reason is not None:
            self.ending.add(job.key)  # from its last delta on, a forced revoke keeps it (on_revoke)
        try:
            if job.stream:
                seq.unsent_ids.append(token)
                seq.unsent_text += text
                if logprob is not None:
                    seq.unsent_logprobs.append(logprob)
                # The first token at once (time to first token), then every stream_interval tokens; a last
                # token goes with the ones still unsent, just before the final (_finish_seq).
                if reason is None and (seq.seq_no == job.start_seq or len(seq.unsent_ids) >= self.stream_interval):
                    await self._send_unsent(seq)
            if reason is not None:
                await self._finish(seq, reason)
        finally:
            if reason is not None:
                self.ending.discard(job.key)

    async def _send_unsent(self, seq: Sequence) -> None:
        job = seq.job
        ids, text, lps = seq.unsent_ids, seq.unsent_text, seq.unsent_logprobs
        seq.unsent_ids, seq.unsent_text, seq.unsent_logprobs = [], "", []
        await self.b.publish(job.stream_subject, StreamDelta(
            request_id=job.request_id, seq=seq.seq_no, token_ids=ids, text=text,
            logprobs=lps or None))
        seq.seq_no += 1

    async def _finish(self, seq: Sequence, reason: str) -> None:
        self.ending.add(seq.job.key)
        try:
            await self._finish_seq(seq, reason)
        finally:
            self.ending.discard(seq.job.key)

    async def _finish_seq(self, seq: Sequence, reason: str) -> None:
        job = seq.job
        # What is still unsent goes out before the final. A sequence's last token alone is sent only with text
        # (the final carries every token id), as when each token is sent at once.
        if job.stream and (seq.unsent_text or len(seq.unsent_ids) > 1):
            await self._send_unsent(seq)
        await self._drop(job.key, [*job.prompt_token_ids, *seq.generated])  # generated includes resumed
        seq.timings.total_ms = now_ms() - job.created_ms
        usage = Usage(prompt_tokens=len(job.prompt_token_ids), completion_tokens=len(seq.generated),
                      cached_tokens=seq.cached_tokens)
        final = StreamFinal(
            request_id=job.request_id, seq=seq.seq_no, token_ids=seq.generated, text=seq.text,
            finish_reason=reason,  # type: ignore[arg-type]
            usage=usage, route=job.route, prefill_worker=job.prefill_worker, decode_worker=self.worker_id,
            timings=seq.timings, decision=job.decision,
            logprobs=seq.logprobs if job.sampling.logprobs is not None else None,
            model=self.model_name,
        )
        await self.b.publish(job.stream_subject, final)
        status = "ok" if reason in ("stop", "length") else reason
        gaps = [(b - a) * 1000 for a, b in zip(seq.token_times, seq.token_times[1:], strict=False)][-512:]
        await self.b.publish(Subjects.finished(job.tenant, job.request_id), RequestFinished(
            request_id=job.request_id, tenant=job.tenant, worker_id=self.worker_id,
            status=status,  # type: ignore[arg-type]
            usage=usage, route=job.route, timings=seq.timings, itl_ms=[round(g, 3) for g in gaps],
            kv_bytes=seq.kv_bytes, finish_reason=reason, model=self.model_name, lora=job.lora, cost=seq.cost))
        sp = self.stream_spans.pop(job.key, None)
        if sp is None:
            sp = trace.INVALID_SPAN
        itl = sorted((b - a) * 1000 for a, b in zip(seq.token_times, seq.token_times[1:], strict=False))
        tracing.set_attrs(sp, completion_tokens=len(seq.generated), finish_reason=reason,
                          cached_tokens=seq.cached_tokens, ttft_server_ms=seq.timings.ttft_server_ms,
                          total_ms=seq.timings.total_ms,
                          itl_p50_ms=round(itl[len(itl) // 2], 3) if itl else None,
                          itl_max_ms=round(itl[-1], 3) if itl else None)
        tracing.gen_ai_response(sp, response_id=job.request_id, model=self.model_name, finish_reason=reason,
                                input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                                cached_tokens=usage.cached_tokens)
        with trace.use_span(sp, end_on_exit=True):  # the log line carries this span's trace and span ids
            self.log.info("finished", request_id=job.request_id, tenant=job.tenant, finish_reason=reason,
                          completion_tokens=len(seq.generated), route=str(job.route),
                          total_ms=round(seq.timings.total_ms or 0, 1))

    async def _drop(self, key: str, tokens: list[int] | None = None) -> None:
        seq = self.active.pop(key, None)
        if seq is not None:
            # Copying a long sequence's KV into the prefix cache pauses every other stream for that long (a
            # 3,000-token sequence: ~80 ms, most of a decode step); with streams active, skip it. The prompt's
            # prefix stays cached where it was prefilled.
            keep = tokens is not None and (not self.active or len(tokens) <= self.max_retire_copy_tokens)
            # the retire and the drain of the KV events it made: one engine-thread call (see _local_prefill)
            events = await self.thread.run(self._retire_and_drain, key, tokens or [], keep, seq.job.cache_salt)
            if self.kv_events is not None:
                await self.kv_events.send(events)

    async def _error(self, job: DecodeJob, code: ErrorCode, message: str) -> None:
        # The sequence's stream span when it was admitted, else whatever span is current (decode.admit).
        sp = self.stream_spans.pop(job.key, None)
        for span in (sp,) if sp is not None else (trace.get_current_span(),):
            span.set_attribute("error.code", str(code))
            tracing.record_error(span, message)
            if sp is not None:
                span.end()
        self.log.warning("request_failed", request_id=job.request_id, code=str(code), reason=message)
        await self.b.publish(job.stream_subject, StreamError(request_id=job.request_id, code=code,
                                                             message=message, worker=self.worker_id))
        await self.b.publish(Subjects.finished(job.tenant, job.request_id), RequestFinished(
            request_id=job.request_id, tenant=job.tenant, worker_id=self.worker_id, status="error",
            error_code=code, route=job.route, model=self.model_name, lora=job.lora))
