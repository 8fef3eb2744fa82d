"""A tokenizer without transformers (nor torch), used once transformers has vouched for it on this machine.

The router tokenizes every prompt with the served model's tokenizer and chat template. Loading that through
transformers costs about 1.5 CPU-seconds per process start (transformers, torch, the tokenizer's Python wrapping)
before a single prompt is read, and routers are restarted, scaled out and started in every stack. What the router
needs is smaller: the Rust ``tokenizers.Tokenizer`` behind a fast tokenizer, and the chat template rendered the
way transformers renders it (jinja2, sandboxed, ``trim_blocks``/``lstrip_blocks``, the same ``tojson``,
``raise_exception`` and ``strftime_now``, the tokenizer's special tokens as variables).

The mock engine (a worker process that needs only a tokenizer) uses it the same way, decoding included.

That smaller path is only taken when it gives exactly transformers' ids (and text, decoding back), and that is
only known by asking transformers: :func:`vouch` loads nothing itself, it is handed the transformers tokenizer,
builds the light one from the same files plus the template and special tokens transformers used, and compares both
on probe texts and conversations. When they agree it writes a record, keyed by a digest of the tokenizer files'
bytes and of the tokenizers / transformers / jinja2 versions, under ``$SPLITSERVE_HOME/tokenizers/``.
:func:`vouched` finds that record at a later start (another router, a restart) and builds the light tokenizer
without importing transformers; it checks the record's probe ids again before trusting it. Files changed,
another library version, or no record: the caller loads transformers as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any, Final

log = logging.getLogger(__name__)

# The files a fast tokenizer (and its chat template) is made of; whichever exist go into the record's key.
_FILES: Final = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                 "chat_template.jinja", "chat_template.json")
_LIBS: Final = ("tokenizers", "transformers", "jinja2")
RECORD_VERSION: Final = 2

# What the light tokenizer must tokenize exactly as transformers before it is used: spaces, digits, non-ASCII,
# text that looks like special tokens, the empty string; and conversations through the template.
PROBE_TEXTS: Final = ("Hello, world!", "  two leading spaces\tand a tab\n", "1234567 + 89 = ?",
                      "naïve café 🙂 日本語", "<|im_start|>user\nhi<|im_end|>\n<s></s>", "")
PROBE_CHATS: Final[tuple[tuple[dict[str, str], ...], ...]] = (
    ({"role": "user", "content": "Hi"},),
    ({"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is the capital of France? Ünïcode 🙂"},
     {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "And of Japan?"}),
)


def _key(directory: Path) -> str | None:
    """A digest of the tokenizer's files and of the libraries whose behaviour the record vouches for; None when
    there is no ``tokenizer.json`` or a library is missing."""
    if not (directory / "tokenizer.json").is_file():
        return None
    h = hashlib.sha256(f"v{RECORD_VERSION}\0".encode())
    try:
        for lib in _LIBS:
            h.update(f"{lib}={metadata.version(lib)}\0".encode())
        for name in _FILES:
            path = directory / name
            if path.is_file():
                h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    except (OSError, metadata.PackageNotFoundError):
        return None
    return h.hexdigest()


def _record_path(key: str) -> Path:
    from splitserve import discovery

    return discovery.home() / "tokenizers" / f"{key}.json"


def _compile(template: str) -> Any:
    """The chat template compiled as transformers compiles it (its ``_cached_compile_jinja_template``, less the
    ``{% generation %}`` tracker, which only marks assistant spans and renders its body unchanged)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


class LightTokenizer:
    """A fast tokenizer's Rust tokenizer and its chat template, with no transformers import: what the router uses
    (encode, render a conversation and encode it), and the part of a transformers tokenizer the mock engine uses
    (``decode``, ``apply_chat_template``, ``eos_token_id``, ``all_special_ids``, ``len``)."""

    def __init__(self, directory: Path, chat_template: str | None, template_vars: dict[str, Any],
                 meta: dict[str, Any] | None = None) -> None:
        from tokenizers import Tokenizer

        self.rust = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.chat_template = chat_template
        self.template_vars = dict(template_vars)
        self._compiled = _compile(chat_template) if chat_template else None
        meta = meta or {}
        self.eos_token_id: int | None = meta.get("eos_token_id")
        self.all_special_ids: list[int] = list(meta.get("special_ids", []))
        self.added_tokens_decoder: dict[int, str] = {}  # what all_special_ids holds already, for the same readers
        self._len = int(meta.get("len") or self.rust.get_vocab_size(with_added_tokens=True))

    def __len__(self) -> int:
        return self._len

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out: str = self.rust.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return out

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True) -> Any:
        if not add_generation_prompt:
            raise ValueError("the light tokenizer renders conversations for a reply only")
        return self.chat_ids(messages) if tokenize else self.render_chat(messages)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.rust.encode(text, add_special_tokens=add_special_tokens).ids)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if self._compiled is None:
            raise ValueError("this tokenizer has no chat template")
        out: str = self._compiled.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=True, **self.template_vars)
        return out

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        # As transformers with tokenize=True: render, then encode without adding special tokens (the template
        # writes its own).
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        vocab: dict[str, int] = self.rust.get_vocab()
        return vocab

    @property
    def normalizer(self) -> Any:
        return self.rust.normalizer

    def probe_ids(self) -> dict[str, Any]:
        """The ids of every probe, and the text of decoding them back, as the record stores them."""
        texts = [[self.encode(t, True), self.encode(t, False)] for t in PROBE_TEXTS]
        chats = [self.chat_ids(list(c)) if self._compiled is not None else None for c in PROBE_CHATS]
        return {"texts": texts, "chats": chats, "decoded": _decoded(self, texts, chats)}


