"""``roundrobin``: each pool takes turns, in worker-id order; ignores cache and load.

The rotation is over the sorted ids of the live workers, so it is fair (each live worker gets one of every
n requests) and does not depend on the order heartbeats arrived in; a worker joining or leaving only shifts
the rotation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitserve.routing.base import Candidate, RoutingRequest, Selection, Strategy, WorkerView

__all__ = ["RoundRobinStrategy"]


class RoundRobinStrategy(Strategy):
    name = "roundrobin"

    def __init__(self, start: int = 0) -> None:
        self._next: dict[str, int] = {}
        self._start = start
        self._order: dict[tuple[str, ...], list[int]] = {}

    def select(
        self, request: RoutingRequest, workers: Sequence[WorkerView], role: str, now: float, block_size: int
    ) -> Selection:
        ids = tuple(w.worker_id for w in workers)
        order = self._order.get(ids)
        if order is None:  # membership changed: recompute the id order once
            order = sorted(range(len(ids)), key=ids.__getitem__)
            if len(self._order) > 16:
                self._order.clear()
            self._order[ids] = order
        turn = self._next.get(role, self._start)
        self._next[role] = turn + 1
        at = order[turn % len(order)]
        w = workers[at]
        prompt = request.num_prompt_tokens()
        chosen = Candidate(w.worker_id, uncached_tokens=prompt, load=w.load)
        return Selection(
            chosen, "roundrobin", [chosen], {"turn": turn % len(order), "pool": len(order)}, view_index=at
        )

    def config(self) -> dict[str, Any]:
        return {"start": self._start}
