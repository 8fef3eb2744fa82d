"""The routing policy's fast paths decide exactly what their plain versions decide.

``CostModel.score`` / ``choose``, ``PendingLoad.overlay`` and ``ContextPools.candidates`` were rewritten for
pools of hundreds of workers (the simulator's 1,000-worker runs): fused comprehensions, per-worker pending
records that keep their overlaid copy. The live router runs the same objects, so the rewrite must not move a
single decision. Each is compared here with the straightforward code it replaced (kept below as the reference),
on seeded random pools that hit every branch: unknown and zero rates, overflowing pools, cached prefixes, exact
ties, the imbalance guard, sampling, long pools, pending load that comes, goes and expires.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest

from splitserve.routing.base import Selection, WorkerView
from splitserve.routing.context import LONG, ContextPools
from splitserve.routing.cost import CostModel, Scores
from splitserve.routing.pending import PendingLoad

# ---------------------------------------------------------------------------------------------- references


class RefCostModel(CostModel):
    """score and choose as they were before the rewrite."""

    def score(
        self,
        workers: Sequence[WorkerView],
        prompt_tokens: int,
        block_size: int,
        cached_blocks: Mapping[str, int] | None = None,
        credit_blocks: Mapping[str, float] | None = None,
    ) -> Scores:
        cfg = self.config
        dls, ovp = cfg.decode_load_scale, cfg.overflow_penalty
        per_token = cfg.prefill_load_scale / block_size
        out = Scores(prompt_tokens, block_size)
        ids = out.ids = [w.worker_id for w in workers]
        out.load = [w.active_seqs + w.queued_requests for w in workers]
        work: list[float] = [w.queued_prefill_tokens + prompt_tokens for w in workers]
        n = len(ids)
        cbs = out.cached_blocks = [0] * n
        crs = out.credit_blocks = [0.0] * n
        if cached_blocks:
            crget = cached_blocks.get if credit_blocks is None else credit_blocks.get
            max_credit = prompt_tokens / block_size
            for i, wid in enumerate(ids):
                nb = cached_blocks.get(wid, 0)
                if nb:
                    credit = min(crget(wid, 0), max_credit)
                    cbs[i] = nb
                    crs[i] = credit
                    work[i] -= credit * block_size
        rates = [w.prefill_tokens_per_s for w in workers]
        if any(rates):
            speeds = sorted(r for r in rates if r)
            ref = speeds[len(speeds) // 2]
            work = [x * ref / r if r else x for x, r in zip(work, rates, strict=True)]
        costs = out.cost = [x * per_token + dls * w.used_blocks for x, w in zip(work, workers, strict=True)]
        full_need = -(-prompt_tokens // block_size)
        for i, w in enumerate(workers):
            if w.free_blocks < full_need and w.total_blocks:
                uncached = prompt_tokens - cbs[i] * block_size
                need = -(-uncached // block_size) if uncached > 0 else 0
                if need > w.free_blocks:
                    costs[i] += ovp * (need - w.free_blocks)
        return out

    def choose(self, scores: Scores, key: str, *, guard: bool = True) -> Selection:
        n = len(scores)
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
            tied = [i for i in pool if costs[i] <= cut]
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


@dataclass
class _RefEntry:
    at: float
    request_id: str
    worker_id: str
    tokens: int
    blocks: int
    live: bool = True


class RefPendingLoad:
    """The pending-load ledger without kept copies: a fresh overlaid view per decision."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._queue: deque[_RefEntry] = deque()
        self._by_request: dict[str, list[_RefEntry]] = {}
        self._per_worker: dict[str, list[int]] = {}

    def add(self, worker_id: str, request_id: str, tokens: int, blocks: int, now: float) -> None:
        e = _RefEntry(now, request_id, worker_id, tokens, blocks)
        self._queue.append(e)
        self._by_request.setdefault(request_id, []).append(e)
        acc = self._per_worker.setdefault(worker_id, [0, 0, 0])
        acc[0] += 1
        acc[1] += tokens
        acc[2] += blocks

    def _drop(self, e: _RefEntry) -> None:
        if e.live:
            e.live = False
            acc = self._per_worker[e.worker_id]
            acc[0] -= 1
            acc[1] -= e.tokens
            acc[2] -= e.blocks
            if acc[0] <= 0:
                del self._per_worker[e.worker_id]

    def release(self, request_id: str, worker_id: str | None = None) -> None:
        for e in self._by_request.get(request_id, []):
            if worker_id is None or e.worker_id == worker_id:
                self._drop(e)
        if all(not e.live for e in self._by_request.get(request_id, [])):
            self._by_request.pop(request_id, None)

    def forget_worker(self, worker_id: str) -> None:
        for e in self._queue:
            if e.worker_id == worker_id:
                self._drop(e)

    def overlay(self, views: Sequence[WorkerView], now: float) -> list[WorkerView]:
        while self._queue and self._queue[0].at <= now - self.ttl_s:
            e = self._queue.popleft()
            self._drop(e)
            if not any(x.live for x in self._by_request.get(e.request_id, [])):
                self._by_request.pop(e.request_id, None)
        out = []
        for v in views:
            acc = self._per_worker.get(v.worker_id)
            if acc is None:
                out.append(v)
                continue
            c = dataclasses.replace(v)
            c.active_seqs += acc[0]
            c.queued_prefill_tokens += acc[1]
            c.free_blocks = max(0, c.free_blocks - acc[2])
            c.used_blocks += acc[2]
            out.append(c)
        return out


