"""Long prompts vs token streams, end to end through ``splitserve up`` with pinned pools and a long-context
decoder: where each request decodes, the stall rule's route, and chunked local prefill between decode steps.

The figures (ITL, TTFT) are measured by ``python -m bench.interference``; these tests check the mechanisms
that produce them, without timing assertions.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from splitserve.client import Client, Result
from splitserve.stackproc import StackProc, start_stack
from tests.procs import heartbeat_of

pytestmark = pytest.mark.slow

LONG_TOKENS = 600  # --long-prompt-tokens of this stack
SHORT = "Write a short poem about the sea."
MEDIUM = ("Rivers carry water from the mountains to the sea, shaping valleys over many thousands of years. ") * 14
LONG = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
        "Constantinople. ") * 30 + "Summarise this in one sentence:"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProc]:
    sp = start_stack(Path(tmp_path_factory.mktemp("interf")), "--prefill", "1", "--decode", "1", "--long-decode",
                     "1", "--long-prompt-tokens", str(LONG_TOKENS), "--strategy", "kvaware")
    try:
        yield sp
    finally:
        assert sp.stop() == 0, sp.output


async def _with_streams(url: str, n: int, during: Any) -> tuple[list[Result], Any]:
    """Run `during(client)` while n short streams are decoding (each has produced a token already)."""
    async with Client(url, idle_timeout=300) as c:
        started = [asyncio.Event() for _ in range(n)]

        async def stream(i: int) -> Result:
            gen = c.generate(f"{SHORT} ({i})", max_tokens=60, ignore_eos=True)
            async for _ in gen:
                started[i].set()
            assert gen.result is not None
            return gen.result

        tasks = [asyncio.create_task(stream(i)) for i in range(n)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        # and until the decoder's heartbeat shows them: the router decides on heartbeats (the simulator alike),
        # and one sent before the streams started would show the decoder idle
        deadline = asyncio.get_running_loop().time() + 30
        while (await heartbeat_of(url, "decode-0")).load.active_seqs < n:
            assert asyncio.get_running_loop().time() < deadline, "the streams never showed in a heartbeat"
        out = await during(c)
        return list(await asyncio.gather(*tasks)), out


def _log_events(stack: StackProc, worker: str, event: str) -> list[dict[str, Any]]:
    lines = (stack.state_dir / "logs" / f"{worker}.log").read_text().splitlines()
    return [d for d in (json.loads(x) for x in lines if x.startswith("{")) if d.get("event") == event]


def test_long_prompt_decodes_on_the_long_pool_never_beside_the_streams(stack: StackProc) -> None:
    async def long_one(c: Client) -> Result:
        return await c.complete(LONG, max_tokens=8)

    shorts, long = asyncio.run(_with_streams(stack.nats_url, 2, long_one))
    assert long.usage.prompt_tokens >= max(LONG_TOKENS, 512)  # past the size threshold too: a prefiller
    assert long.decode_worker == "decode-long-0"
    assert long.route == "disaggregated" and long.prefill_worker == "prefill-0"
    assert long.decision["detail"]["context_pool"] == "long"
    assert len(long.token_ids) == 8
    assert {s.decode_worker for s in shorts} == {"decode-0"}  # short streams never go to the long pool
    assert all(s.finish_reason == "length" and len(s.token_ids) == 60 for s in shorts)

    async def direct_idle() -> Result:
        async with Client(stack.nats_url) as c:
            return await c.complete(LONG, max_tokens=8, route="direct")

    # the same prompt prefilled on the long decoder itself (idle: one chunk) gives the same greedy tokens
    again = asyncio.run(direct_idle())
    assert again.decode_worker == "decode-long-0" and again.route == "direct"
    assert again.token_ids == long.token_ids


def test_a_prompt_that_would_stall_the_streams_goes_through_a_prefiller(stack: StackProc) -> None:
    async def medium(c: Client) -> Result:
        return await c.complete(MEDIUM, max_tokens=4)

    _, res = asyncio.run(_with_streams(stack.nats_url, 2, medium))
    # below both the size threshold (512) and the long-context one: only the stall rule sends it away
    assert res.usage.prompt_tokens < LONG_TOKENS
    assert res.decode_worker == "decode-0"
    assert (res.route, res.decision["reason"]) == ("disaggregated", "would_stall"), res.decision
    t = res.decision["thresholds"]
    assert t["stall_ms"] > t["max_stall_ms"] and t["decoder_active_seqs"] >= 1


def test_a_direct_prefill_beside_active_streams_is_chunked_between_decode_steps(stack: StackProc) -> None:
    prompt = MEDIUM * 2  # ~300 tokens with a 256-token chunk: two chunks, one decode step between them
    before = len(_log_events(stack, "decode-0", "local_prefill"))

    async def forced(c: Client) -> Result:
        return await c.complete(prompt, max_tokens=6, route="direct")

    shorts, res = asyncio.run(_with_streams(stack.nats_url, 2, forced))
    assert res.route == "direct" and res.decode_worker == "decode-0"
    ev = [e for e in _log_events(stack, "decode-0", "local_prefill")[before:] if e["tokens"] == res.usage.prompt_tokens]
    assert ev and ev[0]["chunks"] == 2 and ev[0]["streams"] >= 1, ev
    assert all(len(s.token_ids) == 60 for s in shorts)

    async def idle() -> Result:
        async with Client(stack.nats_url) as c:
            return await c.complete(prompt, max_tokens=6, route="direct")

    # chunked or whole, the prefill gives the same greedy continuation
    alone = asyncio.run(idle())
    assert alone.token_ids == res.token_ids
