"""A thin typed layer over nats-py: publish/request/subscribe with ``proto`` models only.

It owns four rules every service must follow: payloads are checked against the server's ``max_payload``
before they reach NATS (a clear error instead of a dropped connection); trace context is injected into
headers on every publish but a stream delta's (one per token: no receiver continues a trace from one); a
message that fails to decode is answered with a precise error when it has a reply subject, otherwise logged
and dropped — the handler never sees it and the service keeps running; and a request's terminal messages are
stored durably (below).

Durable terminals. Core NATS drops what a connection had in flight when its server dies (a node of a cluster
SIGKILLed). So a request's end is also written to JetStream and confirmed: a ``RequestFinished`` and an async
job's ``StreamFinal``/``StreamError`` (their subjects are captured by ``SS_USAGE`` / ``SS_RESULTS``) are
published with a PubAck awaited and retried until stored (from a background task, so no caller waits on an
election), and a streaming request's terminal, sent live on ``ss.stream.T.R``, gets a stored copy on
``ss.result.T.R``, from which a client that missed it recovers (:meth:`splitserve.client.Client.result`).
Every attempt of one message carries the same ``Nats-Msg-Id``: the stream keeps one copy, and a listener on the
wire can tell a retried message (same id) from a second one. Until confirmed, the request (its
``proto.request_key``) stays in :attr:`Bus.unconfirmed` (heartbeats list it as active, so a router never takes it
for lost and runs it again).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import BaseModel

from splitserve import proto
from splitserve.obs import tracing
from splitserve.obs.log import get_logger
from splitserve.proto import ErrorCode, StreamDelta, StreamError
from splitserve.runtime import natsflush

# nats-py's flush() lets its PING overtake queued SUB/PUB commands: every connection made through the bus (the
# services, the SDK, the CLI) gets the fix; see splitserve.runtime.natsflush
natsflush.apply()

M = TypeVar("M", bound=BaseModel)
log = get_logger(__name__)


class PayloadTooLarge(Exception):
    def __init__(self, size: int, limit: int, what: str) -> None:
        super().__init__(
            f"{what} is {size:,} bytes encoded, over the NATS server's max_payload of {limit:,} bytes"
        )
        self.size = size
        self.limit = limit


class NotAuthorized(Exception):
    """The NATS server refused these credentials (wrong user/password/nkey, or none given to a server that
    requires them)."""


class PermissionDenied(Exception):
    """The NATS server refused a publish or subscribe this connection is not permitted to make."""

    def __init__(self, operation: str, subject: str) -> None:
        super().__init__(f"the NATS server refused to let this connection {operation} {subject!r} "
                         f"(not permitted for these credentials)")
        self.operation = operation
        self.subject = subject


# "No responders" to a stored publish: no stream takes the subject, or its stream is electing a leader (seconds)
NO_STREAM_GRACE_S = 15.0

_VIOLATION = re.compile(r"permissions violation for (publish|subscription) to \"?([^\"']+)\"?", re.IGNORECASE)


def parse_permission_error(err: BaseException) -> PermissionDenied | None:
    """nats-py reports a refused publish/subscribe only as text through the error callback; recover it."""
    m = _VIOLATION.search(str(err))
    if m is None:
        return None
    return PermissionDenied("publish to" if m.group(1).lower() == "publish" else "subscribe to", m.group(2).strip())


class Bus:
    def __init__(self, nc: NATS, name: str) -> None:
        self.nc = nc
        self.name = name
        self._reconnects = [0]
        self._tasks: set[asyncio.Task[Any]] = set()
        # Requests waiting on a subject, failed at once if the server refuses the publish (instead of waiting
        # out the timeout for a reply that cannot come).
        self._pending: dict[str, set[asyncio.Future[None]]] = {}
        self.denied: list[PermissionDenied] = []  # the latest refusals, for callers and tests
        self._reconnect_waiters: set[asyncio.Future[None]] = set()
        self._durable: set[asyncio.Task[Any]] = set()
        self._no_stream: set[asyncio.Task[Any]] = set()  # stored publishes hearing only "no responders" so far
        self.last_reconnect = 0.0  # time.monotonic() of the latest reconnect
        self.unconfirmed: dict[str, int] = {}  # request key -> terminal messages not yet stored by JetStream
        self.durable_retries = 0  # attempts after the first (an election, a dead node): for tests and logs

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        *,
        user: str | None = None,
        password: str | None = None,
        nkey_seed: str | None = None,
        inbox_prefix: str | None = None,
        connect_timeout: float = 5.0,
        reconnect: bool = True,
    ) -> Bus:
        """Connect. ``user``/``password`` or ``nkey_seed`` (a seed file's path) authenticate; ``inbox_prefix``
        (``_INBOX.<tenant>`` for a tenant) is where replies to this connection's requests arrive, which is what
        a tenant's permissions allow it to subscribe to. Raises :class:`NotAuthorized` when the server refuses
        the credentials."""
        holder: list[Bus] = []
        auth_failed: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

        async def on_error(e: Exception) -> None:
            denied = parse_permission_error(e)
            if denied is not None:
                log.warning("nats_permission_denied", operation=denied.operation, subject=denied.subject)
                if holder:
                    holder[0]._on_denied(denied)
                return
            if _is_auth_error(e) and not auth_failed.done():
                auth_failed.set_result(e)
            log.warning("nats_error", error=str(e))

        async def on_disconnect() -> None:
            if not nc.is_closed and not nc.is_draining:
                log.warning("nats_disconnected")

        reconnects = [0]

        async def on_reconnect() -> None:
            reconnects[0] += 1
            url = nc.connected_url
            log.info("nats_reconnected", server=url.netloc if url else None)
            if holder:
                holder[0]._on_reconnect()

        nc = NATS()
        from splitserve.discovery import server_list

        opts: dict[str, Any] = {}
        if nkey_seed:
            opts["nkeys_seed"] = nkey_seed
        if inbox_prefix:
            opts["inbox_prefix"] = inbox_prefix
        connecting = nc.connect(
            # Every server of a cluster (comma-separated URL): the connection fails over between them, and
            # learns the others from the server's INFO (connect_urls) too.
            server_list(url),
            name=name,
            user=user,
            password=password,
            **opts,
            connect_timeout=connect_timeout,  # type: ignore[arg-type]  # floats work; stubs say int
            allow_reconnect=reconnect,
            max_reconnect_attempts=-1 if reconnect else 0,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]
            # A dead node is noticed from the socket at once (SIGKILL closes it); a node that hangs is found by
            # pings: 3 missed at 5 s = 15 s. Reconnects hit the other nodes first (the pool is shuffled).
            ping_interval=5,
            max_outstanding_pings=3,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
        # With unlimited reconnects nats-py retries the *initial* connect forever; bound it so that a wrong
        # URL is a clear error. Once connected, reconnects are unlimited (a NATS restart is survivable).
        # A refused login is final: stop at once rather than retry it until the timeout.
        task = asyncio.ensure_future(connecting)
        try:
            racing: set[asyncio.Future[Any]] = {task, auth_failed}
            done, _ = await asyncio.wait(racing, timeout=connect_timeout * 2,
                                         return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                task.result()
            elif auth_failed in done:
                task.cancel()
                raise NotAuthorized(f"the NATS server at {url} refused the credentials "
                                    f"({_who(user, nkey_seed)}): {auth_failed.result()}")
            else:
                task.cancel()
                raise TimeoutError(f"no connection to NATS at {url} within {connect_timeout * 2:.0f}s")
        except BaseException as exc:
            with contextlib.suppress(BaseException):
                await nc.close()
            if isinstance(exc, NotAuthorized) or not _is_auth_error(exc):
                raise
            raise NotAuthorized(f"the NATS server at {url} refused the credentials "
                                f"({_who(user, nkey_seed)}): {exc}") from None
        bus = cls(nc, name)
        bus._reconnects = reconnects
        holder.append(bus)
        return bus

    def _on_denied(self, denied: PermissionDenied) -> None:
        # nats-py lower-cases the server's error text: match the (case-sensitive) subjects of waiting
        # requests case-insensitively and report the subject as it was sent.
        for subject, waiting in self._pending.items():
            if subject.lower() == denied.subject.lower():
                denied = PermissionDenied(denied.operation, subject)
                for fut in waiting:
                    if not fut.done():
                        fut.set_exception(denied)
        self.denied = [*self.denied[-15:], denied]

    def _on_reconnect(self) -> None:
        self.last_reconnect = time.monotonic()
        for fut in self._reconnect_waiters:
            if not fut.done():
                fut.set_result(None)
        self._reconnect_waiters.clear()

    def next_reconnect(self) -> asyncio.Future[None]:
        """A future that completes when the connection is next re-established (to this server or, in a
        cluster, another one): what was in flight on the old connection may be lost, re-send it."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reconnect_waiters.add(fut)
        return fut

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
        if headers is None and type(msg) is StreamDelta:
            # One per token: no headers to build here and parse at every receiver (~9 us a message in all). Its
            # body names its kind and version, and no receiver continues a trace from a delta (the request's
            # spans carry it; the decoder emits tokens outside any span).
            await self.nc.publish(subject, data, reply=reply)
            return
        stored = _stored_subject(subject, msg)
        if stored is None:
            await self.nc.publish(subject, data, reply=reply,
                                  headers=tracing.inject(proto.headers_for(msg, headers)))
            return
        hdrs = tracing.inject(proto.headers_for(msg, {**(headers or {}), "Nats-Msg-Id": uuid.uuid4().hex}))
        if stored != subject:  # live on the stream subject now; the stored copy follows
            await self.nc.publish(subject, data, reply=reply, headers=hdrs)
        tenant, rid = proto.subject_identity(stored)  # a stored subject always names both
        rid = proto.request_key(tenant, rid or "")
        self.unconfirmed[rid] = self.unconfirmed.get(rid, 0) + 1
        task = asyncio.ensure_future(self._publish_stored(stored, data, hdrs, rid))
        self._durable.add(task)
        task.add_done_callback(self._durable.discard)

    async def _publish_stored(self, subject: str, data: bytes, headers: dict[str, str], rid: str, *,
                              give_up_s: float = 300.0) -> None:
        """Publish until JetStream confirms it stored the message (same Nats-Msg-Id on every attempt)."""
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout
        from nats.js.errors import NoStreamResponseError

        js = self.nc.jetstream()
        started = time.monotonic()
        wait = 0.2
        me = asyncio.current_task()
        no_stream_since: float | None = None
        stream_exists = False
        try:
            attempt = 0
            while True:
                attempt += 1
                try:
                    await js.publish(subject, data, timeout=2.0, headers=headers)
                    if attempt > 1:
                        log.info("terminal_stored_after_retry", subject=subject, attempts=attempt,
                                 waited_s=round(time.monotonic() - started, 2))
                    return
                except (NoRespondersError, NoStreamResponseError):
                    # "No responders" (nats-py's JetStream publish raises NoStreamResponseError for it) means one
                    # of two things: no stream captures the subject (no router made SS_RESULTS / SS_USAGE yet:
                    # delivered live only), or the stream that does has no leader this moment (an election after
                    # a node died). Given up, the second lost a stored end: a router then found none and ended
                    # the request a second time, or a client that lost the live end found no stored one. So it
                    # is retried; past NO_STREAM_GRACE_S (elections on a loaded cluster can take longer) only
                    # until JetStream says the stream does not exist. A closing bus does not wait for it while
                    # that is unknown (flush_stored).
                    now = time.monotonic()
                    if no_stream_since is None:
                        no_stream_since = now
                        if me is not None and not stream_exists:
                            self._no_stream.add(me)
                    if now - no_stream_since > NO_STREAM_GRACE_S and not stream_exists:
                        known = await self._stream_exists(subject)
                        if known is False:
                            return  # no stream takes it: it was delivered live only
                        if known:
                            stream_exists = True
                            if me is not None:
                                self._no_stream.discard(me)
                    if now - started > give_up_s:
                        log.error("terminal_not_stored", subject=subject, attempts=attempt,
                                  error="no responders (the stream has no leader)")
                        return
                    await asyncio.sleep(wait)
                    wait = min(2.0, wait * 2)
                    continue
                except (NatsTimeout, TimeoutError, Exception) as exc:  # an election, a dead node, reconnecting
                    if me is not None:
                        self._no_stream.discard(me)
                    no_stream_since = None
                    if time.monotonic() - started > give_up_s:
                        log.error("terminal_not_stored", subject=subject, attempts=attempt, error=repr(exc))
                        return
                    self.durable_retries += 1
                    await asyncio.sleep(wait)
                    wait = min(2.0, wait * 2)
        finally:
            if me is not None:
                self._no_stream.discard(me)
            n = self.unconfirmed.get(rid, 1) - 1
            if n <= 0:
                self.unconfirmed.pop(rid, None)
            else:
                self.unconfirmed[rid] = n

    async def _stream_exists(self, subject: str) -> bool | None:
        """Whether a stream keeps this stored subject: True, False (JetStream says there is none, or there is no
        JetStream at all), None (no answer now: no meta leader, a timeout)."""
        from nats.errors import NoRespondersError
        from nats.js.errors import NotFoundError

        stream = (proto.Subjects.USAGE_STREAM if subject.startswith("ss.evt.finished.")
                  else proto.Subjects.RESULTS_STREAM)
        try:
            await self.nc.jetstream(timeout=2.0).stream_info(stream)
        except NotFoundError:
            return False
        except NoRespondersError:
            return False  # nothing serves the JetStream API
        except Exception:
            return None
        return True

    async def flush_stored(self, timeout: float = 10.0) -> None:
        """Wait (bounded) until every terminal published so far is stored: before a service exits."""
        # (not those that only ever heard "no responders": most likely no stream takes them at all)
        waiting = self._durable - self._no_stream
        if waiting:
            await asyncio.wait(waiting, timeout=timeout)

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
        refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self._pending.setdefault(subject, set())
        waiting.add(refused)
        req = asyncio.ensure_future(self.nc.request(
            subject, data, timeout=timeout, headers=tracing.inject(proto.headers_for(msg, headers))
        ))
        try:
            racing: set[asyncio.Future[Any]] = {req, refused}
            await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
            if not req.done():  # the server refused the publish: PermissionDenied
                req.cancel()
                refused.result()
            resp = req.result()
        finally:
            waiting.discard(refused)
            if not waiting:
                self._pending.pop(subject, None)
            if not req.done():
                req.cancel()
            if not refused.done():
                refused.cancel()
            elif not refused.cancelled():
                refused.exception()  # retrieved: a late refusal after the reply is not an error to report
        if resp.headers and resp.headers.get(proto.HEADER_KIND) == "error":
            return proto.decode(resp.data, StreamError)
        return proto.decode(resp.data, reply_model)

    async def reply_error(self, msg: Msg, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        if not reply_allowed(msg.reply):
            return
        err = StreamError(request_id=request_id, code=code, message=message)
        await self.nc.publish(msg.reply, proto.encode(err), headers=proto.headers_for(err))

    async def respond(self, msg: Msg, reply: BaseModel) -> None:
        if reply_allowed(msg.reply):
            await self.nc.publish(msg.reply, self._payload(reply), headers=proto.headers_for(reply))

    async def subscribe(
        self,
        subject: str,
        model: type[M],
        handler: Callable[[M, Msg], Awaitable[None]],
        *,
        queue: str = "",
        concurrent: bool = False,
        scoped: bool = False,
        gate: Callable[[Msg], StreamError | None] | None = None,
    ) -> Subscription:
        """Subscribe with decoding and error handling. ``concurrent`` runs each message in its own task
        (the handler must then bound its own concurrency). ``scoped``: the subject names a tenant (and maybe a
        request: ``proto.subjects.subject_identity``), and the message's own ``tenant`` / ``request_id`` must be
        those, else it is refused with ``forbidden`` before the handler sees it. This is where a service learns
        who sent a message: nats-server binds a tenant's credentials to its subjects, not to what a body says.
        ``gate`` sees each raw message before it is decoded (the cheap checks: size, rate) and may refuse it with
        an error, which is the reply."""

        async def run(decoded: M, raw: Msg) -> None:
            try:
                await handler(decoded, raw)
            except Exception as exc:  # a handler bug must not kill the subscription
                log.exception("handler_failed", subject=raw.subject, error=str(exc))
                await self.reply_error(raw, ErrorCode.INTERNAL, f"{self.name}: internal error: {exc}")

        limit: int | None = getattr(model, "MAX_BYTES", None)  # a message type's own size bound, checked unread

        async def cb(raw: Msg) -> None:
            if gate is not None and (refused := gate(raw)) is not None:
                await self.respond(raw, refused)
                return
            if limit is not None and len(raw.data) > limit:
                log.warning("bad_message", subject=raw.subject, code=str(ErrorCode.PAYLOAD_TOO_LARGE),
                            error=f"{len(raw.data):,} bytes", has_reply=bool(raw.reply))
                await self.reply_error(raw, ErrorCode.PAYLOAD_TOO_LARGE, f"{self.name}: a {model.__name__} is at "
                                       f"most {limit:,} bytes; this one is {len(raw.data):,}")
                return
            try:
                decoded = proto.decode(raw.data, model)
            except proto.ProtocolError as exc:
                log.warning(
                    "bad_message", subject=raw.subject, code=str(exc.code), error=exc.message,
                    has_reply=bool(raw.reply),
                )
                await self.reply_error(raw, exc.code, f"{self.name}: {exc.message}")
                return
            if scoped and (refusal := identity_refusal(raw.subject, decoded)) is not None:
                log.warning("forbidden_message", subject=raw.subject, error=refusal)
                await self.reply_error(raw, ErrorCode.FORBIDDEN, f"{self.name}: {refusal}")
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
        with contextlib.suppress(Exception):
            await self.flush_stored()
        for t in list(self._tasks):
            t.cancel()
        try:
            # Bounded: a subscription that never drains (a JetStream pull waiting on the server) would hold the
            # process for nats' 30 s drain timeout after a service's own drain has already finished.
            await asyncio.wait_for(self.nc.drain(), timeout=3.0)
        except Exception:
            with contextlib.suppress(Exception):
                await self.nc.close()


def reply_allowed(reply: str | None) -> bool:
    """Whether a service may answer on a message's reply subject. The sender chooses it, and nats-server does
    not check a reply subject against the sender's rights, while the answer goes out with the service's: a
    reply subject of ``$KV.SS_QUOTA.B`` would have a router overwrite tenant B's quota record. Every client
    (nats-py's request, a tenant's ``_INBOX.{tenant}`` prefix) replies into an inbox, so only inboxes are
    answered."""
    if not reply or not reply.startswith("_INBOX.") or len(reply) > 256:
        return False
    return not any(c in reply for c in " \t\r\n*>")


def identity_refusal(subject: str, msg: BaseModel) -> str | None:
    """Why ``msg`` may not be taken from ``subject`` (its tenant or request id differs from the subject's), or
    None when they agree."""
    try:
        tenant, rid = proto.subject_identity(subject)
    except ValueError as exc:
        return str(exc)
    claimed = getattr(msg, "tenant", None)
    if claimed is None and isinstance(getattr(msg, "request", None), BaseModel):  # a QueuedRequest
        claimed = getattr(msg.request, "tenant", None)  # type: ignore[attr-defined]
    if claimed != tenant:
        return (f"the message names tenant {str(claimed)[:64]!r} but was sent on {subject!r}, which is tenant "
                f"{tenant!r}'s: a connection acts only as the tenant its credentials are for")
    if rid is not None and getattr(msg, "request_id", rid) != rid:
        return f"the message names request {str(getattr(msg, 'request_id', ''))[:64]!r} but was sent on {subject!r}"
    return None


_TERMINALS = (proto.StreamFinal, proto.StreamError, proto.RequestFinished)


def _stored_subject(subject: str, msg: BaseModel) -> str | None:
    """Where a request's terminal message is kept (see the module docstring), or None for any other message."""
    if not isinstance(msg, _TERMINALS):
        return None
    parts = subject.split(".")
    if isinstance(msg, proto.RequestFinished):
        return subject if len(parts) == 5 and parts[:3] == ["ss", "evt", "finished"] else None
    if len(parts) != 4 or parts[0] != "ss":
        return None
    if parts[1] == "result":
        return subject
    if parts[1] == "stream":
        return f"ss.result.{parts[2]}.{parts[3]}"
    return None


def _is_auth_error(exc: BaseException) -> bool:
    from nats.errors import AuthorizationError

    return isinstance(exc, AuthorizationError) or "authorization violation" in str(exc).lower()


def _who(user: str | None, nkey_seed: str | None) -> str:
    if user:
        return f"user {user!r}"
    if nkey_seed:
        return f"nkey seed {nkey_seed}"
    return "no credentials given"
