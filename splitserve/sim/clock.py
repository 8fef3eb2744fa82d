"""The simulator's clock and event queue: a binary heap of (time, order, callback, argument).

Time is simulated seconds from the start of the run; nothing here reads a wall clock. Events at the same
time run in the order they were scheduled (a monotonically increasing counter breaks ties), so a run is
deterministic given its inputs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

__all__ = ["EventLoop"]


class EventLoop:
    __slots__ = ("now", "_heap", "_order", "processed")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._order = 0
        self.processed = 0

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at simulated time ``t`` (never before now)."""
        self._order += 1
        heapq.heappush(self._heap, (t if t > self.now else self.now, self._order, fn, arg))

    def after(self, dt: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        self.at(self.now + dt, fn, arg)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        """Process events in time order until none is left, ``until`` is passed, or ``stop()`` says so."""
        heap = self._heap
        pop = heapq.heappop
        limit = float("inf") if until is None else until
        n = 0
        while heap:
            if heap[0][0] > limit:
                break
            t, _, fn, arg = pop(heap)
            self.now = t
            fn(arg)
            n += 1
            if not (n & 1023) and stop is not None and stop():
                break
        self.processed += n
