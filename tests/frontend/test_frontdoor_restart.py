"""A front door restarted under steady HTTP traffic: no client sees it.

``splitserve up`` runs several front door processes (``--frontends``, default 2) that accept from one listening
socket the supervisor holds for the stack's whole life: while one is drained, killed or restarting, the others
(or, with a single one, the socket's accept queue until it is back) take every new connection. A SIGTERMed one
stops accepting and finishes what it has (streams included); only what was open on a SIGKILLed one may be cut.
And a front door that has just started answers for the served model from its first request (no 404 because it
has not seen a decoder's heartbeat yet).

The slow test drives a real ``splitserve up`` (mock engine) with fresh HTTP connections (one client per request)
while frontend-0 is SIGTERMed and restarted, then the last front door SIGKILLed and restarted.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx2
import nats
import pytest
from nats.aio.msg import Msg

from splitserve import proto
from splitserve.natsserver import NatsServer
from splitserve.proto import Accepted, GenerateRequest, Heartbeat, StreamDelta, StreamFinal, Subjects
from splitserve.runtime.bus import Bus
from splitserve.stackproc import start_stack
from tests.frontend.test_service import frontend

# ------------------------------------------------------------------------------------ a just-started front door

SERVED = "mock-tiny"  # what the decoders announce (the mock engine prefixes the model's name with "mock-")
TOKENIZER = "tiny"  # what the router announces: its tokenizer's name, not the served model's


class ScriptedCluster:
    """A router that answers every request with two tokens, and heartbeats for it and (when told) a decoder."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.decoder = False  # beating as a decoder too

    async def on_request(self, req: GenerateRequest, msg: Msg) -> None:
        await self.bus.respond(msg, Accepted(request_id=req.request_id, router_id="router-s", prompt_tokens=2))
        await self.bus.publish(req.stream_subject, StreamDelta(request_id=req.request_id, seq=0, token_ids=[0],
                                                               text="ok"))
        await self.bus.publish(req.stream_subject, StreamFinal(
            request_id=req.request_id, seq=1, token_ids=[0], text="ok", finish_reason="stop",
            usage=proto.Usage(prompt_tokens=2, completion_tokens=1), route=proto.Route.DIRECT,
            prefill_worker=None, decode_worker="decode-s"))

    async def heartbeats(self) -> None:
        seq = 0
        while True:
            seq += 1
            beats = [("router", "router-s", TOKENIZER)] + ([("decode", "decode-s", SERVED)] if self.decoder else [])
            for role, wid, model in beats:
                await self.bus.publish(Subjects.heartbeat(role, wid), Heartbeat(
                    worker_id=wid, role=role, seq=seq, interval_ms=500, pid=1, model=model,  # type: ignore[arg-type]
                    max_model_len=100))
            await asyncio.sleep(0.5)


async def test_a_just_started_front_door_never_answers_404_for_the_served_model(nats_server: NatsServer) -> None:
    bus = await Bus.connect(nats_server.url, "scripted-cluster")
    cluster = ScriptedCluster(bus)
    await bus.subscribe(Subjects.REQUEST_ALL, GenerateRequest, cluster.on_request, queue=Subjects.ROUTER_QUEUE,
                        concurrent=True)
    beat = asyncio.create_task(cluster.heartbeats())
    body = {"model": SERVED, "prompt": "hi", "max_tokens": 1}
    try:
        # The router's heartbeat has been seen, no decoder's yet: the front door does not know what is served,
        # so a request naming the served model is not refused (it goes to the router, which has its own policy
        # for a cluster with no decoder), and asking for the model's card is a retryable 503, never a 404.
        async with frontend(nats_server.url) as svc, httpx2.AsyncClient(base_url=svc.url, timeout=10) as http:
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            card = await http.get(f"/v1/models/{SERVED}")
            assert card.status_code == 503 and int(card.headers["retry-after"]) >= 1, card.text
            assert card.json()["error"]["code"] == "model_not_announced", card.text
        # Decoders beating (every 0.5 s, as they do): a front door that has just started waits for the registry
        # to fill before it takes requests, so its very first answers name the served model ...
        cluster.decoder = True
        async with frontend(nats_server.url) as svc, httpx2.AsyncClient(base_url=svc.url, timeout=10) as http:
            listed = await http.get("/v1/models")
            assert [m["id"] for m in listed.json()["data"]] == [SERVED], listed.text
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            assert (await http.get(f"/v1/models/{SERVED}")).status_code == 200
            # ... and a model nobody serves is still a 404, at once.
            other = await http.post("/v1/completions", json={**body, "model": "gpt-4o"})
            assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found", other.text
    finally:
        beat.cancel()
        await bus.nc.close()  # not Bus.close: it would wait out its bound for the streams' stored ends


