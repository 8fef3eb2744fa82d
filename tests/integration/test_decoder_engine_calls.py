"""What a short request costs its decoder in hops to the engine thread (a real decoder in this process, the mock
engine, a real nats-server). Each hop is two thread wake-ups and the GIL handed over twice: a few hundred
microseconds of CPU on a busy machine, which was most of what a short request cost a decoder (five hops besides
its decode steps: prefix lookup, prefill, add to the batch, retire, drain of the KV events; now two).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import nats
import pytest

from splitserve import proto
from splitserve.natsserver import NatsServer
from splitserve.proto import DecodeJob, Heartbeat, KvEventBatch, Route, SamplingParams, StreamFinal, Subjects
from splitserve.services.common.options import EngineOptions
from splitserve.services.decode.service import DecodeService

pytestmark = pytest.mark.slow

PROMPT = list(range(5, 85))  # 80 tokens: five whole 16-token blocks for the prefix cache


def _name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__name__", repr(fn)))


async def _serve(nc: Any, worker: str, rid: str) -> StreamFinal:
    subject = Subjects.stream("t", rid)
    sub = await nc.subscribe(subject)
    job = DecodeJob(request_id=rid, tenant="t", prompt_token_ids=PROMPT, stream_subject=subject,
                    sampling=SamplingParams(max_tokens=6, temperature=0.0), route=Route.DIRECT, decoder_id=worker,
                    created_ms=proto.now_ms(), cache_salt="salt-t")
    await nc.publish(Subjects.decode_job(worker), proto.encode(job))
    try:
        while True:
            msg = proto.decode_stream((await sub.next_msg(timeout=30)).data)
            if isinstance(msg, StreamFinal):
                return msg
            assert not isinstance(msg, proto.StreamError), msg
    finally:
        await sub.unsubscribe()


async def test_a_short_request_takes_two_engine_calls_besides_its_steps(
        fresh_nats: NatsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_MOCK_STEP_MS", "0")
    worker = "decode-calls"
    svc = DecodeService(worker, fresh_nats.url, opts=EngineOptions(engine="mock", transport="tcp"),
                        cache_tokens=4096, log_level="WARNING")
    calls: list[str] = []
    real_run = svc.thread.run

    async def counting(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        calls.append(_name(fn))
        return await real_run(fn, *args, **kwargs)

    svc.thread.run = counting  # type: ignore[method-assign]
    nc = await nats.connect(fresh_nats.url)
    ready = asyncio.Event()

    async def on_hb(msg: Any) -> None:
        if proto.decode(msg.data, Heartbeat).state == "ready":
            ready.set()

    events: list[KvEventBatch] = []

    async def on_kv(msg: Any) -> None:
        events.append(proto.decode(msg.data, KvEventBatch))

    await nc.subscribe(Subjects.heartbeat("decode", worker), cb=on_hb)
    await nc.subscribe(Subjects.kv_events(worker), cb=on_kv)
    task = asyncio.create_task(svc.run())
    try:
        await asyncio.wait_for(ready.wait(), timeout=60)
        # what the decoder's load reports (its heartbeats, read by the routers) while the prompt computes
        reported: list[int] = []
        real_prefill = svc.engine.prefill

        def prefill(*args: Any, **kwargs: Any) -> Any:
            reported.append(svc._admitting_prefill)
            return real_prefill(*args, **kwargs)

        svc.engine.prefill = prefill  # type: ignore[method-assign]
        for rid, cached in (("first", False), ("again", True)):
            calls.clear()
            final = await _serve(nc, worker, rid)
            assert final.finish_reason == "length" and len(final.token_ids) == 6
            # the second sees the first's retired blocks: the prefix lookup still runs, inside the prefill's call
            assert (final.usage.cached_tokens > 0) is cached, final.usage
            # only the uncached part counts as prefill work (the whole prompt made a decoder holding the prefix
            # look a prompt busier, and the next request's router sent it elsewhere: test_kvaware)
            assert reported[-1] == len(PROMPT) - final.usage.cached_tokens, reported
            # the first token comes from the prefill, the other five from decode steps
            assert [c for c in calls if c != "step"] == ["_prefill_chunk", "_retire_and_drain"], calls
            assert calls.count("step") == 5
        # the retire's KV events were drained in its call and published: the index hears of the stored blocks
        for _ in range(50):
            if any(ev.type == "stored" for b in events for ev in b.events):
                break
            await asyncio.sleep(0.1)
        assert any(ev.type == "stored" for b in events for ev in b.events), events
    finally:
        svc.request_stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, timeout=30)
        await nc.close()
