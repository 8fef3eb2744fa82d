"""The generate-level engine contract (``splitserve.engines.generate.GenerateEngine``), shared by every
engine: ``hf`` through ``KvEngineAdapter`` (tests/engines) and ``vllm`` (tests/vllm). Each check takes a
started engine and a prompt of token ids and asserts what any engine must do."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.engines import PromptTooLong, Sampling
from splitserve.engines.generate import GenerateEngine, GenRequest

_n = 0


def _rid(tag: str) -> str:
    global _n
    _n += 1
    return f"contract-{tag}-{_n}"


async def run(engine: GenerateEngine, ids: list[int], n: int, stop: tuple[int, ...] = (),
              sampling: Sampling | None = None) -> tuple[list[int], str | None]:
    toks: list[int] = []
    reason = None
    async for out in engine.generate(GenRequest(_rid("run"), list(ids), sampling or Sampling(), n, stop)):
        toks += out.token_ids
        if out.finished:
            reason = out.finish_reason
    return toks, reason


async def check_greedy_deterministic_and_length(engine: GenerateEngine, ids: list[int]) -> list[int]:
    a, ra = await run(engine, ids, 8)
    b, rb = await run(engine, ids, 8)
    assert a == b and len(a) == 8 and ra == rb == "length"
    return a


async def check_stop_token(engine: GenerateEngine, ids: list[int]) -> None:
    ref, _ = await run(engine, ids, 8)
    stop = ref[3]
    out, reason = await run(engine, ids, 8, stop=(stop,))
    assert out == ref[: ref.index(stop) + 1] and reason == "stop"  # the stop token is emitted, then it ends


async def check_concurrent_equals_alone(engine: GenerateEngine, ids: list[int], other: list[int]) -> None:
    alone_a, _ = await run(engine, ids, 6)
    alone_b, _ = await run(engine, other, 6)
    (a, _), (b, _) = await asyncio.gather(run(engine, ids, 6), run(engine, other, 6))
    assert (a, b) == (alone_a, alone_b)  # batching never changes greedy output


async def check_early_stop_frees_the_request(engine: GenerateEngine, ids: list[int]) -> None:
    gen = engine.generate(GenRequest(_rid("early"), list(ids), Sampling(), 50))
    got = 0
    async for out in gen:
        got += len(out.token_ids)
        if got >= 2:
            break
    await gen.aclose()  # the consumer stopped (stop string, cancel, deadline): the engine aborts it
    await engine.abort("never-existed")  # unknown ids are ignored
    toks, reason = await run(engine, ids, 3)
    assert len(toks) == 3 and reason == "length"
    for _ in range(50):  # the aborted request is gone (vLLM reports its stats a step later)
        if engine.load().running == 0:
            break
        await asyncio.sleep(0.1)
    assert engine.load().running == 0


async def check_prompt_too_long(engine: GenerateEngine) -> None:
    with pytest.raises(PromptTooLong):
        async for _ in engine.generate(GenRequest(_rid("long"), [1] * engine.info.max_model_len, Sampling(), 1)):
            pass


async def check_seeded_sampling_reproducible(engine: GenerateEngine, ids: list[int]) -> None:
    s = Sampling(temperature=0.9, top_p=0.95, seed=1234)
    a, _ = await run(engine, ids, 8, sampling=s)
    b, _ = await run(engine, ids, 8, sampling=s)
    assert a == b


async def check_all(engine: GenerateEngine, ids: list[int], other: list[int]) -> None:
    await check_greedy_deterministic_and_length(engine, ids)
    await check_stop_token(engine, ids)
    await check_concurrent_equals_alone(engine, ids, other)
    await check_early_stop_frees_the_request(engine, ids)
    await check_prompt_too_long(engine)
    await check_seeded_sampling_reproducible(engine, ids)
