"""The router's cheap checks are sound and its per-tenant state is bounded.

- The size floor (``PromptTokenizer.min_tokens``: bytes / the most bytes one token covers) refuses a prompt
  before tokenizing it, so it must never exceed the prompt's real token count, for any text (hypothesis, with the
  bundled model's real tokenizer): a floor above it would refuse a valid prompt.
- Without a tenants file any tenant name is served, so the names a router keeps state for are capped.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.proto import ChatMessage, GenerateRequest
from splitserve.services.router.intake import OPEN_MODE_MAX_TENANTS
from splitserve.services.router.service import RouterService
from splitserve.services.router.tokenize import PromptTokenizer


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer(None)


# Text that packs many bytes into few tokens is what could break the bound: runs of spaces and newlines (the
# vocabulary's longest entries), repeated words, multi-byte characters, text that looks like special tokens.
_pieces = st.sampled_from([" ", "\n", "\t", "    ", "\n" + " " * 80, "the", " the", "ab", "é", "日本", "🙂",
                           "<|im_start|>", "<|im_end|>", "0123456789", "=" * 64, "-" * 40, "*"])
_texts = st.one_of(st.text(max_size=400), st.lists(_pieces, max_size=300).map("".join))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_texts)
def test_the_size_floor_never_exceeds_the_real_token_count(tok: PromptTokenizer, text: str) -> None:
    if text:
        req = GenerateRequest(request_id="r", tenant="t", prompt=text)
        assert tok.min_tokens(req) <= len(tok.token_ids(req))
        chat = GenerateRequest(request_id="r", tenant="t", messages=[ChatMessage(role="user", content=text)])
        assert tok.min_tokens(chat) <= len(tok.token_ids(chat))


def test_the_size_floor_refuses_megabytes_without_tokenizing(tok: PromptTokenizer) -> None:
    req = GenerateRequest(request_id="r", tenant="t", prompt="a" * 6_000_000)
    # The bundled model takes 8,192 tokens at most: six million bytes are far over it whatever the text.
    assert tok.min_tokens(req) > 8192
    assert tok.max_token_bytes < 1024


def test_open_mode_keeps_state_for_a_bounded_number_of_tenant_names() -> None:
    svc = RouterService("router-t", "nats://127.0.0.1:1")
    assert svc.tenants.open
    admitted = [svc._tenant_slot(f"t{i}") for i in range(OPEN_MODE_MAX_TENANTS + 500)]
    assert admitted == [True] * OPEN_MODE_MAX_TENANTS + [False] * 500
    assert svc._tenant_slot("t0")  # a tenant already served stays served
    assert len(svc._open_tenants) == OPEN_MODE_MAX_TENANTS
