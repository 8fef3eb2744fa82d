"""Run ``splitserve up`` as a real subprocess (the same command a user runs) and wait until it is up; or run
single services (``python -m splitserve.services.<name>``) and wait for their ready heartbeats.

Used by the end-to-end tests and the benchmarks, which must measure the product as users start it."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from splitserve import proto
from splitserve.obs.log import private_dir, private_opener


def spawn_service(module: str, *args: str, nats_url: str, worker_id: str, log_dir: Path,
                  env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """One service process (``module`` e.g. "splitserve.services.router"), its output appended to log_dir/<id>.log."""
    private_dir(log_dir)  # logs are owner-only (0700 directory, 0600 files): see splitserve.obs.log
    out = open(log_dir / f"{worker_id}.log", "ab", opener=private_opener)  # noqa: SIM115 - handed to the child
    env = dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", module, "--nats-url", nats_url, "--worker-id", worker_id, *args],
                            stdout=out, stderr=subprocess.STDOUT, env=env)


async def wait_ready(nats_url: str, worker_ids: Iterable[str], timeout: float = 240.0, *, user: str | None = None,
                     password: str | None = None) -> dict[str, proto.Heartbeat]:
    """Wait until every named worker has sent a "ready" heartbeat; returns the last heartbeat of each.
    ``user``/``password``: an account that may read heartbeats, on a closed stack (its ``admin``)."""
    import asyncio

    import nats

    want = set(worker_ids)
    seen: dict[str, proto.Heartbeat] = {}
    from splitserve.discovery import server_list

    nc = await nats.connect(server_list(nats_url), user=user, password=password)
    done = asyncio.Event()

    async def cb(msg: object) -> None:
        hb = proto.decode(msg.data, proto.Heartbeat)  # type: ignore[attr-defined]
        if hb.worker_id in want and hb.state == "ready":
            seen[hb.worker_id] = hb
            if set(seen) == want:
                done.set()

    sub = await nc.subscribe(proto.Subjects.HEARTBEAT_ALL, cb=cb)
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        await sub.unsubscribe()
        await nc.close()
    return seen


@dataclass
class StackProc:
    proc: subprocess.Popen[str]
    nats_url: str
    state_dir: Path
    output: list[str] = field(default_factory=list)
    http_url: str | None = None  # the OpenAI-compatible front door, e.g. http://127.0.0.1:8000 (no /v1)
    metrics_url: str | None = None  # frontend-0's /metrics, on its own loopback port
    metrics_urls: list[str] = field(default_factory=list)  # every front door's (each counts its own HTTP series)

    def logs(self, name: str) -> str:
        try:
            return (self.state_dir / "logs" / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_stack(state_dir: Path, *args: str, timeout: float = 420.0, exe: str | None = None,
                env: dict[str, str] | None = None, cwd: Path | None = None) -> StackProc:
    """``exe``: another installation's ``splitserve`` (the wheel test), with its own ``env`` and ``cwd``."""
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    exe = exe or str(Path(sys.executable).parent / "splitserve")
    # Free ports by default (tests run beside a developer's own stack); a later --http-port in args wins.
    proc = subprocess.Popen([exe, "up", "--nats-port", "0", "--http-port", "0", "--state-dir", str(state_dir),
                             *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        # A thread, not select(): buffered readline() can hold several lines select() never reports.
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip())
        lines.put(None)

    threading.Thread(target=pump, daemon=True, name="stack-stdout").start()
    seen: list[str] = []
    url = None
    http_url = None
    metrics_url = None
    metrics_urls: list[str] = []
    up = False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        m = re.search(r"NATS: (nats://\S+)", line)
        if m:
            url = m.group(1)
        m = re.search(r"OpenAI API: (http://\S+?)(?:/v1)?$", line)
        if m:
            http_url = m.group(1)
        m = re.search(r"metrics: +(http://\S+/metrics)", line)
        if m:
            metrics_url = m.group(1)
            metrics_urls = re.findall(r"(http://[^\s;)]+/metrics)", line)  # frontend-0's first, then the others
        up = up or bool("splitserve is up" in line and url)
        # The API line follows the "up" line; the block always ends with "stop:".
        if up and url and "stop:" in line:  # the block's last line: every URL above it has been read
            return StackProc(proc, url, state_dir, seen, http_url=http_url, metrics_url=metrics_url,
                             metrics_urls=metrics_urls)
    proc.kill()
    raise RuntimeError("splitserve up did not come up:\n" + "\n".join(seen))
