"""``kvaware``: route by the KV residency the workers themselves report (a :class:`PrefixIndex`).

The index is the same object type the cache-index service runs; the live router holds an in-process
replica fed by the same ``ss.kv.*`` event batches, so a decision costs one local lookup, no round trip.
Overlap is credited per tier: blocks in the engine's own pool (``gpu``) count fully, blocks beyond that
run that are only in the host L1 (``cpu``) count ``cpu_tier_weight`` (they must be copied back first).
A worker the index has never heard of simply has no overlap: with no events at all this degrades to the
load-aware cost, never to an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitserve.cache.events import GPU
from splitserve.cache.index import PrefixIndex
from splitserve.routing.base import RoutingRequest, Selection, Strategy, WorkerView
from splitserve.routing.cost import CostModel, Scores

__all__ = ["KvAwareStrategy"]


class KvAwareStrategy(Strategy):
    name = "kvaware"
    uses_cache = True

    def __init__(self, index: PrefixIndex | None = None, cost: CostModel | None = None) -> None:
        self.index = index if index is not None else PrefixIndex()
        self.cost = cost or CostModel()
        # The decode and prefill pools of one decision share one lookup (same hashes, same index version).
        self._memo: tuple[object, int, dict[str, int], dict[str, float] | None] | None = None

    def overlaps(self, hashes: Sequence[int]) -> tuple[dict[str, int], dict[str, float] | None]:
        """(leading blocks held in any tier, tier-weighted credit in blocks or None when it is the same)."""
        weight = self.cost.config.cpu_tier_weight
        any_tier = self.index.lookup(hashes)
        if not any_tier or weight >= 1.0 or len(self.index.media()) <= 1:
            return any_tier, None
        fast = self.index.lookup(hashes, GPU)
        credit = {w: fast.get(w, 0) + weight * (n - fast.get(w, 0)) for w, n in any_tier.items()}
        return any_tier, credit

    def select(
        self, request: RoutingRequest, workers: Sequence[WorkerView], role: str, now: float, block_size: int
    ) -> Selection:
        return self.cost.choose(self.scores(request, workers, block_size), role)

    def scores(self, request: RoutingRequest, workers: Sequence[WorkerView], block_size: int) -> Scores:
        """The shared cost of every worker for this request, with its overlap from the index (what ``select``
        chooses from; the ``slo`` strategy filters it by predicted latency first)."""
        hashes = request.hashes(block_size)
        memo = self._memo
        if memo is not None and memo[0] is hashes and memo[1] == self.index.version:
            cached, credit = memo[2], memo[3]
        else:
            cached, credit = self.overlaps(hashes)
            self._memo = (hashes, self.index.version, cached, credit)
        return self.cost.score(workers, request.num_prompt_tokens(), block_size, cached, credit)

    def remove_worker(self, worker_id: str) -> None:
        # The index belongs to whoever feeds it events (the router's replica): dropping the worker there
        # is the feeder's call, since a worker that only missed heartbeats may come back with its cache.
        return None

    def config(self) -> dict[str, Any]:
        return self.cost.describe()
