"""Turn a GGUF model (the bundled SmolLM2 by default) into a plain HF folder that vLLM can load.

transformers dequantises a GGUF on load, but ``save_pretrained`` of that model fails; copying its state dict
into a ``from_config`` model and saving that works. The folder is written once, atomically (a temp folder
renamed into place), under ``$SPLITSERVE_HOME/models/``, and reused afterwards.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from splitserve.engines.model_files import ModelSource, resolve_model

MARKER = ".splitserve-export"


def export_dir(source: ModelSource, dtype: str = "float32") -> Path:
    from splitserve import discovery

    return discovery.home() / "models" / f"{source.name}-{dtype}"


def ensure_hf_folder(model: str | Path | None = None, *, dtype: str = "float32") -> Path:
    """A folder with config.json, safetensors weights and the tokenizer for ``model``.

    An HF folder is returned as is; a GGUF (or None: the bundled model) is converted once and cached.
    """
    source = resolve_model(model)
    if source.gguf_file is None:
        return source.directory
    target = export_dir(source, dtype)
    if (target / MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _convert(source, tmp, dtype)
        (tmp / MARKER).write_text(f"{source.directory / source.gguf_file}\n")
        try:
            os.rename(tmp, target)
        except OSError:
            # another process won the race: theirs is as good as ours
            if not (target / MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(source: ModelSource, out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch_dtype = getattr(torch, dtype)
    kwargs = {"local_files_only": True, "gguf_file": source.gguf_file}
    tokenizer = AutoTokenizer.from_pretrained(source.directory, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch_dtype, **kwargs)
    config = loaded.config
    # the weights are dequantised now: a leftover GGUF quantization_config would make vLLM expect GGUF
    with contextlib.suppress(AttributeError):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # tied embeddings show up as a "missing" lm_head: anything else means the copy is incomplete
    missing = [k for k in missing if not k.startswith("lm_head")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF export of {source.name}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
