"""A decoder's landing buffer bounds how much KV it reserves: when it is full, prefillers wait and retry
instead of dropping work. Real processes: router, one prefill and one decode worker (landing buffer for
barely one prompt), real model, real KV over TCP."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.client import Client
from splitserve.natsserver import NatsServer
from tests.procs import spawn_service, stop, wait_ready

pytestmark = pytest.mark.slow

PROMPTS = [f"Story {i}: " + "the quick brown fox jumps over the lazy dog " * 25 for i in range(4)]  # ~230 tokens


@pytest.fixture(scope="module")
def cluster(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    logs = Path(tmp_path_factory.mktemp("bp-logs"))
    url = nats_server.url
    eng = ["--transport", "tcp", "--threads", "1"]
    procs = [
        spawn_service("splitserve.services.router", "--disagg-threshold", "32", nats_url=url, worker_id="router-bp",
                      log_dir=logs),
        spawn_service("splitserve.services.prefill", *eng, nats_url=url, worker_id="prefill-bp", log_dir=logs),
        spawn_service("splitserve.services.prefill", *eng, nats_url=url, worker_id="prefill-bp2", log_dir=logs),
        # 256 tokens of landing space: one ~230-token prompt at a time.
        spawn_service("splitserve.services.decode", *eng, "--landing-tokens", "256", "--cache-tokens", "0",
                      nats_url=url,
                      worker_id="decode-bp", log_dir=logs),
    ]
    try:
        asyncio.run(wait_ready(url, ["router-bp", "prefill-bp", "prefill-bp2", "decode-bp"], timeout=300))
        yield url, logs
    finally:
        stop(*procs)


def test_full_landing_buffer_makes_prefiller_wait_not_drop(cluster: tuple[str, Path]) -> None:
    url, logs = cluster

    async def go() -> list[str]:
        async with Client(url, idle_timeout=300) as c:
            # Two prefillers work at once; the decoder can land only one prompt at a time.
            rs = await asyncio.gather(*[c.complete(p, max_tokens=4, route="disaggregated") for p in PROMPTS])
            return [r.finish_reason for r in rs]

    reasons = asyncio.run(go())
    assert len(reasons) == len(PROMPTS) and all(r in ("stop", "length") for r in reasons)
    prefill_logs = (logs / "prefill-bp.log").read_text() + (logs / "prefill-bp2.log").read_text()
    assert prefill_logs.count('"prefilled"') == len(PROMPTS)
    assert '"kv_buffer_full_waiting"' in prefill_logs  # the wait path really ran


def test_prompt_larger_than_landing_buffer_is_a_clear_error(cluster: tuple[str, Path]) -> None:
    from splitserve import errors

    url, _ = cluster

    async def go() -> None:
        async with Client(url) as c:
            await c.complete("word " * 400, max_tokens=2, route="disaggregated")

    # It can never be handed over: refused at once as too long for the buffer (no other attempt would fare better)
    with pytest.raises(errors.PromptTooLong) as ei:
        asyncio.run(go())
    assert "landing buffer" in ei.value.message and "--landing-tokens" in ei.value.message, ei.value.message
