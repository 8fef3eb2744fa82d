"""Fair sharing of the cluster between tenants, by tokens rather than requests.

A virtual token counter per tenant (after "Fairness in Serving Large Language Models", Sheng et al., VTC):
every token a tenant is served adds ``tokens / weight`` to its counter, and the next request dispatched comes
from the backlogged tenant with the smallest counter. A tenant that was idle does not bank credit: when it
becomes backlogged again its counter is lifted to the smallest counter among the tenants already waiting, so
it competes from where they are instead of starving them with saved-up share. Within a tenant, lower priority
classes go first.

Pure and deterministic (ties go to the lexically smallest tenant): the router, the benchmarks and the tests
drive the same object. The router charges at dispatch what a request may cost (prompt + max_tokens) and
settles at finish with what it really cost, so a flood of long requests cannot win on estimates.

Several routers: each keeps its own scheduler, publishes ``virtual()`` (the tokens / weight it charged each
tenant) and feeds the other routers' figures to ``set_remote``; every comparison then uses the cluster's
counter (own + remote), so the weighted split holds across replicas as it does with one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass
class _TenantState:
    counter: float = 0.0  # this scheduler's part of the counter (its charges and catch-up lifts)
    virtual: float = 0.0  # tokens / weight this scheduler charged (what other routers add to theirs)
    served_tokens: int = 0  # settled + outstanding charges, for reporting shares
    backlogged: bool = False


class FairScheduler:
    def __init__(self, weight_of: Callable[[str], float] | None = None) -> None:
        self._weight_of = weight_of or (lambda _t: 1.0)
        self._t: dict[str, _TenantState] = {}
        self._remote: dict[str, float] = {}  # tenant -> virtual tokens charged by the other routers

    def _state(self, tenant: str) -> _TenantState:
        st = self._t.get(tenant)
        if st is None:
            st = self._t[tenant] = _TenantState()
        return st

    def weight(self, tenant: str) -> float:
        return max(1e-9, float(self._weight_of(tenant)))

    def set_remote(self, virtual_tokens: Mapping[str, float]) -> None:
        """The other routers' charges, summed per tenant (tokens / weight, as their ``virtual()``)."""
        self._remote = dict(virtual_tokens)

    def _eff(self, tenant: str) -> float:
        return self._state(tenant).counter + self._remote.get(tenant, 0.0)

    def update_backlog(self, pending: Mapping[str, int]) -> None:
        """Tell the scheduler which tenants have queued work (tenant -> queued requests)."""
        waiting = [t for t, n in pending.items() if n > 0]
        already = [self._eff(t) for t in waiting if t in self._t and self._t[t].backlogged]
        floor = min(already) if already else None
        for t in waiting:
            st = self._state(t)
            if not st.backlogged:
                lift: float | None = floor
                if lift is None and self._t:
                    # Nobody else waits: start level with the least-served tenant that is still active.
                    active = [self._eff(name) for name, s in self._t.items() if s.backlogged and name != t]
                    lift = min(active) if active else None
                if lift is not None:
                    st.counter += max(0.0, lift - self._eff(t))  # no credit banked while idle
                st.backlogged = True
        for t, st in self._t.items():
            if st.backlogged and pending.get(t, 0) <= 0:
                st.backlogged = False

    def pick(self, pending: Mapping[str, int]) -> str | None:
        """The tenant whose request should be dispatched next, or None if nobody waits."""
        self.update_backlog(pending)
        best: tuple[float, str] | None = None
        for t, n in pending.items():
            if n <= 0:
                continue
            key = (self._eff(t), t)
            if best is None or key < best:
                best = key
        return None if best is None else best[1]

    def charge(self, tenant: str, tokens: int) -> None:
        """A request of this tenant was dispatched, estimated to cost ``tokens``."""
        st = self._state(tenant)
        v = tokens / self.weight(tenant)
        st.counter += v
        st.virtual += v
        st.served_tokens += tokens

    def settle(self, tenant: str, estimated: int, actual: int) -> None:
        """The request finished having cost ``actual`` tokens instead of the ``estimated`` charged."""
        st = self._state(tenant)
        v = (actual - estimated) / self.weight(tenant)
        st.counter += v
        st.virtual += v
        st.served_tokens += actual - estimated

    def counters(self) -> dict[str, float]:
        """The counters the scheduler compares (with the other routers' charges added)."""
        return {t: self._eff(t) for t in self._t}

    def virtual(self) -> dict[str, float]:
        """Tokens / weight this scheduler charged each tenant (what the other routers add to their counters)."""
        return {t: st.virtual for t, st in self._t.items()}

    def served(self) -> dict[str, int]:
        return {t: st.served_tokens for t, st in self._t.items()}
