"""W3C trace context carried in NATS headers across every hop, and where finished spans go.

A message's headers get ``traceparent`` (and ``tracestate``) from the current span; a receiver starts its
span as a child of what it extracts, so one request is one trace from the client through router,
prefiller, KV transfer and decoder.

:func:`setup_tracing` installs the real SDK ``TracerProvider`` (until it runs, every span is a no-op and
nothing propagates). Exporters, chosen by environment:

- ``OTEL_EXPORTER_OTLP_ENDPOINT`` set: the official OTLP exporter (``OTEL_EXPORTER_OTLP_PROTOCOL``
  ``http/protobuf``, the default, or ``grpc``), for a collector / Jaeger / Tempo.
- otherwise: :class:`NatsSpanExporter`, which publishes finished spans as ``SpanBatch`` messages on
  ``ss.trace.spans.{service}``; the JetStream stream ``SS_TRACES`` (bounded by age and bytes) keeps them
  so ``splitserve trace REQUEST_ID`` can draw a waterfall without any extra infrastructure.

``SPLITSERVE_TRACING=off`` (or the standard ``OTEL_SDK_DISABLED=true``) disables tracing;
``SPLITSERVE_TRACE_SAMPLE`` (0..1, default 1) sets the ratio of new traces sampled (a continued trace follows
its parent's decision); the standard ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``, when set, win.

Spans of a request carry the OpenTelemetry GenAI semantic conventions (``gen_ai.*``, :func:`gen_ai_request`
and :func:`gen_ai_response`) beside splitserve's own attributes, so GenAI-aware backends read them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, Status, StatusCode

_TRACER_NAME = "splitserve"

TRACE_STREAM = "SS_TRACES"
TRACE_STREAM_MAX_AGE_S = 3600.0
TRACE_STREAM_MAX_BYTES = 256 * 1024 * 1024

_provider: TracerProvider | None = None
_nats_exporter: NatsSpanExporter | None = None
_lock = threading.Lock()


_tracer_of: tuple[Any, trace.Tracer] | None = None  # (the provider it came from, the tracer)


def tracer() -> trace.Tracer:
    """splitserve's tracer, made once per tracer provider (``trace.get_tracer`` builds a new one on every
    call: a per-request cost on every hot path)."""
    global _tracer_of
    provider = trace.get_tracer_provider()
    cached = _tracer_of
    if cached is not None and cached[0] is provider:
        return cached[1]
    t = trace.get_tracer(_TRACER_NAME)
    _tracer_of = (provider, t)
    return t


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
        span.add_event("error", {"message": exc})
        span.set_status(Status(StatusCode.ERROR, exc))


def set_attrs(span: Span, prefix: str = "", **attrs: Any) -> None:
    """Set attributes, skipping None; lists/dicts become JSON strings (OTel attributes are scalars). One
    ``set_attributes`` call (the SDK takes its lock once); nothing is encoded for a span that is not recorded
    (sampled out, or tracing off)."""
    if not span.is_recording():
        return
    out: dict[str, Any] = {}
    for k, v in attrs.items():
        if v is None:
            continue
        out[f"{prefix}{k}"] = v if isinstance(v, (str, bool, int, float)) else json.dumps(
            v, default=str, separators=(",", ":"))
    span.set_attributes(out)


def _clean(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if v is not None and isinstance(v, (str, int, float, bool))}


# --- setup -------------------------------------------------------------------------------------------
def tracing_enabled() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return os.environ.get("SPLITSERVE_TRACING", "on").strip().lower() not in ("off", "0", "false", "no")


def _sampler() -> Any:
    """OTEL_TRACES_SAMPLER (+ _ARG) when set (the SDK's own parsing), else parent-based ratio sampling."""
    if os.environ.get("OTEL_TRACES_SAMPLER", "").strip():
        from opentelemetry.sdk.trace import sampling

        return sampling._get_from_env_or_default()
    return ParentBased(TraceIdRatioBased(_sample_ratio()))


# --- OpenTelemetry GenAI semantic conventions ----------------------------------------------------------
GEN_AI_PROVIDER = "splitserve"


def gen_ai_request(*, chat: bool, model: str | None, max_tokens: int | None = None,
                   temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                   stop: Sequence[str] | None = None, request_id: str | None = None) -> dict[str, Any]:
    """The request half of the GenAI conventions (``gen_ai.system`` is the older name of the provider)."""
    out: dict[str, Any] = {
        "gen_ai.operation.name": "chat" if chat else "text_completion",
        "gen_ai.provider.name": GEN_AI_PROVIDER, "gen_ai.system": GEN_AI_PROVIDER,
        "gen_ai.request.model": model, "gen_ai.request.max_tokens": max_tokens,
        "gen_ai.request.temperature": temperature, "gen_ai.request.top_p": top_p, "gen_ai.request.seed": seed,
        "gen_ai.request.stop_sequences": list(stop) if stop else None,
        "gen_ai.request.id": request_id,
    }
    return {k: v for k, v in out.items() if v is not None}


def gen_ai_of(req: Any, model: str | None = None) -> dict[str, Any]:
    """:func:`gen_ai_request` of a ``proto.GenerateRequest`` (its requested model, else ``model``)."""
    sp = req.sampling
    return gen_ai_request(chat=req.messages is not None, model=getattr(req, "model", None) or model,
                          max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed,
                          stop=sp.stop, request_id=req.request_id)


def gen_ai_response(span: Span, *, response_id: str | None = None, model: str | None = None,
                    finish_reason: str | None = None, input_tokens: int | None = None,
                    output_tokens: int | None = None, cached_tokens: int | None = None) -> None:
    attrs: dict[str, Any] = {
        "gen_ai.response.id": response_id, "gen_ai.response.model": model,
        "gen_ai.response.finish_reasons": [finish_reason] if finish_reason else None,
        "gen_ai.usage.input_tokens": input_tokens, "gen_ai.usage.output_tokens": output_tokens,
        "gen_ai.usage.cache_read.input_tokens": cached_tokens,
    }
    for k, v in attrs.items():
        if v is not None:
            span.set_attribute(k, v)


def _sample_ratio() -> float:
    try:
        return min(1.0, max(0.0, float(os.environ.get("SPLITSERVE_TRACE_SAMPLE", "1"))))
    except ValueError:
        return 1.0


def _otlp_exporter() -> SpanExporter | None:
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") and not os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return None
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    # Both exporters read endpoint, headers, timeout and TLS settings from the standard OTEL_* variables.
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError:
            raise RuntimeError("OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the gRPC exporter: "
                               "pip install 'splitserve[otlp-grpc]' (or use http/protobuf)") from None

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter()


def setup_tracing(service_name: str, worker_id: str, bus_or_nc: Any = None) -> TracerProvider | None:
    """Install the process's TracerProvider once (later calls return it). ``bus_or_nc`` (a Bus or a nats
    client) is where the embedded exporter publishes when no OTLP endpoint is configured. Returns None
    when tracing is off, or when the application installed a provider of its own (then spans go there)."""
    global _provider, _nats_exporter
    if not tracing_enabled():
        return None
    with _lock:
        if _provider is not None:
            nc = getattr(bus_or_nc, "nc", bus_or_nc)
            # A process that connects again (a new event loop per asyncio.run, a reconnecting client):
            # spans follow the newest live connection instead of a closed one.
            if _nats_exporter is not None and nc is not None and not _nats_exporter.usable():
                _nats_exporter.rebind(nc)
            return _provider
        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):  # the embedding application configured OTel: respect it
            return None
        exporter = _otlp_exporter()
        if exporter is None:
            nc = getattr(bus_or_nc, "nc", bus_or_nc)
            if nc is None:
                return None  # nowhere to send spans: stay a no-op rather than buffer forever
            exporter = _nats_exporter = NatsSpanExporter(nc, service_name, worker_id)
            with contextlib.suppress(RuntimeError):  # no running loop: the reader creates the stream
                asyncio.get_running_loop().create_task(ensure_trace_stream(nc))
        provider = TracerProvider(
            resource=Resource.create({"service.name": service_name, "service.instance.id": worker_id}),
            sampler=_sampler(),
        )
        # Small batches flushed often: a debugger wants a request's spans within a second, and the
        # export runs on the processor's own thread, off the service's event loop.
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500,
                                                       max_export_batch_size=256))
        trace.set_tracer_provider(provider)
        _provider = provider
        return provider


