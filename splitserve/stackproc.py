"""Run ``splitserve up`` as a real subprocess (the same command a user runs) and wait until it is up.

Used by the end-to-end tests and the benchmarks, which must measure the product as users start it."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class StackProc:
    proc: subprocess.Popen[str]
    nats_url: str
    state_dir: Path
    output: list[str] = field(default_factory=list)

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


def start_stack(state_dir: Path, *args: str, timeout: float = 420.0) -> StackProc:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    exe = str(Path(sys.executable).parent / "splitserve")
    proc = subprocess.Popen([exe, "up", "--nats-port", "0", "--state-dir", str(state_dir), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    url = None
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 1.0)
        if not r:
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        m = re.search(r"NATS: (nats://\S+)", line)
        if m:
            url = m.group(1)
        if "splitserve is up" in line and url:
            return StackProc(proc, url, state_dir, lines)
    proc.kill()
    raise RuntimeError("splitserve up did not come up:\n" + "\n".join(lines))
