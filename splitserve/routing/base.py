"""Routing interfaces and records: what a strategy is given, what it returns, and the decision log record.

This module owns the vocabulary shared by every strategy, the router policy, the live router service, the
benchmarks and the simulator:

* :class:`RoutingRequest` - one request as routing sees it (token ids and/or block hashes, tenant, session);
* :class:`WorkerView` - one worker's state as the router last heard it (heartbeats), per pool;
* :class:`Candidate` / :class:`Selection` - a strategy's scored candidates and its pick within one pool;
* :class:`Decision` - the full record of one routing decision (serialisable for logs and traces);
* :class:`Strategy` - the interface each strategy implements; :class:`NoWorkers` - the typed failure.

Everything is pure and synchronous; anything time-dependent takes ``now`` (seconds, any monotonic clock).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Literal

from splitserve.cache.hashing import DEFAULT_BLOCK_SIZE, hash_token_blocks

__all__ = [
    "DECODE",
    "DIRECT",
    "DISAGGREGATED",
    "PREFILL",
    "Candidate",
    "Decision",
    "NoWorkers",
    "Role",
    "RoutingRequest",
    "Selection",
    "Strategy",
    "WorkerView",
]

Role = Literal["prefill", "decode"]
PREFILL: Final = "prefill"
DECODE: Final = "decode"
DIRECT: Final = "direct"
DISAGGREGATED: Final = "disaggregated"


class NoWorkers(RuntimeError):
    """No live worker in the pool the decision needs (``role`` is "decode" or "prefill")."""

    def __init__(self, role: str, detail: str = "") -> None:
        self.role = role
        super().__init__(f"no live {role} workers" + (f": {detail}" if detail else ""))


@dataclass(slots=True)
class RoutingRequest:
    """A request as routing sees it.

    Give ``token_ids`` (the router hashes them lazily, once per block size) or precomputed ``block_hashes``
    (benchmarks, trace replay); ``prompt_tokens`` defaults to ``len(token_ids)``. ``cache_salt`` / ``lora``
    scope the hash chain (see :mod:`splitserve.cache.hashing`); workers must hash with the same keys for
    their KV events to match, so tenant isolation of cache keys is opt-in per deployment. ``ttft_slo_ms`` /
    ``itl_slo_ms``: the request's latency targets, read by the ``slo`` strategy (other strategies ignore them).
    """

    request_id: str
    tenant: str = "default"
    token_ids: Sequence[int] | None = None
    block_hashes: list[int] | None = None
    prompt_tokens: int | None = None
    session_key: str | None = None
    cache_salt: str | None = None
    lora: str | None = None
    force_route: str | None = None  # "direct" | "disaggregated": the caller overrides the rule (debugging)
    # Latency targets (the tenant's SLO, ms; None: none): the ``slo`` strategy and SLO admission honour them.
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None
    _hash_block_size: int = field(default=0, repr=False, compare=False)

    def num_prompt_tokens(self) -> int:
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        if self.token_ids is not None:
            return len(self.token_ids)
        return 0

    def hashes(self, block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
        """The prompt's chained block hashes (computed from ``token_ids`` on first use and kept)."""
        if self.block_hashes is not None and (
            self._hash_block_size in (0, block_size) or self.token_ids is None
        ):
            return self.block_hashes
        if self.token_ids is None:
            return []
        self.block_hashes = hash_token_blocks(
            self.token_ids, block_size, cache_salt=self.cache_salt, lora=self.lora
        )
        self._hash_block_size = block_size
        return self.block_hashes


