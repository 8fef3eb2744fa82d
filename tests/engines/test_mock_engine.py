"""mock engine: the shared Engine contract, plus what is mock-specific: it says it is not a model, its tokens are
a pure function that never ends a sequence early, its KV bytes are predictable, and its speed knobs."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import torch

from splitserve.engines import Engine, Sampling, load_engine
from splitserve.engines.mock import (
    LORA_LOAD_MS_ENV,
    PREFILL_TPS_ENV,
    STEP_MS_ENV,
    STEP_MS_PER_SEQ_ENV,
    WARNING,
    ZERO_COST_TPS,
    MockEngine,
    mock_kv,
)
from splitserve.services.common.options import EngineOptions
from tests.engines.enginetest import GREEDY, PROMPTS, EngineContract, roundtrip, run


def instant(engine: Engine, max_model_len: int | None = None) -> MockEngine:
    """Another mock over the same tokenizer, with the sleeps off."""
    assert isinstance(engine, MockEngine)
    return MockEngine(engine.tokenizer, max_model_len=max_model_len, step_ms=0, prefill_tokens_per_s=0)


@pytest.fixture(scope="session")
def mock_engine() -> MockEngine:
    """Over the bundled model's tokenizer (the one the router uses), with the sleeps off."""
    engine = load_engine("mock", step_ms=0, prefill_tokens_per_s=0)
    assert isinstance(engine, MockEngine)
    return engine


@pytest.fixture()
def mock(mock_engine: MockEngine) -> Iterator[MockEngine]:
    yield mock_engine
    for seq_id in mock_engine.active_ids():
        mock_engine.remove_sequence(seq_id, keep_kv=False)


class TestMockEngineContract(EngineContract):
    """Nothing of the contract is skipped: only comparisons with transformers (hf's own tests) do not apply."""

    @pytest.fixture()
    def engine(self, mock: MockEngine) -> MockEngine:
        return mock

    def sibling(self, engine: Engine) -> Engine:
        return instant(engine)

    def short(self, engine: Engine, max_model_len: int) -> Engine:
        return instant(engine, max_model_len)


def test_says_it_is_not_a_model(mock: MockEngine, caplog: pytest.LogCaptureFixture) -> None:
    assert mock.info.name == "mock-SmolLM2-135M-Instruct.Q4_1"
    with caplog.at_level(logging.WARNING, logger="splitserve.engines.mock"):
        named = load_engine("mock", name="SmolLM2", step_ms=0)
    assert named.info.name == "mock-SmolLM2"
    assert load_engine("mock", name="mock-a", step_ms=0).info.name == "mock-a"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [WARNING, WARNING]


def test_loader_takes_the_services_options(mock: MockEngine) -> None:
    engine = load_engine("mock", model="bundled", dtype="bfloat16", num_threads=1, max_model_len=512,
                         name=None, block_size=16, transport="tcp")  # the last two: unknown, ignored
    assert engine.info.dtype == "bfloat16" and engine.info.max_model_len == 512
    assert engine.prefill(engine.encode("hello"), GREEDY).kv.dtype == torch.bfloat16
    assert (engine.info.num_layers, engine.info.num_kv_heads, engine.info.head_dim) == (2, 1, 8)
    assert engine.info.kv_bytes_per_token == 2 * 2 * 1 * 8 * 2
    assert EngineOptions(engine="mock").load().info.name.startswith("mock")
    with pytest.raises(ValueError, match="dtype"):
        load_engine("mock", dtype="int8")


def test_vocabulary_is_the_bundled_models(mock: MockEngine) -> None:
    assert mock.info.vocab_size == 49152 and mock.info.eos_token_ids == (2,)
    assert mock.decode(mock.encode("The capital of France is Paris.")) == "The capital of France is Paris."
    ids = mock.apply_chat_template([{"role": "user", "content": "hi"}])
    assert mock.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    specials = set(mock.tokenizer.all_special_ids) | set(mock.tokenizer.added_tokens_decoder)
    assert not specials & set(mock.token_range) and mock.token_range.stop == 49152


def test_tokens_are_a_pure_function_and_never_eos(mock: MockEngine) -> None:
    ids = mock.encode(PROMPTS[0])
    tokens = run(mock, ids, 2000)
    context = [ids[-1], *tokens]
    assert tokens == [mock.next_token(context[i], len(ids) + i, 0) for i in range(len(tokens))]
    assert all(t in mock.token_range for t in tokens)  # never EOS nor special: finishes by length only
    assert len(set(tokens)) > 1500  # not a degenerate repeat
    # greedy ignores the seed, as a model's would; a sampled seed picks a different stream
    assert run(mock, ids, 20, Sampling(seed=5)) == tokens[:20]
    assert run(mock, ids, 20, Sampling(temperature=0.7, seed=5)) != tokens[:20]
    assert run(mock, ids, 20, Sampling(temperature=0.7)) == run(mock, ids, 20, Sampling(temperature=1.0, seed=0))


def test_kv_bytes_are_predictable(mock: MockEngine) -> None:
    ids = mock.encode(PROMPTS[1])
    result = mock.prefill(ids, GREEDY)
    assert torch.equal(result.kv, mock_kv(ids, mock.info))
    assert torch.equal(result.kv[1, 0, 0, 3], ids[3] + torch.arange(8, 16) / 64)  # layer 1: offsets 8..15
    assert torch.equal(result.kv[0, 1, 0, 3], -(3 + torch.arange(8) / 64))
    mock.add_sequence("k", roundtrip(result.kv), result.first_token, GREEDY)
    fed = [result.first_token] + [mock.step()["k"] for _ in range(4)]
    kv = mock.remove_sequence("k")
    assert kv is not None and torch.equal(kv, mock_kv(ids + fed[:4], mock.info))


