"""hf engine on a tiny random-init Llama: the shared Engine contract (prefix reuse, per-layer hooks, batched
decode, seeded sampling, length guards), plus what only a real model can show: equivalence with transformers'
own generate and KV cache, and the decode batch's in-place layout."""

from __future__ import annotations

import pytest
import torch

from splitserve.engines import Engine, Sampling, load_engine
from splitserve.engines.hf import HfEngine
from tests.engines.enginetest import GREEDY, PROMPTS, EngineContract, make_tiny_model, roundtrip, run


class TestHfEngineContract(EngineContract):
    """The shared contract on the tiny hf engine (the `engine` fixture from conftest)."""

    def sibling(self, engine: Engine) -> Engine:
        assert isinstance(engine, HfEngine)
        return HfEngine(engine.model, engine.tokenizer, name="other")

    def short(self, engine: Engine, max_model_len: int) -> Engine:
        assert isinstance(engine, HfEngine)
        return HfEngine(make_tiny_model(len(engine.tokenizer), max_len=max_model_len), engine.tokenizer, name="short")


def reference_greedy(engine: HfEngine, ids: list[int], n: int) -> list[int]:
    out = engine.model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
    )
    return [int(t) for t in out[0, len(ids) :]]



@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_then_decode_equals_generate(engine: HfEngine, prompt: str) -> None:
    ids = engine.encode(prompt)
    assert run(engine, ids, 24) == reference_greedy(engine, ids, 24)



def test_kv_matches_transformers_cache(engine: HfEngine) -> None:
    ids = engine.encode(PROMPTS[1])
    result = engine.prefill(ids, GREEDY)
    with torch.inference_mode():
        cache = engine.model(torch.tensor([ids]), use_cache=True).past_key_values
    for i, layer in enumerate(cache.layers):
        torch.testing.assert_close(result.kv[i, 0], layer.keys[0])
        torch.testing.assert_close(result.kv[i, 1], layer.values[0])


def test_past_kv_prefix_reuse_continues_like_generate(engine: HfEngine) -> None:
    ids = engine.encode(PROMPTS[1])
    full = engine.prefill(ids, GREEDY)
    prefix = engine.prefill(ids[:10], GREEDY).kv
    reused = engine.prefill(ids, GREEDY, past_kv=roundtrip(prefix))
    assert reused.num_computed_tokens == len(ids) - 10
    assert reused.first_token == full.first_token
    torch.testing.assert_close(reused.kv, full.kv, rtol=1e-5, atol=1e-5)
    # the continuation is the same as without reuse
    engine.add_sequence("r", reused.kv, reused.first_token, GREEDY)
    tokens = [reused.first_token] + [engine.step()["r"] for _ in range(15)]
    assert tokens == reference_greedy(engine, ids, 16)







def test_joins_and_leaves_are_in_place(engine: HfEngine) -> None:
    """Only a join longer than every active sequence (or growth, or mostly-padding) re-lays the batch out."""
    ids = {n: engine.encode(PROMPTS[1])[:n] for n in (6, 12, 20, 40)}
    alone = {n: run(engine, ids[n], 8, seq_id=f"alone{n}") for n in ids}
    batch = engine._batch
    got: dict[int, list[int]] = {}

    def join(n: int) -> None:
        result = engine.prefill(ids[n], GREEDY)
        engine.add_sequence(str(n), result.kv, result.first_token, GREEDY)
        got[n] = [result.first_token]

    def step() -> None:
        for seq_id, token in engine.step().items():
            got[int(seq_id)].append(token)

    join(20)
    before = batch.relayouts
    join(12)  # shorter: in place
    step()
    join(6)
    step()
    assert batch.relayouts == before
    assert engine.remove_sequence("12", keep_kv=False) is None  # middle row: the last row moves in, in place
    assert batch.relayouts == before
    join(40)  # longer than every active row: re-layout
    assert batch.relayouts == before + 1
    while len(got[20]) < 8:
        step()
    engine.remove_sequence("20")
    while len(got[40]) < 8:
        step()
    engine.remove_sequence("40")  # the rest is mostly padding now: compacted
    assert batch.relayouts == before + 2 and batch.width == len(ids[6]) + len(got[6]) - 1
    while len(got[6]) < 8:
        step()
    assert {n: got[n][:8] for n in ids} == {n: alone[n][: len(got[n])] for n in ids}  # "12" left after 3


def test_buffers_grow_during_steps(engine: HfEngine) -> None:
    """A tiny headroom forces re-layouts inside step() (inference mode); joins afterwards must still work."""
    small = HfEngine(engine.model, engine.tokenizer, name="small", kv_headroom=1)
    ids = engine.encode(PROMPTS[0])
    alone = run(engine, ids, 20)
    result = small.prefill(ids, GREEDY)
    small.add_sequence("a", result.kv, result.first_token, GREEDY)
    tokens = [result.first_token] + [small.step()["a"] for _ in range(12)]
    assert small._batch.relayouts >= 1
    small.add_sequence("b", result.kv, result.first_token, GREEDY)
    while len(tokens) < 20:
        tokens.append(small.step()["a"])
    assert tokens == alone


def test_removed_kv_continues_like_generate(engine: HfEngine) -> None:
    """KV returned by remove_sequence (prompt + generated tokens) is a valid prefix for a new prefill."""
    ids = engine.encode(PROMPTS[0])
    reference = reference_greedy(engine, ids, 12)
    result = engine.prefill(ids, GREEDY)
    engine.add_sequence("x", result.kv, result.first_token, GREEDY)
    tokens = [result.first_token] + [engine.step()["x"] for _ in range(5)]
    kv = engine.remove_sequence("x")
    assert kv is not None and kv.shape[3] == len(ids) + 5
    resumed = engine.prefill(ids + tokens, GREEDY, past_kv=kv)
    assert resumed.num_computed_tokens == 1
    assert resumed.first_token == reference[6]







def test_unknown_engine_name() -> None:
    with pytest.raises(ValueError, match="unknown engine"):
        load_engine("nope")


def test_top_p_matters(engine: HfEngine) -> None:
    ids = engine.encode(PROMPTS[1])
    nucleus = run(engine, ids, 25, Sampling(temperature=1.0, top_p=0.9, seed=7))
    assert run(engine, ids, 25, Sampling(temperature=1.0, seed=7)) != nucleus
