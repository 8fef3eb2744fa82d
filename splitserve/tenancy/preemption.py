"""Priority preemption: which running request, if any, a more urgent waiting request may take a decode slot from.

Owns the *victim rule* and its rate limit, nothing else: pure and synchronous (no NATS, no clock of its own:
callers pass ``now``). The router (``splitserve.services.router.preempt``) asks it when the contract gate
(:class:`~splitserve.tenancy.contracts.ContractGate`) would dispatch a request now but its model's decoders have
no free slot, and carries the decision out (the victim is revoked on its decoder and moved over prompt + tokens
so far, never lost).

The rule (:func:`choose_victim`), for a waiting request of priority class ``p`` (0 most urgent):

- only a flight of a tenant whose class is *strictly* less urgent (a higher number): two requests of one class,
  or a less urgent one, never preempt each other, so no pair of classes can take slots back and forth;
- only a *burst-funded* flight (never one dispatched as ``Funding.GUARANTEED``), and only while its tenant runs
  more than its guaranteed decode slots over the cluster, judged now: taking one slot must leave the tenant at
  or above its guarantee, whatever funded the flight when it was dispatched;
- only on a decoder of the waiting request's model, one that is decoding (has produced output: a job still
  queued on its decoder frees no running slot) with at least ``min_remaining`` tokens to go (one about to end
  frees its slot anyway, and moving it costs more than waiting);
- at most ``max_per_request`` times per request, and not again within ``cooldown_s`` of its last preemption;
- preferred: the least urgent class, then the fewest tokens generated (cheapest to resume: its prompt + tokens
  so far are prefilled again), then the most recently started, then its key (stable).

:class:`PreemptionGate` adds the router-wide rate limit (at most ``max_per_window`` preemptions per
``window_s``) and remembers each request's last preemption for the cool-down.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from splitserve.tenancy.contracts import Funding

__all__ = ["PreemptionGate", "PreemptionLimits", "Running", "choose_victim"]


@dataclass(frozen=True)
class Running:
    """A running flight as the rule sees it."""

    key: str  # proto.request_key(tenant, request_id)
    tenant: str
    priority: int  # its tenant's class, 0 most urgent
    funding: Funding  # how the contract gate funded it at dispatch
    decoder: str
    generated: int  # tokens the caller has received
    remaining: int  # tokens it may still generate (max_tokens - generated)
    started_at: float  # its current attempt was sent (the caller's clock)
    decoding: bool = True  # its decoder has produced output for this attempt
    preemptions: int = 0  # times it was preempted already


@dataclass(frozen=True)
class PreemptionLimits:
    """How often preemption may happen. Defaults: a few per second per router, each request at most twice and
    not twice within 5 s."""

    max_per_window: int = 4
    window_s: float = 1.0
    cooldown_s: float = 5.0
    max_per_request: int = 2
    min_remaining: int = 8


def choose_victim(waiting_class: int, decoders: Collection[str], flights: Iterable[Running],
                  running_of: Callable[[str], int], guaranteed_slots_of: Callable[[str], int],
                  limits: PreemptionLimits = PreemptionLimits(),
                  last_preempted: Callable[[str], float | None] = lambda _k: None,
                  now: float = 0.0) -> Running | None:
    """The flight a request of class ``waiting_class`` may preempt on one of ``decoders`` (its model's), or None.
    ``running_of(tenant)``: the tenant's running requests over the cluster now; ``guaranteed_slots_of(tenant)``:
    its guaranteed decode slots (0: none); ``last_preempted(key)``: when that request was last preempted (None:
    never). See the module docstring for the rule."""
    best: tuple[tuple[int, int, float, str], Running] | None = None
    inside: dict[str, bool] = {}  # tenant -> inside its guarantee now (asked once per tenant)
    for f in flights:
        if f.priority <= waiting_class or f.funding is Funding.GUARANTEED:
            continue
        if f.decoder not in decoders or not f.decoding or f.remaining < limits.min_remaining:
            continue
        if f.preemptions >= limits.max_per_request:
            continue
        last = last_preempted(f.key)
        if last is not None and now - last < limits.cooldown_s:
            continue
        held = inside.get(f.tenant)
        if held is None:
            # Taking one slot must leave the tenant at or above its guarantee: running - 1 >= guaranteed.
            held = inside[f.tenant] = running_of(f.tenant) <= guaranteed_slots_of(f.tenant)
        if held:
            continue
        rank = (-f.priority, f.generated, -f.started_at, f.key)
        if best is None or rank < best[0]:
            best = (rank, f)
    return None if best is None else best[1]


class PreemptionGate:
    """The victim rule with this router's rate limit and each request's cool-down (bounded memory)."""

    def __init__(self, limits: PreemptionLimits = PreemptionLimits(), remembered: int = 4096) -> None:
        self.limits = limits
        self._recent: deque[float] = deque()  # times of this router's recent preemptions
        self._last: OrderedDict[str, float] = OrderedDict()  # request key -> its last preemption
        self._remembered = remembered
        self.count = 0  # preemptions so far

    def allows(self, now: float) -> bool:
        """Whether the router-wide rate limit lets one more preemption happen now (cheap: asked first)."""
        horizon = now - self.limits.window_s
        while self._recent and self._recent[0] <= horizon:
            self._recent.popleft()
        return len(self._recent) < self.limits.max_per_window

    def victim(self, waiting_class: int, decoders: Collection[str], flights: Iterable[Running],
               running_of: Callable[[str], int], guaranteed_slots_of: Callable[[str], int],
               now: float) -> Running | None:
        """:func:`choose_victim` under this gate's limits, or None while the rate limit is reached."""
        if not self.allows(now):
            return None
        return choose_victim(waiting_class, decoders, flights, running_of, guaranteed_slots_of, self.limits,
                             self._last.get, now)

    def record(self, key: str, now: float) -> None:
        """A preemption of ``key`` happened now: it counts against the rate limit and starts its cool-down."""
        self._recent.append(now)
        self._last[key] = now
        self._last.move_to_end(key)
        while len(self._last) > self._remembered:
            self._last.popitem(last=False)
        self.count += 1