def test_a_step_sleeps_once_per_batch(mock: MockEngine) -> None:
    slow = MockEngine(mock.tokenizer, step_ms=20, prefill_tokens_per_s=0)
    result = slow.prefill(slow.encode(PROMPTS[0]), GREEDY)
    for i in range(8):
        slow.add_sequence(str(i), result.kv, result.first_token, GREEDY)
    started = time.perf_counter()
    for _ in range(5):
        assert len(slow.step()) == 8
    elapsed = time.perf_counter() - started
    assert 0.1 <= elapsed < 0.4  # 5 x 20 ms, not 8 x 5 x 20 ms
    empty = MockEngine(mock.tokenizer, step_ms=1000, prefill_tokens_per_s=0)
    started = time.perf_counter()
    assert empty.step() == {}  # nothing to compute: no sleep
    assert time.perf_counter() - started < 0.5


def test_a_step_costs_more_with_a_bigger_batch(mock: MockEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """``step_ms_per_seq``: a step sleeps for each active sequence too (a real engine's step grows with its
    batch), so a decoder's inter-token latency depends on how many streams it runs."""
    monkeypatch.setenv(STEP_MS_PER_SEQ_ENV, "10")
    engine = MockEngine(mock.tokenizer, step_ms=0, prefill_tokens_per_s=0)
    assert engine.step_ms_per_seq == 10.0
    result = engine.prefill(engine.encode(PROMPTS[0]), GREEDY)

    def three_steps(batch: int) -> float:
        for i in range(batch):
            engine.add_sequence(f"{batch}-{i}", result.kv, result.first_token, GREEDY)
        started = time.perf_counter()
        for _ in range(3):
            assert len(engine.step()) == batch
        for i in range(batch):
            engine.remove_sequence(f"{batch}-{i}", keep_kv=False)
        return time.perf_counter() - started

    one, eight = three_steps(1), three_steps(8)
    assert eight >= 3 * 8 * 0.010  # a sleep is never shorter than asked
    assert eight > 3 * one  # 8 x 10 ms against 10 ms a step (a flat step cost would make them equal)


def test_prefill_sleeps_for_the_computed_tokens_only(mock: MockEngine) -> None:
    slow = MockEngine(mock.tokenizer, step_ms=0, prefill_tokens_per_s=1000)
    ids = list(range(100, 300))  # 200 tokens: 0.2 s
    started = time.perf_counter()
    full = slow.prefill(ids, GREEDY)
    assert 0.2 <= time.perf_counter() - started < 0.5
    started = time.perf_counter()
    assert slow.prefill(ids, GREEDY, past_kv=full.kv[:, :, :, :190]).num_computed_tokens == 10
    assert time.perf_counter() - started < 0.15


def test_knobs_from_the_environment(mock: MockEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (MockEngine(mock.tokenizer).step_ms, MockEngine(mock.tokenizer).prefill_tokens_per_s) == (5.0, 50_000.0)
    monkeypatch.setenv(STEP_MS_ENV, "7.5")
    monkeypatch.setenv(PREFILL_TPS_ENV, "1e6")
    engine = load_engine("mock")
    assert isinstance(engine, MockEngine)
    assert (engine.step_ms, engine.prefill_tokens_per_s) == (7.5, 1e6)
    assert MockEngine(mock.tokenizer, step_ms=1).step_ms == 1  # an explicit option wins
    monkeypatch.setenv(STEP_MS_ENV, "fast")
    with pytest.raises(ValueError, match=STEP_MS_ENV):
        MockEngine(mock.tokenizer)
    monkeypatch.setenv(STEP_MS_ENV, "-1")
    with pytest.raises(ValueError, match="step_ms must be >= 0"):
        MockEngine(mock.tokenizer)


def test_only_a_mock_with_no_sleep_left_runs_inline(mock: MockEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """``blocking`` decides whether the services call the engine on their engine thread: a mock that sleeps for
    any compute time does (it would stall the event loop), a zero-cost one does not."""
    tok = mock.tokenizer
    assert MockEngine(tok, step_ms=0, prefill_tokens_per_s=0).blocking is False
    assert MockEngine(tok, step_ms=0, prefill_tokens_per_s=ZERO_COST_TPS).blocking is False  # bench.peers' 1e12 too
    assert MockEngine(tok).blocking is True  # the defaults: 5 ms steps, 50,000 tokens/s
    assert MockEngine(tok, step_ms=0.5, prefill_tokens_per_s=0).blocking is True
    assert MockEngine(tok, step_ms=0, step_ms_per_seq=0.1, prefill_tokens_per_s=0).blocking is True
    assert MockEngine(tok, step_ms=0, prefill_tokens_per_s=1e6).blocking is True
    monkeypatch.setenv(LORA_LOAD_MS_ENV, "20")
    assert MockEngine(tok, step_ms=0, prefill_tokens_per_s=0).blocking is True
    # a prefill at the zero-cost rate does not sleep (a sleep's timer slack alone would cost more than it)
    fast = MockEngine(tok, step_ms=0, prefill_tokens_per_s=ZERO_COST_TPS)
    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    fast.prefill(list(range(100, 400)), GREEDY)
    assert sleeps == []
    MockEngine(tok, step_ms=0, prefill_tokens_per_s=1e6).prefill(list(range(100, 400)), GREEDY)
    assert sleeps == [pytest.approx(300 / 1e6)]
