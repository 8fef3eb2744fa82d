"""Operator commands against a NATS that is not there: a clear error and exit 1 within seconds, not a retry loop
printing a traceback per attempt (nats-py retries a first connect for ever unless told otherwise)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SPLITSERVE = str(Path(sys.executable).parent / "splitserve")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once it is closed


@pytest.mark.parametrize("args", [["queues"], ["cache", "stats"]])
def test_an_operator_command_says_it_cannot_reach_nats(args: list[str]) -> None:
    url = f"nats://127.0.0.1:{_closed_port()}"
    t0 = time.monotonic()
    out = subprocess.run([SPLITSERVE, *args, "--nats-url", url], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert out.returncode == 1, out
    assert f"cannot connect to NATS at {url}" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert took < 30, took
