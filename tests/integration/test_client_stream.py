"""The client's stream handling against a scripted responder on a real nats-server: out-of-order messages
are released in order; a message that never arrives (lost while a connection was down) becomes a prompt,
precise error instead of a wait for the idle timeout."""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats
import pytest
from nats.js.errors import BadRequestError

from splitserve import errors, proto
from splitserve.client import Client
from splitserve.natsserver import NatsServer
from splitserve.proto import Accepted, GenerateRequest, Route, StreamDelta, StreamFinal, Usage


async def _responder(url: str, seqs: list[int]) -> nats.NATS:
    """Answers every request with Accepted, then publishes the stream messages in the given seq order."""
    nc = await nats.connect(url)

    async def on_req(msg: object) -> None:
        req = proto.decode(msg.data, GenerateRequest)  # type: ignore[attr-defined]
        await nc.publish(msg.reply, proto.encode(Accepted(request_id=req.request_id, router_id="t",  # type: ignore[attr-defined]
                                                          prompt_tokens=1)))
        for seq in seqs:
            if seq < 3:
                m: object = StreamDelta(request_id=req.request_id, seq=seq, token_ids=[seq], text=f"t{seq}")
            else:
                m = StreamFinal(request_id=req.request_id, seq=seq, token_ids=[0, 1, 2], text="t0t1t2",
                                finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=3),
                                route=Route.DIRECT, prefill_worker=None, decode_worker="d")
            await nc.publish(req.stream_subject, proto.encode(m))  # type: ignore[arg-type]

    await nc.subscribe("ss.req.acme", cb=on_req)
    return nc


async def test_out_of_order_messages_are_released_in_order(nats_server: NatsServer) -> None:
    nc = await _responder(nats_server.url, [0, 2, 1, 3])
    try:
        async with Client(nats_server.url, tenant="acme") as c:
            gen = c.generate("x", max_tokens=3)
            seen = [d.seq async for d in gen]
        assert seen == [0, 1, 2]
        assert gen.result is not None and gen.result.text == "t0t1t2"
    finally:
        await nc.close()


async def test_lost_deltas_are_recovered_from_the_final(nats_server: NatsServer) -> None:
    nc = await _responder(nats_server.url, [0, 2, 3])  # seq 1 never comes, the final does
    try:
        async with Client(nats_server.url, tenant="acme", gap_timeout=30) as c:
            gen = c.generate("x", max_tokens=3)
            deltas = [d async for d in gen]
        assert [d.seq for d in deltas] == [0, 1]
        assert "".join(d.text for d in deltas) == "t0t1t2"  # the catch-up delta carries what was missed
        assert [t for d in deltas for t in d.token_ids] == [0, 1, 2]
        assert gen.result is not None and gen.result.text == "t0t1t2"
    finally:
        await nc.close()


async def test_a_lost_stream_message_is_a_prompt_precise_error(nats_server: NatsServer) -> None:
    nc = await _responder(nats_server.url, [0, 2])  # seq 1 never comes, nor the final
    try:
        async with Client(nats_server.url, tenant="acme", gap_timeout=0.5, idle_timeout=60) as c:
            t0 = time.monotonic()
            with pytest.raises(errors.SplitserveError) as ei:
                await c.complete("x", max_tokens=3)
            assert time.monotonic() - t0 < 10  # not the 60 s idle timeout
        assert "lost message seq 1" in ei.value.message and ei.value.retryable
    finally:
        await nc.close()
        await asyncio.sleep(0)


async def test_reconnect_resends_the_request_idempotently(fresh_nats: NatsServer) -> None:
    seen: list[str] = []
    nc = await nats.connect(fresh_nats.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)

    async def on_req(msg: object) -> None:
        req = proto.decode(msg.data, GenerateRequest)  # type: ignore[attr-defined]
        seen.append(req.request_id)
        await nc.publish(msg.reply, proto.encode(Accepted(request_id=req.request_id, router_id="t",  # type: ignore[attr-defined]
                                                          prompt_tokens=1)))
        if len(seen) == 2:  # only the re-sent request gets its (whole) answer
            await nc.publish(req.stream_subject, proto.encode(StreamFinal(
                request_id=req.request_id, seq=0, token_ids=[7], text="ok", finish_reason="length",
                usage=Usage(prompt_tokens=1, completion_tokens=1), route=Route.DIRECT, prefill_worker=None,
                decode_worker="d")))

    await nc.subscribe("ss.req.acme", cb=on_req)
    await nc.flush()  # the subscription is registered before the client sends (else its request may be lost)
    try:
        async with Client(fresh_nats.url, tenant="acme", idle_timeout=60) as c:
            task = asyncio.create_task(c.complete("x", max_tokens=1))
            deadline = time.monotonic() + 30
            while not seen:
                assert time.monotonic() < deadline, "the first send never arrived"
                await asyncio.sleep(0.05)
            await asyncio.to_thread(fresh_nats.restart)  # the answer to the first send would be lost
            res = await asyncio.wait_for(task, 45)
        assert res.text == "ok"
        assert len(seen) == 2 and seen[0] == seen[1]  # the same request id, sent again after the reconnect
    finally:
        await nc.close()


