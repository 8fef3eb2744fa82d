"""structlog JSON logging for every service process.

Every line is one JSON object on stderr with the service, its worker id, and whatever request-scoped
context is bound (request_id, tenant, trace_id, span_id), so that logs join with traces.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog
from opentelemetry import trace


def _add_trace_ids(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


def configure_logging(service: str, worker_id: str, level: str = "INFO") -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_ids,
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, worker_id=worker_id)
    # Libraries that use stdlib logging (nats, transformers) go through the same level.
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr, format="%(name)s %(message)s")


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)


def configure_client_logging(level: str = "WARNING") -> None:
    """For CLI client commands: warnings only, to stderr, so stdout stays clean (``--json`` output)."""
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.WARNING)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
