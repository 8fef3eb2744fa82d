"""Prompt -> token ids for the router, with the served model's own tokenizer and chat template.

The router never loads model weights: only the tokenizer, from the same files the workers serve.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from proto import GenerateRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class PromptTokenizer:
    def __init__(self, model: str | None) -> None:
        from transformers import AutoTokenizer

        from splitserve.engines.model_files import resolve_model

        ref = resolve_model(model)
        if ref.gguf_file is not None:
            self.tok = AutoTokenizer.from_pretrained(str(ref.directory), gguf_file=ref.gguf_file)
        else:
            self.tok = AutoTokenizer.from_pretrained(str(Path(ref.directory)))
        self.name = ref.name

    def token_ids(self, req: GenerateRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.messages is not None:
            msgs = [m.model_dump() for m in req.messages]
            out: Any = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if hasattr(out, "input_ids"):  # transformers 5 may return a BatchEncoding
                out = out["input_ids"]
            return [int(t) for t in out]
        assert req.prompt is not None
        # As vLLM's server: the tokenizer's own special tokens (its BOS when it adds one; SmolLM2's adds none).
        # Chat prompts get theirs from the chat template instead.
        return list(self.tok.encode(req.prompt, add_special_tokens=True))
