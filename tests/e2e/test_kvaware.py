"""kvaware routing end to end: two decoders, the workers' own KV events feed the router's index, and a
repeated long prompt lands on the decoder that holds it, reusing its KV (``cached_tokens`` > 0)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.client import Client
from splitserve.stackproc import StackProc, start_stack

pytestmark = pytest.mark.slow

PROMPT = ("In a quiet village by the sea there lived an old lighthouse keeper who kept a journal of every ship "
          "that passed. ") * 40 + "What did the keeper write about?"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProc]:
    sp = start_stack(Path(tmp_path_factory.mktemp("kv")), "--decode", "2", "--prefill", "1", "--strategy", "kvaware",
                     "--disagg-threshold", "256")
    try:
        yield sp
    finally:
        assert sp.stop() == 0, sp.output


async def _twice(url: str) -> tuple[object, object, object]:
    async with Client(url) as c:
        first = await c.complete(PROMPT, max_tokens=4)
        await asyncio.sleep(1.0)  # KV events reach the router's index replica
        second = await c.complete(PROMPT, max_tokens=4)
        # A different prompt sharing only the long prefix also reuses it.
        third = await c.complete(PROMPT + " Answer briefly.", max_tokens=4)
        return first, second, third


def test_repeated_prompt_lands_on_holder_and_reuses_kv(stack: StackProc) -> None:
    t0 = time.monotonic()
    first, second, third = asyncio.run(_twice(stack.nats_url))
    assert time.monotonic() - t0 < 300
    assert first.route == "disaggregated" and first.usage.cached_tokens == 0  # type: ignore[attr-defined]
    assert second.decode_worker == first.decode_worker  # type: ignore[attr-defined]
    assert second.route == "direct"  # type: ignore[attr-defined]  # long, but cached: no prefiller needed
    assert second.usage.cached_tokens > 0.9 * second.usage.prompt_tokens  # type: ignore[attr-defined]
    assert second.decision["cached_tokens"] > 0  # type: ignore[attr-defined]
    assert second.token_ids == first.token_ids  # type: ignore[attr-defined]  # reuse changes nothing
    assert third.decode_worker == first.decode_worker  # type: ignore[attr-defined]
    assert third.usage.cached_tokens > 0  # type: ignore[attr-defined]


def test_index_service_sees_the_workers_blocks(stack: StackProc) -> None:
    import nats

    from splitserve import proto
    from splitserve.cache.hashing import hash_token_blocks
    from splitserve.services.router.tokenize import PromptTokenizer
    from splitserve.tenancy import TenantsConfig

    ids = PromptTokenizer(None).token_ids(proto.GenerateRequest(request_id="x", tenant="t",
                                                                prompt=PROMPT))

    async def go() -> dict[str, int]:
        # served here too: this test holds without the one above (pytest-xdist may run them on two stacks)
        async with Client(stack.nats_url) as c:
            await c.complete(PROMPT, max_tokens=4)
        nc = await nats.connect(stack.nats_url)
        try:
            # the blocks are keyed by the requesting tenant's salt (the client's default tenant here)
            salt = TenantsConfig.open_mode().cache_salt("default")
            q = proto.CacheQuery(block_hashes=hash_token_blocks(ids, 16, cache_salt=salt))
            for _ in range(50):  # its KV events reach the index through JetStream, a moment after the answer
                resp = await nc.request(proto.Subjects.CACHE_QUERY, proto.encode(q), timeout=5)
                matched = proto.decode(resp.data, proto.CacheQueryReply).matched_blocks
                if matched:
                    break
                await asyncio.sleep(0.1)
            return matched
        finally:
            await nc.close()

    matched = asyncio.run(go())
    assert matched, "the cache index holds nothing for a prompt that was served"
    assert max(matched.values()) >= len(ids) // 16 - 1
