"""``slo``: the cheapest candidate that meets the request's latency targets, by the router's latency predictor.

This module owns :class:`SloStrategy`. It is ``kvaware`` (same index, same overlap, same shared cost: it *is* a
:class:`~splitserve.routing.kvaware.KvAwareStrategy`) with one step in front of the choice: every candidate's TTFT
and ITL are predicted by the :class:`~splitserve.routing.predictor.LatencyPredictor` the Router owns, and only the
candidates that meet the request's ``ttft_slo_ms`` / ``itl_slo_ms`` compete on cost:

* some meet them: the cost model chooses among those (its imbalance guard and tie-breaking included), so a
  loaded-but-cached worker still wins while it can serve in time, and loses to a colder one once its queue would
  make the request late;
* none does: the one that misses by the least (smallest worst ratio of predicted to target; with a TTFT target
  only, the fastest), reason ``slo_unmet`` - admission (:mod:`.admission`) is where a request nobody can serve
  in time is turned away, not here;
* the request has no targets: exactly kvaware's choice (no prediction is made).

The Router chooses the decoder first, then the route, then the prefiller (see :mod:`.router`). For the decoder
the TTFT assumes the decoder prefills the uncached part itself (its own queue and rate, and its wait for KV when its
pool is full: :meth:`~splitserve.routing.predictor.LatencyPredictor.kv_wait_ms`); for the prefiller it is
that prefiller's queue and rate plus one step on the decoder just chosen. A prefiller cannot change ITL, so only
the TTFT target filters the prefill pool.

The predictions land in ``Selection.detail["slo"]`` (the decision record): the targets, how many candidates met
them, and per recorded candidate its predicted TTFT / ITL and whether it met them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from splitserve.cache.index import PrefixIndex
from splitserve.routing.base import DECODE, RoutingRequest, Selection, WorkerView
from splitserve.routing.cost import CostModel, Scores
from splitserve.routing.kvaware import KvAwareStrategy
from splitserve.routing.predictor import LatencyPredictor

__all__ = ["SloStrategy"]


def _subset(scores: Scores, keep: Sequence[int]) -> Scores:
    out = Scores(scores.prompt_tokens, scores.block_size)
    out.ids = [scores.ids[i] for i in keep]
    out.cached_blocks = [scores.cached_blocks[i] for i in keep]
    out.credit_blocks = [scores.credit_blocks[i] for i in keep]
    out.cost = [scores.cost[i] for i in keep]
    out.load = [scores.load[i] for i in keep]
    return out


class SloStrategy(KvAwareStrategy):
    name = "slo"
    uses_cache = True

    def __init__(self, index: PrefixIndex | None = None, cost: CostModel | None = None,
                 predictor: LatencyPredictor | None = None) -> None:
        super().__init__(index, cost)
        # The Router replaces this with the one it owns (shared with slo_estimate and the prefill pool).
        self.predictor = predictor if predictor is not None else LatencyPredictor()
        # (request, predicted ITL) of the last decoder chosen: the prefill pool's TTFT includes its first step.
        self._decoder_itl: tuple[RoutingRequest, float] | None = None

    def select(
        self, request: RoutingRequest, workers: Sequence[WorkerView], role: str, now: float, block_size: int
    ) -> Selection:
        scored = self.scores(request, workers, block_size)
        ttft_slo, itl_slo = request.ttft_slo_ms, request.itl_slo_ms
        if ttft_slo is None and itl_slo is None:
            return self.cost.choose(scored, role)
        pred = self.predictor
        prompt = scored.prompt_tokens
        cbs = scored.cached_blocks
        n = len(scored)
        decode = role == DECODE
        if decode:
            itl = [pred.itl_ms(w) for w in workers]
            unc = [prompt - min(cb * block_size, prompt) for cb in cbs]
            ttft = [pred.ttft_ms(w, unc[i], itl_ms=itl[i]) + pred.kv_wait_ms(w, -(-unc[i] // block_size))
                    for i, w in enumerate(workers)]
        else:
            memo = self._decoder_itl
            step = memo[1] if memo is not None and memo[0] is request else pred.step_ms("", 1)
            itl = [step] * n
            ttft = [pred.ttft_ms(w, prompt - min(cbs[i] * block_size, prompt), itl_ms=step)
                    for i, w in enumerate(workers)]
        t_lim = math.inf if ttft_slo is None else ttft_slo
        i_lim = math.inf if (itl_slo is None or not decode) else itl_slo
        ok = [t <= t_lim and s <= i_lim for t, s in zip(ttft, itl, strict=True)]
        meeting = [i for i in range(n) if ok[i]]
        if len(meeting) == n:
            sel = self.cost.choose(scored, role)
            chosen = sel.view_index if sel.view_index is not None else scored.index_of(sel.worker_id)
            reason = sel.reason
        elif meeting:
            sub = self.cost.choose(_subset(scored, meeting), role)
            chosen = meeting[sub.view_index if sub.view_index is not None else 0]
            reason = f"slo_{sub.reason}"
        else:
            # Nobody is in time: the smallest miss, relative to each target (costs break ties).
            def miss(i: int) -> tuple[float, float]:
                return (max(ttft[i] / t_lim if ttft_slo else 0.0, itl[i] / i_lim if i_lim < math.inf else 0.0),
                        scored.cost[i])
            chosen = min(range(n), key=miss)
            reason = "slo_unmet"
        recorded = self.cost.recorded(scored, chosen)
        sel = Selection(recorded[0], reason, recorded, view_index=chosen)
        if decode:
            self._decoder_itl = (request, itl[chosen])
        pos = {wid: i for i, wid in enumerate(scored.ids)} if n > 16 else None
        preds = []
        for c in recorded:
            i = pos[c.worker_id] if pos is not None else scored.ids.index(c.worker_id)
            preds.append({"worker": c.worker_id, "predicted_ttft_ms": round(ttft[i], 2),
                          "predicted_itl_ms": round(itl[i], 2), "met": ok[i]})
        sel.detail["slo"] = {
            "ttft_slo_ms": ttft_slo, "itl_slo_ms": itl_slo if decode else None, "meeting": len(meeting),
            "of": n, "predicted_ttft_ms": round(ttft[chosen], 2), "predicted_itl_ms": round(itl[chosen], 2),
            "met": ok[chosen], "candidates": preds,
        }
        return sel

    def remove_worker(self, worker_id: str) -> None:
        # The Router forgets the worker in the predictor it owns (this one, once bound).
        return None

    def config(self) -> dict[str, Any]:
        return {**self.cost.describe(), "predictor": self.predictor.describe()["config"]}
