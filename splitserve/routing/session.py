"""``session``: sticky routing by a session key on a consistent-hash ring; load-aware without a key.

Each worker owns ``vnodes`` points on a 64-bit ring (xxh3 of ``"{worker_id}#{i}"``); a key goes to the
owner of the first point at or after xxh3(key). Because points depend only on the worker's own id, adding a
worker moves only the keys that now land on its points, and removing one moves only the keys it owned -
about 1/n of them - and every router replica computes the same ring from the same live set, so affinity
survives several routers. Requests without a key fall back to the shared load-aware cost (no affinity).
Stickiness is strict by default: the imbalance guard does not override it unless ``balance_override``.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import xxhash

from splitserve.routing.base import RoutingRequest, Selection, Strategy, WorkerView
from splitserve.routing.cost import CostModel

__all__ = ["HashRing", "SessionStrategy"]

_h64 = xxhash.xxh3_64_intdigest


class HashRing:
    """An immutable consistent-hash ring over a set of worker ids."""

    __slots__ = ("_points", "_owners", "vnodes")

    def __init__(self, worker_ids: Iterable[str], vnodes: int = 160) -> None:
        if vnodes <= 0:
            raise ValueError("vnodes must be positive")
        self.vnodes = vnodes
        # Ties between points (astronomically rare) are broken by worker id so every replica agrees.
        pts = sorted((_h64(f"{w}#{i}".encode()), w) for w in set(worker_ids) for i in range(vnodes))
        self._points = [p for p, _ in pts]
        self._owners = [w for _, w in pts]

    def __len__(self) -> int:
        return len(set(self._owners))

    def owner(self, key: str | bytes) -> str:
        if not self._points:
            raise LookupError("empty ring")
        h = _h64(key.encode() if isinstance(key, str) else key)
        i = bisect.bisect_left(self._points, h)
        return self._owners[i if i < len(self._points) else 0]


class SessionStrategy(Strategy):
    name = "session"

    def __init__(
        self,
        vnodes: int = 160,
        cost: CostModel | None = None,
        balance_override: bool = False,
        ring_cache: int = 8,
    ) -> None:
        self.vnodes = vnodes
        self.cost = cost or CostModel()
        self.balance_override = balance_override
        self._rings: OrderedDict[frozenset[str], HashRing] = OrderedDict()
        self._ring_cache = max(1, ring_cache)

    def ring(self, worker_ids: Iterable[str]) -> HashRing:
        key = frozenset(worker_ids)
        ring = self._rings.get(key)
        if ring is None:
            ring = HashRing(key, self.vnodes)
            self._rings[key] = ring
            while len(self._rings) > self._ring_cache:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(key)
        return ring

    @staticmethod
    def ring_key(request: RoutingRequest) -> str:
        # Scoped by tenant: two tenants' "session-1" are different sessions and should spread independently.
        return f"{request.tenant}\x00{request.session_key}"

    def select(
        self, request: RoutingRequest, workers: Sequence[WorkerView], role: str, now: float, block_size: int
    ) -> Selection:
        prompt = request.num_prompt_tokens()
        scored = self.cost.score(workers, prompt, block_size)
        if request.session_key is None:
            sel = self.cost.choose(scored, role)
            sel.reason = f"no_session_key:{sel.reason}"
            return sel
        if self.balance_override and self.cost.imbalanced(scored):
            sel = self.cost.choose(scored, role)
            sel.detail["sticky_owner"] = self.ring(w.worker_id for w in workers).owner(self.ring_key(request))
            return sel
        owner = self.ring(w.worker_id for w in workers).owner(self.ring_key(request))
        i = scored.index_of(owner)
        recorded = self.cost.recorded(scored, i)
        return Selection(recorded[0], "session_sticky", recorded, view_index=i)

    def config(self) -> dict[str, Any]:
        return {"vnodes": self.vnodes, "balance_override": self.balance_override, **self.cost.describe()}
