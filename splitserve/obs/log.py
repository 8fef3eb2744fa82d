"""structlog JSON logging for every service process.

Every line is one JSON object (on stderr, or appended to the file the supervisor names in
``SPLITSERVE_LOG_FILE``) with the service, its worker id, and whatever request-scoped
context is bound (request_id, tenant, trace_id, span_id), so that logs join with traces. The standard
library's loggers (transformers, uvicorn, nats, vllm, torch, ...) and Python warnings go through structlog's
``ProcessorFormatter`` into the same JSON; uncaught exceptions are logged as JSON too; progress bars are
switched off (:func:`quiet_third_party`), since a bar redrawn with carriage returns is not a log line.

It also owns keeping secrets out of the logs: every event, structlog's and the standard library's, goes
through :func:`redact_secrets` last before rendering (credential-named fields, registered secret values,
``user:password@`` in URLs, ``Bearer``/``Authorization`` text); tracebacks never carry frame locals; and
the log files and their directory are created owner-only (:func:`private_dir`, :func:`private_opener`).
Secrets known from the environment (the NATS password, the nkey seed, the console's admin keys) are
registered by :func:`configure_logging` itself; a service that loads others calls :func:`register_secret`.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import stat
import sys
import threading
import urllib.parse
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog
from opentelemetry import trace
from structlog.tracebacks import ExceptionDictTransformer

# What libraries read to stay quiet: set before they are imported (the supervisor also sets them for its
# children, so a library imported before configure_logging already sees them).
QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",  # else a fork warning per worker
    "VLLM_CONFIGURE_LOGGING": "0",  # vLLM leaves the root logger to us (its loggers propagate to it)
}


ENV_LOG_SERVICE = "SPLITSERVE_LOG_SERVICE"


def inherit_logging() -> None:
    """In a process a service's library spawned (vLLM's engine core and workers): the parent's JSON logging,
    with the process's own name. Does nothing outside a splitserve service."""
    raw = os.environ.get(ENV_LOG_SERVICE, "")
    if raw.count("\t") == 2:
        service, worker_id, level = raw.split("\t")
        import multiprocessing

        configure_logging(service, f"{worker_id}/{multiprocessing.current_process().name}", level)


