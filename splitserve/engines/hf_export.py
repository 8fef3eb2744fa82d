"""Turn a GGUF model (the bundled SmolLM2 by default) into a plain HF folder that loads in a fraction of the time.

transformers parses and dequantises a GGUF on every load: for the bundled 135M model on a 2-core CPU that is
about 18 s per worker start (the weights) and 4 s per tokenizer, against 0.1 s and 0.6 s from a saved folder.
So every process that loads a GGUF loads it from its folder here instead: vLLM (which cannot read this GGUF),
the hf engine (:func:`loadable`) and every tokenizer (:func:`tokenizer_folder`: the router's, the mock
engine's). The folders hold the same weights (dequantised once, tensor for tensor what a GGUF load gives) and
the same tokenizer.

``save_pretrained`` of a model loaded from a GGUF fails; copying its state dict into a ``from_config`` model and
saving that works. A folder is written once, atomically (a temp folder renamed into place), under
``$SPLITSERVE_HOME/models/``, by whichever process needs it first (a file lock makes the others wait for it
rather than convert too), and reused afterwards. Where that folder cannot be written (or a GGUF cannot be
converted), the GGUF is loaded as it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from splitserve.engines.model_files import ModelSource, resolve_model

MARKER = ".splitserve-export"
log = logging.getLogger(__name__)


def export_dir(source: ModelSource, dtype: str = "float32") -> Path:
    """``$SPLITSERVE_HOME/models/NAME-DTYPE-KEY``: KEY is a digest of the GGUF's path, size and mtime, so two
    models of one file name never share a folder, and a GGUF replaced in place is converted again."""
    from splitserve import discovery

    key = ""
    if source.gguf_file:
        path = (source.directory / source.gguf_file).resolve()
        st = path.stat()
        key = "-" + hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:10]
    return discovery.home() / "models" / f"{source.name}-{dtype}{key}"


def ensure_hf_folder(model: str | Path | ModelSource | None = None, *, dtype: str = "float32") -> Path:
    """A folder with config.json, safetensors weights and the tokenizer for ``model``.

    An HF folder is returned as is; a GGUF (or None: the bundled model) is converted once and cached.
    """
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    if source.gguf_file is None:
        return source.directory
    return _once(export_dir(source, dtype), source, lambda out: _convert(source, out, dtype))


def loadable(source: ModelSource, dtype: str = "float32") -> ModelSource:
    """What to load ``source``'s weights and tokenizer from: a GGUF's converted folder (made on first use),
    anything else as it is; the GGUF itself where the folder cannot be written."""
    if source.gguf_file is None:
        return source
    try:
        return ModelSource(ensure_hf_folder(source, dtype=dtype))
    except Exception as exc:  # unwritable home, or a GGUF transformers loads but cannot save: load it as it is
        log.warning("could not convert %s under %s (%s); loading the GGUF as it is", source.gguf_file,
                    export_dir(source, dtype).parent, exc)
        return source


def tokenizer_folder(source: ModelSource) -> ModelSource:
    """What to load ``source``'s tokenizer from, without ever loading weights: a GGUF's converted model folder
    when one exists, else a tokenizer-only folder (made on first use); anything else as it is."""
    if source.gguf_file is None:
        return source
    for dtype in ("float32", "bfloat16", "float16"):
        if (export_dir(source, dtype) / MARKER).is_file():
            return ModelSource(export_dir(source, dtype))
    target = export_dir(source, "tokenizer")
    try:
        return ModelSource(_once(target, source, lambda out: _save_tokenizer(source, out)))
    except Exception as exc:
        log.warning("could not save %s's tokenizer under %s (%s); loading the GGUF's", source.gguf_file,
                    target.parent, exc)
        return source


def _once(target: Path, source: ModelSource, make: Callable[[Path], None]) -> Path:
    """``target``, made by ``make`` into a temp folder renamed into place, unless it is there already; one
    process at a time (the others wait on the lock, then find it made)."""
    if (target / MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if (target / MARKER).is_file():  # made while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            make(tmp)
            (tmp / MARKER).write_text(f"{source.directory / (source.gguf_file or '')}\n")
            try:
                os.rename(tmp, target)
            except OSError:
                # another process won the race (one that took no lock: an older splitserve): as good as ours
                if not (target / MARKER).is_file():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_tokenizer(source: ModelSource, out: Path) -> None:
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(source.directory, local_files_only=True, gguf_file=source.gguf_file)
    tok.save_pretrained(out)


def _convert(source: ModelSource, out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch_dtype = getattr(torch, dtype)
    kwargs = {"local_files_only": True, "gguf_file": source.gguf_file}
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
    _save_tokenizer(source, out)
