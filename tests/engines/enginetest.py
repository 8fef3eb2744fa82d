"""Shared engine tests: the Engine contract suite every backend's tests subclass (`EngineContract`), a tiny
random-init Llama with an in-memory byte-level BPE tokenizer, and moving KV tensors through raw bytes as another
process would receive them."""

from __future__ import annotations

import os

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from splitserve.engines import ContextFull, Engine, PrefillRequest, PromptTooLong, Sampling

# One intra-op thread: on a shared 2-core machine a second torch thread spin-waits on a busy core, which
# made tiny-model steps ~100x slower. Override with SPLITSERVE_TEST_THREADS on a dedicated machine.
TEST_THREADS = int(os.environ.get("SPLITSERVE_TEST_THREADS", "1"))
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Disaggregated prefill and decode split the work of serving a language model.",
    "Café, naïve, façade, Straße, ĳ, œuvre — accents everywhere.",
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji: 🚀🔥👍🏽 👨‍👩‍👧 and more 🎉.",
    "def f(x):\n    return x * 2\n",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_model(vocab_size: int, max_len: int = 256) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_len,
        # wide init: random logits get clear argmax gaps, so padding-order rounding cannot flip greedy picks
        initializer_range=0.25,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(1234)
    return LlamaForCausalLM(config).eval()


def kv_to_bytes(kv: Tensor) -> tuple[bytes, tuple[int, ...], torch.dtype]:
    # through uint8 so that bfloat16 (which numpy lacks) round-trips too
    return kv.contiguous().view(torch.uint8).numpy().tobytes(), tuple(kv.shape), kv.dtype


