"""A prefiller serves its waiting prompts fairly between tenants (splitserve.tenancy.fairqueue): a tenant that
floods it with long prompts does not sit in front of another tenant's one prompt. Real nats-server, router,
mock-engine prefiller (slow prefill) and decoder; every request disaggregated."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import pytest

from splitserve.client import Client
from splitserve.natsserver import NatsServer
from tests.procs import spawn_service, stop, wait_ready

pytestmark = pytest.mark.slow

LONG = "the tides follow the moon and the sea keeps its own counsel " * 40  # ~500 tokens


async def test_a_flood_of_long_prompts_does_not_hold_back_another_tenants_prefill(
        nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, logs = nats_server.url, tmp_path / "logs"
    with monkeypatch.context() as env:
        env.setenv("SPLITSERVE_MOCK_STEP_MS", "2")
        env.setenv("SPLITSERVE_MOCK_PREFILL_TPS", "4000")  # ~0.13 s per prompt: 24 queued are ~3 s of prefill
        procs = [spawn_service("splitserve.services.router", "--disagg-threshold", "0", "--no-queue",
                               nats_url=url, worker_id="router-f", log_dir=logs),
                 spawn_service("splitserve.services.prefill", "--engine", "mock", "--transport", "tcp",
                               "--prefill-batch", "1", nats_url=url, worker_id="prefill-f", log_dir=logs),
                 spawn_service("splitserve.services.decode", "--engine", "mock", "--transport", "tcp", "--max-batch",
                               "64", nats_url=url, worker_id="decode-f", log_dir=logs)]
    try:
        await wait_ready(url, ["router-f", "prefill-f", "decode-f"], timeout=120)
        async with Client(url, tenant="flood") as flood, Client(url, tenant="light") as light:
            await light.complete("warm up", max_tokens=2)

            async def timed(c: Client, prompt: str) -> float:
                t0 = time.monotonic()
                async for _ in c.generate(prompt, max_tokens=2):
                    return time.monotonic() - t0
                raise AssertionError("no token")

            floods = [asyncio.ensure_future(timed(flood, f"{i} {LONG}")) for i in range(24)]
            await asyncio.sleep(0.3)  # the flood is queued at the prefiller
            mine = await timed(light, f"mine {LONG}")
            theirs = await asyncio.gather(*floods)
        print(f"light TTFT {mine:.2f}s; flood TTFT p50 {statistics.median(theirs):.2f}s max {max(theirs):.2f}s")
        # First come first served, the light prompt waited for most of the flood (TTFT near the flood's worst);
        # served fairly, it is among the next prompts prefilled.
        assert mine < statistics.median(theirs), (mine, sorted(theirs))
    finally:
        stop(*procs)
