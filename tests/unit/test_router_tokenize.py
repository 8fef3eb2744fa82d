"""The router's tokenizer: its Rust fast path gives exactly the ids transformers gives, or it is not used."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.proto import GenerateRequest
from splitserve.proto.messages import ChatMessage
from splitserve.services.router.tokenize import PromptTokenizer


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    t = PromptTokenizer(None)
    assert t._rust is not None and t._rust_chat  # the bundled model's tokenizer takes the fast path
    return t


def _req(**kw: Any) -> GenerateRequest:
    return GenerateRequest(request_id="r", tenant="t", **kw)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=200))
def test_plain_prompts_match_transformers(tok: PromptTokenizer, text: str) -> None:
    assert tok.token_ids(_req(prompt=text)) == list(tok.tok.encode(text, add_special_tokens=True))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.text(min_size=1, max_size=80), min_size=1, max_size=4))
def test_chat_prompts_match_transformers(tok: PromptTokenizer, turns: list[str]) -> None:
    msgs = [ChatMessage(role="user" if i % 2 == 0 else "assistant", content=c) for i, c in enumerate(turns)]
    if msgs[-1].role != "user":
        msgs.append(ChatMessage(role="user", content="and?"))
    want: Any = tok.tok.apply_chat_template([m.model_dump() for m in msgs], add_generation_prompt=True,
                                            tokenize=True)
    if hasattr(want, "input_ids"):
        want = want["input_ids"]
    assert tok.token_ids(_req(messages=msgs)) == [int(t) for t in want]


class _SkewedRust:
    """Agrees with transformers except on text holding digits."""

    def __init__(self, rust: Any) -> None:
        self._rust = rust

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        enc = self._rust.encode(text, add_special_tokens=add_special_tokens)
        return type("Enc", (), {"ids": enc.ids + [0] if any(c.isdigit() for c in text) else enc.ids})()


class _Skewed:
    """A transformers tokenizer whose Rust tokenizer disagrees with it (as a slow-only special case would)."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.backend_tokenizer = _SkewedRust(real.backend_tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        return self._real.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, *a: Any, **kw: Any) -> Any:
        return self._real.apply_chat_template(*a, **kw)


def test_a_tokenizer_whose_rust_side_disagrees_keeps_the_transformers_path(tok: PromptTokenizer) -> None:
    skewed = PromptTokenizer.__new__(PromptTokenizer)
    skewed.tok = _Skewed(tok.tok)
    assert skewed._rust_if_same() == (None, False)
    skewed._rust, skewed._rust_chat = None, False
    assert skewed.token_ids(_req(prompt="Hello 42")) == list(tok.tok.encode("Hello 42"))
