"""Row groups in the decode batch: rows of very different lengths attend over their own columns only, with
the same tokens as one padded attention over every column, and padding read only as far as a group reaches
(zeroed lazily; garbage in the buffers never leaks into attention)."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from splitserve.engines import attention, batch
from splitserve.engines.base import Sampling
from splitserve.engines.hf import HfEngine
from tests.engines.enginetest import make_tiny_model

LENGTHS = (5, 9, 700)  # two short streams and one long prompt: groups {5, 9} and {700}


def _engine(tok: PreTrainedTokenizerFast, grouped: bool) -> HfEngine:
    return HfEngine(make_tiny_model(len(tok), max_len=2048), tok, name="tiny", gqa_sdpa=grouped)


def _run(eng: HfEngine, kvs: list[torch.Tensor], steps: int) -> list[dict[str, int]]:
    for i, kv in enumerate(kvs):
        eng.add_sequence(f"r{i}", kv, 3 + i, Sampling())
    out = [eng.step() for _ in range(steps)]
    eng.remove_sequence("r0", keep_kv=False)  # a short row leaves; the long one moves into its slot
    out += [eng.step() for _ in range(steps)]
    return out


def test_grouped_attention_gives_the_padded_batchs_tokens(tiny_tokenizer: PreTrainedTokenizerFast,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch, "GROUP_SLACK", 16)
    grouped, padded = _engine(tiny_tokenizer, True), _engine(tiny_tokenizer, False)
    assert grouped._batch.grouped and not padded._batch.grouped
    torch.manual_seed(0)
    info = grouped.info
    kvs = [torch.randn(info.kv_shape(n)) for n in LENGTHS]
    calls: list[int] = []
    real = attention._grouped
    monkeypatch.setattr(attention, "_grouped", lambda q, k, v, m, groups, s: calls.append(len(groups)) or real(
        q, k, v, m, groups, s))
    assert _run(grouped, kvs, 6) == _run(padded, kvs, 6)
    assert calls and set(calls) == {2}  # every step ran two groups


def test_garbage_in_unused_buffer_never_reaches_attention(tiny_tokenizer: PreTrainedTokenizerFast,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Buffers come from torch.empty; fill fresh ones with NaN to prove every column attention reads is written
    monkeypatch.setattr(batch, "GROUP_SLACK", 16)
    monkeypatch.setattr(batch.DecodeBatch, "_empty",
                        lambda self, shape: torch.full(shape, float("nan"), dtype=self.dtype, device=self.device))
    eng = _engine(tiny_tokenizer, True)
    torch.manual_seed(1)
    kvs = [torch.randn(eng.info.kv_shape(n)) for n in LENGTHS]
    ref = _engine(tiny_tokenizer, False)
    assert _run(eng, kvs, 4) == _run(ref, kvs, 4)
    # and the short group read only its own columns: far fewer than the long row's width were zeroed
    short = [s for s in eng._batch.rows if s.length < 100]
    assert short and all(eng._batch.width - s.zero_from < 100 for s in short)
