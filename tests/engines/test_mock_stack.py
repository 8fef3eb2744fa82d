"""The mock engine behind real services: nats-server + router + one decode worker started with ``--engine mock``,
driven through the client SDK with concurrent requests, as the control-plane load tests will use it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg

from splitserve import proto
from splitserve.client import Client
from splitserve.natsserver import NatsServer
from splitserve.proto import RequestFinished
from tests.procs import heartbeat_of, spawn_service, stop, wait_ready

REQUESTS = 20
MAX_TOKENS = 24


# "0": a zero-cost engine (bench.peers' workers), whose calls the decoder makes inline, not on its engine thread
@pytest.mark.parametrize("step_ms", ["2", "0"])
async def test_concurrent_requests_through_a_stack_of_mocks(nats_server: NatsServer, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch, step_ms: str) -> None:
    url, logs = nats_server.url, tmp_path / "logs"
    with monkeypatch.context() as env:
        env.setenv("SPLITSERVE_MOCK_STEP_MS", step_ms)  # the children inherit it; the mock reads it at load
        if step_ms == "0":
            env.setenv("SPLITSERVE_MOCK_PREFILL_TPS", "0")
        # every prompt is prefilled on the decoder (no prefill pool needed), dispatched directly: this is about
        # the engine behind real services, the JetStream queue has its own tests
        procs = [spawn_service("splitserve.services.router", "--disagg-threshold", "1000000000", "--no-queue",
                               nats_url=url, worker_id="router-m", log_dir=logs),
                 spawn_service("splitserve.services.decode", "--engine", "mock", "--transport", "tcp", "--max-batch",
                               "8",
                               nats_url=url, worker_id="decode-m", log_dir=logs)]
    try:
        await wait_ready(url, ["router-m", "decode-m"], timeout=120)
        hb = await heartbeat_of(url, "decode-m")
        calls = "inline" if step_ms == "0" else "thread"
        assert f'"engine_calls": "{calls}"' in (logs / "decode-m.log").read_text()
        assert str(hb.model_dump()).count("mock-SmolLM2") >= 1  # it tells the cluster it is a mock
        nc = await nats.connect(url)
        finished: list[RequestFinished] = []

        async def on_finished(msg: Msg) -> None:
            finished.append(proto.decode(msg.data, RequestFinished))

        await nc.subscribe("ss.evt.finished.load.>", cb=on_finished)
        started = time.monotonic()
        async with Client(url, tenant="load") as client:
            results = await asyncio.gather(*(client.complete(f"request {i}: count to ten", max_tokens=MAX_TOKENS)
                                             for i in range(REQUESTS)))
        took = time.monotonic() - started
        assert len({r.request_id for r in results}) == REQUESTS
        for r in results:
            assert r.decode_worker == "decode-m"
            assert r.finish_reason == "length" and len(r.token_ids) == MAX_TOKENS
        # deterministic: the same prompt gives the same tokens
        async with Client(url, tenant="load") as client:
            again = await client.complete("request 3: count to ten", max_tokens=MAX_TOKENS)
        assert again.token_ids == results[3].token_ids
        assert took < 30, f"{REQUESTS} mock requests took {took:.1f} s"

        long = "Tell me about the tides and the moon, and then about the sea and its shores. " * 8
        async with Client(url, tenant="load") as client:
            await client.complete(long, max_tokens=4)
            repeat = await client.complete(long, max_tokens=4)

        # Chargeback: each decode step's time is shared by the sequences it advanced, and every prefill's compute
        # is its request's, so the requests' costs sum to what the decoder reports busy (nothing lost or doubled)
        await asyncio.sleep(0.5)
        await nc.close()
        busy = (await heartbeat_of(url, "decode-m")).load.busy_s
        costs = [ev.cost for ev in finished if ev.cost is not None]
        assert len(costs) == len(finished) == REQUESTS + 3
        assert busy["decode"] > 0 and busy["prefill"] > 0
        assert sum(c.decode_s for c in costs) == pytest.approx(busy["decode"], abs=1e-3)
        assert sum(c.prefill_s for c in costs) == pytest.approx(busy["prefill"], abs=1e-3)
        assert all(c.decode_s > 0 and c.transfer_s == 0 for c in costs)  # direct: no KV moved
        # the repeated long prompt found its blocks cached: what they would have cost is reported as saved
        cost = next(ev.cost for ev in finished if ev.request_id == repeat.request_id)
        assert cost is not None and cost.cached_tokens == repeat.usage.cached_tokens > 0 and cost.saved_s > 0
    finally:
        stop(*procs)
        for name in ("router-m", "decode-m"):
            log = logs / f"{name}.log"
            print(f"--- {name}\n{log.read_text(errors='replace')[-3000:] if log.exists() else ''}")


@pytest.mark.slow
async def test_disaggregated_costs_sum_to_the_prefiller_and_decoder_busy_seconds(
        nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chargeback with a prefiller: each request's prefill_s is its share of the prefiller's compute (a batched
    prefill's time split among its members), its transfer_s the push after it, and its decode_s its share of the
    decoder's steps; summed over the requests they are the two workers' busy seconds."""
    url, logs = nats_server.url, tmp_path / "logs"
    with monkeypatch.context() as env:
        env.setenv("SPLITSERVE_MOCK_STEP_MS", "2")
        env.setenv("SPLITSERVE_MOCK_PREFILL_TPS", "5000")  # prefill takes time in proportion, as a real one
        procs = [spawn_service("splitserve.services.router", "--disagg-threshold", "0", "--no-queue",
                               nats_url=url, worker_id="router-c", log_dir=logs),
                 spawn_service("splitserve.services.prefill", "--engine", "mock", "--transport", "tcp",
                               nats_url=url, worker_id="prefill-c", log_dir=logs),
                 spawn_service("splitserve.services.decode", "--engine", "mock", "--transport", "tcp", "--max-batch",
                               "8", nats_url=url, worker_id="decode-c", log_dir=logs)]
    try:
        await wait_ready(url, ["router-c", "prefill-c", "decode-c"], timeout=120)
        nc = await nats.connect(url)
        finished: list[RequestFinished] = []

        async def on_finished(msg: Msg) -> None:
            finished.append(proto.decode(msg.data, RequestFinished))

        await nc.subscribe("ss.evt.finished.bill.>", cb=on_finished)
        async with Client(url, tenant="bill") as client:
            results = await asyncio.gather(*(client.complete(f"request {i}: " + "a long prompt to prefill " * 12,
                                                             max_tokens=8) for i in range(12)))
        assert all(r.route == "disaggregated" and r.prefill_worker == "prefill-c" for r in results)
        await asyncio.sleep(0.5)
        await nc.close()
        p_busy = (await heartbeat_of(url, "prefill-c", role="prefill")).load.busy_s
        d_busy = (await heartbeat_of(url, "decode-c")).load.busy_s
        costs = [ev.cost for ev in finished if ev.cost is not None]
        assert len(costs) == len(finished) == 12
        assert p_busy["prefill"] > 0 and d_busy["decode"] > 0
        assert sum(c.prefill_s for c in costs) == pytest.approx(p_busy["prefill"], rel=0.05)
        assert sum(c.decode_s for c in costs) == pytest.approx(d_busy["decode"], rel=0.05)
        assert d_busy["prefill"] == 0  # the decoder computed no prompt of these
        assert all(c.transfer_s >= 0 and c.prefill_s > 0 for c in costs)
    finally:
        stop(*procs)


