"""Dispatch capacity follows the decoders' ends as they arrive: a slot a heartbeat showed taken is offered again
when its request's RequestFinished comes, not at the decoder's next heartbeat (which capped a decoder at about
its batch size per heartbeat interval)."""

from __future__ import annotations

import time

from splitserve import proto
from splitserve.services.router.service import RouterService


def _hb(seq: int, active: int, ids: list[str]) -> proto.Heartbeat:
    return proto.Heartbeat(worker_id="d0", role="decode", seq=seq, pid=1,
                           load=proto.WorkerLoad(active_seqs=active, max_seqs=8),
                           active_requests=[proto.request_key("t", i) for i in ids])


def _end(rid: str, worker: str = "d0") -> proto.RequestFinished:
    return proto.RequestFinished(request_id=rid, tenant="t", worker_id=worker, status="ok")


async def test_a_slot_is_free_again_when_its_request_ends() -> None:
    svc = RouterService("router-fs", "nats://127.0.0.1:1", queue=False)
    svc.make_policy()
    await svc.on_finished(_end("z"), None)  # type: ignore[arg-type]  # ended before the heartbeat
    # "z" is still listed (its end not stored yet) but not counted in the load: it frees nothing later
    await svc.on_heartbeat(_hb(1, 8, [f"r{i}" for i in range(8)] + ["z"]), None)  # type: ignore[arg-type]
    base = svc.free_slots(time.monotonic())
    assert base == 8 + 2 - 8
    await svc.on_finished(_end("r0"), None)  # type: ignore[arg-type]
    await svc.on_finished(_end("r1"), None)  # type: ignore[arg-type]
    assert svc.free_slots(time.monotonic()) == base + 2
    for dup in ("r1", "z", "x"):  # a repeated end, one from before the heartbeat, one never listed
        await svc.on_finished(_end(dup), None)  # type: ignore[arg-type]
    await svc.on_finished(_end("o1", worker="d1"), None)  # type: ignore[arg-type]  # another worker's end
    assert svc.free_slots(time.monotonic()) == base + 2
    # the next heartbeat is the new truth: what it lists is counted from there
    await svc.on_heartbeat(_hb(2, 6, [f"r{i}" for i in range(2, 8)]), None)  # type: ignore[arg-type]
    assert svc.free_slots(time.monotonic()) == base + 2
    await svc.on_finished(_end("r2"), None)  # type: ignore[arg-type]
    assert svc.free_slots(time.monotonic()) == base + 3
