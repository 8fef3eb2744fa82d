"""The front-door process logic against a real nats-server, with a scripted router and decoder in the test
(no model, no stack; fast): heartbeats and readiness, the real Client path over NATS, tenants from API keys,
router errors as HTTP statuses, and that a client disconnect releases the request's NATS subscription."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import pytest
from nats.aio.msg import Msg

from splitserve import proto
from splitserve.natsserver import NatsServer
from splitserve.proto import (
    Accepted,
    ErrorCode,
    GenerateRequest,
    Heartbeat,
    StreamDelta,
    StreamError,
    StreamFinal,
    Subjects,
)
from splitserve.runtime.bus import Bus
from splitserve.services.frontend.service import FrontendService

MODEL = "fake-model"


@dataclass
class FakeCluster:
    """A router that answers from the prompt's first word, and heartbeats for a router and a decoder."""

    bus: Bus
    requests: list[GenerateRequest] = field(default_factory=list)
    beating: bool = True
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_request(self, req: GenerateRequest, msg: Msg) -> None:
        self.requests.append(req)
        text = req.prompt or (req.messages[-1].content if req.messages else "")
        if text.startswith("toolong"):
            await self.bus.respond(msg, StreamError(request_id=req.request_id, code=ErrorCode.PROMPT_TOO_LONG,
                                                    message="prompt has 9,999 tokens; the model accepts 99"))
            return
        await self.bus.respond(msg, Accepted(request_id=req.request_id, router_id="router-f", prompt_tokens=4))
        words = ["The", " answer", " is", " 42"]
        for i, w in enumerate(words):
            await self.bus.publish(req.stream_subject, StreamDelta(request_id=req.request_id, seq=i, token_ids=[i],
                                                                   text=w))
            if text.startswith("hang") and i == 0:
                await self.release.wait()  # a long generation: nothing more until the test says so
        await self.bus.publish(req.stream_subject, StreamFinal(
            request_id=req.request_id, seq=len(words), token_ids=list(range(len(words))), text="".join(words),
            finish_reason="stop", usage=proto.Usage(prompt_tokens=4, completion_tokens=4, cached_tokens=2),
            route=proto.Route.DIRECT, prefill_worker=None, decode_worker="decode-f"))

    async def heartbeats(self) -> None:
        seq = 0
        while True:
            if self.beating:
                seq += 1
                for role, wid in (("router", "router-f"), ("decode", "decode-f")):
                    await self.bus.publish(Subjects.heartbeat(role, wid), Heartbeat(
                        worker_id=wid, role=role, seq=seq, interval_ms=200, pid=1, model=MODEL,  # type: ignore[arg-type]
                        max_model_len=100))
            await asyncio.sleep(0.2)


@pytest.fixture
async def cluster(nats_server: NatsServer) -> AsyncIterator[FakeCluster]:
    bus = await Bus.connect(nats_server.url, "fake-cluster")
    fc = FakeCluster(bus)
    await bus.subscribe(Subjects.REQUEST_ALL, GenerateRequest, fc.on_request, queue=Subjects.ROUTER_QUEUE,
                        concurrent=True)
    beat = asyncio.create_task(fc.heartbeats())
    yield fc
    fc.release.set()
    beat.cancel()
    await bus.close()


@contextlib.asynccontextmanager
async def frontend(url: str, worker_id: str = "frontend-t", **kw: object) -> AsyncIterator[FrontendService]:
    svc = FrontendService(worker_id, url, port=0, heartbeat_s=0.2, log_level="WARNING", **kw)  # type: ignore[arg-type]
    task = asyncio.create_task(svc.run())
    for _ in range(500):
        if svc._state == "ready" or task.done():
            break
        await asyncio.sleep(0.01)
    if task.done():
        task.result()
    try:
        yield svc
    finally:
        svc.request_stop()
        await asyncio.wait_for(task, 20)


