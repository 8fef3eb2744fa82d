"""The `hf` engine: transformers + torch, a real model with real KV, runs anywhere (CPU default).

Owns model/tokenizer loading (offline), prefill with prefix reuse and per-layer hooks, and batched decode.
LoRA adapters (splitserve.engines.lora) are applied per row: one prefill batch or decode step may mix the
base model and several adapters.
Supports decoder-only models whose layers all use full attention (Llama family, SmolLM2, Qwen2, Mistral
without sliding window...).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import get_layer_types_and_kwargs

from splitserve.engines.attention import row_groups, use_gqa_sdpa
from splitserve.engines.base import (
    ContextFull,
    Engine,
    HfTokenizerMixin,
    KvSource,
    LayerHook,
    ModelInfo,
    PrefillRequest,
    PrefillResult,
    Sampling,
    TokenLogprobs,
    check_join,
    check_kv,
    prompt_ids,
)
from splitserve.engines.batch import DecodeBatch
from splitserve.engines.hf_export import loadable
from splitserve.engines.kvcache import BatchCache, PrefillCache
from splitserve.engines.lora import LoraSet
from splitserve.engines.model_files import resolve_model
from splitserve.engines.sampling import sample_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Config fields of models whose logits are not just lm_head(last hidden state): their prompts are prefilled
# one at a time (the batched path computes logits from the decoder's hidden states itself).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _model_info(model: Any, tokenizer: Any, name: str, max_model_len: int | None) -> ModelInfo:
    config = model.config.get_text_config(decoder=True)
    # the same rule transformers uses to pick cache layer types: our buffer caches model full attention only
    layer_types, _ = get_layer_types_and_kwargs(config)
    if set(layer_types) != {"full_attention"} or len(layer_types) != config.num_hidden_layers:
        raise ValueError(f"the hf engine supports full-attention models only; {name} has {set(layer_types)}")
    num_heads = config.num_attention_heads
    eos: list[int] = []
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        for token in source if isinstance(source, list | tuple) else [source]:
            if token is not None and int(token) not in eos:
                eos.append(int(token))
    return ModelInfo(
        name=name,
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        dtype=str(model.dtype).removeprefix("torch."),
        max_model_len=max_model_len or config.max_position_embeddings,
        eos_token_ids=tuple(eos),
        vocab_size=config.vocab_size,
    )


class HfEngine(HfTokenizerMixin, Engine):
    """Engine over an in-memory transformers causal LM and its tokenizer (see `load` for files)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str = "model",
        max_model_len: int | None = None,
        num_threads: int | None = None,
        kv_headroom: int = 64,
        gqa_sdpa: bool = True,
    ) -> None:
        if num_threads is not None:
            # process-wide in torch: workers pinned to N cores should pass N
            torch.set_num_threads(num_threads)
        self.model = model.eval()
        # switches the model in place (stock SDPA -> masked-GQA SDPA with per-row-group attention)
        grouped = use_gqa_sdpa(self.model) if gqa_sdpa else False
        self.tokenizer = tokenizer
        self.info = _model_info(model, tokenizer, name, max_model_len)
        self.dtype: torch.dtype = model.dtype
        self.device: torch.device = model.device
        self.load_seconds: float | None = None
        self._batch = DecodeBatch(self.info, self.dtype, self.device, min_headroom=kv_headroom, grouped=grouped)
        self._step_lp: dict[str, TokenLogprobs] = {}
        self.adapters = LoraSet(self.model)
        config = model.config.get_text_config(decoder=True)
        self._batch_prefill = (
            all(getattr(config, f, None) in (None, 1, 1.0) for f in _LOGIT_TRANSFORMS)
            and model.get_output_embeddings() is not None
        )

    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        *,
        dtype: str = "float32",
        num_threads: int | None = None,
        max_model_len: int | None = None,
        name: str | None = None,
        kv_headroom: int = 64,
    ) -> HfEngine:
        """Load a model from local files (default: the bundled SmolLM2-135M-Instruct GGUF), fully offline."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        # local_files_only is what keeps this load offline; the variable also covers child processes
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if num_threads is not None:
            torch.set_num_threads(num_threads)  # before loading: GGUF dequantisation uses the pool too
        source = resolve_model(model)
        started = time.perf_counter()
        # A GGUF from its converted folder (the same weights; a GGUF is parsed and dequantised on every load).
        files = loadable(source, dtype)
        kwargs: dict[str, Any] = {"local_files_only": True}
        if files.gguf_file:
            kwargs["gguf_file"] = files.gguf_file
        tokenizer = AutoTokenizer.from_pretrained(files.directory, **kwargs)
        hf_model = AutoModelForCausalLM.from_pretrained(files.directory, dtype=DTYPES[dtype], **kwargs)
        engine = cls(
            hf_model,
            tokenizer,
            name=name or source.name,
            max_model_len=max_model_len,
            num_threads=num_threads,
            kv_headroom=kv_headroom,
        )
        engine.load_seconds = time.perf_counter() - started
        return engine

    # -- LoRA adapters --------------------------------------------------------------------------------------
    def load_lora(self, name: str, path: str | Path) -> None:
        self.adapters.load(name, path)

    def unload_lora(self, name: str) -> None:
        self.adapters.check(name)
        users = self._batch.uses(name)
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(users)} decoding sequence(s): "
                             f"{', '.join(users[:5])}")
        self.adapters.unload(name)

    def loras(self) -> list[str]:
        return self.adapters.names()

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
        self.adapters.check(lora)
        ids, reused = prompt_ids(token_ids, self.info, past_kv)
        # allocated outside inference mode so the caller gets an ordinary tensor it may modify
        out = torch.empty(self.info.kv_shape(len(ids)), dtype=self.dtype, device=self.device)
        if past_kv is not None and reused:
            out[:, :, :, :reused] = past_kv[:, :, :, :reused]
        cache = PrefillCache(out, reused, on_layer)
        with torch.inference_mode(), self.adapters.rows([lora]):
            logits = self.model(
                input_ids=torch.tensor([ids[reused:]], device=self.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
            firsts, lps = sample_logprobs(logits, [sampling], [len(ids)])
        return PrefillResult(first_token=firsts[0], kv=out, num_computed_tokens=len(ids) - reused,
                             first_logprobs=lps[0])

    def prefill_batch(self, requests: Sequence[PrefillRequest]) -> list[PrefillResult]:
        """Prompts without a reused prefix share one right-padded forward: the weights are read once for all
        of them (for short prompts that read is most of a prefill's time). Right padding keeps every real
        token's view exactly the unbatched one: causal attention never looks ahead to the padding, and the
        padding's own queries always see real keys (no fully masked row, so no NaN to leak anywhere). Rows of
        different LoRA adapters share the forward too (each row's adapter applies to that row only)."""
        for r in requests:
            self.adapters.check(r.lora)
        checked = [prompt_ids(r.token_ids, self.info, r.past_kv) for r in requests]
        together = [i for i, (_, reused) in enumerate(checked) if not reused] if self._batch_prefill else []
        if len(together) < 2:
            together = []
        results: list[PrefillResult | None] = [None] * len(requests)
        if together:
            padded = self._prefill_padded([checked[i][0] for i in together], [requests[i].sampling for i in together],
                                          [requests[i].lora for i in together])
            for i, result in zip(together, padded, strict=True):
                results[i] = result
        for i, r in enumerate(requests):
            if results[i] is None:
                results[i] = self.prefill(r.token_ids, r.sampling, past_kv=r.past_kv, lora=r.lora)
        return [r for r in results if r is not None]

    def _prefill_padded(self, prompts: list[list[int]], samplings: list[Sampling],
                        loras: list[str | None]) -> list[PrefillResult]:
        info, b = self.info, len(prompts)
        lengths = [len(ids) for ids in prompts]
        width = max(lengths)
        # one buffer [L, 2, B, H, width, D]; each layer's cache is a [B, H, width, D] view of it
        buf = torch.empty((info.num_layers, 2, b, info.num_kv_heads, width, info.head_dim),
                          dtype=self.dtype, device=self.device)
        input_ids = torch.zeros((b, width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask = None
        if min(lengths) != width:
            mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long().to(self.device)
        cache = BatchCache([buf[i, 0] for i in range(info.num_layers)], [buf[i, 1] for i in range(info.num_layers)], 0)
        with torch.inference_mode(), self.adapters.rows(loras):
            hidden = self.model.get_decoder()(
                input_ids=input_ids.to(self.device),
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
            ).last_hidden_state
            last = hidden[torch.arange(b, device=self.device), torch.tensor(lengths, device=self.device) - 1]
            logits = self.model.get_output_embeddings()(last)
            firsts, lps = sample_logprobs(logits, samplings, lengths)
        # each prompt's KV as its own ordinary (non-inference) tensor, like prefill's
        return [PrefillResult(first_token=firsts[row], kv=buf[:, :, row, :, :n].clone(), num_computed_tokens=n,
                              first_logprobs=lps[row]) for row, n in enumerate(lengths)]

    # -- decode ---------------------------------------------------------------------------------------------
    def add_sequence(self, seq_id: str, kv: Tensor | KvSource, last_token: int, sampling: Sampling, *,
                     lora: str | None = None) -> None:
        self.adapters.check(lora)
        if isinstance(kv, Tensor):
            num_tokens = check_kv(kv, self.info)
        else:
            num_tokens = kv.num_tokens
            k0, _ = kv.layer(0)
            expected = (self.info.num_kv_heads, num_tokens, self.info.head_dim)
            if tuple(k0.shape) != expected:
                raise ValueError(f"kv source layers are {tuple(k0.shape)}, the model needs {expected}")
        check_join(num_tokens, last_token, self.info)
        if isinstance(kv, Tensor) and (kv.dtype != self.dtype or kv.device != self.device):
            kv = kv.to(dtype=self.dtype, device=self.device)
        self._batch.add(seq_id, kv, last_token, sampling, lora)

    def step(self) -> dict[str, int]:
        for seq in self._batch.rows:
            if seq.length + 2 > self.info.max_model_len:
                raise ContextFull(seq.seq_id, seq.length + 2, self.info.max_model_len)
        with torch.inference_mode():
            inputs = self._batch.prepare()
            self._step_lp = {}
            if inputs is None:
                return {}
            with row_groups(inputs.groups), self.adapters.rows(inputs.loras or ()):
                logits = self.model(
                    input_ids=inputs.input_ids,
                    position_ids=inputs.position_ids,
                    attention_mask=inputs.attention_mask,
                    past_key_values=inputs.cache,
                    use_cache=True,
                ).logits[:, -1]
            tokens, lps = sample_logprobs(logits, inputs.samplings, inputs.sample_positions)
        result = dict(zip(inputs.seq_ids, tokens, strict=True))
        self._step_lp = {sid: lp for sid, lp in zip(inputs.seq_ids, lps, strict=True) if lp is not None}
        self._batch.advance(result)
        return result

    def remove_sequence(self, seq_id: str, *, keep_kv: bool = True) -> Tensor | None:
        return self._batch.remove(seq_id, keep_kv)

    def active(self) -> int:
        return len(self._batch)

    def step_logprobs(self) -> dict[str, TokenLogprobs]:
        return self._step_lp

    def active_ids(self) -> list[str]:
        return self._batch.seq_ids