# ------------------------------------------------------------------------------------ a drain

async def test_a_draining_front_door_answers_a_connection_it_accepted_before_the_request_came(
        nats_server: NatsServer) -> None:
    """Accepted just before the drain began, its request not read yet: answered (then closed), not closed under
    the client (uvicorn's own shutdown closes every connection with no request in progress). One that never
    sends a byte is closed without holding the drain to its bound."""
    async with frontend(nats_server.url) as svc:
        server = svc._server
        assert server is not None
        early_r, early_w = await asyncio.open_connection("127.0.0.1", svc.port)
        mute_r, mute_w = await asyncio.open_connection("127.0.0.1", svc.port)
        await _until(lambda: len(server.server_state.connections) >= 2, 10, "connections accepted")
        svc.request_stop()  # SIGTERM
        await _until(lambda: server.should_exit, 10, "the drain began")
        await asyncio.sleep(0.3)  # uvicorn's shutdown has run: it stopped accepting and shut connections down
        early_w.write(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        answer = await asyncio.wait_for(early_r.read(), 10)  # to EOF: the server closes after answering
        assert answer.startswith(b"HTTP/1.1 200 ") and b"connection: close" in answer.lower(), answer
        assert await asyncio.wait_for(mute_r.read(), 10) == b""  # closed, never answered
        early_w.close()
        mute_w.close()


# ------------------------------------------------------------------------------------ restarts under load

STEP_MS = "20"  # the mock engine's decode step: a 100-token stream lasts about 2 s


@dataclass
class Outcome:
    rid: str
    stream: bool
    t0: float
    t1: float = 0.0
    status: int | None = None
    done: bool = False  # the whole answer arrived (a stream: a finish_reason, then [DONE])
    refused: bool = False  # the connection itself failed
    error: str | None = None


class FreshClients:
    """Threads that each send requests one after another, every one on a NEW connection (its own client)."""

    def __init__(self, base: str, model: str) -> None:
        self.base = base
        self.model = model
        self.outcomes: list[Outcome] = []
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self._n = 0
        self._lock = threading.Lock()

    def start(self, short: int, long: int) -> None:
        for i in range(short):
            self.threads.append(threading.Thread(target=self._loop, args=(f"s{i}", 12), daemon=True))
        for i in range(long):
            self.threads.append(threading.Thread(target=self._loop, args=(f"l{i}", 100), daemon=True))
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(120)

    def _loop(self, name: str, max_tokens: int) -> None:
        k = 0
        while not self.stopping.is_set():
            k += 1
            stream = max_tokens > 50 or k % 2 == 0
            o = self.one(f"fd-{name}-{k}", stream, max_tokens)
            with self._lock:
                self.outcomes.append(o)

    def one(self, rid: str, stream: bool, max_tokens: int) -> Outcome:
        o = Outcome(rid, stream, time.monotonic())
        body = {"model": self.model, "prompt": f"request {rid}", "max_tokens": max_tokens, "temperature": 0,
                "stream": stream}
        try:
            with httpx2.Client(base_url=self.base, timeout=60) as http:  # a new connection for every request
                if stream:
                    with http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
                        o.status = r.status_code
                        finish = None
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                choices = json.loads(line[6:]).get("choices") or [{}]
                                finish = finish or choices[0].get("finish_reason")
                            elif line == "data: [DONE]":
                                o.done = finish is not None
                        if not o.done:
                            o.error = f"status {r.status_code}, stream ended without its end"
                else:
                    r = http.post("/v1/completions", json=body, headers={"X-Request-Id": rid})
                    o.status = r.status_code
                    o.done = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] is not None
                    if not o.done:
                        o.error = f"status {r.status_code}: {r.text[:200]}"
        except httpx2.ConnectError as exc:
            o.refused, o.error = True, f"ConnectError: {exc}"
        except httpx2.HTTPError as exc:
            o.error = f"{type(exc).__name__}: {exc}"
        o.t1 = time.monotonic()
        return o


