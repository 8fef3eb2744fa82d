"""The embedded stack behind ``splitserve up``: NATS plus every service, each a separate OS process.

The supervisor starts nats-server (unless given a URL), then the router replicas (``routers``: router-0 ..
router-{N-1}, each its own process sharing the durable queue), the cache-index service, the prefill and
decode workers and the HTTP front doors (``frontends``: frontend-0 .. frontend-{N-1}, each its own process, all
accepting from one listening socket the supervisor binds once and holds: see :mod:`splitserve.listener`); waits
until each one's heartbeat says ``ready``; restarts a service that dies
(with exponential backoff, as an orchestrator would); and on SIGINT/SIGTERM stops them all, leaving no
process behind. Every child also gets PR_SET_PDEATHSIG so that even a SIGKILLed supervisor takes its
children down with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from splitserve import discovery
from splitserve.cpus import parse_cpus
from splitserve.listener import bind_listener
from splitserve.natsserver import NatsCluster, NatsServer, child_preexec, free_port, start_nats, start_nats_cluster
from splitserve.obs.log import ENV_LOG_FILE, QUIET_ENV, private_dir, private_opener
from splitserve.proto import Heartbeat, Subjects
from splitserve.runtime.bus import Bus
from splitserve.runtime.jetstream import CLUSTER_REPLICAS, ENV_REPLICAS
from splitserve.tenancy import consolekey, natsauth
from splitserve.tenancy.config import load_tenants
from splitserve.tenancy.natsauth import StackAuth

MODEL_NAME_MAX = 256  # a served model's name: as long as a request's ``model`` may be (proto.GenerateRequest)
# The sequences each decoder runs at once: the decode service's --max-batch default, which ``up`` leaves as it is.
DECODE_MAX_BATCH = 16
BUNDLED_MODEL = "bundled"  # the routers' PATH for the bundled SmolLM2 (``--model NAME=bundled``)


@dataclass(frozen=True)
class ModelPool:
    """One served model's workers. ``name`` is what clients ask for: the workers' ``--served-model-name`` (their
    heartbeats' model) and the routers' ``--model NAME=PATH``; ``model`` is the weights' path (a folder, a .gguf,
    a hub id in the local cache; None: the bundled SmolLM2)."""

    name: str
    model: str | None = None
    prefill: int = 1
    decode: int = 1
    # LoRA adapters its workers load at start: (name, PEFT folder) each (``--lora-modules NAME=PATH``)
    lora_modules: tuple[tuple[str, str], ...] = ()
    # Its own routing strategy and disaggregation threshold (None: the stack's --strategy / --disagg-threshold)
    strategy: str | None = None
    disagg_threshold: int | None = None

    def check(self) -> None:
        """ValueError naming what is wrong with this pool."""
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("a model pool needs a non-empty name")
        if len(self.name) > MODEL_NAME_MAX:
            raise ValueError(f"model name {self.name[:40]!r}... is longer than {MODEL_NAME_MAX} characters")
        if self.name != self.name.strip():  # the routers strip what they read: the workers' name would differ
            raise ValueError(f"model name {self.name!r} starts or ends with white space")
        if "=" in self.name:  # the routers read --model NAME=PATH up to the first '='
            raise ValueError(f"model name {self.name!r} holds '=' (names may not)")
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError(f"model {self.name!r}: model must be a path (or left out: the bundled model)")
        if isinstance(self.prefill, bool) or not isinstance(self.prefill, int) or self.prefill < 0:
            raise ValueError(f"model {self.name!r}: prefill must be a whole number >= 0, not {self.prefill!r}")
        if isinstance(self.decode, bool) or not isinstance(self.decode, int) or self.decode < 1:
            raise ValueError(f"model {self.name!r}: decode must be a whole number >= 1, not {self.decode!r}")
        if self.strategy is not None:
            from splitserve.routing.registry import available

            if self.strategy not in available():
                raise ValueError(f"model {self.name!r}: unknown routing strategy {self.strategy!r}; available: "
                                 f"{', '.join(available())}")
        dt = self.disagg_threshold
        if dt is not None and (isinstance(dt, bool) or not isinstance(dt, int) or dt < 0):
            raise ValueError(f"model {self.name!r}: disagg_threshold must be a whole number >= 0, not {dt!r}")
        names = [n for n, _ in self.lora_modules]
        if len(set(names)) != len(names) or self.name in names:
            raise ValueError(f"model {self.name!r}: LoRA adapter names must be unique and not the model's name")


def check_pools(pools: list[ModelPool]) -> None:
    """ValueError unless every pool is valid and no two share a name."""
    if not pools:
        raise ValueError("models: list at least one model")
    seen: set[str] = set()
    for pool in pools:
        pool.check()
        for name in (pool.name, *(n for n, _ in pool.lora_modules)):
            if name in seen:  # a request names a model or an adapter by one name: it must say which
                raise ValueError(f"model or adapter name {name!r} is listed twice (names must be unique)")
            seen.add(name)


# A config's `models:` list: one pool of workers per served model (splitserve.stack.ModelPool).
MODEL_POOL_KEYS = ("name", "model", "prefill", "decode", "lora_modules", "strategy", "disagg_threshold")


def lora_pairs(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    """LoRA adapters as a config gives them: a mapping NAME: PATH, or a list of NAME=PATH (or [NAME, PATH])."""
    from splitserve.engines.model_files import parse_lora_modules

    if isinstance(value, dict):
        items = [f"{k}={v}" for k, v in value.items()]
    elif isinstance(value, list):
        items = ["=".join(map(str, x)) if isinstance(x, list) else str(x) for x in value]
    else:
        raise ValueError(f"{where}: lora_modules must be a mapping of NAME: PATH")
    try:
        return parse_lora_modules(items)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def parse_model_pools(data: Any) -> list[ModelPool]:
    """The ``models:`` list of an up config as ModelPools; ValueError naming the item and key at fault."""
    if not isinstance(data, list) or not data:
        raise ValueError("models: must be a non-empty list of {name, model, prefill, decode} mappings")
    pools = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"models[{i}] must be a mapping with keys {', '.join(MODEL_POOL_KEYS)}")
        fields: dict[str, Any] = {}
        for key, v in item.items():
            k = str(key).replace("-", "_")
            if k not in MODEL_POOL_KEYS:
                raise ValueError(f"models[{i}]: unknown key {key!r}; the keys are {', '.join(MODEL_POOL_KEYS)}")
            fields[k] = v
        if "name" not in fields:
            raise ValueError(f"models[{i}] needs a name")
        if not isinstance(fields["name"], str):
            raise ValueError(f"models[{i}]: name must be a string (quote it), not {fields['name']!r}")
        if fields.get("model") is not None and not isinstance(fields["model"], str):
            raise ValueError(f"models[{i}] ({fields['name']}): model must be a path string, not {fields['model']!r}")
        if "lora_modules" in fields:
            fields["lora_modules"] = lora_pairs(fields["lora_modules"], f"models[{i}] ({fields['name']})")
        pool = ModelPool(**fields)
        try:
            pool.check()
        except ValueError as exc:
            raise ValueError(f"models[{i}]: {exc}") from None
        pools.append(pool)
    check_pools(pools)
    return pools


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
    # > 1: a JetStream cluster of this many nats-servers on loopback (client ports from nats_port up), every
    # stream R3 when >= 3 (splitserve.runtime.jetstream); services get every node's URL and fail over.
    nats_cluster: int = 0
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
    max_migrations: int = 2  # the routers' --max-migrations
    stream_interval: int = 1  # the decoders' --stream-interval (tokens per stream delta)
    slo_admission: bool = False  # the routers' --slo-admission
    max_loras: int = 0  # the workers' --max-loras (0: every adapter loaded at start)
    lora_affinity: bool = True  # the routers' --lora-affinity
    http_port: int = 8000  # the OpenAI-compatible front door; 0 (or taken) = a free port
    # Front door processes (frontend-0 ..) on that one port: while one drains or restarts the others accept.
    frontends: int = 2
    whatif_traces: Path | None = None  # the front doors' --whatif-traces (the console's what-if)
    http_host: str = "127.0.0.1"  # the front door's interface (0.0.0.0: every interface)
    log_level: str = "INFO"
    kv_connector: str = "nixl"  # --engine vllm: vLLM's KV connector between the pools (nixl | lmcache)
    kv_backend: str = "UCX"  # --engine vllm: NIXL backend (UCX | LIBFABRIC)
    # Tenants file (splitserve.tenancy.config): NATS users and permissions per tenant and per service.
    tenants_file: Path | None = None
    # Several served models, one pool of workers each (the first is the routers' default model). Empty: one pool
    # of ``prefill`` + ``decode`` workers serving ``model`` under the engine's own name (no --served-model-name).
    # Given: ``model`` is unused, and ``prefill``/``decode`` become the pools' totals (the cores are shared
    # between all pools' workers of a role, as within one pool).
    models: list[ModelPool] = field(default_factory=list)
    # The one pool's LoRA adapters (up --lora-modules; with ``models`` each pool has its own)
    lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.models:
            return
        check_pools(self.models)
        if self.colocated:  # no prefill pool for any model
            self.models = [replace(p, prefill=0) for p in self.models]
        self.prefill = sum(p.prefill for p in self.models)
        self.decode = sum(p.decode for p in self.models)

    def worker_pools(self) -> list[ModelPool]:
        """Every pool of workers: the configured models, else the one pool of the flags (named "": it passes no
        --served-model-name)."""
        return list(self.models) or [ModelPool("", self.model, self.prefill, self.decode, self.lora_modules)]

    def capacity(self) -> tuple[int, float | None]:
        """The decode slots and prefill tokens per second the stack's workers will have, for checking the tenants'
        contract guarantees at start: slots are the decoders' batch (``DECODE_MAX_BATCH`` each, long-context ones
        included); the prefill rate is known ahead only for the mock engine (its configured speed per prefiller),
        else None (the routers check it once the prefillers have measured theirs)."""
        slots = (self.decode + self.long_decode) * DECODE_MAX_BATCH
        rate = None
        if self.engine == "mock":
            from splitserve.engines.mock import DEFAULT_PREFILL_TPS, PREFILL_TPS_ENV

            rate = self.prefill * float(os.environ.get(PREFILL_TPS_ENV) or DEFAULT_PREFILL_TPS)
        return slots, rate

    def router_model_policies(self) -> list[str]:
        """The routers' per-model settings: ``--model-strategy NAME=S`` / ``--model-disagg-threshold NAME=N`` for
        each pool that sets its own (colocated: no threshold, every prompt stays on its decoder)."""
        out = []
        for p in self.models:
            if p.strategy is not None:
                out += ["--model-strategy", f"{p.name}={p.strategy}"]
            if p.disagg_threshold is not None and not self.colocated:
                out += ["--model-disagg-threshold", f"{p.name}={p.disagg_threshold}"]
        return out

    def router_models(self) -> list[str]:
        """The routers' --model values: ``NAME=PATH`` per pool in order (PATH ``bundled`` for the bundled
        model); without pools the --model path as before, if any."""
        if not self.models:
            return [self.model] if self.model else []
        return [f"{p.name}={p.model or BUNDLED_MODEL}" for p in self.models]


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
    env: dict[str, str] = field(default_factory=dict)  # this child's own variables
    crashes: int = 0  # crashes in a row (exits other than clean ones, each within a minute of its start)
    pass_fds: tuple[int, ...] = ()  # descriptors it inherits (the front doors: the API's listening socket)
    pump: threading.Thread | None = None  # copies its output into its log (log_pump)
    model: str | None = None  # a worker of a model pool: the pool's served name (StackConfig.models)

    def drain_log(self, timeout: float = 2.0) -> None:
        """Wait until everything the (exited) process wrote is in its log file."""
        if self.pump is not None:
            self.pump.join(timeout)


class Stack:
    def __init__(self, cfg: StackConfig, echo: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.echo = echo
        self.nats: NatsServer | None = None
        self.nats_cluster: NatsCluster | None = None
        self.nats_url = cfg.nats_url or ""
        self.http_url = ""
        self.metrics_url = ""  # frontend-0's /metrics (its own port, loopback: it names every tenant)
        self.metrics_urls: list[str] = []  # every front door's, in order (each serves the same cluster series)
        # The API's listening socket: bound once, held for the stack's life, inherited by every front door.
        self.http_sock: socket.socket | None = None
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
        if c.engine == "vllm":
            eng += ["--kv-connector", c.kv_connector, "--kv-backend", c.kv_backend]
        tenants = ["--tenants", str(c.tenants_file)] if c.tenants_file else []
        pools = self.pools
        counts = {"prefill": c.prefill, "decode": c.decode, "long": c.long_decode}

        def model_args(pool: ModelPool) -> list[str]:
            return [*(["--model", pool.model] if pool.model else []),
                    *(["--served-model-name", pool.name] if pool.name else []),
                    *(a for name, path in pool.lora_modules for a in ("--lora-modules", f"{name}={path}")),
                    *(["--max-loras", str(c.max_loras)] if c.max_loras and pool.lora_modules else [])]

        def worker_args(role: str, i: int, pool: ModelPool) -> list[str]:
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
            args = [*eng, *model_args(pool), "--threads", str(threads), "--cache-tokens", str(c.cache_tokens),
                    "--l1-tokens", str(c.l1_tokens)]
            if role != "prefill" and c.stream_interval != 1:
                args += ["--stream-interval", str(c.stream_interval)]
            return args + (["--cpus", ",".join(map(str, cores))] if cores else [])

        # Colocated: there is nowhere else to send a prompt, so no stall limit (decoders chunk instead).
        router_extra = ["--max-stall-ms", "0" if c.colocated else str(c.max_stall_ms),
                        "--long-prompt-tokens", str(c.long_prompt_tokens), "--max-migrations", str(c.max_migrations),
                        *([] if c.lora_affinity else ["--no-lora-affinity"]),
                        *(["--slo-admission"] if c.slo_admission else [])]
        out = [Child(f"router-{i}", "router", py + ["splitserve.services.router", "--worker-id", f"router-{i}",
                                                    "--strategy",
                                                    c.strategy, "--disagg-threshold",
                                                    str(10**9 if c.colocated else c.disagg_threshold), *router_extra,
                                                    *(a for m in c.router_models() for a in ("--model", m)),
                                                    *c.router_model_policies(),
                                                    *tenants,
                                                    *common],
                     self.logs / f"router-{i}.log") for i in range(max(1, c.routers))]
        out += [Child("cache-index-0", "cache_index", py + ["splitserve.services.cache_index", "--worker-id",
                                                            "cache-index-0",
                                                           *common], self.logs / "cache-index-0.log")]
        # Worker ids are numbered across the model pools (prefill-0, prefill-1, ... in the pools' order): one
        # pool's are those of a stack without pools, and no model name has to fit a subject token.
        model_pools = c.worker_pools()
        for role, module in (("prefill", "splitserve.services.prefill"), ("decode", "splitserve.services.decode")):
            i = 0
            for pool in model_pools:
                for _ in range(pool.prefill if role == "prefill" else pool.decode):
                    name = f"{role}-{i}"
                    out.append(Child(name, role, py + [module, "--worker-id", name, *worker_args(role, i, pool),
                                                       *common],
                                     self.logs / f"{name}.log", model=pool.name or None))
                    i += 1
        # long-context decoders serve the default (first) model
        for i in range(c.long_decode):
            name = f"decode-long-{i}"
            out.append(Child(name, "decode", py + ["splitserve.services.decode", "--worker-id", name, "--pool", "long",
                                                   *worker_args("long", i, model_pools[0]), *common],
                             self.logs / f"{name}.log", model=model_pools[0].name or None))
        # The API's socket is bound here, once, and held by this process: every front door accepts from it (one
        # accept queue), so while one drains or restarts the others take every connection, and with all of them
        # down at once connections wait in the queue instead of being refused. A restarted front door comes back
        # at the URL already printed.
        if self.http_sock is None:
            self.http_sock = _listen(c.http_host, c.http_port)
        fd = self.http_sock.fileno()
        port = int(self.http_sock.getsockname()[1])
        shown = "127.0.0.1" if c.http_host in ("0.0.0.0", "") else \
            "[::1]" if c.http_host == "::" else f"[{c.http_host}]" if ":" in c.http_host else c.http_host
        self.http_url = f"http://{shown}:{port}"
        self.metrics_urls = []
        for i in range(max(1, c.frontends)):
            name = f"frontend-{i}"
            # each its own metrics port (its http_* series are its own), fixed here: a restart keeps it
            metrics_port = free_port(host="127.0.0.1")
            self.metrics_urls.append(f"http://127.0.0.1:{metrics_port}/metrics")
            out.append(Child(name, "frontend", py + ["splitserve.services.frontend", "--worker-id", name, "--host",
                                                     c.http_host,
                                                     "--port", str(port), "--listen-fd", str(fd), *tenants,
                                                     "--metrics-port", str(metrics_port),
                                                     *(["--whatif-traces", str(c.whatif_traces)]
                                                       if c.whatif_traces else []), *common],
                             self.logs / f"{name}.log", pass_fds=(fd,)))
        self.metrics_url = self.metrics_urls[0]
        if c.engine == "vllm":
            # vLLM's own vllm:* series, one port per worker (fixed here: a restart keeps it)
            for ch in out:
                if ch.role in ("prefill", "decode"):
                    port = free_port()
                    ch.env["SPLITSERVE_VLLM_METRICS_PORT"] = str(port)
                    self.echo(f"  {ch.name:<15} vLLM metrics at http://127.0.0.1:{port}/metrics")
        return out

    def _cpu_pools(self) -> dict[str, list[int]]:
        """Disjoint core sets for the prefill and decode pools (the CPU analogue of separate GPU pools). The mock
        engine computes nothing (it sleeps), so it gets pools only when they are asked for: pinned by default, a
        mock stack's control plane and decoders' event loops shared half the machine while the other half idled
        (``bench.peers`` at c=32 on 2 cores: 94 req/s pinned, 144 on every core)."""
        c = self.cfg
        if c.engine == "mock" and not (c.prefill_cpus or c.decode_cpus or c.long_decode_cpus):
            return {}
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
        private_dir(ch.log.parent)
        # The child appends its JSON log lines to its log itself (ENV_LOG_FILE); what else reaches its stdout
        # or stderr (a native library's output, a crash's dump) is copied in by log_pump, every line JSON.
        # JSON logs only: progress bars off and library verbosity routed through logging from the start
        env = {**QUIET_ENV, **os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1"}
        env.update(ch.env)
        env[ENV_LOG_FILE] = str(ch.log)
        if self.nats_cluster is not None:
            # Every stream, bucket and object store as many copies as the cluster allows (R3 from 3 nodes),
            # decided here once rather than by each service from the nodes alive when it connects.
            n = len(self.nats_cluster.nodes)
            env[ENV_REPLICAS] = str(CLUSTER_REPLICAS if n >= CLUSTER_REPLICAS else 1)
        if self.auth is not None:
            # Each service authenticates as its role's user; the environment (not argv, which any local
            # user can read in ps) carries the password. A tenant's own variables must not leak in.
            env.pop(natsauth.ENV_NKEY_SEED, None)
            env[natsauth.ENV_USER], env[natsauth.ENV_PASSWORD] = self.auth.credentials(ch.role)
            if ch.role == "frontend":  # the web console's admin key (see splitserve.tenancy.consolekey)
                env[consolekey.ADMIN_KEYS_ENV] = consolekey.ensure_console_key(self.cfg.state_dir)
        ch.proc = subprocess.Popen(ch.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                   preexec_fn=child_preexec, pass_fds=ch.pass_fds)
        assert ch.proc.stdout is not None
        ch.pump = threading.Thread(target=log_pump, args=(ch.proc.stdout, ch.log, ch.name), daemon=True,
                                   name=f"log-{ch.name}")
        ch.pump.start()
        ch.ready = False
        ch.started_at = time.monotonic()

    async def run(self, on_ready: Callable[[Stack], None] | None = None) -> int:
        c = self.cfg
        # Owner-only, also when left by an older version: logs hold tenants' names, request ids, errors.
        private_dir(c.state_dir)
        private_dir(self.logs)
        auth_conf = ""
        if c.tenants_file is not None:
            self.auth = natsauth.prepare_stack_auth(c.state_dir, load_tenants(c.tenants_file))
            auth_conf = self.auth.config
            assert self.auth.auth_dir is not None
            conf_path = self.auth.auth_dir / "nats-auth.conf"
            natsauth.write_private(conf_path, auth_conf)
            self.echo(f"  {'auth':<15} {len(self.auth.service_secrets)} service users + tenants from "
                      f"{c.tenants_file}; secrets under {self.auth.auth_dir} (mode 0600)")
            self.echo(f"  {'auth':<15} web console admin key: "
                      f"{consolekey.key_path(c.state_dir)} (tenants' API keys see their own tenant only)")
            consolekey.ensure_console_key(c.state_dir)
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
        admin = self.auth.credentials(natsauth.ADMIN_ROLE) if self.auth else (None, None)
        if not self.nats_url and c.nats_cluster > 1:
            ports = [c.nats_port + i for i in range(c.nats_cluster)] if c.nats_port else None
            self.nats_cluster = await asyncio.to_thread(
                start_nats_cluster, c.state_dir / "nats-cluster", c.nats_cluster, ports=ports,
                log_dir=self.logs, extra_config=auth_conf, user=admin[0], password=admin[1])
            self.nats_url = self.nats_cluster.url
            for name, node in zip(self.nats_cluster.names, self.nats_cluster.nodes, strict=True):
                self.echo(f"  {'nats ' + name:<15} ready  {node.url}  (pid {node.proc.pid})")
            self.echo(f"  {'nats cluster':<15} {c.nats_cluster} nodes, JetStream streams "
                      f"R{CLUSTER_REPLICAS if c.nats_cluster >= CLUSTER_REPLICAS else 1}; configs under "
                      f"{c.state_dir / 'nats-cluster'}")
        elif not self.nats_url:
            self.nats = await asyncio.to_thread(start_nats, c.state_dir / "nats", port=c.nats_port,
                                                log_file=self.logs / "nats.log", extra_config=auth_conf)
            self.nats_url = self.nats.url
            self.echo(f"  {'nats':<15} ready  {self.nats_url}  (pid {self.nats.proc.pid})")
        bus = await Bus.connect(self.nats_url, "supervisor", user=admin[0], password=admin[1])
        try:
            try:
                self.children = self._children()
            except OSError as exc:  # the API's socket (e.g. --host names no interface of this machine)
                self.echo(f"  {'frontend':<15} FAILED to start: {exc}")
                return 1
            for pool in c.models:
                workers = ", ".join(ch.name for ch in self.children if ch.model == pool.name)
                self.echo(f"  {'model ' + pool.name:<15} {pool.model or BUNDLED_MODEL}: {workers}")
            sub = await bus.nc.subscribe(Subjects.HEARTBEAT_ALL, cb=self._on_hb)
            t0 = time.monotonic()
            for ch in self.children:
                self._spawn(ch)
            rc = await self._wait_ready(t0)
            if rc != 0:
                return rc
            # No secret goes here (the file is readable by anyone who can read the home directory): operator
            # commands find the admin credentials under state_dir/auth, readable by the stack's owner only.
            discovery.write_stack({"pid": os.getpid(), "nats_url": self.nats_url,
                                   "nats_urls": discovery.server_list(self.nats_url), "state_dir": str(c.state_dir),
                                   "auth": self.auth is not None, "services": [ch.name for ch in self.children],
                                   "http_url": self.http_url, "metrics_url": self.metrics_url,
                                   "metrics_urls": self.metrics_urls})
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
            if self.nats_cluster:
                self.nats_cluster.stop()
            if self.http_sock is not None:
                self.http_sock.close()  # after every front door: until then connections wait, none is refused
            discovery.clear_stack(os.getpid())

    async def _on_hb(self, raw: object) -> None:
        from splitserve import proto

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
                    ch.drain_log()
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
                    # A clean exit (a drain after SIGTERM: a rolling restart, an operator) is no crash: back at
                    # once. Only crashes back off, and a child that ran a while is not in a crash loop.
                    clean = ch.proc.returncode == 0
                    if not clean:
                        ch.crashes = 0 if now - ch.started_at > 60 else ch.crashes + 1
                    backoff = 0.5 if clean else min(30.0, 0.5 * (2 ** min(max(0, ch.crashes - 1), 6)))
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
        for ch in self.children:
            ch.drain_log()

    def request_stop(self) -> None:
        self.stopping.set()


def log_pump(src: IO[bytes], log: Path, service: str) -> None:
    """Copy a child's output into its log, one JSON object per line. The services log JSON themselves (Python
    logging included); what a native library writes straight to the file descriptor (a C++ extension's leak
    report at exit, UCX, a fatal signal's dump) is wrapped here, so every line of every log parses."""
    read = getattr(src, "read1", None) or src.read
    with open(log, "ab", buffering=0, opener=private_opener) as out:
        # Whatever the pipe holds is copied in one write (a burst of lines, one system call); a line split across
        # reads waits in ``rest`` for its end, kept as pieces (joined once: a long line costs its length, not its
        # length times the number of reads).
        rest: list[bytes] = []
        while chunk := read(1 << 16):
            lines = chunk.split(b"\n")
            if len(lines) == 1:
                rest.append(chunk)
                continue
            lines[0] = b"".join([*rest, lines[0]])
            tail = lines.pop()
            rest = [tail] if tail else []
            out.write(b"".join(json_line(raw, service) for raw in lines))
        if rest:
            out.write(json_line(b"".join(rest), service))


def json_line(raw: bytes, service: str) -> bytes:
    text = raw.rstrip(b"\r\n")
    if text.startswith(b"{"):
        try:
            if isinstance(json.loads(text), dict):
                return text + b"\n"
        except ValueError:
            pass
    event = {"event": text.decode("utf-8", errors="replace"), "level": "warning", "logger": "stderr",
             "service": service, "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
             "note": "raw output of the process, not a log record"}
    return json.dumps(event, ensure_ascii=False).encode() + b"\n"


def _listen(host: str, port: int) -> socket.socket:
    """The API's listening socket: on ``port`` when it is free, else (or for 0) on a free one."""
    if port:
        try:
            return bind_listener(host, port)
        except OSError:
            pass  # taken: a free one, printed at start, as documented
    for _ in range(2):  # a free port taken between the pick and the bind: pick again
        with contextlib.suppress(OSError):
            return bind_listener(host, free_port(host=host))
    return bind_listener(host, free_port(host=host))


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
