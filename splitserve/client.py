"""The Python client for internal services.

    async with Client(tenant="search") as c:
        async for delta in c.generate("Hello", max_tokens=32):
            print(delta.text, end="")
        result = await c.complete("What is the capital of France?", chat=True)
        print(result.text, result.usage.cached_tokens, result.ttft_ms)

``generate`` returns a :class:`Generation`: iterate it for ordered deltas; after iteration ``.result``
holds the final :class:`Result`. Terminal errors raise a typed :class:`splitserve.errors.SplitserveError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NotFoundError
from opentelemetry import context as otel_context
from opentelemetry import trace

from splitserve import errors, proto
from splitserve.discovery import resolve_nats_url
from splitserve.obs import tracing
from splitserve.proto import (
    Accepted,
    CancelRequest,
    ChatMessage,
    ErrorCode,
    GenerateRequest,
    SamplingParams,
    StreamDelta,
    StreamError,
    StreamFinal,
)
from splitserve.runtime import natsnext
from splitserve.runtime.bus import Bus, NotAuthorized, PermissionDenied
from splitserve.runtime.bus import PayloadTooLarge as _BusPayloadTooLarge
from splitserve.tenancy import natsauth


@dataclass(frozen=True)
class Delta:
    request_id: str
    seq: int
    text: str
    token_ids: list[int]
    logprobs: list[proto.TokenLogprob] | None = None  # one per token id, when the request asked for them


@dataclass(frozen=True)
class Result:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: proto.Usage
    route: str
    prefill_worker: str | None
    decode_worker: str
    ttft_ms: float | None  # client-measured: request sent -> first delta received
    total_ms: float
    timings: proto.Timings
    decision: dict[str, Any]
    logprobs: list[proto.TokenLogprob] | None = None  # one per generated token, when asked for

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "route": self.route, "prefill_worker": self.prefill_worker,
            "decode_worker": self.decode_worker, "token_ids": self.token_ids, "text": self.text,
            "finish_reason": self.finish_reason, "usage": self.usage.model_dump(), "ttft_ms": self.ttft_ms,
            "total_ms": self.total_ms, "timings": self.timings.model_dump(), "decision": self.decision,
        }


def _to_result(final: StreamFinal, *, ttft_ms: float | None, total_ms: float) -> Result:
    return Result(
        request_id=final.request_id, text=final.text, token_ids=list(final.token_ids),
        finish_reason=final.finish_reason, usage=final.usage, route=final.route.value,
        prefill_worker=final.prefill_worker, decode_worker=final.decode_worker, ttft_ms=ttft_ms,
        total_ms=total_ms, timings=final.timings, decision=final.decision, logprobs=final.logprobs,
    )


class Generation:
    """One streaming request. Async-iterate for deltas; ``result`` is set when the stream ends."""

    def __init__(self, client: Client, req: GenerateRequest) -> None:
        self._client = client
        self.request = req
        self.request_id = req.request_id
        self.result: Result | None = None
        self.accepted: Accepted | None = None
        self._started = False
        self._server_ended = False  # the server sent a terminal error
        # The caller's trace context where generate() was called (its own span, or the HTTP front door's
        # incoming traceparent): client.generate continues it instead of starting a new trace.
        self._parent_ctx = otel_context.get_current()

    def __aiter__(self) -> AsyncIterator[Delta]:
        if self._started:
            raise RuntimeError("a Generation can be iterated only once")
        self._started = True
        return self._run()

    async def _run(self) -> AsyncIterator[Delta]:
        c = self._client
        bus = c._require()
        req = self.request
        sub = await bus.nc.subscribe(req.stream_subject)
        t0 = time.perf_counter()
        ttft: float | None = None
        # Not a *current* span across the yields below (a context attached in one step of an async
        # generator cannot be detached in another): made current only around the publish that carries it.
        span = tracing.tracer().start_span("client.generate", context=self._parent_ctx, attributes={
            "request_id": req.request_id, "tenant": req.tenant, "route.requested": req.route,
            "max_tokens": req.sampling.max_tokens, **tracing.gen_ai_of(req)})
        try:
            with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                reply = await c._send(req)
            self.accepted = reply
            expected = 0  # next seq to release
            emitted_text, emitted_tokens = 0, 0  # how much of the output has been yielded
            early: dict[int, Any] = {}
            gap_since: float | None = None  # a later message arrived while an earlier one is missing
            last_msg = time.perf_counter()
            seen_reconnects = bus.reconnects
            # This connection was re-established mid-request (its NATS node died, or a restart): messages were
            # lost, so the end comes from the final (it carries the whole output) or from its stored copy.
            recovering = False
            retried_gap = False  # a stuck gap gets one recovery attempt before it is an error
            last_poll = 0.0
            while True:
                # Whatever is still buffered waits behind a missing message.
                gap_since = (gap_since or time.perf_counter()) if early else None
                now = time.perf_counter()
                wait = c.idle_timeout - (now - last_msg)
                if gap_since is not None:
                    wait = min(wait, c.gap_timeout - (now - gap_since))
                msg: Any = None
                try:
                    # In slices, so a reconnect is noticed while waiting.
                    raw = await natsnext.next_msg(sub, max(0.05, min(wait, 1.0)))
                except (NatsTimeout, TimeoutError):
                    if bus.reconnects != seen_reconnects:
                        # The connection came back: what was published meanwhile is gone. Re-send the same
                        # request (idempotent: a router still running it re-accepts it, one that lost it runs
                        # it); the final message carries the whole output, so missed deltas are recovered, and
                        # a request that ended meanwhile is answered from its stored terminal message.
                        seen_reconnects = bus.reconnects
                        recovering = True
                        msg = await self._resend_or_stored(req)
                        gap_since, last_msg = None, time.perf_counter()
                        if msg is None:
                            continue
                    else:
                        now = time.perf_counter()
                        stuck = gap_since is not None and now - gap_since >= c.gap_timeout
                        silent = c.probe_s > 0 and now - last_msg >= c.probe_s and now - last_poll >= c.probe_s
                        if ((recovering or stuck) and now - last_poll >= 1.0) or silent:
                            # A silent stream may have ended unheard: its messages were published into a
                            # connection that died (the publisher's NATS node) while this one stayed up, so
                            # nothing here says they were lost. The end is stored durably: look for it.
                            last_poll = now
                            msg = await c._stored_terminal(req.tenant, req.request_id)
                        if msg is None and stuck:
                            if recovering:
                                gap_since = None  # expected after a reconnect: keep waiting for the final
                                continue
                            if not retried_gap:
                                # A message lost on another connection (the publisher's node died): ask the
                                # router whether the request still runs (or fetch its end if it is over).
                                retried_gap = True
                                msg = await self._resend_or_stored(req)
                                gap_since = None
                                if msg is None:
                                    continue
                            else:
                                # Core NATS drops what is published while a connection is down: say so now
                                # rather than wait out the idle timeout for a message that will never come.
                                raise errors.SplitserveError(
                                    f"the stream of request {req.request_id} lost message seq {expected} (the "
                                    f"connection to NATS was interrupted?); retry the request",
                                    code=ErrorCode.INTERNAL, request_id=req.request_id, retryable=True) from None
                        if msg is None:
                            if now - last_msg >= c.idle_timeout:
                                raise errors.Timeout(
                                    f"no token for request {req.request_id} within {c.idle_timeout:.0f}s",
                                    request_id=req.request_id) from None
                            continue
                if msg is None:
                    last_msg = time.perf_counter()
                    try:
                        msg = proto.decode_stream(raw.data)
                    except proto.ProtocolError as exc:
                        raise errors.SplitserveError(f"undecodable stream message: {exc.message}",
                                                     request_id=req.request_id) from None
                if not isinstance(msg, StreamError) and (getattr(msg, "seq", None) or 0) < expected:
                    continue  # already released (a stored final after the live one, a re-sent delta)
                if isinstance(msg, StreamError):
                    self._server_ended = True
                    raise errors.from_wire(msg)
                if isinstance(msg, StreamFinal) and msg.seq > expected:
                    # Deltas went missing but the final holds everything: release the rest as one delta.
                    early = {expected: StreamDelta(request_id=msg.request_id, seq=expected,
                                                   token_ids=list(msg.token_ids[emitted_tokens:]),
                                                   text=msg.text[emitted_text:],
                                                   logprobs=(msg.logprobs or [])[emitted_tokens:] or None),
                             expected + 1: msg}
                else:
                    early[msg.seq] = msg  # deltas and the final carry consecutive seq numbers
                while expected in early:
                    item = early.pop(expected)
                    expected += 1
                    if isinstance(item, StreamDelta):
                        if ttft is None:
                            ttft = (time.perf_counter() - t0) * 1000
                            span.set_attribute("ttft_ms", round(ttft, 2))
                        emitted_text += len(item.text)
                        emitted_tokens += len(item.token_ids)
                        yield Delta(request_id=item.request_id, seq=item.seq, text=item.text,
                                    token_ids=list(item.token_ids), logprobs=item.logprobs)
                    elif isinstance(item, StreamFinal):
                        self.result = _to_result(item, ttft_ms=ttft, total_ms=(time.perf_counter() - t0) * 1000)
                        tracing.set_attrs(span, route=item.route.value, finish_reason=item.finish_reason,
                                          completion_tokens=item.usage.completion_tokens,
                                          cached_tokens=item.usage.cached_tokens,
                                          prefill_worker=item.prefill_worker, decode_worker=item.decode_worker)
                        tracing.gen_ai_response(span, response_id=item.request_id, model=item.model,
                                                finish_reason=item.finish_reason,
                                                input_tokens=item.usage.prompt_tokens,
                                                output_tokens=item.usage.completion_tokens,
                                                cached_tokens=item.usage.cached_tokens)
                        return
        except BaseException as exc:
            if not isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
                tracing.record_error(span, exc)
                if isinstance(exc, errors.SplitserveError):
                    span.set_attribute("error.code", str(exc.code))
            raise
        finally:
            span.end()
            if self.accepted is not None and self.result is None and not self._server_ended:
                # The caller stopped reading (break, disconnect, idle timeout): stop the work server-side
                # too, so the request's KV and batch slot are freed instead of decoding to nobody.
                with contextlib.suppress(Exception):
                    await c.cancel(req.request_id, tenant=req.tenant, reason="the client stopped reading")
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _resend_or_stored(self, req: GenerateRequest) -> StreamFinal | StreamError | None:
        """Re-send the request (idempotent). None: a router has it (queued or running); the stream goes on.
        If it already ended, its stored terminal message (kept in the results stream) is returned instead."""
        c = self._client
        try:
            await c._send(req)
            return None
        except (errors.Unavailable, errors.Timeout):
            return None  # accepted before, so durably queued: it runs, and its end will come (or be stored)
        except errors.SplitserveError as exc:
            if exc.retryable:
                return None  # e.g. the queue's stream electing a leader: as above
            if not isinstance(exc, errors.BadRequest) or "already ended" not in str(exc):
                raise
            # Its end is stored once JetStream confirms it (a publisher whose node died retries until then).
            deadline = time.monotonic() + c.idle_timeout
            while True:
                stored = await c._stored_terminal(req.tenant, req.request_id)
                if stored is not None:
                    return stored
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.25)

    async def cancel(self, reason: str = "cancelled by the client") -> None:
        """Stop this request wherever it is; its stream then ends with finish_reason "cancelled"."""
        await self._client.cancel(self.request_id, tenant=self.request.tenant, reason=reason)

    async def collect(self) -> Result:
        async for _ in self:
            pass
        assert self.result is not None
        return self.result


class Client:
    """Async client. One NATS connection; many concurrent requests."""

    def __init__(
        self,
        nats_url: str | None = None,
        *,
        tenant: str | None = None,
        user: str | None = None,
        password: str | None = None,
        accept_timeout: float = 30.0,
        idle_timeout: float = 120.0,
        gap_timeout: float = 5.0,
        resend_s: float = 5.0,
        failover_s: float = 30.0,
        probe_s: float = 5.0,
        busy_retry_s: float = 10.0,
        bus: Bus | None = None,
        nkey_seed: str | None = None,
        inbox_prefix: str | None = None,
    ) -> None:
        # Credentials: explicit, else $SPLITSERVE_NATS_USER / _PASSWORD / _NKEY_SEED (as the CLI reads them).
        # A lent connection brings its own.
        if bus is None and user is None and nkey_seed is None:
            user = os.environ.get(natsauth.ENV_USER) or None
            password = password or os.environ.get(natsauth.ENV_PASSWORD) or None
            nkey_seed = None if user else os.environ.get(natsauth.ENV_NKEY_SEED) or None
        # The tenant defaults to the NATS user (a tenant's user is named after it), else "default".
        if tenant is None:
            tenant = user if user and not user.startswith("svc.") else "default"
        proto.subjects.check_token(tenant, "tenant")
        self.nats_url = resolve_nats_url(nats_url)
        self.tenant = tenant
        self.user = user
        self.password = password
        self.nkey_seed = nkey_seed
        # An authenticated tenant may only receive replies under its own inbox prefix (see
        # splitserve.tenancy.natsauth); derive it so request/reply works under those permissions.
        if inbox_prefix is None and (user or nkey_seed) and not (user or "").startswith("svc."):
            inbox_prefix = natsauth.tenant_inbox(tenant)
        self.inbox_prefix = inbox_prefix
        self.accept_timeout = accept_timeout
        self.idle_timeout = idle_timeout
        self.gap_timeout = gap_timeout  # how long a missing stream message may stay missing
        self.resend_s = resend_s  # an unanswered request is sent again after this long (idempotent)
        # how long "no router" may last where routers ran before (a restart, every router reconnecting after its
        # node died) before the request is refused: the time a router takes to come back, with room
        self.failover_s = failover_s
        # a stream silent this long looks for its stored end every probe_s (0: never; the idle timeout only)
        self.probe_s = probe_s
        # a retryable "busy" answer (the registry or queue unreachable while NATS elects a leader, the queue
        # full) is sent again after its retry_after, for up to this long (inside accept_timeout; 0: never)
        self.busy_retry_s = busy_retry_s
        self._router_seen = False
        # A service that already holds a connection (the HTTP front door) lends it: one connection per
        # process, and the lender, not this client, closes it.
        self._bus: Bus | None = bus
        self._owns_bus = bus is None

    async def connect(self) -> Client:
        if self._bus is not None:
            return self
        try:
            self._bus = await Bus.connect(self.nats_url, f"client:{self.tenant}", user=self.user,
                                          password=self.password, nkey_seed=self.nkey_seed,
                                          inbox_prefix=self.inbox_prefix, reconnect=True)
        except NotAuthorized as exc:
            hint = ("" if self.user or self.nkey_seed else
                    "; this server requires credentials: pass user=/password= (CLI: --user/--password, or "
                    f"${natsauth.ENV_USER}/${natsauth.ENV_PASSWORD})")
            raise errors.NotAuthorized(f"{exc}{hint}") from None
        except Exception as exc:
            raise errors.Unavailable(f"cannot connect to NATS at {self.nats_url}: {exc}") from None
        if self.inbox_prefix is None:
            # A tenant may not publish spans (only its own request subjects): its spans are not exported, the
            # trace context still travels with its requests.
            tracing.setup_tracing("client", f"client-{uuid.uuid4().hex[:8]}", self._bus)
        return self

    async def close(self) -> None:
        if self._bus is not None and self._owns_bus:
            with contextlib.suppress(Exception):  # this process's spans leave on this connection
                await tracing.flush_tracing(2.0)
            await self._bus.close()
        self._bus = None

    async def __aenter__(self) -> Client:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def cancel(self, request_id: str, *, tenant: str | None = None,
                     reason: str = "cancelled by the client") -> None:
        """Cancel a request by id (streaming or submitted): workers stop it and free its KV; its stream ends
        with finish_reason "cancelled" and what was generated so far."""
        t = tenant or self.tenant
        await self._require().publish(proto.Subjects.cancel(t), CancelRequest(request_id=request_id, tenant=t,
                                                                              reason=reason))

    def _require(self) -> Bus:
        if self._bus is None:
            raise RuntimeError("Client is not connected: use 'async with Client(...)' or await connect()")
        return self._bus

    def generate(self, prompt: str | Sequence[dict[str, str]] | Sequence[int], **kw: Any) -> Generation:
        """Start a streaming request. ``prompt`` is text (``chat=True`` wraps it as one user message), a list of
        chat messages (``{"role", "content"}``), or a list of token ids. Options: ``max_tokens``,
        ``temperature``, ``top_p``, ``seed``, ``stop``, ``ignore_eos`` (always generate ``max_tokens``: load
        tests), ``min_tokens``, ``logprobs`` (k: each token's log-probability and the k most likely),
        ``session_id``, ``request_id``, ``timeout`` (a
        deadline in seconds), ``priority``, ``route``, ``model`` (a served model's name; none: the routers'
        default; a name not served raises ``errors.ModelNotFound``, one the tenant may not use
        ``errors.ModelNotAllowed``), ``cache_salt`` (splits the tenant's prefix cache further:
        requests reuse each other's cached prefixes only with the same salt; it never reaches another tenant's),
        and ``tenant`` (overrides the client's own for this request: a gateway serving many tenants over one
        connection)."""
        return Generation(self, self._build(prompt, **kw))

    async def submit(self, prompt: str | Sequence[dict[str, str]] | Sequence[int], **kw: Any) -> str:
        """An async job: returns the request id as soon as the router accepted it. The result is kept (per
        tenant, for the router's results TTL) on ``ss.result.{tenant}.{id}``: fetch it with :meth:`result`,
        or subscribe to that subject to have it delivered."""
        req = self._build(prompt, async_job=True, **kw)
        await self._send(req)
        return req.request_id

    async def _stored_terminal(self, tenant: str, request_id: str) -> StreamFinal | StreamError | None:
        """The request's terminal message as stored in the results stream (every request's end is kept there,
        see :mod:`splitserve.runtime.bus`), or None (not ended, not stored, or the store not reachable now)."""
        js = self._require().nc.jetstream()
        try:
            raw = await js.get_last_msg(proto.Subjects.RESULTS_STREAM, proto.Subjects.result(tenant, request_id),
                                        direct=True)
            msg = proto.decode_stream(raw.data or b"")
        except Exception:
            return None
        return msg if isinstance(msg, (StreamFinal, StreamError)) else None

    async def result(self, request_id: str, *, tenant: str | None = None, wait: float = 0.0) -> Result | None:
        """A submitted job's result: None while it is still running (after waiting up to ``wait`` seconds);
        raises the job's typed error if it failed."""
        from nats.js.errors import NotFoundError

        js = self._require().nc.jetstream()
        subject = proto.Subjects.result(tenant or self.tenant, request_id)
        deadline = time.monotonic() + wait
        # Direct get by subject: the request subject is $JS.API.DIRECT.GET.SS_RESULTS.<subject>, which a
        # tenant's permissions allow for its own results only (the general JetStream API is not open to it).
        direct = True
        while True:
            try:
                raw = await js.get_last_msg(proto.Subjects.RESULTS_STREAM, subject, direct=direct)
            except NoRespondersError:
                if direct and self.inbox_prefix is None:
                    direct = False  # a results stream created before allow_direct: the plain API still works
                    continue
                # Within the wait, ride it out: the store's nodes may be electing a leader (a node died)
                if time.monotonic() < deadline:
                    await asyncio.sleep(min(0.5, max(0.01, deadline - time.monotonic())))
                    continue
                raise errors.Unavailable(f"the results store {proto.Subjects.RESULTS_STREAM} does not answer "
                                         f"(no router has created it yet?)", request_id=request_id) from None
            except (NatsTimeout, TimeoutError):
                if time.monotonic() < deadline:
                    continue  # as above: a request that already waited its timeout
                raise errors.Timeout(f"the results store did not answer for request {request_id}",
                                     request_id=request_id) from None
            except NotFoundError:
                if time.monotonic() >= deadline:
                    return None
                await asyncio.sleep(min(0.25, max(0.01, deadline - time.monotonic())))
                continue
            msg = proto.decode_stream(raw.data or b"")
            if isinstance(msg, StreamError):
                raise errors.from_wire(msg)
            if isinstance(msg, StreamFinal):
                return _to_result(msg, ttft_ms=None, total_ms=msg.timings.total_ms or 0.0)
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.25)

    async def _routers_ran(self, req: GenerateRequest) -> bool:
        """Whether routers served this NATS before: they create the results stream, which answers a direct get of
        one of this tenant's own subjects (a fresh process has not been answered yet, yet a router restarting is
        no reason to fail it)."""
        js = self._require().nc.jetstream()
        try:
            await js.get_last_msg(proto.Subjects.RESULTS_STREAM, proto.Subjects.result(req.tenant, req.request_id),
                                  direct=True)
        except NotFoundError:
            return True  # the stream is there; this request has no result yet (of course)
        except Exception:
            return False  # no such stream (no responder for its API), or no right to ask: no sign of routers
        return True

    async def _send(self, req: GenerateRequest) -> Accepted:
        """Hand a request to a router: Accepted, or the precise reason it was not.

        Re-sent (same request id: the router and the queue de-duplicate it) when this connection is
        re-established while waiting, when no answer came within ``resend_s`` (the router's NATS node may have
        died with the answer in flight), and while "no responders" lasts up to ``failover_s`` where routers ran
        before (answered this client, or made the results stream: a router restarting, every router reconnecting
        after its node died). Where no router ever ran (no stack), "no router" is the answer at once."""
        bus = self._require()
        subject = proto.Subjects.request(req.tenant)
        deadline = time.monotonic() + self.accept_timeout
        busy_until = time.monotonic() + self.busy_retry_s
        no_router_since: float | None = None
        attempts = 0
        while True:
            attempts += 1
            resent = attempts > 1  # an earlier attempt of this call may have been taken (its answer lost)
            remaining = deadline - time.monotonic()
            reconnected = bus.next_reconnect()
            attempt = asyncio.ensure_future(bus.request(subject, req, Accepted,
                                                        timeout=max(0.05, min(remaining, self.resend_s))))
            try:
                racing: set[asyncio.Future[Any]] = {attempt, reconnected}
                await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                attempt.cancel()
                raise
            finally:
                reconnected.cancel()
            if not attempt.done():
                attempt.cancel()  # this connection came back: the request or its answer may be lost
                with contextlib.suppress(BaseException):
                    await attempt
                if time.monotonic() < deadline:
                    continue
            try:
                reply = attempt.result()
            except _BusPayloadTooLarge as exc:
                raise errors.PayloadTooLarge(str(exc), request_id=req.request_id) from None
            except NoRespondersError:
                now = time.monotonic()
                if no_router_since is None:
                    no_router_since = now
                    self._router_seen = self._router_seen or await self._routers_ran(req)
                    if self._router_seen:
                        trace.get_current_span().add_event("waiting_for_router", {"failover_s": self.failover_s})
                if self._router_seen and now - no_router_since < self.failover_s and now < deadline:
                    await asyncio.sleep(0.1)
                    continue
                raise errors.Unavailable(f"no router is serving requests at {self.nats_url}",
                                         request_id=req.request_id) from None
            except PermissionDenied as exc:
                raise errors.NotAuthorized(f"tenant {req.tenant!r} is not permitted with these credentials: "
                                           f"{exc}", request_id=req.request_id) from None
            except (NatsTimeout, TimeoutError, asyncio.CancelledError):
                if time.monotonic() < deadline:
                    continue
                raise errors.Timeout(f"no router answered within {self.accept_timeout:.0f}s",
                                     request_id=req.request_id) from None
            except (OSError, ConnectionClosedError) as exc:
                # the socket broke under the request (its server died): nats-py reconnects; send it again (the
                # request id makes that idempotent)
                if time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                    continue
                raise errors.Unavailable(f"lost the connection to NATS at {self.nats_url}: {exc!r}",
                                         request_id=req.request_id) from None
            self._router_seen = True
            if isinstance(reply, StreamError):
                if (resent and reply.code is ErrorCode.BAD_REQUEST and "already ended" in reply.message
                        and reply.request_id == req.request_id):
                    # An earlier attempt of this very call was accepted (its answer lost), and the request ran
                    # to its end since: it is accepted. Its messages went to the stream subscribed before the
                    # send (or its stored end is fetched, as after any gap); a submitted job's result is stored.
                    return Accepted(request_id=req.request_id, router_id="", prompt_tokens=0)
                if reply.code is ErrorCode.BUSY and reply.retryable:
                    now = time.monotonic()
                    wait = max(0.05, (reply.retry_after_ms or 500.0) / 1000)
                    if now + wait < min(busy_until, deadline):
                        trace.get_current_span().add_event("busy_retry", {"reason": reply.message,
                                                                          "retry_after_s": round(wait, 3)})
                        await asyncio.sleep(wait)
                        continue
                raise errors.from_wire(reply)
            return reply

    def _build(
        self,
        prompt: str | Sequence[dict[str, str]] | Sequence[int],
        *,
        chat: bool = False,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        min_tokens: int = 0,
        logprobs: int | None = None,
        session_id: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        route: Literal["auto", "direct", "disaggregated"] = "auto",
        tenant: str | None = None,
        async_job: bool = False,
        model: str | None = None,
        cache_salt: str | None = None,
    ) -> GenerateRequest:
        rid = request_id or uuid.uuid4().hex
        tenant = self.tenant if tenant is None else tenant
        fields: dict[str, Any] = {}
        if isinstance(prompt, str):
            if chat:
                fields["messages"] = [ChatMessage(role="user", content=prompt)]
            else:
                fields["prompt"] = prompt
        elif prompt and all(isinstance(x, int) for x in prompt):
            fields["prompt_token_ids"] = list(prompt)  # type: ignore[arg-type]
        else:
            fields["messages"] = [ChatMessage.model_validate(m) for m in prompt]
        try:
            req = GenerateRequest(
                request_id=rid, tenant=tenant,
                sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                        stop=list(stop), ignore_eos=ignore_eos, min_tokens=min_tokens,
                                        logprobs=logprobs),
                session_id=session_id,
                stream_subject=(proto.Subjects.result if async_job else proto.Subjects.stream)(tenant, rid),
                deadline_ms=None if timeout is None else proto.now_ms() + timeout * 1000, priority=priority,
                route=route, stream=not async_job, model=model, cache_salt=cache_salt, **fields,
            )
        except ValueError as exc:
            raise errors.BadRequest(str(exc), request_id=rid) from None
        return req

    async def complete(self, prompt: str | Sequence[dict[str, str]] | Sequence[int], **kw: Any) -> Result:
        """Non-streaming: wait for the whole result."""
        return await self.generate(prompt, **kw).collect()