@pytest.mark.slow
async def test_a_zero_cost_stack_disaggregates_inline_with_layerwise_pushes(
        nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no step and no prefill time (bench.peers' workers) the prefiller and the decoder call the engine on
    their event loops (engine_calls: inline): long prompts still go through a prefiller, their KV pushed layer by
    layer as each is computed (services.prefill: the push is scheduled from the engine call onto the same loop),
    and every request gets the tokens a second run of it gets."""
    url, logs = nats_server.url, tmp_path / "logs"
    with monkeypatch.context() as env:
        env.setenv("SPLITSERVE_MOCK_STEP_MS", "0")
        env.setenv("SPLITSERVE_MOCK_PREFILL_TPS", "0")
        procs = [spawn_service("splitserve.services.router", "--disagg-threshold", "0", "--no-queue",
                               nats_url=url, worker_id="router-z", log_dir=logs),
                 spawn_service("splitserve.services.prefill", "--engine", "mock", "--transport", "tcp",
                               nats_url=url, worker_id="prefill-z", log_dir=logs),
                 spawn_service("splitserve.services.decode", "--engine", "mock", "--transport", "tcp",
                               nats_url=url, worker_id="decode-z", log_dir=logs)]
    try:
        await wait_ready(url, ["router-z", "prefill-z", "decode-z"], timeout=120)
        prompts = [f"request {i}: " + "the tides and the moon " * (40 + 150 * (i % 3)) for i in range(9)]
        async with Client(url, tenant="zero") as client:
            results = await asyncio.gather(*(client.complete(p, max_tokens=12) for p in prompts))
            again = [await client.complete(p, max_tokens=12) for p in prompts[:3]]
        assert all(r.route == "disaggregated" and r.prefill_worker == "prefill-z" for r in results)
        assert all(r.finish_reason == "length" and len(r.token_ids) == 12 for r in results)
        assert max(r.usage.prompt_tokens for r in results) >= 2 * 256  # pushed layer by layer (LAYERWISE_MIN_TOKENS)
        assert [r.token_ids for r in again] == [r.token_ids for r in results[:3]]
        for name in ("prefill-z", "decode-z"):
            assert '"engine_calls": "inline"' in (logs / f"{name}.log").read_text()
    finally:
        stop(*procs)
