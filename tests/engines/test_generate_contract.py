"""The generate-level contract on the hf engine (tiny random model) through KvEngineAdapter; the same
checks run on vLLM in tests/vllm/test_vllm_engine.py."""

from __future__ import annotations

from splitserve.engines.generate import KvEngineAdapter
from splitserve.engines.hf import HfEngine
from tests.engines import generate_contract as contract


async def test_hf_satisfies_the_generate_contract(tiny_engine: HfEngine) -> None:
    engine = KvEngineAdapter(tiny_engine)
    try:
        await contract.check_all(engine, tiny_engine.encode("The quick brown fox"),
                                 tiny_engine.encode("Disaggregated prefill and decode"))
    finally:
        await engine.close()
