"""Every NATS handler fuzzed through its real subject (hypothesis): random bytes and mutated valid messages;
the HTTP front door fuzzed from its own OpenAPI schema (schemathesis).

Real processes: a router (with a tenants file, so a mutated request that happens to be valid stays small), a
mock decoder, a mock prefiller and the cache index. Per subject: no handler raises (``handler_failed`` never
logged), every process keeps running, a subject with a reply always answers (an error reply for what does not
decode), and afterwards a valid request through the router completes. HTTP: no 5xx, every call answered
within its timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve import proto
from splitserve.client import Client
from splitserve.natsserver import NatsServer, start_nats
from splitserve.proto import (
    CacheQuery,
    CancelRequest,
    DecodeJob,
    GenerateRequest,
    JobBounced,
    KvEventBatch,
    KvHandle,
    KvReserveRequest,
    PrefillDone,
    PrefillJob,
    QueueReportRequest,
    RevokeJob,
    Route,
    SamplingParams,
    Subjects,
)
from tests.procs import spawn_service, stop, wait_ready

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("SPLITSERVE_FUZZ_EXAMPLES", "120"))
TENANTS = "defaults: {max_tokens: 16, max_prompt_tokens: 256}\ntenants:\n  fuzz: {}\n  default: {}\n"
DEC, PRE = "decode-f", "prefill-f"


def _job() -> DecodeJob:
    return DecodeJob(request_id="fz-1", tenant="fuzz", prompt_token_ids=[1, 2, 3, 4],
                     sampling=SamplingParams(max_tokens=4), stream_subject="ss.stream.fuzz.fz-1",
                     route=Route.DIRECT, decoder_id=DEC, created_ms=proto.now_ms())


# subject -> (a valid message, whether the subject has a reply)
CASES: dict[str, tuple[proto.Message, bool]] = {
    Subjects.request("fuzz"): (GenerateRequest(request_id="fz-r", tenant="fuzz", prompt="hello",
                                               stream_subject="ss.stream.fuzz.fz-r",
                                               sampling=SamplingParams(max_tokens=4)), True),
    Subjects.cancel("fuzz"): (CancelRequest(request_id="fz-r", tenant="fuzz"), False),
    Subjects.prefill_job(PRE): (PrefillJob(decode=_job().model_copy(update={"route": Route.DISAGGREGATED,
                                                                             "prefill_worker": PRE})), False),
    Subjects.decode_job(DEC): (_job(), False),
    Subjects.kv_reserve(DEC): (KvReserveRequest(request_id="fz-1", prefill_worker=PRE, num_tokens=4,
                                                transport="tcp"), True),
    Subjects.kv_ready(DEC): (PrefillDone(request_id="fz-1", first_token=5, decode=_job(),
                                         kv=KvHandle(transfer_id="nope", num_tokens=4, kv_bytes=1, transport="tcp",
                                                     prefill_ms=1.0, transfer_ms=1.0)), False),
    Subjects.revoke(DEC): (RevokeJob(request_id="fz-1", tenant="fuzz", attempt=0), True),
    Subjects.CACHE_QUERY: (CacheQuery(block_hashes=[1, 2, 3]), True),
    Subjects.ADMIN_QUEUES: (QueueReportRequest(), True),
    Subjects.kv_events("fuzzworker"): (KvEventBatch(worker_id="fuzzworker", seq=1, events=[]), False),
    Subjects.bounced("fuzz", "fz-1"): (JobBounced(request_id="fz-1", tenant="fuzz", worker_id=PRE,
                                                  code=proto.ErrorCode.TIMEOUT, message="x"), False),
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10)


@st.composite
def mutated(draw: st.DrawFn, valid: dict[str, Any]) -> bytes:
    """A valid message's JSON with a few fields dropped, replaced by random JSON, or added."""
    doc = json.loads(json.dumps(valid))
    for _ in range(draw(st.integers(1, 3))):
        keys = sorted(doc)
        op = draw(st.sampled_from(["drop", "replace", "add"]))
        if op == "drop" and keys:
            doc.pop(draw(st.sampled_from(keys)))
        elif op == "replace" and keys:
            doc[draw(st.sampled_from(keys))] = draw(json_values)
        else:
            doc[draw(st.text(max_size=12))] = draw(json_values)
    return json.dumps(doc).encode()


