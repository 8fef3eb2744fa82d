"""How the live router service builds its policy and paces dispatch - shared with the simulator.

The router service (``services/router/service.py``) and the capacity-planning simulator (``splitserve.sim``)
both call these, so a simulated router is built, fed and paced exactly as the live one:

* :func:`build_router` - the :class:`Router` with the service's disaggregation rule and context pools;
* :func:`build_policies` - those, one per model that has its own strategy or threshold (:class:`PolicySet`);
* :func:`view_from_load` - a heartbeat's load report -> the :class:`WorkerView` the policy decides on;
* :func:`decoder_free_slots` / :func:`dispatch_batch` - how many queued requests dispatch may pull now.

Pure and synchronous (no NATS, no clock).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from splitserve.cache.index import PrefixIndex
from splitserve.proto import WorkerLoad
from splitserve.routing.base import WorkerView
from splitserve.routing.context import ContextPools
from splitserve.routing.disagg import DisaggPolicy
from splitserve.routing.policies import PolicySet
from splitserve.routing.router import Router

__all__ = ["DEFAULT_DECODER_SLOTS", "DISPATCH_BATCH", "build_policies", "build_router", "decoder_free_slots",
           "dispatch_batch", "live_disagg", "view_from_load"]

DEFAULT_DECODER_SLOTS: Final = 16
DISPATCH_BATCH: Final = 8  # most queue messages pulled from one tenant per scheduling decision


def live_disagg(disagg_threshold: int = 512, max_stall_ms: float | None = 100.0,
                decoder_prefill_tps: float = 400.0) -> DisaggPolicy:
    # Direct prefill on a decoder pauses its other streams: above this pause, use a prefiller instead.
    return DisaggPolicy(min_uncached_tokens=disagg_threshold, max_stall_ms=max_stall_ms,
                        decoder_prefill_tokens_per_s=decoder_prefill_tps)


def build_router(strategy: str, disagg: DisaggPolicy, index: PrefixIndex, long_prompt_tokens: int = 2048) -> Router:
    """The router service's policy object (one per router process)."""
    return Router(strategy=strategy, disagg=disagg, index=index,
                  context=ContextPools(long_prompt_tokens=long_prompt_tokens))


def build_policies(strategy: str, disagg: DisaggPolicy, index: PrefixIndex, long_prompt_tokens: int = 2048,
                   per_model: Mapping[str, tuple[str, DisaggPolicy]] | None = None) -> PolicySet:
    """The router service's policies: the default (``strategy``, ``disagg``) and, for each model in
    ``per_model``, its own (strategy, disaggregation rule), all sharing the one index and pending ledger."""
    default = build_router(strategy, disagg, index, long_prompt_tokens)
    own = {}
    for model, (m_strategy, m_disagg) in (per_model or {}).items():
        r = build_router(m_strategy, m_disagg, index, long_prompt_tokens)
        r.pending = default.pending
        own[model] = r
    return PolicySet(default, own)


def view_from_load(worker_id: str, role: str, pool: str, load: WorkerLoad) -> WorkerView:
    """A heartbeat's load (live, or the simulator's by the same rule: ``splitserve.routing.load``) -> the policy's
    view of that worker (the fields the router decides on)."""
    return WorkerView(
        worker_id=worker_id, role=role, live=True, active_seqs=load.active_seqs,
        queued_prefill_tokens=load.queued_prefill_tokens, free_blocks=load.free_blocks,
        total_blocks=load.total_blocks, used_blocks=load.used_blocks,
        prefill_tokens_per_s=load.prefill_tokens_per_s, step_ms=load.step_ms, pool=pool,
        max_seqs=load.max_seqs, waiting=load.queued_requests if role == "decode" else 0,
    )


def overfill(cap: int) -> int:
    """Requests the dispatch ledger sends a decoder of batch size ``cap`` beyond its batch (they wait there, so it
    never idles between one request ending and the next arriving)."""
    return max(1, cap // 4)


def decoder_free_slots(max_seqs: int | None, reported: int, mine: int, pool: str) -> int:
    """Decode slots one decoder offers dispatch: its batch size (plus a little, so it never idles between one
    request finishing and the next arriving) less what it runs (``reported``: active + queued in its last
    heartbeat) or this router sent it (``mine``)."""
    cap = max_seqs or DEFAULT_DECODER_SLOTS
    slots = max(0, cap + overfill(cap) - max(mine, reported))
    # A long-context decoder only takes long prompts: counting all its slots would pull short requests off the
    # fair queue for the general decoders to hold. One slot lets a long one through.
    return min(slots, 1) if pool == "long" else slots


def dispatch_batch(free: int) -> int:
    """Requests to pull from the chosen tenant at once: a few when many slots are free (one round trip for
    several), few enough that the fair scheduler still decides at a fine grain."""
    return max(1, min(free // 2, DISPATCH_BATCH))
