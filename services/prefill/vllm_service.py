"""Prefill worker on the ``vllm`` engine.

Each PrefillJob runs on vLLM with ``max_tokens=1`` and the connector's "this KV goes to a remote decoder"
params (NixlConnector: ``do_remote_decode``; vLLM then keeps the prompt's blocks under a lease until the
decoder has pulled them). The params vLLM returns travel in ``PrefillDone.kv_transfer_params`` to the decoder
the router chose, whose vLLM pulls the blocks and decodes. Queueing, cancel of queued jobs, failure reports
and heartbeats are the ``hf`` prefiller's (inherited).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from splitserve.engines import PromptTooLong, UnknownAdapter
from splitserve.engines.generate import GenRequest
from splitserve.obs import tracing
from splitserve.proto import (
    CancelRequest,
    DecodeJob,
    ErrorCode,
    KvHandle,
    LoraAdminRequest,
    PrefillDone,
    PrefillJob,
    Subjects,
    WorkerLoad,
    now_ms,
)
from splitserve.services.common import handoff
from splitserve.services.common.adapters import AdapterSlots
from splitserve.services.common.options import EngineOptions
from splitserve.services.common.sampling import engine_sampling, wire_logprob
from splitserve.services.common.vllm_kv import VllmKvBridge
from splitserve.services.common.vllm_worker import (
    VllmOptions,
    check_lora,
    run_on_loop,
    serve_vllm_metrics,
    vllm_config,
    vllm_load,
)
from splitserve.services.prefill.service import JobFailed, PrefillService


class VllmPrefillService(PrefillService):
    def __init__(self, worker_id: str, nats_url: str, *, opts: EngineOptions, vllm: VllmOptions | None = None,
                 **kw: Any) -> None:
        kw.pop("cache_tokens", None)
        kw.pop("l1_tokens", None)
        kw.pop("layerwise", None)
        super().__init__(worker_id, nats_url, opts=opts, cache_tokens=0, **kw)
        self.vopts = vllm or VllmOptions()
        self.bridge: VllmKvBridge | None = None
        self.lmcache_done: Any = None  # LMCache PD: where its senders report a finished push

    async def setup(self) -> None:
        from splitserve.engines.vllm_engine import VllmEngine

        cfg = vllm_config(self.opts, self.vopts, role="prefill", max_num_seqs=4, worker_id=self.worker_id)
        if cfg.kv_connector is None:
            raise ValueError("a vLLM prefill worker needs a KV connector (--kv-connector nixl|lmcache)")
        check_lora(cfg)
        self.engine = await VllmEngine.start(cfg)  # type: ignore[assignment]
        # as on the vLLM decoder: vLLM does the adapters' LRU itself, "loaded" is its registered set
        self.adapters = AdapterSlots(self.opts.lora_modules, 0, run_on_loop)
        self.adapters.started(self.engine.loras())
        serve_vllm_metrics(self.log)
        if cfg.kv_events_endpoint:
            self.bridge = VllmKvBridge(self.b, self.worker_id, cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint,
                                       engine_block_size=self.engine.block_size,  # type: ignore[attr-defined]
                                       route_block_size=self.vopts.route_block_size)
        if cfg.kv_connector == "lmcache":
            from splitserve.engines.lmcache_pd import DoneListener, proxy_port

            self.lmcache_done = DoneListener(proxy_port(self.worker_id))
        self.log.info("vllm_ready", load_s=round(self.engine.load_seconds or 0, 1),  # type: ignore[attr-defined]
                      connector=cfg.kv_connector, kv_events=cfg.kv_events_endpoint)

    async def start(self) -> None:
        await self.b.subscribe(Subjects.prefill_job(self.worker_id), PrefillJob, self.on_job)
        await self.b.subscribe(Subjects.CANCEL_ALL, CancelRequest, self.on_cancel, scoped=True)
        await self.b.subscribe(Subjects.ADMIN_LORA, LoraAdminRequest, self.on_lora_admin)
        if self.bridge is not None:
            await self.bridge.start()
        self.b.spawn(self._loop())

    async def shutdown(self) -> None:
        for job, _ in list(self.queue):
            await self._fail(job.decode, ErrorCode.WORKER_DIED, f"prefill worker {self.worker_id} is shutting down")
        if self.bridge is not None:
            await self.bridge.close()
        if self.lmcache_done is not None:
            self.lmcache_done.close()
        if hasattr(self, "engine"):
            with contextlib.suppress(Exception):
                await self.engine.close()  # type: ignore[attr-defined]
        self.thread.close()

    def load(self) -> WorkerLoad:
        if not hasattr(self, "engine"):
            return WorkerLoad()
        load = vllm_load(self.engine, active=int(self.current is not None), queued=len(self.queue),
                         route_block_size=self.vopts.route_block_size,
                         cached_blocks=self.bridge.num_blocks() if self.bridge is not None else 0)
        load.queued_prefill_tokens = sum(len(j.decode.prompt_token_ids) for j, _ in self.queue) + (
            len(self.current.prompt_token_ids) if self.current is not None else 0)
        return load

    def heartbeat_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"engine": "vllm", "transport": f"vllm-{self.vopts.kv_connector}",
                                 "block_size": self.vopts.route_block_size}
        if hasattr(self, "engine"):
            extra.update(model=self.model_name, max_model_len=self.engine.info.max_model_len,
                         adapters=self.adapters.loaded(), adapters_available=self.adapters.available())
        return extra

    def remote_decode_params(self, job: DecodeJob) -> dict[str, Any]:
        """The connector's per-request params telling vLLM this prompt's KV goes to a remote decoder."""
        if self.vopts.kv_connector == "lmcache":
            from splitserve.engines.lmcache_pd import prefill_params

            return prefill_params(job.key, job.decoder_id, tp_size=self.vopts.tensor_parallel_size)
        return {"do_remote_decode": True}

    async def _run(self, job: DecodeJob) -> None:
        started_ms = now_ms()
        if job.deadline_ms is not None and now_ms() > job.deadline_ms:
            raise JobFailed(ErrorCode.EXPIRED, "the request's deadline passed before prefill started")
        ids = list(job.prompt_token_ids)
        sampling = engine_sampling(job.sampling, len(ids), self.engine.info.eos_token_ids)
        # the engine's request id is proto.request_key: two tenants' requests may share an id
        try:
            await self.adapters.ensure(self.engine, job.lora)  # served here (registered with vLLM), or refused
        except UnknownAdapter as exc:
            raise JobFailed(ErrorCode.MODEL_NOT_FOUND, str(exc)) from None
        # the same adapter as the decoder's: the KV it pulls is this adapter's
        req = GenRequest(job.key, ids, sampling, 1, (), self.remote_decode_params(job), job.cache_salt,
                         lora=job.lora)
        first: int | None = None
        first_lp = None
        cached = 0
        params: dict[str, Any] | None = None
        with tracing.tracer().start_as_current_span("prefill.compute") as csp:
            t0 = time.perf_counter()
            try:
                async for out in self.engine.generate(req):  # type: ignore[attr-defined]
                    if out.token_ids and first is None:
                        first = out.token_ids[0]
                        first_lp = out.logprobs[0] if out.logprobs else None
                    cached = max(cached, out.num_cached_tokens)
                    if out.finished:
                        params = out.kv_transfer_params
            except PromptTooLong as exc:
                raise JobFailed(ErrorCode.PROMPT_TOO_LONG, str(exc)) from None
            except UnknownAdapter as exc:  # unloaded by an operator since the check above
                raise JobFailed(ErrorCode.MODEL_NOT_FOUND, str(exc)) from None
            prefill_ms = (time.perf_counter() - t0) * 1000
            csp.set_attribute("prefill.tokens", len(ids))
            csp.set_attribute("prefill.cached_tokens", cached)
            csp.set_attribute("prefill.ms", round(prefill_ms, 2))
            csp.set_attribute("engine", "vllm")
        if first is None:
            raise JobFailed(ErrorCode.INTERNAL, "vLLM returned no token for the prefill")
        if params is None and self.vopts.kv_connector == "nixl":
            raise JobFailed(ErrorCode.KV_TRANSFER_FAILED, "vLLM returned no kv_transfer_params for the decoder")
        if self.lmcache_done is not None:
            # LMCache pushes after the prefill step; every TP rank reports when its part has landed
            try:
                await self.lmcache_done.wait(job.key, self.vopts.tensor_parallel_size)
            except TimeoutError:
                raise JobFailed(ErrorCode.KV_TRANSFER_FAILED,
                                f"LMCache did not confirm the KV push to {job.decoder_id}") from None
            params = {"connector": "lmcache", "first_token": first}
        nbytes = (len(ids) - cached) * self.engine.info.kv_bytes_per_token
        done = PrefillDone(
            request_id=job.request_id, first_token=first,
            kv=KvHandle(transfer_id=job.request_id, num_tokens=len(ids), cached_tokens=cached, kv_bytes=nbytes,
                        transport=f"vllm-{self.vopts.kv_connector}", prefill_ms=prefill_ms, transfer_ms=0.0,
                        started_ms=started_ms),
            decode=job, kv_transfer_params=params or {}, first_logprob=wire_logprob(self.engine, first_lp))
        # delivered until the decoder answers (splitserve.services.common.handoff): awaited here, so a draining
        # prefiller
        # finishes its hand-offs before it exits (one round trip; a lost copy costs ACK_TIMEOUT_S)
        await handoff.hand_over(self.b, Subjects.kv_ready(job.decoder_id), done, self.log)
        self.log.info("prefilled", request_id=job.request_id, tokens=len(ids), cached_tokens=cached,
                      prefill_ms=round(prefill_ms, 1), decoder=job.decoder_id, engine="vllm")
