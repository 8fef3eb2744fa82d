"""The HTTP surface of the front door: routes, API-key auth, request ids, SSE relaying and client disconnects.

It holds no state a restart would lose: the only bookkeeping is the set of requests in flight on this
process (for heartbeats and duplicate ids). Everything that talks to NATS sits behind :class:`Backend`
(``service.FrontendService`` in production; fakes in the unit tests), and every wire shape comes from
``openai_api``.

A request's token stream is owned by a :class:`Relay` from the first read to a guaranteed close: whether it
ends normally, with an error, or because the caller went away, the client's Generation is closed (which
releases its NATS subscription) and, if the request may still be running server-side, the backend's
``cancel_request`` hook is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from json.encoder import encode_basestring
from pathlib import Path
from typing import Any, Protocol, TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_fastapi_instrumentator import Instrumentator
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve import errors
from splitserve.client import Delta, Result
from splitserve.obs import tracing
from splitserve.obs.log import get_logger
from splitserve.obs.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from splitserve.proto import ErrorCode
from splitserve.proto.subjects import check_token
from splitserve.services.frontend import openai_api as oa
from splitserve.tenancy.config import TenantsConfig

log = get_logger("frontend.http")
T = TypeVar("T")

REQUEST_ID_HEADER = "X-Request-Id"
SESSION_HEADER = "X-Session-Id"  # the session key for sticky routing (else the body's ``user``)
PROBE_PATHS = frozenset({"/healthz", "/health", "/readyz", "/metrics"})
# Far above any prompt NATS can carry (max_payload 8 MiB): only stops a body from filling this process's memory.
MAX_BODY_BYTES = 32 * 1024 * 1024
# A body must arrive within this (a slow-body sender holds a task and a connection while it trickles).
BODY_TIMEOUT_S = 60.0
# Caller-chosen ids travel on as NATS subject tokens and log fields: bounded, never echoed when invalid.
MAX_REQUEST_ID_CHARS = 128
MAX_SESSION_ID_CHARS = 256  # the wire's own bound on GenerateRequest.session_id
# Shorter keys are guessable; the error names the tenant, never the key.
MIN_API_KEY_CHARS = 16
# Failed-key throttling: this many failures from one address within the window, then 429 until it ends.
AUTH_FAILURES_ALLOWED = 10
AUTH_FAILURE_WINDOW_S = 60.0
AUTH_TRACKED_ADDRESSES = 10_000  # LRU bound on the addresses remembered (memory stays bounded under a flood)
# Concurrent generation requests one API key may have in flight on this front door (0 = no limit).
PER_KEY_CONCURRENCY = 64
# Used when no decode worker has announced its context length yet; decoders cap at the real one anyway.
FALLBACK_MAX_TOKENS = 4096


# ---------------------------------------------------------------------------------------------- backend


class Stream(Protocol):
    """What ``splitserve.client.Generation`` offers: ordered deltas, then ``result`` once iteration ends."""

    result: Result | None

    def __aiter__(self) -> AsyncIterator[Delta]: ...


class Backend(Protocol):
    """What the HTTP layer needs from the cluster.

    ``served_models`` is the set of models known to be served (empty when none is known, e.g. no decoder heard
    yet): the only names a request is refused against with 404. A backend without it is taken as serving one
    model: ``served_model_name`` (optional too; else ``model_name``) with ``max_model_len``. Optional too:
    ``served_adapters``, the LoRA adapters loaded on live decoders -> their base model's name (requests may
    name them; ``/v1/models`` lists them with their ``parent``)."""

    @property
    def served_models(self) -> dict[str, int | None]:
        """Every served model's name -> its max_model_len (None: not announced), in a stable order (the first
        is the default of a request that names none); empty while none is known."""

    @property
    def model_name(self) -> str | None:
        """The (first) served model's name (None until known)."""

    @property
    def max_model_len(self) -> int | None: ...

    def readiness(self) -> tuple[bool, dict[str, Any]]: ...

    def generate(self, args: oa.GenerateArgs, *, tenant: str, request_id: str) -> Stream:
        """Start one request (raises a SplitserveError when it cannot even be sent)."""

    async def cancel_request(self, request_id: str) -> None:
        """The caller is gone before the request ended: stop it server-side."""

    def metrics(self) -> bytes:
        """The cluster's metrics in Prometheus text format."""


