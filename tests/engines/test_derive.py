"""The derived second model (splitserve.engines.derive): the bundled SmolLM2 less a run of its middle layers,
saved as an HF folder. Deterministic, made once, a real model that answers differently from the bundled one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from splitserve.engines import derive
from splitserve.engines.derive import MARKER, derivation, derive_model, is_derived

QUESTION = "What is the capital of France?"


def test_layer_keys_are_found_and_renumbered() -> None:
    assert derive._layer("model.layers.20.mlp.up_proj.weight") == 20
    assert derive._layer("model.embed_tokens.weight") is None and derive._layer("model.norm.weight") is None
    assert derive._renumbered("model.layers.18.self_attn.q_proj.weight", 14) == \
        "model.layers.14.self_attn.q_proj.weight"


def test_bad_parameters_and_foreign_folders_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "weights.bin").write_text("someone's")
    with pytest.raises(FileExistsError):
        derive_model(out, keep_layers=3, drop_from=3)
    assert (out / "weights.bin").read_text() == "someone's"
    with pytest.raises(ValueError, match="drop_from"):
        derive_model(tmp_path / "x", keep_layers=10, drop_from=14)


def test_the_cli_skips_a_folder_derived_already(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from splitserve import cli

    out = tmp_path / "m"
    out.mkdir()
    (out / MARKER).write_text(json.dumps(derivation(7, 7)))
    assert is_derived(out, keep_layers=7, drop_from=7) and not is_derived(out, keep_layers=8, drop_from=7)
    monkeypatch.setattr(derive, "_derive", lambda *_: pytest.fail("derived again"))
    res = CliRunner().invoke(cli.app, ["models", "derive", str(out), "--keep-layers", "7", "--drop-from", "7"])
    assert res.exit_code == 0 and "derived already" in res.output, res.output
    made: list[tuple[int, int]] = []

    def fake(tmp: Path, keep: int, drop_from: int) -> None:
        made.append((keep, drop_from))
        (tmp / "config.json").write_text("{}")

    monkeypatch.setattr(derive, "_derive", fake)
    res = CliRunner().invoke(cli.app, ["models", "derive", str(out)])
    assert res.exit_code == 0, res.output
    assert made == [(26, 14)] and is_derived(out)  # another derivation: replaced (the default one)


def _greedy(folder: Path, n: int = 24) -> tuple[list[int], str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    ids = list(ids if isinstance(ids, list) else ids["input_ids"])
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n)
    tokens = [int(t) for t in out[0, len(ids):]]
    return tokens, str(tok.decode(tokens, skip_special_tokens=True))


@pytest.mark.slow
def test_derive_is_deterministic_made_once_and_a_different_model(tmp_path: Path) -> None:
    from transformers import AutoConfig

    from splitserve.engines.hf_export import ensure_hf_folder

    a = derive_model(tmp_path / "a")
    b = derive_model(tmp_path / "b")
    weights = sorted(p.name for p in a.glob("*.safetensors"))
    assert weights and weights == sorted(p.name for p in b.glob("*.safetensors"))
    for name in weights:  # the same derivation, byte for byte
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert is_derived(a, keep_layers=26, drop_from=14)
    stamp = (a / weights[0]).stat().st_mtime_ns
    assert derive_model(a) == a and (a / weights[0]).stat().st_mtime_ns == stamp  # found, not made again
    assert AutoConfig.from_pretrained(a, local_files_only=True).num_hidden_layers == 26
    bundled = ensure_hf_folder(None)
    assert AutoConfig.from_pretrained(bundled, local_files_only=True).num_hidden_layers == 30
    assert (a / "tokenizer.json").is_file() and (a / "generation_config.json").is_file()
    (ours, text), (theirs, _) = _greedy(a), _greedy(bundled)
    assert ours != theirs
    assert "Paris" in text, text  # still a coherent model (layers 14-17 are what it can do without)
    # the hf engine loads it as any HF folder, under the folder's name
    from splitserve.engines.hf import HfEngine

    engine = HfEngine.load(a)
    assert engine.info.name == "a" and engine.info.num_layers == 26