def complete_sync(prompt: str | Sequence[dict[str, str]] | Sequence[int], *, nats_url: str | None = None,
                  tenant: str | None = None, user: str | None = None, password: str | None = None,
                  **kw: Any) -> Result:
    """Blocking one-shot helper for scripts."""

    async def go() -> Result:
        async with Client(nats_url, tenant=tenant, user=user, password=password) as c:
            return await c.complete(prompt, **kw)

    return asyncio.run(go())


class SyncClient:
    """Blocking client for code without an event loop: the async :class:`Client` runs on a private loop in a
    background thread; streaming yields deltas as they arrive.

        with SyncClient(tenant="search") as c:
            for delta in c.generate("Once upon a time", max_tokens=16):
                print(delta.text, end="")
            print(c.complete("What is the capital of France?", chat=True).text)
    """

    def __init__(self, nats_url: str | None = None, **kw: Any) -> None:
        import threading

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="splitserve-client", daemon=True)
        self._thread.start()
        self._client = Client(nats_url, **kw)
        try:
            self._call(self._client.connect())
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompt: str | Sequence[dict[str, str]] | Sequence[int], **kw: Any) -> Iterator[Delta]:
        """Stream deltas. Stopping early (break) cancels the request server-side."""
        gen = self._client.generate(prompt, **kw)
        it = cast(AsyncGenerator[Delta, None], gen.__aiter__())
        try:
            while True:
                try:
                    yield self._call(it.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._call(it.aclose())  # runs the generation's cleanup (and cancel, if it did not finish)

    def complete(self, prompt: str | Sequence[dict[str, str]] | Sequence[int], **kw: Any) -> Result:
        return self._call(self._client.complete(prompt, **kw))  # type: ignore[no-any-return]

    def cancel(self, request_id: str, **kw: Any) -> None:
        self._call(self._client.cancel(request_id, **kw))

    def submit(self, prompt: str | Sequence[dict[str, str]] | Sequence[int], **kw: Any) -> str:
        return self._call(self._client.submit(prompt, **kw))  # type: ignore[no-any-return]

    def result(self, request_id: str, **kw: Any) -> Result | None:
        return self._call(self._client.result(request_id, **kw))  # type: ignore[no-any-return]

    def close(self) -> None:
        if self._loop.is_running():
            with contextlib.suppress(Exception):
                self._call(self._client.close())
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
