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


class _Worker:
    """One worker's pending load, and the overlaid ``copy`` of ``src``, the last view it was given (``src`` None:
    none yet, or the load changed since; ``copy`` is only read while ``src`` is the view at hand)."""

    __slots__ = ("seqs", "tokens", "blocks", "src", "copy")
    copy: WorkerView

    def __init__(self, tokens: int, blocks: int) -> None:
        self.seqs = 1
        self.tokens = tokens
        self.blocks = blocks
        self.src: WorkerView | None = None

    def over(self, v: WorkerView) -> WorkerView:
        self.src, self.copy = v, _plus(v, (self.seqs, self.tokens, self.blocks))
        return self.copy


class PendingLoad:
    def __init__(self, ttl_s: float = 1.0) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.ttl_s = ttl_s
        self._queue: deque[_Entry] = deque()
        self._by_request: dict[str, list[_Entry]] = {}
        self._per_worker: dict[str, _Worker] = {}  # worker -> sequences, prefill tokens, blocks; its copy

    def __len__(self) -> int:
        return len(self._by_request)

    def add(self, worker_id: str, request_id: str, prefill_tokens: int, blocks: int, now: float) -> None:
        e = _Entry(now, request_id, worker_id, prefill_tokens, blocks)
        self._queue.append(e)
        self._by_request.setdefault(request_id, []).append(e)
        acc = self._per_worker.get(worker_id)
        if acc is None:
            self._per_worker[worker_id] = _Worker(prefill_tokens, blocks)
        else:
            acc.seqs += 1
            acc.tokens += prefill_tokens
            acc.blocks += blocks
            acc.src = None

    def _drop(self, e: _Entry) -> None:
        if not e.live:
            return
        e.live = False
        acc = self._per_worker[e.worker_id]
        acc.seqs -= 1
        acc.tokens -= e.tokens
        acc.blocks -= e.blocks
        acc.src = None
        if acc.seqs <= 0:
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
        return (acc.seqs, acc.tokens, acc.blocks) if acc else (0, 0, 0)

    def overlay(self, views: Sequence[WorkerView], now: float) -> Sequence[WorkerView]:
        """``views`` with pending load added (copies only for workers that have some).

        Views are treated as immutable: a worker's copy is kept until its pending load changes or it is given
        a different view object, so a caller that reuses view objects between heartbeats (the simulator, with
        hundreds of workers pending at once) does not pay for a fresh copy of each one per decision."""
        self.expire(now)
        per = self._per_worker
        if not per:
            return views
        get = per.get
        # the kept copy inline (no call per pending worker: hundreds at once in the simulator's big runs)
        return [v if (acc := get(v.worker_id)) is None else acc.copy if acc.src is v else acc.over(v)
                for v in views]


# Every field of a view, in constructor order: a copy keeps each one (step time, context pool, any added later)
# as reported. attrgetter + a positional constructor call is ~5x cheaper than dataclasses.replace, which
# mattered at hundreds of workers with pending load (the simulator's 1,000-worker runs: half of all time).
_FIELDS = attrgetter(*(f.name for f in fields(WorkerView)))


def _plus(v: WorkerView, acc: tuple[int, int, int]) -> WorkerView:
    c = WorkerView(*_FIELDS(v))
    c.active_seqs += acc[0]
    c.queued_prefill_tokens += acc[1]
    c.free_blocks = max(0, c.free_blocks - acc[2])
    c.used_blocks += acc[2]
    return c
