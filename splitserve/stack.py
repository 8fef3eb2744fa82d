"""The embedded stack behind ``splitserve up``: NATS plus every service, each a separate OS process.

The supervisor starts nats-server (unless given a URL), then the router replicas (``routers``: router-0 ..
router-{N-1}, each its own process sharing the durable queue), the cache-index service and the prefill and
decode workers; waits until each one's heartbeat says ``ready``; restarts a service that dies
(with exponential backoff, as an orchestrator would); and on SIGINT/SIGTERM stops them all, leaving no
process behind. Every child also gets PR_SET_PDEATHSIG so that even a SIGKILLed supervisor takes its
children down with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from proto import Heartbeat, Subjects
from splitserve import discovery
from splitserve.cpus import parse_cpus
from splitserve.natsserver import NatsServer, child_preexec, free_port, start_nats
from splitserve.runtime.bus import Bus
from splitserve.tenancy import natsauth
from splitserve.tenancy.config import load_tenants
from splitserve.tenancy.natsauth import StackAuth


@dataclass
class StackConfig:
    prefill: int = 1
    decode: int = 1
    routers: int = 1  # router replicas (router-0 ..): they share the queue, the request registry and quotas
    engine: str = "hf"
    model: str | None = None
    dtype: str = "float32"
    disagg_threshold: int = 512
    strategy: str = "roundrobin"
    transport: str = "nixl"
    nats_url: str | None = None
    nats_port: int | None = 4222
    state_dir: Path = field(default_factory=lambda: discovery.home() / "stack")
    ready_timeout_s: float = 600.0
    threads: int | None = None
    cache_tokens: int = 8192
    l1_tokens: int = 0
    prefill_cpus: str | None = None  # e.g. "0" or "0-3"; default: the first half of the cores
    decode_cpus: str | None = None  # default: the other half (all cores when there are no prefillers)
    colocated: bool = False  # no prefill pool: every prompt is prefilled on the decoders (for comparison)
    # Long-context decoders (splitserve.routing.context): prompts of at least long_prompt_tokens decode there,
    # never in the general decoders' batches. Default cores: the prefill pool's (it is idle between long
    # prompts), else the decode pool's.
    long_decode: int = 0
    long_decode_cpus: str | None = None
    long_prompt_tokens: int = 2048
    max_stall_ms: float = 100.0
    http_port: int = 8000  # the OpenAI-compatible front door; 0 (or taken) = a free port
    log_level: str = "INFO"
    kv_connector: str = "nixl"  # --engine vllm: vLLM's KV connector between the pools (nixl | lmcache)
    kv_backend: str = "UCX"  # --engine vllm: NIXL backend (UCX | LIBFABRIC)
    # Tenants file (splitserve.tenancy.config): NATS users and permissions per tenant and per service.
    tenants_file: Path | None = None


@dataclass
class Child:
    name: str
    role: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    ready: bool = False
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = 0.0


class Stack:
    def __init__(self, cfg: StackConfig, echo: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.echo = echo
        self.nats: NatsServer | None = None
        self.nats_url = cfg.nats_url or ""
        self.http_url = ""
        self.children: list[Child] = []
        self.stopping = asyncio.Event()
        self.logs = cfg.state_dir / "logs"
        self.auth: StackAuth | None = None  # set when running with a tenants file
        # computed once, before the supervisor pins itself (which changes what sched_getaffinity reports)
        self.pools = self._cpu_pools()

    def control_cpus(self) -> list[int] | None:
        """Cores for nats-server, the router, the cache index, the front door and this supervisor: every core
        but the decode pool's, so that only decoders run there. Left to float, the control plane (~7% of a core
        under load) moved onto the decode core whenever the prefill core was saturated, and the streams' steps
        slowed by as much. None (no pinning) when the decode pool has every core (colocated)."""
        decode = set(self.pools.get("decode", ()))
        if not decode:
            return None
        rest = [x for x in sorted(os.sched_getaffinity(0)) if x not in decode]
        return rest or None

    def _children(self) -> list[Child]:
        c = self.cfg
        py = [sys.executable, "-m"]
        common = ["--nats-url", self.nats_url, "--log-level", c.log_level]
        eng = ["--engine", c.engine, "--dtype", c.dtype, "--transport", c.transport]
        if c.model:
            eng += ["--model", c.model]
        if c.engine == "vllm":
            eng += ["--kv-connector", c.kv_connector, "--kv-backend", c.kv_backend]
        tenants = ["--tenants", str(c.tenants_file)] if c.tenants_file else []
        pools = self.pools
        base = {"prefill": list(eng), "decode": list(eng), "long": list(eng)}
        counts = {"prefill": c.prefill, "decode": c.decode, "long": c.long_decode}

        def worker_args(role: str, i: int) -> list[str]:
            n, cores = counts[role], pools.get(role)
            share = 1
            if cores and len(cores) >= n:
                # one slice of the pool's cores per worker: replicas never compete for a core
                k = len(cores) // n
                cores = cores[i * k : (i + 1) * k]
            elif cores:
                share = n  # more workers than cores: they share them, one thread each at most
            threads = c.threads or (max(1, len(cores) // share) if cores else
                                    max(1, (os.cpu_count() or 1) // max(1, c.prefill + c.decode)))
            args = [*base[role], "--threads", str(threads), "--cache-tokens", str(c.cache_tokens),
                    "--l1-tokens", str(c.l1_tokens)]
            return args + (["--cpus", ",".join(map(str, cores))] if cores else [])

        # Colocated: there is nowhere else to send a prompt, so no stall limit (decoders chunk instead).
        router_extra = ["--max-stall-ms", "0" if c.colocated else str(c.max_stall_ms),
                        "--long-prompt-tokens", str(c.long_prompt_tokens)]
        out = [Child(f"router-{i}", "router", py + ["services.router", "--worker-id", f"router-{i}", "--strategy",
                                                    c.strategy, "--disagg-threshold",
                                                    str(10**9 if c.colocated else c.disagg_threshold), *router_extra,
                                                    *(["--model", c.model] if c.model else []), *tenants,
                                                    *common],
                     self.logs / f"router-{i}.log") for i in range(max(1, c.routers))]
        out += [Child("cache-index-0", "cache_index", py + ["services.cache_index", "--worker-id", "cache-index-0",
                                                           *common], self.logs / "cache-index-0.log")]
        for i in range(c.prefill):
            name = f"prefill-{i}"
            out.append(Child(name, "prefill", py + ["services.prefill", "--worker-id", name,
                                                    *worker_args("prefill", i), *common],
                             self.logs / f"{name}.log"))
        for i in range(c.decode):
            name = f"decode-{i}"
            out.append(Child(name, "decode", py + ["services.decode", "--worker-id", name,
                                                   *worker_args("decode", i), *common],
                             self.logs / f"{name}.log"))
        for i in range(c.long_decode):
            name = f"decode-long-{i}"
            out.append(Child(name, "decode", py + ["services.decode", "--worker-id", name, "--pool", "long",
                                                   *worker_args("long", i), *common],
                             self.logs / f"{name}.log"))
        # The port is fixed here, once: a restarted front door comes back at the URL already printed.
        port = free_port(c.http_port or None)
        self.http_url = f"http://127.0.0.1:{port}"
        out.append(Child("frontend-0", "frontend", py + ["services.frontend", "--worker-id", "frontend-0",
                                                        "--port", str(port), *tenants, *common],
                         self.logs / "frontend-0.log"))
        return out

    def _cpu_pools(self) -> dict[str, list[int]]:
        """Disjoint core sets for the prefill and decode pools (the CPU analogue of separate GPU pools)."""
        c = self.cfg
        avail = sorted(os.sched_getaffinity(0))
        pools: dict[str, list[int]] = {}
        if c.prefill_cpus:
            pools["prefill"] = list(parse_cpus(c.prefill_cpus) or ())
        if c.decode_cpus:
            pools["decode"] = list(parse_cpus(c.decode_cpus) or ())
        if c.prefill == 0 or c.colocated:
            pools.setdefault("decode", avail)
        elif len(avail) >= 2:
            half = len(avail) // 2
            pools.setdefault("prefill", [x for x in avail[:half] if x not in pools.get("decode", [])] or avail[:half])
            pools.setdefault("decode", [x for x in avail[half:] if x not in pools["prefill"]] or avail[half:])
        if c.long_decode_cpus:
            pools["long"] = list(parse_cpus(c.long_decode_cpus) or ())
        elif c.long_decode and (pools.get("prefill") or pools.get("decode")):
            pools["long"] = list(pools.get("prefill") or pools["decode"])
        return pools

    def _spawn(self, ch: Child) -> None:
        ch.log.parent.mkdir(parents=True, exist_ok=True)
        with open(ch.log, "ab") as out:
            env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
            if self.auth is not None:
                # Each service authenticates as its role's user; the environment (not argv, which any local
                # user can read in ps) carries the password. A tenant's own variables must not leak in.
                env.pop(natsauth.ENV_NKEY_SEED, None)
                env[natsauth.ENV_USER], env[natsauth.ENV_PASSWORD] = self.auth.credentials(ch.role)
            ch.proc = subprocess.Popen(ch.argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                       preexec_fn=child_preexec)
        ch.ready = False
        ch.started_at = time.monotonic()

    async def run(self, on_ready: Callable[[Stack], None] | None = None) -> int:
        c = self.cfg
        self.logs.mkdir(parents=True, exist_ok=True)
        auth_conf = ""
        if c.tenants_file is not None:
            self.auth = natsauth.prepare_stack_auth(c.state_dir, load_tenants(c.tenants_file))
            auth_conf = self.auth.config
            assert self.auth.auth_dir is not None
            conf_path = self.auth.auth_dir / "nats-auth.conf"
            natsauth.write_private(conf_path, auth_conf)
            self.echo(f"  {'auth':<15} {len(self.auth.service_secrets)} service users + tenants from "
                      f"{c.tenants_file}; secrets under {self.auth.auth_dir} (mode 0600)")
            if self.auth.generated_tenants:
                self.echo(f"  {'auth':<15} generated passwords for tenant(s) "
                          f"{', '.join(sorted(self.auth.generated_tenants))}: "
                          f"{self.auth.auth_dir / natsauth.TENANTS_FILE}")
            if self.nats_url:
                self.echo(f"  {'auth':<15} external NATS server: its config must include {conf_path}")
        control = self.control_cpus()
        if control:
            # The supervisor's threads first: everything it starts inherits them (workers then pin their
            # engine threads to their own pool).
            for tid in os.listdir("/proc/self/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), control)
            self.echo(f"  {'control plane':<15} cores {','.join(map(str, control))} (decode cores "
                      f"{','.join(map(str, self.pools['decode']))} run only decoders)")
        if not self.nats_url:
            self.nats = await asyncio.to_thread(start_nats, c.state_dir / "nats", port=c.nats_port,
                                                log_file=self.logs / "nats.log", extra_config=auth_conf)
            self.nats_url = self.nats.url
            self.echo(f"  {'nats':<15} ready  {self.nats_url}  (pid {self.nats.proc.pid})")
        admin = self.auth.credentials(natsauth.ADMIN_ROLE) if self.auth else (None, None)
        bus = await Bus.connect(self.nats_url, "supervisor", user=admin[0], password=admin[1])
        try:
            self.children = self._children()
            sub = await bus.nc.subscribe(Subjects.HEARTBEAT_ALL, cb=self._on_hb)
            t0 = time.monotonic()
            for ch in self.children:
                self._spawn(ch)
            rc = await self._wait_ready(t0)
            if rc != 0:
                return rc
            # No secret goes here (the file is readable by anyone who can read the home directory): operator
            # commands find the admin credentials under state_dir/auth, readable by the stack's owner only.
            discovery.write_stack({"pid": os.getpid(), "nats_url": self.nats_url, "state_dir": str(c.state_dir),
                                   "auth": self.auth is not None, "services": [ch.name for ch in self.children]})
            if on_ready:
                on_ready(self)
            await self._supervise()
            await sub.unsubscribe()
            return 0
        finally:
            await self._stop_all()
            await bus.close()
            if self.nats:
                self.nats.stop()
            discovery.clear_stack(os.getpid())

    async def _on_hb(self, raw: object) -> None:
        import proto

        try:
            hb = proto.decode(raw.data, Heartbeat)  # type: ignore[attr-defined]
        except proto.ProtocolError:
            return
        for ch in self.children:
            ours = ch.name == hb.worker_id and ch.proc is not None and hb.pid == ch.proc.pid
            if ours and hb.state == "ready" and not ch.ready:
                assert ch.proc is not None
                ch.ready = True
                took = time.monotonic() - ch.started_at
                what = "ready" if ch.restarts == 0 else f"ready again (restart {ch.restarts})"
                self.echo(f"  {ch.name:<15} {what}  pid {ch.proc.pid}  ({took:.1f}s)")

    async def _wait_ready(self, t0: float) -> int:
        while not all(ch.ready for ch in self.children):
            if self.stopping.is_set():
                return 130
            for ch in self.children:
                if ch.proc is not None and ch.proc.poll() is not None:
                    self.echo(f"  {ch.name:<15} FAILED to start (exit {ch.proc.returncode}); last log lines:")
                    self.echo(_tail(ch.log))
                    return 1
            if time.monotonic() - t0 > self.cfg.ready_timeout_s:
                late = ", ".join(ch.name for ch in self.children if not ch.ready)
                self.echo(f"  not ready after {self.cfg.ready_timeout_s:.0f}s: {late}")
                return 1
            await asyncio.sleep(0.1)
        return 0

    async def _supervise(self) -> None:
        while not self.stopping.is_set():
            now = time.monotonic()
            for ch in self.children:
                if ch.proc is None:
                    if now >= ch.next_start:
                        self._spawn(ch)
                    continue
                if ch.proc.poll() is not None:
                    backoff = min(30.0, 0.5 * (2 ** min(ch.restarts, 6)))
                    if now - ch.started_at > 60:
                        backoff = 0.5  # it had run for a while: not a crash loop
                    ch.restarts += 1
                    self.echo(f"  {ch.name:<15} exited with code {ch.proc.returncode}; restarting in "
                              f"{backoff:.1f}s (restart {ch.restarts})")
                    ch.proc = None
                    ch.ready = False
                    ch.next_start = now + backoff
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), timeout=0.2)

    async def _stop_all(self, grace_s: float = 15.0) -> None:
        procs = [ch.proc for ch in self.children if ch.proc is not None and ch.proc.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            await asyncio.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def request_stop(self) -> None:
        self.stopping.set()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        data = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "    (no log)"
    return "\n".join("    " + line for line in data)


def run_stack(cfg: StackConfig, echo: Callable[[str], None] = print,
              on_ready: Callable[[Stack], None] | None = None) -> int:
    stack = Stack(cfg, echo)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stack.request_stop)
        return await stack.run(on_ready)

    return asyncio.run(main())
