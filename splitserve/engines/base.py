"""The engine interface every inference backend implements (hf now; mock and vllm later).

Owns the shared vocabulary between workers and engines: model facts (`ModelInfo`), sampling parameters
(`Sampling`), the prefill result, the engine errors and the KV tensor convention.

KV convention (fixed, shared with the KV transport): one tensor ``[num_layers, 2, num_kv_heads, T, head_dim]``
where index 0 of the second axis holds keys and 1 holds values, T counts tokens from position 0.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

# Called during prefill as soon as one layer's KV for the whole prompt is final: (layer_idx, keys, values),
# keys/values shaped [num_kv_heads, T, head_dim].
LayerHook = Callable[[int, Tensor, Tensor], None]


@dataclass(frozen=True)
class ModelInfo:
    """Static facts about the loaded model that workers and the KV transport size themselves by."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32", "bfloat16"
    max_model_len: int  # prompt + generated tokens may not exceed this
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def kv_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, num_tokens, self.head_dim)

    @property
    def kv_bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class Sampling:
    """How to pick each next token. temperature 0 means greedy; seed None means nondeterministic."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # None: no log-probabilities; k: the chosen token's and the k most likely (raw log-softmax of the logits)
    logprobs: int | None = None
    # min_tokens: these ids (the model's EOS) are masked out of every token at a position below this one
    suppress_ids: tuple[int, ...] = ()
    suppress_before: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and the most likely alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PrefillResult:
    first_token: int  # the token sampled after the prompt (position len(prompt)); not in kv
    kv: Tensor  # [L, 2, H, len(prompt), D], covers the whole prompt including any past_kv prefix
    num_computed_tokens: int  # prompt tokens actually run through the model (the rest came from past_kv)
    first_logprobs: TokenLogprobs | None = None  # when sampling.logprobs was set


@dataclass(frozen=True)
class PrefillRequest:
    """One prompt of a batched prefill (`Engine.prefill_batch`)."""

    token_ids: Sequence[int]
    sampling: Sampling
    past_kv: Tensor | None = None
    lora: str | None = None  # the LoRA adapter to prefill with (None: the base model); past_kv must be its KV


class EngineError(Exception):
    """Base class for errors an engine raises on a bad request (not on bugs)."""


class PromptTooLong(EngineError, ValueError):
    """The prompt leaves no room for a generated token inside the model's maximum length."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        super().__init__(
            f"prompt has {prompt_tokens} tokens; the model's maximum length is {limit} tokens "
            f"(prompt + output), so at most {limit - 1} prompt tokens are accepted"
        )


class UnknownAdapter(EngineError, ValueError):
    """A request names a LoRA adapter the engine has not loaded (or has unloaded)."""

    def __init__(self, name: str, loaded: Sequence[str] = ()) -> None:
        self.name = name
        super().__init__(f"unknown LoRA adapter {name!r}; loaded: {', '.join(map(repr, loaded)) or 'none'}")


class AdapterNotSupported(EngineError, NotImplementedError):
    """The engine cannot serve LoRA adapters (yet)."""

    def __init__(self, engine: str) -> None:
        super().__init__(f"the {engine} engine does not serve LoRA adapters")


class ContextFull(EngineError):
    """A decoding sequence would grow past the model's maximum length; finish it with reason 'length'."""

    def __init__(self, seq_id: str, tokens: int, limit: int) -> None:
        self.seq_id = seq_id
        self.tokens = tokens
        self.limit = limit
        super().__init__(f"sequence {seq_id!r} would reach {tokens} tokens; the model's maximum length is {limit}")


@runtime_checkable
class KvSource(Protocol):
    """A sequence's KV held elsewhere (the landing blocks of a KV transfer), read one layer at a time: an
    engine copies it straight into its own layout, with no whole-sequence intermediate tensor (for a
    3,000-token prompt that tensor was three 138 MB copies into fresh memory, on the decoder's core)."""

    @property
    def num_tokens(self) -> int: ...

    def layer(self, layer: int) -> tuple[Tensor, Tensor]:
        """Keys and values of one layer, each [num_kv_heads, num_tokens, head_dim]."""
        ...

    def copy_layer(self, layer: int, keys_out: Tensor, values_out: Tensor) -> None:
        """Write one layer's keys and values into the given [num_kv_heads, num_tokens, head_dim] views (one
        strided copy, no temporary)."""
        ...


def materialize(kv: Tensor | KvSource, info: ModelInfo) -> Tensor:
    """The KV as one [L, 2, H, T, D] tensor (for engines that keep whole-sequence tensors)."""
    if isinstance(kv, Tensor):
        return kv
    out = torch.empty(info.kv_shape(kv.num_tokens), dtype=getattr(torch, info.dtype))
    for layer in range(info.num_layers):
        out[layer, 0], out[layer, 1] = kv.layer(layer)
    return out


