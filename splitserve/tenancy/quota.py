"""Per-tenant quota accounting: admission checks against the tenants file's limits.

``QuotaBook.check`` answers, before a request is accepted, whether it may be: the first limit it would exceed
(by name), a precise message, and when to retry (None when retrying cannot help: a prompt over the tenant's
maximum stays over it). Tokens per minute count prompt + completion over a sliding minute; at admission the
request reserves prompt + max_tokens, and when it finishes the reservation is replaced by what it really
used, so a tenant is never refused on tokens it did not spend for long.

Pure and synchronous; ``now`` is passed in, so tests drive time (monotonic seconds for one router's own
book; unix seconds for a book shared by several routers, whose clocks must agree).

Several routers share one tenant's usage through ``export`` / ``load``: a router loads the latest shared
snapshot (a JetStream KV value), decides and records admissions and finishes on it here, and writes the new
snapshot back with compare-and-set; a conflicting write by another router makes it reload and decide again.
Admission and finish are idempotent per request id, so a snapshot can be replayed safely. ``stale`` lists
reservations old enough to check against the request registry (a router that died between reserving and
queueing leaves one behind); ``finish(..., None)`` drops them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from splitserve.tenancy.config import TenantLimits, TenantsConfig

WINDOW_S = 60.0
MAX_FINISHES = 64  # recent finish times kept for the retry-after estimate


MAX_CLOCK_SKEW_S = 60.0  # how far ahead of this router's clock another router's time may be


def _finite(at: Any, now: float) -> float:
    """A snapshot's time as read: an infinite or NaN one, or one further in the future than routers' clocks can
    differ (no router writes it: a corrupt record), would keep its charge in the window for ever (or until then)
    and block the tenant, so it counts from now instead."""
    t = float(at)
    return t if math.isfinite(t) and t <= now + MAX_CLOCK_SKEW_S else now


@dataclass(frozen=True)
class Refusal:
    code: str  # "unknown_tenant" | "quota_exceeded" | "prompt_too_long" | "bad_request"
    limit: str | None  # which limit of the tenants file, e.g. "max_inflight"
    message: str
    retry_after_s: float | None = None  # None: retrying the same request will not help


@dataclass
class _Charge:
    at: float
    tokens: int
    in_window: bool = True
    request_id: str = ""  # set while the request is in flight


@dataclass
class _Usage:
    inflight: dict[str, _Charge] = field(default_factory=dict)  # request id -> its charge in the window
    window: deque[_Charge] = field(default_factory=deque)  # charges of the last minute, oldest first
    window_total: int = 0
    finish_times: deque[float] = field(default_factory=deque)  # recent finishes, to estimate retry-after


class QuotaBook:
    def __init__(self, config: TenantsConfig) -> None:
        self.config = config
        self._u: dict[str, _Usage] = {}

    def _usage(self, tenant: str) -> _Usage:
        u = self._u.get(tenant)
        if u is None:
            u = self._u[tenant] = _Usage()
        return u

    def _expire(self, u: _Usage, now: float) -> None:
        while u.window and u.window[0].at <= now - WINDOW_S:
            old = u.window.popleft()
            old.in_window = False
            u.window_total -= old.tokens
        while u.finish_times and u.finish_times[0] <= now - WINDOW_S:
            u.finish_times.popleft()

    def inflight(self, tenant: str) -> int:
        u = self._u.get(tenant)
        return len(u.inflight) if u else 0

    def is_inflight(self, tenant: str, request_id: str) -> bool:
        u = self._u.get(tenant)
        return u is not None and request_id in u.inflight

    def tokens_in_window(self, tenant: str, now: float) -> int:
        u = self._usage(tenant)
        self._expire(u, now)
        return u.window_total

    def check(self, tenant: str, prompt_tokens: int, max_tokens: int, queued: int, now: float,
              request_id: str | None = None) -> Refusal | None:
        """The first limit this request would break, or None. ``request_id`` already in flight: None (a re-sent
        request is the same request; it is not counted twice)."""
        refusal = self.check_static(tenant, prompt_tokens, max_tokens)
        if refusal is not None:
            return refusal
        lim = self.config.limits(tenant)
        assert lim is not None
        u = self._usage(tenant)
        if request_id is not None and request_id in u.inflight:
            return None
        return self._check_usage(tenant, lim, u, prompt_tokens, max_tokens, queued, now)

    def has_dynamic_limits(self, tenant: str) -> bool:
        """Whether admitting this tenant's requests depends on its usage (max_inflight, max_queued, tokens per
        minute): only those tenants need usage shared between routers."""
        lim = self.config.limits(tenant)
        return lim is not None and (lim.max_inflight is not None or lim.max_queued is not None
                                    or lim.tokens_per_minute is not None)

    def check_static(self, tenant: str, prompt_tokens: int, max_tokens: int) -> Refusal | None:
        """The limits that do not depend on usage: unknown tenant, prompt and max_tokens sizes."""
        lim = self.config.limits(tenant)
        if lim is None:
            return Refusal("unknown_tenant", None, f"tenant {tenant!r} is not in the tenants file")
        if lim.max_prompt_tokens is not None and prompt_tokens > lim.max_prompt_tokens:
            return Refusal("prompt_too_long", "max_prompt_tokens",
                           f"prompt has {prompt_tokens:,} tokens; tenant {tenant!r} may send at most "
                           f"{lim.max_prompt_tokens:,} (max_prompt_tokens)")
        if lim.max_tokens is not None and max_tokens > lim.max_tokens:
            return Refusal("bad_request", "max_tokens",
                           f"max_tokens {max_tokens:,} is over tenant {tenant!r}'s limit of {lim.max_tokens:,}")
        return None

    def _check_usage(self, tenant: str, lim: TenantLimits, u: _Usage, prompt_tokens: int, max_tokens: int,
                     queued: int, now: float) -> Refusal | None:
        self._expire(u, now)
        if lim.max_inflight is not None and len(u.inflight) >= lim.max_inflight:
            return Refusal("quota_exceeded", "max_inflight",
                           f"tenant {tenant!r} has {len(u.inflight)} requests in flight (queued or running), "
                           f"its limit (max_inflight); retry when one finishes",
                           retry_after_s=self._retry_inflight(u, now))
        if lim.max_queued is not None and queued >= lim.max_queued:
            return Refusal("quota_exceeded", "max_queued",
                           f"tenant {tenant!r} has {queued} requests waiting in its queue, its limit "
                           f"(max_queued); retry later", retry_after_s=self._retry_inflight(u, now))
        if lim.tokens_per_minute is not None:
            need = prompt_tokens + max_tokens
            if need > lim.tokens_per_minute:
                return Refusal("quota_exceeded", "tokens_per_minute",
                               f"the request may use {need:,} tokens (prompt {prompt_tokens:,} + max_tokens "
                               f"{max_tokens:,}), more than tenant {tenant!r}'s {lim.tokens_per_minute:,} "
                               "tokens per minute (tokens_per_minute); lower max_tokens or the prompt")
            if u.window_total + need > lim.tokens_per_minute:
                return Refusal("quota_exceeded", "tokens_per_minute",
                               f"tenant {tenant!r} used {u.window_total:,} of its {lim.tokens_per_minute:,} "
                               f"tokens per minute (tokens_per_minute); this request may use {need:,} more",
                               retry_after_s=self._retry_tpm(u, lim, need, now))
        return None

    @staticmethod
    def _retry_inflight(u: _Usage, now: float) -> float:
        # From the recent finish rate: about one finish interval; at least 0.1 s, at most a minute.
        if len(u.finish_times) >= 2:
            span = now - u.finish_times[0]
            return round(min(WINDOW_S, max(0.1, span / len(u.finish_times))), 3)
        return 1.0

    @staticmethod
    def _retry_tpm(u: _Usage, lim: TenantLimits, need: int, now: float) -> float:
        assert lim.tokens_per_minute is not None
        excess = u.window_total + need - lim.tokens_per_minute
        freed = 0
        for c in u.window:
            freed += c.tokens
            if freed >= excess:
                return round(max(0.001, c.at + WINDOW_S - now), 3)
        return WINDOW_S

    def admit(self, tenant: str, request_id: str, prompt_tokens: int, max_tokens: int, now: float) -> None:
        u = self._usage(tenant)
        if request_id in u.inflight:
            return  # idempotent: a re-sent request is the same request
        charge = _Charge(now, prompt_tokens + max_tokens, request_id=request_id)
        u.inflight[request_id] = charge
        u.window.append(charge)
        u.window_total += charge.tokens

    def finish(self, tenant: str, request_id: str, used_tokens: int | None, now: float) -> bool:
        """The request ended; ``used_tokens`` (prompt + completion) replaces its reservation in the window
        (None: it never ran, e.g. refused at dispatch, so nothing is charged). False if it was not ours."""
        u = self._u.get(tenant)
        if u is None or request_id not in u.inflight:
            return False
        charge = u.inflight.pop(request_id)
        charge.request_id = ""
        used = used_tokens or 0
        if charge.in_window:  # the charge stays dated at admission; only its size becomes the real one
            u.window_total += used - charge.tokens
        charge.tokens = used
        u.finish_times.append(now)
        while len(u.finish_times) > MAX_FINISHES:
            u.finish_times.popleft()
        return True

    # --- sharing one tenant's usage between routers ----------------------------------------------------
    def export(self, tenant: str, now: float) -> dict[str, Any]:
        """The tenant's usage as plain data (the fields of ``proto.TenantUsage``). Finished requests' charges
        are merged per second: the snapshot stays small (in flight + at most 60 entries), at the cost of
        retry-after estimates rounded to the second."""
        u = self._usage(tenant)
        self._expire(u, now)
        settled: dict[float, int] = {}
        for c in u.window:
            if not c.request_id:
                sec = float(math.ceil(c.at))  # never earlier than the real charge: stricter, not looser
                settled[sec] = settled.get(sec, 0) + c.tokens
        return {"tenant": tenant,
                "inflight": {rid: (c.at, c.tokens) for rid, c in u.inflight.items()},
                "settled": sorted(settled.items()),
                "finishes": list(u.finish_times)}

    def load(self, tenant: str, snapshot: dict[str, Any] | None, now: float) -> None:
        """Replace the tenant's usage by a snapshot from ``export`` (None: no usage yet)."""
        u = self._u[tenant] = _Usage()
        if not snapshot:
            return
        charges: list[_Charge] = []
        for rid, (at, tokens) in snapshot.get("inflight", {}).items():
            c = _Charge(_finite(at, now), max(0, int(tokens)), request_id=rid)
            u.inflight[rid] = c
            charges.append(c)
        charges += [_Charge(_finite(at, now), max(0, int(tokens))) for at, tokens in snapshot.get("settled", [])]
        charges.sort(key=lambda c: c.at)
        for c in charges:
            u.window.append(c)
            u.window_total += c.tokens
        u.finish_times.extend(sorted(float(t) for t in snapshot.get("finishes", [])
                                     if math.isfinite(float(t)) and float(t) <= now + MAX_CLOCK_SKEW_S)[-MAX_FINISHES:])
        self._expire(u, now)

    def stale(self, tenant: str, older_than_s: float, now: float) -> list[str]:
        """Requests in flight for longer than ``older_than_s``: candidates to check against the registry."""
        u = self._u.get(tenant)
        if u is None:
            return []
        return [rid for rid, c in u.inflight.items() if c.at <= now - older_than_s]
