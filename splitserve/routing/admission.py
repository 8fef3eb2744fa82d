"""SLO admission: take a request only if some worker can still serve it within its latency targets.

This module owns the pure rule the live router's intake (HTTP 429 with ``Retry-After``) and the simulator's
intake both apply, and the two small estimates it needs:

* :class:`SloAdmission` - ``check(estimate, ttft_slo_ms, itl_slo_ms, queue_wait_ms)`` -> :class:`Admit` or
  :class:`Refuse`. The predicted TTFT is the time the request would wait in the router's queue plus the best
  candidate's predicted TTFT (:meth:`splitserve.routing.router.Router.slo_estimate`); it is refused when that
  exceeds ``ttft_slo_ms * slack`` or the predicted ITL exceeds ``itl_slo_ms * itl_slack`` (the boundary itself
  is admitted). Answering early is the point: a request refused now can go elsewhere or come back, one served
  late has used the capacity that would have kept another in time. Requests without targets are admitted.
* ``Refuse.retry_after_s``: whole seconds until the wait ahead would have drained enough for it to fit (the
  overshoot, since queued work drains in real time), at least ``min_retry_after_s`` and at most
  ``max_retry_after_s``; an ITL refusal alone (a batch too big, which no wait can be computed for) says
  ``itl_retry_after_s``.
* :func:`queue_wait_ms` - the wait ahead in the router's queue from what is queued ahead (requests, prompt
  tokens) and the pace it drains at; :func:`drain_rps` - that pace (the decoders' for requests like this one, at
  the tenant's :func:`weighted_share`, or its measured dispatch rate if faster), counted from the slots a request
  can start in at once (:func:`free_now`) and never shorter than the time until a running request ends
  (:func:`first_end_ms`).

Pure and synchronous; times are passed in (``now``: seconds, any monotonic clock).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from splitserve.routing.base import DECODE, WorkerView
from splitserve.routing.live import overfill
from splitserve.routing.predictor import LatencyPredictor, SloEstimate

__all__ = ["Admit", "Refuse", "SloAdmission", "Verdict", "drain_rps", "first_end_ms", "free_now", "queue_wait_for",
           "queue_wait_ms", "weighted_share"]

TTFT_UNMEETABLE: Final = "ttft_unmeetable"
ITL_UNMEETABLE: Final = "itl_unmeetable"


@dataclass(frozen=True, slots=True)
class Admit:
    """Take the request. ``predicted_ttft_ms``: queue wait + estimate (None: the request had no targets)."""

    reason: str = "meets_slo"  # or "no_targets"
    predicted_ttft_ms: float | None = None
    predicted_itl_ms: float | None = None

    @property
    def admitted(self) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class Refuse:
    """Turn the request away now (HTTP 429), asking the caller to come back in ``retry_after_s``."""

    retry_after_s: int
    reason: str  # "ttft_unmeetable" | "itl_unmeetable"
    predicted_ttft_ms: float = math.inf
    predicted_itl_ms: float = math.inf

    @property
    def admitted(self) -> bool:
        return False


Verdict = Admit | Refuse


@dataclass(frozen=True, slots=True)
class SloAdmission:
    slack: float = 1.0  # refuse when predicted TTFT > target * slack (1.0: no slack)
    itl_slack: float = 1.0
    min_retry_after_s: int = 1
    max_retry_after_s: int = 60
    itl_retry_after_s: int = 5

    def __post_init__(self) -> None:
        if self.slack <= 0 or self.itl_slack <= 0:
            raise ValueError("slack and itl_slack must be positive")
        if not 1 <= self.min_retry_after_s <= self.max_retry_after_s:
            raise ValueError("need 1 <= min_retry_after_s <= max_retry_after_s")

    def check(self, estimate: SloEstimate, ttft_slo_ms: float | None, itl_slo_ms: float | None,
              queue_wait_ms: float = 0.0) -> Verdict:
        if ttft_slo_ms is None and itl_slo_ms is None:
            return Admit("no_targets")
        wait = queue_wait_ms if queue_wait_ms > 0 else 0.0
        ttft = wait + estimate.ttft_ms
        itl = estimate.itl_ms
        over_ms = ttft - ttft_slo_ms * self.slack if ttft_slo_ms is not None else -math.inf
        if over_ms > 0 or math.isnan(ttft):
            return Refuse(self._retry(over_ms), TTFT_UNMEETABLE, ttft, itl)
        if itl_slo_ms is not None and (itl > itl_slo_ms * self.itl_slack or math.isnan(itl)):
            return Refuse(self._clamp(self.itl_retry_after_s), ITL_UNMEETABLE, ttft, itl)
        return Admit("meets_slo", ttft, itl)

    def _retry(self, over_ms: float) -> int:
        if not math.isfinite(over_ms):
            return self.max_retry_after_s
        return self._clamp(math.ceil(over_ms / 1000.0))

    def _clamp(self, s: int) -> int:
        return min(max(int(s), self.min_retry_after_s), self.max_retry_after_s)


def queue_wait_ms(ahead_requests: int, dispatch_rps: float | None, *, ahead_prompt_tokens: int = 0,
                  prefill_tokens_per_s: float | None = None, share: float = 1.0) -> float:
    """Expected wait in the router's queue, ms: the requests ahead at this tenant's ``share`` (0-1] of the recent
    dispatch rate, or the prompt tokens ahead at the cluster's prefill rate, whichever is longer (either one can
    be what holds dispatch back). Nothing ahead: 0; something ahead and no rate measured: infinite."""
    if ahead_requests <= 0 and ahead_prompt_tokens <= 0:
        return 0.0
    wait_s = 0.0
    if ahead_requests > 0:
        rate = (dispatch_rps or 0.0) * min(max(share, 0.0), 1.0)
        if rate <= 0 or not math.isfinite(rate):
            return math.inf
        wait_s = ahead_requests / rate
    if ahead_prompt_tokens > 0 and prefill_tokens_per_s:
        wait_s = max(wait_s, ahead_prompt_tokens / prefill_tokens_per_s)
    return 1000.0 * wait_s


def weighted_share(tenant: str, waiting: Mapping[str, int], weight: Callable[[str], float]) -> float:
    """``tenant``'s share (0-1] of dispatch among the tenants with requests ``waiting``, by weight (the fair
    scheduler's split when all of them are backlogged)."""
    mine = weight(tenant)
    others = sum(weight(t) for t, n in waiting.items() if n > 0 and t != tenant)
    return mine / (mine + others) if mine > 0 else 0.0