def prompt_ids(token_ids: Sequence[int], info: ModelInfo, past_kv: Tensor | None) -> tuple[list[int], int]:
    """A prefill's checked prompt and how many of its leading tokens past_kv covers. At least the last prompt
    token is always recomputed: its logits give the first new token. Raises PromptTooLong."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("prefill needs at least one prompt token")
    if len(ids) >= info.max_model_len:
        raise PromptTooLong(len(ids), info.max_model_len)
    reused = 0 if past_kv is None else min(check_kv(past_kv, info, "past_kv"), len(ids) - 1)
    return ids, reused


def check_join(num_tokens: int, last_token: int, info: ModelInfo) -> None:
    """A sequence joining the decode batch: its next token must be in the vocabulary (not an embedding
    IndexError failing every sequence's step) and leave room for the token its first step produces."""
    if not 0 <= int(last_token) < info.vocab_size:
        raise ValueError(f"last_token {last_token} is outside the vocabulary (size {info.vocab_size})")
    if num_tokens + 1 >= info.max_model_len:
        raise PromptTooLong(num_tokens + 1, info.max_model_len)


class HfTokenizerMixin:
    """The tokenizer half of the Engine interface, through a Hugging Face tokenizer (hf and mock share it)."""

    tokenizer: Any

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding by default
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def check_kv(kv: Tensor, info: ModelInfo, what: str = "kv") -> int:
    """Validate a KV tensor against the model; returns its token count."""
    if kv.dim() != 5:
        raise ValueError(f"{what} must have 5 dims [L, 2, H, T, D], got shape {tuple(kv.shape)}")
    num_tokens = kv.shape[3]
    if tuple(kv.shape) != info.kv_shape(num_tokens):
        raise ValueError(f"{what} shape {tuple(kv.shape)} does not match the model's {info.kv_shape(num_tokens)}")
    return int(num_tokens)


class Engine(ABC):
    """One model instance: tokenizer, single-sequence prefill, and batched decode of a set of sequences.

    Not thread-safe: a worker drives one engine from one thread (or one asyncio executor slot).
    """

    info: ModelInfo
    # Whether a call can hold its thread for long (computing, or sleeping for compute time): the services then
    # run it on their engine thread, off the event loop. Only an engine whose calls return at once (a zero-cost
    # mock) says False, and its calls run inline (services.common.engine_thread).
    blocking: bool = True

    # -- tokenizer ------------------------------------------------------------------------------------------
    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids for a raw completion prompt (only the special tokens the model expects, e.g. BOS)."""

    @abstractmethod
    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat, ending with the assistant generation prompt."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    # -- prefill --------------------------------------------------------------------------------------------
    @abstractmethod
    def prefill(
        self,
        token_ids: Sequence[int],
        sampling: Sampling,
        *,
        past_kv: Tensor | None = None,
        on_layer: LayerHook | None = None,
        lora: str | None = None,
    ) -> PrefillResult:
        """Compute KV for the prompt and sample the first new token.

        past_kv holds the KV of a prefix of token_ids (cached elsewhere); only the rest is computed. At least
        the last prompt token is always recomputed, because its logits are needed. on_layer fires once per
        layer, in order, with views of the returned kv tensor. lora names a loaded LoRA adapter to run the
        prompt with (None: the base model); past_kv must then have been computed with the same adapter.
        Raises PromptTooLong, UnknownAdapter.
        """

    def prefill_batch(self, requests: Sequence[PrefillRequest]) -> list[PrefillResult]:
        """Prefill several prompts at once; results in request order, each the same as `prefill` would give
        (KV equal up to float summation order, the same greedy tokens). No per-layer hook: it is for short
        prompts, whose KV is pushed in one piece. This default runs them one at a time; an engine that can
        share one forward between them (hf) overrides it. Raises PromptTooLong (for the batch as a whole:
        callers check lengths first, or retry one by one)."""
        return [self.prefill(r.token_ids, r.sampling, past_kv=r.past_kv, lora=r.lora) for r in requests]

    # -- decode ---------------------------------------------------------------------------------------------
    @abstractmethod
    def add_sequence(self, seq_id: str, kv: Tensor | KvSource, last_token: int, sampling: Sampling, *,
                     lora: str | None = None) -> None:
        """Join the decode batch. kv covers the prompt; last_token was sampled after it and is not in kv.
        lora: the LoRA adapter the sequence decodes with (None: the base model), the one its kv was computed
        with. Raises UnknownAdapter."""

    @abstractmethod
    def step(self) -> dict[str, int]:
        """Advance every active sequence by one token in one batched forward; returns seq_id -> new token.

        Raises ContextFull (before computing anything) if a sequence has no room left.
        """

    @abstractmethod
    def remove_sequence(self, seq_id: str, *, keep_kv: bool = True) -> Tensor | None:
        """Leave the batch; returns the sequence's KV [L, 2, H, T, D] (prompt + fed tokens), or None if the
        sequence is unknown or keep_kv is False (skips copying it out)."""

    @abstractmethod
    def active(self) -> int:
        """Number of sequences in the decode batch."""

    def step_logprobs(self) -> dict[str, TokenLogprobs]:
        """The last step's log-probabilities of the sequences whose sampling asked for them."""
        return {}

    def room_for(self, num_tokens: int) -> int:
        """How many more tokens a sequence holding num_tokens (prompt + output so far) may generate."""
        return max(self.info.max_model_len - num_tokens, 0)

    # -- LoRA adapters --------------------------------------------------------------------------------------
    def load_lora(self, name: str, path: str | Path) -> None:
        """Load the PEFT LoRA adapter folder ``path`` as ``name``, for requests to name in prefill and
        add_sequence. ValueError for a name already loaded or a folder the engine cannot serve."""
        raise AdapterNotSupported(type(self).__name__)

    def unload_lora(self, name: str) -> None:
        """Unload adapter ``name``. UnknownAdapter if it is not loaded; ValueError while a decoding sequence
        uses it."""
        raise AdapterNotSupported(type(self).__name__)

    def loras(self) -> list[str]:
        """The names of the loaded LoRA adapters."""
        return []