def payloads(valid: proto.Message) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=512), mutated(json.loads(proto.encode(valid))),
                     st.just(proto.encode(valid)))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, asyncio.AbstractEventLoop, Any, Path,
                                                                       list[subprocess.Popen[bytes]]]]:
    tmp = Path(tmp_path_factory.mktemp("fuzz"))
    srv = start_nats(tmp / "nats", port=None)
    logs = tmp / "logs"
    (tmp / "tenants.yaml").write_text(TENANTS)
    env = dict(os.environ, SPLITSERVE_MOCK_STEP_MS="0")
    procs = [
        spawn_service("splitserve.services.router", "--tenants", str(tmp / "tenants.yaml"), "--disagg-threshold", "64",
                      nats_url=srv.url, worker_id="router-f", log_dir=logs),
        spawn_service("splitserve.services.decode", "--engine", "mock", "--transport", "tcp", nats_url=srv.url,
                      worker_id=DEC,
                      log_dir=logs, env=env),
        spawn_service("splitserve.services.prefill", "--engine", "mock", "--transport", "tcp", nats_url=srv.url,
                      worker_id=PRE, log_dir=logs, env=env),
        spawn_service("splitserve.services.cache_index", nats_url=srv.url, worker_id="cache-index-f", log_dir=logs),
        spawn_service("splitserve.services.frontend", "--port", "0", "--docs", nats_url=srv.url, worker_id="frontend-f",
                      log_dir=logs),  # --docs: the fuzzer reads /openapi.json (off by default)
    ]
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(wait_ready(srv.url, ["router-f", DEC, PRE, "cache-index-f", "frontend-f"],
                                           timeout=180))
        nc = loop.run_until_complete(nats.connect(srv.url))
        yield srv, loop, nc, logs, procs
        loop.run_until_complete(nc.close())
    finally:
        stop(*procs)
        loop.close()
        srv.stop()


SENT: dict[str, int] = {}


@pytest.mark.parametrize("subject", list(CASES))
def test_fuzz_subject(world: Any, subject: str) -> None:
    srv, loop, nc, logs, procs = world
    valid, has_reply = CASES[subject]
    no_reply: list[bytes] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(payloads(valid))
    def send(data: bytes) -> None:
        SENT[subject] = SENT.get(subject, 0) + 1
        if not has_reply:
            loop.run_until_complete(nc.publish(subject, data))
            return
        try:
            reply = loop.run_until_complete(nc.request(subject, data, timeout=10))
        except Exception:
            no_reply.append(data)
            return
        try:
            proto.decode(data, type(valid))
        except proto.ProtocolError:
            # what does not decode gets an error reply
            assert (reply.headers or {}).get(proto.HEADER_KIND) == "error", reply.data

    send()
    loop.run_until_complete(nc.flush())
    loop.run_until_complete(asyncio.sleep(0.5))
    assert no_reply == [], f"{len(no_reply)} requests on {subject} got no reply, e.g. {no_reply[:3]}"
    assert all(p.poll() is None for p in procs), [p.args for p in procs if p.poll() is not None]
    failed = [ln for f in logs.glob("*.log") for ln in f.read_text(errors="replace").splitlines()
              if '"handler_failed"' in ln or "Traceback" in ln]
    assert failed == [], failed[:5]

    async def still_serves() -> None:
        async with Client(srv.url, tenant="fuzz", idle_timeout=60) as c:
            res = await c.complete("a valid request after the fuzz", max_tokens=4)
            assert res.finish_reason in ("length", "stop") and res.token_ids

    loop.run_until_complete(still_serves())
    print(f"\nfuzz {subject}: {SENT.get(subject, 0)} messages")


def test_http_api_fuzzed_from_openapi(world: Any) -> None:
    # The schema comes from the running front door; each operation's cases are drawn by schemathesis'
    # hypothesis strategies (its pytest plugin is not used: it does not load under this pytest).
    import re

    import schemathesis

    logs = world[3]
    url = re.findall(r'"url": "(http://[^"]+)"', (logs / "frontend-f.log").read_text())[-1]
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    sent: dict[str, int] = {}
    server_errors: list[tuple[str, str, Any, int, str]] = []
    def fuzz(op: Any) -> None:
        @settings(max_examples=max(10, EXAMPLES // 3), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(op.as_strategy())
        def call(case: Any) -> None:
            resp = case.call(timeout=30)  # a hang is a failure: the call raises past its timeout
            sent[op.label] = sent.get(op.label, 0) + 1
            if resp.status_code >= 500:
                server_errors.append((case.method, case.path, case.body, resp.status_code, resp.text[:300]))

        call()

    for result in schema.get_all_operations():
        fuzz(result.ok())

    # The generation endpoints read their JSON body themselves (the schema does not describe it): fuzz it too,
    # with random bytes, random JSON and mutated valid bodies.
    import httpx

    valid_bodies = {"/v1/completions": {"prompt": "hi", "max_tokens": 3, "stream": False},
                    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                             "stream": True}}
    def fuzz_body(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(st.one_of(st.binary(max_size=256), json_values.map(lambda v: json.dumps(v).encode()), mutated(body)))
        def post(data: bytes) -> None:
            resp = http.post(path, content=data, headers={"Content-Type": "application/json"})
            sent[f"POST {path} (body)"] = sent.get(f"POST {path} (body)", 0) + 1
            if resp.status_code >= 500:
                server_errors.append(("POST", path, data, resp.status_code, resp.text[:300]))

        post()

    with httpx.Client(base_url=url, timeout=30) as http:
        for path, body in valid_bodies.items():
            fuzz_body(http, path, body)
    print(f"\nHTTP fuzz: {sum(sent.values())} calls over {len(sent)} operations: {sent}")
    assert sent and server_errors == [], server_errors[:5]
