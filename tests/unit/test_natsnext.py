"""splitserve.runtime.natsnext.next_msg against a real nats-server: what nats-py's Subscription.next_msg does
(buffered messages in order, a timeout, a closed connection, the pending-bytes bookkeeping its slow-consumer
limit reads), without a task per message."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats import errors

from splitserve.natsserver import NatsServer
from splitserve.runtime.natsnext import next_msg


async def test_next_msg_as_nats_py_does(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        sub = await nc.subscribe("natsnext.t")
        for i in range(5):
            await nc.publish("natsnext.t", f"m{i}".encode())
        await nc.flush()
        got = [(await next_msg(sub, 1.0)).data for _ in range(5)]
        assert got == [b"m0", b"m1", b"m2", b"m3", b"m4"]
        assert sub.pending_bytes == 0 and sub.pending_msgs == 0

        t0 = time.monotonic()
        with pytest.raises(errors.TimeoutError):
            await next_msg(sub, 0.2)
        assert 0.15 < time.monotonic() - t0 < 2.0

        async def later() -> None:  # a message that arrives while it waits ends the wait
            await asyncio.sleep(0.1)
            await nc.publish("natsnext.t", b"late")

        task = asyncio.create_task(later())
        assert (await next_msg(sub, 5.0)).data == b"late"
        await task
    finally:
        await nc.close()
    with pytest.raises(errors.ConnectionClosedError):
        await next_msg(sub, 0.1)