async def _until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not in time: {what}"
        await asyncio.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("frontends", [2, 1], ids=["two-front-doors", "one-front-door"])
async def test_front_door_restarts_are_invisible_to_fresh_clients(tmp_path: Path, frontends: int) -> None:
    """Two front doors: the other one accepts while one is down. One: connections wait in the accept queue of
    the socket the supervisor holds until it is back (slower answers, none refused)."""
    env = dict(os.environ, SPLITSERVE_MOCK_STEP_MS=STEP_MS)
    sp = await asyncio.to_thread(start_stack, tmp_path / "state", "--engine", "mock", "--prefill", "0", "--decode",
                                 "1", "--frontends", str(frontends), env=env)
    beats: dict[str, tuple[float, Heartbeat]] = {}  # front door -> (when received, its last heartbeat)

    async def on_hb(msg: Msg) -> None:
        hb = proto.decode(msg.data, Heartbeat)
        beats[hb.worker_id] = (time.monotonic(), hb)

    nc = await nats.connect(sp.nats_url)
    await nc.subscribe("ss.hb.frontend.*", cb=on_hb)
    assert sp.http_url
    load = FreshClients(sp.http_url, httpx2.get(f"{sp.http_url}/v1/models").json()["data"][0]["id"])
    marks: dict[str, float] = {}
    open_at: dict[str, set[str]] = {}

    async def signal_when_busy(wid: str, sig: signal.Signals) -> int:
        """Send ``sig`` to front door ``wid`` just after a heartbeat of it lists open streams; returns its pid."""
        since = time.monotonic()
        await _until(lambda: wid in beats and beats[wid][0] > since and beats[wid][1].state == "ready"
                     and any(r.startswith("fd-l") for r in beats[wid][1].active_requests), 60, f"{wid} busy")
        hb = beats[wid][1]
        assert hb.pid
        os.kill(hb.pid, sig)
        marks[sig.name] = time.monotonic()
        open_at[sig.name] = set(hb.active_requests)
        return hb.pid

    async def back(wid: str, old_pid: int) -> None:
        await _until(lambda: beats[wid][1].pid != old_pid and beats[wid][1].state == "ready", 120, f"{wid} back")

    try:
        load.start(short=3, long=2)
        await _until(lambda: len(load.outcomes) >= 10, 60, "first requests")
        names = sorted(w for w in beats if w.startswith("frontend-"))
        assert len(names) == frontends, names
        pid = await signal_when_busy("frontend-0", signal.SIGTERM)
        await back("frontend-0", pid)
        marks["term_back"] = time.monotonic()
        pid = await signal_when_busy(names[-1], signal.SIGKILL)
        await back(names[-1], pid)
        marks["kill_back"] = time.monotonic()
        n = len(load.outcomes)
        await _until(lambda: len(load.outcomes) >= n + 10, 60, "requests after the restarts")
    finally:
        load.stop()
        await nc.close()
        rc = await asyncio.to_thread(sp.stop)
    outcomes = load.outcomes
    refused = [o for o in outcomes if o.refused]
    # Only what was open on the SIGKILLed front door may be cut: started before the kill, and not a refusal.
    cut = [o for o in outcomes if not o.done and not o.refused and o.t0 <= marks["SIGKILL"] <= o.t1]
    failed = [o for o in outcomes if not o.done and o not in cut]
    by_rid = {o.rid: o for o in outcomes}
    drained = [by_rid[r] for r in open_at["SIGTERM"] if r in by_rid]
    during_term = [o for o in outcomes if marks["SIGTERM"] <= o.t0 <= marks["term_back"]]
    during_kill = [o for o in outcomes if marks["SIGKILL"] <= o.t0 <= marks["kill_back"]]
    print(f"\nfront doors {names}: {len(outcomes)} requests on fresh connections; refused {len(refused)}, "
          f"failed {len(failed)}, cut on the SIGKILLed front door {len(cut)}; streams open at SIGTERM "
          f"{len(drained)}, completed {sum(o.done for o in drained)}; started while restarting: "
          f"{len(during_term)} (SIGTERM), {len(during_kill)} (SIGKILL)")
    assert refused == [], [o.error for o in refused][:5]
    assert failed == [], [(o.rid, o.error) for o in failed][:5]
    assert drained and all(o.done for o in drained), [(o.rid, o.error) for o in drained]
    assert during_term and during_kill  # the load kept arriving while each front door was down
    assert rc == 0, sp.output[-30:]
