"""SLO admission at intake: a request whose tenant has latency targets (``slo:`` in the tenants file) is refused
at once (``slo_unattainable``, HTTP 429 with Retry-After) when no live worker can give it its first token in
time once what is queued ahead of it has gone, instead of being queued and served late. On with
``--slo-admission`` (``splitserve up --slo-admission``); without it, or for a tenant without targets, nothing
here runs.

The rule is the simulator's (:class:`~splitserve.routing.admission.SloAdmission`): the routing policy's
:meth:`~splitserve.routing.policies.PolicySet.slo_estimate` (the best candidate's predicted TTFT and ITL from the
workers' own heartbeats: nothing is routed) plus the wait in the tenant's queue lane: its requests queued (or
being stored) beyond the slots it could start in at once, at the pace the queue drains for it, and never less than
the time until the first running request ends (:mod:`splitserve.routing.admission`, the simulator's too).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

from splitserve.proto import GenerateRequest
from splitserve.routing import NoWorkers
from splitserve.routing.admission import Refuse, SloAdmission, queue_wait_for, weighted_share
from splitserve.services.router.core import RouterCore
from splitserve.services.router.inputs import routing_inputs


class SloGate(RouterCore):
    """Intake's SLO check (:meth:`_slo_refusal`)."""

    def __init__(self, *args: Any, slo_admission: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.slo_admission = SloAdmission() if slo_admission else None
        # Requests admitted here whose intake has not stored them in the queue yet, per tenant: a burst's intakes
        # run side by side, and each must count the ones before it that the queue does not show yet.
        self._entering: dict[str, int] = {}

    @contextlib.contextmanager
    def _slo_entering(self, tenant: str) -> Iterator[None]:
        """Count an admitted request of ``tenant`` as queued ahead of its next ones while its intake runs."""
        if self.slo_admission is None:
            yield
            return
        self._entering[tenant] = self._entering.get(tenant, 0) + 1
        try:
            yield
        finally:
            if (n := self._entering[tenant] - 1) > 0:
                self._entering[tenant] = n
            else:
                del self._entering[tenant]

    def _slo_refusal(self, req: GenerateRequest, ids: list[int], queued: int) -> tuple[Refuse, dict[str, Any]] | None:
        """Why ``req`` (``ids``: its prompt; ``queued``: its tenant's requests waiting before it) cannot meet its
        tenant's targets now, with the prediction behind it (for the refusal's log line), or None (admit: no
        targets, admission off, or it can)."""
        if self.slo_admission is None:
            return None
        slo = self.tenants.slo(req.tenant)
        if slo is None:
            return None
        now = self.clock()
        rreq, views, model, _ = routing_inputs(self, req, ids, self._cache_salt(req), now)
        wait = 0.0
        try:
            est = self.policy.slo_estimate(rreq, views, now, model)
        except NoWorkers:
            return None  # dispatch fails it the same way, and says so
        # Ahead of it: the tenant's requests queued or being stored (as long as this one, the tenant's own).
        before = queued + self._entering.get(req.tenant, 0)
        if before > 0:
            wait = queue_wait_for(
                before, self.book.free_slots(now, model), views, self.policy.predictor_of(model),
                req.sampling.max_tokens, weighted_share(req.tenant, self.wq.pending_by_tenant(), self.tenants.weight),
                self._rate(req.tenant, "dispatched").per_s(now) * self._router_share()[1],
                ((f.decoder, f.request.sampling.max_tokens - len(f.tokens)) for f in self.inflight.values()
                 if f.request is not None), est.decoder)
        verdict = self.slo_admission.check(est, slo.ttft_p99_ms, slo.itl_p99_ms, wait)
        if not isinstance(verdict, Refuse):
            return None
        return verdict, {"slo_reason": verdict.reason, "predicted_ttft_ms": _ms(verdict.predicted_ttft_ms),
                         "queue_wait_ms": _ms(wait), "predicted_itl_ms": _ms(verdict.predicted_itl_ms),
                         "decoder": est.decoder}


def _ms(x: float) -> float | None:
    return round(x, 1) if math.isfinite(x) else None


def refusal_message(tenant: str, ttft_ms: float | None, itl_ms: float | None, verdict: Refuse) -> str:
    """What the caller reads: which target cannot be met, the prediction, and when to retry."""
    if verdict.reason == "itl_unmeetable":
        what = f"inter-token latency target {itl_ms:g} ms (predicted {_fmt(verdict.predicted_itl_ms)})"
    else:
        what = f"time-to-first-token target {ttft_ms:g} ms (predicted {_fmt(verdict.predicted_ttft_ms)})"
    return (f"tenant {tenant!r}: no worker can meet the {what} with the requests queued now; "
            f"retry in {verdict.retry_after_s} s")


def _fmt(x: float) -> str:
    return f"{x:,.0f} ms" if math.isfinite(x) else "unbounded"
