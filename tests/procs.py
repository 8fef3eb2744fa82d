"""Helpers to run real service processes in tests and wait for their heartbeats."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import nats
import nats.errors

from splitserve import errors, proto
from splitserve.client import Client, Result
from splitserve.discovery import server_list
from splitserve.proto import Heartbeat, Subjects
from splitserve.stackproc import spawn_service, wait_ready

__all__ = ["spawn_service", "wait_ready"]


def log_events(log: str, event: str) -> list[dict[str, object]]:
    """The JSON records of ``event`` in a service's log text, in order (other lines, and any text before a
    record's opening brace, skipped)."""
    out = []
    for line in log.splitlines():
        if f'"{event}"' not in line or "{" not in line:
            continue
        try:
            rec = json.loads(line[line.index("{"):])
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == event:
            out.append(rec)
    return out


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


async def ready_pid(url: str, worker: str, role: str, other_than: int | None, timeout: float = 120.0) -> int:
    """The pid of ``worker`` once a heartbeat says ``ready`` from a process other than ``other_than`` (a restarted
    one is back)."""
    nc = await nats.connect(server_list(url))
    try:
        sub = await nc.subscribe(Subjects.heartbeat(role, worker))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"{worker} did not come back ready within {timeout:.0f}s"
            try:
                msg = await sub.next_msg(timeout=min(left, 5.0))
            except nats.errors.TimeoutError:
                continue
            hb = proto.decode(msg.data, Heartbeat)
            if hb.state == "ready" and hb.pid is not None and hb.pid != other_than:
                return hb.pid
    finally:
        await nc.close()


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


async def cancel_mid_stream(url: str, *, after: int = 3, tenant: str | None = None, max_tokens: int = 2000) -> Result:
    """Stream a long generation and cancel it at its ``after``-th delta; returns the final result."""
    async with Client(url, tenant=tenant) as c:
        gen = c.generate("Write a very long story about a dragon.", chat=True, max_tokens=max_tokens)
        n = 0
        async for _ in gen:
            n += 1
            if n == after:
                await gen.cancel()
        assert gen.result is not None
        return gen.result
