"""Prompt -> token ids for the router, with the served model's own tokenizer and chat template.

The router never loads model weights: only the tokenizer, from the same files the workers serve.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from splitserve.proto import GenerateRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class PromptTokenizer:
    def __init__(self, model: str | None) -> None:
        from splitserve.engines.hf_export import tokenizer_folder
        from splitserve.engines.model_files import resolve_model
        from splitserve.engines.tokenizer_load import load_tokenizer

        ref = resolve_model(model)
        files = tokenizer_folder(ref)  # a GGUF's tokenizer from its converted folder: 0.6 s, not 4 s
        self.tok = load_tokenizer(Path(files.directory), files.gguf_file)
        self.name = ref.name
        # The Rust tokenizer behind a fast tokenizer: ``tok.encode`` ends in its ``encode``, under about as much
        # again of transformers' Python wrapping (and a chat template tokenized by transformers pays that on
        # top of rendering). The router tokenizes every request, so it calls the Rust one directly, but only
        # once it has given the very same ids as transformers on this tokenizer (checked here).
        self._rust, self._rust_chat = self._rust_if_same()
        self.max_token_bytes = self._max_token_bytes()

    def _max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token covers: the longest vocabulary entry as spelled
        in the vocabulary (byte-level BPE spells each byte as one character of 1-2 UTF-8 bytes, SentencePiece's
        '▁' is 3 bytes for one space, byte fallbacks are 6 characters for one byte: each spelling is at least as
        long as the text it covers). A normaliser could shrink text before tokenizing, so then 4x slack."""
        try:
            longest = max(len(tok.encode("utf-8")) for tok in self.tok.get_vocab())
        except Exception:
            return 1 << 20  # no vocabulary to read: no bound (every prompt is tokenized)
        backend = getattr(self.tok, "backend_tokenizer", None)
        normalizer = getattr(backend, "normalizer", None) if backend is not None else None
        return max(1, longest * (4 if normalizer is not None else 1))

    @staticmethod
    def text_bytes(req: GenerateRequest) -> int:
        """The UTF-8 size of what would be tokenized (0 for pre-tokenized prompts)."""
        if req.prompt is not None:
            return len(req.prompt.encode("utf-8"))
        if req.messages is not None:
            return sum(len(m.content.encode("utf-8")) for m in req.messages)
        return 0

    def min_tokens(self, req: GenerateRequest, text_bytes: int | None = None) -> int:
        """A lower bound on the request's prompt tokens, computed without tokenizing (bytes / the most bytes one
        token covers): a prompt whose bound is over a limit is refused before any tokenizer work. ``text_bytes``:
        :meth:`text_bytes` of the request, when the caller has it already."""
        if req.prompt_token_ids is not None:
            return len(req.prompt_token_ids)
        return (self.text_bytes(req) if text_bytes is None else text_bytes) // self.max_token_bytes

    def _rust_if_same(self) -> tuple[Any, bool]:
        rust = getattr(self.tok, "backend_tokenizer", None)
        if rust is None:
            return None, False
        try:
            for text in _PROBE_TEXTS:
                for special in (True, False):
                    if rust.encode(text, add_special_tokens=special).ids != list(
                            self.tok.encode(text, add_special_tokens=special)):
                        return None, False
        except Exception:
            return None, False
        try:
            same_chat = self._chat_rust(rust, _PROBE_CHAT) == self._chat_slow(_PROBE_CHAT)
        except Exception:  # no chat template: chat requests get the slow path's own error
            same_chat = False
        return rust, same_chat

    def _chat_slow(self, msgs: list[dict[str, Any]]) -> list[int]:
        out: Any = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if hasattr(out, "input_ids"):  # transformers 5 may return a BatchEncoding
            out = out["input_ids"]
        return [int(t) for t in out]

    def _chat_rust(self, rust: Any, msgs: list[dict[str, Any]]) -> list[int]:
        # What transformers does with tokenize=True: render, then encode without adding special tokens (the
        # template writes its own).
        text = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return list(rust.encode(text, add_special_tokens=False).ids)

    def token_ids(self, req: GenerateRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.messages is not None:
            msgs = [m.model_dump() for m in req.messages]
            return self._chat_rust(self._rust, msgs) if self._rust_chat else self._chat_slow(msgs)
        assert req.prompt is not None
        # As vLLM's server: the tokenizer's own special tokens (its BOS when it adds one; SmolLM2's adds none).
        # Chat prompts get theirs from the chat template instead.
        if self._rust is not None:
            return list(self._rust.encode(req.prompt, add_special_tokens=True).ids)
        return list(self.tok.encode(req.prompt, add_special_tokens=True))


# What the Rust fast path must tokenize exactly as transformers does before the router uses it: spaces, digits,
# non-ASCII, text that looks like special tokens, the empty string; and a conversation through the template.
_PROBE_TEXTS = ("Hello, world!", "  two leading spaces\tand a tab\n", "1234567 + 89 = ?", "naïve café 🙂 日本語",
                "<|im_start|>user\nhi<|im_end|>\n<s></s>", "")
_PROBE_CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France? Ünïcode 🙂"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan?"},
]
