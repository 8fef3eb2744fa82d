"""OTLP export: with OTEL_EXPORTER_OTLP_ENDPOINT set, setup_tracing uses the official OTLP/HTTP exporter;
a tiny receiver decodes the real protobuf (ExportTraceServiceRequest) and finds the spans and attributes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

SCRIPT = """
from opentelemetry import trace
from splitserve.obs import tracing
p = tracing.setup_tracing("router", "r-otlp", None)
assert p is not None
with tracing.tracer().start_as_current_span("router.request", attributes={"request_id": "otlp-1"}) as sp:
    tracing.set_attrs(sp, "decision.", strategy="roundrobin", thresholds={"min_uncached_tokens": 32})
    with tracing.span_from(tracing.inject({}), "decode.admit", prompt_tokens=40):
        pass
p.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_otlp_http_export() -> None:
    got: list[ExportTraceServiceRequest] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802  (http.server's naming)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            got.append(req)
            out = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a: object) -> None:
            pass

    port = _free_port()
    srv = HTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
                   OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
        env.pop("SPLITSERVE_TRACING", None)
        subprocess.run([sys.executable, "-c", SCRIPT], env=env, check=True, timeout=60)
    finally:
        srv.shutdown()
    _check(got)


def test_otlp_grpc_export() -> None:
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    got: list[ExportTraceServiceRequest] = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: ExportTraceServiceRequest, context: object) -> ExportTraceServiceResponse:  # noqa: N802
            got.append(request)
            return ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
                   OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
        env.pop("SPLITSERVE_TRACING", None)
        subprocess.run([sys.executable, "-c", SCRIPT], env=env, check=True, timeout=60)
    finally:
        server.stop(0)
    _check(got)


def _check(got: list[ExportTraceServiceRequest]) -> None:
    spans = {}
    services = set()
    for req in got:
        for rs in req.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            services.add(attrs.get("service.name"))
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    spans[sp.name] = sp
    assert services == {"router"}
    assert set(spans) == {"router.request", "decode.admit"}
    root, child = spans["router.request"], spans["decode.admit"]
    assert child.trace_id == root.trace_id and child.parent_span_id == root.span_id
    rattrs = {a.key: a.value for a in root.attributes}
    assert rattrs["request_id"].string_value == "otlp-1"
    assert rattrs["decision.strategy"].string_value == "roundrobin"
    assert '"min_uncached_tokens":32' in rattrs["decision.thresholds"].string_value
    assert {a.key: a.value.int_value for a in child.attributes}["prompt_tokens"] == 40
