"""Attention kernel choice for the hf engine: transformers' SDPA, minus a K/V copy on masked GQA.

transformers lets torch's SDPA broadcast grouped KV heads itself (`enable_gqa`) only when there is no
attention mask -- a restriction that matters for CUDA/NPU kernels. Otherwise it materialises every layer's
K/V `num_heads / num_kv_heads` times (`repeat_kv`) on every forward. A padded decode batch always has a mask,
and on CPU masked GQA is supported and gives bit-identical results, so this kernel calls SDPA directly in
that case (measured on SmolLM2, 8 sequences x ~230 tokens: 0.72 -> 0.14 ms per layer). Every other case is
delegated to the stock kernel unchanged.

Row groups (decode steps only): a padded batch makes every row attend over the longest row's width, so one
3,000-token sequence joining 100-token streams made each step read ~30x their KV and doubled the step time.
The decode batch sorts rows into groups of similar length (``row_groups``, set around the forward); each group
attends only over its own columns. Masked columns get exactly zero weight, so a group's output is the same as
the full padded attention's (up to float summation order). The decode batch zeroes padding only as far as a
group reaches, so groups are honoured for every model and device: attention over a column no group reaches
would read whatever the buffer's memory held.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "splitserve_sdpa"


@dataclass(frozen=True)
class RowGroup:
    rows: slice | torch.Tensor  # batch rows of the group: a slice when contiguous, else an index tensor
    first_column: int  # the group's rows hold nothing before this column (all of it masked)


_GROUPS: ContextVar[list[RowGroup] | None] = ContextVar("splitserve_row_groups", default=None)


@contextmanager
def row_groups(groups: list[RowGroup] | None) -> Iterator[None]:
    """Attend per row group for the forwards run inside this block (one decode step). A single group is kept
    when it starts past column 0: the batch zeroes padding only as far as each group reaches, so the columns
    before it may hold anything (garbage that plain attention over every column would read: masked weights are
    exactly 0, but 0 * NaN is NaN)."""
    token = _GROUPS.set(groups if groups and (len(groups) > 1 or groups[0].first_column > 0) else None)
    try:
        yield
    finally:
        _GROUPS.reset(token)


def _grouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
             groups: list[RowGroup], scaling: float | None) -> torch.Tensor:
    out = query.new_empty(query.shape)
    gqa = query.shape[1] != key.shape[1]
    for g in groups:
        c = g.first_column
        if isinstance(g.rows, slice):
            q, k, v, m = query[g.rows], key[g.rows, :, c:], value[g.rows, :, c:], mask[g.rows, ..., c:]
            out[g.rows] = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scaling, enable_gqa=gqa)
        else:
            idx = g.rows
            # columns first, then rows: only the group's own columns are gathered
            k, v = key[:, :, c:].index_select(0, idx), value[:, :, c:].index_select(0, idx)
            q, m = query.index_select(0, idx), mask[..., c:].index_select(0, idx)
            out.index_copy_(0, idx, F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scaling,
                                                                    enable_gqa=gqa))
    return out


def gqa_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    plain = kwargs.get("position_bias") is None and kwargs.get("cache") is None and not kwargs.get(
        "output_attentions", False)
    groups = _GROUPS.get()
    if groups is not None and plain and query.shape[2] == 1 and attention_mask is not None:
        # row groups are a correctness matter, not only speed (see row_groups): honoured for every model and
        # device. Where SDPA cannot broadcast grouped KV heads under a mask (off CPU), they are repeated here.
        if query.device.type != "cpu" and query.shape[1] != key.shape[1]:
            repeats = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        output = _grouped(query, key, value, attention_mask, groups, scaling)
    elif (plain and attention_mask is not None and attention_mask.dtype == torch.bool
          and query.device.type == "cpu" and query.shape[1] != key.shape[1]):
        output = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )
    else:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    return output.transpose(1, 2).contiguous(), None


def use_gqa_sdpa(model: Any) -> bool:
    """Switch a model that runs stock SDPA to this kernel; returns whether it was switched."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, gqa_sdpa_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # same masks as stock SDPA
    model.set_attn_implementation(NAME)
    return True
