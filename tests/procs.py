"""Helpers to run real service processes in tests and wait for their heartbeats."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import nats

import proto
from proto import Heartbeat, Subjects
from splitserve import errors
from splitserve.client import Client


def spawn_service(module: str, *args: str, nats_url: str, worker_id: str, log_dir: Path) -> subprocess.Popen[bytes]:
    log_dir.mkdir(parents=True, exist_ok=True)
    out = open(log_dir / f"{worker_id}.log", "ab")  # noqa: SIM115 - handed to the child
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", module, "--nats-url", nats_url, "--worker-id", worker_id, *args],
                            stdout=out, stderr=subprocess.STDOUT, env=env)


async def wait_ready(nats_url: str, worker_ids: Iterable[str], timeout: float = 240.0) -> dict[str, Heartbeat]:
    want = set(worker_ids)
    seen: dict[str, Heartbeat] = {}
    nc = await nats.connect(nats_url)
    done = asyncio.Event()

    async def cb(msg: object) -> None:
        hb = proto.decode(msg.data, Heartbeat)  # type: ignore[attr-defined]
        if hb.worker_id in want and hb.state == "ready":
            seen[hb.worker_id] = hb
            if set(seen) == want:
                done.set()

    sub = await nc.subscribe(Subjects.HEARTBEAT_ALL, cb=cb)
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        await sub.unsubscribe()
        await nc.close()
    return seen


def stop(*procs: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def heartbeat_of(url: str, worker: str, role: str = "decode") -> Heartbeat:
    """The next heartbeat of one worker."""
    nc = await nats.connect(url)
    try:
        sub = await nc.subscribe(Subjects.heartbeat(role, worker))
        msg = await sub.next_msg(timeout=5)
        return proto.decode(msg.data, Heartbeat)
    finally:
        await nc.close()


async def kill_worker_mid_stream(client: Client, url: str, worker: str = "decode-0",
                                 role: str = "decode") -> tuple[str, errors.SplitserveError]:
    """Start a long generation and SIGKILL the worker at its fourth delta. Returns the request id and the
    terminal error the stream ended with; fails if the stream ended without one."""
    gen = client.generate("Write a very long story about a dragon.", chat=True, max_tokens=2000)
    killed = False
    try:
        async for d in gen:
            if d.seq >= 3 and not killed:
                hb = await heartbeat_of(url, worker, role)
                assert hb.pid is not None
                os.kill(hb.pid, signal.SIGKILL)
                killed = True
    except errors.SplitserveError as exc:
        return gen.request_id, exc
    raise AssertionError(f"the stream of {gen.request_id} ended normally although {worker} was killed")
