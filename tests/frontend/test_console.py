"""The web console's API over a real nats-server: the same streams the operator commands read (SS_TRACES,
SS_USAGE, the router's queue report), who may see what (admin key, tenant key, none), and its failure
answers. The pages themselves are driven in a real browser in ``test_console_browser.py``."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import nats
import pytest
from nats.js.api import StreamConfig

from splitserve import proto
from splitserve.natsserver import NatsServer
from splitserve.obs import tracing
from splitserve.obs.metrics import ClusterMetrics
from splitserve.proto import (
    Heartbeat,
    QueueReport,
    RequestFinished,
    SpanBatch,
    Subjects,
    TenantQueue,
    Usage,
    WorkerLoad,
)
from splitserve.services.frontend import console
from splitserve.services.frontend.app import AuthThrottle, create_app
from splitserve.services.frontend.console_data import ConsoleData
from splitserve.tenancy.config import TenantsConfig
from tests.frontend.fakes import FakeBackend

ADMIN = "admin-key-0123456789abcdef"
KEYS = {"sk-a": "A", "sk-b": "B"}
T0 = 1_700_000_000_000_000_000


def span(trace: str, sid: str, parent: str | None, name: str, service: str, start_ms: float, dur_ms: float,
         error: str | None = None, **attrs: Any) -> dict[str, Any]:
    return {"trace_id": trace, "span_id": sid, "parent_id": parent, "name": name, "service": service,
            "worker_id": f"{service}-0", "start_ns": T0 + int(start_ms * 1e6),
            "end_ns": T0 + int((start_ms + dur_ms) * 1e6), "status": "error" if error else "unset",
            "status_message": error, "attributes": attrs, "events": []}


DECISION = {"request_id": "ra", "strategy": "kvaware", "route": "disaggregated", "decoder": "decode-0",
            "prefiller": "prefill-0", "reason": "long_uncached", "candidates": [{"worker": "decode-0", "cost": 1.5}]}
SPANS_A = [
    span("ta" * 16, "a1", None, "client.generate", "client", 0, 900, request_id="ra"),
    span("ta" * 16, "a2", "a1", "router.request", "router", 1, 5, request_id="ra", tenant="A"),
    span("ta" * 16, "a3", "a2", "router.dispatch", "router", 6, 2, request_id="ra", tenant="A",
         decision_json=json.dumps(DECISION), **{"decision.route": "disaggregated"}),
    span("ta" * 16, "a4", "a3", "kv.push", "prefill", 10, 40, request_id="ra", tenant="A",
         **{"kv.bytes": 4_600_000, "kv.transport": "tcp", "kv.bandwidth_mbps": 115.0}),  # type: ignore[arg-type]
    span("ta" * 16, "a5", "a3", "decode.stream", "decode", 60, 800, request_id="ra", tenant="A"),
]
SPANS_B = [
    span("tb" * 16, "b1", None, "client.generate", "client", 0, 50, request_id="rb"),
    span("tb" * 16, "b2", "b1", "router.request", "router", 1, 3, error="tokens_per_minute exceeded",
         request_id="rb", tenant="B", **{"error.code": "quota_exceeded"}),
]


@pytest.fixture
async def nc(fresh_nats: NatsServer) -> AsyncIterator[Any]:
    c = await nats.connect(fresh_nats.url)
    js = c.jetstream()
    await tracing.ensure_trace_stream(c)
    await js.add_stream(StreamConfig(name=Subjects.USAGE_STREAM, subjects=[Subjects.FINISHED_ALL]))
    for spans in (SPANS_A, SPANS_B):
        await js.publish(Subjects.trace_spans("test"), proto.encode(SpanBatch(service="test", worker_id="t",
                                                                               spans=spans)))
    for tenant, rid, status in (("A", "ra", "ok"), ("B", "rb", "error")):
        ev = RequestFinished(request_id=rid, tenant=tenant, worker_id="decode-0", status=status,  # type: ignore[arg-type]
                             usage=Usage(prompt_tokens=100, completion_tokens=10) if status == "ok" else None,
                             error_code=None if status == "ok" else proto.ErrorCode.QUOTA_EXCEEDED,
                             model="smollm2" if status == "ok" else None, lora="sql" if status == "ok" else None)
        await js.publish(Subjects.finished(tenant, rid), proto.encode(ev))
    yield c
    await c.close()


async def fake_router(c: Any) -> None:
    async def on_report(msg: Any) -> None:
        rep = QueueReport(router_id="router-0", capacity=12, running=1, tenants=[
            TenantQueue(tenant="A", weight=2, queued=3, queued_by_class={"p0": 3}, running=1, inflight=4,
                        served_tokens=900, tokens_last_minute=400),
            TenantQueue(tenant="B", queued=0, refused_per_s=0.5, served_tokens=100)])
        await msg.respond(proto.encode(rep))

    await c.subscribe(Subjects.ADMIN_QUEUES, cb=on_report)


def metrics() -> ClusterMetrics:
    m = ClusterMetrics()
    for wid, role in (("decode-0", "decode"), ("prefill-0", "prefill"), ("router-0", "router"),
                      ("cache-index-0", "cache_index")):
        m.on_heartbeat(Heartbeat(worker_id=wid, role=role, seq=1, pid=1, engine="hf",  # type: ignore[arg-type]
                                 load=WorkerLoad(active_seqs=2, free_blocks=100, total_blocks=128,
                                                 prefill_tokens_per_s=900.0)))
    return m


def make(nc: Any, *, keys: dict[str, str] | None = KEYS, admins: list[str] | None = None) -> tuple[Any, ConsoleData]:
    # A generous failed-key budget: these tests send many wrong keys on purpose (throttling has its own test).
    app = create_app(FakeBackend(), api_keys=keys, auth_throttle=AuthThrottle(allowed=10_000))
    tenants = TenantsConfig.model_validate({"defaults": {"tokens_per_minute": 1000},
                                            "tenants": {"A": {"max_inflight": 8}, "B": {}}})
    data = ConsoleData(metrics(), lambda: nc, tenants=tenants)
    console.install(app, data, console.ConsoleAuth(keys, [ADMIN] if admins is None else admins))
    return app, data


@pytest.fixture
async def http(nc: Any) -> AsyncIterator[httpx2.AsyncClient]:
    app, data = make(nc)
    data.sample()
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as c:
        yield c


def as_(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_pages_are_served_from_the_package(http: httpx2.AsyncClient) -> None:
    r = await http.get("/console/")
    assert r.status_code == 200 and "/console/static/console.js" in r.text
    js = await http.get("/console/static/console.js")
    assert js.status_code == 200 and "/console/api" in js.text
    assert (await http.get("/console", follow_redirects=False)).status_code in (307, 308)


async def test_every_api_call_needs_a_key(http: httpx2.AsyncClient) -> None:
    for path in ("/whoami", "/cluster", "/tenants", "/usage", "/requests", "/trace/ra"):
        for headers in ({}, as_("wrong-key"), {"Authorization": "Basic sk-a"}):
            r = await http.get(f"/console/api{path}", headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert "admin key" in r.json()["error"]["message"]
    assert (await http.get("/console/api/whoami", headers=as_(ADMIN))).json() == {"admin": True, "tenant": None,
                                                                                   "auth": True}
    assert (await http.get("/console/api/whoami", headers=as_("sk-a"))).json()["tenant"] == "A"


async def test_admin_sees_the_whole_cluster(http: httpx2.AsyncClient, nc: Any) -> None:
    await fake_router(nc)
    c = (await http.get("/console/api/cluster", headers=as_(ADMIN))).json()
    assert {w["worker"] for w in c["workers"]} == {"decode-0", "prefill-0", "router-0", "cache-index-0"}
    d0 = next(w for w in c["workers"] if w["worker"] == "decode-0")
    assert (d0["state"], d0["active"], d0["total_blocks"], d0["engine"]) == ("ready", 2, 128, "hf")
    assert c["history"]["workers"]["decode-0"]["active"] == [2]

    t = (await http.get("/console/api/tenants", headers=as_(ADMIN))).json()
    assert t["router_id"] == "router-0" and t["error"] is None
    rows = {r["tenant"]: r for r in t["tenants"]}
    assert set(rows) == {"A", "B"}
    assert rows["A"]["queued"] == 3 and rows["A"]["limits"]["max_inflight"] == 8
    assert rows["A"]["limits"]["tokens_per_minute"] == 1000 and rows["B"]["refused_per_s"] == 0.5
    assert rows["A"]["limits"]["contract"] is None and rows["A"]["limits"]["priority"] == 0

    u = (await http.get("/console/api/usage?since=1h", headers=as_(ADMIN))).json()
    assert u["tenants"]["A"]["prompt_tokens"] == 100 and u["tenants"]["B"]["by_error"] == {"quota_exceeded": 1}
    # and per tenant, model and adapter (B's request was refused before it had a model)
    assert [(x["tenant"], x["model"], x["adapter"], x["prompt_tokens"]) for x in u["by_model"]] == [
        ("A", "smollm2", "sql", 100), ("B", None, None, 0)]

    r = (await http.get("/console/api/requests", headers=as_(ADMIN))).json()
    assert [x["request_id"] for x in r["slowest"]] == ["ra", "rb"]
    assert [x["request_id"] for x in r["failed"]] == ["rb"] and r["failed"][0]["tenants"] == ["B"]

    tr = (await http.get("/console/api/trace/ra", headers=as_(ADMIN))).json()
    assert [row["name"] for row in tr["rows"]] == ["client.generate", "router.request", "router.dispatch",
                                                   "kv.push", "decode.stream"]
    assert tr["rows"][2]["depth"] == 2 and tr["rows"][4]["start_ms"] == pytest.approx(60)
    assert tr["decision"] == DECISION and tr["duration_ms"] == pytest.approx(900)
    assert tr["kv"] == [{"worker_id": "prefill-0", "kv.bytes": 4_600_000, "kv.transport": "tcp",
                         "kv.bandwidth_mbps": 115.0}]
    tb = (await http.get(f"/console/api/trace/{'tb' * 16}", headers=as_(ADMIN))).json()  # by trace id too
    assert tb["errors"] == [{"service": "router", "worker_id": "router-0", "name": "router.request",
                             "message": "tokens_per_minute exceeded", "code": "quota_exceeded"}]


async def test_a_tenant_key_sees_only_its_own_tenant(http: httpx2.AsyncClient, nc: Any) -> None:
    await fake_router(nc)
    a = as_("sk-a")
    for path in ("/cluster",):
        r = await http.get(f"/console/api{path}", headers=a)
        assert r.status_code == 403 and "admin key" in r.json()["error"]["message"]
    r = await http.post("/console/api/explain", headers=a, json={"prompt": "hi"})
    assert r.status_code == 403
    t = (await http.get("/console/api/tenants", headers=a)).json()
    assert [row["tenant"] for row in t["tenants"]] == ["A"] and "capacity" not in t
    u = (await http.get("/console/api/usage?since=all", headers=a)).json()
    assert set(u["tenants"]) == {"A"} and {x["tenant"] for x in u["by_model"]} == {"A"}
    r = (await http.get("/console/api/requests", headers=a)).json()
    assert [x["request_id"] for x in r["slowest"]] == ["ra"] and r["failed"] == []
    assert (await http.get("/console/api/trace/ra", headers=a)).status_code == 200
    for ref in ("rb", "tb" * 16):  # B's trace, by request id or trace id: as if it did not exist
        r = await http.get(f"/console/api/trace/{ref}", headers=a)
        assert r.status_code == 404 and "no trace" in r.json()["error"]["message"]
    b = (await http.get("/console/api/requests", headers=as_("sk-b"))).json()
    assert [x["request_id"] for x in b["failed"]] == ["rb"] and b["slowest"][0]["request_id"] == "rb"


async def test_clear_answers_when_something_is_missing(http: httpx2.AsyncClient) -> None:
    adm = as_(ADMIN)
    r = await http.post("/console/api/explain", headers=adm, json={"prompt": "hello"})
    assert r.status_code == 503 and "no router answered" in r.json()["error"]["message"]
    t = (await http.get("/console/api/tenants", headers=adm)).json()  # the page still draws, with the reason
    assert "no router answered" in t["error"] and {r["tenant"] for r in t["tenants"]} == {"A", "B"}
    assert (await http.get("/console/api/usage?since=3w", headers=adm)).status_code == 400
    assert (await http.get("/console/api/trace/no.such", headers=adm)).status_code == 400
    assert (await http.get("/console/api/trace/nope", headers=adm)).status_code == 404
    r = await http.post("/console/api/explain", headers=adm, json={"prompt": "x", "tenant": "a.b"})
    assert r.status_code == 400 and "tenant" in r.json()["error"]["message"]
    assert (await http.post("/console/api/explain", headers=adm, json={"prompt": ""})).status_code == 400
    # Bodies the router's RouteExplainRequest would refuse are refused here, not a 500 (the OpenAPI fuzz found them)
    for body in (b'{"prompt": "x\\ud800"}', b'{"prompt": "x", "strategies": ["\\udfff"]}',
                 json.dumps({"prompt": "x", "strategies": ["kvaware"] * 17}).encode()):
        r = await http.post("/console/api/explain", headers={**adm, "Content-Type": "application/json"},
                            content=body)
        assert r.status_code == 400, (body, r.status_code, r.text)


async def test_a_cluster_without_streams_yet_says_so(fresh_nats: NatsServer) -> None:
    bare = await nats.connect(fresh_nats.url)  # no router ever started: no SS_USAGE, no SS_TRACES
    try:
        app, _ = make(bare)
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.get("/console/api/usage", headers=as_(ADMIN))
            assert r.status_code == 503 and "NATS answered" in r.json()["error"]["message"]
            r = await c.get("/console/api/requests", headers=as_(ADMIN))
            assert r.status_code == 200 and r.json()["slowest"] == []
    finally:
        await bare.close()


async def test_an_open_front_door_has_an_open_console(nc: Any) -> None:
    app, _ = make(nc, keys=None, admins=[])
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/console/api/whoami")).json() == {"admin": True, "tenant": None, "auth": False}
        assert (await c.get("/console/api/cluster")).status_code == 200
    # admin keys alone (no tenant keys) close it
    app, _ = make(nc, keys=None)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/console/api/whoami")).status_code == 401
        assert (await c.get("/console/api/whoami", headers=as_(ADMIN))).json()["admin"] is True


def test_admin_keys_and_tenant_keys_must_differ(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="also a tenant's API key"):
        console.ConsoleAuth({"k" * 20: "A"}, ["k" * 20])
    f = tmp_path / "admins.txt"
    f.write_text("# operators\n" + "x" * 20 + "\n")
    assert console.load_admin_keys(f) == ["x" * 20]
    f.write_text("short\n")
    with pytest.raises(ValueError, match="at least 16"):
        console.load_admin_keys(f)


def test_history_stays_aligned_as_workers_come_and_go() -> None:
    m = ClusterMetrics(stale_s=5.0)
    data = ConsoleData(m, lambda: None)
    m.on_heartbeat(Heartbeat(worker_id="d0", role="decode", seq=1, load=WorkerLoad(active_seqs=1)))
    data.sample(1.0)
    m.on_heartbeat(Heartbeat(worker_id="d1", role="decode", seq=1, load=WorkerLoad(active_seqs=3)))
    data.sample(2.0)
    m.workers["d0"] = (m.workers["d0"][0], time.monotonic() - 60)  # d0 went silent: its gap is a gap
    data.sample(3.0)
    h = data.cluster()["history"]
    assert h["t"] == [1.0, 2.0, 3.0]
    assert h["workers"]["d1"]["active"] == [None, 3, 3] and h["workers"]["d0"]["active"] == [1, 1, None]


async def test_the_route_explorer_asks_about_the_model_it_names(http: httpx2.AsyncClient, nc: Any) -> None:
    from splitserve.proto.admin import RouteExplainReply, RouteExplainRequest

    asked: list[RouteExplainRequest] = []

    async def on_explain(msg: Any) -> None:
        asked.append(proto.decode(msg.data, RouteExplainRequest))
        await msg.respond(proto.encode(RouteExplainReply(router_id="router-0", prompt_tokens=1, block_size=16,
                                                         live_strategy="kvaware", policy={}, workers=[],
                                                         results=[])))

    await nc.subscribe(Subjects.ADMIN_ROUTE_EXPLAIN, cb=on_explain)
    adm = as_(ADMIN)
    for body, want in (({"prompt": "hi", "model": "smollm2/26l"}, "smollm2/26l"), ({"prompt": "hi"}, None)):
        r = await http.post("/console/api/explain", headers=adm, json=body)
        assert r.status_code == 200, r.text
        assert asked[-1].model == want
