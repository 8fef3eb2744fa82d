"""The generate-level engine interface: for engines that own their KV cache (vLLM).

The KV-level :class:`splitserve.engines.base.Engine` (prefill returns KV, decode takes KV) is how the ``hf``
engine lets splitserve move KV itself. An engine that keeps KV in its own paged cache and moves it with its
own connectors (vLLM: NixlConnector, LMCache) cannot hand out KV tensors; it takes whole requests instead.
A worker checks ``manages_kv`` and drives such an engine through :meth:`GenerateEngine.generate`.

Disaggregation at this level is the connectors' protocol: the prefiller runs the request with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": True}``; what it returns in
``GenOutput.kv_transfer_params`` travels (over NATS, in ``PrefillDone``) to the chosen decoder, which runs
the full request with those params and pulls the KV from the prefiller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from splitserve.engines.base import Engine, ModelInfo, Sampling, TokenLogprobs


@dataclass(frozen=True)
class GenRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()  # stop after emitting one of these (usually the model's EOS ids)
    kv_transfer_params: dict[str, Any] | None = None  # the connector's params (see the module doc)
    # Scopes the engine's own prefix cache (vLLM's ``cache_salt``): the router's per-tenant / cache-group salt.
    cache_salt: str | None = None
    lora: str | None = None  # a LoRA adapter the engine has loaded (None: the base model)


@dataclass
class GenOutput:
    """One step's new tokens of a request; the last one has ``finished`` set."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" when finished
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (or pulled from a prefiller)
    kv_transfer_params: dict[str, Any] | None = None  # the prefiller's answer, for the decoder
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the sampling asked for them


@dataclass
class EngineLoad:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of the engine's KV blocks in use
    num_blocks: int = 0
    block_size: int = 0
    prefix_hit_rate: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class GenerateEngine(ABC):
    """An engine driven request by request (it batches internally); all methods run on the event loop."""

    info: ModelInfo
    manages_kv = True

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    @abstractmethod
    def generate(self, req: GenRequest) -> AsyncIterator[GenOutput]:
        """Stream the request's tokens. Raises PromptTooLong for a prompt with no room left."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request and free what it holds; unknown ids are ignored."""

    @abstractmethod
    def load(self) -> EngineLoad: ...

    @abstractmethod
    async def close(self) -> None: ...

    def room_for(self, num_tokens: int) -> int:
        return max(self.info.max_model_len - num_tokens, 0)


class KvEngineAdapter(GenerateEngine):
    """A KV-level :class:`Engine` (``hf``) behind the generate-level interface: one driver task admits
    requests (prefill) between batched decode steps, all engine calls on one worker thread.

    This lets code (and the shared contract tests) drive every engine one way; the workers still drive
    ``hf`` at the KV level, because splitserve moves its KV.
    """

    manages_kv = False

    def __init__(self, engine: Engine) -> None:
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        self.engine = engine
        self.info = engine.info
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-adapter")
        self._queues: dict[str, asyncio.Queue[GenOutput]] = {}
        self._pending: list[GenRequest] = []
        self._live: dict[str, tuple[GenRequest, int]] = {}  # request id -> (request, tokens emitted)
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.engine.apply_chat_template(messages)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.engine.decode(ids, skip_special_tokens)

    async def _run(self, fn: Any, *args: Any) -> Any:
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def generate(self, req: GenRequest) -> AsyncIterator[GenOutput]:
        import asyncio

        from splitserve.engines.base import PromptTooLong

        if len(req.prompt_token_ids) >= self.info.max_model_len:
            raise PromptTooLong(len(req.prompt_token_ids), self.info.max_model_len)
        q: asyncio.Queue[GenOutput] = asyncio.Queue()
        self._queues[req.request_id] = q
        self._pending.append(req)
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await q.get()
                finished = out.finished
                if isinstance(out.kv_transfer_params, dict) and "error" in out.kv_transfer_params:
                    raise RuntimeError(out.kv_transfer_params["error"])
                yield out
        finally:
            if not finished:
                await self.abort(req.request_id)
            self._queues.pop(req.request_id, None)

    def _emit(self, rid: str, token: int, done: list[str]) -> None:
        """Event loop: account one token of a live request and hand it to its consumer."""
        req, n = self._live[rid]
        n += 1
        self._live[rid] = (req, n)
        reason = "stop" if token in req.stop_token_ids else ("length" if n >= req.max_tokens else None)
        if reason is not None:
            del self._live[rid]
            done.append(rid)
        q = self._queues.get(rid)
        if q is not None:
            q.put_nowait(GenOutput([token], finished=reason is not None, finish_reason=reason))

    def _admit(self, req: GenRequest) -> int:
        res = self.engine.prefill(req.prompt_token_ids, req.sampling, lora=req.lora)
        self.engine.add_sequence(req.request_id, res.kv, res.first_token, req.sampling, lora=req.lora)
        return res.first_token

    def _remove(self, ids: list[str]) -> None:
        for rid in ids:
            self.engine.remove_sequence(rid, keep_kv=False)

    async def _drive(self) -> None:
        done: list[str] = []
        while True:
            try:
                if done:
                    finished, done = done, []
                    await self._run(self._remove, finished)
                if self._pending:
                    req = self._pending.pop(0)
                    first = await self._run(self._admit, req)
                    self._live[req.request_id] = (req, 0)
                    self._emit(req.request_id, first, done)
                elif self._live:
                    for rid, tok in (await self._run(self.engine.step)).items():
                        if rid in self._live:
                            self._emit(rid, tok, done)
                elif not done:
                    self._wake.clear()
                    await self._wake.wait()
            except Exception as exc:  # fail every request in flight, keep the driver alive
                for rid in list(self._live):
                    await self.abort(rid)
                    q = self._queues.get(rid)
                    if q is not None:
                        q.put_nowait(GenOutput([], finished=True, finish_reason="abort",
                                               kv_transfer_params={"error": str(exc)}))

    async def abort(self, request_id: str) -> None:
        self._pending = [r for r in self._pending if r.request_id != request_id]
        if self._live.pop(request_id, None) is not None:
            await self._run(self._remove, [request_id])

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self._live), waiting=len(self._pending))

    async def close(self) -> None:
        if self._driver is not None:
            self._driver.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
