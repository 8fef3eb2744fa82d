"""Load this router has dispatched that the workers' heartbeats do not show yet.

Worker views come from heartbeats (every ~500 ms). Between two heartbeats every decision would see the
same loads, so a burst of similar requests would all pick the same "cheapest" worker (herding). The
router therefore remembers what it just sent - one sequence, its prefill tokens and its KV blocks per
worker - and overlays that on the views it decides with, until the worker's own report can be trusted to
include it: ``release(request_id, worker)`` when that worker's heartbeat lists the request (or it finished),
or ``ttl_s``
after dispatch at the latest. Dynamo's router keeps a similar predicted-load book for the same reason.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from operator import attrgetter

from splitserve.routing.base import WorkerView

__all__ = ["PendingLoad"]


@dataclass(slots=True)
class _Entry:
    at: float
    request_id: str
    worker_id: str
    tokens: int
    blocks: int
    live: bool = True


class PendingLoad:
    def __init__(self, ttl_s: float = 1.0) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.ttl_s = ttl_s
        self._queue: deque[_Entry] = deque()
        self._by_request: dict[str, list[_Entry]] = {}
        self._per_worker: dict[str, list[int]] = {}  # worker -> [sequences, prefill tokens, blocks]
        self._copies: dict[str, tuple[WorkerView, WorkerView]] = {}  # worker -> (view given, view + pending)

    def __len__(self) -> int:
        return len(self._by_request)

    def add(self, worker_id: str, request_id: str, prefill_tokens: int, blocks: int, now: float) -> None:
        e = _Entry(now, request_id, worker_id, prefill_tokens, blocks)
        self._queue.append(e)
        self._by_request.setdefault(request_id, []).append(e)
        self._copies.pop(worker_id, None)
        acc = self._per_worker.get(worker_id)
        if acc is None:
            self._per_worker[worker_id] = [1, prefill_tokens, blocks]
        else:
            acc[0] += 1
            acc[1] += prefill_tokens
            acc[2] += blocks

    def _drop(self, e: _Entry) -> None:
        if not e.live:
            return
        e.live = False
        self._copies.pop(e.worker_id, None)
        acc = self._per_worker[e.worker_id]
        acc[0] -= 1
        acc[1] -= e.tokens
        acc[2] -= e.blocks
        if acc[0] <= 0:
            del self._per_worker[e.worker_id]

    def release(self, request_id: str, worker_id: str | None = None) -> None:
        """``worker_id``'s own reports now include this request (None: every worker's, or it is over).

        Per worker, because a disaggregated request is pending on two: the decoder lists it (its KV
        reservation) long before the prefiller's next report shows the prefill, and releasing both on the
        decoder's report made a prefiller busy with a 3,000-token prompt look idle to the next short one."""
        entries = self._by_request.get(request_id)
        if not entries:
            return
        for e in entries:
            if worker_id is None or e.worker_id == worker_id:
                self._drop(e)
        if all(not e.live for e in entries):
            del self._by_request[request_id]

    def forget_worker(self, worker_id: str) -> None:
        for e in self._queue:
            if e.worker_id == worker_id:
                self._drop(e)

    def expire(self, now: float) -> None:
        q = self._queue
        horizon = now - self.ttl_s
        while q and q[0].at <= horizon:
            e = q.popleft()
            if e.live:
                self._drop(e)
                entries = self._by_request.get(e.request_id)
                if entries is not None and not any(x.live for x in entries):
                    del self._by_request[e.request_id]

    def pending_for(self, worker_id: str) -> tuple[int, int, int]:
        acc = self._per_worker.get(worker_id)
        return (acc[0], acc[1], acc[2]) if acc else (0, 0, 0)

    def overlay(self, views: Sequence[WorkerView], now: float) -> Sequence[WorkerView]:
        """``views`` with pending load added (copies only for workers that have some).

        Views are treated as immutable: a worker's copy is kept until its pending load changes or it is given
        a different view object, so a caller that reuses view objects between heartbeats (the simulator, with
        hundreds of workers pending at once) does not pay for a fresh copy of each one per decision."""
        self.expire(now)
        per = self._per_worker
        if not per:
            return views
        get, over = per.get, self._over
        return [v if (acc := get(v.worker_id)) is None else over(v, acc) for v in views]

    def _over(self, v: WorkerView, acc: list[int]) -> WorkerView:
        c = self._copies.get(v.worker_id)
        if c is None or c[0] is not v:
            c = self._copies[v.worker_id] = (v, _plus(v, acc))
        return c[1]


# Every field of a view, in constructor order: a copy keeps each one (step time, context pool, any added later)
# as reported. attrgetter + a positional constructor call is ~5x cheaper than dataclasses.replace, which
# mattered at hundreds of workers with pending load (the simulator's 1,000-worker runs: half of all time).
_FIELDS = attrgetter(*(f.name for f in fields(WorkerView)))


def _plus(v: WorkerView, acc: list[int]) -> WorkerView:
    c = WorkerView(*_FIELDS(v))
    c.active_seqs += acc[0]
    c.queued_prefill_tokens += acc[1]
    c.free_blocks = max(0, c.free_blocks - acc[2])
    c.used_blocks += acc[2]
    return c
