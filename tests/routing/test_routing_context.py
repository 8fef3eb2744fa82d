"""Context pools: long prompts decode on the ``long`` decoders, short ones never do while others are live."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.routing import ContextPools, Router, RoutingRequest, WorkerView
from splitserve.routing.pending import PendingLoad


def views(general: int, long: int) -> list[WorkerView]:
    return [WorkerView(f"g{i}", "decode") for i in range(general)] + [
        WorkerView(f"l{i}", "decode", pool="long") for i in range(long)
    ] + [WorkerView("p0", "prefill")]


def tokens(n: int) -> list[int]:
    return list(range(1000, 1000 + n))


def test_long_prompt_goes_to_the_long_pool_and_short_ones_never_do() -> None:
    router = Router("kvaware", context=ContextPools(long_prompt_tokens=2048))
    ws = views(2, 1)
    long = router.decide(RoutingRequest("long", token_ids=tokens(3000)), ws, 0.0)
    assert long.decoder == "l0"
    assert long.detail["context_pool"] == "long"
    assert long.route == "disaggregated"  # the long decoder still gets it through a prefiller
    for i in range(20):
        d = router.decide(RoutingRequest(f"s{i}", token_ids=tokens(40 + i)), ws, float(i))
        assert d.decoder.startswith("g"), d
        assert "context_pool" not in d.detail


def test_boundary_is_inclusive() -> None:
    pools = ContextPools(long_prompt_tokens=100)
    ws = views(1, 1)
    assert pools.candidates(99, ws)[1] == "general"
    assert pools.candidates(100, ws)[1] == "long"


def test_without_long_decoders_every_decoder_is_a_candidate() -> None:
    ws = views(3, 0)[:3]
    chosen, pool = ContextPools(long_prompt_tokens=10).candidates(5000, ws)
    assert pool == "general" and [w.worker_id for w in chosen] == ["g0", "g1", "g2"]


def test_only_long_decoders_live_serve_everything_degraded() -> None:
    router = Router("roundrobin", context=ContextPools(long_prompt_tokens=2048))
    d = router.decide(RoutingRequest("s", token_ids=tokens(20)), views(0, 1), 0.0)
    assert d.decoder == "l0" and d.detail["context_pool"] == "long_only"


def test_pending_overlay_keeps_the_pool() -> None:
    # the router's pending-load view rebuilds views: it must not turn a long decoder into a general one
    pending = PendingLoad(5.0)
    pending.add("l0", "r1", 0, 10, 0.0)
    out = pending.overlay(views(1, 1), 0.1)
    assert [w.pool for w in out if w.role == "decode"] == ["general", "long"]
    assert out[1].used_blocks == 10


def test_rejects_nonsense_threshold() -> None:
    with pytest.raises(ValueError):
        ContextPools(long_prompt_tokens=0)


@given(st.integers(0, 10_000), st.integers(0, 3), st.integers(0, 3), st.integers(1, 8192))
def test_partition_rule(prompt: int, general: int, long: int, threshold: int) -> None:
    ws = [w for w in views(general, long) if w.role == "decode"]
    if not ws:
        return
    chosen, pool = ContextPools(long_prompt_tokens=threshold).candidates(prompt, ws)
    assert chosen, "never an empty candidate list when some decoder is live"
    if long and prompt >= threshold:
        assert pool == "long" and all(w.pool == "long" for w in chosen)
    elif general:
        assert pool == "general" and all(w.pool == "general" for w in chosen) and len(chosen) == general
    else:
        assert pool == "long_only"


def test_decoder_refuses_an_unknown_pool() -> None:
    import subprocess
    import sys

    cp = subprocess.run([sys.executable, "-m", "splitserve.services.decode", "--pool", "huge", "--nats-url",
                         "nats://127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 2 and "--pool" in cp.stderr and "general, long" in cp.stderr, cp.stderr
