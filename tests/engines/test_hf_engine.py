"""hf engine on a tiny random-init Llama: equivalence with transformers' own generate, KV hand-off through
bytes, prefix reuse, per-layer hooks, batched decode, seeded sampling, length guards."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from splitserve.engines import ContextFull, PromptTooLong, Sampling, load_engine
from splitserve.engines.hf import HfEngine
from tests.engines.enginetest import make_tiny_model, roundtrip

GREEDY = Sampling()
PROMPTS = [
    "The quick brown fox jumps",
    "Disaggregated prefill and decode split the work of serving a language model over many workers.",
    "Emoji: 🚀",
]


def reference_greedy(engine: HfEngine, ids: list[int], n: int) -> list[int]:
    out = engine.model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
    )
    return [int(t) for t in out[0, len(ids) :]]


def run(engine: HfEngine, ids: list[int], n: int, sampling: Sampling = GREEDY, seq_id: str = "s") -> list[int]:
    """Prefill + (n - 1) decode steps in this engine; the KV goes through bytes in between."""
    result = engine.prefill(ids, sampling)
    engine.add_sequence(seq_id, roundtrip(result.kv), result.first_token, sampling)
    tokens = [result.first_token]
    for _ in range(n - 1):
        tokens.append(engine.step()[seq_id])
    engine.remove_sequence(seq_id)
    return tokens


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_then_decode_equals_generate(engine: HfEngine, prompt: str) -> None:
    ids = engine.encode(prompt)
    assert run(engine, ids, 24) == reference_greedy(engine, ids, 24)


def test_prefill_result_shape(engine: HfEngine) -> None:
    ids = engine.encode(PROMPTS[1])
    result = engine.prefill(ids, GREEDY)
    assert tuple(result.kv.shape) == engine.info.kv_shape(len(ids))
    assert result.num_computed_tokens == len(ids)
    assert not result.kv.is_inference()  # callers may write into it outside inference mode


def test_kv_matches_transformers_cache(engine: HfEngine) -> None:
    ids = engine.encode(PROMPTS[1])
    result = engine.prefill(ids, GREEDY)
    with torch.inference_mode():
        cache = engine.model(torch.tensor([ids]), use_cache=True).past_key_values
    for i, layer in enumerate(cache.layers):
        torch.testing.assert_close(result.kv[i, 0], layer.keys[0])
        torch.testing.assert_close(result.kv[i, 1], layer.values[0])


def test_past_kv_prefix_reuse(engine: HfEngine) -> None:
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


def test_past_kv_covering_whole_prompt_recomputes_last_token(engine: HfEngine) -> None:
    ids = engine.encode(PROMPTS[0])
    full = engine.prefill(ids, GREEDY)
    again = engine.prefill(ids, GREEDY, past_kv=full.kv)
    assert again.num_computed_tokens == 1
    assert again.first_token == full.first_token
    torch.testing.assert_close(again.kv, full.kv)


def test_past_kv_shape_is_checked(engine: HfEngine) -> None:
    ids = engine.encode(PROMPTS[0])
    with pytest.raises(ValueError, match="past_kv"):
        engine.prefill(ids, GREEDY, past_kv=torch.zeros(1, 2, 3, 4, 5))


def test_on_layer_fires_per_layer_in_order_with_final_tensors(engine: HfEngine) -> None:
    ids = engine.encode(PROMPTS[1])
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    result = engine.prefill(ids, GREEDY, on_layer=lambda i, k, v: seen.append((i, k.clone(), v.clone())))
    assert [i for i, _, _ in seen] == list(range(engine.info.num_layers))
    for i, k, v in seen:
        assert k.shape == (engine.info.num_kv_heads, len(ids), engine.info.head_dim)
        assert torch.equal(k, result.kv[i, 0]) and torch.equal(v, result.kv[i, 1])


def test_on_layer_with_past_kv_covers_whole_prompt(engine: HfEngine) -> None:
    ids = engine.encode(PROMPTS[1])
    prefix = engine.prefill(ids[:7], GREEDY).kv
    seen: list[tuple[int, torch.Tensor]] = []
    result = engine.prefill(ids, GREEDY, past_kv=prefix, on_layer=lambda i, k, v: seen.append((i, k.clone())))
    assert [i for i, _ in seen] == list(range(engine.info.num_layers))
    assert all(torch.equal(k, result.kv[i, 0]) for i, k in seen)


def test_batched_decode_matches_each_alone_with_join_and_leave(engine: HfEngine) -> None:
    prompts = [engine.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == 3  # different lengths: exercises padding
    alone = [run(engine, ids, 30, seq_id=f"alone{i}") for i, ids in enumerate(prompts)]

    got: dict[str, list[int]] = {}

    def join(i: int) -> None:
        result = engine.prefill(prompts[i], GREEDY)
        engine.add_sequence(f"s{i}", result.kv, result.first_token, GREEDY)
        got[f"s{i}"] = [result.first_token]

    def step() -> None:
        for seq_id, token in engine.step().items():
            got[seq_id].append(token)
            if len(got[seq_id]) == 30:  # leaves mid-way while others continue
                kv = engine.remove_sequence(seq_id)
                assert kv is not None and kv.shape[3] == len(prompts[int(seq_id[1:])]) + 29

    join(0)
    for _ in range(5):
        step()
    join(1)  # joins a running batch
    for _ in range(4):
        step()
    join(2)
    while engine.active():
        step()
    assert [got[f"s{i}"] for i in range(3)] == alone


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


def test_removed_kv_continues_elsewhere(engine: HfEngine) -> None:
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


def test_seeded_sampling_split_equals_single_process(engine: HfEngine) -> None:
    ids = engine.encode(PROMPTS[1])
    sampling = Sampling(temperature=1.0, top_p=0.9, seed=7)
    first = run(engine, ids, 25, sampling)
    assert run(engine, ids, 25, sampling) == first
    # "another process": a second engine instance over the same weights decodes the bytes-cloned KV
    other = HfEngine(engine.model, engine.tokenizer, name="other")
    result = engine.prefill(ids, sampling)
    other.add_sequence("p", roundtrip(result.kv), result.first_token, sampling)
    assert [result.first_token] + [other.step()["p"] for _ in range(24)] == first
    other.remove_sequence("p")
    assert run(engine, ids, 25, Sampling(temperature=1.0, top_p=0.9, seed=8)) != first
    assert run(engine, ids, 25, Sampling(temperature=1.0, seed=7)) != first  # top_p matters


def test_seeded_sampling_is_independent_of_batch_company(engine: HfEngine) -> None:
    ids = engine.encode(PROMPTS[1])
    sampling = Sampling(temperature=0.8, seed=3)
    alone = run(engine, ids, 12, sampling)
    other = engine.prefill(engine.encode(PROMPTS[2]), Sampling(temperature=1.0, seed=99))
    engine.add_sequence("noise", other.kv, other.first_token, Sampling(temperature=1.0, seed=99))
    assert run(engine, ids, 12, sampling) == alone


def test_prompt_too_long(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    engine = HfEngine(make_tiny_model(400, max_len=16), tiny_tokenizer, name="short")
    with pytest.raises(PromptTooLong) as info:
        engine.prefill(list(range(3, 19)), GREEDY)
    assert info.value.prompt_tokens == 16 and info.value.limit == 16
    assert "16 tokens" in str(info.value) and "15 prompt tokens" in str(info.value)
    result = engine.prefill(list(range(3, 13)), GREEDY)  # 10 tokens: room for 6 more
    engine.add_sequence("a", result.kv, result.first_token, GREEDY)
    for _ in range(engine.room_for(11)):  # 11 = prompt + first token
        engine.step()
    with pytest.raises(ContextFull):
        engine.step()
    with pytest.raises(PromptTooLong):
        engine.add_sequence("b", engine.prefill(list(range(3, 18)), GREEDY).kv, 5, GREEDY)


def test_chat_template_and_decode(engine: HfEngine) -> None:
    ids = engine.apply_chat_template([{"role": "user", "content": "hi"}])
    text = engine.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert engine.decode(engine.encode("café 🚀")) == "café 🚀"


def test_step_with_no_sequences(engine: HfEngine) -> None:
    assert engine.step() == {}
    assert engine.remove_sequence("nope") is None


def test_unknown_engine_name() -> None:
    with pytest.raises(ValueError, match="unknown engine"):
        load_engine("nope")
