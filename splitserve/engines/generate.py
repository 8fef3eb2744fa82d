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

from splitserve.engines.base import ModelInfo, Sampling


@dataclass(frozen=True)
class GenRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()  # stop after emitting one of these (usually the model's EOS ids)
    kv_transfer_params: dict[str, Any] | None = None  # the connector's params (see the module doc)


@dataclass
class GenOutput:
    """One step's new tokens of a request; the last one has ``finished`` set."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" when finished
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (or pulled from a prefiller)
    kv_transfer_params: dict[str, Any] | None = None  # the prefiller's answer, for the decoder


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
