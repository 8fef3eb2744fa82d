"""What headers ``Bus.publish`` puts on a request's stream messages (a real nats-server): a delta, one per token,
goes without (its body names its kind and version; building and parsing headers cost ~9 us a message in all),
and decodes as before; the final and an error keep their kind and version, and the trace context of the span
they are sent in."""

from __future__ import annotations

import nats
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from splitserve import proto
from splitserve.natsserver import NatsServer
from splitserve.proto import ErrorCode, StreamDelta, StreamError, StreamFinal, Subjects
from splitserve.runtime.bus import Bus


async def test_a_delta_goes_without_headers_and_the_end_with_them(nats_server: NatsServer) -> None:
    subject = Subjects.stream("acme", "hdr-1")
    watcher = await nats.connect(nats_server.url)
    bus = await Bus.connect(nats_server.url, "decode:hdr")
    try:
        sub = await watcher.subscribe(subject)
        await watcher.flush()
        delta = StreamDelta(request_id="hdr-1", seq=0, token_ids=[7, 8], text="hi")
        await bus.publish(subject, delta)
        # a final inside a span (as a router's migration sends one): its trace context rides along
        provider = trace.get_tracer_provider()
        tracer = provider.get_tracer("test") if isinstance(provider, TracerProvider) else \
            TracerProvider().get_tracer("test")
        with tracer.start_as_current_span("t"):
            await bus.publish(subject, StreamFinal(
                request_id="hdr-1", seq=1, token_ids=[7, 8], text="hi", finish_reason="length",
                usage=proto.Usage(prompt_tokens=1, completion_tokens=2), route=proto.Route.DIRECT,
                prefill_worker=None, decode_worker="decode-h"))
        await bus.publish(subject, StreamError(request_id="hdr-1", code=ErrorCode.INTERNAL, message="x"))
        first, final, err = [await sub.next_msg(timeout=5) for _ in range(3)]
        assert not first.headers
        assert proto.decode_stream(first.data) == delta
        for msg, kind in ((final, "final"), (err, "error")):
            assert msg.headers is not None
            assert msg.headers[proto.HEADER_KIND] == kind and msg.headers[proto.HEADER_VERSION]
        assert "traceparent" in final.headers  # type: ignore[operator]
    finally:
        await bus.close()
        await watcher.close()
