"""The durable queue's fast path (``services/router/direct.py``) against real processes: nats-server (JetStream), a
router and a mock-engine decoder. With nothing waiting and a decode slot free, intake dispatches a request it has
just stored, at once; the request is still stored before it is accepted, and its queue message is acked once it
ended (the loop pulls it later), so nothing is left in the queue. A burst past the decoder's slots queues the rest
as before, and every request ends once.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import pytest

from splitserve.client import Client
from splitserve.natsserver import NatsServer
from splitserve.proto import Subjects
from tests.procs import log_events, spawn_service, stop, wait_ready

pytestmark = pytest.mark.slow


def _queued_lines(log: Path) -> list[dict[str, object]]:
    return log_events(log.read_text(errors="replace"), "queued")


async def _queue_messages(url: str) -> int:
    nc = await nats.connect(url)
    try:
        return int((await nc.jetstream().stream_info(Subjects.QUEUE_STREAM)).state.messages)
    finally:
        await nc.close()


async def test_idle_queue_dispatches_at_intake_and_leaves_nothing_behind(fresh_nats: NatsServer, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_MOCK_STEP_MS", "4")
    url, logs = fresh_nats.url, tmp_path / "logs"
    procs = [spawn_service("splitserve.services.router", "--disagg-threshold", "1000000000", "--queue-ack-wait-s",
                           "3", nats_url=url, worker_id="router-d", log_dir=logs),
             spawn_service("splitserve.services.decode", "--engine", "mock", "--transport", "tcp", "--max-batch", "2",
                           nats_url=url, worker_id="decode-d", log_dir=logs)]
    try:
        await wait_ready(url, ["router-d", "decode-d"], timeout=180)
        async with Client(url) as c:
            # one at a time: the queue is idle each time, so intake dispatches every one itself
            for i in range(6):
                res = await c.complete(f"one at a time {i}", max_tokens=8)
                assert res.finish_reason == "length" and res.usage.completion_tokens == 8
            alone = _queued_lines(logs / "router-d.log")
            # (most, not all: the queue message of the one before counts as waiting from the periodic refresh of
            # the lanes' counts until the loop has pulled and acked it)
            assert len(alone) == 6 and sum(bool(r["direct"]) for r in alone) >= 4, alone
            # a burst past the decoder's slots (a batch of 2, and one more waiting there): the rest wait in the
            # queue and are dispatched by the loop as slots free up; every one ends once
            results = await asyncio.gather(*(c.complete(f"burst {i}", max_tokens=8) for i in range(12)))
        assert all(r.finish_reason == "length" and r.usage.completion_tokens == 8 for r in results)
        assert len({r.request_id for r in results}) == 12
        burst = _queued_lines(logs / "router-d.log")[6:]
        assert len(burst) == 12
        assert any(r["direct"] for r in burst) and not all(r["direct"] for r in burst), burst
        # every queue message was acked: those of requests dispatched at intake too (pulled after they ended)
        deadline = time.monotonic() + 15
        while (left := await _queue_messages(url)) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert left == 0, f"{left} queue message(s) never acked"
    finally:
        stop(*procs)
