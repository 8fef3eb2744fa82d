"""The mock engine behind real services: nats-server + router + one decode worker started with ``--engine mock``,
driven through the client SDK with concurrent requests, as the control-plane load tests will use it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from splitserve.client import Client
from splitserve.natsserver import NatsServer
from tests.procs import heartbeat_of, spawn_service, stop, wait_ready

REQUESTS = 20
MAX_TOKENS = 24


async def test_concurrent_requests_through_a_stack_of_mocks(nats_server: NatsServer, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    url, logs = nats_server.url, tmp_path / "logs"
    with monkeypatch.context() as env:
        env.setenv("SPLITSERVE_MOCK_STEP_MS", "2")  # the children inherit it; the mock reads it at load
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
        assert str(hb.model_dump()).count("mock-SmolLM2") >= 1  # it tells the cluster it is a mock
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
    finally:
        stop(*procs)
        for name in ("router-m", "decode-m"):
            log = logs / f"{name}.log"
            print(f"--- {name}\n{log.read_text(errors='replace')[-3000:] if log.exists() else ''}")
