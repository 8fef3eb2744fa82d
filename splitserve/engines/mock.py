"""The `mock` engine: NOT a model. Deterministic fake tokens for control-plane load tests only.

Owns a cheap stand-in for a real backend so queue throughput, fairness and failover can be exercised with
hundreds of requests on a small machine: the real tokenizer (so token ids agree with the router's), tiny but
real KV tensors (so the KV transports move real bytes), and sleeps instead of forward passes:

- prefill sleeps ``computed_tokens / prefill_tokens_per_s`` seconds (default 50,000 tokens/s);
- each batched ``step()`` sleeps ``step_ms`` once, plus ``step_ms_per_seq`` for each active sequence (default
  5 ms and 0: a real engine's step grows with its batch, which is what makes inter-token latency depend on
  where a request is routed; the SLO-aware router learns that slope from the decoders' heartbeats).

They are loader options, also read from ``SPLITSERVE_MOCK_STEP_MS``, ``SPLITSERVE_MOCK_STEP_MS_PER_SEQ`` and
``SPLITSERVE_MOCK_PREFILL_TPS`` so that ``splitserve up --engine mock`` and the services can be tuned without new
flags (0 disables a sleep). With no sleep left (step times 0, prefill 0 or at least ``ZERO_COST_TPS``, no adapter
load time) the engine is zero-cost: ``blocking`` is False and the services call it inline, not on their engine
thread.

Output: the token at position p is a pure function of (token at p - 1, p, sampling seed), drawn from the
largest run of ordinary ids in the vocabulary, so it never emits EOS or a special token (sequences finish by
max_tokens, stop strings or the length limit). Greedy sampling ignores the seed, as a real model's would.

KV: ``mock_kv`` fills keys with the token id and values with minus the position (plus a fixed per-element
offset), so a transfer test can check the bytes that arrived without running the engine.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from splitserve.engines.base import (
    ContextFull,
    Engine,
    HfTokenizerMixin,
    KvSource,
    LayerHook,
    ModelInfo,
    PrefillResult,
    Sampling,
    TokenLogprobs,
    UnknownAdapter,
    check_join,
    check_kv,
    materialize,
    prompt_ids,
)
from splitserve.engines.hf_export import tokenizer_folder
from splitserve.engines.model_files import resolve_model
from splitserve.engines.sampling import _splitmix64

log = logging.getLogger(__name__)

WARNING = "mock engine: not a model; deterministic fake tokens for control-plane load tests"
STEP_MS_ENV = "SPLITSERVE_MOCK_STEP_MS"
STEP_MS_PER_SEQ_ENV = "SPLITSERVE_MOCK_STEP_MS_PER_SEQ"
PREFILL_TPS_ENV = "SPLITSERVE_MOCK_PREFILL_TPS"
# What loading one LoRA adapter costs (ms, spent in load_lora): the control plane's adapter benchmark measures
# what on-demand loads do to latency (on a GPU, tens to hundreds of ms per adapter).
LORA_LOAD_MS_ENV = "SPLITSERVE_MOCK_LORA_LOAD_MS"
DEFAULT_STEP_MS = 5.0
DEFAULT_PREFILL_TPS = 50_000.0
# A prefill rate at or above this is no prefill time at all (a 100,000-token prompt: under 100 us): no sleep, which
# would cost more than that itself (a sleep's timer slack alone is ~50 us)
ZERO_COST_TPS = 1e9
DEFAULT_MAX_MODEL_LEN = 8192
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MASK64 = (1 << 64) - 1
# per-element offsets step by 1/64: exact in float32 for every token id and position below 2^17
_OFFSET_SCALE = 1 / 64


def _knob(value: float | None, env: str, default: float) -> float:
    """An explicit option wins over the environment, which wins over the default."""
    if value is None:
        raw = os.environ.get(env, "").strip()
        if not raw:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{env} must be a number, got {raw!r}") from None
    if not value >= 0:  # also rejects NaN
        raise ValueError(f"{env.removeprefix('SPLITSERVE_MOCK_').lower()} must be >= 0, got {value}")
    return float(value)


@functools.lru_cache(maxsize=4)
def _load_tokenizer(directory: Path, gguf_file: str | None) -> Any:
    # Tokenizer only, never weights: the same files the router tokenizes with, so ids agree. Cached because
    # tests and benchmarks build several engines in one process and the GGUF tokenizer takes seconds. Once
    # transformers has vouched for these files on this machine, without transformers (about 1 CPU-s less per
    # worker start: splitserve.engines.light_tokenizer).
    from splitserve.engines.light_tokenizer import vouch, vouched
    from splitserve.engines.tokenizer_load import load_tokenizer

    if not gguf_file and (light := vouched(directory)) is not None:
        return light
    tok = load_tokenizer(directory, gguf_file or None, local_files_only=True)
    if not gguf_file:
        vouch(directory, tok)  # for the next start
    return tok


def ordinary_token_range(tokenizer: Any, exclude: Sequence[int] = ()) -> range:
    """The longest run of consecutive ids that are neither special/added tokens nor in `exclude`."""
    vocab = len(tokenizer)
    special = {int(t) for t in getattr(tokenizer, "all_special_ids", ())}
    special |= {int(t) for t in getattr(tokenizer, "added_tokens_decoder", {})}
    special |= {int(t) for t in exclude}
    best, start = range(0), 0
    for cut in [*sorted(t for t in special if 0 <= t < vocab), vocab]:
        if cut - start > len(best):
            best = range(start, cut)
        start = cut + 1
    if not best:
        raise ValueError("the tokenizer has no ordinary (non-special) token ids")
    return best


def mock_kv(token_ids: Sequence[int], info: ModelInfo, start: int = 0) -> Tensor:
    """KV the mock engine computes for token_ids at positions start, start+1, ...: [L, 2, H, T, D].

    keys[l, h, t, d] = token_id + offset, values[l, h, t, d] = -(position + offset), with
    offset = (l*H*D + h*D + d) / 64, so every element says which token, position and slot it belongs to.

    Computed in numpy (float64, then cast): the same values torch gives, at a fraction of its per-operation
    cost. The mock is the zero-cost engine of the control plane's load tests (bench.peers), where building
    this tiny tensor with torch was about a tenth of a decoder's CPU per request.
    """
    num = len(token_ids)
    offset = _kv_offset(info.num_layers, info.num_kv_heads, info.head_dim)
    tokens = np.fromiter(token_ids, dtype=np.float64, count=num).reshape(1, 1, num, 1)
    positions = np.arange(start, start + num, dtype=np.float64).reshape(1, 1, num, 1)
    kv = np.stack((tokens + offset, -(positions + offset)), axis=1)
    if info.dtype == "float32":
        return torch.from_numpy(kv.astype(np.float32))
    return torch.from_numpy(kv).to(getattr(torch, info.dtype))  # bfloat16 has no numpy type: torch casts


@functools.lru_cache(maxsize=8)
def _kv_offset(layers: int, heads: int, dim: int) -> np.ndarray:
    offset = np.arange(layers * heads * dim, dtype=np.float64).reshape(layers, heads, 1, dim) * _OFFSET_SCALE
    offset.flags.writeable = False  # shared by every call
    return offset


@dataclass
class _Seq:
    kv: Tensor  # what add_sequence was given (a private copy)
    last_token: int  # fed at position `length` by the next step
    key: int  # the sampling key the next tokens derive from
    fed: list[int] = field(default_factory=list)  # tokens steps have fed (positions kv_len, kv_len + 1, ...)
    sampling: Sampling = field(default_factory=Sampling)
    lora: str | None = None

    @property
    def length(self) -> int:  # tokens in KV
        return int(self.kv.shape[3]) + len(self.fed)


class MockEngine(HfTokenizerMixin, Engine):
    """Engine with a real tokenizer, fake deterministic tokens, tiny real KV, and sleeps for compute time."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        name: str = "mock",
        max_model_len: int | None = None,
        dtype: str = "float32",
        step_ms: float | None = None,
        prefill_tokens_per_s: float | None = None,
        step_ms_per_seq: float | None = None,
        num_layers: int = 2,
        num_kv_heads: int = 1,
        head_dim: int = 8,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        log.warning(WARNING)
        self.tokenizer = tokenizer
        self.step_ms = _knob(step_ms, STEP_MS_ENV, DEFAULT_STEP_MS)
        self.step_ms_per_seq = _knob(step_ms_per_seq, STEP_MS_PER_SEQ_ENV, 0.0)
        self.prefill_tokens_per_s = _knob(prefill_tokens_per_s, PREFILL_TPS_ENV, DEFAULT_PREFILL_TPS)
        eos = tuple(dict.fromkeys(int(t) for t in [tokenizer.eos_token_id] if t is not None))
        self.info = ModelInfo(
            # the name is what heartbeats and `splitserve top` show: it must never pass for a real model
            name=name if name.startswith("mock") else f"mock-{name}",
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            max_model_len=max_model_len or DEFAULT_MAX_MODEL_LEN,
            eos_token_ids=eos,
            vocab_size=len(tokenizer),
        )
        self.dtype: torch.dtype = DTYPES[dtype]
        self.token_range = ordinary_token_range(tokenizer, eos)
        self.load_seconds: float | None = None
        self._seqs: dict[str, _Seq] = {}
        self._step_lp: dict[str, TokenLogprobs] = {}
        self._loras: dict[str, Path] = {}

    @property
    def blocking(self) -> bool:  # type: ignore[override]
        """False when nothing here sleeps: no step time, no prefill time worth a sleep (at ``ZERO_COST_TPS`` or
        more), no adapter load time. Its calls then run inline on the services' event loop."""
        return (self.step_ms > 0 or self.step_ms_per_seq > 0 or 0 < self.prefill_tokens_per_s < ZERO_COST_TPS
                or _knob(None, LORA_LOAD_MS_ENV, 0.0) > 0)

    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        *,
        dtype: str = "float32",
        num_threads: int | None = None,
        max_model_len: int | None = None,
        name: str | None = None,
        step_ms: float | None = None,
        prefill_tokens_per_s: float | None = None,
        step_ms_per_seq: float | None = None,
        **ignored: Any,
    ) -> MockEngine:
        """Load only the tokenizer of `model` (default: the bundled SmolLM2), offline; no weights.

        Accepts every option the hf loader does (num_threads is moot: nothing here computes); unknown
        options are ignored so that services passing newer options still start a mock.
        """
        del num_threads
        if ignored:
            log.debug("mock engine: ignoring options %s", sorted(ignored))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        source = resolve_model(model)
        started = time.perf_counter()
        files = tokenizer_folder(source)
        tokenizer = _load_tokenizer(files.directory, files.gguf_file)
        engine = cls(
            tokenizer,
            name=name or f"mock-{source.name}",
            max_model_len=max_model_len,
            dtype=dtype,
            step_ms=step_ms,
            prefill_tokens_per_s=prefill_tokens_per_s,
            step_ms_per_seq=step_ms_per_seq,
        )
        engine.load_seconds = time.perf_counter() - started
        return engine

    # -- fake model -----------------------------------------------------------------------------------------
    def _key(self, sampling: Sampling) -> int:
        # a real greedy pick does not depend on the seed; sampled output does (an unseeded one acts as seed 0,
        # so even "random" load-test traffic is reproducible)
        if sampling.greedy:
            return 0
        return _splitmix64(((sampling.seed or 0) + 1) & _MASK64)

    def logprobs_of(self, token: int, sampling: Sampling) -> TokenLogprobs | None:
        """Honest log-probabilities of the fake distribution: greedy output is a point mass (log 1 = 0, no
        alternative has any mass); sampled output is uniform over the ordinary-token range."""
        n = sampling.logprobs
        if n is None:
            return None
        if sampling.greedy:
            return TokenLogprobs(token, 0.0, ((token, 0.0),) if n else ())
        lp = -math.log(len(self.token_range))
        others = [t for t in range(self.token_range.start, self.token_range.start + n + 1) if t != token]
        return TokenLogprobs(token, lp, tuple((t, lp) for t in [token, *others][:n]))

    def next_token(self, previous: int, position: int, key: int) -> int:
        """The token at `position` after `previous` (the token at position - 1): a pure function."""
        mixed = _splitmix64(_splitmix64(key ^ (previous & _MASK64)) ^ (position & _MASK64))
        return self.token_range.start + mixed % len(self.token_range)

    # -- LoRA adapters --------------------------------------------------------------------------------------
    # Names only: the mock computes no model output, so an adapter changes nothing it returns (its tokens are
    # the same with or without one). It keeps the names so that control-plane tests see the same accepted and
    # refused requests (UnknownAdapter, unload while in use) as on the hf engine.
    def load_lora(self, name: str, path: str | Path) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter name must be a non-empty string, not {name!r}")
        if name in self._loras:
            raise ValueError(f"adapter {name!r} is loaded already (unload it first)")
        load_ms = _knob(None, LORA_LOAD_MS_ENV, 0.0)
        if load_ms > 0:
            time.sleep(load_ms / 1000)  # (the engine thread: a load holds the engine, as a real one does)
        self._loras[name] = Path(path)

    def unload_lora(self, name: str) -> None:
        self._check_lora(name)
        users = [sid for sid, seq in self._seqs.items() if seq.lora == name]
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(users)} decoding sequence(s): "
                             f"{', '.join(users[:5])}")
        del self._loras[name]

    def loras(self) -> list[str]:
        return list(self._loras)

    def _check_lora(self, name: str | None) -> None:
        if name is not None and name not in self._loras:
            raise UnknownAdapter(name, list(self._loras))

    # -- tokenizer ------------------------------------------------------------------------------------------
    # -- prefill --------------------------------------------------------------------------------------------
    def prefill(
        self,
        token_ids: Sequence[int],
        sampling: Sampling,
        *,
        past_kv: Tensor | None = None,
        on_layer: LayerHook | None = None,
        lora: str | None = None,
    ) -> PrefillResult:
        self._check_lora(lora)
        ids, reused = prompt_ids(token_ids, self.info, past_kv)
        out = torch.empty(self.info.kv_shape(len(ids)), dtype=self.dtype)
        if past_kv is not None and reused:
            out[:, :, :, :reused] = past_kv[:, :, :, :reused]
        out[:, :, :, reused:] = mock_kv(ids[reused:], self.info, start=reused)
        computed = len(ids) - reused
        if 0 < self.prefill_tokens_per_s < ZERO_COST_TPS:
            time.sleep(computed / self.prefill_tokens_per_s)
        if on_layer is not None:
            for layer in range(self.info.num_layers):
                on_layer(layer, out[layer, 0], out[layer, 1])
        first = self.next_token(ids[-1], len(ids), self._key(sampling))
        return PrefillResult(first_token=first, kv=out, num_computed_tokens=computed,
                             first_logprobs=self.logprobs_of(first, sampling))

    # -- decode ---------------------------------------------------------------------------------------------
    def add_sequence(self, seq_id: str, kv: Tensor | KvSource, last_token: int, sampling: Sampling, *,
                     lora: str | None = None) -> None:
        self._check_lora(lora)
        kv = materialize(kv, self.info)
        num_tokens = check_kv(kv, self.info)
        check_join(num_tokens, last_token, self.info)
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already active")
        # a copy: decoders hand in views of landing buffers they reuse as soon as this returns
        own = kv.to(dtype=self.dtype, device="cpu", copy=True)
        self._seqs[seq_id] = _Seq(own, int(last_token), self._key(sampling), sampling=sampling, lora=lora)

    def step(self) -> dict[str, int]:
        self._step_lp = {}
        if not self._seqs:
            return {}
        for seq_id, seq in self._seqs.items():
            if seq.length + 2 > self.info.max_model_len:
                raise ContextFull(seq_id, seq.length + 2, self.info.max_model_len)
        step_ms = self.step_ms + self.step_ms_per_seq * len(self._seqs)
        if step_ms > 0:
            time.sleep(step_ms / 1000)  # once per batch: a batched forward costs about one step, plus its batch
        out: dict[str, int] = {}
        for seq_id, seq in self._seqs.items():
            token = self.next_token(seq.last_token, seq.length + 1, seq.key)
            seq.fed.append(seq.last_token)
            seq.last_token = token
            out[seq_id] = token
            lp = self.logprobs_of(token, seq.sampling)
            if lp is not None:
                self._step_lp[seq_id] = lp
        return out

    def step_logprobs(self) -> dict[str, TokenLogprobs]:
        return self._step_lp

    def remove_sequence(self, seq_id: str, *, keep_kv: bool = True) -> Tensor | None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None or not keep_kv:
            return None
        if not seq.fed:
            return seq.kv
        # the fed tokens' KV is built only now: steps stay O(batch) integer work, no tensor traffic
        return torch.cat((seq.kv, mock_kv(seq.fed, self.info, start=int(seq.kv.shape[3]))), dim=3)

    def active(self) -> int:
        return len(self._seqs)

    def active_ids(self) -> list[str]:
        return list(self._seqs)
