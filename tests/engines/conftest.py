"""Fixtures for the engine tests: the tiny engine (fast) and the real bundled SmolLM2 (slow, loaded once)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import PreTrainedTokenizerFast

# the contract suite's asserts live in a helper module: rewrite them too, for pytest's detailed failures
pytest.register_assert_rewrite("tests.engines.enginetest")

from splitserve.engines.hf import HfEngine  # noqa: E402
from tests.engines.enginetest import TEST_THREADS, make_tiny_model, make_tiny_tokenizer  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_threads() -> Iterator[None]:
    """TEST_THREADS for these tests only: torch's thread count is process-wide, other suites keep theirs."""
    previous = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_engine(tiny_tokenizer: PreTrainedTokenizerFast) -> HfEngine:
    return HfEngine(make_tiny_model(len(tiny_tokenizer)), tiny_tokenizer, name="tiny")


@pytest.fixture()
def engine(tiny_engine: HfEngine) -> Iterator[HfEngine]:
    """The tiny engine, with the decode batch emptied after each test."""
    yield tiny_engine
    for seq_id in tiny_engine.active_ids():
        tiny_engine.remove_sequence(seq_id, keep_kv=False)


@pytest.fixture(scope="session")
def real_engine() -> HfEngine:
    return HfEngine.load()  # thread count: left to _torch_threads
