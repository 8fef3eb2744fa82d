"""The embedded span exporter and the reader: spans published as SpanBatch land in SS_TRACES and come back
as the same records; a request's trace is found by its request_id and drawn as a waterfall."""

from __future__ import annotations

import asyncio
import io

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from rich.console import Console

from splitserve.natsserver import NatsServer
from splitserve.obs import tracing
from splitserve.obs.waterfall import render_slowest, render_waterfall
from splitserve.runtime.bus import Bus


def test_setup_tracing_off(monkeypatch: object) -> None:
    import os

    os.environ["SPLITSERVE_TRACING"] = "off"
    try:
        assert tracing.setup_tracing("router", "r1", None) is None
    finally:
        del os.environ["SPLITSERVE_TRACING"]


def test_round_trip(nats_server: NatsServer) -> None:
    async def go() -> list[dict[str, object]]:
        bus = await Bus.connect(nats_server.url, "test:trace")
        try:
            await tracing.ensure_trace_stream(bus.nc)
            await tracing.ensure_trace_stream(bus.nc)  # idempotent
            # A provider of the test's own: the process-global one can be set only once.
            provider = TracerProvider()
            provider.add_span_processor(SimpleSpanProcessor(tracing.NatsSpanExporter(bus.nc, "router", "r1")))
            tr = provider.get_tracer("t")
            with tr.start_as_current_span("router.request", attributes={"request_id": "req-1"}) as root:
                tracing.set_attrs(root, "decision.", strategy="kvaware", candidates=[{"worker": "d1"}])
                # The child continues the trace through headers, as a NATS hop does.
                headers = {}
                from opentelemetry import propagate

                propagate.inject(headers)
                with tr.start_as_current_span("kv.push", context=tracing.extract(headers)) as sp:
                    sp.set_attribute("kv.bytes", 1024)
                    tracing.record_error(sp, "decoder vanished")
            with tr.start_as_current_span("router.request", attributes={"request_id": "other"}):
                pass
            await bus.nc.flush()
            await asyncio.sleep(0.2)
            return await tracing.read_spans(bus.nc)
        finally:
            await bus.close()

    spans = asyncio.run(go())
    mine = tracing.spans_for_request(spans, "req-1")
    assert [s["name"] for s in mine] == ["router.request", "kv.push"]
    root, push = mine
    assert root["trace_id"] == push["trace_id"] and push["parent_id"] == root["span_id"]
    assert root["attributes"]["decision.strategy"] == "kvaware"  # type: ignore[index]
    assert '"worker":"d1"' in root["attributes"]["decision.candidates"]  # type: ignore[index]
    assert push["status"] == "error" and push["status_message"] == "decoder vanished"
    assert push["attributes"]["kv.bytes"] == 1024  # type: ignore[index]
    rows = tracing.slowest_requests(spans, 100_000)  # the shared server holds other tests' traces too
    assert {r["request_id"] for r in rows} >= {"req-1", "other"}

    buf = io.StringIO()
    render_waterfall(mine, Console(file=buf, width=200))
    render_slowest(rows[:5], Console(file=buf, width=200))
    out = buf.getvalue()
    assert "router.request" in out and "kv.push" in out and "ERROR: decoder vanished" in out
    assert "decision.strategy=kvaware" in out


def test_no_provider_is_a_noop() -> None:
    # Before setup_tracing (or with it off) spans are non-recording and inject adds nothing.
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        with tracing.tracer().start_as_current_span("x"):
            assert "traceparent" not in tracing.inject({})
