"""The router holds nothing per request once the request ended: a long run of requests routed, listed in
heartbeats and finished (every map and ledger the router keeps per request) grows its memory by a bounded amount
however many requests pass, not by an amount per request. (A soak saw the routers' RSS creep by ~0.1 MiB/min:
the remembered-ends map and the per-tenant rate windows filled towards their bounds, and the rate windows had
none unless a queue report asked for them.)"""

from __future__ import annotations

import gc
import tracemalloc

import pytest
from opentelemetry import trace

import splitserve.services.router.core as core_mod
from splitserve import proto
from splitserve.obs.rates import EventRate
from splitserve.services.router.service import RouterService
from tests.recording_bus import RecordingBus


def _hb(seq: int, keys: list[str]) -> proto.Heartbeat:
    return proto.Heartbeat(worker_id="d0", role="decode", seq=seq, pid=1, max_model_len=8192,
                           load=proto.WorkerLoad(active_seqs=len(keys), max_seqs=64, free_blocks=10_000,
                                                 total_blocks=10_000), active_requests=keys)


async def _run(svc: RouterService, bus: RecordingBus, clock: list[float], start: int, n: int) -> None:
    span = trace.INVALID_SPAN
    for i in range(start, start + n):
        clock[0] += 0.05  # 20 requests per second: the time windows (rates, pending load) turn over
        tenant = f"t{i % 4}"
        req = proto.GenerateRequest(request_id=f"r{i}", tenant=tenant, prompt_token_ids=[1 + i % 50, 2, 3, 4],
                                    sampling=proto.SamplingParams(max_tokens=4))
        inf = await svc._route(req, list(req.prompt_token_ids or []), None, span)
        assert inf is not None
        svc._rate(tenant, "accepted").add(clock[0])
        await svc.on_heartbeat(_hb(i + 1, [req.key]), None)  # type: ignore[arg-type]
        await svc.on_finished(proto.RequestFinished(request_id=req.request_id, tenant=tenant, worker_id="d0",
                                                    status="ok", usage=proto.Usage(prompt_tokens=4,
                                                                                   completion_tokens=4)),
                              None)  # type: ignore[arg-type]
        bus.published.clear()


async def test_router_memory_does_not_grow_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(core_mod, "RECENT_ENDS_KEPT", 500)  # every bound reached early in the run
    svc = RouterService("router-mem", "nats://127.0.0.1:1", queue=False, strategy="kvaware", log_level="WARNING")
    svc.clock = lambda: clock[0]
    svc.make_policy()
    bus = RecordingBus()
    svc.bus = bus  # type: ignore[assignment]
    await svc.on_heartbeat(_hb(0, []), None)  # type: ignore[arg-type]
    await _run(svc, bus, clock, 0, 1500)  # warm: caches, the bounded maps filled
    tracemalloc.start()
    try:
        # Two equal runs, both traced: what the first left in bounded structures, the second replaces (freed), so
        # their difference is what the router keeps per request.
        await _run(svc, bus, clock, 1500, 3000)
        gc.collect()
        first = tracemalloc.get_traced_memory()[0]
        await _run(svc, bus, clock, 4500, 3000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - first
    finally:
        tracemalloc.stop()
    assert not svc.inflight and not svc._accepted_meta
    print(f"router memory per request: {grown / 3000:.2f} B")
    assert grown / 3000 < 16, f"{grown} bytes for 3,000 more requests ({grown / 3000:.1f} B per request)"


def test_a_rate_window_stays_bounded_when_nobody_asks() -> None:
    r = EventRate(window_s=1.0)
    t = 0.0
    for _ in range(100_000):
        t += 0.001  # 1,000 events per second for 100 s
        r.add(t)
    assert len(r._t) <= 1_100
    assert 990 <= r.per_s(t) * r.window_s <= 1_001


def test_a_young_rate_is_read_over_its_own_age() -> None:
    """A tenant that started 2 s ago at 5 requests/s reads as 5/s, not as its 10 events over the whole 10 s
    window (SLO admission divides the queue ahead by this rate: a fifth of it refused a first burst)."""
    r = EventRate(window_s=10.0)
    assert r.per_s(0.0) == 0.0
    for i in range(11):
        r.add(100.0 + i * 0.2)
    assert 5.0 <= r.per_s(102.0) <= 5.6
    one = EventRate(window_s=10.0)
    one.add(5.0)
    assert one.per_s(5.0) == 1.0  # the first event alone: over at least a second
    assert abs(r.per_s(109.0) - 11 / 9) < 1e-9 and abs(r.per_s(150.0)) < 1e-9
