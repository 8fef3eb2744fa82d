"""splitserve.runtime.natsnext against a real nats-server. next_msg: what nats-py's Subscription.next_msg does
(buffered messages in order, a timeout, a closed connection, the pending-bytes bookkeeping its slow-consumer
limit reads), without a task per message. subscribe_inline: every message to its handler in order from the read
loop, a failing handler costing only its message, unsubscribe and drain as usual."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats import errors

from splitserve.natsserver import NatsServer
from splitserve.runtime.natsnext import next_msg, subscribe_inline


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


async def test_subscribe_inline_hands_every_message_to_its_handler(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        got: list[bytes] = []

        def handler(msg: nats.aio.msg.Msg) -> None:
            if msg.data == b"boom":
                raise ValueError("handler failed")
            got.append(msg.data)

        sub = await subscribe_inline(nc, "inline.t", handler)
        other = await nc.subscribe("inline.other")
        for i in range(200):
            await nc.publish("inline.t", f"m{i}".encode())
        await nc.publish("inline.t", b"boom")  # logged and dropped: the read loop goes on
        await nc.publish("inline.t", b"after")
        await nc.publish("inline.other", b"still served")
        await nc.flush()
        deadline = time.monotonic() + 5
        while len(got) < 201 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert got == [f"m{i}".encode() for i in range(200)] + [b"after"]
        assert sub.pending_msgs == 0 and sub.pending_bytes == 0  # nothing counted as waiting: no slow consumer
        assert (await next_msg(other, 2.0)).data == b"still served"
        assert not nc.is_closed

        await sub.unsubscribe()
        await nc.publish("inline.t", b"gone")
        await nc.flush()
        await asyncio.sleep(0.1)
        assert got[-1] == b"after"

        await subscribe_inline(nc, "inline.d", lambda m: got.append(m.data))
        await nc.publish("inline.d", b"before drain")
        await nc.flush()
        await asyncio.wait_for(nc.drain(), 5)  # a drain waits on each subscription's queue: an inline one is empty
        assert got[-1] == b"before drain"
    finally:
        if not nc.is_closed:
            await nc.close()
