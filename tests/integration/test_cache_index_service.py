"""The cache-index service as a real process on a real nats-server, fed synthetic worker KV events:
answers prefix queries, survives a SIGKILL (snapshot + JetStream replay, including events published while
it was down), resyncs a worker whose event stream has a gap, and drops a worker that stops heartbeating."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import nats

from splitserve import proto
from splitserve.natsserver import NatsServer
from splitserve.proto import BlockStored, CacheQuery, CacheQueryReply, Heartbeat, KvEventBatch, KvHeld, Subjects
from tests.procs import spawn_service, stop, wait_ready

CHAIN = list(range(1000, 1010))  # block hashes of one prompt, in chain order


async def _publish(nc: nats.NATS, worker: str, seq: int, hashes: list[int]) -> None:
    batch = KvEventBatch(worker_id=worker, seq=seq, events=[BlockStored(block_hashes=hashes, block_size=16)])
    await nc.publish(Subjects.kv_events(worker), proto.encode(batch))
    await nc.flush()


async def _query(nc: nats.NATS, hashes: list[int]) -> dict[str, int]:
    resp = await nc.request(Subjects.CACHE_QUERY, proto.encode(CacheQuery(block_hashes=hashes)), timeout=5)
    return proto.decode(resp.data, CacheQueryReply).matched_blocks


async def _eventually(fn, want, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        got = await fn()
        if want(got):
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"condition not met; last value {got!r}")


def _start(url: str, log_dir: Path):  # type: ignore[no-untyped-def]
    p = spawn_service("splitserve.services.cache_index", "--snapshot-interval-s", "0.5", nats_url=url,
                      worker_id="cache-index-t", log_dir=log_dir)
    asyncio.run(wait_ready(url, ["cache-index-t"], timeout=60))
    return p


def test_restart_gap_and_dead_worker(fresh_nats: NatsServer, tmp_path: Path) -> None:
    url = fresh_nats.url
    p = _start(url, tmp_path)
    try:
        async def phase1() -> None:
            nc = await nats.connect(url)
            await _publish(nc, "w1", 0, CHAIN[:4])
            await _publish(nc, "w1", 1, CHAIN[4:6])
            got = await _eventually(lambda: _query(nc, CHAIN), lambda m: m.get("w1") == 6)
            assert got == {"w1": 6}
            await asyncio.sleep(1.5)  # at least one snapshot taken
            await nc.close()
        asyncio.run(phase1())

        os.kill(p.pid, signal.SIGKILL)  # no graceful snapshot
        p.wait()

        async def while_down() -> None:
            nc = await nats.connect(url)
            await _publish(nc, "w1", 2, CHAIN[6:8])  # captured by the JetStream stream meanwhile
            await nc.close()
        asyncio.run(while_down())

        p = _start(url, tmp_path)

        async def phase2() -> None:
            nc = await nats.connect(url)
            await _eventually(lambda: _query(nc, CHAIN), lambda m: m.get("w1") == 8)

            # A gap (seq 3 never arrives): the service asks the worker for its full state.
            async def held(msg: object) -> None:
                reply = KvHeld(worker_id="w1", seq=4, held={"gpu": CHAIN})
                await nc.publish(msg.reply, proto.encode(reply))  # type: ignore[attr-defined]
            await nc.subscribe(Subjects.kv_held("w1"), cb=held)
            await _publish(nc, "w1", 4, [])
            await _eventually(lambda: _query(nc, CHAIN), lambda m: m.get("w1") == 10)

            # A worker that heartbeats, reports blocks, then goes silent is dropped from the index.
            for i in range(3):
                hb = Heartbeat(worker_id="w2", role="decode", seq=i + 1, interval_ms=200, pid=4242)
                await nc.publish(Subjects.heartbeat("decode", "w2"), proto.encode(hb))
                await asyncio.sleep(0.1)
            await _publish(nc, "w2", 0, CHAIN[:3])
            await _eventually(lambda: _query(nc, CHAIN), lambda m: m.get("w2") == 3)
            await _eventually(lambda: _query(nc, CHAIN), lambda m: "w2" not in m, timeout=15)
            await nc.close()
        asyncio.run(phase2())

        async def malformed() -> None:
            nc = await nats.connect(url)
            resp = await nc.request(Subjects.CACHE_QUERY, b"{oops", timeout=5)
            err = proto.decode(resp.data, proto.StreamError)
            assert err.code == proto.ErrorCode.BAD_REQUEST
            await nc.publish(Subjects.kv_events("w1"), b"\x00garbage")
            assert (await _query(nc, CHAIN)).get("w1") == 10  # still serving
            await nc.close()
        asyncio.run(malformed())
    finally:
        stop(p)
