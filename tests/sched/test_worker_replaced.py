"""A worker id whose process is replaced by a new one (restarted under the same id before its heartbeats timed
out): the requests the old process held move, the ones routed to the new process stay, whatever else moved
their timers meanwhile (the lost-job check moves ``routed_at`` forward once per window)."""

from __future__ import annotations

import pytest
from opentelemetry import trace

import splitserve.services.router.service as service_mod
from splitserve import proto
from splitserve.services.router.service import RouterService
from tests.recording_bus import RecordingBus


def _hb(pid: int, seq: int, keys: list[str]) -> proto.Heartbeat:
    return proto.Heartbeat(worker_id="d0", role="decode", seq=seq, pid=pid, max_model_len=8192,
                           load=proto.WorkerLoad(active_seqs=len(keys), max_seqs=8, free_blocks=100,
                                                 total_blocks=100), active_requests=keys)


async def test_only_the_old_process_requests_move_when_a_worker_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    moved: list[str] = []

    async def migrate(inf: object, *_: object, **__: object) -> None:
        moved.append(inf.request_id)  # type: ignore[attr-defined]

    svc = RouterService("router-rp", "nats://127.0.0.1:1", queue=False)
    svc.clock = lambda: clock[0]
    svc.make_policy()
    bus = RecordingBus()
    spawned: list[object] = []
    bus.spawn = spawned.append  # type: ignore[method-assign,assignment]
    svc.bus = bus  # type: ignore[assignment]
    monkeypatch.setattr(svc, "_migrate", migrate)
    await svc.on_heartbeat(_hb(1, 1, []), None)  # type: ignore[arg-type]

    async def route(rid: str) -> service_mod.Inflight:
        req = proto.GenerateRequest(request_id=rid, tenant="t", prompt_token_ids=[1, 2, 3],
                                    sampling=proto.SamplingParams(max_tokens=4))
        inf = await svc._route(req, [1, 2, 3], None, trace.INVALID_SPAN)
        assert inf is not None
        return inf

    old = await route("old")  # sent to pid 1, never confirmed
    clock[0] += 3.0
    old.routed_at = clock[0]  # what the lost-job check does to an unconfirmed request, once per window
    await svc.on_heartbeat(_hb(2, 1, []), None)  # type: ignore[arg-type]  # pid 2 replaces pid 1
    clock[0] += 0.1
    new = await route("new")  # sent to pid 2
    assert new.decoder == old.decoder == "d0"
    reaped = svc.registry.reap(clock[0], observer=None)
    assert reaped, svc.registry.workers
    for wid, reason in reaped:
        svc._worker_lost(wid, reason)
    for coro in spawned:
        await coro  # type: ignore[misc]
    assert moved == ["old"]
