"""The bus's stored terminals (``Bus.publish`` of a final or error): JetStream stores them when a stream
captures their subject, and where none does (no router has made the results stream yet) they are delivered
live only: a closing bus does not wait for them. "No responders" is also what a replicated stream answers
while it elects a leader (a node died), so the stored copy is tried again for ``NO_STREAM_GRACE_S`` before it
is taken as uncaptured: given up at once, a decoder's stored end was lost in a NATS-cluster node kill, the
router found no end and ended the request a second time (a duplicate terminal, seen in CI). Past that grace it
is given up only when JetStream says no stream takes it: on a loaded cluster an election outlasted the grace, a
stored end was lost, and a client that had lost the live end waited for it in vain (CI again).

nats-py reports a JetStream publish that no stream answers as ``NoStreamResponseError``, not as the
``NoRespondersError`` the bus caught: every such terminal was retried for five minutes (``durable_retries``
climbing), and ``Bus.close`` waited its full 10 s bound for them."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats.errors import NoRespondersError
from nats.js.api import StreamConfig
from nats.js.errors import ServiceUnavailableError

from splitserve import proto
from splitserve.natsserver import NatsCluster, NatsServer
from splitserve.proto import StreamFinal, Subjects
from splitserve.runtime import bus as bus_mod
from splitserve.runtime.bus import Bus


def _final(rid: str) -> StreamFinal:
    return StreamFinal(request_id=rid, seq=1, token_ids=[1], text="x", finish_reason="stop",
                       usage=proto.Usage(prompt_tokens=1, completion_tokens=1), route=proto.Route.DIRECT,
                       prefill_worker=None, decode_worker="decode-t")


async def test_a_terminal_no_stream_captures_is_live_only_and_close_does_not_wait(fresh_nats: NatsServer) -> None:
    watcher = await nats.connect(fresh_nats.url)
    got = await watcher.subscribe(Subjects.stream("acme", "r1"))
    await watcher.flush()
    bus = await Bus.connect(fresh_nats.url, "stored-t")
    try:
        # live on the stream subject; its stored copy goes to ss.result.acme.r1, which nothing captures
        await bus.publish(Subjects.stream("acme", "r1"), _final("r1"))
        msg = await got.next_msg(timeout=5)  # delivered live
        assert proto.decode_stream(msg.data).request_id == "r1"
        await asyncio.sleep(0.5)
        assert bus.durable_retries == 0
    finally:
        t0 = time.monotonic()
        await bus.close()
        closed_s = time.monotonic() - t0
        await watcher.close()
    assert closed_s < 5.0, f"close waited {closed_s:.1f}s for terminals no stream stores"


async def test_a_terminal_a_stream_captures_is_stored(fresh_nats: NatsServer) -> None:
    nc = await nats.connect(fresh_nats.url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=Subjects.RESULTS_STREAM, subjects=[Subjects.RESULTS_ALL]))
    bus = await Bus.connect(fresh_nats.url, "stored-t")
    try:
        await bus.publish(Subjects.result("acme", "r2"), _final("r2"))
        await bus.flush_stored(timeout=5)
        assert not bus.unconfirmed
        raw = await js.get_last_msg(Subjects.RESULTS_STREAM, Subjects.result("acme", "r2"))
        assert proto.decode_stream(raw.data or b"").request_id == "r2"
    finally:
        await bus.close()
        await nc.close()


async def test_a_terminal_whose_stream_answers_no_responders_for_a_while_is_still_stored(
        fresh_nats: NatsServer) -> None:
    """As during a leader election: no stream answers at first, then one does; the end is stored, and the request
    stays unconfirmed (its worker keeps listing it) until it is."""
    nc = await nats.connect(fresh_nats.url)
    js = nc.jetstream()
    bus = await Bus.connect(fresh_nats.url, "stored-t")
    try:
        await bus.publish(Subjects.result("acme", "r3"), _final("r3"))
        await asyncio.sleep(1.0)
        assert bus.unconfirmed == {proto.request_key("acme", "r3"): 1}
        await js.add_stream(StreamConfig(name=Subjects.RESULTS_STREAM, subjects=[Subjects.RESULTS_ALL]))
        deadline = time.monotonic() + 10
        while bus.unconfirmed and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not bus.unconfirmed, "the terminal was given up while its stream was electing"
        raw = await js.get_last_msg(Subjects.RESULTS_STREAM, Subjects.result("acme", "r3"))
        assert proto.decode_stream(raw.data or b"").request_id == "r3"
    finally:
        await bus.close()
        await nc.close()


async def test_a_terminal_no_stream_captures_is_given_up_after_the_grace(fresh_nats: NatsServer,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """JetStream answers that no stream takes the subject: the stored copy is given up (not retried for minutes)."""
    monkeypatch.setattr(bus_mod, "NO_STREAM_GRACE_S", 0.5)
    bus = await Bus.connect(fresh_nats.url, "stored-t")
    try:
        await bus.publish(Subjects.result("acme", "r5"), _final("r5"))
        deadline = time.monotonic() + 10
        while bus.unconfirmed and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not bus.unconfirmed, "a terminal no stream takes was retried past the grace"
    finally:
        await bus.close()


@pytest.mark.slow
async def test_a_terminal_whose_stream_has_no_leader_past_the_grace_is_still_stored(
        nats_cluster: NatsCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two of three nodes die, the stream leader among them: the survivor answers "no responders" for longer than
    the grace. The stream exists, so the end is kept trying, and stored once the nodes are back."""
    monkeypatch.setattr(bus_mod, "NO_STREAM_GRACE_S", 1.0)
    admin = await nats.connect(servers=nats_cluster.urls)
    await admin.jetstream().add_stream(StreamConfig(name=Subjects.RESULTS_STREAM, subjects=[Subjects.RESULTS_ALL],
                                                    num_replicas=3))
    info = await admin.jetstream().stream_info(Subjects.RESULTS_STREAM)
    assert info.cluster is not None and info.cluster.leader in nats_cluster.names
    await admin.close()
    survivor = next(i for i, name in enumerate(nats_cluster.names) if name != info.cluster.leader)
    dead = [i for i in range(len(nats_cluster.nodes)) if i != survivor]
    for i in dead:
        nats_cluster.kill(i)
    bus = await Bus.connect(nats_cluster.nodes[survivor].url, "stored-t")
    try:
        await bus.publish(Subjects.result("acme", "r4"), _final("r4"))
        await asyncio.sleep(5.0)  # five graces without a leader
        assert bus.unconfirmed == {proto.request_key("acme", "r4"): 1}, "given up while its stream had no leader"
        for i in dead:
            nats_cluster.restart(i)
        deadline = time.monotonic() + 90
        while bus.unconfirmed and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not bus.unconfirmed, "not stored after the stream's nodes came back"
        nc = await nats.connect(servers=nats_cluster.urls)
        try:
            # The cluster just came back: a read may hear "JetStream temporarily unavailable" (503) or time out
            # while the nodes catch up; the stored end is what counts, so read until it answers.
            deadline = time.monotonic() + 60
            while True:
                try:
                    raw = await nc.jetstream().get_last_msg(Subjects.RESULTS_STREAM, Subjects.result("acme", "r4"))
                    break
                except (ServiceUnavailableError, nats.errors.TimeoutError, NoRespondersError):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
            assert proto.decode_stream(raw.data or b"").request_id == "r4"
        finally:
            await nc.close()
    finally:
        await bus.close()