def drain_rps(decoders: Sequence[WorkerView], predictor: LatencyPredictor, max_tokens: int, share: float,
              measured_rps: float = 0.0) -> float:
    """How fast a tenant's queue drains, requests/s: the decoders' pace for requests like this one (each finishes
    a full batch of them, ``max_seqs``, in ``max_tokens`` steps at its predicted full-batch step time) at the
    tenant's ``share``, or the rate its requests were dispatched lately (``measured_rps``) if that is faster (a rate
    measured while the tenant sent little says what it asked for, not what the cluster can do). 0: nothing known.
    The live router's SLO admission and the simulator's read the same."""
    capacity = 0.0
    for d in decoders:
        if d.role != DECODE or not d.live or not d.max_seqs:
            continue
        decode_s = max_tokens * predictor.step_ms(d.worker_id, d.max_seqs) / 1000.0
        if decode_s > 0:
            capacity += d.max_seqs / decode_s
    return max(capacity * min(max(share, 0.0), 1.0), measured_rps)


def free_now(decoders: Sequence[WorkerView], ledger_free: int) -> int:
    """Slots a request can start in at once: what the dispatch ledger offers (``ledger_free``: it counts what was
    sent but not reported yet) within the decoders' batch sizes (the ledger overfills a decoder a little so it
    never idles; a request sent into that margin waits on the decoder for a running one to end). Decoders of
    unknown batch size count as the ledger says."""
    known = [d for d in decoders if d.role == DECODE and d.live and d.max_seqs]
    if not known:
        return max(0, ledger_free)
    batch = sum(max(0, (d.max_seqs or 0) - d.active_seqs - d.waiting) for d in known)
    margin = sum(overfill(d.max_seqs or 0) for d in known)
    return max(0, min(ledger_free - margin, batch))


def first_end_ms(running: Iterable[tuple[str, int]], decoders: Sequence[WorkerView],
                 predictor: LatencyPredictor, full: bool = False) -> float:
    """When the first of the ``running`` requests ((decoder, tokens left) pairs) should end, ms from now: the
    fewest tokens left times its decoder's predicted inter-token latency. A request that must wait for a slot
    waits at least this long, however fast the queue drains on average (a burst that filled every slot at once
    frees none until its requests end). ``full``: at the step of a full batch (``max_seqs``, where known), the
    batch a request waiting for a slot finds; else at the batch the decoder's view shows (a burst just
    dispatched is not in it yet). 0: nothing known to be running."""
    views = {d.worker_id: d for d in decoders}
    best = math.inf
    for wid, left in running:
        d = views.get(wid)
        if d is not None and left > 0:
            more = max(0, (d.max_seqs or 0) - d.active_seqs - d.queued_requests) if full else 0
            best = min(best, left * predictor.itl_ms(d, extra_seqs=more))
    return best if math.isfinite(best) else 0.0


def queue_wait_for(before: int, ledger_free: int, decoders: Sequence[WorkerView], predictor: LatencyPredictor,
                   max_tokens: int, share: float, measured_rps: float, running: Iterable[tuple[str, int]],
                   decoder: str) -> float:
    """The wait, ms, of a request with ``before`` of its tenant's requests queued (or being stored) ahead of it:
    none while it can start at once (a slot of :func:`free_now` of ``ledger_free`` is left for it after those
    ahead took theirs); else what is ahead of it at the pace the queue drains (:func:`drain_rps`; nothing known:
    not guessed), and never less than the time until the first of the ``running`` ((decoder, tokens left) pairs)
    ends, the requests before it counted as long as this one (``max_tokens`` on ``decoder``, the one it would go
    to). The live router's SLO admission and the simulator's."""
    # This request needs a slot too: with as many ahead as slots free, it waits for a running one to end (it used
    # to count as starting at once, and the request one past a burst's free slots was admitted a whole batch late)
    ahead = before + 1 - free_now(decoders, ledger_free)
    if ahead <= 0:
        return 0.0
    rate = drain_rps(decoders, predictor, max_tokens, share, measured_rps)
    wait = queue_wait_ms(ahead, rate) if rate > 0 else 0.0
    # it waits for a slot, so the decoders are full: their steps are a full batch's, not what the views show yet
    return max(wait, first_end_ms([*running, (decoder, max_tokens)], decoders, predictor, full=True))
