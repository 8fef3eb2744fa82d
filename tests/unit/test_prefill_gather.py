"""The prefill worker's batch gathering (splitserve.services.prefill.service.PrefillGather): the jobs started together
make one engine call once all of them have called or dropped out; a slow one does not hold the rest back."""

from __future__ import annotations

import asyncio

import pytest
import torch

from splitserve.engines import PrefillResult, PromptTooLong, Sampling
from splitserve.services.prefill.service import BatchItem, PrefillGather

GREEDY = Sampling()


class FakeEngineCalls:
    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []
        self.salts: list[list[str | None]] = []
        self.loras: list[list[str | None]] = []

    async def __call__(self, items: list[BatchItem]) -> list[PrefillResult | BaseException]:
        self.calls.append([ids for ids, _, _, _ in items])
        self.salts.append([salt for _, _, salt, _ in items])
        self.loras.append([lora for _, _, _, lora in items])
        await asyncio.sleep(0)
        return [PromptTooLong(len(ids), 4) if len(ids) >= 4 else
                PrefillResult(first_token=sum(ids), kv=torch.zeros(1), num_computed_tokens=len(ids))
                for ids, _, _, _ in items]


def test_jobs_started_together_make_one_call_and_errors_stay_per_job() -> None:
    calls = FakeEngineCalls()

    async def main() -> list[object]:
        gather = PrefillGather(["a", "b", "c", "d"], calls)

        async def job(key: str, ids: list[int] | None, delay: float) -> object:
            await asyncio.sleep(delay)  # the reservation
            try:
                if ids is None:
                    raise RuntimeError("reservation failed")
                return (await gather.prefill(key, ids, GREEDY)).first_token
            except Exception as exc:
                return type(exc).__name__
            finally:
                gather.leave(key)

        out = await asyncio.gather(job("a", [1], 0.0), job("b", [2, 3], 0.01), job("c", None, 0.02),
                                   job("d", [1, 1, 1, 1], 0.005))
        assert gather.batched == 3
        return list(out)

    assert asyncio.run(main()) == [1, 5, "RuntimeError", "PromptTooLong"]
    assert calls.calls == [[[1], [1, 1, 1, 1], [2, 3]]]


@pytest.mark.parametrize("wait_s", [0.05])
def test_a_slow_job_prefills_alone_later(wait_s: float) -> None:
    calls = FakeEngineCalls()

    async def main() -> list[int]:
        gather = PrefillGather(["a", "b", "slow"], calls, wait_s=wait_s)

        async def job(key: str, ids: list[int], delay: float) -> int:
            await asyncio.sleep(delay)
            try:
                return (await gather.prefill(key, ids, GREEDY)).first_token
            finally:
                gather.leave(key)

        out = await asyncio.gather(job("a", [1], 0.0), job("b", [2], 0.0), job("slow", [3], wait_s * 4))
        assert gather.batch_of == {"a": 2, "b": 2, "slow": 1}
        return list(out)

    assert asyncio.run(main()) == [1, 2, 3]
    assert calls.calls == [[[1], [2]], [[3]]]


def test_each_prompt_of_a_batch_keeps_its_own_cache_salt() -> None:
    """Jobs of different tenants can share a forward, but each prompt's prefix reuse stays in its own salt."""
    calls = FakeEngineCalls()

    async def main() -> None:
        gather = PrefillGather(["a", "b", "late"], calls)
        await asyncio.gather(gather.prefill("a", [1], GREEDY, "t:A"), gather.prefill("b", [2], GREEDY, "t:B", "ad"))
        await gather.prefill("late", [3], GREEDY, "g:shared", "ad2")  # after the batch closed: alone, salt kept

    asyncio.run(main())
    assert calls.salts == [["t:A", "t:B"], ["g:shared"]]
    assert calls.loras == [[None, "ad"], ["ad2"]]  # each prompt's LoRA adapter travels with it