async def until(cond: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_ready_only_with_router_and_decoder(nats_server: NatsServer) -> None:
    bus = await Bus.connect(nats_server.url, "probe")
    hbs: list[Heartbeat] = []

    async def on_hb(hb: Heartbeat, _: Msg) -> None:
        hbs.append(hb)

    await bus.subscribe("ss.hb.frontend.*", Heartbeat, on_hb)
    async with frontend(nats_server.url) as svc, httpx2.AsyncClient(base_url=svc.url) as http:
        assert (await http.get("/healthz")).status_code == 200
        r = await http.get("/readyz")
        assert r.status_code == 503 and r.json()["missing"] == ["router", "decode"]
        assert (await http.get("/v1/models")).json()["data"] == []
        fc = FakeCluster(bus)
        beat = asyncio.create_task(fc.heartbeats())
        try:
            await until(lambda: svc.readiness()[0])
            r = await http.get("/readyz")
            assert r.status_code == 200 and r.json()["routers"] == ["router-f"] and r.json()["model"] == MODEL
            assert (await http.get("/v1/models")).json()["data"][0]["id"] == MODEL
            fc.beating = False  # workers gone silent: not ready again within a few heartbeat intervals
            await until(lambda: not svc.readiness()[0])
        finally:
            beat.cancel()
    # The stack's supervisor waits for exactly this: a ready heartbeat with the process's pid.
    assert any(hb.role == "frontend" and hb.state == "ready" and hb.pid for hb in hbs)
    assert hbs[-1].state == "stopped"
    await bus.close()


async def test_chat_over_nats_with_tenant_and_request_id(cluster: FakeCluster, nats_server: NatsServer,
                                                         tmp_path: Path) -> None:
    keys = {"sk-1": "acme"}
    async with frontend(nats_server.url, api_keys=keys) as svc, httpx2.AsyncClient(base_url=svc.url) as http:
        await until(lambda: svc.readiness()[0])
        r = await http.post("/v1/chat/completions", headers={"Authorization": "Bearer sk-1", "X-Request-Id": "rq-7"},
                            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "seed": 3,
                                  "stop": ["x", "y"], "max_completion_tokens": 9, "temperature": 0.5})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == "The answer is 42"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
        assert body["splitserve"]["decode_worker"] == "decode-f" and r.headers["x-request-id"] == "rq-7"
        req = cluster.requests[-1]
        assert (req.request_id, req.tenant, req.stream_subject) == ("rq-7", "acme", "ss.stream.acme.rq-7")
        assert req.sampling.seed == 3 and req.sampling.stop == ["x", "y"] and req.sampling.max_tokens == 9
        assert req.messages is not None and req.messages[0].content == "Hi"
        # chat without max tokens: up to the context the decoders announced
        await http.post("/v1/chat/completions", headers={"Authorization": "Bearer sk-1"},
                        json={"messages": [{"role": "user", "content": "Hi"}]})
        assert cluster.requests[-1].sampling.max_tokens == 100
        r = await http.post("/v1/completions", headers={"Authorization": "Bearer sk-1"},
                            json={"prompt": "toolong please", "stream": True})
        assert r.status_code == 413 and r.json()["error"]["code"] == "context_length_exceeded"
        r = await http.post("/v1/completions", headers={"Authorization": "Bearer sk-1"},
                            json={"prompt": [5, 6, 7], "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert list(cluster.requests[-1].prompt_token_ids or []) == [5, 6, 7]


async def test_disconnect_mid_stream_releases_the_subscription(cluster: FakeCluster,
                                                               nats_server: NatsServer) -> None:
    async with frontend(nats_server.url) as svc, httpx2.AsyncClient(base_url=svc.url) as http:
        await until(lambda: svc.readiness()[0])
        assert (await http.post("/v1/completions", json={"prompt": "warm up"})).status_code == 200
        nc = svc.b.nc
        baseline = len(nc._subs)
        async with http.stream("POST", "/v1/completions", json={"prompt": "hang on", "stream": True,
                                                                 "max_tokens": 50},
                               headers={"X-Request-Id": "drop-1"}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    assert json.loads(line[6:])["choices"][0]["text"] == "The"
                    break
            assert len(nc._subs) == baseline + 1 and svc.active_requests() == ["drop-1"]
        # Leaving the block closed the connection mid-stream.
        await until(lambda: svc.cancel_requests == ["drop-1"])
        await until(lambda: len(nc._subs) == baseline and not svc.active_requests())
        cluster.release.set()
        # Still serving.
        r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and svc.cancel_requests == ["drop-1"]
        assert len(nc._subs) == baseline


async def test_a_stopped_service_stops_watching_the_garbage_collector(nats_server: NatsServer) -> None:
    """Services also run inside other processes (tests, benchmarks): each one that stopped left its gc
    callback behind, and every later collection logged one gc_pause line per service ever run."""
    import gc

    before = list(gc.callbacks)
    for _ in range(2):
        async with frontend(nats_server.url) as svc:
            assert svc._gc_watch in gc.callbacks
    assert gc.callbacks == before


async def test_no_router_is_503_at_once(fresh_nats: NatsServer) -> None:
    # A NATS no router ever served (no results stream): nothing to wait for. (Where routers ran, the front door's
    # client waits up to failover_s for one to come back: a restart is not an error.)
    async with frontend(fresh_nats.url) as svc, httpx2.AsyncClient(base_url=svc.url) as http:
        r = await http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "no router" in r.json()["error"]["message"]


async def test_connections_have_nagle_off(nats_server: NatsServer) -> None:
    # With Nagle on, each small SSE write after the first waits for the client's delayed ACK (~40 ms).
    import socket

    async with frontend(nats_server.url) as svc, httpx2.AsyncClient(base_url=svc.url) as http:
        assert (await http.get("/healthz")).status_code == 200  # the keep-alive connection stays open
        assert svc._server is not None
        conns = list(svc._server.server_state.connections)
        assert conns
        for conn in conns:
            sock = conn.transport.get_extra_info("socket")  # type: ignore[attr-defined]
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
