"""Shared helpers for the engine tests: a tiny random-init Llama with an in-memory byte-level BPE tokenizer,
and moving KV tensors through raw bytes as another process would receive them."""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
