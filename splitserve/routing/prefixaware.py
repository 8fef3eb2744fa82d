"""``prefixaware``: route by what THIS router sent where, for deployments where workers report no KV events.

The router keeps its own bounded record of the prompts it routed: a :class:`PrefixIndex` (same chained
block hashes, same leading-run lookup as ``kvaware``) plus a per-worker LRU of block hashes capped at the
worker's KV pool size (``total_blocks`` from its heartbeat once seen, else ``capacity_blocks``), which
approximates the worker's own LRU eviction. A prompt goes through the shared cost (:mod:`.cost`) with the
recorded overlap as its cache credit, so a repeated prefix lands on the worker that computed it unless
that worker is overloaded (imbalance guard) or its queue outweighs the saving.

It is approximate in the ways SGLang's and production-stack's approximate trees are: it cannot see
evictions caused by other routers' traffic, engine restarts or preemption. ``kvaware`` is exact when the
workers publish events; use this when they don't.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from splitserve.cache.index import PrefixIndex
from splitserve.routing.base import Decision, RoutingRequest, Selection, Strategy, WorkerView
from splitserve.routing.cost import CostModel

__all__ = ["PrefixAwareStrategy"]


class PrefixAwareStrategy(Strategy):
    name = "prefixaware"
    uses_cache = True

    def __init__(
        self,
        capacity_blocks: int = 65_536,
        cost: CostModel | None = None,
        use_reported_capacity: bool = True,
    ) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity_blocks = capacity_blocks
        self.use_reported_capacity = use_reported_capacity
        self.cost = cost or CostModel()
        self.tree = PrefixIndex()
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}
        self.evicted_blocks = 0
        self._memo: tuple[object, int, dict[str, int]] | None = None

    def select(
        self, request: RoutingRequest, workers: Sequence[WorkerView], role: str, now: float, block_size: int
    ) -> Selection:
        if self.use_reported_capacity:
            for w in workers:
                if w.total_blocks:
                    self._capacity[w.worker_id] = w.total_blocks
        hashes = request.hashes(block_size)
        memo = self._memo
        if memo is not None and memo[0] is hashes and memo[1] == self.tree.version:
            overlap = memo[2]  # the other pool of the same decision: same lookup
        else:
            overlap = self.tree.lookup(hashes)
            self._memo = (hashes, self.tree.version, overlap)
        scored = self.cost.score(workers, request.num_prompt_tokens(), block_size, overlap)
        return self.cost.choose(scored, role)

    def on_routed(self, request: RoutingRequest, decision: Decision, now: float, block_size: int) -> None:
        hashes = request.hashes(block_size)
        if not hashes:
            return
        # Both ends end up holding the prompt's KV: the prefiller computed it, the decoder received it.
        self.record(decision.decoder, hashes)
        if decision.prefiller is not None:
            self.record(decision.prefiller, hashes)

    def record(self, worker_id: str, hashes: Sequence[int]) -> None:
        lru = self._lru.get(worker_id)
        if lru is None:
            lru = self._lru[worker_id] = OrderedDict()
        new = []
        # Touch tail-first so the first block ends most recent: like an engine, evict tails before heads.
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                new.append(h)
        if new:
            self.tree.store(worker_id, new)
        cap = self._capacity.get(worker_id, self.capacity_blocks)
        excess = len(lru) - cap
        if excess > 0:
            evicted = [lru.popitem(last=False)[0] for _ in range(excess)]
            self.tree.remove(worker_id, evicted)
            self.evicted_blocks += excess

    def remove_worker(self, worker_id: str) -> None:
        self._lru.pop(worker_id, None)
        self._capacity.pop(worker_id, None)
        self.tree.remove_worker(worker_id)

    def tracked_blocks(self, worker_id: str) -> int:
        lru = self._lru.get(worker_id)
        return len(lru) if lru is not None else 0

    def config(self) -> dict[str, Any]:
        return {
            "capacity_blocks": self.capacity_blocks,
            "use_reported_capacity": self.use_reported_capacity,
            **self.cost.describe(),
        }
