"""The prefill -> decode hand-off (``PrefillDone`` on ``ss.decode.{worker}.kvready``) against a real nats-server:
delivered until the decoder answers, taken once (splitserve.services.common.handoff).

In an hour of chaos one hand-off was lost with a nats-server killed: the decoder held the KV reservation for
its 300 s lease (listed in its heartbeats, so no router thought the request lost) and the request never ran.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import nats
import pytest
import structlog

from splitserve import proto
from splitserve.natsserver import NatsServer
from splitserve.proto import (
    DecodeJob,
    KvHandle,
    PrefillDone,
    PrefillDoneAck,
    Route,
    SamplingParams,
    StreamFinal,
    Subjects,
)
from splitserve.runtime.bus import Bus
from splitserve.services.common import handoff
from tests.procs import spawn_service, stop, wait_ready


def _done(decoder: str, rid: str = "h1", transfer: str = "t-unknown") -> PrefillDone:
    job = DecodeJob(request_id=rid, tenant="t", prompt_token_ids=[1, 2, 3, 4, 5], stream_subject=f"ss.stream.t.{rid}",
                    sampling=SamplingParams(max_tokens=4), route=Route.DISAGGREGATED, decoder_id=decoder,
                    prefill_worker="prefill-h", created_ms=proto.now_ms())
    kv = KvHandle(transfer_id=transfer, num_tokens=5, kv_bytes=0, transport="tcp", prefill_ms=1.0, transfer_ms=0.0)
    return PrefillDone(request_id=rid, first_token=7, kv=kv, decode=job)


async def test_hand_over_is_sent_again_until_answered(fresh_nats: NatsServer) -> None:
    """The first copy goes unanswered (as if lost): the prefiller sends it again, and is done once answered;
    with no decoder at all it gives up at once (the router moves requests of a dead decoder)."""
    bus = await Bus.connect(fresh_nats.url, "prefill-h")
    dec = await nats.connect(fresh_nats.url)
    got: list[bytes] = []

    async def decoder(msg: Any) -> None:
        got.append(msg.data)
        if len(got) > 1:  # the first one "lost": no answer
            await msg.respond(proto.encode(PrefillDoneAck(request_id="h1", transfer_id="t-unknown")))

    try:
        await dec.subscribe(Subjects.kv_ready("decode-h"), cb=decoder)
        await dec.flush()
        log = structlog.get_logger("test")
        assert await handoff.hand_over(bus, Subjects.kv_ready("decode-h"), _done("decode-h"), log)
        assert len(got) == 2 and got[0] == got[1]  # the same hand-off, twice
        t0 = asyncio.get_running_loop().time()
        assert not await handoff.hand_over(bus, Subjects.kv_ready("nobody"), _done("nobody"), log)
        assert asyncio.get_running_loop().time() - t0 < handoff.ACK_TIMEOUT_S  # no responders: not retried
    finally:
        await dec.close()
        await bus.close()


@pytest.mark.slow
async def test_a_decoder_answers_every_copy_and_runs_the_request_once(fresh_nats: NatsServer, tmp_path: Path) -> None:
    """A real decoder (mock engine) gets the same hand-off twice, as a prefiller sends it when the first answer is
    lost: both copies are answered, the request runs once (one final message). Its transfer is unknown to the
    decoder, so it prefills locally: a second run would be a second final."""
    url, logs = fresh_nats.url, tmp_path / "logs"
    procs: list[subprocess.Popen[bytes]] = [spawn_service(
        "splitserve.services.decode", "--engine", "mock", "--transport", "tcp", nats_url=url, worker_id="decode-h",
        log_dir=logs)]
    try:
        await wait_ready(url, ["decode-h"], timeout=180)
        nc = await nats.connect(url)
        try:
            finals: list[StreamFinal] = []

            async def on_stream(msg: Any) -> None:
                m = proto.decode_stream(msg.data)
                if isinstance(m, StreamFinal):
                    finals.append(m)

            await nc.subscribe("ss.stream.t.h1", cb=on_stream)
            await nc.flush()
            done = proto.encode(_done("decode-h"))
            for _ in range(2):
                reply = await nc.request(Subjects.kv_ready("decode-h"), done, timeout=10)
                ack = proto.decode(reply.data, PrefillDoneAck)
                assert (ack.request_id, ack.transfer_id) == ("h1", "t-unknown")
            for _ in range(100):
                if finals:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(2.0)  # time for a second run to show
        finally:
            await nc.close()
    finally:
        stop(*procs)
    assert len(finals) == 1, finals
    lines = [json.loads(x) for x in (logs / "decode-h.log").read_text().splitlines() if x.startswith("{")]
    assert sum(x.get("event") == "kv_unusable_prefilling_locally" for x in lines) == 1


@pytest.mark.slow
async def test_a_landed_reservation_whose_hand_off_never_comes_is_dropped(fresh_nats: NatsServer,
                                                                          tmp_path: Path) -> None:
    """The prefiller reserved and pushed the KV (it landed), then its hand-off never arrived (every copy lost, or
    the prefiller died right after the push). The decoder used to hold and list the reservation for its 300 s
    lease, so no router moved the request; it now drops it after ``--handoff-grace-s`` (its routers' orphan
    check moves the request), and a hand-off that still comes later runs (prefilled locally): nothing lost."""
    from splitserve.engines.mock import MockEngine
    from splitserve.kv import BlockPool
    from splitserve.kv.transport import make_sender
    from splitserve.proto import Heartbeat, KvReserveReply, KvReserveRequest
    from splitserve.services.common.kvcache import kv_layout

    url, logs = fresh_nats.url, tmp_path / "logs"
    procs: list[subprocess.Popen[bytes]] = [spawn_service(
        "splitserve.services.decode", "--engine", "mock", "--transport", "tcp", "--handoff-grace-s", "2",
        nats_url=url, worker_id="decode-g", log_dir=logs)]
    key = proto.request_key("t", "g1")
    listed: list[tuple[float, bool]] = []
    finals: list[StreamFinal] = []
    sender = None
    try:
        await wait_ready(url, ["decode-g"], timeout=180)
        nc = await nats.connect(url)
        loop = asyncio.get_running_loop()

        async def on_hb(msg: Any) -> None:
            listed.append((loop.time(), key in proto.decode(msg.data, Heartbeat).active_requests))

        async def on_stream(msg: Any) -> None:
            m = proto.decode_stream(msg.data)
            if isinstance(m, StreamFinal):
                finals.append(m)

        try:
            await nc.subscribe(Subjects.heartbeat("decode", "decode-g"), cb=on_hb)
            await nc.subscribe("ss.stream.t.g1", cb=on_stream)
            reply = proto.decode((await nc.request(Subjects.kv_reserve("decode-g"), proto.encode(KvReserveRequest(
                request_id="g1", tenant="t", prefill_worker="prefill-g", num_tokens=5, transport="tcp")),
                timeout=10)).data, KvReserveReply)
            assert reply.ok and reply.transfer_id and reply.descriptor, reply
            layout = kv_layout(MockEngine.load().info, 16)
            sender = make_sender("tcp", BlockPool(layout, 4), push_timeout=30)
            await sender.push(reply.transfer_id, [0], reply.descriptor)  # the KV lands; no hand-off follows
            landed = loop.time()
            for _ in range(100):  # listed, then dropped once the grace has passed
                if listed and listed[-1][0] > landed and not listed[-1][1]:
                    break
                await asyncio.sleep(0.1)
            assert any(on for t, on in listed if t > landed), listed  # held (and listed) while within the grace
            gone = [t for t, on in listed if t > landed and not on]
            assert gone, f"still listed {listed[-1][0] - landed:.1f}s after its KV landed (no hand-off)"
            assert 2.0 <= gone[0] - landed < 6.0, gone[0] - landed
            # the hand-off after all: answered, and the request runs (its KV was let go: prefilled here)
            late = _done("decode-g", "g1", reply.transfer_id)
            ack = proto.decode((await nc.request(Subjects.kv_ready("decode-g"), proto.encode(late), timeout=10)).data,
                               PrefillDoneAck)
            assert ack.transfer_id == reply.transfer_id
            for _ in range(100):
                if finals:
                    break
                await asyncio.sleep(0.1)
        finally:
            await nc.close()
    finally:
        if sender is not None:
            sender.close()
        stop(*procs)
    assert len(finals) == 1 and finals[0].finish_reason == "length", finals
    events = [json.loads(x).get("event") for x in (logs / "decode-g.log").read_text().splitlines()
              if x.startswith("{")]
    assert events.count("handoff_missing") == 1 and "reservation_expired" not in events
    assert events.count("kv_unusable_prefilling_locally") == 1