def _add_trace_ids(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


# ------------------------------------------------------------------------------------------------ secrets

REDACTED = "[REDACTED]"
# Shorter values are not masked inside text: a 1-3 character "secret" would blank out every word holding it
# and is no secret anyway. (A field named like a credential is redacted whatever its length.)
MIN_SECRET_LEN = 4
# Environment variables whose values are secrets, registered by configure_logging in every process (the
# names are natsauth.ENV_PASSWORD, natsauth.ENV_NKEY_SEED and consolekey.ADMIN_KEYS_ENV: spelled out here so
# that logging imports nothing of the product).
SECRET_ENV = ("SPLITSERVE_NATS_PASSWORD",)
SEED_ENV = "SPLITSERVE_NATS_NKEY_SEED"  # a seed file's path (or, from some callers, the seed itself)
LIST_SECRET_ENV = ("SPLITSERVE_CONSOLE_ADMIN_KEYS",)  # comma-separated

# A field whose (normalised) name contains one of these holds a credential whatever its value.
_SECRET_KEY_PARTS = ("password", "passwd", "secret", "api_key", "apikey", "authorization", "bearer",
                     "credential", "cookie", "nkey_seed", "private_key", "admin_key")
# Names that are credentials only when the value is text: ``token`` and ``seed`` are also token ids and
# sampling seeds (ints), and ``*_tokens`` counts (prompt_tokens, max_tokens, tokens_per_minute, token_ids)
# never match: the name must end in ``token`` itself, alone or after a credential-ish prefix.
_TEXT_SECRET_KEY = re.compile(
    r"^(?:(?:.*_)?(?:access|refresh|auth|id|api|bearer|session|csrf|xsrf|jwt|oauth|nats|hf|github|service)_?)?token"
    r"$|^(?:.*_)?seed$")
# An nkey seed: "S", the key type, base32 (58 characters in all).
_NKEY_SEED = re.compile(r"\bS[UACNOX][A-Z2-7]{56}\b")
# Secrets in free text (messages, exception values, reprs); each keeps the words around the secret (the
# scheme and user, the header name, the field name), so the line still says what failed.
_TEXT_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # scheme://user:password@host and scheme://token@host (nats:// takes a token as the whole userinfo)
    (re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)([^\s/@:\[\]]+):(?!\[REDACTED\]@)[^\s/@]+@"), r"\1\2:" + REDACTED + "@"),
    (re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)(?!\[REDACTED\]@)[^\s/@:\[\]]+@"), r"\1" + REDACTED + "@"),
    # Authorization: <scheme> <credentials> (as a header line, a header tuple's repr, or key=value)
    (re.compile(r"(?i)\b((?:proxy-)?authorization)((?:['\"]\s*,|['\"]?\s*[:=])\s*(?:(?-i:b)?['\"])?)"
                r"(?!\[REDACTED\])[^\r\n'\",;}]+"), r"\1\2" + REDACTED),
    (re.compile(r"(?i)\b(bearer|basic)\s+(?!\[REDACTED\])[A-Za-z0-9._~+/=\-]{4,}"), r"\1 " + REDACTED),
    # password=..., api_key: ..., nkey_seed="..." inside text (a dataclass's repr, an argv, a DSN)
    (re.compile(r"(?i)(?<![a-z0-9])(password|passwd|pwd|secret|api[_-]?key|apikey|nkey[_-]?seed|admin[_-]?key"
                r"|access[_-]?token|refresh[_-]?token|auth[_-]?token)(['\"]?\s*[:=]\s*)((?:(?-i:b)?['\"])?)"
                r"(?!\[REDACTED\]|None\b)[^\s'\",;&})\]]+"), r"\1\2\3" + REDACTED),
)
# Every pattern above needs one of these (lower-cased) in the text: one cheap scan skips them all for the
# usual string (an id, a path, a timestamp). The nkey seed, which needs none, is looked for on its own.
_TRIGGERS = ("://", "authorization", "bearer", "basic", "pass", "pwd", "secret", "key", "seed", "token")

_secrets: set[str] = set()
_secrets_re: re.Pattern[str] | None = None
_secrets_lock = threading.Lock()


def register_secret(*values: str | bytes | None) -> None:
    """Values that must never appear in a log line: any string in any event containing one is masked. Call
    at startup with what the process was given (keys, passwords); empty and very short values are ignored."""
    global _secrets_re
    forms: set[str] = set()
    for v in values:
        if isinstance(v, bytes):
            v = v.decode("utf-8", errors="replace")
        v = (v or "").strip()
        if len(v) < MIN_SECRET_LEN:
            continue
        # As it may be written: itself, percent-encoded (in a URL), escaped (in a repr or JSON text).
        forms.update({v, urllib.parse.quote(v, safe=""), repr(v)[1:-1]})
    with _secrets_lock:
        if forms <= _secrets:
            return
        _secrets.update(forms)
        # Longest first, so that a secret containing another is masked whole.
        _secrets_re = re.compile("|".join(re.escape(s) for s in sorted(_secrets, key=len, reverse=True)))


def register_secrets_from_env(environ: Mapping[str, str] | None = None) -> None:
    """Register the secrets a splitserve process is handed in its environment (the NATS password, the nkey
    seed, the console admin keys). Done by :func:`configure_logging`, so every service gets it."""
    env = os.environ if environ is None else environ
    register_secret(*(env.get(k) for k in SECRET_ENV))
    for k in LIST_SECRET_ENV:
        register_secret(*(env.get(k) or "").split(","))
    seed = env.get(SEED_ENV) or ""
    if seed:
        register_secret(seed if _NKEY_SEED.fullmatch(seed.strip()) else None)
        try:  # the usual case: a seed file's path (the path is no secret; what the file holds is)
            path = Path(seed)
            if path.is_file() and path.stat().st_size <= 64 * 1024:
                # only the seed lines: a .creds file's boilerplate ("NKEYs are sensitive...") is no secret
                register_secret(*(ln for ln in path.read_text(errors="replace").split() if _NKEY_SEED.fullmatch(ln)))
        except (OSError, ValueError):
            pass


