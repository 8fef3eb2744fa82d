"""How a service process ends when its world goes away: its supervisor dies (it stops at once, without the drain
nobody waits for, and its requests move to another decoder), or a stop hangs (the process still ends, at the
stop deadline). Real processes, a real nats-server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from splitserve.client import Client
from splitserve.natsserver import NatsServer
from splitserve.stackproc import spawn_service
from tests.procs import log_events, stop, wait_ready

PROMPT = "Tell me a story about migrating birds."

# A stand-in for `splitserve up`: starts one service the way the supervisor does (splitserve.natsserver.
# child_preexec: SIGTERM when the supervisor dies), prints its pid, and waits to be killed.
SUPERVISOR = """
import os, subprocess, sys, time
from splitserve.natsserver import child_preexec
log = open(os.environ["TEST_CHILD_LOG"], "ab")
p = subprocess.Popen(sys.argv[1:], stdout=log, stderr=subprocess.STDOUT, preexec_fn=child_preexec)
print(p.pid, flush=True)
time.sleep(3600)
"""

# A service whose stop never ends (its shutdown waits for ever), with a short drain bound and stop grace.
HANGS = """
import asyncio, sys
from splitserve.runtime import service
service.STOP_GRACE_S = 1.0

class Stuck(service.Service):
    role = "router"

    async def shutdown(self) -> None:
        await asyncio.Event().wait()

service.run_service(Stuck("router-stuck", sys.argv[1], drain_timeout_s=0.5))
"""


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    ps: list[subprocess.Popen[bytes]] = []
    yield ps
    stop(*ps)


def _popen(argv: list[str], **kw: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, **kw)  # type: ignore[call-overload,no-any-return]


async def _exits(pid: int, within: float) -> float | None:
    """Seconds until process ``pid`` is gone (None: still running after ``within``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return time.monotonic() - t0
        except psutil.NoSuchProcess:
            return time.monotonic() - t0
        await asyncio.sleep(0.1)
    return None


@pytest.mark.slow
async def test_an_orphaned_decoder_stops_at_once_and_its_requests_move(fresh_nats: NatsServer, tmp_path: Path,
                                                                       procs: list[subprocess.Popen[bytes]]) -> None:
    url, logs = fresh_nats.url, tmp_path / "logs"
    procs.append(spawn_service("splitserve.services.router", "--disagg-threshold", "1000000000", nats_url=url,
                               worker_id="router-o", log_dir=logs))
    # Its drain bound (120 s) is far longer than its requests (400 tokens at 100 ms: 40 s): a drain would wait
    # for them.
    env = dict(os.environ, SPLITSERVE_MOCK_STEP_MS="100", TEST_CHILD_LOG=str(logs / "decode-orphan.log"),
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    logs.mkdir(parents=True, exist_ok=True)
    sup = _popen([sys.executable, "-c", SUPERVISOR, sys.executable, "-m", "splitserve.services.decode", "--engine",
                  "mock", "--transport", "tcp", "--drain-timeout-s", "120", "--nats-url", url, "--worker-id",
                  "decode-orphan"], stdout=subprocess.PIPE, env=env)
    procs.append(sup)
    assert sup.stdout is not None
    child = int(sup.stdout.readline())
    try:
        await wait_ready(url, ["router-o", "decode-orphan"], timeout=180)
        async with Client(url, idle_timeout=60) as c:
            gens = [c.generate(PROMPT + f" ({i})", max_tokens=400) for i in range(4)]
            its = [g.__aiter__() for g in gens]
            firsts = [await it.__anext__() for it in its]  # every stream has begun, on the only decoder
            procs.append(spawn_service("splitserve.services.decode", "--engine", "mock", "--transport", "tcp",
                                       nats_url=url, worker_id="decode-kept", log_dir=logs,
                                       env=dict(os.environ, SPLITSERVE_MOCK_STEP_MS="5")))
            await wait_ready(url, ["decode-kept"], timeout=180)
            sup.kill()  # the supervisor dies at once: no SIGTERM handler of its own, no stop of its children
            took = await _exits(child, within=30.0)
            assert took is not None, "the orphaned decoder was still running 30 s after its supervisor died"
            rests = [[d async for d in it] for it in its]
        for g, f, rest in zip(gens, firsts, rests, strict=True):
            deltas = [f, *rest]
            assert g.result is not None and g.result.finish_reason == "length"
            assert len(g.result.token_ids) == 400
            assert g.result.decode_worker == "decode-kept"  # moved when its decoder stopped
            assert [d.seq for d in deltas] == list(range(len(deltas)))  # one unbroken stream
            streamed = [t for d in deltas for t in d.token_ids]
            assert streamed == g.result.token_ids[:len(streamed)]
    finally:
        if psutil.pid_exists(child):
            os.kill(child, signal.SIGKILL)
    log = (logs / "decode-orphan.log").read_text()
    assert log_events(log, "supervisor_gone"), log[-3000:]
    assert not log_events(log, "stop_deadline_exceeded")


async def test_a_stop_that_hangs_ends_at_the_stop_deadline(nats_server: NatsServer, tmp_path: Path) -> None:
    log = tmp_path / "stuck.log"
    with log.open("wb") as out:
        p = _popen([sys.executable, "-c", HANGS, nats_server.url], stdout=out, stderr=subprocess.STDOUT)
    try:
        await wait_ready(nats_server.url, ["router-stuck"], timeout=120)
        p.send_signal(signal.SIGTERM)
        # drain 0.5 s + grace 1 s; far less than this bound unless the deadline never fires
        assert p.wait(timeout=60) == 3
    finally:
        stop(p)
    assert log_events(log.read_text(), "stop_deadline_exceeded")
