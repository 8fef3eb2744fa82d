"""Cheaper ways to read a subscription on the per-token path (nats-py is pinned: these use its queue).

``next_msg``: a cheaper ``Subscription.next_msg``.

nats-py's ``next_msg`` makes a uuid4, a task and an ``asyncio.wait_for`` for every message, even one already
buffered. A streamed request reads one message per token this way (the SDK's ``Generation``, the front door's
streams), so this takes a buffered message at once and otherwise waits on the queue under ``asyncio.timeout``,
with no task made. Unlike nats-py's, a wait is not cut short when the connection closes or the subscription
ends: it runs to its timeout (callers wait in slices of a second at most), and the next call raises
``ConnectionClosedError`` as nats-py's does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from nats import errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = structlog.get_logger("splitserve.natsnext")


async def next_msg(sub: Subscription, timeout: float) -> Msg:
    """The subscription's next message, waiting at most ``timeout`` seconds (raises ``nats.errors.TimeoutError``).
    For subscriptions made without a callback, as ``Subscription.next_msg``."""
    if sub._conn.is_closed:
        raise errors.ConnectionClosedError
    queue = sub._pending_queue
    if queue.empty():
        try:
            async with asyncio.timeout(timeout):
                msg = await queue.get()
        except TimeoutError:
            if sub._conn.is_closed:
                raise errors.ConnectionClosedError from None
            raise errors.TimeoutError from None
    else:
        msg = queue.get_nowait()
    # the bookkeeping nats-py's next_msg does (its slow-consumer limits count pending bytes)
    sub._pending_size -= len(msg.data)
    queue.task_done()
    return msg


class _Inline:
    """Stands in for a subscription's message queue (the methods nats-py calls on it): each message the read loop
    parses is handed to a synchronous handler at once, with no queue, no task per subscription and no task
    wake-up per message."""

    __slots__ = ("_handler", "_sub")

    def __init__(self, handler: Callable[[Msg], None]) -> None:
        self._handler = handler
        self._sub: Subscription | None = None

    def put_nowait(self, msg: Msg) -> None:
        if self._sub is not None:
            self._sub._pending_size -= len(msg.data)  # counted by the read loop before it queues a message
        try:
            self._handler(msg)
        except Exception:  # the handler runs inside nats-py's read loop: an exception there would end it
            log.exception("inline_handler_failed", subject=msg.subject)

    def empty(self) -> bool:
        return True

    def qsize(self) -> int:
        return 0

    def task_done(self) -> None:
        pass

    async def join(self) -> None:  # a drain waits for the queue to empty: it always is
        return None

    async def get(self) -> Msg:
        raise RuntimeError("an inline subscription has no queue to read")


async def subscribe_inline(nc: NATS, subject: str, handler: Callable[[Msg], None]) -> Subscription:
    """Subscribe with a synchronous handler called from the connection's read loop as each message arrives.

    For a subscription that lives as long as one request and sees one message per token (a router following a
    stream): nats-py's callback subscriptions make a task per subscription and route every message through an
    ``asyncio.Queue`` and a task wake-up, more than such a handler costs. The handler must be quick and must not
    block; an exception it raises is logged and the message dropped. Unsubscribe as usual."""
    inline = _Inline(handler)
    sub = await nc.subscribe(subject)
    inline._sub = sub
    early, sub._pending_queue = sub._pending_queue, inline  # type: ignore[assignment]
    if sub._message_iterator is not None:
        sub._message_iterator._queue = inline  # type: ignore[assignment]
    while not early.empty():  # anything the read loop queued while subscribe() awaited, in order
        inline.put_nowait(early.get_nowait())
    return sub
