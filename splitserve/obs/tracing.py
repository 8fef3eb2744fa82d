"""W3C trace context carried in NATS headers across every hop.

A message's headers get ``traceparent`` (and ``tracestate``) from the current span; a receiver starts its
span as a child of what it extracts, so one request is one trace from the client through router,
prefiller, KV transfer and decoder.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, Status, StatusCode

_TRACER_NAME = "splitserve"


def tracer() -> trace.Tracer:
    return trace.get_tracer(_TRACER_NAME)


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    out: dict[str, str] = dict(headers or {})
    propagate.inject(out)
    return out


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(dict(headers or {}))


@contextmanager
def span_from(headers: Mapping[str, str] | None, name: str, **attrs: Any) -> Iterator[Span]:
    """A span that continues the trace found in a message's headers."""
    ctx = extract(headers)
    with tracer().start_as_current_span(name, context=ctx, attributes=_clean(attrs)) as sp:
        yield sp


def record_error(span: Span, exc: BaseException | str) -> None:
    if isinstance(exc, BaseException):
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, str(exc)))
    else:
        span.set_status(Status(StatusCode.ERROR, exc))


def _clean(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if v is not None and isinstance(v, (str, int, float, bool))}
