"""Test doubles for the front door's Backend: scripted token streams with no NATS behind them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from splitserve import proto
from splitserve.client import Delta, Result
from splitserve.errors import SplitserveError
from splitserve.services.frontend.openai_api import GenerateArgs
from splitserve.tenancy.config import TenantsConfig

MODEL = "tiny-model"


def make_result(text: str, *, request_id: str = "r", finish: str = "stop", prompt_tokens: int = 7,
                completion_tokens: int | None = None, cached: int = 3) -> Result:
    n = completion_tokens or len(text.split())
    return Result(request_id=request_id, text=text, token_ids=[1] * n, finish_reason=finish,
                  usage=proto.Usage(prompt_tokens=prompt_tokens, completion_tokens=n, cached_tokens=cached),
                  route="direct", prefill_worker=None, decode_worker="decode-0", ttft_ms=12.5, total_ms=40.0,
                  timings=proto.Timings(queue_ms=1.0), decision={})


@dataclass
class Script:
    """What one request does: these deltas, then a result (or an error at ``error_at``, or a hang)."""

    deltas: list[str] = field(default_factory=lambda: ["Hello", ",", " world"])
    finish: str = "stop"
    error: SplitserveError | None = None
    error_at: int | None = None  # raise before this delta index (None: after the last delta)
    hang_after: int | None = None  # wait forever before this delta index


class FakeStream:
    def __init__(self, script: Script, request_id: str) -> None:
        self.script = script
        self.request_id = request_id
        self.result: Result | None = None
        self.started = False
        self.closed = False
        self.yielded = 0

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._run()

    async def _run(self) -> AsyncIterator[Delta]:
        s = self.script
        self.started = True
        try:
            for i, text in enumerate(s.deltas):
                if s.error is not None and s.error_at == i:
                    raise s.error
                if s.hang_after == i:
                    await asyncio.Event().wait()
                self.yielded += 1
                yield Delta(request_id=self.request_id, seq=i, text=text, token_ids=[i])
            if s.error is not None:
                raise s.error
            self.result = make_result("".join(s.deltas), request_id=self.request_id, finish=s.finish,
                                      completion_tokens=len(s.deltas))
        finally:
            self.closed = True


@dataclass
class FakeBackend:
    metrics_text: bytes = b"splitserve_requests_total 0.0\n"
    model: str | None = MODEL
    max_len: int | None = 8192
    # Several served models (name -> max_model_len, in the backend's order); None: the one of ``model``.
    models: dict[str, int | None] | None = None
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapter -> its base model
    tenants: TenantsConfig | None = None  # whose contract names which models (None: every tenant, every model)
    ready: bool = True
    script: Script = field(default_factory=Script)
    on_generate: Callable[[GenerateArgs], None] | None = None
    calls: list[tuple[GenerateArgs, str, str]] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    def metrics(self) -> bytes:
        return self.metrics_text

    @property
    def served_models(self) -> dict[str, int | None]:
        if self.models is not None:
            return dict(self.models)
        return {self.model: self.max_len} if self.model else {}

    @property
    def served_adapters(self) -> dict[str, str]:
        return dict(self.adapters)

    @property
    def model_name(self) -> str | None:
        return next(iter(self.models), None) if self.models is not None else self.model

    @property
    def max_model_len(self) -> int | None:
        return next(iter(self.models.values()), None) if self.models is not None else self.max_len

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        return self.ready, {"missing": [] if self.ready else ["decode"]}

    def generate(self, args: GenerateArgs, *, tenant: str, request_id: str) -> FakeStream:
        if self.on_generate is not None:
            self.on_generate(args)
        self.calls.append((args, tenant, request_id))
        st = FakeStream(self.script, request_id)
        self.streams.append(st)
        return st

    async def cancel_request(self, request_id: str) -> None:
        self.cancelled.append(request_id)
