"""The lifecycle every service process shares: connect, set up, announce, heartbeat, drain, stop.

A service subclasses :class:`Service`, fills in ``setup`` (load models, open transports), ``start``
(subscribe) and ``load`` (what its heartbeats report). :func:`run_service` runs it with SIGINT/SIGTERM
handling so a supervisor can stop it cleanly.

Graceful drain (SIGTERM/SIGINT): heartbeats say ``draining`` at once (routers stop sending it work: only
``ready`` workers are routed to), ``drain`` finishes what the service holds, bounded by ``drain_timeout_s``;
whatever is still held then is let go by ``hand_over`` without a terminal message, and the ``stopped``
heartbeat that follows tells the routers to move those requests elsewhere (request migration). A second
signal skips what is left of the drain. A service whose supervisor died (its parent changed) skips the drain at
once, and whatever a stop waits on, the process ends ``STOP_GRACE_S`` after the drain bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from splitserve.obs.log import configure_logging, get_logger
from splitserve.obs.tracing import flush_tracing, setup_tracing
from splitserve.proto import Heartbeat, Subjects, WorkerLoad
from splitserve.runtime.bus import Bus
from splitserve.tenancy import natsauth
from splitserve.tenancy.natsauth import ENV_NKEY_SEED, ENV_PASSWORD, ENV_USER

# After the first stop signal, the drain bound plus this, a service still running exits (os._exit) whatever it waits on
STOP_GRACE_S = 20.0
STOP_DEADLINE_EXIT = 3


class Service:
    role: str = "service"

    def __init__(self, worker_id: str, nats_url: str, *, heartbeat_s: float = 0.5, log_level: str = "INFO",
                 drain_timeout_s: float = 10.0) -> None:
        Subjects.heartbeat(self.role, worker_id)  # validates the id early
        self.worker_id = worker_id
        self.drain_timeout_s = drain_timeout_s
        self._stop_now = asyncio.Event()
        self.nats_url = nats_url
        self.heartbeat_s = heartbeat_s
        configure_logging(self.role, worker_id, log_level)
        self.log = get_logger(self.role)
        self.bus: Bus | None = None
        self._stop = asyncio.Event()
        self._state = "starting"
        self._hb_seq = 0
        self.started_at = time.time()
        self._parent = os.getppid()  # the supervisor (splitserve up), an init process, a shell: see request_stop
        self._deadline: threading.Timer | None = None

    # --- to override -----------------------------------------------------------------------------
    async def setup(self) -> None:
        """Heavy initialisation (models, transports). Heartbeats say 'starting' meanwhile."""

    async def start(self) -> None:
        """Subscribe to subjects."""

    async def drain(self) -> None:
        """Stop taking new work and return once nothing is held (bounded by ``drain_timeout_s`` by the caller).
        Heartbeats already say ``draining``."""

    async def hand_over(self) -> None:
        """The drain bound ran out: let go of what is still held, silently (no terminal message): the
        ``stopped`` heartbeat that follows makes the routers migrate it."""

    async def shutdown(self) -> None:
        """Release resources after the subscriptions are drained."""

    def load(self) -> WorkerLoad:
        return WorkerLoad()

    def active_requests(self) -> list[str]:
        return []

    def heartbeat_extra(self) -> dict[str, Any]:
        return {}

    # --- mechanism ---------------------------------------------------------------------------------
    _gc_started = 0.0

    def _gc_watch(self, phase: str, info: dict[str, Any]) -> None:
        """Log garbage-collector pauses long enough to show in a token stream (any thread may trigger one)."""
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        ms = (time.perf_counter() - self._gc_started) * 1000
        if ms >= 20.0:
            self.log.warning("gc_pause", ms=round(ms, 1), generation=info.get("generation"),
                             collected=info.get("collected"))

    @property
    def b(self) -> Bus:
        assert self.bus is not None, "service not connected"
        return self.bus

    def request_stop(self) -> None:
        if self._stop.is_set():
            self._stop_now.set()  # a second signal: stop draining
        elif os.getppid() != self._parent:
            # Orphaned: the supervisor died (its PR_SET_PDEATHSIG sent this SIGTERM; splitserve.natsserver.
            # child_preexec) and nobody waits for a drain, which could last the whole drain bound with NATS gone
            # too. Stop at once; a supervisor stopping its children is still there, and they drain.
            self.log.warning("supervisor_gone", parent_pid=self._parent)
            self._stop_now.set()
        self._stop.set()

    def arm_stop_deadline(self) -> None:
        """Whatever a stop waits on (a drain, a NATS server that is gone, a library's thread), the process ends
        within ``drain_timeout_s + STOP_GRACE_S`` from now: a service that cannot stop would hold its ports and its
        share of the machine for ever. Only for a service that owns its process (:func:`run_service`, at the first
        signal): one running inside a test's or a benchmark's process is never given it. Idempotent."""
        if self._deadline is not None:
            return
        limit = self.drain_timeout_s + STOP_GRACE_S

        def expire() -> None:
            with contextlib.suppress(Exception):
                self.log.error("stop_deadline_exceeded", seconds=limit)
            os._exit(STOP_DEADLINE_EXIT)

        self._deadline = threading.Timer(limit, expire)
        self._deadline.daemon = True
        self._deadline.start()

    @property
    def draining(self) -> bool:
        return self._state in ("draining", "stopped")

    async def _heartbeat(self) -> None:
        self._hb_seq += 1
        hb = Heartbeat(
            worker_id=self.worker_id,
            role=self.role,  # type: ignore[arg-type]
            seq=self._hb_seq,
            state=self._state,  # type: ignore[arg-type]
            interval_ms=self.heartbeat_s * 1000,
            pid=os.getpid(),
            load=self.load(),
            # Requests whose end is not yet stored durably still count as this worker's (see Bus.publish):
            # a router must not take them for lost and run them again.
            active_requests=list(dict.fromkeys([*self.active_requests(),
                                                *(self.bus.unconfirmed if self.bus else {})])),
            **self.heartbeat_extra(),
        )
        if self.bus is not None and self.bus.nc.is_connected:
            await self.bus.publish(Subjects.heartbeat(self.role, self.worker_id), hb)

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self._heartbeat()
            except Exception as exc:
                self.log.warning("heartbeat_failed", error=str(exc))
            await asyncio.sleep(self.heartbeat_s)

    async def _drain_bounded(self) -> None:
        t0 = time.perf_counter()
        task = asyncio.ensure_future(self.drain())
        skip = asyncio.ensure_future(self._stop_now.wait())
        try:
            await asyncio.wait({task, skip}, timeout=self.drain_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            skip.cancel()
        drained = task.done() and not task.cancelled() and task.exception() is None
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        elif task.exception() is not None:
            self.log.warning("drain_failed", error=str(task.exception()))
        held = self.active_requests()
        if held:
            await self.hand_over()
        self.log.info("drained", drained=drained, handed_over=len(held),
                      drain_s=round(time.perf_counter() - t0, 3))

    async def run(self) -> None:
        # Credentials come from the supervisor through the environment (``splitserve up --tenants``: one NATS
        # user per service role); without them the server must be running without authentication.
        user = os.environ.get(ENV_USER) or None
        # As its role's user, replies come back on the role's own inbox: the only one its permissions let it
        # subscribe to (splitserve.tenancy.natsauth.service_inbox).
        inbox = natsauth.service_inbox(self.role) if (self.role in natsauth.SERVICE_ROLES
                                                      and user == natsauth.service_user(self.role)) else None
        self.bus = await Bus.connect(self.nats_url, f"{self.role}:{self.worker_id}", user=user,
                                     password=os.environ.get(ENV_PASSWORD) or None,
                                     nkey_seed=os.environ.get(ENV_NKEY_SEED) or None, inbox_prefix=inbox)
        # After connecting: the embedded span exporter publishes on this connection.
        setup_tracing(self.role, self.worker_id, self.bus)
        hb_task = asyncio.create_task(self._heartbeat_loop())
        try:
            t0 = time.perf_counter()
            await self.setup()
            # Everything loaded so far (torch, transformers, the model's modules: ~430k objects in a worker)
            # lives as long as the process. Left to the collector, every full collection walked all of it:
            # ~165 ms with the engine's thread stopped, i.e. a stall in every stream of a decoder.
            gc.collect()
            gc.freeze()
            gc.callbacks.append(self._gc_watch)
            await self.start()
            self._state = "ready"
            await self._heartbeat()
            self.log.info("ready", setup_s=round(time.perf_counter() - t0, 2), pid=os.getpid())
            await self._stop.wait()
            self.log.info("stopping", drain_timeout_s=self.drain_timeout_s)
            self._state = "draining"
            await self._heartbeat()
            await self._drain_bounded()
        finally:
            # Services also run inside other processes (tests, benchmarks): a stopped one stops watching.
            with contextlib.suppress(ValueError):
                gc.callbacks.remove(self._gc_watch)
            self._state = "stopped"
            with contextlib.suppress(Exception):
                await self._heartbeat()
            hb_task.cancel()
            await self.shutdown()
            with contextlib.suppress(Exception):  # the last requests' spans, before the connection closes
                await flush_tracing(2.0)
            await self.b.close()
            structlog.contextvars.clear_contextvars()
            if self._deadline is not None:  # stopped in time
                self._deadline.cancel()


ENV_EVENT_LOOP = "SPLITSERVE_EVENT_LOOP"


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop a service runs on: uvloop when installed (its transports and scheduling cost a fraction
    of asyncio's: every message a service sends or receives pays them), unless ``SPLITSERVE_EVENT_LOOP=asyncio``
    asks for the standard library's. None: asyncio's default."""
    if os.environ.get(ENV_EVENT_LOOP, "uvloop").strip().lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_service(svc: Service) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        def on_signal() -> None:
            svc.request_stop()
            svc.arm_stop_deadline()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        await svc.run()

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(main())
