"""structlog JSON logging for every service process.

Every line is one JSON object on stderr with the service, its worker id, and whatever request-scoped
context is bound (request_id, tenant, trace_id, span_id), so that logs join with traces. The standard
library's loggers (transformers, uvicorn, nats, vllm, torch, ...) and Python warnings go through structlog's
``ProcessorFormatter`` into the same JSON; uncaught exceptions are logged as JSON too; progress bars are
switched off (:func:`quiet_third_party`), since a bar redrawn with carriage returns is not a log line.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from types import TracebackType
from typing import Any

import structlog
from opentelemetry import trace

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


def configure_logging(service: str, worker_id: str, level: str = "INFO") -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_trace_ids,
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(_STDERR),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, worker_id=worker_id)
    # Child processes a library spawns (vLLM's engine core) log as this service too: see inherit_logging.
    os.environ[ENV_LOG_SERVICE] = f"{service}\t{worker_id}\t{level}"
    # The standard library's records (every third-party logger, and warnings) rendered by the same chain.
    handler = logging.StreamHandler(_STDERR)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()],
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
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.WARNING)),
        logger_factory=structlog.PrintLoggerFactory(_STDERR),
        cache_logger_on_first_use=True,
    )
