"""Prompt -> token ids for the router, with the served model's own tokenizer and chat template.

The router never loads model weights: only the tokenizer, from the same files the workers serve.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from splitserve.engines.light_tokenizer import PROBE_CHATS, PROBE_TEXTS
from splitserve.proto import GenerateRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class PromptTokenizer:
    def __init__(self, model: str | None) -> None:
        from splitserve.engines.hf_export import tokenizer_folder
        from splitserve.engines.light_tokenizer import vouched
        from splitserve.engines.model_files import resolve_model

        ref = resolve_model(model)
        files = tokenizer_folder(ref)  # a GGUF's tokenizer from its converted folder: 0.6 s, not 4 s
        self.name = ref.name
        self.tok: Any = None
        self._rust: Any = None
        self._rust_chat = False
        # The Rust tokenizer and the template, without transformers, when an earlier start on this machine found
        # them to give transformers' very ids for these files (splitserve.engines.light_tokenizer): a router start
        # then imports neither transformers nor torch (about 1.5 CPU-s less).
        self._light = vouched(files.directory) if files.gguf_file is None else None
        if self._light is None:
            self._load_transformers(files.directory, files.gguf_file)
        self.max_token_bytes = self._max_token_bytes()

    def _load_transformers(self, directory: Path, gguf_file: str | None) -> None:
        from splitserve.engines.light_tokenizer import vouch
        from splitserve.engines.tokenizer_load import load_tokenizer

        self.tok = load_tokenizer(directory, gguf_file)
        self._light = vouch(directory, self.tok) if gguf_file is None else None
        # Not vouched for whole (say the template needs what jinja alone lacks): the Rust tokenizer behind a
        # fast tokenizer still takes plain prompts when it gives the same ids (``tok.encode`` ends in its
        # ``encode``, under about as much again of transformers' Python wrapping).
        self._rust, self._rust_chat = (None, False) if self._light is not None else self._rust_if_same()

    def _max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token covers: the longest vocabulary entry as spelled
        in the vocabulary (byte-level BPE spells each byte as one character of 1-2 UTF-8 bytes, SentencePiece's
        '▁' is 3 bytes for one space, byte fallbacks are 6 characters for one byte: each spelling is at least as
        long as the text it covers). A normaliser could shrink text before tokenizing, so then 4x slack."""
        try:
            vocab = self._light.get_vocab() if self._light is not None else self.tok.get_vocab()
            longest = max(len(tok.encode("utf-8")) for tok in vocab)
        except Exception:
            return 1 << 20  # no vocabulary to read: no bound (every prompt is tokenized)
        if self._light is not None:
            normalizer = self._light.normalizer
        else:
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
            for text in PROBE_TEXTS:
                for special in (True, False):
                    if rust.encode(text, add_special_tokens=special).ids != list(
                            self.tok.encode(text, add_special_tokens=special)):
                        return None, False
        except Exception:
            return None, False
        try:
            probe = list(PROBE_CHATS[-1])
            same_chat = self._chat_rust(rust, probe) == self._chat_slow(probe)
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
            if self._light is not None:
                return self._light.chat_ids(msgs)
            return self._chat_rust(self._rust, msgs) if self._rust_chat else self._chat_slow(msgs)
        assert req.prompt is not None
        if self._light is not None:
            return self._light.encode(req.prompt, add_special_tokens=True)
        # As vLLM's server: the tokenizer's own special tokens (its BOS when it adds one; SmolLM2's adds none).
        # Chat prompts get theirs from the chat template instead.
        if self._rust is not None:
            return list(self._rust.encode(req.prompt, add_special_tokens=True).ids)
        return list(self.tok.encode(req.prompt, add_special_tokens=True))
