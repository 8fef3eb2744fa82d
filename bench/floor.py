"""The design's floor: what its mechanism alone costs, with nothing of splitserve in it.

splitserve's request path is Python processes talking over NATS: an HTTP front door, a router, decoders streaming
tokens back. This module runs that shape stripped to the bone, on the same libraries (uvicorn with httptools and
uvloop, nats-py on uvloop, a real nats-server) and with no contract, no durable queue, no tracing, no logging, no
policy but round robin, so that ``bench.peers`` can put it in the same table as splitserve and the Rust routers:

* ``floor-1hop``: front door -> a decoder (a NATS queue group) -> its tokens straight back to the front door;
* ``floor-2hop``: front door -> a router -> a decoder -> tokens back to the front door (splitserve's hops).

A decoder sends one NATS message per token and yields to its event loop between tokens, as an engine's step
loop does (tokens of concurrent requests share a socket write, as they do in splitserve's decoders). The front
door has one wildcard subscription for every stream and hands each message to its request by the subject's
last token: the cheapest correct way to take a stream back. What splitserve does beyond this (the durable queue,
the request book, migration, tracing, fair share) is its own cost; this is the part no Python implementation of
this design can go below on the same machine.

    python -m bench.floor front --nats-url URL --port PORT --hops 1|2
    python -m bench.floor router --nats-url URL --workers N
    python -m bench.floor worker --nats-url URL --index I [--hops 1|2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from typing import Any

from bench.peers import Receive, Send, lifespan, read_body

MODEL = "floor"
IN = "floor.in"  # what the front door publishes: the router's queue group (2 hops) or the decoders' (1 hop)
ROUTER_QUEUE, WORKER_QUEUE = "floor-routers", "floor-workers"


def work_subject(index: int) -> str:
    return f"floor.work.{index}"


def stream_prefix(front: str) -> str:
    return f"floor.stream.{front}"


async def _connect(url: str, name: str) -> Any:
    import nats

    return await nats.connect(url, name=name, max_reconnect_attempts=0, pending_size=64 * 1024 * 1024)


async def _ready(nc: Any) -> None:
    await nc.flush()
    print("ready", flush=True)  # the harness waits for this line: subscribed and flushed


async def run_worker(url: str, index: int, hops: int) -> None:
    nc = await _connect(url, f"floor-worker-{index}")

    async def on_request(msg: Any) -> None:
        req = json.loads(msg.data)
        n, reply = int(req["max_tokens"]), req["reply"]
        for i in range(n):
            await nc.publish(reply, json.dumps({"text": "x ", "done": i == n - 1}).encode())
            await asyncio.sleep(0)  # one token a step, as an engine's loop: other requests' tokens interleave

    running: set[asyncio.Task[None]] = set()

    async def cb(msg: Any) -> None:  # each request its own task: nats-py runs one callback at a time
        task = asyncio.ensure_future(on_request(msg))
        running.add(task)
        task.add_done_callback(running.discard)

    if hops == 1:
        await nc.subscribe(IN, queue=WORKER_QUEUE, cb=cb)
    else:
        await nc.subscribe(work_subject(index), cb=cb)
    await _ready(nc)
    await asyncio.Event().wait()


async def run_router(url: str, workers: int) -> None:
    nc = await _connect(url, "floor-router")
    rr = itertools.cycle(range(workers))

    async def cb(msg: Any) -> None:
        req = json.loads(msg.data)  # a router reads what it routes
        await nc.publish(work_subject(next(rr)), json.dumps(req).encode())

    await nc.subscribe(IN, queue=ROUTER_QUEUE, cb=cb)
    await _ready(nc)
    await asyncio.Event().wait()


class Front:
    """A raw ASGI OpenAI-ish front door (``/v1/models``, streaming ``/v1/completions``) over NATS."""

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.name = name
        self.nc: Any = None
        self.streams: dict[str, asyncio.Queue[bytes]] = {}
        self.ids = itertools.count()

    async def start(self) -> None:
        self.nc = await _connect(self.url, f"floor-front-{self.name}")

        async def on_token(msg: Any) -> None:
            q = self.streams.get(msg.subject.rpartition(".")[2])
            if q is not None:
                q.put_nowait(msg.data)

        await self.nc.subscribe(stream_prefix(self.name) + ".*", cb=on_token)
        await self.nc.flush()

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, self.start)
            return
        body = await read_body(receive)
        if scope["method"] == "GET":
            data = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": data})
            return
        req = json.loads(body)
        rid = str(next(self.ids))
        q: asyncio.Queue[bytes] = asyncio.Queue()
        self.streams[rid] = q
        try:
            await self.nc.publish(IN, json.dumps({"prompt": req["prompt"], "max_tokens": req.get("max_tokens", 16),
                                                  "reply": f"{stream_prefix(self.name)}.{rid}"}).encode())
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
            cid = f"cmpl-{self.name}-{rid}"
            while True:
                tok = json.loads(await q.get())
                chunk = {"id": cid, "object": "text_completion", "model": MODEL,
                         "choices": [{"index": 0, "text": tok["text"],
                                      "finish_reason": "length" if tok["done"] else None}]}
                out = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
                if tok["done"]:
                    await send({"type": "http.response.body", "body": out + b"data: [DONE]\n\n"})
                    return
                await send({"type": "http.response.body", "body": out, "more_body": True})
        finally:
            del self.streams[rid]


def run_front(url: str, port: int) -> None:
    import uvicorn

    uvicorn.run(Front(url, f"f{port}"), host="127.0.0.1", port=port, log_level="warning", access_log=False,
                loop="uvloop", http="httptools", lifespan="on")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", choices=("front", "router", "worker"))
    ap.add_argument("--nats-url", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--hops", type=int, choices=(1, 2), default=2)
    a = ap.parse_args(argv)
    if a.role == "front":
        run_front(a.nats_url, a.port)
        return
    import uvloop

    uvloop.run(run_worker(a.nats_url, a.index, a.hops) if a.role == "worker" else run_router(a.nats_url, a.workers))


if __name__ == "__main__":
    main()
