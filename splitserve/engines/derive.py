"""A second real model, derived from the bundled one: for multi-model stacks in tests and demos, with nothing
downloaded.

:func:`derive_model` keeps ``keep_layers`` of the bundled SmolLM2-135M-Instruct's 30 decoder layers, dropping one
contiguous run of the others from layer ``drop_from`` on (embeddings, final norm and tied head unchanged), and
saves the result as an ordinary HF folder (config.json, float32 safetensors, the tokenizer, the generation
config). Deterministic: the same parameters give the same weights, byte for byte. ``splitserve models derive
OUT`` and ``make models`` run it.

Which layers go decides whether the result still speaks. Measured with greedy decoding of chat prompts: cutting
the last layers ruins it (only the first 29 of 30: "les Anglais, or the Angl postdocs..."; the first 20: "I I I
I..."), as does dropping the second-to-last; a run from the middle costs little. The default, 26 layers without
layers 14-17, answers "What is the capital of France?" with "The capital of France is Paris, which is also known
as the City of Light..." where the bundled model says "The capital of France is Paris.": a second, coherent,
different model (longer runs from the middle, 6 layers and more, drift off the question again).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock

from splitserve.engines.model_files import BUNDLED_FILE

MARKER = ".splitserve-derived.json"  # the derivation's parameters: a folder holding the same ones is reused
DERIVATION_VERSION = 1  # bump when the recipe changes: existing folders are then derived again
KEEP_LAYERS = 26  # the default derivation: see above
DROP_FROM = 14


def derivation(keep_layers: int, drop_from: int) -> dict[str, Any]:
    """What a derived folder's marker records (and must equal for the folder to be reused)."""
    return {"version": DERIVATION_VERSION, "source": BUNDLED_FILE, "keep_layers": keep_layers,
            "drop_from": drop_from, "dtype": "float32"}


def is_derived(out: Path, *, keep_layers: int = KEEP_LAYERS, drop_from: int = DROP_FROM) -> bool:
    """Whether ``out`` holds this derivation already."""
    return holds(out, MARKER, derivation(keep_layers, drop_from))


def derive_model(out: Path, *, keep_layers: int = KEEP_LAYERS, drop_from: int = DROP_FROM) -> Path:
    """Write the bundled model with ``keep_layers`` of its layers into ``out`` and return ``out``: the layers
    dropped are the run from ``drop_from`` on (``drop_from == keep_layers``: the last ones, keeping the first
    ``keep_layers``). ``out`` is made atomically (a temp folder beside it, renamed into place); nothing is done
    when it holds the same derivation, a folder of another derivation is replaced, anything else at ``out`` is
    left alone (FileExistsError). ValueError for layer counts the bundled model does not allow."""
    out = Path(out).expanduser().absolute()
    if keep_layers < 1 or not 0 <= drop_from <= keep_layers:
        raise ValueError(f"keep_layers must be >= 1 and drop_from 0..keep_layers, not {keep_layers} and {drop_from}")
    return write_once(out, MARKER, derivation(keep_layers, drop_from),
                      lambda tmp: _derive(tmp, keep_layers, drop_from), "a derived model folder")


def holds(out: Path, marker_name: str, marker: dict[str, Any]) -> bool:
    """Whether the folder ``out`` holds what ``marker`` describes (its marker file says so)."""
    try:
        return bool(json.loads((Path(out) / marker_name).read_text()) == marker)
    except (OSError, ValueError):
        return False


def write_once(out: Path, marker_name: str, marker: dict[str, Any], make: Callable[[Path], None],
               what: str) -> Path:
    """Make the folder ``out`` with ``make`` (called on a temp folder beside it, then renamed into place, under a
    file lock) unless it holds ``marker`` already; a folder with another marker (or an empty one) is replaced,
    anything else is left alone (FileExistsError naming ``what`` it is not). Shared by the derived model and
    the test adapters."""
    if holds(out, marker_name, marker):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        if holds(out, marker_name, marker):  # made while we waited
            return out
        if out.exists() and not (out / marker_name).is_file() and not (out.is_dir() and not any(out.iterdir())):
            raise FileExistsError(f"{out} exists and is not {what}: not overwriting it")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            make(tmp)
            (tmp / marker_name).write_text(json.dumps(marker, indent=1) + "\n")
            _ordinary_modes(tmp)
            if out.exists():  # another derivation (or an empty folder): replaced
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
                os.rename(out, old / "x")
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def _derive(out: Path, keep_layers: int, drop_from: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from splitserve.engines.hf_export import ensure_hf_folder

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = ensure_hf_folder(None, dtype="float32")  # the bundled GGUF as an HF folder (converted once, cached)
    loaded = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True)
    config = loaded.config
    total = int(config.num_hidden_layers)
    if not 1 <= keep_layers <= total:
        raise ValueError(f"keep_layers must be 1..{total} (the bundled model has {total} layers), not {keep_layers}")
    kept = [*range(drop_from), *range(drop_from + total - keep_layers, total)]  # old index of each new layer
    config.num_hidden_layers = keep_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in kept]
    state = {}
    for key, tensor in loaded.state_dict().items():
        layer = _layer(key)
        if layer is None:
            state[key] = tensor
        elif layer in kept:
            state[_renumbered(key, kept.index(layer))] = tensor
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("lm_head")]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"deriving from {src}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(src, local_files_only=True).save_pretrained(out)


def _ordinary_modes(folder: Path) -> None:
    """The modes of a folder made with the umask, not the temp folder's 0700 (nor the 0600 transformers gives
    its safetensors): a model folder in a checkout is as readable as the checkout."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


def _layer(key: str) -> int | None:
    """The decoder layer a state-dict key belongs to (``model.layers.7.mlp...``: 7), None for the others."""
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _renumbered(key: str, layer: int) -> str:
    """``key`` of a decoder layer, moved to index ``layer``."""
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            parts[i + 1] = str(layer)
            break
    return ".".join(parts)