def _decoded(tok: Any, texts: list[Any], chats: list[Any]) -> list[list[str]]:
    seqs = [ids for pair in texts for ids in pair] + [c for c in chats if c is not None]
    seqs.append(list(range(0, 64)) + [len(tok) - 1])  # the special and added tokens, and the last id
    return [[str(tok.decode(list(ids), skip_special_tokens=skip)) for skip in (True, False)] for ids in seqs]


def _reference_ids(tok: Any, has_template: bool) -> dict[str, Any]:
    """The probes' ids (and their decoding back) as the transformers tokenizer ``tok`` gives them."""
    texts = [[[int(i) for i in tok.encode(t, add_special_tokens=s)] for s in (True, False)] for t in PROBE_TEXTS]
    chats: list[Any] = []
    for conv in PROBE_CHATS:
        if not has_template:
            chats.append(None)
            continue
        out: Any = tok.apply_chat_template(list(conv), add_generation_prompt=True, tokenize=True)
        if hasattr(out, "input_ids"):  # transformers 5 may return a BatchEncoding
            out = out["input_ids"]
        chats.append([int(i) for i in out])
    return {"texts": texts, "chats": chats, "decoded": _decoded(tok, texts, chats)}


def _meta(tok: Any) -> dict[str, Any]:
    """What the mock engine reads of a tokenizer besides encoding: its end-of-sequence id, its special and added
    ids, its length."""
    special = {int(t) for t in getattr(tok, "all_special_ids", ())}
    special |= {int(t) for t in getattr(tok, "added_tokens_decoder", {})}
    eos = getattr(tok, "eos_token_id", None)
    return {"eos_token_id": int(eos) if eos is not None else None, "special_ids": sorted(special),
            "len": len(tok)}


def vouch(directory: str | Path, tok: Any) -> LightTokenizer | None:
    """The light tokenizer for ``directory`` when it gives exactly the ids of ``tok`` (the transformers tokenizer
    loaded from that folder) on every probe, and a record saying so for :func:`vouched`; None otherwise."""
    directory = Path(directory)
    key = _key(directory)
    if key is None or getattr(tok, "backend_tokenizer", None) is None:
        return None
    try:
        template = getattr(tok, "chat_template", None)
        template = template if isinstance(template, str) else None
        template_vars: dict[str, Any] = {}
        for k, v in tok.special_tokens_map.items():  # strings, or lists of them (additional special tokens)
            if isinstance(v, str):
                template_vars[k] = v
            elif isinstance(v, list):
                template_vars[k] = [str(x) for x in v]
        meta = _meta(tok)
        light = LightTokenizer(directory, template, template_vars, meta)
        reference = _reference_ids(tok, template is not None)
        if light.probe_ids() != reference:
            log.info("the light tokenizer differs from transformers' for %s: not used", directory)
            return None
    except Exception as exc:  # a template jinja cannot compile alone, an odd tokenizer: transformers stays
        log.info("no light tokenizer for %s: %s", directory, exc)
        return None
    record = {"version": RECORD_VERSION, "chat_template": template, "template_vars": template_vars,
              "meta": meta, "probes": reference}
    path = _record_path(key)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # only this user may vouch for a tokenizer
        fd, tmp = tempfile.mkstemp(prefix=".tok-", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError as exc:  # an unwritable home: this process uses it, later ones vouch again
        log.info("could not keep the tokenizer record %s: %s", path, exc)
    return light


def vouched(directory: str | Path) -> LightTokenizer | None:
    """The light tokenizer for ``directory`` if an earlier :func:`vouch` recorded that these very files, with
    these library versions, tokenize as transformers does (and the probes still give the recorded ids); None
    otherwise (load transformers' and :func:`vouch`)."""
    directory = Path(directory)
    key = _key(directory)
    if key is None:
        return None
    try:
        record = json.loads(_record_path(key).read_text(encoding="utf-8"))
        if not isinstance(record, dict) or record.get("version") != RECORD_VERSION:
            return None
        light = LightTokenizer(directory, record["chat_template"], record["template_vars"], record["meta"])
        if light.probe_ids() != record["probes"]:
            return None
        return light
    except (OSError, ValueError, KeyError, TypeError):
        return None
    except Exception as exc:  # a template that no longer compiles, a tokenizer.json tokenizers refuses
        log.info("tokenizer record for %s not usable: %s", directory, exc)
        return None
