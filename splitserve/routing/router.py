"""The Router policy: one request + the live workers -> a :class:`Decision` (decoder, route, prefiller).

This module owns the order of a decision, which every caller (the live router service, the benchmarks, the
simulator) shares:

1. split the live workers into the decode and prefill pools (separate pools, never mixed); a long prompt
   decodes on the ``long`` context pool when there is one (:mod:`.context`);
2. choose the decoder with the strategy (its cache affinity + the shared load-aware cost);
3. decide the route with :class:`DisaggPolicy` on the *uncached* tokens of that decoder;
4. if disaggregated, choose the prefiller from the prefill pool with the same strategy and cost (prefillers
   keep prefix caches too);
5. record the decision (``on_routed``): prefixaware learns what it routed where, and the pending-load book
   adds the request to the chosen workers' load until their heartbeats show it (see :mod:`.pending`).

It raises :class:`NoWorkers` ("decode") when no decoder is live; a missing prefill pool degrades to the
direct path (or raises ``NoWorkers("prefill")`` with ``require_prefiller=True``).

The Router owns one :class:`~splitserve.routing.predictor.LatencyPredictor` (``router.predictor``): every decision
and every :meth:`Router.slo_estimate` first lets it learn from the views given (as reported, before the
pending-load overlay), the ``slo`` strategy predicts with it in both pools, and :meth:`Router.slo_estimate`
answers SLO admission with it without routing anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from splitserve.cache.events import KvEventBatch
from splitserve.cache.hashing import DEFAULT_BLOCK_SIZE
from splitserve.cache.index import PrefixIndex
from splitserve.routing.base import (
    DECODE,
    DIRECT,
    DISAGGREGATED,
    PREFILL,
    Decision,
    NoWorkers,
    RoutingRequest,
    Selection,
    Strategy,
    WorkerView,
)
from splitserve.routing.context import GENERAL, ContextPools
from splitserve.routing.disagg import DisaggPolicy, RouteChoice
from splitserve.routing.kvaware import KvAwareStrategy
from splitserve.routing.pending import PendingLoad
from splitserve.routing.predictor import LatencyPredictor, SloEstimate
from splitserve.routing.registry import make_strategy
from splitserve.routing.slo import SloStrategy

__all__ = ["Router"]


class Router:
    """Routing policy object. Not thread-safe; one per router process (or per simulated router).

    ``strategy``: a registered name or a :class:`Strategy`. ``strategy_cfg`` goes to
    :func:`make_strategy` (cost settings such as ``temperature`` or ``balance_abs_threshold``, strategy
    settings such as ``vnodes``). ``index``: the KV residency replica; ``kvaware`` routes on it, and with
    any other strategy it still tells the disaggregation rule how much of the prompt the chosen decoder
    already holds. A ``kvaware`` router without an ``index`` creates one (``router.index``): feed it with
    :meth:`apply_events`. ``disagg_threshold`` is shorthand for ``DisaggPolicy(min_uncached_tokens=...)``.
    ``pending_ttl_s``: how long a dispatched request counts on top of its workers' reported load (None:
    trust the views as given); call :meth:`release` once a heartbeat lists the request. ``context``: which
    decoders a request may use by prompt length (only matters when some decoders are a ``long`` pool).
    ``predictor``: the latency predictor this router owns (default: the ``slo`` strategy's, else a new one);
    every ``slo`` strategy of the router is bound to it.
    """

    def __init__(
        self,
        strategy: str | Strategy = "kvaware",
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        disagg: DisaggPolicy | None = None,
        disagg_threshold: int | None = None,
        index: PrefixIndex | None = None,
        prefill_strategy: str | Strategy | None = None,
        observe: bool = True,
        require_prefiller: bool = False,
        pending_ttl_s: float | None = 1.0,
        context: ContextPools | None = None,
        predictor: LatencyPredictor | None = None,
        **strategy_cfg: Any,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if disagg is not None and disagg_threshold is not None:
            raise ValueError("give disagg or disagg_threshold, not both")
        self.block_size = block_size
        self.disagg = disagg or DisaggPolicy(
            min_uncached_tokens=512 if disagg_threshold is None else disagg_threshold
        )
        if isinstance(strategy, str):
            if strategy in ("kvaware", "slo"):
                index = index if index is not None else PrefixIndex()
                strategy_cfg.setdefault("index", index)
            strategy = make_strategy(strategy, **strategy_cfg)
        elif strategy_cfg:
            raise ValueError("strategy settings only apply when the strategy is given by name")
        if isinstance(strategy, KvAwareStrategy) and index is None:
            index = strategy.index
        self.strategy: Strategy = strategy
        if prefill_strategy is None:
            self.prefill_strategy = strategy
        elif isinstance(prefill_strategy, str):
            kw: dict[str, Any] = (
                {"index": index} if prefill_strategy in ("kvaware", "slo") and index is not None else {}
            )
            self.prefill_strategy = make_strategy(prefill_strategy, **kw)
        else:
            self.prefill_strategy = prefill_strategy
        self.index = index
        if predictor is None:
            predictor = strategy.predictor if isinstance(strategy, SloStrategy) else LatencyPredictor()
        self.predictor = predictor
        for s in (self.strategy, self.prefill_strategy):
            if isinstance(s, SloStrategy):
                s.predictor = predictor
        self.observe = observe
        self.require_prefiller = require_prefiller
        self.pending = PendingLoad(pending_ttl_s) if pending_ttl_s else None
        self.context = context or ContextPools()

    @property
    def strategy_name(self) -> str:
        return self.strategy.name

    # ------------------------------------------------------------------------------------------ decide
    def _pools(self, request: RoutingRequest, workers: Sequence[WorkerView], now: float
               ) -> tuple[list[WorkerView], list[WorkerView], str]:
        """(the decoders the request may use, the prefillers, their context pool), live, with the pending load on
        top; the predictor learns from the views as reported first (the pending overlay is not a measurement).
        Raises NoWorkers when no decoder is live."""
        self.predictor.observe(workers, now)
        if self.pending is not None:
            workers = self.pending.overlay(workers, now)
        decoders = [w for w in workers if w.role == DECODE and w.live]
        prefillers = [w for w in workers if w.role == PREFILL and w.live]
        if not decoders:
            raise NoWorkers(DECODE, f"{len(prefillers)} prefill workers live")
        decoders, context_pool = self.context.candidates(request.num_prompt_tokens(), decoders)
        return decoders, prefillers, context_pool

    def decide(self, request: RoutingRequest, workers: Sequence[WorkerView], now: float) -> Decision:
        decoders, prefillers, context_pool = self._pools(request, workers, now)
        bs = self.block_size
        prompt = request.num_prompt_tokens()

        dsel = self.strategy.select(request, decoders, DECODE, now, bs)
        chosen = dsel.chosen
        if not self.strategy.uses_cache and self.index is not None and prompt:
            # The strategy ignored the cache, but the route should still know what the decoder holds.
            held = self.index.lookup(request.hashes(bs)).get(chosen.worker_id, 0)
            chosen.cached_blocks = held
            chosen.cached_tokens = min(held * bs, prompt)
            chosen.uncached_tokens = prompt - chosen.cached_tokens
        uncached = prompt - chosen.cached_tokens
        dview = decoders[dsel.view_index] if dsel.view_index is not None else None
        if dview is None or dview.worker_id != chosen.worker_id:
            dview = next(w for w in decoders if w.worker_id == chosen.worker_id)
        rc = self.disagg.decide(prompt, uncached, dview, bool(prefillers))
        if request.force_route is not None and request.force_route != rc.route:
            if request.force_route == DISAGGREGATED and not prefillers:
                raise NoWorkers(PREFILL, "the request asked for the disaggregated route")
            rc = RouteChoice(request.force_route, "forced", {**rc.values, "rule_said": rc.route})
        if rc.reason == "no_prefillers" and self.require_prefiller:
            raise NoWorkers(PREFILL, f"the request needs a prefiller ({rc.values.get('wanted')})")

        psel: Selection | None = None
        if rc.route == DISAGGREGATED:
            psel = self.prefill_strategy.select(request, prefillers, PREFILL, now, bs)

        decision = Decision(
            request_id=request.request_id,
            strategy=self.strategy.name,
            route=rc.route,
            decoder=chosen.worker_id,
            prefiller=psel.worker_id if psel else None,
            reason=rc.reason,
            decoder_reason=dsel.reason,
            prefiller_reason=psel.reason if psel else None,
            prompt_tokens=prompt,
            cached_tokens=chosen.cached_tokens,
            uncached_tokens=uncached,
            candidates=dsel.candidates,
            prefill_candidates=psel.candidates if psel else [],
            thresholds=rc.values,
            now=now,
            detail={**dsel.detail, **({"prefill": psel.detail} if psel and psel.detail else {}),
                    **({"context_pool": context_pool} if context_pool != GENERAL else {})},
        )
        if self.observe:
            self.on_routed(request, decision, now)
        return decision

    # ------------------------------------------------------------------------------------------ estimate
    def slo_estimate(self, request: RoutingRequest, workers: Sequence[WorkerView], now: float,
                     model: str | None = None) -> SloEstimate:
        """The best candidate's predicted TTFT and ITL for ``request``, routing nothing: no strategy state moves
        (no tie-break turn, no ``on_routed``) and the pending ledger only expires what ``decide`` would. For SLO
        admission, before the request is queued.

        Each live decoder (of the context pool the request may use) is weighed with the route the disaggregation
        rule would give it: direct, the decoder prefills its uncached tokens after its own queue; disaggregated,
        the prefiller that would be first done (its queue, its uncached tokens) plus the decoder's first step.
        The best is the one meeting the request's targets that is first to the first token (none meets them: the
        one missing by the least; no targets: the first to the first token). ``model`` is accepted for the
        :class:`~splitserve.routing.policies.PolicySet` interface (a Router is already one model's policy).
        Raises :class:`NoWorkers` when no decoder is live."""
        pred = self.predictor
        decoders, prefillers, _ = self._pools(request, workers, now)
        bs = self.block_size
        prompt = request.num_prompt_tokens()
        held = self.index.lookup(request.hashes(bs)) if self.index is not None and prompt else {}

        def cached(wid: str) -> int:
            return min(held.get(wid, 0) * bs, prompt) if held else 0

        # The prefiller a disaggregated request would be first done on (uncorrected prefill + its correction).
        best_p: WorkerView | None = None
        best_p_ms = math.inf
        for p in prefillers:
            t = pred.prefill_ms(p, prompt - cached(p.worker_id)) * pred.correction(p.worker_id)
            if t < best_p_ms:
                best_p, best_p_ms = p, t
        t_lim = request.ttft_slo_ms
        i_lim = request.itl_slo_ms
        targets = t_lim is not None or i_lim is not None
        forced = request.force_route
        rule = self.disagg.decide
        # The rule reads only these of a decoder: decoders alike (the usual case, nothing cached) share one call.
        routes: dict[tuple[int, float | None, float | None, bool], str] = {}
        best: tuple[tuple[float, float, float], float, float, str, str | None, str, int, bool] | None = None
        meeting = 0
        for d in decoders:
            c = cached(d.worker_id)
            unc = prompt - c
            sig = (unc, d.prefill_tokens_per_s, d.step_ms, d.active_seqs > 0)
            route = routes.get(sig)
            if route is None:
                route = routes[sig] = rule(prompt, unc, d, best_p is not None).route
            if forced is not None and (forced == DIRECT or best_p is not None):
                route = forced
            itl = pred.itl_ms(d)
            kv_wait = pred.kv_wait_ms(d, -(-unc // bs))
            if route == DISAGGREGATED and best_p is not None:
                ttft = pred.ttft_ms(best_p, prompt - cached(best_p.worker_id), itl_ms=itl)
                pid: str | None = best_p.worker_id
            else:
                ttft = pred.ttft_ms(d, unc, itl_ms=itl)
                pid, route = None, DIRECT
            ttft += kv_wait
            ok = (t_lim is None or ttft <= t_lim) and (i_lim is None or itl <= i_lim)
            meeting += ok
            if ok or not targets:
                key = (0.0, ttft, itl)
            else:
                miss = max(ttft / t_lim if t_lim else 0.0, itl / i_lim if i_lim else 0.0)
                key = (1.0, miss, ttft)
            if best is None or key < best[0]:
                best = (key, ttft, itl, d.worker_id, pid, route, c, ok)
        assert best is not None
        _, ttft, itl, wid, pid, route, c, ok = best
        return SloEstimate(ttft, itl, wid, pid, route, c, ok if targets else None, len(decoders), meeting)

    def on_routed(self, request: RoutingRequest, decision: Decision, now: float) -> None:
        """Record a dispatched decision: strategy observations and the router's pending-load book."""
        self.strategy.on_routed(request, decision, now, self.block_size)
        if self.prefill_strategy is not self.strategy:
            self.prefill_strategy.on_routed(request, decision, now, self.block_size)
        if self.pending is not None:
            self.on_remote_routed(decision.request_id, self.pending_entries(decision), now)

    def pending_entries(self, decision: Decision) -> list[tuple[str, int, int]]:
        """What a dispatched decision adds to its workers' load until they report it: (worker, prefill tokens,
        KV blocks) for the decoder and, when disaggregated, the prefiller."""
        blocks = -(-decision.prompt_tokens // self.block_size)
        local = 0 if decision.prefiller is not None else decision.uncached_tokens
        out = [(decision.decoder, local, blocks)]
        if decision.prefiller is not None:
            out.append((decision.prefiller, decision.uncached_tokens, 0))
        return out

    def on_remote_routed(self, request_id: str, entries: Sequence[tuple[str, int, int]], now: float) -> None:
        """Another router replica dispatched this request (its ``pending_entries``): count it on those workers
        too until their heartbeats list it, so two routers do not pile one burst onto the same worker."""
        if self.pending is not None:
            for worker, tokens, blocks in entries:
                self.pending.add(worker, request_id, tokens, blocks, now)

    def release(self, request_id: str, worker_id: str | None = None) -> None:
        """``worker_id``'s heartbeat now includes this request (None: it finished): stop adding it on top."""
        if self.pending is not None:
            self.pending.release(request_id, worker_id)

    # ------------------------------------------------------------------------------------------ upkeep
    def apply_events(self, batch: KvEventBatch) -> bool:
        """Feed the router's residency replica. Returns True on a sequence gap (resync that worker)."""
        if self.index is None:
            self.index = PrefixIndex()
        return self.index.apply(batch)

    def remove_worker(self, worker_id: str, *, forget_cache: bool = True) -> None:
        if self.pending is not None:
            self.pending.forget_worker(worker_id)
        self.predictor.remove_worker(worker_id)
        self.strategy.remove_worker(worker_id)
        if self.prefill_strategy is not self.strategy:
            self.prefill_strategy.remove_worker(worker_id)
        if forget_cache and self.index is not None:
            self.index.remove_worker(worker_id)

    def describe(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy.name,
            "strategy_config": self.strategy.config(),
            "prefill_strategy": self.prefill_strategy.name,
            "block_size": self.block_size,
            "disagg": self.disagg.describe(),
            "long_prompt_tokens": self.context.long_prompt_tokens,
        }
