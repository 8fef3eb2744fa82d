"""``load_tokenizer`` (splitserve.engines.tokenizer_load): a folder that names the generic fast tokenizer gets
that class without transformers' auto machinery, and it tokenizes exactly as ``AutoTokenizer``'s; anything else
still goes through ``AutoTokenizer``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.engines.hf_export import tokenizer_folder
from splitserve.engines.model_files import resolve_model
from splitserve.engines.tokenizer_load import generic_class, load_tokenizer


@pytest.fixture(scope="module")
def folder() -> Path:
    return Path(tokenizer_folder(resolve_model(None)).directory)


@pytest.fixture(scope="module")
def pair(folder: Path) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    return load_tokenizer(folder, local_files_only=True), AutoTokenizer.from_pretrained(folder, local_files_only=True)


def test_the_bundled_models_folder_names_the_generic_class(folder: Path, pair: tuple[Any, Any]) -> None:
    assert generic_class(folder) is not None
    light, auto = pair
    assert type(light) is type(auto)
    assert (light.eos_token_id, light.bos_token_id, len(light)) == (auto.eos_token_id, auto.bos_token_id, len(auto))
    assert light.all_special_ids == auto.all_special_ids and light.chat_template == auto.chat_template


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=120), special=st.booleans())
def test_same_ids_and_text_as_auto_tokenizer(pair: tuple[Any, Any], text: str, special: bool) -> None:
    light, auto = pair
    ids = auto.encode(text, add_special_tokens=special)
    assert light.encode(text, add_special_tokens=special) == ids
    assert light.decode(ids) == auto.decode(ids)


def test_same_chat_rendering(pair: tuple[Any, Any]) -> None:
    light, auto = pair
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Capital of Japan? 🙂"}]
    assert (light.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            == auto.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))


def test_other_folders_go_through_auto_tokenizer(folder: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(folder, other, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"  # a model-specific class: AutoTokenizer's business
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert generic_class(other) is None
    tok = load_tokenizer(other, local_files_only=True)
    assert type(tok).__name__ == "GPT2Tokenizer"
    assert generic_class(tmp_path / "missing") is None
