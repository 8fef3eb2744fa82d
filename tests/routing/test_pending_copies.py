"""PendingLoad keeps each worker's overlaid copy between decisions: it must never serve a stale one."""

from __future__ import annotations

from splitserve.routing.base import WorkerView
from splitserve.routing.pending import PendingLoad


def test_overlaid_copies_follow_pending_changes_and_new_views() -> None:
    p = PendingLoad(ttl_s=1.0)
    a, b = WorkerView("a", active_seqs=1, free_blocks=10, total_blocks=20), WorkerView("b", step_ms=7.0, pool="long")
    p.add("a", "r1", 100, 2, now=0.0)
    v1 = p.overlay([a, b], now=0.1)
    assert (v1[0].active_seqs, v1[0].queued_prefill_tokens, v1[0].free_blocks, v1[0].used_blocks) == (2, 100, 8, 2)
    assert v1[1] is b and a.active_seqs == 1  # the reported view is never modified
    assert p.overlay([a, b], now=0.2)[0] is v1[0]  # unchanged: the same copy
    p.add("a", "r2", 50, 1, now=0.3)
    assert p.overlay([a, b], now=0.3)[0].active_seqs == 3  # pending changed: recomputed
    a2 = WorkerView("a", active_seqs=5, free_blocks=4, total_blocks=20)  # a new heartbeat
    assert p.overlay([a2, b], now=0.4)[0].active_seqs == 7
    p.release("r1", "a")
    assert p.overlay([a2, b], now=0.5)[0].active_seqs == 6
    p.add("b", "r3", 10, 0, now=0.5)
    vb = p.overlay([a2, b], now=0.6)[1]
    assert (vb.step_ms, vb.pool, vb.active_seqs) == (7.0, "long", 1)  # every other field kept
    assert p.overlay([a2, b], now=1.45)[0] is a2  # r2 expired (ttl 1 s): a's own view again