def kv_from_bytes(data: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def roundtrip(kv: Tensor) -> Tensor:
    return kv_from_bytes(*kv_to_bytes(kv))


GREEDY = Sampling()
PROMPTS = [
    "The quick brown fox jumps",
    "Disaggregated prefill and decode split the work of serving a language model over many workers.",
    "Emoji: 🚀",
]


def run(engine: Engine, ids: list[int], n: int, sampling: Sampling = GREEDY, seq_id: str = "s") -> list[int]:
    """Prefill + (n - 1) decode steps in this engine; the KV goes through bytes in between."""
    result = engine.prefill(ids, sampling)
    engine.add_sequence(seq_id, roundtrip(result.kv), result.first_token, sampling)
    tokens = [result.first_token]
    for _ in range(n - 1):
        tokens.append(engine.step()[seq_id])
    engine.remove_sequence(seq_id)
    return tokens


class EngineContract:
    """The Engine interface contract, run against every backend: subclass it as ``Test<Backend>Contract``.

    A subclass provides the `engine` fixture (a shared instance whose decode batch is emptied after each test),
    `sibling` (a second instance over the same weights, as another process would hold) and `short` (an
    instance over the same weights with a small max_model_len). Checks of a backend's output against a
    reference implementation (e.g. transformers' generate) belong in the backend's own tests.
    """

    def sibling(self, engine: Engine) -> Engine:
        raise NotImplementedError

    def short(self, engine: Engine, max_model_len: int) -> Engine:
        raise NotImplementedError

    def test_prefill_result_shape(self, engine: Engine) -> None:
        ids = engine.encode(PROMPTS[1])
        result = engine.prefill(ids, GREEDY)
        assert tuple(result.kv.shape) == engine.info.kv_shape(len(ids))
        assert str(result.kv.dtype) == f"torch.{engine.info.dtype}"
        assert result.num_computed_tokens == len(ids)
        assert not result.kv.is_inference()  # callers may write into it outside inference mode
        assert 0 <= result.first_token < engine.info.vocab_size

    def test_past_kv_prefix_reuse(self, engine: Engine) -> None:
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
        engine.remove_sequence("r", keep_kv=False)
        assert tokens == run(engine, ids, 16)

    def test_past_kv_covering_whole_prompt_recomputes_last_token(self, engine: Engine) -> None:
        ids = engine.encode(PROMPTS[0])
        full = engine.prefill(ids, GREEDY)
        again = engine.prefill(ids, GREEDY, past_kv=full.kv)
        assert again.num_computed_tokens == 1
        assert again.first_token == full.first_token
        torch.testing.assert_close(again.kv, full.kv)

    def test_past_kv_shape_is_checked(self, engine: Engine) -> None:
        ids = engine.encode(PROMPTS[0])
        with pytest.raises(ValueError, match="past_kv"):
            engine.prefill(ids, GREEDY, past_kv=torch.zeros(1, 2, 3, 4, 5))

    def test_on_layer_fires_per_layer_in_order_with_final_tensors(self, engine: Engine) -> None:
        ids = engine.encode(PROMPTS[1])
        seen: list[tuple[int, Tensor, Tensor]] = []
        result = engine.prefill(ids, GREEDY, on_layer=lambda i, k, v: seen.append((i, k.clone(), v.clone())))
        assert [i for i, _, _ in seen] == list(range(engine.info.num_layers))
        for i, k, v in seen:
            assert k.shape == (engine.info.num_kv_heads, len(ids), engine.info.head_dim)
            assert torch.equal(k, result.kv[i, 0]) and torch.equal(v, result.kv[i, 1])

    def test_on_layer_with_past_kv_covers_whole_prompt(self, engine: Engine) -> None:
        ids = engine.encode(PROMPTS[1])
        prefix = engine.prefill(ids[:7], GREEDY).kv
        seen: list[tuple[int, Tensor]] = []
        result = engine.prefill(ids, GREEDY, past_kv=prefix, on_layer=lambda i, k, v: seen.append((i, k.clone())))
        assert [i for i, _ in seen] == list(range(engine.info.num_layers))
        assert all(torch.equal(k, result.kv[i, 0]) for i, k in seen)

    def test_batched_decode_matches_each_alone_with_join_and_leave(self, engine: Engine) -> None:
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
        assert engine.active() == 2
        for _ in range(4):
            step()
        join(2)
        while engine.active():
            step()
        assert [got[f"s{i}"] for i in range(3)] == alone

    def test_removed_kv_continues_elsewhere(self, engine: Engine) -> None:
        """KV returned by remove_sequence (prompt + fed tokens) is a valid prefix for a new prefill."""
        ids = engine.encode(PROMPTS[0])
        reference = run(engine, ids, 12)
        result = engine.prefill(ids, GREEDY)
        engine.add_sequence("x", result.kv, result.first_token, GREEDY)
        tokens = [result.first_token] + [engine.step()["x"] for _ in range(5)]
        kv = engine.remove_sequence("x")
        assert kv is not None and kv.shape[3] == len(ids) + 5
        resumed = engine.prefill(ids + tokens, GREEDY, past_kv=kv)
        assert resumed.num_computed_tokens == 1
        assert resumed.first_token == reference[6]

    def test_seeded_sampling_split_equals_single_process(self, engine: Engine) -> None:
        ids = engine.encode(PROMPTS[1])
        sampling = Sampling(temperature=1.0, top_p=0.9, seed=7)
        first = run(engine, ids, 25, sampling)
        assert run(engine, ids, 25, sampling) == first
        # "another process": a second engine instance over the same weights decodes the bytes-cloned KV
        other = self.sibling(engine)
        result = engine.prefill(ids, sampling)
        other.add_sequence("p", roundtrip(result.kv), result.first_token, sampling)
        assert [result.first_token] + [other.step()["p"] for _ in range(24)] == first
        other.remove_sequence("p")
        assert run(engine, ids, 25, Sampling(temperature=1.0, top_p=0.9, seed=8)) != first

    def test_seeded_sampling_is_independent_of_batch_company(self, engine: Engine) -> None:
        ids = engine.encode(PROMPTS[1])
        sampling = Sampling(temperature=0.8, seed=3)
        alone = run(engine, ids, 12, sampling)
        other = engine.prefill(engine.encode(PROMPTS[2]), Sampling(temperature=1.0, seed=99))
        engine.add_sequence("noise", other.kv, other.first_token, Sampling(temperature=1.0, seed=99))
        assert run(engine, ids, 12, sampling) == alone

    def test_prefill_batch_equals_one_at_a_time(self, engine: Engine) -> None:
        """Prompts of different lengths prefilled together (one with a reused prefix, one seeded-sampled) give
        each the KV, first token and greedy continuation it gets alone."""
        prompts = [engine.encode(p) for p in (*PROMPTS, "def f(x):", PROMPTS[1] + " Again.")]
        assert len({len(p) for p in prompts}) >= 4  # different lengths: exercises padding
        seeded = Sampling(temperature=1.0, seed=11)
        samplings = [GREEDY, seeded, GREEDY, GREEDY, GREEDY]
        prefix = engine.prefill(prompts[4][:9], GREEDY).kv
        pasts = [None, None, None, None, prefix]
        alone = [engine.prefill(ids, s, past_kv=p) for ids, s, p in zip(prompts, samplings, pasts, strict=True)]
        together = engine.prefill_batch([PrefillRequest(ids, s, p) for ids, s, p in
                                         zip(prompts, samplings, pasts, strict=True)])
        assert len(together) == len(prompts)
        for ids, one, batched in zip(prompts, alone, together, strict=True):
            assert batched.first_token == one.first_token
            assert batched.num_computed_tokens == one.num_computed_tokens
            assert tuple(batched.kv.shape) == engine.info.kv_shape(len(ids))
            assert not batched.kv.is_inference()
            torch.testing.assert_close(batched.kv, one.kv, rtol=1e-4, atol=1e-4)
        for i, (ids, batched) in enumerate(zip(prompts, together, strict=True)):
            if samplings[i] is not GREEDY:
                continue
            engine.add_sequence(f"pb{i}", roundtrip(batched.kv), batched.first_token, GREEDY)
            tokens = [batched.first_token] + [engine.step()[f"pb{i}"] for _ in range(11)]
            engine.remove_sequence(f"pb{i}", keep_kv=False)
            assert tokens == run(engine, ids, 12)

    def test_prompt_too_long(self, engine: Engine) -> None:
        short = self.short(engine, 16)
        with pytest.raises(PromptTooLong) as info:
            short.prefill(list(range(3, 19)), GREEDY)
        assert info.value.prompt_tokens == 16 and info.value.limit == 16
        assert "16 tokens" in str(info.value) and "15 prompt tokens" in str(info.value)
        result = short.prefill(list(range(3, 13)), GREEDY)  # 10 tokens: room for 6 more
        short.add_sequence("a", result.kv, result.first_token, GREEDY)
        for _ in range(short.room_for(11)):  # 11 = prompt + first token
            short.step()
        with pytest.raises(ContextFull):
            short.step()
        with pytest.raises(PromptTooLong):
            short.add_sequence("b", short.prefill(list(range(3, 18)), GREEDY).kv, 5, GREEDY)
        kv = short.remove_sequence("a")
        assert kv is not None and kv.shape[3] == 15  # prompt + the 5 fed tokens; the 16th was never fed

    def test_add_sequence_guards(self, engine: Engine) -> None:
        result = engine.prefill(engine.encode(PROMPTS[0]), GREEDY)
        with pytest.raises(ValueError, match="vocabulary"):
            engine.add_sequence("v", result.kv, engine.info.vocab_size, GREEDY)
        engine.add_sequence("d", result.kv, result.first_token, GREEDY)
        with pytest.raises(ValueError, match="already active"):
            engine.add_sequence("d", result.kv, result.first_token, GREEDY)
        assert engine.active() == 1
        assert engine.remove_sequence("d", keep_kv=False) is None
        assert engine.active() == 0

    def test_chat_template_and_decode(self, engine: Engine) -> None:
        ids = engine.apply_chat_template([{"role": "user", "content": "hi"}])
        text = engine.decode(ids, skip_special_tokens=False)
        assert "hi" in text and text.endswith("<|im_start|>assistant\n")
        assert engine.decode(engine.encode("café 🚀")) == "café 🚀"

    def test_step_with_no_sequences(self, engine: Engine) -> None:
        assert engine.step() == {}
        assert engine.remove_sequence("nope") is None
