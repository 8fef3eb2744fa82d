"""The front-door process: one NATS connection (shared by the service lifecycle and the request client),
the worker registry behind ``/readyz``, and the embedded uvicorn server.

It is a :class:`splitserve.runtime.service.Service` like every other process, so ``splitserve up`` sees its
heartbeats (role ``frontend``), waits for it to be ready (= serving), restarts it if it dies, and stops it
with SIGTERM (which drains in-flight HTTP requests for a bounded time). It keeps no state a restart loses.

``splitserve up`` runs several (``--frontends``) on one listening socket it holds itself (``--listen-fd``, see
:mod:`splitserve.listener`), so that a front door draining or restarting never refuses a connection. A front door
takes requests only once its worker registry has filled (a decoder seen, or ``registry_warmup_s`` of heartbeats):
just started, it would otherwise not know the served model and answer 404 for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from nats.aio.msg import Msg

from splitserve import errors
from splitserve.client import Client
from splitserve.listener import bind_listener, inherited_listener
from splitserve.obs.metrics import ClusterMetrics
from splitserve.proto import Heartbeat, RequestFinished, Subjects, WorkerLoad
from splitserve.runtime.registry import WorkerRegistry
from splitserve.runtime.service import Service
from splitserve.services.frontend import console
from splitserve.services.frontend import openai_api as oa
from splitserve.services.frontend.app import PER_KEY_CONCURRENCY, Stream, create_app, create_metrics_app
from splitserve.services.frontend.console_data import ConsoleData
from splitserve.services.frontend.guard import HEADER_TIMEOUT_S, exposure_warning, guarded_httptools
from splitserve.services.frontend.whatif import WHATIF_TIMEOUT_S, WhatIfRunner
from splitserve.tenancy.config import TenantsConfig

# The metrics port of `python -m splitserve.services.frontend` (OpenTelemetry's Prometheus exporter's port).
METRICS_PORT = 9464
# Connections (streams included) one front door serves at once; beyond it uvicorn answers 503 at once.
LIMIT_CONCURRENCY = 1024
# Idle time a kept-alive connection is held between requests: long enough for clients' pools to reuse it,
# short enough that idle sockets do not pile up against LIMIT_CONCURRENCY.
KEEP_ALIVE_S = 30
# How long a just-started front door listens to heartbeats before it takes requests when no decoder has been
# heard yet: two of the workers' default heartbeat intervals (0.5 s), so every live worker has been heard.
REGISTRY_WARMUP_S = 1.0


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside a Service: signals belong to ``run_service`` (which drains the whole service), not to
    uvicorn, which would otherwise replace the service's handlers with its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class FrontendService(Service):
    role = "frontend"

    def __init__(
        self,
        worker_id: str,
        nats_url: str,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        listen_fd: int | None = None,
        model_name: str | None = None,
        api_keys: dict[str, str] | None = None,
        admin_keys: list[str] | None = None,
        tenants: TenantsConfig | None = None,
        graceful_s: int = 5,
        accept_timeout_s: float = 30.0,
        idle_timeout_s: float = 120.0,
        docs: bool = False,
        metrics_host: str = "127.0.0.1",
        metrics_port: int | None = 0,
        limit_concurrency: int = LIMIT_CONCURRENCY,
        per_key_concurrency: int = PER_KEY_CONCURRENCY,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        keep_alive_s: int = KEEP_ALIVE_S,
        registry_warmup_s: float = REGISTRY_WARMUP_S,
        whatif_traces: Path | None = None,
        whatif_timeout_s: float = WHATIF_TIMEOUT_S,
        **kw: Any,
    ) -> None:
        super().__init__(worker_id, nats_url, **kw)
        self.host = host
        self.port = port
        # A listening socket passed down by the supervisor (shared with the other front doors): used instead of
        # binding host:port (which then only name it).
        self.listen_fd = listen_fd
        self.registry_warmup_s = registry_warmup_s
        self._listening_since: float | None = None  # monotonic time the heartbeat subscription began
        self._model_name = model_name
        self.api_keys = api_keys
        self.graceful_s = graceful_s
        self.accept_timeout_s = accept_timeout_s
        self.idle_timeout_s = idle_timeout_s
        # /metrics names every tenant: served on its own port (None: not at all), loopback unless told otherwise.
        self.metrics_host = metrics_host
        self.metrics_port = metrics_port
        self.limit_concurrency = limit_concurrency
        self.header_timeout_s = header_timeout_s
        self.keep_alive_s = keep_alive_s
        self.registry = WorkerRegistry()
        self.tenants = tenants  # whose contract names which models (/v1/models lists only a tenant's own)
        self.app = create_app(self, api_keys=api_keys, docs=docs, per_key_concurrency=per_key_concurrency)
        self.metrics_app = create_metrics_app(self, self.app)
        self.url = ""
        self.metrics_url = ""  # http://host:port/metrics once listening ("" when there is no metrics port)
        self.cancel_requests: list[str] = []  # what cancel_request was asked for (until the lead wires it)
        self._server: _EmbeddedServer | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._metrics_server: _EmbeddedServer | None = None
        self._metrics_task: asyncio.Task[None] | None = None
        self._client: Client | None = None
        self.cluster_metrics = ClusterMetrics()  # gathered here: every request's end and every heartbeat
        # The web console (/console): the same figures, drawn; its own keys (admin) besides the tenants' keys.
        self.console = ConsoleData(self.cluster_metrics, lambda: self.bus.nc if self.bus is not None else None,
                                   tenants=tenants)
        # The console's what-if panel: the simulator on this tenants file, in a child process (one at a time).
        self.whatif = WhatIfRunner(tenants=tenants, traces_dir=whatif_traces, timeout_s=whatif_timeout_s)
        console.install(self.app, self.console, console.ConsoleAuth(api_keys, admin_keys or []), self.whatif)

    # --- lifecycle ----------------------------------------------------------------------------------
    async def setup(self) -> None:
        self._client = Client(self.nats_url, bus=self.b, accept_timeout=self.accept_timeout_s,
                              idle_timeout=self.idle_timeout_s)

    async def start(self) -> None:
        await self.b.subscribe(Subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        self._listening_since = time.monotonic()
        # Every request's end, twice over: each front door keeps the cluster's recent rates (the console) from all
        # of them, and counts the metrics of its share (a queue group: summed over the front doors, each request
        # is counted once, and the counting, most of the work, is not done once per front door).
        await self.b.subscribe(Subjects.FINISHED_ALL, RequestFinished, self.on_finished, scoped=True)
        await self.b.subscribe(Subjects.FINISHED_ALL, RequestFinished, self.on_finished_counted, scoped=True,
                               queue=Subjects.FINISHED_COUNTERS_QUEUE)
        self.b.spawn(self.console.run_sampler())
        warning = exposure_warning(self.host, self.api_keys)
        if warning is not None:
            # Loud on purpose: in the log (error level, so it survives --log-level warning) and on stderr.
            self.log.error("open_front_door_beyond_loopback", host=self.host, warning=warning)
            print(warning, file=sys.stderr, flush=True)
        # Bind here rather than in uvicorn: a taken port is then an exception with a clear message (uvicorn
        # would sys.exit), and port 0 tells us the real port before we announce ready.
        sock = inherited_listener(self.listen_fd) if self.listen_fd is not None else self._bind(self.host, self.port)
        self.port = int(sock.getsockname()[1])
        self.url = f"http://{self.host}:{self.port}"
        # Listening already (connections wait in the accept queue, none is refused), but taking none before the
        # registry has filled: a request answered now could get a 404 for the very model the decoders serve.
        await self.registry_filled()
        # httptools (a dependency): the C HTTP parser, not "auto" (which falls back to h11 silently), with a
        # deadline on reading each request's headers (slowloris); limit_concurrency answers 503 beyond it.
        cfg = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off",
                             http=guarded_httptools(self.header_timeout_s),
                             timeout_graceful_shutdown=self.graceful_s, timeout_keep_alive=self.keep_alive_s,
                             limit_concurrency=self.limit_concurrency or None)
        self._server, self._serve_task = await self._serve(cfg, sock)
        if self.metrics_port is not None:
            try:
                msock = self._bind(self.metrics_host, self.metrics_port)
            except OSError as exc:
                # Never stop for metrics: serve them on a free port and say which (as the vLLM workers do).
                msock = self._bind(self.metrics_host, 0)
                self.log.warning("metrics_port_taken", wanted=self.metrics_port, error=str(exc),
                                 port=int(msock.getsockname()[1]))
            self.metrics_port = int(msock.getsockname()[1])
            self.metrics_url = f"http://{self.metrics_host}:{self.metrics_port}/metrics"
            mcfg = uvicorn.Config(self.metrics_app, log_config=None, access_log=False, lifespan="off",
                                  http=guarded_httptools(self.header_timeout_s), timeout_graceful_shutdown=1,
                                  timeout_keep_alive=self.keep_alive_s, limit_concurrency=64)
            self._metrics_server, self._metrics_task = await self._serve(mcfg, msock)
        self.log.info("http_listening", url=self.url, openai_base_url=f"{self.url}/v1",
                      auth="api-keys" if self.api_keys else "none", metrics_url=self.metrics_url or None)

    @staticmethod
    def _bind(host: str, port: int) -> socket.socket:
        return bind_listener(host, port)

    @staticmethod
    async def _serve(cfg: uvicorn.Config, sock: socket.socket) -> tuple[_EmbeddedServer, asyncio.Task[None]]:
        server = _EmbeddedServer(cfg)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("the HTTP server stopped during startup")
            await asyncio.sleep(0.02)
        return server, task

    async def drain(self) -> None:
        # Stop accepting connections (on a listening socket shared with other front doors, this process's
        # descriptor only: the socket and its queue stay, the others accept); open requests (streams included)
        # run to their end within the bound, a connection accepted but not yet read gets its request answered.
        if self._server is None or self._serve_task is None:
            return
        self._server.config.timeout_graceful_shutdown = max(self.graceful_s, int(self.drain_timeout_s))
        self._server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.shield(self._serve_task)
        await self._stop_metrics()

    async def shutdown(self) -> None:
        if self._server is None or self._serve_task is None:
            return
        # Stop accepting, let in-flight requests finish (uvicorn cancels them after graceful_s).
        self._server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(self._serve_task, timeout=self.graceful_s + 5)
        await self._stop_metrics()

    async def _stop_metrics(self) -> None:
        # Last: a scrape during the drain still sees the final numbers.
        if self._metrics_server is None or self._metrics_task is None:
            return
        self._metrics_server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(self._metrics_task, timeout=5)

    def load(self) -> WorkerLoad:
        return WorkerLoad(active_seqs=len(self.app.state.inflight))

    def active_requests(self) -> list[str]:
        return list(self.app.state.inflight)

    async def on_heartbeat(self, hb: Heartbeat, _: Msg) -> None:
        now = time.monotonic()
        self.registry.observe(hb, now)
        self.cluster_metrics.on_heartbeat(hb, now)

    async def on_finished(self, ev: RequestFinished, _: Msg) -> None:
        self.cluster_metrics.see_finished(ev)

    async def on_finished_counted(self, ev: RequestFinished, _: Msg) -> None:
        self.cluster_metrics.count_finished(ev)

    def metrics(self) -> bytes:
        return self.cluster_metrics.exposition()

    # --- Backend (what the HTTP layer calls) --------------------------------------------------------
    def _decoder_models(self) -> dict[str, int | None]:
        """Every model a live decoder announces -> the smallest max_model_len announced for it: the routers'
        default model first (the one their heartbeats name, when a decoder serves it), then the others sorted by
        name, so every front door and every router agree on the default."""
        lens: dict[str, int | None] = {}
        now = time.monotonic()
        for hb in self.registry.live("decode", now):
            if not hb.model:
                continue
            known = lens.get(hb.model)
            if hb.max_model_len:
                lens[hb.model] = hb.max_model_len if known is None else min(known, hb.max_model_len)
            else:
                lens.setdefault(hb.model, None)
        defaults = {hb.model for hb in self.registry.live("router", now) if hb.model in lens}
        first = [min(defaults)] if defaults else []  # (routers disagree only mid-rollout: any one, the same everywhere)
        return {name: lens[name] for name in first + sorted(set(lens) - set(first))}

    def _decoder_model(self) -> str | None:
        return next(iter(self._decoder_models()), None)

    def registry_warm(self) -> bool:
        """Whether the registry shows the cluster as it is: a decoder has been heard, or the heartbeats have been
        listened to for ``registry_warmup_s`` (every live worker beats within it)."""
        if self._model_name or self._decoder_model() is not None:
            return True
        since = self._listening_since
        return since is not None and time.monotonic() - since >= self.registry_warmup_s

    async def registry_filled(self) -> None:
        """Return once :meth:`registry_warm` (at most ``registry_warmup_s`` after the subscription began)."""
        while not self.registry_warm():
            await asyncio.sleep(0.02)

    @property
    def served_models(self) -> dict[str, int | None]:
        """The models known to be served -> their max_model_len: every model a live decoder announces (the
        smallest max_model_len announced for it), the routers' default first (a request's default when it names
        none), then sorted by name. With ``--model-name``: that one name (the smallest
        max_model_len of its decoders, or of all decoders when none announces that name). Empty while no
        decoder has been heard. The router's name (its tokenizer's) is not one: it may differ (the mock engine's
        "mock-" prefix), and a front door that has heard only the router must not 404 the real one."""
        announced = self._decoder_models()
        if not self._model_name:
            return announced
        own = announced.get(self._model_name)
        if own is None:
            lens = [n for n in announced.values() if n]
            own = min(lens) if lens else None
        return {self._model_name: own}

    @property
    def served_adapters(self) -> dict[str, str]:
        """The LoRA adapters live decoders have loaded -> their base model's served name, sorted by name."""
        out: dict[str, str] = {}
        for hb in self.registry.live("decode", time.monotonic()):
            if hb.model:
                for a in (*hb.adapters, *hb.adapters_available):
                    out.setdefault(a, hb.model)
        return dict(sorted(out.items()))

    @property
    def model_name(self) -> str | None:
        """The (first) served model's name; before a decoder is heard, the name the router announces."""
        served = self.served_models
        if served:
            return next(iter(served))
        # Learned from the workers: decoders name the model they serve; the router names its tokenizer's.
        for hb in self.registry.live("router", time.monotonic()):
            if hb.model:
                return hb.model
        return None

    @property
    def served_model_name(self) -> str | None:
        """The (first) model known to be served (configured, or announced by a live decoder)."""
        return next(iter(self.served_models), None)

    @property
    def max_model_len(self) -> int | None:
        """That of the (first) served model; of all live decoders when none is known."""
        served = self.served_models
        if served:
            return next(iter(served.values()))
        lens = [hb.max_model_len for hb in self.registry.live("decode", time.monotonic()) if hb.max_model_len]
        return min(lens) if lens else None

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        now = time.monotonic()
        routers = sorted(hb.worker_id for hb in self.registry.live("router", now))
        decoders = sorted(hb.worker_id for hb in self.registry.live("decode", now))
        prefillers = sorted(hb.worker_id for hb in self.registry.live("prefill", now))
        connected = self.bus is not None and self.bus.nc.is_connected
        missing = [what for what, ok in (("nats", connected), ("router", routers), ("decode", decoders)) if not ok]
        # "model": the first served model (the one field older probes read); "models": every one.
        return not missing, {"nats_connected": connected, "routers": routers, "decoders": decoders,
                             "prefillers": prefillers, "model": self.model_name, "models": list(self.served_models),
                             "missing": missing}

    def generate(self, args: oa.GenerateArgs, *, tenant: str, request_id: str) -> Stream:
        if self._client is None or self.bus is None or not self.bus.nc.is_connected:
            # While NATS reconnects a request would only wait out the accept timeout: say so at once.
            raise errors.Unavailable("the front door is not connected to NATS (reconnecting); retry shortly",
                                     request_id=request_id)
        kwargs = args.client_kwargs()  # the chosen model travels as GenerateRequest.model (routed by it)
        if self._model_name and kwargs.get("model") == self._model_name \
                and self._model_name not in self._decoder_models():
            # --model-name names the one model under a name of its own, which no decoder announces: the router
            # is asked for its default model instead of a name it would not know.
            del kwargs["model"]
        return self._client.generate(args.prompt, request_id=request_id, tenant=tenant, **kwargs)

    async def cancel_request(self, request_id: str) -> None:
        """Hook: the HTTP caller went away before its request ended.

        The front door has already stopped relaying and released the request's stream subscription. Stopping
        the work server-side needs the cancel message (a later issue); wire it here, e.g. publish a cancel
        for ``request_id`` on the router's cancel subject. Until then the request runs to its end unread.
        """
        self.cancel_requests.append(request_id)
        del self.cancel_requests[:-100]  # bounded: it is only for tests and debugging
        inflight = getattr(self.app.state, "inflight", {}).get(request_id)
        tenant = getattr(inflight, "tenant", None) if inflight is not None else None
        if isinstance(inflight, str):
            tenant = inflight
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.cancel(request_id, tenant=tenant, reason="the HTTP client disconnected")
        self.log.info("cancel_request", request_id=request_id, tenant=tenant, wired=True)
