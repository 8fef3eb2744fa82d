"""The vllm engine itself (vLLM's AsyncLLM in this process, CPU build): greedy tokens equal to the hf engine
on the same model in fp32, vLLM's prefix cache reported as cached tokens, early stop frees vLLM's slot, and
vLLM's own LoRA: an adapter request's greedy tokens equal transformers + peft with that adapter.

One engine for the module (a start is ~60 s of CPU), started with LoRA on and the test adapter ``a``
registered (when peft is installed to make it): the base-model tests run beside the adapter."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from splitserve.engines import Sampling, UnknownAdapter
from splitserve.engines.generate import GenRequest
from tests.vllm.conftest import needs_vllm

pytestmark = [pytest.mark.slow, needs_vllm, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    "The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
    "Constantinople. Summarise this in one sentence:",
]
N = 24
POOL = (min(os.sched_getaffinity(0)),)  # the engine's cores: the first this process may use
HAS_PEFT = importlib.util.find_spec("peft") is not None  # (it makes the test adapter)
needs_peft = pytest.mark.skipif(not HAS_PEFT, reason="peft is not installed (the dev extra): no test adapter")


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    if not HAS_PEFT:
        return None
    from splitserve.engines.lora import make_test_adapter

    return make_test_adapter(tmp_path_factory.mktemp("vllm-lora") / "lora-a", seed=1)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vengine(adapter_dir: Path | None) -> AsyncIterator[object]:
    from splitserve.engines.vllm_engine import VllmEngine

    loras = (("a", str(adapter_dir)),) if adapter_dir is not None else ()
    # on one core: the engine core runs on the pool's cores (test_the_engine_core_runs_on_the_pools_cores)
    engine = await VllmEngine.start(max_model_len=2048, max_num_seqs=4, lora_modules=loras, cpus=POOL)
    try:
        yield engine
    finally:
        await engine.close()


def _ids(engine: object, prompt: object) -> list[int]:
    if isinstance(prompt, list):
        return engine.apply_chat_template(prompt)  # type: ignore[attr-defined]
    return engine.encode(prompt)  # type: ignore[attr-defined]


async def _run(engine: object, rid: str, ids: list[int], n: int = N,
               lora: str | None = None) -> tuple[list[int], int, str | None]:
    toks: list[int] = []
    cached, reason = 0, None
    async for out in engine.generate(GenRequest(rid, ids, Sampling(), n, lora=lora)):  # type: ignore[attr-defined]
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


async def test_the_engine_core_runs_on_the_pools_cores(vengine: object) -> None:
    """One rank: the model runs in vLLM's engine-core process (uni executor), every thread of it on the pool's
    cores (``cpus``), inherited from the thread that started it; this process's threads keep every core."""
    import psutil

    me = psutil.Process()
    cores = [p for p in me.children(recursive=True) if "EngineCore" in p.name()]
    assert len(cores) == 1, [p.name() for p in me.children(recursive=True)]
    assert not [p for p in me.children(recursive=True) if "Worker" in p.name()]  # no executor process beside it
    assert {tuple(os.sched_getaffinity(t.id)) for t in cores[0].threads()} == {POOL}
    mine = tuple(sorted(os.sched_getaffinity(0)))
    assert {tuple(sorted(os.sched_getaffinity(t.id))) for t in me.threads()} == {mine}


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


# -- LoRA (vLLM's own: enable_lora, LoRARequest) -----------------------------------------------------------------
QUESTION = [{"role": "user", "content": "Name three rivers in Europe."}]
NL = 16


@pytest.fixture(scope="module")
def peft_tokens(adapter_dir: Path | None, vengine: object) -> dict[str | None, list[int]]:
    """transformers + peft greedy tokens of QUESTION, without (None) and with adapter a (tests/engines/test_lora's
    reference code)."""
    import torch
    from transformers import AutoModelForCausalLM

    from splitserve.engines.hf_export import ensure_hf_folder
    from tests.engines.test_lora import peft_reference

    assert adapter_dir is not None
    base = AutoModelForCausalLM.from_pretrained(ensure_hf_folder(None), dtype=torch.float32, local_files_only=True)
    ref = peft_reference(base, {"a": adapter_dir}, [_ids(vengine, QUESTION)], NL)
    return {lora: tokens for (_, lora), tokens in ref.items()}


@needs_peft
async def test_adapter_request_matches_peft_beside_a_base_request(vengine: object,
                                                                  peft_tokens: dict[str | None, list[int]]) -> None:
    assert vengine.loras() == ["a"]  # type: ignore[attr-defined]
    ids = _ids(vengine, QUESTION)
    # together, so both run in the same vLLM batches (one row with the adapter, one without)
    (lora_toks, _, _), (base_toks, _, _) = await asyncio.gather(_run(vengine, "lora-a", ids, NL, lora="a"),
                                                                 _run(vengine, "lora-base", ids, NL))
    assert lora_toks == peft_tokens["a"]
    assert base_toks == peft_tokens[None]
    assert lora_toks != base_toks  # the adapter changes the answer (the test adapter does)
    # vLLM's prefix cache keys blocks by adapter: the same prompt again reuses the adapter's own blocks
    again, cached, _ = await _run(vengine, "lora-a-again", ids, NL, lora="a")
    assert again == lora_toks and cached == len(ids) // 32 * 32


@needs_peft
async def test_unknown_unloaded_and_reloaded_adapters(vengine: object, adapter_dir: Path,
                                                      peft_tokens: dict[str | None, list[int]]) -> None:
    engine: object = vengine
    ids = _ids(engine, QUESTION)
    with pytest.raises(UnknownAdapter, match="'zz'"):
        await _run(engine, "unknown", ids, 4, lora="zz")
    with pytest.raises(ValueError, match="loaded already"):
        await engine.load_lora("a", adapter_dir)  # type: ignore[attr-defined]
    first_id = engine.lora_id("a")  # type: ignore[attr-defined]
    # not while a request runs with it
    gen = engine.generate(GenRequest("holding", ids, Sampling(), 200, lora="a"))  # type: ignore[attr-defined]
    await gen.__anext__()
    with pytest.raises(ValueError, match="in use"):
        await engine.unload_lora("a")  # type: ignore[attr-defined]
    await gen.aclose()
    await engine.unload_lora("a")  # type: ignore[attr-defined]
    assert engine.loras() == []  # type: ignore[attr-defined]
    with pytest.raises(UnknownAdapter, match="'a'"):
        await _run(engine, "unloaded", ids, 4, lora="a")
    with pytest.raises(UnknownAdapter):
        await engine.unload_lora("a")  # type: ignore[attr-defined]
    await engine.load_lora("a", adapter_dir)  # type: ignore[attr-defined]
    assert engine.loras() == ["a"] and engine.lora_id("a") != first_id  # type: ignore[attr-defined]
    toks, _, _ = await _run(engine, "reloaded", ids, NL, lora="a")
    assert toks == peft_tokens["a"]
