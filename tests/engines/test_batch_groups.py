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


def _nan_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch.DecodeBatch, "_empty",
                        lambda self, shape: torch.full(shape, float("nan"), dtype=self.dtype, device=self.device))


def _poison(eng: HfEngine) -> None:
    """NaN in every column the batch holds as unwritten padding (before `zero_from`), rows past the batch's and
    columns past its width: what those hold is whatever the memory held, and attention must not read it."""
    b = eng._batch
    for layer in range(eng.info.num_layers):
        for buf in (b.keys[layer], b.values[layer]):
            buf[len(b.rows):] = float("nan")
            buf[:, :, b.width:] = float("nan")
            for row, seq in enumerate(b.rows):
                buf[row, :, : seq.zero_from] = float("nan")


def test_a_single_group_left_after_the_longest_row_leaves_reads_no_garbage(
        tiny_tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows of 6 and 28 tokens form one group, a 30-token row another (30 > 2 * 6 + 16). When the 30 leaves, the
    # width stays (28 * 2 >= 30: no compaction) and the batch is one group whose rows hold nothing in columns
    # [0, 2). Before the fix attention read them (one group meant plain attention over every column): with
    # garbage there, NaN logits and every next token 0 (CI run 68's flake, where the garbage was whatever the
    # freed memory held).
    monkeypatch.setattr(batch, "GROUP_SLACK", 16)
    eng, ref = _engine(tiny_tokenizer, True), _engine(tiny_tokenizer, False)
    torch.manual_seed(2)
    kvs = [torch.randn(eng.info.kv_shape(n)) for n in (6, 28, 30)]

    def run(e: HfEngine) -> list[dict[str, int]]:
        for i, kv in enumerate(kvs):
            e.add_sequence(f"r{i}", kv, 3 + i, Sampling())
        out = [e.step() for _ in range(2)]
        e.remove_sequence("r2", keep_kv=False)
        assert e._batch.width > max(s.length for s in e._batch.rows)  # the case: padding every row shares
        for _ in range(4):
            _poison(e)
            out.append(e.step())
        return out

    got = run(eng)
    assert got == run(ref)
    assert all(set(step.values()) != {0} for step in got)


def test_rows_of_a_model_without_grouped_kv_heads_read_no_garbage(tiny_tokenizer: PreTrainedTokenizerFast,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # As many KV heads as query heads: the kernel once honoured row groups only for grouped-query models, so such
    # a model's steps attended over every column while the batch zeroed only as far as each group reaches
    monkeypatch.setattr(batch, "GROUP_SLACK", 16)
    _nan_buffers(monkeypatch)

    def mha(grouped: bool) -> HfEngine:
        model = make_tiny_model(len(tiny_tokenizer), max_len=2048)
        config = model.config
        config.num_key_value_heads = config.num_attention_heads
        torch.manual_seed(1234)
        model = type(model)(config).eval()
        return HfEngine(model, tiny_tokenizer, name="tiny-mha", gqa_sdpa=grouped)

    eng, ref = mha(True), mha(False)
    assert eng._batch.grouped and eng.info.num_kv_heads == 4
    torch.manual_seed(3)
    kvs = [torch.randn(eng.info.kv_shape(n)) for n in LENGTHS]
    assert _run(eng, kvs, 4) == _run(ref, kvs, 4)
