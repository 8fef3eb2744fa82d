"""A thin typed layer over nats-py: publish/request/subscribe with ``proto`` models only.

It owns three rules every service must follow: payloads are checked against the server's ``max_payload``
before they reach NATS (a clear error instead of a dropped connection); trace context is injected into
headers on every publish; and a message that fails to decode is answered with a precise error when it
has a reply subject, otherwise logged and dropped — the handler never sees it and the service keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import BaseModel

import proto
from proto import ErrorCode, StreamError
from splitserve.obs import tracing
from splitserve.obs.log import get_logger

M = TypeVar("M", bound=BaseModel)
log = get_logger(__name__)


class PayloadTooLarge(Exception):
    def __init__(self, size: int, limit: int, what: str) -> None:
        super().__init__(
            f"{what} is {size:,} bytes encoded, over the NATS server's max_payload of {limit:,} bytes"
        )
        self.size = size
        self.limit = limit


class Bus:
    def __init__(self, nc: NATS, name: str) -> None:
        self.nc = nc
        self.name = name
        self._reconnects = [0]
        self._tasks: set[asyncio.Task[Any]] = set()

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        *,
        user: str | None = None,
        password: str | None = None,
        connect_timeout: float = 5.0,
        reconnect: bool = True,
    ) -> Bus:
        async def on_error(e: Exception) -> None:
            log.warning("nats_error", error=str(e))

        async def on_disconnect() -> None:
            if not nc.is_closed and not nc.is_draining:
                log.warning("nats_disconnected")

        reconnects = [0]

        async def on_reconnect() -> None:
            reconnects[0] += 1
            log.info("nats_reconnected")

        nc = NATS()
        connecting = nc.connect(
            url,
            name=name,
            user=user,
            password=password,
            connect_timeout=connect_timeout,  # type: ignore[arg-type]  # floats work; stubs say int
            allow_reconnect=reconnect,
            max_reconnect_attempts=-1 if reconnect else 0,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
        # With unlimited reconnects nats-py retries the *initial* connect forever; bound it so that a wrong
        # URL is a clear error. Once connected, reconnects are unlimited (a NATS restart is survivable).
        try:
            await asyncio.wait_for(connecting, timeout=connect_timeout * 2)
        except Exception:
            with contextlib.suppress(Exception):
                await nc.close()
            raise
        bus = cls(nc, name)
        bus._reconnects = reconnects
        return bus

    @property
    def reconnects(self) -> int:
        """How many times the connection was re-established (requests in flight may have lost messages)."""
        return self._reconnects[0]

    @property
    def max_payload(self) -> int:
        return int(self.nc.max_payload or 1024 * 1024)

    def _payload(self, msg: BaseModel) -> bytes:
        data = proto.encode(msg)
        # Headers and protocol framing also count; keep a little room.
        if len(data) > self.max_payload - 4096:
            raise PayloadTooLarge(len(data), self.max_payload, type(msg).__name__)
        return data

    async def publish(
        self, subject: str, msg: BaseModel, *, reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        data = self._payload(msg)
        await self.nc.publish(subject, data, reply=reply, headers=tracing.inject(proto.headers_for(msg, headers)))

    async def request(
        self,
        subject: str,
        msg: BaseModel,
        reply_model: type[M],
        *,
        timeout: float = 2.0,
        headers: dict[str, str] | None = None,
    ) -> M | StreamError:
        """Request/reply. Returns the typed reply, or a StreamError when the responder answered with one.

        Raises nats' NoRespondersError / TimeoutError untouched so callers can name the cause.
        """
        data = self._payload(msg)
        resp = await self.nc.request(
            subject, data, timeout=timeout, headers=tracing.inject(proto.headers_for(msg, headers))
        )
        if resp.headers and resp.headers.get(proto.HEADER_KIND) == "error":
            return proto.decode(resp.data, StreamError)
        return proto.decode(resp.data, reply_model)

    async def reply_error(self, msg: Msg, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        if not msg.reply:
            return
        err = StreamError(request_id=request_id, code=code, message=message)
        await self.nc.publish(msg.reply, proto.encode(err), headers=proto.headers_for(err))

    async def respond(self, msg: Msg, reply: BaseModel) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, self._payload(reply), headers=proto.headers_for(reply))

    async def subscribe(
        self,
        subject: str,
        model: type[M],
        handler: Callable[[M, Msg], Awaitable[None]],
        *,
        queue: str = "",
        concurrent: bool = False,
    ) -> Subscription:
        """Subscribe with decoding and error handling. ``concurrent`` runs each message in its own task
        (the handler must then bound its own concurrency)."""

        async def run(decoded: M, raw: Msg) -> None:
            try:
                await handler(decoded, raw)
            except Exception as exc:  # a handler bug must not kill the subscription
                log.exception("handler_failed", subject=raw.subject, error=str(exc))
                await self.reply_error(raw, ErrorCode.INTERNAL, f"{self.name}: internal error: {exc}")

        async def cb(raw: Msg) -> None:
            try:
                decoded = proto.decode(raw.data, model)
            except proto.ProtocolError as exc:
                log.warning(
                    "bad_message", subject=raw.subject, code=str(exc.code), error=exc.message,
                    has_reply=bool(raw.reply),
                )
                await self.reply_error(raw, exc.code, f"{self.name}: {exc.message}")
                return
            if concurrent:
                self.spawn(run(decoded, raw))
            else:
                await run(decoded, raw)

        return await self.nc.subscribe(subject, queue=queue, cb=cb)

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        try:
            await self.nc.drain()
        except Exception:
            await self.nc.close()
