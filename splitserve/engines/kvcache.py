"""KV caches for the hf engine: transformers `DynamicCache` subclasses backed by preallocated buffers.

Why not a plain DynamicCache: it grows by `torch.cat` on every forward, i.e. it copies the whole cache once
per layer per decode step, and after a prefill the per-layer tensors still have to be stacked into the
[L, 2, H, T, D] transport tensor. Here every layer's keys/values are views into a buffer that `update()`
writes into in place:

* `PrefillCache` writes straight into the result tensor [L, 2, H, T, D] (no stacking copy) and calls the
  `on_layer` hook the moment a layer's KV is final, so the transport can start pushing it while later
  layers compute.
* `BatchCache` presents B left-padded sequences held in the decode batch's [B, H, capacity, D] buffers,
  so a decode step only writes one column.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from splitserve.engines.base import LayerHook


class BufferLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are the first `length` positions of [B, H, capacity, D] buffers.

    The buffers are views owned by someone else (the prefill result, the decode batch); they are never
    reallocated here, so the owner must leave room for what the forward will append.
    """

    def __init__(self, keys: Tensor, values: Tensor, length: int) -> None:
        super().__init__()
        self.kbuf, self.vbuf = keys, values
        self.length = length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._expose()

    def _expose(self) -> tuple[Tensor, Tensor]:
        keys, values = self.kbuf[:, :, : self.length], self.vbuf[:, :, : self.length]
        self.keys, self.values = keys, values
        return keys, values

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass  # buffers are given at construction

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        end = self.length + key_states.shape[-2]
        if end > self.kbuf.shape[2]:
            raise RuntimeError(f"KV buffer of {self.kbuf.shape[2]} tokens cannot hold {end}")
        self.kbuf[:, :, self.length : end] = key_states
        self.vbuf[:, :, self.length : end] = value_states
        self.length = end
        return self._expose()

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self.length = 0
        self._expose()

    def crop(self, tokens_to_remove: int) -> None:
        # transformers' convention: negative drops that many from the end, positive (legacy) keeps that many
        if tokens_to_remove < 0:
            self.length = max(self.length + tokens_to_remove, 0)
        elif tokens_to_remove > 0:
            self.length = min(self.length, tokens_to_remove)
        self._expose()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("BufferLayer does not support beam search")

    def batch_select_indices(self, indices: Tensor) -> None:
        raise NotImplementedError("BufferLayer batches are rebuilt by the engine, not re-indexed")


class _BufferCache(DynamicCache):
    def __init__(self, layers: list[BufferLayer]) -> None:
        # skip DynamicCache.__init__: it would build its own layers from the config
        Cache.__init__(self, layers=list(layers))
        self.buffer_layers = layers


class PrefillCache(_BufferCache):
    """Cache for one prefill, writing into `out` [L, 2, H, T, D]; positions < `past` are given."""

    def __init__(self, out: Tensor, past: int, on_layer: LayerHook | None = None) -> None:
        super().__init__(
            [BufferLayer(out[i, 0].unsqueeze(0), out[i, 1].unsqueeze(0), past) for i in range(out.shape[0])]
        )
        self.on_layer = on_layer

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.on_layer is not None:
            self.on_layer(layer_idx, keys[0], values[0])
        return keys, values


class BatchCache(_BufferCache):
    """Cache for one decode step: per layer [B, H, capacity, D] buffers, rows right-aligned (left-padded)."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], length: int) -> None:
        super().__init__([BufferLayer(k, v, length) for k, v in zip(keys, values, strict=True)])
