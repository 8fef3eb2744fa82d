"""``flush()`` is a barrier (splitserve.runtime.natsflush): once it returns, the server has every command sent
before it, so a subscription made just before is in place for a message another connection publishes next.

nats-py 2.16 wrote flush's PING straight to the socket, ahead of a SUB still queued: the server's protocol
trace showed PING before SUB, and about one message in ten published right after such a flush was dropped."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import nats

import splitserve.runtime.bus  # noqa: F401  (applies the fix, as every splitserve process does)
from splitserve.natsserver import start_nats


async def test_flush_ping_follows_the_queued_sub_on_the_wire(tmp_path: Path) -> None:
    log = tmp_path / "nats.log"
    srv = start_nats(tmp_path / "nats", extra_config="trace: true\n", log_file=log)
    try:
        nc = await nats.connect(srv.url, name="flush-order")
        await nc.subscribe("order.probe")
        await nc.flush()
        await nc.close()
        await asyncio.sleep(0.2)
    finally:
        srv.stop()
    text = log.read_text()
    cid = re.search(r'cid:(\d+) - <<- \[CONNECT .*"name": ?"flush-order"', text)
    assert cid, text[-2000:]
    ops = [m.group(1) for m in re.finditer(rf"cid:{cid.group(1)} - .*<<- \[(SUB order\.probe|PING)", text)]
    # the handshake's PING, then the SUB, then flush's PING (it was PING, PING, SUB)
    assert ops[:3] == ["PING", "SUB order.probe", "PING"], ops


async def test_a_message_published_after_flush_reaches_the_fresh_subscription(tmp_path: Path) -> None:
    srv = start_nats(tmp_path / "nats")
    lost: list[int] = []
    try:
        pub = await nats.connect(srv.url)
        for k in range(150):
            sub_nc = await nats.connect(srv.url)
            got = asyncio.Event()

            async def on_msg(_: object, got: asyncio.Event = got) -> None:
                got.set()

            await sub_nc.subscribe(f"fresh.{k}.>", cb=on_msg)
            await sub_nc.flush()
            await pub.publish(f"fresh.{k}.x", b"hi")
            await pub.flush()
            try:
                await asyncio.wait_for(got.wait(), 5)
            except TimeoutError:
                lost.append(k)
            await sub_nc.close()
        await pub.close()
    finally:
        srv.stop()
    assert not lost, f"{len(lost)} of 150 lost: {lost[:10]}"
