"""Decode worker on the ``vllm`` engine.

vLLM batches, prefills and holds KV itself, so this worker hands it whole requests: a ``DecodeJob``
(direct route: vLLM prefills locally, reusing its prefix cache) or a ``PrefillDone`` whose
``kv_transfer_params`` name the blocks a prefiller holds (NixlConnector: vLLM pulls them, then decodes). Token
streaming, stop strings, cancel, deadlines, the final message and the request-finished event are the same as
the ``hf`` decoder's (inherited). KV reservations are refused: vLLM's connector moves the KV, not splitserve.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import structlog
from nats.aio.msg import Msg

from splitserve.engines import PromptTooLong, UnknownAdapter
from splitserve.engines.detok import IncrementalDetokenizer, StopChecker
from splitserve.engines.generate import GenRequest
from splitserve.obs import tracing
from splitserve.proto import (
    CancelRequest,
    DecodeJob,
    ErrorCode,
    KvReserveReply,
    KvReserveRequest,
    LoraAdminRequest,
    PrefillDone,
    Subjects,
    Timings,
    WorkerLoad,
    now_ms,
)
from splitserve.services.common.adapters import AdapterSlots
from splitserve.services.common.options import EngineOptions
from splitserve.services.common.sampling import engine_sampling
from splitserve.services.common.vllm_kv import VllmKvBridge
from splitserve.services.common.vllm_worker import (
    VllmOptions,
    check_lora,
    run_on_loop,
    serve_vllm_metrics,
    vllm_config,
    vllm_load,
)
from splitserve.services.decode.service import DecodeService, Sequence


class VllmDecodeService(DecodeService):
    def __init__(self, worker_id: str, nats_url: str, *, opts: EngineOptions, vllm: VllmOptions | None = None,
                 max_batch: int = 16, **kw: Any) -> None:
        kw.pop("cache_tokens", None)
        kw.pop("l1_tokens", None)
        super().__init__(worker_id, nats_url, opts=opts, max_batch=max_batch, cache_tokens=0, **kw)
        self.vopts = vllm or VllmOptions()
        self.bridge: VllmKvBridge | None = None
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.transfer_ms: list[float] = []  # per disaggregated request: KV pull + first step (see _serve)

    async def setup(self) -> None:
        from splitserve.engines.vllm_engine import VllmEngine

        cfg = vllm_config(self.opts, self.vopts, role="decode", max_num_seqs=self.max_batch,
                          worker_id=self.worker_id)
        check_lora(cfg)
        self.engine = await VllmEngine.start(cfg)  # type: ignore[assignment]
        # vLLM holds every registered adapter and does the LRU of its batch slots itself (--max-loras), so the
        # slots here have no capacity: "loaded" is vLLM's registered set, all of it ready for a request
        self.adapters = AdapterSlots(self.opts.lora_modules, 0, run_on_loop)
        self.adapters.started(self.engine.loras())
        serve_vllm_metrics(self.log)
        if cfg.kv_events_endpoint:
            self.bridge = VllmKvBridge(self.b, self.worker_id, cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint,
                                       engine_block_size=self.engine.block_size,  # type: ignore[attr-defined]
                                       route_block_size=self.vopts.route_block_size)
        self.log.info("vllm_ready", load_s=round(self.engine.load_seconds or 0, 1),  # type: ignore[attr-defined]
                      connector=cfg.kv_connector, block_size=cfg.resolved_block_size(self.engine.gpu),  # type: ignore[attr-defined]
                      kv_events=cfg.kv_events_endpoint)

    async def start(self) -> None:
        b = self.b
        await b.subscribe(Subjects.decode_job(self.worker_id), DecodeJob, self.on_job)
        await b.subscribe(Subjects.kv_reserve(self.worker_id), KvReserveRequest, self.on_reserve)
        await b.subscribe(Subjects.kv_ready(self.worker_id), PrefillDone, self.on_kv_ready, concurrent=True)
        await b.subscribe(Subjects.CANCEL_ALL, CancelRequest, self.on_cancel, scoped=True)
        await b.subscribe(Subjects.ADMIN_LORA, LoraAdminRequest, self.on_lora_admin)
        if self.bridge is not None:
            await self.bridge.start()

    async def drain(self) -> None:
        while self.tasks:
            await asyncio.sleep(0.05)

    async def hand_over(self) -> None:
        # No resume support on this engine yet (see on_job): what is still running ends with worker_died.
        pass

    async def shutdown(self) -> None:
        for seq in list(self.active.values()):
            await self._error(seq.job, ErrorCode.WORKER_DIED, f"decode worker {self.worker_id} is shutting down")
        for t in list(self.tasks.values()):
            t.cancel()
        if self.bridge is not None:
            await self.bridge.close()
        if hasattr(self, "engine"):
            with contextlib.suppress(Exception):
                await self.engine.close()  # type: ignore[attr-defined]
        self.thread.close()

    def load(self) -> WorkerLoad:
        if not hasattr(self, "engine"):
            return WorkerLoad()
        return vllm_load(self.engine, active=len(self.active), queued=len(self.tasks) - len(self.active),
                         route_block_size=self.vopts.route_block_size,
                         cached_blocks=self.bridge.num_blocks() if self.bridge is not None else 0)

    def active_requests(self) -> list[str]:
        return list(self.tasks)

    def heartbeat_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"engine": "vllm", "transport": f"vllm-{self.vopts.kv_connector}",
                                 "block_size": self.vopts.route_block_size, "pool": self.pool_name}
        if hasattr(self, "engine"):
            extra.update(model=self.model_name, max_model_len=self.engine.info.max_model_len,
                         adapters=self.adapters.loaded(), adapters_available=self.adapters.available())
        return extra

    # --- inputs ---------------------------------------------------------------------------------------
    async def on_job(self, job: DecodeJob, msg: Msg) -> None:
        if job.resume_token_ids:
            await self._error(job, ErrorCode.WORKER_DIED, f"the request's worker died after {job.start_seq} "
                              f"deltas and decoder {self.worker_id} (vLLM) cannot resume a moved request")
            return
        self._start(job, dict(msg.headers or {}), None, None)

    async def on_reserve(self, req: KvReserveRequest, msg: Msg) -> None:
        await self.b.respond(msg, KvReserveReply(
            request_id=req.request_id, ok=False,
            error=f"decoder {self.worker_id} runs vLLM: its KV connector moves KV (no splitserve transport)"))

    async def on_kv_ready(self, done: PrefillDone, msg: Msg) -> None:
        if not await self.handoffs.take(self.b, done, msg):
            return  # a repeat of a hand-off taken already (the prefiller did not hear the answer)
        params = getattr(done, "kv_transfer_params", None)
        if done.decode.resume_token_ids:
            await self._error(done.decode, ErrorCode.WORKER_DIED, f"decoder {self.worker_id} (vLLM) cannot resume "
                              "a moved request")
            return
        if params is None:
            await self._error(done.decode, ErrorCode.KV_TRANSFER_FAILED,
                              f"decoder {self.worker_id} runs vLLM and needs the prefiller's kv_transfer_params")
            return
        self._start(done.decode, dict(msg.headers or {}), params, done)

    async def on_cancel(self, c: CancelRequest, _: Msg) -> None:
        self.cancelled[c.key] = None
        while len(self.cancelled) > 4096:
            self.cancelled.pop(next(iter(self.cancelled)))
        seq = self.active.get(c.key)
        if seq is not None:
            await self._finish(seq, "cancelled")

    # --- serving --------------------------------------------------------------------------------------
    def _start(self, job: DecodeJob, headers: dict[str, str], params: dict[str, Any] | None,
               done: PrefillDone | None) -> None:
        if job.key in self.tasks:
            return  # a duplicate delivery of a request already running here
        key = job.key
        task = self.b.spawn(self._serve(job, headers, params, done))
        self.tasks[key] = task

        def forget(_: asyncio.Task[None]) -> None:
            self.tasks.pop(key, None)

        task.add_done_callback(forget)

    async def _serve(self, job: DecodeJob, headers: dict[str, str], params: dict[str, Any] | None,
                     done: PrefillDone | None) -> None:
        # maps and the engine's request id are keyed by proto.request_key: ids are unique per tenant only
        rid, key = job.request_id, job.key
        if key in self.cancelled:
            await self._finish_unstarted(job, "cancelled")
            return
        if job.deadline_ms is not None and now_ms() > job.deadline_ms:
            await self._finish_unstarted(job, "expired")
            return
        started_ms = done.kv.started_ms if done is not None and done.kv.started_ms else now_ms()
        try:
            await self.adapters.ensure(self.engine, job.lora)  # served here (registered with vLLM), or refused
        except UnknownAdapter as exc:
            await self._error(job, ErrorCode.MODEL_NOT_FOUND, str(exc))
            return
        sampling = engine_sampling(job.sampling, len(job.prompt_token_ids), self.engine.info.eos_token_ids)
        eos = () if job.sampling.ignore_eos else self.engine.info.eos_token_ids
        max_new = self._max_new(job)
        seq = Sequence(
            job=job, detok=IncrementalDetokenizer(self.engine, job.prompt_token_ids),  # type: ignore[arg-type]
            stop=StopChecker(job.sampling.stop, eos, max_new, min_tokens=job.sampling.min_tokens),
            kv_bytes=done.kv.kv_bytes if done is not None else None,
            timings=Timings(queue_ms=job.routed_ms - job.created_ms, dispatch_ms=started_ms - job.created_ms,
                            prefill_ms=done.kv.prefill_ms if done is not None else None))
        ids = list(job.prompt_token_ids)
        given: int | None = None
        if params is not None and params.get("connector") == "lmcache" and done is not None:
            # LMCache PD: the prefiller's token is the first output; vLLM continues from prompt + that token
            # and finds the pushed KV by its token hash
            given, params = done.first_token, None
            ids.append(given)
        req = GenRequest(key, ids, sampling, max(1, max_new - (given is not None)), tuple(eos), params,
                         job.cache_salt, lora=job.lora)
        first = True
        if given is not None:
            self.active[key] = seq
            await self._emit(seq, given, done.first_logprob if done is not None else None)
            if key not in self.active:  # finished on its first token (EOS, stop string, max_tokens 1)
                return
        reason: str | None = None
        t0 = time.perf_counter()
        with structlog.contextvars.bound_contextvars(request_id=rid, tenant=job.tenant):
            try:
                gen = self.engine.generate(req)  # type: ignore[attr-defined]
                async for out in gen:
                    if first:
                        first = False
                        first_ms = (time.perf_counter() - t0) * 1000
                        seq.cached_tokens = out.num_cached_tokens
                        if done is None:
                            seq.timings.prefill_ms = first_ms
                        else:
                            # the decoder's first output = pulling the prompt's KV + one step: what the
                            # transfer adds to TTFT here
                            seq.timings.transfer_ms = first_ms
                            self.transfer_ms.append(first_ms)
                            del self.transfer_ms[:-512]
                        with tracing.span_from(headers, "decode.admit", request_id=rid, tenant=job.tenant,
                                               route=str(job.route), prompt_tokens=len(job.prompt_token_ids),
                                               cached_tokens=seq.cached_tokens, local_prefill=done is None,
                                               first_output_ms=round(first_ms, 2), engine="vllm"):
                            pass
                        self.stream_spans[key] = tracing.tracer().start_span(
                            "decode.stream", context=tracing.extract(headers),
                            attributes={"request_id": rid, "tenant": job.tenant, "route": str(job.route),
                                        **self._gen_ai(job)})
                        self.active[key] = seq
                    lps = out.logprobs or []
                    for i, tok in enumerate(out.token_ids):
                        if key not in self.active:
                            break
                        await self._emit(seq, tok, self._wire_lp(lps[i] if i < len(lps) else None))
                    if key not in self.active or out.finished:
                        reason = out.finish_reason
                        break
                await gen.aclose()
            except PromptTooLong as exc:
                await self._error(job, ErrorCode.PROMPT_TOO_LONG, str(exc))
                return
            except UnknownAdapter as exc:  # unloaded by an operator since the check above
                await self._error(job, ErrorCode.MODEL_NOT_FOUND, str(exc))
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.log.exception("vllm_request_failed")
                self.active.pop(key, None)
                await self._error(job, ErrorCode.KV_TRANSFER_FAILED if params else ErrorCode.INTERNAL,
                                  f"vLLM request failed: {exc}")
                return
            if params is not None:
                # vLLM's own NIXL telemetry of the pulls since the last request (one request at a time in
                # the benchmarks: exactly this request's pull)
                xfers = self.engine.drain_transfers()  # type: ignore[attr-defined]
                if xfers:
                    self.log.info("nixl_transfers", request_id=rid, ms=[round(m, 3) for m, _ in xfers],
                                  bytes=[b for _, b in xfers], total_ms=round(sum(m for m, _ in xfers), 3),
                                  total_bytes=sum(b for _, b in xfers))
            if key in self.active:  # vLLM finished before our stop checker did (e.g. aborted inside vLLM)
                await self._finish(seq, "length" if reason == "length" else "stop")
            elif first:  # no output at all
                await self._error(job, ErrorCode.INTERNAL, "vLLM returned no output")

    async def _drop(self, key: str, tokens: list[int] | None = None) -> None:
        if self.active.pop(key, None) is not None:
            with contextlib.suppress(Exception):
                await self.engine.abort(key)  # type: ignore[attr-defined]

    async def _error(self, job: DecodeJob, code: ErrorCode, message: str) -> None:
        self.active.pop(job.key, None)
        await super()._error(job, code, message)

    async def _lease_sweeper(self) -> None:  # no reservations on a vLLM decoder
        return
