"""Tenant contracts: a guaranteed and a burst share of the two scarce resources of a disaggregated cluster, and
the dispatch rule that honours them.

    tenants:
      search:
        priority: 1                 # 0 = most urgent class (the default)
        contract:
          prefill_tokens_per_s: {guaranteed: 20000, burst: 60000}
          decode_slots: {guaranteed: 32, burst: 128}
          slo: {ttft_p99_ms: 800, itl_p99_ms: 60}

- **Decode slots** are the requests a tenant has running on decoders (dispatched, not yet ended), counted over
  every router. The guaranteed slots are *reserved*: another tenant's burst never takes the last free slots that
  tenants with unused guarantees may still claim, so a tenant inside its guarantee finds a slot at once, however
  hard another floods. Burst slots are a cap: a tenant at its burst waits in the queue, with capacity to spare.
- **Prefill tokens per second** are the prompt tokens a tenant's dispatched requests must prefill (prompt minus
  what the cache holds), metered by two token buckets (one second deep): a request the guaranteed bucket pays
  for is *guaranteed-funded*; one that only the burst bucket pays for is *burst-funded*; one neither can pay for
  waits. Prefillers serve guaranteed-funded prompts first (``FairQueue``), so another tenant's burst never sits
  in front of them.
- **Order**: tenants that a request of theirs would be guaranteed-funded for go first, then the others within
  their burst; within each band the most urgent priority class first, then the fair scheduler's weighted tokens
  (``FairScheduler``). A tenant with no contract is served from the burst band with no caps.

Several routers pull from one shared queue. Caps are split between the live routers: each may run its part of a
tenant's burst slots (parts that sum to the cap exactly) and meters 1/n of its rates, so the routers never pass a
cap together however simultaneously they dispatch, and the queue's pending work reaches every router. Guarantees
are judged on the cluster's counts: each router tells the others its running requests per tenant
(``FairShareReport.running``, with its fair-share report, at least every 2 s), so a tenant's guaranteed band and
the slots held back for unused guarantees hold over the cluster within a report's lag.

Capacity: :func:`overcommitted` says which guarantees the cluster cannot honour (decode slots: the live decoders'
``max_seqs``; prefill: their measured tokens per second), checked by ``splitserve up`` at start and by the routers
from heartbeats when workers die.

Pure and synchronous: no NATS, no clock of its own (callers pass ``now``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Contract", "ContractGate", "Funding", "RateBand", "SlotBand", "overcommitted"]

BUCKET_S: Final = 1.0  # a bucket holds one second of its rate: a tenant idle for a minute banks no more


class _Band(BaseModel):
    """A guaranteed amount (0: none) and a burst cap (None: no cap) at or above it."""

    model_config = ConfigDict(extra="forbid")

    guaranteed: float = 0.0
    burst: float | None = None

    @model_validator(mode="after")
    def _order(self) -> Self:
        if self.burst is not None and self.burst < self.guaranteed:
            raise ValueError(f"burst ({_num(self.burst)}) is below guaranteed ({_num(self.guaranteed)})")
        return self


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


class RateBand(_Band):
    """Tokens per second: guaranteed (0: none) and the burst cap (None: no cap)."""

    guaranteed: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    burst: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)


class SlotBand(_Band):
    """Decode slots: guaranteed (0: none) and the burst cap (None: no cap)."""

    guaranteed: int = Field(default=0, ge=0)
    burst: int | None = Field(default=None, ge=1)


class Contract(BaseModel):
    """What a tenant bought: each resource optional (absent: no guarantee, no cap)."""

    model_config = ConfigDict(extra="forbid")

    prefill_tokens_per_s: RateBand | None = None
    decode_slots: SlotBand | None = None

    def guarantees(self) -> bool:
        return bool((self.prefill_tokens_per_s and self.prefill_tokens_per_s.guaranteed > 0)
                    or (self.decode_slots and self.decode_slots.guaranteed > 0))


class Funding(StrEnum):
    GUARANTEED = "guaranteed"
    BURST = "burst"


@dataclass
class _Bucket:
    rate: float
    level: float
    at: float

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.rate * BUCKET_S, self.level + self.rate * (now - self.at))
            self.at = now


@dataclass
class _Tenant:
    contract: Contract
    guaranteed: _Bucket | None = None
    burst: _Bucket | None = None


class ContractGate:
    """Which tenant may be dispatched next, and how its request is funded; this router's meters of prefill tokens
    and the other routers' running requests (``set_remote``). ``own_running(tenant)``: the tenant's requests this
    router runs (its request book's flights)."""

    def __init__(self, contract_of: Callable[[str], Contract | None], priority_of: Callable[[str], int],
                 own_running: Callable[[str], int], named: Mapping[str, Contract] | None = None,
                 router_share: Callable[[], tuple[int, int]] | None = None) -> None:
        """``named``: the contracts of every tenant the tenants file names (their guaranteed slots are held back
        whether or not they have asked yet). ``router_share()``: this router's rank among the live routers and
        their number (default: the only one)."""
        self._contract_of = contract_of
        self._priority_of = priority_of
        self._priority: dict[str, int] = {}  # the tenants file is read once: each tenant's class, when first asked
        self._own_running = own_running
        self._router_share = router_share or (lambda: (0, 1))
        self._slot_guarantees = {t: c.decode_slots.guaranteed for t, c in (named or {}).items()
                                 if c.decode_slots is not None and c.decode_slots.guaranteed > 0}
        self._t: dict[str, _Tenant] = {}
        self._remote_running: dict[str, int] = {}

    # -- meters -------------------------------------------------------------------------------------------------

    def _state(self, tenant: str, now: float) -> _Tenant | None:
        st = self._t.get(tenant)
        if st is not None:
            return st
        c = self._contract_of(tenant)
        if c is None:
            return None
        rate = c.prefill_tokens_per_s
        st = _Tenant(contract=c)
        if rate is not None:
            if rate.guaranteed > 0:
                st.guaranteed = _Bucket(rate.guaranteed, rate.guaranteed * BUCKET_S, now)
            if rate.burst is not None:
                st.burst = _Bucket(rate.burst, rate.burst * BUCKET_S, now)
        self._t[tenant] = st
        return st

    def running(self, tenant: str) -> int:
        """The tenant's running requests over the cluster (this router's and the others' last reports)."""
        return self._own_running(tenant) + self._remote_running.get(tenant, 0)

    def set_remote(self, running: Mapping[str, int]) -> None:
        """The other routers' running requests per tenant (their last reports, summed)."""
        self._remote_running = {t: max(0, int(n)) for t, n in running.items()}

    # -- the rule -----------------------------------------------------------------------------------------------

    def funding(self, tenant: str, now: float) -> Funding | None:
        """How a request of ``tenant`` would be funded now: GUARANTEED (each resource it has a guarantee of is
        within it: running under its guaranteed slots, its guaranteed bucket not empty), BURST, or None (at a
        burst cap: it waits)."""
        st = self._state(tenant, now)
        if st is None:
            return Funding.BURST
        rank, n = self._router_share()
        slots, running = st.contract.decode_slots, self.running(tenant)
        if slots is not None and slots.burst is not None and (
                running >= slots.burst or self._own_running(tenant) >= _share(slots.burst, rank, n)):
            return None
        self._refill(st, now, n)
        if st.burst is not None and st.burst.level <= 0:
            return None
        slot_g = slots is not None and slots.guaranteed > 0
        if not (slot_g or st.guaranteed is not None):
            return Funding.BURST
        slot_ok = not slot_g or running < slots.guaranteed  # type: ignore[union-attr]
        rate_ok = st.guaranteed is None or st.guaranteed.level > 0
        return Funding.GUARANTEED if slot_ok and rate_ok else Funding.BURST

    def reserved_slots(self, exclude: str | None = None, uses: Callable[[str], bool] | None = None) -> int:
        """Decode slots held back for tenants' unused guarantees (``exclude``: not counting that tenant's; ``uses``:
        only tenants it accepts, e.g. those allowed the model whose slots these are)."""
        return sum(max(0, g - self.running(t)) for t, g in self._slot_guarantees.items()
                   if t != exclude and (uses is None or uses(t)))

    def pick(self, pending: Mapping[str, int], free_slots: int,
             fair_pick: Callable[[Mapping[str, int]], str | None], now: float,
             uses: Callable[[str], bool] | None = None) -> tuple[str, Funding] | None:
        """The tenant to dispatch from next and its funding, or None: guaranteed-funded tenants first, then burst
        within the slots no unused guarantee holds; the most urgent priority class first within a band, then
        ``fair_pick`` (the fair scheduler's weighted tokens). A request is admitted while its bucket is above
        zero and its whole prefill comes out when it is dispatched (its size is not known before it is pulled):
        a bucket may go below zero by one request, and refills from there. ``uses(tenant)``: whether the tenant
        may use these slots (a served model's; None: every tenant), so only those tenants' guarantees hold them."""
        if free_slots <= 0:
            return None
        bands: dict[Funding, dict[str, int]] = {Funding.GUARANTEED: {}, Funding.BURST: {}}
        for t, n in pending.items():
            if n <= 0:
                continue
            f = self.funding(t, now)
            if f is not None:
                bands[f][t] = n
        for band in (Funding.GUARANTEED, Funding.BURST):
            cands = bands[band]
            if band is Funding.BURST:
                # Burst may only use slots beyond the unused guarantees of the tenants that are not in it.
                cands = {t: n for t, n in cands.items() if free_slots > self.reserved_slots(t, uses)}
            if not cands:
                continue
            urgent = min(self._class(t) for t in cands)
            chosen = fair_pick({t: n for t, n in cands.items() if self._class(t) == urgent})
            if chosen is not None:
                return chosen, band
        return None

    def _class(self, tenant: str) -> int:
        c = self._priority.get(tenant)
        if c is None:
            c = self._priority[tenant] = self._priority_of(tenant)
        return c

    def dispatched(self, tenant: str, prefill_tokens: int, now: float) -> None:
        """A request of ``tenant`` was dispatched: its prefill tokens come out of its buckets (its slot is counted
        by ``own_running``)."""
        st = self._state(tenant, now)
        if st is None:
            return
        self._refill(st, now, self._router_share()[1])
        for b in (st.guaranteed, st.burst):
            if b is not None:
                b.level -= max(0, prefill_tokens)

    @staticmethod
    def _refill(st: _Tenant, now: float, routers: int) -> None:
        # Each router meters its 1/n of the contract's rates: the routers pull from one shared queue, so the
        # shares add up to the whole with no router waiting on another's report.
        rate = st.contract.prefill_tokens_per_s
        for b, full in ((st.guaranteed, rate.guaranteed if rate else 0.0), (st.burst, rate.burst if rate else None)):
            if b is not None and full:
                b.rate = full / max(1, routers)
                b.refill(now)
                b.level = min(b.level, b.rate * BUCKET_S)  # a bucket made full, or a share that just shrank


def _share(cap: int, rank: int, n: int) -> int:
    """Router ``rank``'s part of a cap of ``cap`` split between ``n`` routers: parts that differ by at most one and
    sum to ``cap`` exactly, so simultaneous dispatches on every router can never pass the cap together."""
    n = max(1, n)
    return cap // n + (1 if rank < cap % n else 0)


def overcommitted(contracts: Mapping[str, Contract], decode_slots: int | None,
                  prefill_tokens_per_s: float | None) -> list[str]:
    """What the guarantees ask beyond the capacity given (None: unknown, not checked), one line per resource;
    empty when they fit."""
    problems = []
    slots = sum(c.decode_slots.guaranteed for c in contracts.values() if c.decode_slots is not None)
    if decode_slots is not None and slots > decode_slots:
        who = ", ".join(f"{t} {c.decode_slots.guaranteed}" for t, c in sorted(contracts.items())
                        if c.decode_slots is not None and c.decode_slots.guaranteed)
        problems.append(f"guaranteed decode slots sum to {slots} ({who}) but the decoders run {decode_slots}")
    rate = sum(c.prefill_tokens_per_s.guaranteed for c in contracts.values() if c.prefill_tokens_per_s is not None)
    if prefill_tokens_per_s is not None and rate > prefill_tokens_per_s:
        who = ", ".join(f"{t} {c.prefill_tokens_per_s.guaranteed:g}" for t, c in sorted(contracts.items())
                        if c.prefill_tokens_per_s is not None and c.prefill_tokens_per_s.guaranteed)
        problems.append(f"guaranteed prefill sums to {rate:g} tokens/s ({who}) but the prefillers do "
                        f"{prefill_tokens_per_s:g}")
    return problems
