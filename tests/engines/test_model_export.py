"""A GGUF's converted folder (what every worker and tokenizer loads) holds what the GGUF itself gives: the same
tensors, the same tokenizer; it is made once however many processes ask at once, and an unwritable home falls
back to the GGUF."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from splitserve.engines import hf_export
from splitserve.engines.model_files import ModelSource, resolve_model


@pytest.fixture(scope="module")
def bundled() -> ModelSource:
    return resolve_model(None)


@pytest.fixture(scope="module")
def gguf_tok(bundled: ModelSource) -> object:
    return AutoTokenizer.from_pretrained(bundled.directory, local_files_only=True, gguf_file=bundled.gguf_file)


@pytest.fixture(scope="module")
def folder_tok(bundled: ModelSource) -> object:
    files = hf_export.tokenizer_folder(bundled)
    assert files.gguf_file is None and (files.directory / "tokenizer.json").is_file()
    return AutoTokenizer.from_pretrained(files.directory, local_files_only=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_the_converted_tokenizer_encodes_as_the_gguf_one(gguf_tok: object, folder_tok: object, text: str) -> None:
    for special in (True, False):
        assert folder_tok.encode(text, add_special_tokens=special) == gguf_tok.encode(  # type: ignore[attr-defined]
            text, add_special_tokens=special)


def test_the_converted_tokenizer_keeps_the_chat_template_and_special_tokens(gguf_tok: object,
                                                                            folder_tok: object) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    for tok in (gguf_tok, folder_tok):
        assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)  # type: ignore[attr-defined]
    assert folder_tok.apply_chat_template(msgs, add_generation_prompt=True,  # type: ignore[attr-defined]
                                          tokenize=False) == gguf_tok.apply_chat_template(  # type: ignore[attr-defined]
        msgs, add_generation_prompt=True, tokenize=False)
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids"):
        assert getattr(folder_tok, attr) == getattr(gguf_tok, attr), attr


@pytest.mark.slow
def test_the_converted_weights_are_the_gguf_weights(bundled: ModelSource) -> None:
    files = hf_export.loadable(bundled, "float32")
    assert files.gguf_file is None and (files.directory / hf_export.MARKER).is_file()
    assert hf_export.loadable(bundled, "float32") == files  # made once, then found
    a = AutoModelForCausalLM.from_pretrained(bundled.directory, local_files_only=True, gguf_file=bundled.gguf_file,
                                             dtype=torch.float32).state_dict()
    b = AutoModelForCausalLM.from_pretrained(files.directory, local_files_only=True, dtype=torch.float32).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_one_conversion_however_many_ask_at_once(tmp_path: Path, bundled: ModelSource) -> None:
    made: list[float] = []

    def make(out: Path) -> None:
        made.append(time.monotonic())
        time.sleep(0.3)  # long enough for the other callers to reach the lock
        (out / "weights").write_text("w")

    target = tmp_path / "models" / "m"
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(hf_export._once(target, bundled, make)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and got == [target] * 4
    assert (target / "weights").read_text() == "w" and (target / hf_export.MARKER).is_file()
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".m-")]  # no temp folder left


def test_a_failed_conversion_leaves_nothing_and_the_next_one_runs(tmp_path: Path, bundled: ModelSource) -> None:
    target = tmp_path / "models" / "m"

    def broken(out: Path) -> None:
        (out / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        hf_export._once(target, bundled, broken)
    assert not target.exists() and not [p for p in target.parent.iterdir() if p.is_dir()]
    assert hf_export._once(target, bundled, lambda out: (out / "ok").write_text("y")) == target


def test_an_unwritable_home_loads_the_gguf_as_it_is(tmp_path: Path, bundled: ModelSource,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "home-is-a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPLITSERVE_HOME", str(blocker))
    assert hf_export.tokenizer_folder(bundled) == bundled
    assert hf_export.loadable(bundled, "float32") == bundled


def test_a_gguf_that_cannot_be_converted_is_loaded_as_it_is(bundled: ModelSource,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(*_: object) -> None:
        raise RuntimeError("GGUF export of this architecture: missing ['model.norm.weight']")

    monkeypatch.setattr(hf_export, "_convert", fails)
    assert hf_export.loadable(bundled, "float16") == bundled
    assert not hf_export.export_dir(bundled, "float16").exists()


def test_a_replaced_gguf_gets_a_folder_of_its_own(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"v1")
    first = hf_export.export_dir(ModelSource(tmp_path, "m.gguf"))
    time.sleep(0.01)
    model.write_bytes(b"version 2")
    assert hf_export.export_dir(ModelSource(tmp_path, "m.gguf")) != first
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "m.gguf").write_bytes(b"version 2")
    assert hf_export.export_dir(ModelSource(other, "m.gguf")) != hf_export.export_dir(ModelSource(tmp_path, "m.gguf"))
