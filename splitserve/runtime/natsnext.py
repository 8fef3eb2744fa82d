"""A cheaper ``Subscription.next_msg`` for the per-token path (nats-py is pinned: this reads its queue).

nats-py's ``next_msg`` makes a uuid4, a task and an ``asyncio.wait_for`` for every message, even one already
buffered. A streamed request reads one message per token this way (the SDK's ``Generation``, the front door's
streams), so this takes a buffered message at once and otherwise waits on the queue under ``asyncio.timeout``,
with no task made. Unlike nats-py's, a wait is not cut short when the connection closes or the subscription
ends: it runs to its timeout (callers wait in slices of a second at most), and the next call raises
``ConnectionClosedError`` as nats-py's does.
"""

from __future__ import annotations

import asyncio

from nats import errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription


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