def mask_text(text: str) -> str:
    """``text`` with every registered secret and every credential-looking pattern replaced by [REDACTED]."""
    if len(text) < MIN_SECRET_LEN:
        return text
    pattern = _secrets_re
    if pattern is not None:
        text = pattern.sub(REDACTED, text)
    low = text.lower()
    if any(t in low for t in _TRIGGERS):
        for rx, repl in _TEXT_PATTERNS:
            text = rx.sub(repl, text)
    if len(text) >= 58:  # an nkey seed ("S" + key type + base32: 58 characters), wherever it shows up
        text = _NKEY_SEED.sub(REDACTED, text)
    return text


@functools.lru_cache(maxsize=4096)  # a service logs the same few dozen field names over and over
def _key_kind(key: str) -> int:
    """2: a credential whatever the value; 1: a credential when the value is text; 0: not a credential."""
    k = key.lower().replace("-", "_")
    if any(part in k for part in _SECRET_KEY_PARTS):
        return 2
    return 1 if _TEXT_SECRET_KEY.match(k) else 0


def is_secret_key(key: str, value: Any) -> bool:
    """Whether a field named ``key`` holding ``value`` is a credential (see _SECRET_KEY_PARTS)."""
    if value is None or isinstance(value, bool):
        return False  # "no password" / "has a key" give nothing away, and say something when debugging
    kind = _key_kind(key)
    return kind == 2 or (kind == 1 and isinstance(value, str | bytes))


_MAX_DEPTH = 24
_PLAIN = (int, float, bool, type(None))


def _redact(value: Any, depth: int) -> Any:
    if isinstance(value, str):
        return mask_text(value)
    if isinstance(value, _PLAIN):
        return value
    if depth < _MAX_DEPTH:
        if isinstance(value, Mapping):
            return {k: REDACTED if isinstance(k, str) and is_secret_key(k, v) else _redact(v, depth + 1)
                    for k, v in value.items()}
        if isinstance(value, list | tuple | set | frozenset):
            return [_redact(v, depth + 1) for v in value]
    # Anything else is rendered with repr() by the JSON renderer: mask that text, and keep the object itself
    # when there was nothing to mask (the line stays exactly as before).
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not lose the line
        return value
    masked = mask_text(text)
    return value if masked == text else masked


