"""Restarts are invisible to clients that keep arriving: ``splitserve up`` (mock engine) while fresh
``splitserve generate`` processes start one after another (each its own process and connection, never answered by
a router before), every service kind in turn gets SIGTERM and, once its supervisor has brought it back, SIGKILL:
the router (the only one), the prefiller, a decoder and the cache index; then one nats-server of the stack's
3-node cluster (SIGTERM, started again, SIGKILL, started again: ``up`` does not restart nats-servers, an operator
or Kubernetes does). Every client must get its full output.

A fresh client used to fail at once with ``[no_workers] no router is serving requests`` while the only router
restarted (6 of 24 clients on main at 3bfffbf): only a client that a router had answered before waited for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from splitserve.discovery import server_list
from splitserve.natsserver import nats_server_binary
from splitserve.stackproc import StackProc, start_stack
from tests.procs import ready_pid

pytestmark = pytest.mark.slow

SPLITSERVE = str(Path(sys.executable).parent / "splitserve")
VICTIMS = [("router-0", "router"), ("prefill-0", "prefill"), ("decode-0", "decode"), ("cache-index-0", "cache_index")]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # a zombie until its parent reaps it
    except psutil.NoSuchProcess:
        return False


async def _restart_nats_node(stack: StackProc, node: str, pid: int, sig: signal.Signals) -> int:
    """Stop one nats-server of the cluster with ``sig``, start it again with its config (its ports and
    JetStream store: it rejoins the cluster and catches up), and return the new pid once it listens."""
    os.kill(pid, sig)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not _alive(pid), f"nats-server {node} did not exit on {sig.name}"
    conf = stack.state_dir / "nats-cluster" / node / "nats.conf"
    port = int(re.search(r'^listen: *"[^"]*:(\d+)"', conf.read_text(), re.M).group(1))  # type: ignore[union-attr]
    await asyncio.sleep(1.0)  # down for a moment, as a pod rescheduled
    proc = await asyncio.create_subprocess_exec(nats_server_binary(), "-c", str(conf), stdout=subprocess.DEVNULL,
                                                stderr=subprocess.STDOUT)
    while time.monotonic() < deadline + 30:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc.pid
        except OSError:
            await asyncio.sleep(0.1)
    raise AssertionError(f"nats-server {node} did not listen again on {port}")


async def test_restarting_each_service_fails_no_fresh_client(tmp_path: Path) -> None:
    env = dict(os.environ, SPLITSERVE_MOCK_STEP_MS="10", SPLITSERVE_MOCK_PREFILL_TPS="5000")
    # Short prompts go straight to a decoder, longer ones (>= 12 tokens) through the prefiller: both paths run.
    stack: StackProc = await asyncio.to_thread(
        start_stack, tmp_path / "state", "--engine", "mock", "--prefill", "1", "--decode", "2",
        "--disagg-threshold", "12", "--max-stall-ms", "0", "--nats-cluster", "3", env=env)
    url = stack.nats_url  # every node's URL, as stack.json gives it to a client
    assert len(server_list(url)) == 3, url
    m = re.search(r"nats n1 +ready +\S+ +\(pid (\d+)\)", "\n".join(stack.output))
    assert m, stack.output
    nats_pid = int(m.group(1))
    outcomes: list[tuple[int, str]] = []
    stop = asyncio.Event()

    async def one(i: int) -> None:
        words = " ".join(["weather"] * (3 if i % 2 else 20))
        proc = await asyncio.create_subprocess_exec(
            SPLITSERVE, "generate", f"client {i} asks about the {words}", "--max-tokens", "8", "--nats-url", url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        outcomes.append((proc.returncode or 0, out.decode(errors="replace")[-400:]))

    async def clients() -> None:
        running: set[asyncio.Task[None]] = set()
        i = 0
        while not stop.is_set():
            if len(running) < 3:  # a new client process every 2 s, a few at once (each costs ~0.6 CPU-s)
                task = asyncio.ensure_future(one(i))
                running.add(task)
                task.add_done_callback(running.discard)
                i += 1
            await asyncio.sleep(2.0)
        if running:
            await asyncio.wait(running)

    driver = asyncio.ensure_future(clients())
    restarts: list[str] = []
    try:
        await asyncio.sleep(3)
        for worker, role in VICTIMS:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                pid = await ready_pid(url, worker, role, None)
                os.kill(pid, sig)
                await ready_pid(url, worker, role, pid)
                restarts.append(f"{worker}:{sig.name}")
                await asyncio.sleep(2)  # clients keep arriving at the restarted service
        for sig in (signal.SIGTERM, signal.SIGKILL):
            nats_pid = await _restart_nats_node(stack, "n1", nats_pid, sig)
            restarts.append(f"nats-n1:{sig.name}")
            await asyncio.sleep(4)  # it rejoins; clients keep arriving, some of them on it
        stop.set()
        await asyncio.wait_for(driver, 180)
    finally:
        stop.set()
        driver.cancel()
        await asyncio.to_thread(stack.stop)
        with contextlib.suppress(OSError):
            os.kill(nats_pid, signal.SIGKILL)  # the node this test started again (up stops only its own)
    failed = [out for rc, out in outcomes if rc != 0]
    assert len(restarts) == 2 * len(VICTIMS) + 2
    assert len(outcomes) >= 20, len(outcomes)  # clients kept arriving through every restart
    assert not failed, f"{len(failed)} of {len(outcomes)} clients failed: {failed[:3]}"
