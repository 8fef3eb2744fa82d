"""The vllm engine itself (vLLM's AsyncLLM in this process, CPU build): greedy tokens equal to the hf engine
on the same model in fp32, vLLM's prefix cache reported as cached tokens, early stop frees vLLM's slot."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from splitserve.engines import Sampling
from splitserve.engines.generate import GenRequest
from tests.vllm.conftest import needs_vllm

pytestmark = [pytest.mark.slow, needs_vllm, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    "The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
    "Constantinople. Summarise this in one sentence:",
]
N = 24


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vengine() -> AsyncIterator[object]:
    from splitserve.engines.vllm_engine import VllmEngine

    engine = await VllmEngine.start(max_model_len=2048, max_num_seqs=4)
    try:
        yield engine
    finally:
        await engine.close()


def _ids(engine: object, prompt: object) -> list[int]:
    if isinstance(prompt, list):
        return engine.apply_chat_template(prompt)  # type: ignore[attr-defined]
    return engine.encode(prompt)  # type: ignore[attr-defined]


async def _run(engine: object, rid: str, ids: list[int], n: int = N) -> tuple[list[int], int, str | None]:
    toks: list[int] = []
    cached, reason = 0, None
    async for out in engine.generate(GenRequest(rid, ids, Sampling(), n)):  # type: ignore[attr-defined]
        toks += out.token_ids
        cached = out.num_cached_tokens
        reason = out.finish_reason
    return toks, cached, reason


async def test_greedy_tokens_match_hf_engine(vengine: object) -> None:
    from splitserve.engines.hf import HfEngine

    hf = HfEngine.load(dtype="float32")
    for i, prompt in enumerate(PROMPTS):
        ids = _ids(vengine, prompt)
        assert ids == _ids(hf, prompt)  # same tokenizer and chat template
        toks, _, reason = await _run(vengine, f"greedy-{i}", ids)
        res = hf.prefill(ids, Sampling())
        hf.add_sequence(f"ref-{i}", res.kv, res.first_token, Sampling())
        ref = [res.first_token]
        while len(ref) < N:
            ref.append(hf.step()[f"ref-{i}"])
        hf.remove_sequence(f"ref-{i}", keep_kv=False)
        assert toks == ref, (prompt, toks, ref)
        assert reason == "length"


async def test_repeated_prompt_reports_vllm_cached_tokens(vengine: object) -> None:
    ids = vengine.encode(PROMPTS[1] + " Again, please.")  # type: ignore[attr-defined]
    first, cached0, _ = await _run(vengine, "cache-a", ids, 4)
    again, cached1, _ = await _run(vengine, "cache-b", ids, 4)
    assert first == again
    assert cached0 == 0 and cached1 == len(ids) // 32 * 32  # whole 32-token blocks from vLLM's prefix cache


async def test_stop_token_and_early_stop_free_the_slot(vengine: object) -> None:
    eos = vengine.info.eos_token_ids  # type: ignore[attr-defined]
    ids = _ids(vengine, PROMPTS[0])
    n = 0
    gen = vengine.generate(GenRequest("early", ids, Sampling(), 200, eos))  # type: ignore[attr-defined]
    async for out in gen:
        n += len(out.token_ids)
        if n >= 3:
            break
    await gen.aclose()  # the caller stopped (stop string, cancel): the engine aborts the request
    toks, _, reason = await _run(vengine, "after-early", ids, 200)
    assert vengine.load().running == 0 or reason is not None  # type: ignore[attr-defined]
    # with the model's EOS as a stop token the chat answer ends by itself, well before 200 tokens
    toks2: list[int] = []
    async for out in vengine.generate(GenRequest("eos", ids, Sampling(), 200, eos)):  # type: ignore[attr-defined]
        toks2 += out.token_ids
        last = out
    assert last.finish_reason == "stop" and toks2[-1] in eos and len(toks2) < 200


async def test_vllm_satisfies_the_generate_contract(vengine: object) -> None:
    from tests.engines import generate_contract as contract

    await contract.check_all(vengine, vengine.encode("The quick brown fox"),  # type: ignore[arg-type, attr-defined]
                             vengine.encode("Disaggregated prefill and decode"))  # type: ignore[attr-defined]