def ref_candidates(prompt_tokens: int, decoders: Sequence[WorkerView], long_prompt_tokens: int) -> tuple[list, str]:
    long = [d for d in decoders if d.pool == LONG]
    general = [d for d in decoders if d.pool != LONG]
    if long and prompt_tokens >= long_prompt_tokens:
        return long, LONG
    if general:
        return general, "general"
    return long, "long_only"


# ---------------------------------------------------------------------------------------------- pools


def _rate(rng: random.Random, mode: str) -> float | None:
    if mode == "same":
        return 794.5
    if mode == "none":
        return None
    if mode == "near":  # costs a hair apart: tied within tie_epsilon, not equal
        return 794.5 * (1 + rng.choice([-1, 0, 1, 2]) * 1e-12)
    if mode == "inf":  # inf / inf: NaN costs, which have no order (the fast paths step aside)
        return rng.choice([794.5, float("inf")])
    return rng.choice([None, 0.0, 400.0, 794.5, 1234.5678, 3000.1])


def _pool(rng: random.Random, n: int, *, rate_mode: str, tight: bool, ties: bool) -> list[WorkerView]:
    views = []
    for i in range(n):
        small = ties and rng.random() < 0.7  # many identical workers: exact ties
        views.append(WorkerView(
            f"w{rng.randrange(10_000)}-{i}", active_seqs=0 if small else rng.randrange(60),
            queued_requests=0 if small else rng.randrange(3), queued_prefill_tokens=0 if small else rng.randrange(5000),
            free_blocks=rng.choice([0, 3, 40, 100_000]) if tight else 100_000,
            total_blocks=rng.choice([0, 100_000]) if tight else 100_000,
            used_blocks=0 if small else rng.randrange(4000), prefill_tokens_per_s=_rate(rng, rate_mode),
            pool=rng.choice(["general", "general", "long"]),
        ))
    return views


def _sel(model: CostModel, scores: Scores, key: str, guard: bool) -> tuple:
    try:
        s = model.choose(scores, key, guard=guard)
    except (ZeroDivisionError, IndexError, ValueError) as exc:  # NaN costs: both versions fail, alike
        return (type(exc).__name__,)
    return (s.chosen.worker_id, s.reason, s.view_index, repr([c.to_dict() for c in s.candidates]),
            repr([(c.cost, c.credit_tokens) for c in s.candidates]))


@pytest.mark.parametrize("n", [1, 2, 7, 64, 257, 300, 750])
def test_cost_model_scores_and_choices_equal_the_reference(n: int) -> None:
    rng = random.Random(n)
    for case in range(40 if n < 300 else 12):
        cfg = {"temperature": rng.choice([0.0, 0.0, 0.5]), "tie_break": rng.choice(["rotate", "random"]),
               "seed": case, "balance_abs_threshold": rng.choice([2, 32, 10_000]),
               "max_recorded": rng.choice([8, 8, 8, 0, 1, 3, 2000])}
        fast, ref = CostModel(**cfg), RefCostModel(**cfg)
        views = _pool(rng, n, rate_mode=rng.choice(["same", "same", "none", "mixed", "inf", "near"]),
                      tight=rng.random() < 0.5, ties=rng.random() < 0.5)
        for _ in range(6):
            prompt = rng.choice([1, 15, 16, 17, 500, 4000, 70_000])
            holders = rng.sample(views, k=min(len(views), rng.choice([0, 1, 3, n])))
            cached = {v.worker_id: rng.randrange(0, 300) for v in holders} or None
            credit = ({w: b * rng.choice([0.5, 1.0]) for w, b in cached.items()}
                      if cached and rng.random() < 0.5 else None)
            a = fast.score(views, prompt, 16, cached, credit)
            b = ref.score(views, prompt, 16, cached, credit)
            for f in Scores.__slots__:
                assert repr(getattr(a, f)) == repr(getattr(b, f)), f  # repr: NaN equals NaN
            for key in ("decode", "prefill"):
                guard = rng.random() < 0.8
                assert _sel(fast, a, key, guard) == _sel(ref, b, key, guard)


