"""The disaggregation rule: a table of cases, presets, and invariants over the whole input space."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from splitserve.routing import DIRECT, DISAGGREGATED, DisaggPolicy, WorkerView

IDLE = WorkerView("d", "decode")
BUSY = WorkerView("d", "decode", active_seqs=4)
BUSY_SLOW = WorkerView("d", "decode", active_seqs=4, prefill_tokens_per_s=800.0)


@pytest.mark.parametrize(
    ("policy", "prompt", "uncached", "decoder", "prefillers", "route", "reason"),
    [
        # absolute threshold (512 on CPU)
        (DisaggPolicy(), 3000, 3000, IDLE, True, DISAGGREGATED, "long_uncached"),
        (DisaggPolicy(), 3000, 511, IDLE, True, DIRECT, "short_uncached"),
        (DisaggPolicy(), 3000, 512, IDLE, True, DISAGGREGATED, "long_uncached"),
        (DisaggPolicy(), 100, 100, IDLE, True, DIRECT, "short_uncached"),
        (DisaggPolicy(), 3000, 0, IDLE, True, DIRECT, "fully_cached"),
        (DisaggPolicy(), 0, 0, IDLE, True, DIRECT, "fully_cached"),
        # no prefill pool: degrade to direct, remember what was wanted
        (DisaggPolicy(), 3000, 3000, IDLE, False, DIRECT, "no_prefillers"),
        (DisaggPolicy(), 3000, 100, IDLE, False, DIRECT, "short_uncached"),
        # relative rule, "any": mostly cached goes direct even when the uncached part is long
        (DisaggPolicy(max_direct_fraction=0.2), 100_000, 10_000, IDLE, True, DIRECT, "mostly_cached"),
        (DisaggPolicy(max_direct_fraction=0.2), 100_000, 30_000, IDLE, True, DISAGGREGATED, "long_uncached"),
        # Dynamo's rule ("all"): < 2048 uncached AND < 70% of the prompt
        (DisaggPolicy.dynamo(), 4000, 2000, IDLE, True, DIRECT, "short_uncached"),
        (DisaggPolicy.dynamo(), 2100, 2000, IDLE, True, DISAGGREGATED, "long_uncached"),  # 95% uncached
        (DisaggPolicy.dynamo(), 10_000, 2048, IDLE, True, DISAGGREGATED, "long_uncached"),
        (DisaggPolicy.dynamo(), 100, 100, IDLE, True, DISAGGREGATED, "long_uncached"),
        # stall rule: a busy, slow decoder sends even short prefills away ...
        (DisaggPolicy(max_stall_ms=200), 3000, 400, BUSY_SLOW, True, DISAGGREGATED, "would_stall"),
        (DisaggPolicy(max_stall_ms=200), 3000, 150, BUSY_SLOW, True, DIRECT, "short_uncached"),  # 187 ms
        # ... an idle one may prefill locally, and without a rate the rule cannot fire
        (
            DisaggPolicy(max_stall_ms=200),
            3000,
            400,
            WorkerView("d", "decode", prefill_tokens_per_s=800.0),
            True,
            DIRECT,
            "short_uncached",
        ),
        (DisaggPolicy(max_stall_ms=200), 3000, 400, BUSY, True, DIRECT, "short_uncached"),
        (
            DisaggPolicy(max_stall_ms=200, decoder_prefill_tokens_per_s=800.0),
            3000,
            400,
            BUSY,
            True,
            DISAGGREGATED,
            "would_stall",
        ),
        (DisaggPolicy(max_stall_ms=200), 3000, 400, BUSY_SLOW, False, DIRECT, "no_prefillers"),
        # presets
        (DisaggPolicy.always(), 20, 1, IDLE, True, DISAGGREGATED, "long_uncached"),
        (DisaggPolicy.never(), 90_000, 90_000, IDLE, True, DIRECT, "disaggregation_off"),
    ],
)
def test_rule_table(
    policy: DisaggPolicy,
    prompt: int,
    uncached: int,
    decoder: WorkerView,
    prefillers: bool,
    route: str,
    reason: str,
) -> None:
    rc = policy.decide(prompt, uncached, decoder, prefillers)
    assert (rc.route, rc.reason) == (route, reason)
    assert rc.values["uncached_tokens"] == min(uncached, prompt)


def test_values_record_the_inputs() -> None:
    rc = DisaggPolicy(max_stall_ms=200).decide(3000, 400, BUSY_SLOW, True)
    assert rc.values["stall_ms"] == 500.0
    assert rc.values["decoder_prefill_tokens_per_s"] == 800.0
    rc = DisaggPolicy().decide(3000, 3000, IDLE, False)
    assert rc.values["wanted"] == "long_uncached"


def test_invalid_settings() -> None:
    with pytest.raises(ValueError):
        DisaggPolicy(combine="some")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        DisaggPolicy(max_direct_fraction=1.5)
    with pytest.raises(ValueError):
        DisaggPolicy(min_uncached_tokens=-1)


policies = st.builds(
    DisaggPolicy,
    min_uncached_tokens=st.integers(0, 5000),
    max_direct_fraction=st.none() | st.floats(0.0, 1.0),
    combine=st.sampled_from(["any", "all"]),
    max_stall_ms=st.none() | st.floats(1.0, 10_000.0),
    decoder_prefill_tokens_per_s=st.none() | st.floats(10.0, 50_000.0),
)
decoders_st = st.builds(
    WorkerView,
    worker_id=st.just("d"),
    role=st.just("decode"),
    active_seqs=st.integers(0, 64),
    prefill_tokens_per_s=st.none() | st.floats(10.0, 50_000.0),
)


@settings(max_examples=300, deadline=None)
@given(policies, st.integers(0, 200_000), st.integers(0, 200_000), st.integers(0, 200_000), decoders_st)
def test_more_cache_never_sends_a_request_away(
    policy: DisaggPolicy, prompt: int, a: int, b: int, decoder: WorkerView
) -> None:
    less, more = sorted((min(a, prompt), min(b, prompt)))  # uncached tokens: less <= more
    if policy.decide(prompt, more, decoder, True).route == DIRECT:
        assert policy.decide(prompt, less, decoder, True).route == DIRECT


@settings(max_examples=300, deadline=None)
@given(policies, st.integers(0, 200_000), st.integers(0, 200_000), decoders_st)
def test_no_prefillers_is_always_direct_and_reasons_are_known(
    policy: DisaggPolicy, prompt: int, uncached: int, decoder: WorkerView
) -> None:
    assert policy.decide(prompt, uncached, decoder, False).route == DIRECT
    rc = policy.decide(prompt, uncached, decoder, True)
    assert rc.reason in {"fully_cached", "would_stall", "short_uncached", "mostly_cached", "long_uncached"}
    if rc.route == DISAGGREGATED:
        assert min(uncached, prompt) > 0


def test_stall_counts_a_forward_passs_fixed_cost() -> None:
    # 25 tokens at 800 tok/s is 31 ms of compute, but a CPU decoder whose steps take 100 ms pauses its streams
    # for a whole forward pass plus that: 131 ms, over a 100 ms bound -> a prefiller takes it.
    busy = WorkerView("d", active_seqs=4, prefill_tokens_per_s=800.0, step_ms=100.0)
    rc = DisaggPolicy(max_stall_ms=100).decide(25, 25, busy, True)
    assert (rc.route, rc.reason) == (DISAGGREGATED, "would_stall")
    assert rc.values["stall_ms"] == pytest.approx(131.25) and rc.values["decoder_step_ms"] == 100.0
    unknown = WorkerView("d", active_seqs=4, prefill_tokens_per_s=800.0)  # no step time reported yet
    assert DisaggPolicy(max_stall_ms=100).decide(25, 25, unknown, True).route == DIRECT
    idle = WorkerView("d", active_seqs=0, prefill_tokens_per_s=800.0, step_ms=100.0)
    assert DisaggPolicy(max_stall_ms=100).decide(25, 25, idle, True).route == DIRECT


def test_pending_accounting_keeps_the_decoders_step_time() -> None:
    # the router adds requests it routed but the decoder has not reported yet; the stall rule must still see
    # the decoder's step time on that adjusted view (it once fell back to "unknown" and routed direct)
    from splitserve.routing import Router

    router = Router("roundrobin", disagg=DisaggPolicy(max_stall_ms=100))
    views = [WorkerView("d", active_seqs=4, prefill_tokens_per_s=800.0, step_ms=100.0),
             WorkerView("p", role="prefill", prefill_tokens_per_s=800.0)]
    from splitserve.routing import RoutingRequest

    first = router.decide(RoutingRequest("r1", "t", list(range(25))), views, 0.0)
    second = router.decide(RoutingRequest("r2", "t", list(range(1000, 1025))), views, 0.0)
    assert (first.route, second.route) == (DISAGGREGATED, DISAGGREGATED)