async def test_a_silent_stream_finds_its_stored_end(nats_server: NatsServer) -> None:
    """Every live message of a stream was lost (published into a connection that died: the publisher's NATS node)
    while the client's own connection stayed up, so nothing tells it so. Its end is stored durably; a stream
    silent for ``probe_s`` looks there, and the client gets the whole output long before its idle timeout."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    with contextlib.suppress(BadRequestError):  # this server's services made it already (a shared server)
        await js.add_stream(name=proto.Subjects.RESULTS_STREAM, subjects=[proto.Subjects.RESULTS_ALL],
                            allow_direct=True)

    async def on_req(msg: object) -> None:
        req = proto.decode(msg.data, GenerateRequest)  # type: ignore[attr-defined]
        await nc.publish(msg.reply, proto.encode(Accepted(request_id=req.request_id, router_id="t",  # type: ignore[attr-defined]
                                                          prompt_tokens=1)))
        final = StreamFinal(request_id=req.request_id, seq=3, token_ids=[0, 1, 2], text="t0t1t2",
                            finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=3),
                            route=Route.DIRECT, prefill_worker=None, decode_worker="d")
        await js.publish(proto.Subjects.result("acme", req.request_id), proto.encode(final))  # nothing live

    await nc.subscribe("ss.req.acme", cb=on_req)
    try:
        async with Client(nats_server.url, tenant="acme", idle_timeout=60, probe_s=0.5) as c:
            t0 = time.monotonic()
            gen = c.generate("x", max_tokens=3)
            deltas = [d async for d in gen]
            assert time.monotonic() - t0 < 10  # not the 60 s idle timeout
        assert "".join(d.text for d in deltas) == "t0t1t2" and [t for d in deltas for t in d.token_ids] == [0, 1, 2]
        assert gen.result is not None and gen.result.text == "t0t1t2"
    finally:
        await nc.close()


async def test_result_rides_out_a_results_store_that_does_not_answer_within_its_wait(fresh_nats: NatsServer) -> None:
    """``Client.result(wait=...)`` while the results store does not answer (its nodes electing a leader after one
    died: a direct get times out): it asks again until its wait is over, not raise at the first timeout (CI:
    test_cluster_routers' capped waves failed so)."""
    nc = await nats.connect(fresh_nats.url)
    silent = await nc.subscribe(f"$JS.API.DIRECT.GET.{proto.Subjects.RESULTS_STREAM}.>")  # takes it, never answers
    await nc.flush()
    final = StreamFinal(request_id="r9", seq=1, token_ids=[7], text="done", finish_reason="stop",
                        usage=Usage(prompt_tokens=1, completion_tokens=1), route=Route.DIRECT, prefill_worker=None,
                        decode_worker="d")

    async def store_back() -> None:
        await asyncio.sleep(1.0)
        await silent.unsubscribe()
        js = nc.jetstream()
        await js.add_stream(name=proto.Subjects.RESULTS_STREAM, subjects=[proto.Subjects.RESULTS_ALL],
                            allow_direct=True)
        await js.publish(proto.Subjects.result("acme", "r9"), proto.encode(final))

    back = asyncio.ensure_future(store_back())
    try:
        async with Client(fresh_nats.url, tenant="acme") as c:
            res = await c.result("r9", wait=30)
        assert res is not None and res.text == "done"
    finally:
        await back
        await nc.close()


async def test_a_resent_request_that_ended_meanwhile_is_accepted_not_refused(nats_server: NatsServer) -> None:
    """The router took the first attempt but its answer was lost (a node died under it); the job ran to its end
    before the client sent it again, so the re-send hears "already ended". That is this call's own request:
    accepted (its result is stored), not a bad request. A first attempt that hears it is still refused."""
    nc = await nats.connect(nats_server.url)
    heard: list[str] = []

    async def on_req(msg: nats.aio.msg.Msg) -> None:
        req = proto.decode(msg.data, GenerateRequest)
        heard.append(req.request_id)
        if req.request_id == "lost-answer" and heard.count("lost-answer") == 1:
            return  # taken, and the answer lost
        err = proto.StreamError(request_id=req.request_id, code=proto.ErrorCode.BAD_REQUEST,
                                message=f"request {req.request_id} already ended (ok); use a new request id")
        await nc.publish(msg.reply, proto.encode(err), headers=proto.headers_for(err))  # as a router answers

    await nc.subscribe("ss.req.acme", cb=on_req)
    try:
        async with Client(nats_server.url, tenant="acme", resend_s=0.5) as c:
            assert await c.submit("job", request_id="lost-answer") == "lost-answer"
            with pytest.raises(errors.BadRequest, match="already ended"):
                await c.submit("job", request_id="used-before")  # a caller re-using an id: still its error
        assert heard.count("lost-answer") == 2
    finally:
        await nc.close()
