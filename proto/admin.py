"""Operator request/reply models that only consoles and tools send (not on any request's path).

``ss.admin.route.explain``: "what would each routing strategy decide for this prompt, now?" The router
answers from its live worker views, its cache-index replica and its pending-load ledger without dispatching
anything or changing any of its state (see ``splitserve.routing.explain``).

``ss.admin.cache.stats``: "what does the cache index hold?" A cache-index service answers with its blocks per
worker and tier and how far it has read the workers' KV event stream (``splitserve cache stats``).

Same compatibility rule as ``proto.messages``: within one ``v`` fields are only added with defaults.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from splitserve.proto.messages import ChatMessage, Message, now_ms
from splitserve.proto.subjects import check_token
from splitserve.proto.tokens import TokenIds

__all__ = ["CacheStatsReply", "CacheStatsRequest", "CacheWorkerStats",
           "ExplainWorker", "LoraAdminReply", "LoraAdminRequest", "RouteExplainReply", "RouteExplainRequest",
           "StrategyExplanation"]

MAX_EXPLAIN_STRATEGIES = 16


class RouteExplainRequest(Message):
    """A prompt to route on paper. Exactly one of prompt / messages / prompt_token_ids (as GenerateRequest)."""

    kind: Literal["route_explain_request"] = "route_explain_request"
    tenant: str = "default"
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: TokenIds | None = None
    session_id: str | None = Field(default=None, max_length=256)
    # The request's own cache salt (as GenerateRequest's): the router salts the lookup the way it would route.
    cache_salt: str | None = Field(default=None, max_length=256)
    model: str | None = Field(default=None, max_length=256)  # a served model (None: the router's default)
    # None: every registered strategy; the router's own (live) strategy is always marked in the reply.
    strategies: list[str] | None = Field(default=None, max_length=MAX_EXPLAIN_STRATEGIES)

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, v: str) -> str:
        return check_token(v, "tenant")

    @model_validator(mode="after")
    def _one_input(self) -> RouteExplainRequest:
        given = [x is not None for x in (self.prompt, self.messages, self.prompt_token_ids)]
        if sum(given) != 1:
            raise ValueError("exactly one of prompt, messages or prompt_token_ids must be given")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class ExplainWorker(BaseModel):
    """One live worker as the router sees it for this decision (heartbeat load + its pending ledger)."""

    worker_id: str
    role: str
    pool: str = "general"
    active_seqs: int = 0
    queued_prefill_tokens: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    used_blocks: int = 0
    prefill_tokens_per_s: float | None = None
    step_ms: float | None = None
    cached_blocks: int = 0  # leading blocks of this prompt it holds, per the router's index replica


class StrategyExplanation(BaseModel):
    strategy: str
    live: bool = False  # the strategy this router runs (its state, e.g. prefixaware's tree, is the live one)
    decision: dict[str, Any] | None = None  # splitserve.routing.Decision.to_dict()
    error: str | None = None  # e.g. "no live decode workers"
    note: str | None = None


class RouteExplainReply(Message):
    kind: Literal["route_explain_reply"] = "route_explain_reply"
    router_id: str
    ts_ms: float = Field(default_factory=now_ms)
    prompt_tokens: int
    block_size: int
    live_strategy: str
    policy: dict[str, Any] = Field(default_factory=dict)  # the live Router.describe(): thresholds, disagg rule
    workers: list[ExplainWorker] = Field(default_factory=list)
    results: list[StrategyExplanation] = Field(default_factory=list)


class LoraAdminRequest(Message):
    """``ss.admin.lora``: an operator loads or unloads a LoRA adapter at runtime (the front door's
    ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, behind an admin key). Every worker serving
    ``model`` (None: every worker) acts and answers: a load makes the adapter available there (and loads it now
    unless the worker loads adapters on demand); an unload removes it (refused while a sequence decodes with it).
    The path is the workers' own (their filesystem), named by the operator only."""

    kind: Literal["lora_admin_request"] = "lora_admin_request"
    action: Literal["load", "unload"]
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str | None = Field(default=None, max_length=4096)
    model: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _path_for_load(self) -> LoraAdminRequest:
        if self.action == "load" and not self.lora_path:
            raise ValueError("a load needs lora_path")
        return self


class LoraAdminReply(Message):
    kind: Literal["lora_admin_reply"] = "lora_admin_reply"
    worker_id: str
    ok: bool
    message: str = ""
    adapters: list[str] = Field(default_factory=list)  # what the worker has loaded after it acted


class CacheStatsRequest(Message):
    """``ss.admin.cache.stats`` (operator only): the cache index's residency summary."""

    kind: Literal["cache_stats_request"] = "cache_stats_request"


class CacheWorkerStats(BaseModel):
    """One worker as the cache index sees it."""

    worker_id: str
    blocks: int = 0  # distinct blocks it holds in any tier
    blocks_by_medium: dict[str, int] = Field(default_factory=dict)  # tier ("gpu", "cpu", ...) -> blocks
    last_batch_seq: int = -1  # the last KV event batch applied from it (-1: none yet)


class CacheStatsReply(Message):
    kind: Literal["cache_stats_reply"] = "cache_stats_reply"
    index_id: str  # the cache-index service that answered (replicas each hold the whole index)
    ts_ms: float = Field(default_factory=now_ms)
    blocks: int = 0  # distinct blocks held by some worker in some tier
    blocks_by_medium: dict[str, int] = Field(default_factory=dict)
    workers: list[CacheWorkerStats] = Field(default_factory=list)
    batches: int = 0  # KV event batches applied since it started (or restored)
    events: int = 0
    gaps: int = 0  # sequence gaps seen (each resynced from the worker's dump)
    stale_batches: int = 0
    restarts: int = 0  # workers seen starting over (seq 0 again)
    applied_seq: int = 0  # the last SS_KV_EVENTS stream sequence applied
    snapshot_seq: int = 0  # ... and the one its last snapshot covers (what a starting router loads)
    restored_from: int | None = None  # the snapshot it restored at its own start