async def flush_tracing(timeout_s: float = 5.0) -> None:
    """Export what is buffered (before a process exits). In a thread: the NATS exporter needs the loop."""
    if _provider is not None:
        await asyncio.to_thread(_provider.force_flush, int(timeout_s * 1000))


async def ensure_trace_stream(nc: Any) -> None:
    """Create (or update) the bounded JetStream stream that keeps spans. Idempotent; never raises."""
    from nats.js.api import StorageType, StreamConfig

    from splitserve.proto import Subjects

    cfg = StreamConfig(name=TRACE_STREAM, subjects=[Subjects.TRACE_SPANS_ALL], max_age=TRACE_STREAM_MAX_AGE_S,
                       max_bytes=TRACE_STREAM_MAX_BYTES, storage=StorageType.FILE)
    from splitserve.runtime.jetstream import ensure_stream, replicas_for

    with contextlib.suppress(Exception):
        await ensure_stream(nc.jetstream(), cfg, replicas_for(nc))


# --- the embedded exporter ---------------------------------------------------------------------------
def span_to_record(span: ReadableSpan, service: str, worker_id: str) -> dict[str, Any]:
    ctx = span.get_span_context()
    parent = span.parent
    assert ctx is not None
    return {
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(parent.span_id, "016x") if parent is not None else None,
        "name": span.name,
        "service": service,
        "worker_id": worker_id,
        "start_ns": span.start_time or 0,
        "end_ns": span.end_time or span.start_time or 0,
        "status": span.status.status_code.name.lower(),
        "status_message": span.status.description,
        "attributes": {k: (list(v) if isinstance(v, tuple) else v) for k, v in (span.attributes or {}).items()},
        "events": [{"name": e.name, "ts_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                   for e in span.events],
    }


class NatsSpanExporter(SpanExporter):
    """Publishes finished spans as one ``SpanBatch`` per export on the process's own NATS connection.

    Called on the BatchSpanProcessor's thread; the publish is handed to the connection's event loop and
    not awaited there (a plain publish: the stream captures the subject, no per-batch ack round trip)."""

    def __init__(self, nc: Any, service: str, worker_id: str) -> None:
        self.service = service
        self.worker_id = worker_id
        self.loop: asyncio.AbstractEventLoop | None = None
        self.rebind(nc)

    def rebind(self, nc: Any) -> None:
        """Publish on this connection (and its event loop, the one running now) from now on."""
        self.nc = nc
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None

    def usable(self) -> bool:
        return (self.loop is not None and not self.loop.is_closed() and bool(self.nc.is_connected))

    def encode(self, spans: Sequence[ReadableSpan]) -> bytes:
        from splitserve.proto import SpanBatch, encode

        batch = SpanBatch(service=self.service, worker_id=self.worker_id,
                          spans=[span_to_record(s, self.service, self.worker_id) for s in spans])
        return encode(batch)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from splitserve.proto import Subjects

        if not spans:
            return SpanExportResult.SUCCESS
        loop = self.loop
        if loop is None or not self.usable():
            return SpanExportResult.FAILURE
        data = self.encode(spans)
        subject = Subjects.trace_spans(self.service)
        fut = asyncio.run_coroutine_threadsafe(self.nc.publish(subject, data), loop)
        # Wait briefly unless we are the loop's own thread (a flush from the loop would deadlock).
        if getattr(loop, "_thread_id", None) != threading.get_ident():
            with contextlib.suppress(Exception):
                fut.result(timeout=2.0)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# --- reading spans back ------------------------------------------------------------------------------
async def read_spans(nc: Any, *, limit: int = 200_000) -> list[dict[str, Any]]:
    """Every span record held in SS_TRACES (oldest first)."""
    from nats.js.api import DeliverPolicy
    from nats.js.errors import NotFoundError

    from splitserve.proto import SpanBatch, decode

    js = nc.jetstream()
    try:
        info = await js.stream_info(TRACE_STREAM)
    except NotFoundError:
        return []
    last = info.state.last_seq
    if info.state.messages == 0 or last == 0:
        return []
    out: list[dict[str, Any]] = []
    sub = await js.subscribe(f"{_spans_prefix()}>", ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    try:
        while len(out) < limit:
            try:
                msg = await sub.next_msg(timeout=2.0)
            except Exception:
                break
            with contextlib.suppress(Exception):
                out.extend(decode(msg.data, SpanBatch).spans)
            if msg.metadata.sequence.stream >= last:
                break
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return out


def _spans_prefix() -> str:
    from splitserve.proto import Subjects

    return Subjects.TRACE_SPANS_ALL[:-1]


def spans_for_request(spans: Sequence[Mapping[str, Any]], request_id: str) -> list[dict[str, Any]]:
    """All spans of the trace(s) in which some span has attribute ``request_id`` == request_id."""
    tids = {s["trace_id"] for s in spans if (s.get("attributes") or {}).get("request_id") == request_id}
    picked = [dict(s) for s in spans if s["trace_id"] in tids]
    picked.sort(key=lambda s: (s["start_ns"], s["end_ns"]))
    return picked


def slowest_requests(spans: Sequence[Mapping[str, Any]], n: int) -> list[dict[str, Any]]:
    """The n longest traces: (trace_id, request_id, root span name, start, duration, error)."""
    by_trace: dict[str, list[Mapping[str, Any]]] = {}
    for s in spans:
        by_trace.setdefault(s["trace_id"], []).append(s)
    rows = []
    for tid, group in by_trace.items():
        ids = {s["span_id"] for s in group}
        roots = [s for s in group if s.get("parent_id") not in ids] or list(group)
        root = min(roots, key=lambda s: s["start_ns"])
        start = min(s["start_ns"] for s in group)
        end = max(s["end_ns"] for s in group)
        rid = next((s["attributes"]["request_id"] for s in group if "request_id" in (s.get("attributes") or {})),
                   None)
        rows.append({"trace_id": tid, "request_id": rid, "root": f"{root['service']}:{root['name']}",
                     "start_ns": start, "duration_ms": (end - start) / 1e6, "spans": len(group),
                     "error": any(s.get("status") == "error" for s in group)})
    rows.sort(key=lambda r: -float(r["duration_ms"]))
    return rows[:n]