# ---------------------------------------------------------------------------------------------- api keys


def load_api_keys(path: Path) -> dict[str, str]:
    """API key -> tenant, from a JSON or YAML mapping. Tenants must be valid subject tokens (they name the
    NATS subjects the request travels on)."""
    text = path.read_text()
    data: Any
    try:
        data = json.loads(text)
    except ValueError:
        import yaml  # only needed for YAML key files

        data = yaml.safe_load(text)
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path}: expected a non-empty mapping of API key -> tenant")
    keys: dict[str, str] = {}
    for key, tenant in data.items():
        if not isinstance(key, str) or not key or not isinstance(tenant, str):
            raise ValueError(f"{path}: every entry must map a non-empty string key to a tenant name")
        tenant = check_token(tenant, "tenant")
        # The message names the tenant and never the key: it ends up in terminals and logs.
        if len(key) < MIN_API_KEY_CHARS:
            raise ValueError(f"{path}: an API key of tenant {tenant!r} is shorter than {MIN_API_KEY_CHARS} "
                             "characters (use e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
        if not is_key_text(key):
            raise ValueError(f"{path}: an API key of tenant {tenant!r} has whitespace or control characters "
                             "(a key is compared exactly, so such a key could never be sent)")
        keys[key] = tenant
    return keys


def is_key_text(key: str) -> bool:
    """Visible ASCII only: what an ``Authorization: Bearer`` value can carry without any re-encoding."""
    return bool(key) and all("!" <= ch <= "~" for ch in key)


def bearer_key(values: list[str]) -> str | None:
    """The key of exactly one ``Authorization: Bearer KEY`` header, read strictly: one space after the scheme
    and a key of visible ASCII only. Anything else (several headers, other schemes, a key with a trailing
    newline, tab or other whitespace) is no key at all, so that a key is only ever compared exactly."""
    if len(values) != 1:
        return None
    scheme, sep, key = values[0].partition(" ")
    if sep != " " or scheme.lower() != "bearer" or not is_key_text(key):
        return None
    return key


class Authenticator:
    """Bearer-key auth. Keys are held only as SHA-256 digests, and a candidate is compared with every one of
    them in constant time (``hmac.compare_digest``, no early exit), so a lookup's timing says nothing about
    how close a guess was nor which key it matched."""

    def __init__(self, keys: dict[str, str] | None) -> None:
        self._keys = None if keys is None else [(self._digest(k), t) for k, t in keys.items()]

    @property
    def open(self) -> bool:
        """No keys configured: every caller is tenant 'default'."""
        return self._keys is None

    @staticmethod
    def _digest(key: str) -> bytes:
        return hashlib.sha256(key.encode()).digest()

    def authenticate(self, authorization: list[str]) -> tuple[str, bytes]:
        """(tenant, key id) for the request's Authorization headers; raises the 401 ApiError otherwise. The
        key id (its digest) is what per-key limits count by."""
        if self._keys is None:
            return "default", b""
        key = bearer_key(authorization)
        if key is None:
            raise oa.invalid_api_key()
        digest = self._digest(key)
        found: tuple[str, bytes] | None = None
        for known, tenant in self._keys:  # all of them, whatever matched: constant time over the key set
            if hmac.compare_digest(digest, known):
                found = (tenant, known)
        if found is None:
            raise oa.invalid_api_key()
        return found

    def tenant(self, authorization: str | None) -> str:
        """The tenant of one Authorization header value (None: the header is absent)."""
        return self.authenticate([] if authorization is None else [authorization])[0]


class AuthThrottle:
    """Failed-key throttling per client address: after ``allowed`` failures within ``window_s`` every request
    from that address that needs a key is a 429 (with Retry-After) until the window ends, whatever key it
    carries, so a key cannot be guessed faster than that. Memory is bounded: at most ``max_addresses`` are
    remembered, the least recently failing forgotten first."""

    def __init__(self, *, allowed: int = AUTH_FAILURES_ALLOWED, window_s: float = AUTH_FAILURE_WINDOW_S,
                 max_addresses: int = AUTH_TRACKED_ADDRESSES, clock: Callable[[], float] = time.monotonic) -> None:
        self.allowed = allowed
        self.window_s = window_s
        self.max_addresses = max_addresses
        self._clock = clock
        self._failures: OrderedDict[str, tuple[float, int]] = OrderedDict()  # address -> (window start, count)

    def retry_after(self, address: str) -> float | None:
        """Seconds until ``address`` may try again, or None when it is not throttled."""
        entry = self._failures.get(address)
        if entry is None:
            return None
        left = entry[0] + self.window_s - self._clock()
        if left <= 0:
            del self._failures[address]
            return None
        return left if entry[1] >= self.allowed else None

    def failed(self, address: str) -> None:
        now = self._clock()
        start, count = self._failures.pop(address, (now, 0))
        if now - start >= self.window_s:
            start, count = now, 0
        self._failures[address] = (start, count + 1)  # (re)inserted last: the most recent
        while len(self._failures) > self.max_addresses:
            self._failures.popitem(last=False)

    def check(self, address: str) -> None:
        left = self.retry_after(address)
        if left is not None:
            raise oa.ApiError(429, "Too many requests with an invalid API key from this address; retry later.",
                              type="rate_limit_error", code="too_many_auth_failures", retry_after_s=left)


class KeyConcurrency:
    """How many generation requests each API key has in flight here; over ``limit`` a request is a 429."""

    def __init__(self, limit: int = PER_KEY_CONCURRENCY) -> None:
        self.limit = limit
        self._active: dict[bytes, int] = {}

    def acquire(self, key_id: bytes) -> Callable[[], None]:
        """Count one request of ``key_id`` (raises the 429 when it is at its limit); returns its release."""
        if not key_id or self.limit <= 0:
            return lambda: None
        n = self._active.get(key_id, 0)
        if n >= self.limit:
            raise oa.ApiError(429, f"Too many concurrent requests for this API key (at most {self.limit}); "
                                   "retry when one has finished.", type="rate_limit_error",
                              code="too_many_concurrent_requests", retry_after_s=1)
        self._active[key_id] = n + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self._active.get(key_id, 1) - 1
            if left > 0:
                self._active[key_id] = left
            else:
                self._active.pop(key_id, None)

        return release


# ---------------------------------------------------------------------------------------------- request ids


def request_id_from(header: str | None) -> str:
    """The caller's X-Request-Id when it is a valid subject token of at most MAX_REQUEST_ID_CHARS, else a
    fresh one (an invalid or overlong id is dropped, never echoed)."""
    if header and len(header) <= MAX_REQUEST_ID_CHARS:
        try:
            return check_token(header, "request id")
        except ValueError:
            pass
    return uuid.uuid4().hex


def session_id_from(header: str | None) -> str | None:
    """The X-Session-Id header, validated: at most MAX_SESSION_ID_CHARS of visible ASCII (spaces allowed
    inside). Anything else is a 400 whose message does not repeat the value."""
    if header is None:
        return None
    if not header or len(header) > MAX_SESSION_ID_CHARS or not all(" " <= ch <= "~" for ch in header):
        raise oa.ApiError(400, f"Invalid '{SESSION_HEADER}' header: it must be 1 to {MAX_SESSION_ID_CHARS} "
                               "printable ASCII characters.", param=SESSION_HEADER, code="invalid_value")
    return header


class RequestIdMiddleware:
    """Pure ASGI (streaming-safe): picks the request id, echoes it on every response, logs one access line."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER.lower().encode())
        rid = request_id_from(raw.decode("latin-1") if raw else None)
        scope.setdefault("state", {})["request_id"] = rid
        status = 0
        t0 = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        # Continue the caller's own trace (W3C traceparent/tracestate): client.generate, started inside
        # this request, becomes a child of the caller's span.
        hdrs = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []
                if k.lower() in (b"traceparent", b"tracestate")}
        # (Only when no server span is current: the ASGI instrumentation outside this middleware has already
        # continued the caller's trace, and its span must stay the parent.)
        outer = trace.get_current_span().get_span_context().is_valid
        token = otel_context.attach(tracing.extract(hdrs)) if hdrs and not outer else None
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if token is not None:
                otel_context.detach(token)
            # Probes (and the console's polling) come every second or so: keep them out of the info log.
            path = str(scope.get("path") or "")
            emit = log.debug if path in PROBE_PATHS or path.startswith("/console/") else log.info
            emit("http", method=scope.get("method"), path=scope.get("path"), status=status or None, request_id=rid,
                 ms=round((time.perf_counter() - t0) * 1000, 1))


# ---------------------------------------------------------------------------------------------- relaying


class ClientGone(Exception):
    """The HTTP caller disconnected before there was anything to send."""


async def until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def or_disconnect(fn: Callable[[], Awaitable[T]], receive: Receive) -> T:
    """Await ``fn()`` unless the caller disconnects first (then ``fn`` is cancelled and ClientGone raised).
    Without this a caller that gives up while waiting for the first token would hold the request open."""
    box: list[T] = []
    failure: list[Exception] = []
    gone = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal gone
            await until_disconnected(receive)
            gone = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            box.append(await fn())
        except Exception as exc:  # re-raised below, outside the task group, so it is not wrapped in a group
            failure.append(exc)
        tg.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if not box:
        assert gone
        raise ClientGone
    return box[0]


class Relay:
    """One request's token stream, owned from the first read to a guaranteed close."""

    def __init__(self, stream: Stream, *, request_id: str, cancel: Callable[[str], Awaitable[None]],
                 on_closed: Callable[[str], object]) -> None:
        self.stream = stream
        self.request_id = request_id
        self._it = aiter(stream)
        self._cancel = cancel
        self._on_closed = on_closed
        self.finished = False  # the server side is known to be over (final result, or an error it sent)
        self._closed = False

    @property
    def result(self) -> Result:
        assert self.stream.result is not None
        return self.stream.result

    async def next(self) -> Delta | None:
        """The next delta, or None at the end (then ``result`` is set)."""
        try:
            return await anext(self._it)
        except StopAsyncIteration:
            self.finished = True
            return None
        except errors.SplitserveError as exc:
            # A timeout is the one error this side raises on its own while the request may still be running.
            self.finished = exc.code is not ErrorCode.TIMEOUT
            raise

    async def drain(self) -> Result:
        while await self.next() is not None:
            pass
        return self.result

    async def close(self) -> None:
        """Idempotent. Shielded: it runs when the request is being cancelled, and must still finish, or the
        subscription and the server-side request would leak."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            aclose = getattr(self._it, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()  # runs the Generation's finally: unsubscribes its stream subject
                except Exception as exc:
                    log.warning("relay_close_failed", request_id=self.request_id, error=str(exc))
            if not self.finished:
                try:
                    await self._cancel(self.request_id)
                except Exception as exc:
                    log.warning("cancel_failed", request_id=self.request_id, error=str(exc))
        self._on_closed(self.request_id)


def internal_error(request_id: str) -> oa.ApiError:
    # Exception text stays in our log (found by request id); it can name internals a caller should not see.
    return oa.ApiError(500, f"internal server error (request {request_id}; details in the front door's log)",
                       type="server_error", code="internal")


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")
_MARK = "\x00splitserve-text\x00"


def text_event_encoder(r: oa.Responder) -> Callable[[str], bytes]:
    """``sse(r.text_chunk(text))`` for a request without logprobs, byte for byte, with the envelope encoded
    once per request: each token's event then costs one string escape, not a dict build and a JSON dump."""
    whole = sse(r.text_chunk(_MARK)).decode()
    parts = whole.split(encode_basestring(_MARK))
    if len(parts) != 2:  # the mark also appears in the envelope (a model named after it): no shortcut
        return lambda text: sse(r.text_chunk(text))
    head, tail = parts[0].encode(), parts[1].encode()
    return lambda text: head + encode_basestring(text).encode() + tail


class Pump:
    """Reads a :class:`Relay` ahead from its own task and watches for the caller's disconnect, so the request's
    own task only ever waits for "something to do": new deltas, the end, an error, or the caller gone.

    Deltas that pile up while the writer is blocked (the HTTP client reads slower than the stream: its send
    buffer is full and ``send`` waits) are taken together and merged into one SSE event; a client that keeps
    up gets every delta as its own event, the moment it arrives (deltas that came in one burst go in one
    write). Two plain asyncio tasks per request, no task group or cancel scope on the per-token path.
    """

    def __init__(self, relay: Relay, receive: Receive) -> None:
        self.relay = relay
        self.items: list[Delta] = []
        self.received = 0  # deltas read so far
        self.done = False  # the stream ended normally (relay.result is set)
        self.error: Exception | None = None  # what the stream raised
        self.gone = False  # the HTTP caller disconnected
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read())
        self._watcher = loop.create_task(self._watch(receive))

    async def _read(self) -> None:
        relay, wake = self.relay, self._wake
        try:
            while (delta := await relay.next()) is not None:
                self.items.append(delta)
                self.received += 1
                wake.set()
            self.done = True
        except Exception as exc:
            self.error = exc
        wake.set()

    async def _watch(self, receive: Receive) -> None:
        with contextlib.suppress(Exception):  # a server that raises on a dead connection: gone all the same
            await until_disconnected(receive)
        self.gone = True
        self._wake.set()

    @property
    def over(self) -> bool:
        return self.done or self.error is not None or self.gone

    async def take(self) -> list[Delta]:
        """Every delta received since the last take; waits until there is one, or the stream is over."""
        while not self.items and not self.over:
            self._wake.clear()
            await self._wake.wait()
        items = self.items
        if items:
            self.items = []
        return items

    async def close(self) -> None:
        """Idempotent: stop the watcher and the reader (which runs the stream's cleanup), then close the relay."""
        self._watcher.cancel()
        self._reader.cancel()
        try:
            with anyio.CancelScope(shield=True):
                await asyncio.wait((self._reader, self._watcher))  # the reader ran the stream's own cleanup
        finally:
            await self.relay.close()


