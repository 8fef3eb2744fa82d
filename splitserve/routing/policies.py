"""One routing policy per served model, behind the one-policy interface the router drives.

A router serving several models may route each with its own strategy and disaggregation threshold (a big model
with long prompts disaggregates early; a small one decodes in place): :class:`PolicySet` holds one
:class:`~splitserve.routing.router.Router` per model that has its own settings, and the default policy for the
rest. They share what is the cluster's, not a model's: the prefix index (blocks are keyed by a salt scoped to
the model, so one index serves every model without a hit across them) and the pending-load ledger (a worker
serves one model, so its pending requests are the same whichever policy sent them). What a strategy learns
(round-robin position, prefixaware's tree, session pins) stays per policy, and so does the latency predictor each
Router owns (``Router.predictor``): a policy decides only among its model's workers, so each learns its own
model's step times and prefill rates, and its pooled prior is not blurred by another model's speed.

Pure and synchronous (no NATS, no clock): the live router and the simulator build it with the same
:func:`splitserve.routing.live.build_policies`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from splitserve.cache.events import KvEventBatch
from splitserve.cache.index import PrefixIndex
from splitserve.routing.base import Decision, RoutingRequest, WorkerView
from splitserve.routing.predictor import LatencyPredictor, SloEstimate
from splitserve.routing.router import Router

__all__ = ["PolicySet"]


class PolicySet:
    """The default policy and one per model that has its own settings (``per_model``); every one must share the
    default's index and pending ledger (:func:`~splitserve.routing.live.build_policies` builds them so)."""

    def __init__(self, default: Router, per_model: Mapping[str, Router] | None = None) -> None:
        self.default = default
        self.per_model = dict(per_model or {})
        for name, r in self.per_model.items():
            if r.index is not default.index or r.pending is not default.pending:
                raise ValueError(f"the policy of model {name!r} must share the default's index and pending ledger")
            if r.block_size != default.block_size:
                raise ValueError(f"the policy of model {name!r} has another block size")

    def of(self, model: str | None) -> Router:
        """The policy that routes ``model``'s requests."""
        return self.per_model.get(model, self.default) if model is not None else self.default

    def all(self) -> list[Router]:
        return [self.default, *self.per_model.values()]

    # The one-policy interface, for what is shared -------------------------------------------------------
    @property
    def index(self) -> PrefixIndex | None:
        return self.default.index

    @property
    def block_size(self) -> int:
        return self.default.block_size

    @property
    def strategy_name(self) -> str:
        return self.default.strategy_name

    def decide(self, request: RoutingRequest, workers: Sequence[WorkerView], now: float,
               model: str | None = None) -> Decision:
        return self.of(model).decide(request, workers, now)

    def slo_estimate(self, request: RoutingRequest, workers: Sequence[WorkerView], now: float,
                     model: str | None = None) -> SloEstimate:
        """``model``'s policy's :meth:`Router.slo_estimate` (admission: nothing is routed)."""
        return self.of(model).slo_estimate(request, workers, now)

    @property
    def predictor(self) -> LatencyPredictor:
        """The default policy's latency predictor (each model's own: :meth:`predictor_of`)."""
        return self.default.predictor

    def predictor_of(self, model: str | None = None) -> LatencyPredictor:
        """The latency predictor of ``model``'s policy."""
        return self.of(model).predictor

    def observe_outcome(self, worker_id: str, predicted_ttft_ms: float, actual_ttft_ms: float,
                        model: str | None = None) -> None:
        """A finished request's measured TTFT against its prediction, to ``model``'s policy's predictor."""
        self.of(model).predictor.observe_outcome(worker_id, predicted_ttft_ms, actual_ttft_ms)

    def pending_entries(self, decision: Decision) -> list[tuple[str, int, int]]:
        return self.default.pending_entries(decision)

    def on_remote_routed(self, request_id: str, entries: Sequence[tuple[str, int, int]], now: float) -> None:
        self.default.on_remote_routed(request_id, entries, now)  # the shared ledger

    def release(self, request_id: str, worker_id: str | None = None) -> None:
        self.default.release(request_id, worker_id)  # the shared ledger

    def apply_events(self, batch: KvEventBatch) -> bool:
        return self.default.apply_events(batch)  # the shared index

    def remove_worker(self, worker_id: str, *, forget_cache: bool = True) -> None:
        for r in self.all():  # each strategy forgets it; the shared index and ledger forget it once or more
            r.remove_worker(worker_id, forget_cache=forget_cache)

    def describe(self) -> dict[str, Any]:
        out = self.default.describe()
        if self.per_model:
            out["models"] = {name: r.describe() for name, r in sorted(self.per_model.items())}
        return out