def redact_secrets(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor, run last before rendering on every event (the traceback already rendered to
    text by then): credential-named fields at any depth become [REDACTED], secrets inside text are masked."""
    for key in list(event):
        value = event[key]
        event[key] = REDACTED if isinstance(key, str) and is_secret_key(key, value) else _redact(value, 0)
    return event


# Structured tracebacks without frame locals: a local holding a password, an API key or a request's prompt
# would otherwise be printed by every exception logged (structlog's default is show_locals=True).
dict_tracebacks = structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False))


def private_dir(path: Path) -> Path:
    """``mkdir -p path``, and the directory readable by its owner only (0700), also when it already existed.
    A shared directory (someone else's, or sticky like /tmp: ``--state-dir /tmp``, even as root) keeps its
    mode: closing it would break its other users, and what we create inside is private anyway."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid == os.geteuid() and not st.st_mode & stat.S_ISVTX:
        os.chmod(path, 0o700)
    return path


def private_opener(path: str | os.PathLike[str], flags: int) -> int:
    """``open(..., opener=private_opener)``: the file is created 0600 (never briefly readable by others), and an
    existing one (from before this rule, or another umask) is put back to 0600."""
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def quiet_third_party() -> None:
    """Progress bars off, library verbosity through logging (call before loading models)."""
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    try:  # transformers caches its settings at import: tell it directly as well, when it is loaded
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            hf_logging.disable_default_handler()
            hf_logging.enable_propagation()
    except Exception:  # a logging nicety must never stop a service
        pass


class _Stderr:
    """``sys.stderr`` as it is when a line is written, not when logging was configured: a CLI command run inside
    another program (a test's runner, an embedding app) may swap it for a stream it closes afterwards."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


_STDERR: Any = _Stderr()

# Set by the supervisor (``splitserve up``) for each service it runs: the service appends its JSON lines to
# this file itself. Through the supervisor's pipe, every line cost three system calls and a JSON parse in the
# supervisor (read, check, write: about 0.4 ms of CPU per request at seven lines a request); the pipe is left
# to what is written straight to the file descriptors (a native library's output), which the supervisor wraps.
ENV_LOG_FILE = "SPLITSERVE_LOG_FILE"


class _LogFile:
    """An owner-only log file opened for appending, written one whole line per system call (O_APPEND keeps
    lines whole beside the supervisor's own writes to the same file, and beside a library's child processes)."""

    def __init__(self, path: str) -> None:
        self.fd = private_opener(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def write(self, s: str) -> int:
        data = s.encode("utf-8", errors="replace")
        view = memoryview(data)
        while view:  # a regular file takes it whole; a short write (disk full...) is retried, not split silently
            n = os.write(self.fd, view)
            view = view[n:]
        return len(s)

    def flush(self) -> None:
        pass


_log_files: dict[str, _LogFile] = {}


def _sink() -> Any:
    """Where this process's log lines go: the file the supervisor named, else stderr (as it is at each write)."""
    path = os.environ.get(ENV_LOG_FILE, "")
    if not path:
        return _STDERR
    try:
        if path not in _log_files:
            _log_files[path] = _LogFile(path)
        return _log_files[path]
    except OSError as exc:  # logging must not stop a service: stderr (the supervisor's pipe) still works
        print(f"cannot open the log file {path}: {exc}; logging to stderr", file=sys.stderr)
        return _STDERR


def configure_logging(service: str, worker_id: str, level: str = "INFO") -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_trace_ids,
    ]
    register_secrets_from_env()
    sink = _sink()
    structlog.configure(
        # redact_secrets last before rendering: it must also see the traceback dict_tracebacks renders.
        processors=[*shared, dict_tracebacks, redact_secrets, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # one write per line (PrintLogger writes the line and its newline apart: two system calls)
        logger_factory=structlog.WriteLoggerFactory(sink),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, worker_id=worker_id)
    # Child processes a library spawns (vLLM's engine core) log as this service too: see inherit_logging.
    os.environ[ENV_LOG_SERVICE] = f"{service}\t{worker_id}\t{level}"
    # The standard library's records (every third-party logger, and warnings) rendered by the same chain.
    handler = logging.StreamHandler(sink)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    dict_tracebacks, redact_secrets, structlog.processors.JSONRenderer()],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # Libraries stay at WARNING (their INFO is chatty) unless the service itself logs at DEBUG.
    root.setLevel(max(lvl, logging.WARNING) if lvl > logging.DEBUG else lvl)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "vllm", "transformers", "nixl", "torch"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    logging.captureWarnings(True)
    quiet_third_party()
    log = structlog.get_logger("uncaught")

    def _hook(tp: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if issubclass(tp, KeyboardInterrupt):
            sys.__excepthook__(tp, exc, tb)
            return
        log.critical("uncaught_exception", exc_info=(tp, exc, tb))

    sys.excepthook = _hook


def adopt_loggers(*names: str) -> None:
    """Route loggers a library configured on import (its own handlers, propagate off) to the JSON handler."""
    for name in names:
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)


def configure_client_logging(level: str = "WARNING") -> None:
    """For CLI client commands: warnings only, to stderr, so stdout stays clean (``--json`` output)."""
    register_secrets_from_env()
    structlog.configure(
        processors=[structlog.processors.add_log_level, dict_tracebacks, redact_secrets,
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.WARNING)),
        logger_factory=structlog.PrintLoggerFactory(_STDERR),
        cache_logger_on_first_use=True,
    )
