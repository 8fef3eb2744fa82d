"""The router's tokenizer gives exactly the ids transformers gives: through the light tokenizer (Rust tokenizer and
jinja template, no transformers) only once transformers has vouched for it on these very files, else through
transformers' own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.engines import light_tokenizer
from splitserve.engines.hf_export import tokenizer_folder
from splitserve.engines.model_files import resolve_model
from splitserve.engines.tokenizer_load import load_tokenizer
from splitserve.proto import GenerateRequest
from splitserve.proto.messages import ChatMessage
from splitserve.services.router.tokenize import PromptTokenizer


@pytest.fixture(scope="module")
def folder() -> Path:
    return tokenizer_folder(resolve_model(None)).directory


@pytest.fixture(scope="module")
def hf(folder: Path) -> Any:
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def tok(folder: Path) -> PromptTokenizer:
    PromptTokenizer(None)  # vouches (or finds the record of an earlier start)
    t = PromptTokenizer(None)
    assert t._light is not None and t.tok is None  # the bundled model's tokenizer takes the light path
    return t


def _req(**kw: Any) -> GenerateRequest:
    return GenerateRequest(request_id="r", tenant="t", **kw)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=200))
def test_plain_prompts_match_transformers(tok: PromptTokenizer, hf: Any, text: str) -> None:
    assert tok.token_ids(_req(prompt=text)) == list(hf.encode(text, add_special_tokens=True))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.text(min_size=1, max_size=80), min_size=1, max_size=4), system=st.booleans())
def test_chat_prompts_match_transformers(tok: PromptTokenizer, hf: Any, turns: list[str], system: bool) -> None:
    msgs = [ChatMessage(role="user" if i % 2 == 0 else "assistant", content=c) for i, c in enumerate(turns)]
    if msgs[-1].role != "user":
        msgs.append(ChatMessage(role="user", content="and?"))
    if system:
        msgs.insert(0, ChatMessage(role="system", content="Be brief."))
    want: Any = hf.apply_chat_template([m.model_dump() for m in msgs], add_generation_prompt=True, tokenize=True)
    if hasattr(want, "input_ids"):
        want = want["input_ids"]
    assert tok.token_ids(_req(messages=msgs)) == [int(t) for t in want]


def test_a_router_start_with_a_record_imports_neither_transformers_nor_torch(tok: PromptTokenizer) -> None:
    code = ("import sys\nfrom splitserve.services.router.tokenize import PromptTokenizer\n"
            "t = PromptTokenizer(None)\nassert t._light is not None\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def test_changed_files_are_not_vouched_for_by_an_old_record(folder: Path, tmp_path: Path) -> None:
    copy = _copy(folder, tmp_path / "tok")
    assert light_tokenizer.vouch(copy, load_tokenizer(copy)) is not None
    assert light_tokenizer.vouched(copy) is not None
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    template = (copy / "chat_template.jinja").read_text() if (copy / "chat_template.jinja").is_file() else None
    # The same files with another chat template: the record does not cover them.
    if template is not None:
        (copy / "chat_template.jinja").write_text(template.replace("<|im_start|>", "<|im_start|> "))
    else:
        cfg["chat_template"] = cfg["chat_template"].replace("<|im_start|>", "<|im_start|> ")
        (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert light_tokenizer.vouched(copy) is None


def test_a_record_whose_probes_no_longer_hold_is_not_trusted(folder: Path, tmp_path: Path) -> None:
    copy = _copy(folder, tmp_path / "tok")
    assert light_tokenizer.vouch(copy, load_tokenizer(copy)) is not None
    key = light_tokenizer._key(copy)
    assert key is not None
    path = light_tokenizer._record_path(key)
    record = json.loads(path.read_text())
    record["probes"]["texts"][0][0].append(7)  # as if tokenizers now split "Hello, world!" otherwise
    path.write_text(json.dumps(record))
    assert light_tokenizer.vouched(copy) is None


class _Disagreeing:
    """A transformers tokenizer whose template renders what the light one cannot know (as a tokenizer class that
    adds its own template variables would)."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.backend_tokenizer = real.backend_tokenizer
        self.chat_template = real.chat_template
        self.special_tokens_map = real.special_tokens_map

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        return self._real.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, msgs: Any, **kw: Any) -> Any:
        out = self._real.apply_chat_template(msgs, **kw)
        return [*out["input_ids"], 7] if hasattr(out, "input_ids") else [*out, 7]


def test_a_light_tokenizer_that_disagrees_is_not_vouched_for(folder: Path, tmp_path: Path) -> None:
    copy = _copy(folder, tmp_path / "tok")
    assert light_tokenizer.vouch(copy, _Disagreeing(load_tokenizer(copy))) is None
    assert light_tokenizer.vouched(copy) is None


def test_plain_prompts_get_bos_when_the_tokenizer_adds_one(folder: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, processors

    copy = _copy(folder, tmp_path / "llama-style")
    rust = Tokenizer.from_file(str(copy / "tokenizer.json"))
    bos = "<|im_start|>"
    rust.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                        special_tokens=[(bos, rust.token_to_id(bos))])
    rust.save(str(copy / "tokenizer.json"))
    (copy / "config.json").write_text("{}")  # an HF folder, as resolve_model wants one
    hf = load_tokenizer(copy)
    want = [hf.bos_token_id, *hf("Hello", add_special_tokens=False)["input_ids"]]
    assert list(hf.encode("Hello")) == want  # transformers itself adds it, as vLLM's server sends it
    first, second = PromptTokenizer(str(copy)), PromptTokenizer(str(copy))
    assert first.tok is not None and second.tok is None  # the second start took the light path
    for t in (first, second):
        assert t.token_ids(_req(prompt="Hello")) == want


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


def test_a_tokenizer_whose_rust_side_disagrees_keeps_the_transformers_path(hf: Any) -> None:
    skewed = PromptTokenizer.__new__(PromptTokenizer)
    skewed.tok = _Skewed(hf)
    skewed._light = None
    assert skewed._rust_if_same() == (None, False)
    skewed._rust, skewed._rust_chat = None, False
    assert skewed.token_ids(_req(prompt="Hello 42")) == list(hf.encode("Hello 42"))


@pytest.fixture(scope="module")
def light(folder: Path, hf: Any) -> light_tokenizer.LightTokenizer:
    assert light_tokenizer.vouch(folder, hf) is not None
    got = light_tokenizer.vouched(folder)
    assert got is not None
    return got


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 49151), max_size=40), skip=st.booleans())
def test_the_light_tokenizer_decodes_as_transformers(light: Any, hf: Any, ids: list[int], skip: bool) -> None:
    # what the mock engine's detokenizer feeds it: any ids, special ones included, partial UTF-8 included
    assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_the_light_tokenizer_answers_what_the_mock_engine_reads(light: Any, hf: Any) -> None:
    assert len(light) == len(hf) and light.eos_token_id == hf.eos_token_id
    assert set(light.all_special_ids) == set(hf.all_special_ids) | set(hf.added_tokens_decoder)
    msgs = [{"role": "user", "content": "Hi"}]
    want: Any = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "input_ids") else want
    assert light.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True) == list(want)


def test_a_mock_worker_start_with_a_record_imports_no_transformers(light: Any) -> None:
    code = ("import sys\nfrom splitserve.engines.mock import MockEngine\ne = MockEngine.load()\n"
            "print(type(e.tokenizer).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "LightTokenizer False", out.stdout + out.stderr
