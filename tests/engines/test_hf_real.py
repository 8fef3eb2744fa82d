"""The hf engine on the real bundled SmolLM2-135M-Instruct (slow: the model loads once, ~14 s)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from splitserve.engines import PrefillRequest, PromptTooLong, Sampling
from splitserve.engines.hf import HfEngine
from tests.engines.enginetest import TEST_THREADS, kv_from_bytes, roundtrip

pytestmark = pytest.mark.slow
GREEDY = Sampling()
RAW_PROMPT = "The three primary colours are"


def chat(engine: HfEngine, question: str) -> list[int]:
    return engine.apply_chat_template([{"role": "user", "content": question}])


def generate(engine: HfEngine, ids: list[int], n: int, sampling: Sampling = GREEDY, seq_id: str = "s") -> list[int]:
    result = engine.prefill(ids, sampling)
    engine.add_sequence(seq_id, roundtrip(result.kv), result.first_token, sampling)
    tokens = [result.first_token]
    while len(tokens) < n and tokens[-1] not in engine.info.eos_token_ids:
        tokens.append(engine.step()[seq_id])
    engine.remove_sequence(seq_id)
    return tokens


def test_capital_of_france(real_engine: HfEngine) -> None:
    tokens = generate(real_engine, chat(real_engine, "What is the capital of France?"), 40)
    assert tokens[-1] in real_engine.info.eos_token_ids
    assert "Paris" in real_engine.decode(tokens)


@pytest.mark.parametrize("kind", ["chat", "raw"])
def test_equals_transformers_generate(real_engine: HfEngine, kind: str) -> None:
    ids = chat(real_engine, "Name three rivers in Europe.") if kind == "chat" else real_engine.encode(RAW_PROMPT)
    ours = generate(real_engine, ids, 32)
    reference = real_engine.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=len(ours))
    assert ours == reference[0, len(ids) :].tolist()


def test_prefill_and_decode_in_two_processes(real_engine: HfEngine, tmp_path: Path) -> None:
    """A separate OS process prefills and writes the KV bytes; this process decodes from them, greedy and
    seeded-sampled, and must match one process doing everything."""
    ids = chat(real_engine, "Write one sentence about the sea.")
    seeded = Sampling(temperature=0.8, top_p=0.95, seed=1234)
    (tmp_path / "ids.txt").write_text(" ".join(map(str, ids)))
    script = textwrap.dedent(
        f"""
        import torch
        from pathlib import Path
        from splitserve.engines import Sampling
        from splitserve.engines.hf import HfEngine
        d = Path({str(tmp_path)!r})
        engine = HfEngine.load(num_threads={TEST_THREADS})
        ids = [int(t) for t in (d / "ids.txt").read_text().split()]
        greedy = engine.prefill(ids, Sampling())
        seeded = engine.prefill(ids, Sampling(temperature=0.8, top_p=0.95, seed=1234))
        (d / "kv.bin").write_bytes(greedy.kv.contiguous().view(torch.uint8).numpy().tobytes())
        (d / "first.txt").write_text(f"{{greedy.first_token}} {{seeded.first_token}}")
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300, capture_output=True)
    kv = kv_from_bytes((tmp_path / "kv.bin").read_bytes(), real_engine.info.kv_shape(len(ids)), torch.float32)
    first_greedy, first_seeded = map(int, (tmp_path / "first.txt").read_text().split())
    real_engine.add_sequence("greedy", kv, first_greedy, GREEDY)
    real_engine.add_sequence("seeded", kv, first_seeded, seeded)
    split = {"greedy": [first_greedy], "seeded": [first_seeded]}
    for _ in range(23):
        for seq_id, token in real_engine.step().items():
            split[seq_id].append(token)
    real_engine.remove_sequence("greedy")
    real_engine.remove_sequence("seeded")
    for seq_id, sampling in (("greedy", GREEDY), ("seeded", seeded)):
        single = generate(real_engine, ids, 24, sampling)  # stops early at EOS
        assert len(single) > 10 and split[seq_id][: len(single)] == single
    assert split["seeded"] != split["greedy"]


