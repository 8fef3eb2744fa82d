"""Load-aware cost shared by the cache-aware strategies (kvaware, prefixaware) and the session fallback.

Per candidate worker ``w`` and request of ``P`` prompt tokens, with ``credit_w`` the tokens of the prompt
``w`` already caches (GPU-tier blocks at full weight, CPU-tier blocks at ``cpu_tier_weight``)::

    uncached_w = max(P - credit_w, 0)
    prefill_w  = (queued_prefill_tokens_w + uncached_w) / block_size / speed_w        # blocks of prefill work
    decode_w   = used_blocks_w                                                          # KV of active streams
    overflow_w = max(ceil(uncached_w / block_size) - free_blocks_w, 0)   if the pool size is known
    cost_w     = prefill_load_scale * prefill_w + decode_load_scale * decode_w + overflow_penalty * overflow_w

Lowest cost wins. This is Dynamo's KV-router cost (prefill blocks after the overlap credit, plus decode
blocks) with these changes, each aimed at a way the plain formula misroutes:

* the overlap credit only ever discounts *this* request's tokens: it never cancels work already queued on
  the worker (``queued + new - overlap`` clamped at 0 lets a big hit hide a long queue);
* CPU-tier hits are credited partially: they must be copied back into the engine's pool before use;
* ``speed_w`` (the worker's ``prefill_tokens_per_s`` over the pool's median; 1 when unknown) turns queued
  tokens into time, so a slow worker with a short queue is not preferred to a fast one with a longer queue;
* a request whose new blocks do not fit in the worker's free KV blocks pays for the overflow: the engine
  would have to evict cached prefixes or preempt running streams to take it;
* SGLang's imbalance guard runs first: when the pool is lopsided (``max - min > balance_abs_threshold``
  and ``max > balance_rel_threshold * min`` running+queued requests) cache affinity is ignored and the
  least-loaded worker wins, because no prefix hit is worth feeding a hot spot;
* ties (common when nothing is cached and loads are equal) are broken fairly - rotating through the tied
  workers, or with a seeded RNG - instead of always picking the first listed worker;
* optional softmax sampling over normalised costs (``temperature > 0``) with an explicit seeded RNG, to
  spread load across near-equal candidates without giving up determinism in tests and replays.

The router adds one more guard outside this module: load it has just dispatched counts on top of the
heartbeat views until the workers report it (:mod:`.pending`), so a burst between two heartbeats does not
herd onto the one worker that looked cheapest. Each candidate's cost, cache credit and load land in the
Decision record, so a decision can be explained after the fact.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from splitserve.routing.base import Candidate, Selection, WorkerView

__all__ = ["CostConfig", "CostModel", "Scores"]


@dataclass(frozen=True, slots=True)
class CostConfig:
    prefill_load_scale: float = 1.0
    decode_load_scale: float = 1.0
    overflow_penalty: float = 4.0
    cpu_tier_weight: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.1
    temperature: float = 0.0  # > 0: softmax sampling over normalised costs
    tie_break: str = "rotate"  # "rotate" | "random"
    seed: int = 0
    tie_epsilon: float = 1e-9
    max_recorded: int = 8  # candidates kept in a Decision (the best ones)

    def __post_init__(self) -> None:
        if self.tie_break not in ("rotate", "random"):
            raise ValueError("tie_break must be 'rotate' or 'random'")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")


class Scores:
    """One pool's scores for one request, as parallel lists (Candidate objects are built only for the
    few a Decision records: building 64 of them per decision would cost more than the scoring)."""

    __slots__ = ("ids", "cached_blocks", "credit_blocks", "cost", "load", "prompt_tokens", "block_size")

    def __init__(self, prompt_tokens: int, block_size: int) -> None:
        self.ids: list[str] = []
        self.cached_blocks: list[int] = []
        self.credit_blocks: list[float] = []
        self.cost: list[float] = []
        self.load: list[int] = []
        self.prompt_tokens = prompt_tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.ids)

    def index_of(self, worker_id: str) -> int:
        return self.ids.index(worker_id)

    def candidate(self, i: int) -> Candidate:
        p, bs = self.prompt_tokens, self.block_size
        nb = self.cached_blocks[i]
        if not nb:
            return Candidate(self.ids[i], 0, 0, 0.0, p, self.cost[i], self.load[i])
        cached = min(nb * bs, p)
        credit = min(self.credit_blocks[i] * bs, float(p))
        return Candidate(self.ids[i], nb, cached, credit, p - cached, self.cost[i], self.load[i])

    def candidates(self) -> list[Candidate]:
        return [self.candidate(i) for i in range(len(self.ids))]


class CostModel:
    """Scores a pool and picks from it. Holds the tie-break rotation and the seeded RNG (per instance)."""

    def __init__(self, config: CostConfig | None = None, **overrides: Any) -> None:
        cfg = config or CostConfig()
        if overrides:
            cfg = CostConfig(**{**asdict(cfg), **overrides})
        self.config = cfg
        self._rng = random.Random(cfg.seed)
        self._turn: dict[str, int] = {}

    # ------------------------------------------------------------------------------------------ scoring
    def score(
        self,
        workers: Sequence[WorkerView],
        prompt_tokens: int,
        block_size: int,
        cached_blocks: Mapping[str, int] | None = None,
        credit_blocks: Mapping[str, float] | None = None,
    ) -> Scores:
        """Score ``workers`` (in order). ``cached_blocks``: leading prompt blocks each holds (any tier);
        ``credit_blocks``: the tier-weighted version (defaults to ``cached_blocks``)."""
        cfg = self.config
        dls, ovp = cfg.decode_load_scale, cfg.overflow_penalty
        per_token = cfg.prefill_load_scale / block_size
        out = Scores(prompt_tokens, block_size)
        # Column-wise comprehensions: about 3x cheaper than one loop with appends at 64 workers, and the
        # cache terms touch only the few workers that hold part of the prompt. (Comprehensions also beat
        # map(attrgetter) and operator functions here, ~2x on CPython 3.11's specialised slot reads.)
        ids = out.ids = [w.worker_id for w in workers]
        out.load = [w.active_seqs + w.queued_requests for w in workers]
        work: list[float] = [w.queued_prefill_tokens + prompt_tokens for w in workers]
        n = len(ids)
        cbs = out.cached_blocks = [0] * n
        crs = out.credit_blocks = [0.0] * n
        if cached_blocks:
            crget = cached_blocks.get if credit_blocks is None else credit_blocks.get
            max_credit = prompt_tokens / block_size
            if len(cached_blocks) * 8 < n:  # few holders (the usual case): find them, don't probe everyone
                hits = []
                for wid in cached_blocks:
                    try:
                        hits.append((ids.index(wid), wid))
                    except ValueError:
                        continue  # a worker of the other pool, or one not live
            else:
                hits = [(i, wid) for i, wid in enumerate(ids) if wid in cached_blocks]
            for i, wid in hits:
                nb = cached_blocks[wid]
                if nb:
                    credit = min(crget(wid, 0), max_credit)
                    cbs[i] = nb
                    crs[i] = credit
                    work[i] -= credit * block_size
        rates = [w.prefill_tokens_per_s for w in workers]
        if any(rates):
            speeds = sorted([r for r in rates if r])
            ref = speeds[len(speeds) // 2]
            # the work in the median worker's time, then the cost: one pass (the same operations, in order)
            costs = [(x * ref / r if r else x) * per_token + dls * w.used_blocks
                     for x, r, w in zip(work, rates, workers, strict=True)]
        else:
            costs = [x * per_token + dls * w.used_blocks for x, w in zip(work, workers, strict=True)]
        out.cost = costs
        full_need = -(-prompt_tokens // block_size)
        # the few workers a request of this size could overflow (a comprehension finds them; most pools have none)
        short = [i for i, w in enumerate(workers) if w.free_blocks < full_need and w.total_blocks]
        for i in short:
            free = workers[i].free_blocks
            uncached = prompt_tokens - cbs[i] * block_size
            need = -(-uncached // block_size) if uncached > 0 else 0
            if need > free:
                costs[i] += ovp * (need - free)
        return out

    # ------------------------------------------------------------------------------------------ choosing
    def imbalanced(self, scores: Scores) -> bool:
        loads = scores.load
        if len(loads) < 2:
            return False
        lo, hi = min(loads), max(loads)
        return hi - lo > self.config.balance_abs_threshold and hi > self.config.balance_rel_threshold * lo

    def choose(self, scores: Scores, key: str, *, guard: bool = True) -> Selection:
        """Pick from a non-empty pool's scores. ``key`` names the tie rotation (e.g. the pool's role)."""
        n = len(scores)
        if not n:
            raise ValueError("no candidates")
        cfg = self.config
        costs = scores.cost
        reason = "lowest_cost"
        pool: Sequence[int] = range(n)
        if guard and self.imbalanced(scores):
            least = min(scores.load)
            pool = [i for i in pool if scores.load[i] == least]
            reason = "imbalance_guard"
        if cfg.temperature > 0 and len(pool) > 1 and reason != "imbalance_guard":
            chosen = self._softmax(scores, pool)
            reason = "softmax"
        else:
            best = min(costs[i] for i in pool) if reason == "imbalance_guard" else min(costs)
            cut = best + cfg.tie_epsilon * max(1.0, abs(best))
            if reason == "imbalance_guard":
                tied = [i for i in pool if costs[i] <= cut]
            else:  # the whole pool, in order
                tied = [i for i, c in enumerate(costs) if c <= cut]
            if len(tied) == 1:
                chosen = tied[0]
            else:
                tied.sort(key=scores.ids.__getitem__)
                if cfg.tie_break == "random":
                    chosen = self._rng.choice(tied)
                else:
                    turn = self._turn.get(key, 0)
                    self._turn[key] = turn + 1
                    chosen = tied[turn % len(tied)]
                if reason == "lowest_cost":
                    reason = "tie_break"
        recorded = self.recorded(scores, chosen)
        return Selection(recorded[0], reason, recorded, view_index=chosen)

    def _softmax(self, scores: Scores, pool: Sequence[int]) -> int:
        costs = [scores.cost[i] for i in pool]
        lo, hi = min(costs), max(costs)
        span = (hi - lo) or 1.0
        t = self.config.temperature
        weights = [math.exp(-(c - lo) / span / t) for c in costs]
        return self._rng.choices(list(pool), weights=weights, k=1)[0]

    def recorded(self, scores: Scores, chosen: int) -> list[Candidate]:
        """Candidates for the Decision record: the chosen one first, then the cheapest others."""
        limit = self.config.max_recorded
        n = len(scores)
        key = scores.cost.__getitem__
        others = sorted(range(n), key=key)[:limit] if n <= 256 else heapq.nsmallest(limit, range(n), key=key)
        return [scores.candidate(chosen)] + [scores.candidate(i) for i in others if i != chosen][: limit - 1]

    def describe(self) -> dict[str, Any]:
        return asdict(self.config)
