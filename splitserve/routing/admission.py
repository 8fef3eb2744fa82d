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
  tokens) and the recent dispatch rate (requests per second, the tenant's ``share`` of it when the fair
  scheduler splits dispatch among several queued tenants); :class:`RateMeter` measures that rate.

Pure and synchronous; times are passed in (``now``: seconds, any monotonic clock).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from splitserve.routing.predictor import SloEstimate

__all__ = ["Admit", "RateMeter", "Refuse", "SloAdmission", "Verdict", "queue_wait_ms"]

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


class RateMeter:
    """Events per second over the last ``tau_s`` or so (exponentially decayed count, corrected for a meter younger
    than ``tau_s`` so the first seconds are not under-read). Deterministic: time is passed in."""

    __slots__ = ("tau_s", "_count", "_at", "_start")

    def __init__(self, tau_s: float = 10.0) -> None:
        if tau_s <= 0:
            raise ValueError("tau_s must be positive")
        self.tau_s = tau_s
        self._count = 0.0
        self._at: float | None = None
        self._start: float | None = None

    def tick(self, now: float, n: int = 1) -> None:
        if self._at is None:
            self._start = self._at = now
        elif now > self._at:
            self._count *= math.exp(-(now - self._at) / self.tau_s)
            self._at = now
        self._count += n

    def rate(self, now: float) -> float:
        if self._at is None or self._start is None:
            return 0.0
        age = max(now - self._start, 0.0)
        count = self._count * math.exp(-max(now - self._at, 0.0) / self.tau_s)
        window = self.tau_s * (1.0 - math.exp(-age / self.tau_s)) if age > 0 else 0.0
        # a meter that has seen one instant only: no rate yet (one event over zero time is not a rate)
        return count / window if window > 1e-9 else 0.0