@pytest.mark.parametrize("tie_break", ["rotate", "random"])
def test_a_big_pool_tied_within_epsilon_chooses_as_the_reference(tie_break: str) -> None:
    """More workers within tie_epsilon of the best than a decision records, their costs a hair apart."""
    rng = random.Random(9)
    views = [WorkerView(f"w{i:03d}", free_blocks=100_000, total_blocks=100_000, used_blocks=rng.choice([0, 0, 0, 5]),
                        prefill_tokens_per_s=794.5 * (1 + rng.choice([-1, 0, 1, 2, 3]) * 1e-12)) for i in range(600)]
    rng.shuffle(views)
    for limit in (1, 3, 8, 40):
        fast, ref = CostModel(tie_break=tie_break, max_recorded=limit), RefCostModel(tie_break=tie_break,
                                                                                   max_recorded=limit)
        for prompt in (1, 300, 5000, 300, 300):
            a, b = fast.score(views, prompt, 16), ref.score(views, prompt, 16)
            assert a.cost == b.cost and len(set(a.cost)) > 1
            assert _sel(fast, a, "decode", True) == _sel(ref, b, "decode", True)


def test_pending_overlay_equals_a_fresh_overlay_each_time() -> None:
    rng = random.Random(7)
    ids = [f"w{i}" for i in range(40)]

    def view(wid: str) -> WorkerView:
        return WorkerView(wid, active_seqs=rng.randrange(9), queued_prefill_tokens=rng.randrange(900),
                          free_blocks=rng.randrange(50), total_blocks=60, used_blocks=rng.randrange(60),
                          step_ms=rng.choice([None, 31.5]), pool=rng.choice(["general", "long"]))

    views = [view(w) for w in ids]
    fast, ref = PendingLoad(ttl_s=1.0), RefPendingLoad(ttl_s=1.0)
    now, live = 0.0, []
    for step in range(3000):
        now += rng.random() * 0.05
        op = rng.random()
        if op < 0.3:
            rid, w = f"r{step}", rng.choice(ids)
            tokens, blocks = rng.randrange(2000), rng.randrange(8)
            for p in (fast, ref):
                p.add(w, rid, tokens, blocks, now)
            live.append((rid, w))
        elif op < 0.45 and live:
            rid, w = rng.choice(live)
            who = rng.choice([w, None, rng.choice(ids)])
            fast.release(rid, who)
            ref.release(rid, who)
        elif op < 0.5:
            w = rng.choice(ids)
            fast.forget_worker(w)
            ref.forget_worker(w)
        elif op < 0.7:
            i = rng.randrange(len(views))
            views[i] = view(ids[i])  # a new heartbeat
        else:
            a, b = fast.overlay(views, now), ref.overlay(views, now)
            assert [dataclasses.astuple(v) for v in a] == [dataclasses.astuple(v) for v in b]
            assert [x is v for x, v in zip(a, views, strict=True)] == [x is v for x, v in zip(b, views, strict=True)]
            assert all(fast.pending_for(w) == tuple(ref._per_worker.get(w, (0, 0, 0))) for w in ids)
            assert views == [dataclasses.replace(v) for v in views]  # the given views are never modified


def test_context_candidates_equal_the_reference() -> None:
    rng = random.Random(3)
    for _ in range(300):
        decoders = [WorkerView(f"d{i}", pool=rng.choice(["general", "long"] if rng.random() < 0.5 else ["general"]))
                    for i in range(rng.randrange(0, 30))]
        prompt = rng.choice([10, 2047, 2048, 9000])
        got, pool = ContextPools(2048).candidates(prompt, decoders)
        want, want_pool = ref_candidates(prompt, decoders, 2048)
        assert pool == want_pool and [d.worker_id for d in got] == [d.worker_id for d in want]
        assert got is not decoders  # a list of its own, as before