class EventStreamResponse(Response):
    """Server-sent events relayed from a :class:`Pump`, which this response closes whatever happens. The pump
    watches for the caller's disconnect (any ASGI server, any spec version): the stream stops at once."""

    media_type = "text/event-stream"

    def __init__(self, pump: Pump, responder: oa.Responder, first: list[Delta]) -> None:
        self.pump = pump
        self.responder = responder
        self.first = first
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _pump(self, send: Send) -> None:
        r = self.responder
        pump = self.pump
        text_event = None if r.logprobs else text_event_encoder(r)  # pre-encoded envelope (no logprobs)
        held: list[Any] = []  # logprobs of tokens whose text is held back: they go with the next text

        def events(items: list[Delta], merge: bool) -> bytes:
            # A delta can be empty while the detokenizer holds back a partial character: no event for it.
            nonlocal held
            out = []
            for group in ([items] if merge else [[d] for d in items]):
                text = group[0].text if len(group) == 1 else "".join(d.text for d in group)
                for d in group:
                    if d.logprobs:
                        held.extend(d.logprobs)
                if text:
                    if text_event is not None:
                        out.append(text_event(text))
                    else:
                        out.append(sse(r.text_chunk(text, held if r.logprobs else None)))
                        held = []
            return b"".join(out)

        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            opening = r.first_chunk()
            head = sse(opening) if opening is not None else b""
            items = self.first
            behind = False
            while not pump.gone:
                if items:
                    # Deltas that came in a burst while we waited: one event each, written together. Deltas
                    # that came while the last write was blocked (the client reads slower than the stream):
                    # merged into one event.
                    body = head + events(items, behind)
                    head = b""
                    if body:
                        seen = pump.received
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                        behind = pump.received != seen  # the reader only runs while this task waits
                elif pump.error is not None:
                    exc = pump.error
                    if not isinstance(exc, errors.SplitserveError):
                        raise exc
                    # Headers are gone: the error travels as an event (the openai client raises APIError on it).
                    body = head + sse(oa.api_error_from(exc, kind=r.kind).body()) + DONE
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    break
                elif pump.done:
                    result = pump.relay.result
                    body = head + sse(r.finish_chunk(result))
                    if r.include_usage:
                        body += sse(r.usage_chunk(result))
                    await send({"type": "http.response.body", "body": body + DONE, "more_body": True})
                    break
                items = await pump.take()
            else:
                return  # the caller is gone: nothing more to send
        except Exception as exc:  # a bug mid-stream: tell the caller in-band rather than cutting the stream
            if pump.gone:
                return
            log.exception("stream_failed", request_id=pump.relay.request_id, error=str(exc))
            err = internal_error(pump.relay.request_id)
            await send({"type": "http.response.body", "body": sse(err.body()) + DONE, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            with contextlib.suppress(OSError):  # the connection broke under a send: a disconnect too
                await self._pump(send)
        finally:
            await self.pump.close()


# ---------------------------------------------------------------------------------------------- the app

R = TypeVar("R", bound=BaseModel)

# A \uD800-\uDFFF escape somewhere in the raw body: only then is the decoded data walked (it is rare).
_LONE_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _encodable(data: Any) -> bool:
    """Every string (keys too) of decoded JSON encodes to UTF-8. Iterative: the data may be deeply nested."""
    todo = [data]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return False
    return True


async def parse_body(request: Request, model: type[R]) -> R:
    """The body as JSON whatever its Content-Type says (``curl -d`` sends a form type; OpenAI accepts it),
    validated into ``model``; every failure is a 400 naming the offending field (413 for an oversize body,
    408 for one that does not arrive in time), never a 500: a malformed body is the caller's error."""
    too_large = oa.ApiError(413, f"request body over {MAX_BODY_BYTES // (1024 * 1024)} MiB", code="payload_too_large")
    declared = request.headers.get("content-length")
    # Refused before a byte of it is read (the declared size is checked again against what really arrives).
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
        raise too_large if declared.isdigit() else oa.ApiError(400, "invalid Content-Length header")
    chunks: list[bytes] = []
    size = 0
    try:
        with anyio.fail_after(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise oa.ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
                          code="request_timeout") from None
    raw = b"".join(chunks)
    try:
        data = json.loads(raw)
    except RecursionError:  # deeper than the parser's stack allows
        raise oa.ApiError(400, "The JSON body of your request is nested too deeply.") from None
    except ValueError:  # invalid JSON, invalid UTF-8, an integer of more digits than Python converts
        raise oa.ApiError(400, "We could not parse the JSON body of your request: it is not valid JSON.") from None
    if not isinstance(data, dict):
        raise oa.ApiError(400, "The request body must be a JSON object.")
    if _LONE_SURROGATE.search(raw) and not _encodable(data):
        # JSON's \\ud800 escapes decode to strings no UTF-8 encoder (msgpack, the tokenizer) accepts later.
        raise oa.ApiError(400, "The JSON body of your request has a string with an unpaired UTF-16 surrogate.")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise oa.api_error_from_validation(exc) from None
    except RecursionError:  # pydantic's own guard normally answers first; this is the last line
        raise oa.ApiError(400, "The JSON body of your request is nested too deeply.") from None
    for name in oa.unknown_fields_once(body.model_extra):
        log.warning("unknown_request_field_ignored", field=name, path=request.url.path,
                    note="logged once per field name")
    return body



def create_app(backend: Backend, *, api_keys: dict[str, str] | None = None, docs: bool = False,
               per_key_concurrency: int = PER_KEY_CONCURRENCY, auth_throttle: AuthThrottle | None = None) -> FastAPI:
    """The public HTTP surface. ``/metrics`` is not on it (it names every tenant): see
    :func:`create_metrics_app`, served on its own port. ``docs`` turns on /docs, /redoc and /openapi.json
    (off by default: they map the whole surface for whoever asks)."""
    app = FastAPI(title="splitserve OpenAI-compatible API", docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    auth = Authenticator(api_keys)
    throttle = auth_throttle or AuthThrottle()
    app.state.auth_throttle = throttle  # the console's key checks count against the same budget
    limits = KeyConcurrency(per_key_concurrency)
    inflight: dict[str, str] = {}  # request id -> tenant, on this process only
    app.state.inflight = inflight
    started = int(time.time())
    app.add_middleware(RequestIdMiddleware)
    # HTTP server metrics of this process (http_requests_total, http_request_duration_seconds...: the names
    # vLLM's own server exposes, from the same library), beside the cluster's series on /metrics.
    http_registry = CollectorRegistry()
    app.state.http_registry = http_registry
    Instrumentator(excluded_handlers=["/metrics"], registry=http_registry).instrument(app)
    # The standard ASGI server span (outermost): it continues the caller's traceparent, and every span of the
    # request (client.generate, router, workers) is its child. Probes are not traced; nor are the per-chunk
    # send/receive events (one span per SSE chunk otherwise).
    app.add_middleware(OpenTelemetryMiddleware, excluded_urls="healthz,health,readyz,metrics",
                       exclude_spans=["receive", "send"])

    @app.exception_handler(oa.ApiError)
    async def _api_error(_: Request, exc: oa.ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = oa.api_error_from_validation(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = (f"Unknown request URL: {request.method} {request.url.path}" if exc.status_code == 404
               else str(exc.detail))
        err = oa.ApiError(exc.status_code, msg, code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # Runs outside the middleware stack (Starlette's last resort), so the request id is added here.
        rid = getattr(request.state, "request_id", "")
        log.error("unhandled_error", request_id=rid, error=repr(exc))
        err = internal_error(rid)
        return JSONResponse(err.body(), status_code=500, headers={REQUEST_ID_HEADER: rid} if rid else None)

    async def tenant_of(request: Request) -> str:
        # async on purpose: FastAPI runs a plain-def dependency in its thread pool, a thread hop (and two
        # wake-ups) on every request's critical path for a dict lookup.
        if auth.open:
            return "default"
        address = request.client.host if request.client else ""
        throttle.check(address)  # before the key is even looked at: a throttled guess learns nothing
        try:
            tenant, key_id = auth.authenticate(request.headers.getlist("authorization"))
        except oa.ApiError:
            throttle.failed(address)
            raise
        request.state.key_id = key_id
        return tenant

    def served_models() -> dict[str, int | None]:
        """The models known to be served, each with its max_model_len (see Backend); empty: none known yet."""
        models: dict[str, int | None] | None = getattr(backend, "served_models", None)
        if models is not None:
            return models
        name: str | None = getattr(backend, "served_model_name", backend.model_name)  # a one-model backend
        return {name: backend.max_model_len} if name else {}

    def served_adapters() -> dict[str, str]:
        """The LoRA adapters loaded on live decoders -> their base model (see Backend); empty: none."""
        adapters: dict[str, str] | None = getattr(backend, "served_adapters", None)
        return adapters or {}

    def not_found(model: str, served: dict[str, int | None]) -> oa.ApiError:
        # With one model served the message is OpenAI's own; with several it lists them (as the router does).
        names = list(served) + list(served_adapters())
        return oa.model_not_found(model, names if len(names) > 1 else None)

    def choose_model(requested: str | None) -> tuple[str, str | None, int | None]:
        """(the name answered with, the name the request travels with, that model's max_model_len) for the
        body's ``model``. It must be a served one or an adapter when any is known (else 404 listing them); none
        named: the only one, or with several the first (``served_models``' order: the routers' default first)."""
        served = served_models()
        if served:
            if requested:
                if requested in served:
                    return requested, requested, served[requested]
                parent = served_adapters().get(requested)
                if parent is None:
                    raise not_found(requested, served)
                return requested, requested, served.get(parent)  # an adapter: the router resolves its base
            first = next(iter(served))
            return first, first, served[first]
        # Not known (no decoder heard): the request goes on as asked (none named: the router's default), and the
        # router (which waits for decoders within its own bound, then answers a retryable 503) decides; a 404
        # here could be wrong.
        return requested or backend.model_name or "unknown", requested or None, backend.max_model_len

    async def serve(request: Request, args: oa.GenerateArgs, *, tenant: str, model: str,
                    route_model: str | None) -> Response:
        rid: str = request.state.request_id
        if rid in inflight:
            raise oa.ApiError(409, f"request id {rid} is already in flight", param=REQUEST_ID_HEADER,
                              code="duplicate_request_id")
        args = args.served(model=route_model, session_id=session_id_from(request.headers.get(SESSION_HEADER)))
        trace.get_current_span().set_attributes({"request_id": rid, "gen_ai.request.model": model,
                                                 "gen_ai.operation.name": "chat" if args.kind == "chat"
                                                 else "text_completion"})
        responder = oa.Responder(kind=args.kind, request_id=rid, model=model, created=int(time.time()),
                                 include_usage=args.include_usage, logprobs=args.logprobs is not None)
        release = limits.acquire(getattr(request.state, "key_id", b""))
        try:
            stream = backend.generate(args, tenant=tenant, request_id=rid)
        except errors.SplitserveError as exc:
            release()
            raise oa.api_error_from(exc, kind=args.kind) from None
        except BaseException:
            release()
            raise
        inflight[rid] = tenant

        def closed(r: str) -> None:  # the relay's guaranteed end (streams included): the key's slot is free
            inflight.pop(r, None)
            release()

        relay = Relay(stream, request_id=rid, cancel=backend.cancel_request, on_closed=closed)
        pump: Pump | None = None
        handed_over = False
        try:
            if args.stream:
                # Wait for the first token before sending headers, so that everything the router rejects
                # up front (too long, no workers, quota) still gets its own HTTP status.
                pump = Pump(relay, request.receive)
                first = await pump.take()
                if not first:
                    if pump.gone:
                        raise ClientGone
                    if pump.error is not None:
                        raise pump.error
                handed_over = True
                return EventStreamResponse(pump, responder, first)
            result = await or_disconnect(relay.drain, request.receive)
            return JSONResponse(responder.response(result))
        except errors.SplitserveError as exc:
            raise oa.api_error_from(exc, kind=args.kind) from None
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; the status is only for the access log
        except Exception as exc:
            log.exception("request_failed", request_id=rid, error=str(exc))
            raise internal_error(rid) from None
        finally:
            if not handed_over:
                await (pump.close() if pump is not None else relay.close())

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request, tenant: str = Depends(tenant_of)) -> Response:
        body = await parse_body(request, oa.ChatCompletionRequest)
        model, route_model, max_len = choose_model(body.model)
        args = oa.chat_args(body, default_max_tokens=max_len or FALLBACK_MAX_TOKENS)
        return await serve(request, args, tenant=tenant, model=model, route_model=route_model)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request, tenant: str = Depends(tenant_of)) -> Response:
        body = await parse_body(request, oa.CompletionRequest)
        model, route_model, _ = choose_model(body.model)
        return await serve(request, oa.completion_args(body), tenant=tenant, model=model, route_model=route_model)

    def model_card(name: str, max_model_len: int | None, parent: str | None = None) -> dict[str, Any]:
        # max_model_len as vLLM's server reports it (clients size prompts by it); null until a decoder announced.
        # An adapter's card names its base model as ``parent``, as vLLM's does (``root`` is its name here: the
        # adapter's path on the workers is not the tenants' business).
        return {"id": name, "object": "model", "created": started, "owned_by": "splitserve", "root": name,
                "parent": parent, "max_model_len": max_model_len}

    def may_use(tenant: str, model: str) -> bool:
        """The tenant's contract (the tenants file's ``models:``; absent: every model) allows ``model``: the
        router refuses the rest (model_not_allowed), so the list shows a tenant only what it may ask for."""
        tenants: TenantsConfig | None = getattr(backend, "tenants", None)
        return tenants is None or tenants.allows_model(tenant, model)

    @app.get("/v1/models")
    async def models(tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        served = served_models()
        if not served and backend.model_name:  # none known to be served: the name the router announces
            served = {backend.model_name: backend.max_model_len}
        cards = [model_card(name, max_len) for name, max_len in served.items() if may_use(tenant, name)]
        cards += [model_card(name, served.get(parent), parent) for name, parent in sorted(served_adapters().items())
                  if name not in served and may_use(tenant, name)]
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        served = served_models()
        if served:
            parent = None if model_id in served else served_adapters().get(model_id)
            if model_id not in served and parent is None:
                raise not_found(model_id, served)
            if not may_use(tenant, model_id):
                raise oa.ApiError(403, f"tenant {tenant!r} may not use model {model_id!r} (its models in the "
                                  "tenants file)", type="permission_error", code="model_not_allowed")
            return model_card(model_id, served.get(parent) if parent else served[model_id], parent)
        if model_id != backend.model_name:
            # Whether it is served is not known yet (no decoder heard): say so, retryably, never a wrong 404.
            raise oa.ApiError(503, "No decode worker has announced the model it serves yet; retry shortly.",
                              type="server_error", code="model_not_announced", retry_after_s=1)
        return model_card(model_id, backend.max_model_len)

    @app.get("/healthz")
    @app.get("/health")  # the path vLLM serves, which load generators such as GuideLLM probe
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", response_model=None)
    async def readyz() -> JSONResponse:
        # Open (probes carry no key): the detail names workers and the model, never a tenant.
        ready, detail = backend.readiness()
        return JSONResponse({"status": "ready" if ready else "not_ready", **detail},
                            status_code=200 if ready else 503)

    return app


def create_metrics_app(backend: Backend, public_app: FastAPI) -> Starlette:
    """``GET /metrics`` alone, for the metrics port (loopback unless the operator binds it wider): the
    cluster's series name every tenant, so they are not on the port tenants reach. The HTTP series are those
    of ``public_app`` (made by :func:`create_app`)."""
    http_registry: CollectorRegistry = public_app.state.http_registry

    async def metrics(_: Request) -> Response:
        return Response(backend.metrics() + generate_latest(http_registry), media_type=METRICS_CONTENT_TYPE)

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])
