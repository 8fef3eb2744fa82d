"""Batched prefill in the prefill worker: short prompts that arrive together share one forward, and every
request still gets the tokens it gets alone. Real processes: router, one prefill and one decode worker, real
model (hf), real KV over TCP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.client import Client
from splitserve.natsserver import NatsServer
from tests.procs import spawn_service, stop, wait_ready

pytestmark = pytest.mark.slow

QUESTIONS = ["Hi!", "What is 2+2? Answer briefly.", "Tell me about Paris.", "Name a colour.",
             "Write one sentence about the sea, the wind and the sky.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def cluster(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    logs = Path(tmp_path_factory.mktemp("pb-logs"))
    url = nats_server.url
    eng = ["--transport", "tcp", "--threads", "1"]
    procs = [
        spawn_service("splitserve.services.router", "--disagg-threshold", "1", nats_url=url, worker_id="router-pb",
                      log_dir=logs),
        # prefix cache on: the burst's prompts were cached by the sequential run; in a batch those short
        # prefixes are recomputed, not reused (which would take each prompt out of the shared forward)
        spawn_service("splitserve.services.prefill", *eng, nats_url=url, worker_id="prefill-pb", log_dir=logs),
        spawn_service("splitserve.services.decode", *eng, "--cache-tokens", "0", nats_url=url, worker_id="decode-pb",
                      log_dir=logs),
    ]
    try:
        asyncio.run(wait_ready(url, ["router-pb", "prefill-pb", "decode-pb"], timeout=300))
        yield url, logs
    finally:
        stop(*procs)


def _batches(log: str) -> list[int]:
    return [json.loads(line).get("batch", 1) for line in log.splitlines() if '"prefilled"' in line]


def test_prompts_arriving_together_share_a_forward_and_keep_their_tokens(cluster: tuple[str, Path]) -> None:
    url, logs = cluster

    async def go() -> tuple[list[list[int]], list[list[int]]]:
        async with Client(url, idle_timeout=300) as c:
            chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
            alone = [(await c.complete(m, max_tokens=8, route="disaggregated")).token_ids for m in chats]
            together = await asyncio.gather(*[c.complete(m, max_tokens=8, route="disaggregated") for m in chats])
            return alone, [r.token_ids for r in together]

    alone, together = asyncio.run(go())
    assert together == alone
    batches = _batches((logs / "prefill-pb.log").read_text())
    assert len(batches) == 2 * len(QUESTIONS)
    assert batches[: len(QUESTIONS)] == [1] * len(QUESTIONS)  # one at a time: nothing to share
    assert max(batches[len(QUESTIONS):]) > 1  # the burst: the jobs queued behind the first went together
