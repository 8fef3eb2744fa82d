"""LoRA adapter affinity: which of a model's workers may take a request for an adapter, and which it prefers.

Pure and synchronous (no NATS, no engine): the live router and the benchmarks run the same rule. A worker that
has the adapter loaded serves it at once; one that only has it available (``--max-loras``: loaded on first use,
evicting the least recently used) pays a load first and may evict an adapter others need. So the request goes
to a worker with it loaded, unless those are busier than the least busy other worker by more than ``spill``
requests (then every worker that has it available competes, and the policy's own load rule picks): the
LoRA-affinity scorer of llm-d, as a filter ahead of the strategy.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from splitserve.routing.base import WorkerView

SPILL_REQUESTS = 4  # how much busier the workers holding an adapter may be before another one loads it


def adapter_candidates(views: Sequence[WorkerView], loaded: Collection[str], *,
                       spill: int = SPILL_REQUESTS) -> tuple[list[WorkerView], str]:
    """(the candidates, why) among ``views`` (workers of one role that have the adapter available) for an
    adapter request; ``loaded``: the ids of those with it loaded now. Why: ``loaded`` (only those),
    ``spill`` (they are too busy: all), ``load`` (none has it loaded: all, one will load it)."""
    have = [v for v in views if v.worker_id in loaded]
    if not have:
        return list(views), "load"
    rest = [v for v in views if v.worker_id not in loaded]
    if rest and min(v.load for v in have) - min(v.load for v in rest) > spill:
        return list(views), "spill"
    return have, "loaded"


def adapter_views(decoders: Sequence[WorkerView], prefillers: Sequence[WorkerView], loaded: Collection[str],
                  affinity: bool) -> tuple[list[WorkerView], dict[str, str]]:
    """The candidates of both roles for a request (``affinity``: an adapter request, affinity on; else all of
    them), and why per role (for the route explanation)."""
    if not affinity:
        return [*decoders, *prefillers], {}
    d, d_why = adapter_candidates(decoders, loaded)
    p, p_why = adapter_candidates(prefillers, loaded)
    return d + p, {"decode": d_why, "prefill": p_why}
