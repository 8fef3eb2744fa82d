"""Fixtures for the engine tests: the tiny engine (fast) and the real bundled SmolLM2 (slow, loaded once)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from enginetest import TEST_THREADS, make_tiny_model, make_tiny_tokenizer
from transformers import PreTrainedTokenizerFast

from splitserve.engines.hf import HfEngine


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_engine(tiny_tokenizer: PreTrainedTokenizerFast) -> Iterator[HfEngine]:
    engine = HfEngine(
        make_tiny_model(len(tiny_tokenizer)), tiny_tokenizer, name="tiny", num_threads=TEST_THREADS
    )
    yield engine
    for seq_id in engine.active_ids():
        engine.remove_sequence(seq_id)


@pytest.fixture()
def engine(tiny_engine: HfEngine) -> Iterator[HfEngine]:
    """The tiny engine, with the decode batch emptied after each test."""
    yield tiny_engine
    for seq_id in tiny_engine.active_ids():
        tiny_engine.remove_sequence(seq_id)


@pytest.fixture(scope="session")
def real_engine() -> HfEngine:
    return HfEngine.load(num_threads=TEST_THREADS)