@dataclass(slots=True)
class WorkerView:
    """One worker's state as last reported (heartbeat load), plus what routing needs to know about it.

    ``used_blocks`` is the KV held by its active sequences (the decode load); ``free_blocks`` /
    ``total_blocks`` its KV pool (0 = unknown); ``prefill_tokens_per_s`` a measured or configured prefill
    rate (None = unknown), used to compare heterogeneous workers and for the disaggregation stall rule;
    ``step_ms`` a decoder's recent decode step time, the fixed cost any local prefill adds to its streams;
    ``pool`` its context pool (long prompts decode on ``long`` decoders when there are any).
    """

    worker_id: str
    role: str = DECODE
    live: bool = True
    active_seqs: int = 0
    queued_requests: int = 0
    queued_prefill_tokens: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    used_blocks: int = 0
    prefill_tokens_per_s: float | None = None
    step_ms: float | None = None  # a decoder's recent decode step time (None = unknown)
    pool: str = "general"  # a decoder's context pool: "general" or "long" (see splitserve.routing.context)
    # A decoder's batch size and the requests it holds but has not started (its heartbeat's max_seqs and
    # queued_requests): only the latency predictor reads them (a request sent to a full decoder waits for a slot);
    # the cost model's load stays what it has always weighed.
    max_seqs: int | None = None
    waiting: int = 0

    @property
    def load(self) -> int:
        """Requests on the worker (running + queued): the imbalance guard's measure."""
        return self.active_seqs + self.queued_requests


@dataclass(slots=True)
class Candidate:
    """One worker's score within a pool for one request."""

    worker_id: str
    cached_blocks: int = 0  # leading prompt blocks the worker holds (any tier)
    cached_tokens: int = 0
    credit_tokens: float = 0.0  # cached tokens after tier weighting (what the cost credits)
    uncached_tokens: int = 0
    cost: float = 0.0
    load: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "worker": self.worker_id,
            "cached_blocks": self.cached_blocks,
            "cached_tokens": self.cached_tokens,
            "credit_tokens": round(self.credit_tokens, 1),
            "uncached_tokens": self.uncached_tokens,
            "cost": round(self.cost, 3),
            "load": self.load,
        }


@dataclass(slots=True)
class Selection:
    """A strategy's pick within one pool: the chosen candidate, why, and the candidates it weighed."""

    chosen: Candidate
    reason: str
    candidates: list[Candidate]
    detail: dict[str, Any] = field(default_factory=dict)
    view_index: int | None = None  # position of the chosen worker in the views the strategy was given

    @property
    def worker_id(self) -> str:
        return self.chosen.worker_id


@dataclass(slots=True)
class Decision:
    """Everything about one routing decision; ``to_dict`` is what goes into trace attributes and the request's
    final message (the router's ``routed`` log line has its summary)."""

    request_id: str
    strategy: str
    route: str  # "direct" | "disaggregated"
    decoder: str
    prefiller: str | None
    reason: str  # why this route
    decoder_reason: str
    prefiller_reason: str | None
    prompt_tokens: int
    cached_tokens: int  # on the chosen decoder
    uncached_tokens: int  # on the chosen decoder: what the disaggregation rule looked at
    candidates: list[Candidate]  # decode pool (the best few, chosen first)
    prefill_candidates: list[Candidate]
    thresholds: dict[str, Any]
    now: float
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def disaggregated(self) -> bool:
        return self.route == DISAGGREGATED

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "strategy": self.strategy,
            "route": self.route,
            "decoder": self.decoder,
            "prefiller": self.prefiller,
            "reason": self.reason,
            "decoder_reason": self.decoder_reason,
            "prefiller_reason": self.prefiller_reason,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "uncached_tokens": self.uncached_tokens,
            "candidates": [c.to_dict() for c in self.candidates],
            "prefill_candidates": [c.to_dict() for c in self.prefill_candidates],
            "thresholds": dict(self.thresholds),
            "now": self.now,
            **({"detail": dict(self.detail)} if self.detail else {}),
        }


class Strategy(ABC):
    """Picks one worker from one pool. One instance serves both pools (``role`` says which).

    Subclasses must be deterministic given their inputs, their own state and their explicit seeds.
    """

    name: ClassVar[str] = "base"
    uses_cache: ClassVar[bool] = False  # True: its candidates' cached_blocks are real (kvaware, prefixaware)

    @abstractmethod
    def select(
        self, request: RoutingRequest, workers: Sequence[WorkerView], role: str, now: float, block_size: int
    ) -> Selection:
        """Choose among ``workers`` (non-empty, all live, all of ``role``)."""

    def on_routed(self, request: RoutingRequest, decision: Decision, now: float, block_size: int) -> None:
        """Observe a decision that is being dispatched (prefixaware learns from this)."""
        return None

    def remove_worker(self, worker_id: str) -> None:
        """Forget anything about a worker that left."""
        return None

    def config(self) -> dict[str, Any]:
        """The strategy's settings, for decision records."""
        return {}
