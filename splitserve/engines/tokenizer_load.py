"""Load a model's tokenizer without transformers' auto-class machinery where the folder names its class.

``from transformers import AutoTokenizer`` imports the auto mappings of every model transformers knows (about
3 CPU-seconds here), before a single file is read. The router and the mock engine load only a tokenizer, and
every process start paid that: each router, mock worker and restart. A folder whose ``tokenizer_config.json``
names the generic fast tokenizer (``TokenizersBackend``, transformers 5's name for what ``PreTrainedTokenizerFast``
was; what our own exports write) gets that class directly, which is what ``AutoTokenizer`` resolves it to
(0.7 s). Anything else (a model-specific class, a GGUF file, no config) goes through ``AutoTokenizer`` as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The generic fast tokenizer, under both names transformers has given it: AutoTokenizer maps these to it.
_GENERIC = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def generic_class(directory: Path) -> str | None:
    """The generic tokenizer class ``directory`` names, or None (anything else, or nothing to read)."""
    try:
        cfg = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = cfg.get("tokenizer_class") if isinstance(cfg, dict) else None
    if name in _GENERIC and (directory / "tokenizer.json").is_file():
        return str(name)
    return None


def load_tokenizer(directory: str | Path, gguf_file: str | None = None, **kwargs: Any) -> Any:
    """The tokenizer in ``directory`` (``gguf_file``: the GGUF file in it to read the tokenizer from), as
    ``AutoTokenizer.from_pretrained`` would load it; ``kwargs`` go to ``from_pretrained``."""
    directory = Path(directory)
    if gguf_file is None and generic_class(directory) is not None:
        import transformers

        cls = getattr(transformers, "TokenizersBackend", None) or transformers.PreTrainedTokenizerFast
        return cls.from_pretrained(str(directory), **kwargs)
    from transformers import AutoTokenizer

    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    return AutoTokenizer.from_pretrained(str(directory), **kwargs)
