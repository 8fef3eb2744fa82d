"""Prefill worker service.

For each PrefillJob (one at a time; prefill is compute-bound and the engine is single-threaded):
reserve landing blocks on the named decoder (waiting while its buffer is full, never dropping the job),
compute the KV, push it with the KV transport straight into those blocks, then publish PrefillDone with
the first token to the decoder. KV bytes never travel over NATS.

A job whose hand-off to the decoder fails (the decoder is gone, refuses or times out the reservation, the push
fails) is bounced to the routers (JobBounced), not failed: the router dispatches it again. A resumed job
(migration) is computed over prompt + the tokens already produced. On SIGTERM the prefiller finishes its queue
within the drain bound; jobs still queued then are handed over (the routers re-dispatch them).

Short prompts queued together share one forward (engines that batch prefill: hf): when the engine frees up,
the job at the head of the queue takes the short jobs queued right behind it (up to `prefill_batch` of them);
each reserves its landing blocks as usual, then their prefills run as one `engine.prefill_batch` call, and each
pushes its own KV. A job that is alone in the queue runs exactly as before (no waiting window).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

import structlog
import torch
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from splitserve.cache.store import PrefixKvStore
from splitserve.engines import Engine, LayerHook, PrefillRequest, PrefillResult, PromptTooLong, Sampling, UnknownAdapter
from splitserve.kv import BlockPool, make_sender
from splitserve.kv.transport import usable_transport
from splitserve.obs import tracing
from splitserve.proto import (
    CancelRequest,
    DecodeJob,
    ErrorCode,
    JobBounced,
    KvHandle,
    KvReserveReply,
    KvReserveRequest,
    PrefillDone,
    PrefillJob,
    RequestFinished,
    StreamError,
    StreamFinal,
    Subjects,
    Usage,
    WorkerLoad,
    now_ms,
)
from splitserve.proto.admin import LoraAdminRequest
from splitserve.routing.load import prefiller_load
from splitserve.runtime.service import Service
from splitserve.services.common import handoff
from splitserve.services.common.adapters import AdapterBusy, AdapterSlots, on_lora_admin
from splitserve.services.common.engine_thread import EngineThread
from splitserve.services.common.kvcache import KvEventPublisher, kv_layout
from splitserve.services.common.options import EngineOptions
from splitserve.services.common.sampling import engine_sampling, wire_logprob
from splitserve.tenancy.fairqueue import FairQueue

# Prompts shorter than this are pushed in one piece after prefill (see _run).
LAYERWISE_MIN_TOKENS = 256
# Failures of the hand-off to the decoder, which another decoder (or this one, later) may not have.
BOUNCE_CODES = frozenset({ErrorCode.WORKER_DIED, ErrorCode.KV_TRANSFER_FAILED, ErrorCode.TIMEOUT})
# Batched prefill: at most this many prompts per forward (0 or 1: off), and at most this many padded tokens
# (longest prompt x prompts) in one forward.
PREFILL_BATCH = 8
PREFILL_BATCH_TOKENS = 2048
# How long the jobs of a batch that are ready wait for one whose reservation is slow (its decoder's buffer is
# full, say): that one then prefills alone, later.
GATHER_WAIT_S = 0.1
# In a batch, a cached prefix at most this long is recomputed inside the shared forward rather than reused:
# reusing it takes the prompt out of the batch (its own forward, its own read of the weights), which costs
# more than these few extra tokens. (A chat template's system prompt is such a prefix, shared by every chat.)
BATCH_RECOMPUTE_TOKENS = 64

# One prompt of a batch: its token ids, sampling, and the cache salt its job carries (scopes its prefix reuse).
BatchItem = tuple[list[int], Sampling, str | None, str | None]  # ids, sampling, cache salt, LoRA adapter
BatchRunner = Callable[[list[BatchItem]], Awaitable[list["PrefillResult | BaseException"]]]


class PrefillGather:
    """The prefill calls of jobs started together, run as one engine call once every job has made its call or
    dropped out (failed before computing), or `wait_s` after the first call; later calls run alone."""

    def __init__(self, keys: list[str], run_batch: BatchRunner, wait_s: float = GATHER_WAIT_S) -> None:
        self.waiting = set(keys)
        self.run_batch = run_batch
        self.wait_s = wait_s
        self.items: list[BatchItem] = []
        self.futures: list[asyncio.Future[PrefillResult]] = []
        self.closed = False
        self._all_in = asyncio.Event()
        self.batched = 0  # prompts that went through the batched call (for tests and logs)
        self.batch_of: dict[str, int] = {}  # key -> how many prompts shared its forward
        self._keys: list[str] = []

    def leave(self, key: str) -> None:
        """The job `key` will not call prefill (it failed first, or finished)."""
        self.waiting.discard(key)
        if not self.waiting:
            self._all_in.set()

    async def prefill(self, key: str, ids: list[int], sampling: Sampling,
                      cache_salt: str | None = None, lora: str | None = None) -> PrefillResult:
        if self.closed:  # too late for the batch
            self.waiting.discard(key)
            self.batch_of[key] = 1
            return self._result((await self.run_batch([(ids, sampling, cache_salt, lora)]))[0])
        future: asyncio.Future[PrefillResult] = asyncio.get_running_loop().create_future()
        self.items.append((ids, sampling, cache_salt, lora))
        self.futures.append(future)
        self._keys.append(key)
        self.leave(key)
        if len(self.items) > 1:
            return await future
        # the first caller drives the batch
        if self.waiting:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_in.wait(), self.wait_s)
        self.closed = True
        items, futures = list(self.items), list(self.futures)
        self.batched = len(items)
        self.batch_of.update((k, len(items)) for k in self._keys)
        try:
            results = await self.run_batch(items)
        except BaseException as exc:
            for f in futures[1:]:
                if not f.done():
                    f.set_exception(exc if isinstance(exc, Exception) else RuntimeError("prefill batch cancelled"))
            raise
        for f, r in zip(futures[1:], results[1:], strict=True):
            if isinstance(r, BaseException):
                f.set_exception(r)
            else:
                f.set_result(r)
        return self._result(results[0])

    @staticmethod
    def _result(r: PrefillResult | BaseException) -> PrefillResult:
        if isinstance(r, BaseException):
            raise r
        return r


# The batch the job running in this task belongs to and its key there (None: prefilled alone).
_GATHER: ContextVar[tuple[PrefillGather, str] | None] = ContextVar("prefill_gather", default=None)


class JobFailed(Exception):
    def __init__(self, code: ErrorCode, message: str, unreachable: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.unreachable = unreachable  # the decoder that had no responder (told to the routers in the bounce)


class PrefillService(Service):
    role = "prefill"

    def __init__(
        self,
        worker_id: str,
        nats_url: str,
        *,
        opts: EngineOptions,
        staging_tokens: int | None = None,
        reserve_wait_s: float = 60.0,
        cache_tokens: int = 8192,
        l1_tokens: int = 0,
        layerwise: bool = True,
        prefill_batch: int = PREFILL_BATCH,
        **kw: Any,
    ) -> None:
        super().__init__(worker_id, nats_url, **kw)
        self.opts = opts
        self.prefill_batch = prefill_batch
        self.layerwise = layerwise
        self.cache_tokens = cache_tokens
        self.l1_tokens = l1_tokens
        self.store: PrefixKvStore | None = None
        self.kv_events: KvEventPublisher | None = None
        self.staging_tokens = staging_tokens
        self.reserve_wait_s = reserve_wait_s
        # Waiting jobs, served by weighted tokens between tenants (FIFO within one): a tenant's flood of long
        # prompts does not sit in front of everyone else's prefill. Weights come with the jobs (the routers').
        self._weights: dict[str, float] = {}
        self.queue: FairQueue[tuple[PrefillJob, dict[str, str]]] = FairQueue(lambda t: self._weights.get(t, 1.0))
        self.current: DecodeJob | None = None
        self.busy_s = {"prefill": 0.0}  # seconds computing since start: its requests' StageCost.prefill_s sum to it
        self.batching: list[DecodeJob] = []  # the jobs of a batched prefill in progress
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.thread = EngineThread(f"prefill-{worker_id}")

    async def setup(self) -> None:
        self.engine = await self.thread.run(self.opts.load)
        self.thread.inline = not self.engine.blocking  # a zero-cost engine: no thread hand-offs (engine_thread)
        self.log.info("engine_loaded", model=self.engine.info.name,
                      engine_calls="inline" if self.thread.inline else "thread")
        self.adapters = AdapterSlots(self.opts.lora_modules, self.opts.max_loras, self.thread.run)
        self.adapters.started(self.engine.loras())
        info = self.engine.info
        self.layout = kv_layout(info, self.opts.block_size)
        # Staging holds one prompt's KV at a time: size it for the longest prompt the model takes.
        tokens = self.staging_tokens or info.max_model_len
        self.pool = BlockPool(self.layout, self.layout.blocks_for_tokens(tokens))
        transport, why = usable_transport(self.opts.transport)
        if why is not None:
            self.log.warning("kv_transport_fallback", transport=transport, reason=why)
            self.opts = dataclasses.replace(self.opts, transport=transport)
        self.sender = await asyncio.to_thread(make_sender, self.opts.transport, self.pool)
        self.kv_events = KvEventPublisher.for_worker(self.b, self.worker_id, info, self.thread,
                                                     block_size=self.opts.block_size, cache_tokens=self.cache_tokens,
                                                     l1_tokens=self.l1_tokens)
        self.store = self.kv_events.store if self.kv_events is not None else None

    async def start(self) -> None:
        await self.b.subscribe(Subjects.prefill_job(self.worker_id), PrefillJob, self.on_job)
        await self.b.subscribe(Subjects.CANCEL_ALL, CancelRequest, self.on_cancel, scoped=True)
        await self.b.subscribe(Subjects.ADMIN_LORA, LoraAdminRequest, self.on_lora_admin)
        if self.kv_events is not None:
            await self.kv_events.start()
        self._loop_task = self.b.spawn(self._loop())

    async def drain(self) -> None:
        while self.queue or self.current is not None or self.batching:
            await asyncio.sleep(0.05)

    async def hand_over(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(BaseException):
                await self._loop_task
        self.log.info("handed_over", requests=self.active_requests())
        self.queue.clear()
        self.current = None
        self.batching = []

    async def shutdown(self) -> None:
        # Jobs still queued were handed over at the end of the drain (the routers re-dispatch them).
        self.sender.close()
        self.thread.close()

    def load(self) -> WorkerLoad:
        running = [*([self.current] if self.current is not None else []), *self.batching]
        return prefiller_load(
            running=len(running), waiting=len(self.queue),
            running_tokens=sum(len(j.context_token_ids()) for j in running),
            waiting_tokens=sum(len(j.decode.context_token_ids()) for j, _ in self.queue),
            cached_blocks=sum(self.store.stats().blocks.values()) if self.store is not None else 0,
            busy_s={k: round(v, 6) for k, v in self.busy_s.items()})

    def active_requests(self) -> list[str]:
        keys = [j.decode.key for j, _ in self.queue]  # proto.request_key: ids are unique per tenant only
        if self.current is not None:
            keys.append(self.current.key)
        keys.extend(j.key for j in self.batching)
        return keys

    @property
    def model_name(self) -> str:
        """The name this worker serves its model under (``--served-model-name``, else the engine's): what its
        heartbeats announce, and what routers match a request's model against."""
        return self.opts.model_name(self.engine.info.name)

    def heartbeat_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"engine": self.opts.engine, "transport": self.opts.transport,
                                 "block_size": self.opts.block_size}
        if hasattr(self, "engine"):
            extra.update(model=self.model_name, max_model_len=self.engine.info.max_model_len,
                         adapters=self.adapters.loaded(), adapters_available=self.adapters.available())
        return extra

    async def on_lora_admin(self, req: LoraAdminRequest, msg: Msg) -> None:
        await on_lora_admin(self, req, msg)

    async def on_cancel(self, c: CancelRequest, _: Msg) -> None:
        # Only a queued job is dropped here; one being computed finishes its push and the decoder, which
        # also saw the cancel, frees the landing blocks and sends the final message.
        gone = self.queue.remove(lambda it: it[0].decode.key == c.key)  # (a re-sent copy too: one answer)
        if not gone:
            return
        job = gone[0][0].decode
        usage = Usage(prompt_tokens=len(job.prompt_token_ids), completion_tokens=len(job.resume_token_ids))
        await self.b.publish(job.stream_subject, StreamFinal(
            request_id=job.request_id, seq=job.start_seq, token_ids=job.resume_token_ids,
            text=job.resume_text, finish_reason="cancelled",
            usage=usage, route=job.route, prefill_worker=self.worker_id, decode_worker=job.decoder_id,
            decision=job.decision, model=self.model_name))
        await self.b.publish(Subjects.finished(job.tenant, job.request_id), RequestFinished(
            request_id=job.request_id, tenant=job.tenant, worker_id=self.worker_id, status="cancelled",
            usage=usage, route=job.route, model=self.model_name, lora=job.lora))

    async def on_job(self, job: PrefillJob, msg: Msg) -> None:
        d = job.decode
        self._weights[d.tenant] = d.weight
        self.queue.push(d.tenant, len(d.context_token_ids()), (job, dict(msg.headers or {})), d.guaranteed)
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            job, headers = self.queue.pop()
            group = self._take_batch(job)
            if group:
                self.batching = [job.decode] + [j.decode for j, _ in group]
                items = [(job, headers), *group]
                gather = PrefillGather([str(i) for i in range(len(items))], self._run_batch)
                try:
                    outcomes = await asyncio.gather(*(self._job(j, h, (gather, str(i)))
                                                      for i, (j, h) in enumerate(items)), return_exceptions=True)
                    for outcome in outcomes:  # one job's failure to report must not end the loop for all
                        if isinstance(outcome, Exception):
                            self.log.error("prefill_job_crashed", error=repr(outcome))
                finally:
                    self.batching = []
                continue
            self.current = job.decode
            try:
                await self._job(job, headers)
            finally:
                self.current = None

    def _batchable(self) -> bool:
        """Whether this engine shares a forward between prompts (not the one-by-one default)."""
        engine = getattr(self, "engine", None)
        return (self.prefill_batch > 1 and engine is not None
                and type(engine).prefill_batch is not Engine.prefill_batch)

    def _short(self, job: DecodeJob) -> bool:
        return len(job.context_token_ids()) < LAYERWISE_MIN_TOKENS

    def _take_batch(self, first: PrefillJob) -> list[tuple[PrefillJob, dict[str, str]]]:
        """The short jobs queued right behind a short `first` that can share its forward (taken off the queue)."""
        if not self.queue or not self._batchable() or not self._short(first.decode):
            return []
        lengths = [len(first.decode.context_token_ids())]
        blocks = self.layout.blocks_for_tokens(lengths[0])
        group: list[tuple[PrefillJob, dict[str, str]]] = []
        while self.queue and len(group) + 1 < self.prefill_batch and self._short(self.queue.peek()[0].decode):
            n = len(self.queue.peek()[0].decode.context_token_ids())
            need = self.layout.blocks_for_tokens(n)
            if max(*lengths, n) * (len(lengths) + 1) > PREFILL_BATCH_TOKENS or blocks + need > self.pool.num_blocks:
                break
            group.append(self.queue.pop())
            lengths.append(n)
            blocks += need
        return group

    async def _job(self, job: PrefillJob, headers: dict[str, str],
                   gather: tuple[PrefillGather, str] | None = None) -> None:
        if gather is not None:
            _GATHER.set(gather)  # this task's own context: _run finds its batch there
        try:
            with tracing.span_from(headers, "prefill.job", request_id=job.decode.request_id,
                                   tenant=job.decode.tenant, decoder=job.decode.decoder_id,
                                   prompt_tokens=len(job.decode.prompt_token_ids),
                                   queue_wait_ms=round(max(0.0, now_ms() - job.decode.routed_ms), 2)) as sp, \
                    structlog.contextvars.bound_contextvars(request_id=job.decode.request_id,
                                                            tenant=job.decode.tenant):
                try:
                    await self._run(job.decode)
                except JobFailed as exc:
                    tracing.record_error(sp, str(exc))
                    await self._fail(job.decode, exc.code, str(exc), exc.unreachable)
                except Exception as exc:
                    self.log.exception("prefill_failed", request_id=job.decode.request_id)
                    tracing.record_error(sp, exc)
                    await self._fail(job.decode, ErrorCode.INTERNAL, f"prefill failed: {exc}")
        finally:
            if gather is not None:
                gather[0].leave(gather[1])

    async def _reserve(self, job: DecodeJob) -> KvReserveReply:
        req = KvReserveRequest(request_id=job.request_id, tenant=job.tenant, prefill_worker=self.worker_id,
                               num_tokens=len(job.context_token_ids()), transport=self.opts.transport)
        give_up = time.monotonic() + self.reserve_wait_s
        waited = False
        while True:
            try:
                reply = await self.b.request(Subjects.kv_reserve(job.decoder_id), req, KvReserveReply, timeout=5.0)
            except NoRespondersError:
                raise JobFailed(ErrorCode.WORKER_DIED, f"decode worker {job.decoder_id} is not running "
                                "(no responder for its KV reservation subject)", unreachable=job.decoder_id) from None
            except (NatsTimeout, TimeoutError):
                raise JobFailed(ErrorCode.WORKER_DIED,
                                f"decode worker {job.decoder_id} did not answer the KV reservation in 5s") from None
            if isinstance(reply, StreamError):
                raise JobFailed(ErrorCode.KV_TRANSFER_FAILED, f"decoder refused the reservation: {reply.message}")
            if reply.ok:
                return reply
            if reply.capacity_tokens is not None:
                # Every attempt would end the same way (another prefiller, the same decoder pool): say so now.
                raise JobFailed(ErrorCode.PROMPT_TOO_LONG,
                                f"the prompt's {req.num_tokens:,} tokens do not fit decoder {job.decoder_id}'s KV "
                                f"landing buffer ({reply.capacity_tokens:,} tokens; its --landing-tokens)")
            if reply.retry_after_ms is None:
                raise JobFailed(ErrorCode.KV_TRANSFER_FAILED, reply.error or "decoder refused the reservation")
            if time.monotonic() > give_up:
                raise JobFailed(ErrorCode.TIMEOUT, f"decode worker {job.decoder_id}'s KV buffer stayed full for "
                                f"{self.reserve_wait_s:.0f}s")
            if job.deadline_ms is not None and now_ms() > job.deadline_ms:
                raise JobFailed(ErrorCode.EXPIRED, "the request's deadline passed while waiting for KV space")
            if not waited:
                self.log.info("kv_buffer_full_waiting", request_id=job.request_id, decoder=job.decoder_id)
                waited = True
            await asyncio.sleep(reply.retry_after_ms / 1000.0)

    async def _run(self, job: DecodeJob) -> None:
        started_ms = now_ms()
        if job.deadline_ms is not None and now_ms() > job.deadline_ms:
            raise JobFailed(ErrorCode.EXPIRED, "the request's deadline passed before prefill started")
        ids = job.context_token_ids()
        if len(ids) >= self.engine.info.max_model_len:
            raise JobFailed(ErrorCode.PROMPT_TOO_LONG,
                            f"prompt has {len(ids):,} tokens; model max is {self.engine.info.max_model_len - 1:,}")
        with tracing.tracer().start_as_current_span("kv.reserve", attributes={"decoder": job.decoder_id}) as rsp:
            t_res = time.perf_counter()
            try:
                reservation = await self._reserve(job)
            except JobFailed as exc:
                tracing.record_error(rsp, str(exc))
                raise
            rsp.set_attribute("kv.reserve_ms", round((time.perf_counter() - t_res) * 1000, 2))
        assert reservation.transfer_id is not None and reservation.descriptor is not None
        tid, desc = reservation.transfer_id, reservation.descriptor
        sampling = engine_sampling(job.sampling, len(ids), self.engine.info.eos_token_ids)
        src = self.pool.try_allocate(self.layout.blocks_for_tokens(len(ids)))
        if src is None:
            raise JobFailed(ErrorCode.INTERNAL, "prefill staging buffer exhausted")
        loop = asyncio.get_running_loop()
        pushes: list[Any] = []
        # Per-layer pushes pay off when a layer's compute hides its transfer. For a short prompt each layer
        # is ~3 ms of compute and each hand-off to the event loop (and the GIL it waits for) cost about as
        # much: py-spy put ~15% of a short prefill's engine-thread time there. One push after it is cheaper.
        layerwise = self.layerwise and len(ids) >= LAYERWISE_MIN_TOKENS
        last_layer = self.layout.num_layers - 1

        def push_layer(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            # Engine thread, right after this layer's KV is final: stage it and start its push while the
            # next layers compute. The last layer's push carries the completion notification.
            self.pool.scatter_layer(layer, k, v, src)
            coro = self.sender.push(tid, src, desc, layers=range(layer, layer + 1), notify=layer == last_layer)
            pushes.append(asyncio.run_coroutine_threadsafe(coro, loop))

        try:
            with tracing.tracer().start_as_current_span("prefill.compute") as csp:
                t0 = time.perf_counter()
                member = _GATHER.get()
                batch = 1
                try:
                    await self.adapters.ensure(self.engine, job.lora)  # (loaded on first use: --max-loras)
                    if member is not None and not layerwise:
                        gather, key = member
                        res = await gather.prefill(key, ids, sampling, job.cache_salt, job.lora)
                        batch = gather.batch_of.get(key, 1)
                        csp.set_attribute("prefill.batch", batch)
                    else:
                        res = await self.thread.run(self._prefill_cached, ids, sampling,
                                                    push_layer if layerwise else None, job.cache_salt, job.lora)
                except PromptTooLong as exc:
                    raise JobFailed(ErrorCode.PROMPT_TOO_LONG, str(exc)) from None
                except UnknownAdapter as exc:
                    raise JobFailed(ErrorCode.MODEL_NOT_FOUND, str(exc)) from None
                except AdapterBusy as exc:
                    raise JobFailed(ErrorCode.BUSY, str(exc)) from None
                prefill_ms = (time.perf_counter() - t0) * 1000
                compute_ms = prefill_ms / batch  # the batch's members share its time (chargeback)
                self.busy_s["prefill"] += compute_ms / 1000
                csp.set_attribute("prefill.tokens", len(ids))
                csp.set_attribute("prefill.cached_tokens", len(ids) - res.num_computed_tokens)
                csp.set_attribute("prefill.computed_tokens", res.num_computed_tokens)
                csp.set_attribute("prefill.ms", round(prefill_ms, 2))
                csp.set_attribute("kv.layerwise", layerwise)
            with tracing.tracer().start_as_current_span("kv.push") as sp:
                t1 = time.perf_counter()
                try:
                    if layerwise:
                        parts = await asyncio.gather(*[asyncio.wrap_future(f) for f in pushes])
                        nbytes, transport = sum(p.bytes for p in parts), parts[-1].transport
                    else:
                        await self.thread.run(self.pool.scatter, res.kv, src)
                        st = await self.sender.push(tid, src, desc)
                        nbytes, transport = st.bytes, st.transport
                except Exception as exc:
                    raise JobFailed(ErrorCode.KV_TRANSFER_FAILED,
                                    f"KV push to decode worker {job.decoder_id} failed: {exc}") from None
                # What the transfer adds to TTFT: with layer-by-layer push, only what was left after compute.
                transfer_ms = (time.perf_counter() - t1) * 1000
                sp.set_attribute("kv.bytes", nbytes)
                sp.set_attribute("kv.transport", transport)
                sp.set_attribute("kv.layerwise", layerwise)
                sp.set_attribute("kv.exposed_ms", transfer_ms)
                # Layerwise pushes overlap compute: bandwidth over the whole push window (compute + the
                # exposed tail) would understate the link, so report it over the exposed part too.
                push_ms = transfer_ms + (prefill_ms if layerwise else 0.0)
                sp.set_attribute("kv.duration_ms", round(push_ms, 3))
                sp.set_attribute("kv.bandwidth_mbps", round(nbytes / 1e6 / max(push_ms / 1000, 1e-9), 1))
                sp.set_attribute("kv.decoder", job.decoder_id)
        finally:
            for f in pushes:  # a failed prefill must not leave pushes writing into freed staging blocks
                with contextlib.suppress(Exception):
                    await asyncio.wrap_future(f)
            self.pool.free(src)
        done = PrefillDone(
            request_id=job.request_id, first_token=res.first_token,
            kv=KvHandle(transfer_id=reservation.transfer_id, num_tokens=len(ids),
                        cached_tokens=len(ids) - res.num_computed_tokens, kv_bytes=nbytes,
                        transport=transport, prefill_ms=prefill_ms, transfer_ms=transfer_ms,
                        started_ms=started_ms, compute_ms=compute_ms),
            decode=job, first_logprob=wire_logprob(self.engine, res.first_logprobs),
        )
        # delivered until the decoder answers (splitserve.services.common.handoff): awaited here, so a draining
        # prefiller
        # finishes its hand-offs before it exits (one round trip; a lost copy costs ACK_TIMEOUT_S)
        await handoff.hand_over(self.b, Subjects.kv_ready(job.decoder_id), done, self.log)
        if self.kv_events is not None:
            await self.kv_events.flush()
        self.log.info("prefilled", request_id=job.request_id, tokens=len(ids), prefill_ms=round(prefill_ms, 1),
                      kv_bytes=nbytes, transfer_ms=round(transfer_ms, 2), layerwise=layerwise, batch=batch,
                      decoder=job.decoder_id)

    def _prefill_cached(self, ids: list[int], sampling: Sampling, on_layer: LayerHook | None,
                        cache_salt: str | None = None, lora: str | None = None) -> PrefillResult:
        """Engine thread: reuse the longest cached prefix, prefill the rest, keep the result for next time;
        both within the job's cache salt (its tenant / cache group), so tenants never reuse each other's KV."""
        past = None
        if self.store is not None:
            m = self.store.match(ids, cache_salt=cache_salt)
            past = m.kv if m.num_tokens else None
        res = self.engine.prefill(ids, sampling, past_kv=past, on_layer=on_layer, lora=lora)
        if self.store is not None:
            self.store.insert(ids, res.kv, cache_salt=cache_salt)
        return res

    async def _run_batch(self, items: list[BatchItem]) -> list[PrefillResult | BaseException]:
        return await self.thread.run(self._prefill_cached_batch, items)

    def _prefill_cached_batch(self, items: list[BatchItem]) -> list[PrefillResult | BaseException]:
        """Engine thread: `_prefill_cached` for several prompts in one engine call (a prompt with a long cached
        prefix is computed on its own by the engine; a short one is recomputed in the batch). If the batch
        fails, each prompt is retried alone, so one bad prompt fails only its own job."""
        requests = []
        for ids, sampling, salt, lora in items:
            past = None
            if self.store is not None:
                m = self.store.match(ids, cache_salt=salt)
                if m.num_tokens > (BATCH_RECOMPUTE_TOKENS if len(items) > 1 else 0):
                    past = m.kv
            requests.append(PrefillRequest(ids, sampling, past, lora=lora))
        try:
            results: list[PrefillResult | BaseException] = list(self.engine.prefill_batch(requests))
        except Exception:
            if len(items) == 1:
                raise
            results = []
            for r in requests:
                try:
                    results.append(self.engine.prefill(r.token_ids, r.sampling, past_kv=r.past_kv, lora=r.lora))
                except Exception as exc:
                    results.append(exc)
        if self.store is not None:
            for (ids, _, salt, _), res in zip(items, results, strict=True):
                if isinstance(res, PrefillResult):
                    self.store.insert(ids, res.kv, cache_salt=salt)
        return results

    async def _fail(self, job: DecodeJob, code: ErrorCode, message: str, unreachable: str | None = None) -> None:
        if code in BOUNCE_CODES:
            # The hand-off failed, not the request: the router dispatches it again (bounded migrations).
            self.log.warning("job_bounced", request_id=job.request_id, code=str(code), reason=message,
                             attempt=job.attempt)
            await self.b.publish(Subjects.bounced(job.tenant, job.request_id), JobBounced(
                request_id=job.request_id, tenant=job.tenant, worker_id=self.worker_id, attempt=job.attempt,
                code=code, message=message, decoder=unreachable))
            return
        self.log.warning("request_failed", request_id=job.request_id, code=str(code), reason=message)
        await self.b.publish(job.stream_subject, StreamError(request_id=job.request_id, code=code, message=message,
                                                             worker=self.worker_id))
        await self.b.publish(Subjects.finished(job.tenant, job.request_id), RequestFinished(
            request_id=job.request_id, tenant=job.tenant, worker_id=self.worker_id, status="error",
            error_code=code, route=job.route, model=self.model_name, lora=job.lora))