def test_past_kv_reuse_and_on_layer(real_engine: HfEngine) -> None:
    system_and_question = chat(real_engine, "What is the capital of France?")
    prefix = real_engine.prefill(system_and_question[:20], GREEDY).kv
    layers: list[int] = []
    result = real_engine.prefill(system_and_question, GREEDY, past_kv=prefix, on_layer=lambda i, k, v: layers.append(i))
    assert result.num_computed_tokens == len(system_and_question) - 20
    assert layers == list(range(30))
    full = real_engine.prefill(system_and_question, GREEDY)
    assert result.first_token == full.first_token
    torch.testing.assert_close(result.kv, full.kv, rtol=1e-4, atol=1e-4)


def test_batched_decode_equals_alone(real_engine: HfEngine) -> None:
    prompts = [chat(real_engine, q) for q in ("Hi!", "What is 2+2? Answer briefly.", "Tell me about Paris.")]
    alone = [generate(real_engine, ids, 16, seq_id=f"a{i}") for i, ids in enumerate(prompts)]
    got: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        result = real_engine.prefill(ids, GREEDY)
        real_engine.add_sequence(f"b{i}", result.kv, result.first_token, GREEDY)
        got[f"b{i}"] = [result.first_token]
        for seq_id, token in real_engine.step().items():  # later sequences join a running batch
            got[seq_id].append(token)
    while real_engine.active():
        for seq_id, token in real_engine.step().items():
            got[seq_id].append(token)
            if len(got[seq_id]) == len(alone[int(seq_id[1:])]):
                real_engine.remove_sequence(seq_id)
    assert [got[f"b{i}"] for i in range(3)] == alone


def test_batched_prefill_gives_the_same_tokens(real_engine: HfEngine) -> None:
    """Short prompts of different lengths prefilled in one forward: the same first token and greedy
    continuation as each prefilled alone, KV equal up to float summation order."""
    questions = ("Hi!", "What is 2+2? Answer briefly.", "Tell me about Paris.", "Name a colour.",
                 "Write one sentence about the sea, the wind and the sky.")
    prompts = [chat(real_engine, q) for q in questions] + [real_engine.encode(RAW_PROMPT)]
    assert len({len(p) for p in prompts}) == len(prompts)
    alone = [generate(real_engine, ids, 16, seq_id=f"a{i}") for i, ids in enumerate(prompts)]
    singles = [real_engine.prefill(ids, GREEDY) for ids in prompts]
    batched = real_engine.prefill_batch([PrefillRequest(ids, GREEDY) for ids in prompts])
    for i, (one, res) in enumerate(zip(singles, batched, strict=True)):
        torch.testing.assert_close(res.kv, one.kv, rtol=1e-4, atol=1e-4)
        real_engine.add_sequence(f"b{i}", roundtrip(res.kv), res.first_token, GREEDY)
    got = {f"b{i}": [res.first_token] for i, res in enumerate(batched)}
    while real_engine.active():
        for seq_id, token in real_engine.step().items():
            got[seq_id].append(token)
            done = len(got[seq_id]) == len(alone[int(seq_id[1:])])
            if done:
                real_engine.remove_sequence(seq_id, keep_kv=False)
    assert [got[f"b{i}"] for i in range(len(prompts))] == alone


def test_seeded_sampling_repeats_and_differs(real_engine: HfEngine) -> None:
    ids = chat(real_engine, "Tell me a story.")
    a = generate(real_engine, ids, 20, Sampling(temperature=1.0, seed=5))
    assert generate(real_engine, ids, 20, Sampling(temperature=1.0, seed=5)) == a
    assert generate(real_engine, ids, 20, Sampling(temperature=1.0, seed=6)) != a


def test_prompt_too_long(real_engine: HfEngine) -> None:
    with pytest.raises(PromptTooLong, match="8192"):
        real_engine.prefill([1] * 8192, GREEDY)


def test_real_tokenizer_streams_multibyte_text(real_engine: HfEngine) -> None:
    from splitserve.engines.detok import IncrementalDetokenizer

    text = "Crème brûlée 🍮, 東京 and 👨‍👩‍👧 — ok"
    ids = real_engine.encode(text)
    detok = IncrementalDetokenizer(real_engine, real_engine.encode("Say:"))
    deltas = [detok.feed(t) for t in ids]
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
