"""The router's answer to ``ss.admin.route.explain``: a prompt routed on paper by every strategy.

Kept out of ``splitserve.services.router.service`` (which only subscribes and calls :func:`answer`): the dry run itself
is the pure :func:`splitserve.routing.explain.explain`; this module turns the request into token ids and
worker views, and the result into the wire reply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from splitserve.proto import (
    ExplainWorker,
    GenerateRequest,
    Heartbeat,
    RouteExplainReply,
    RouteExplainRequest,
    StrategyExplanation,
)
from splitserve.routing import Router, RoutingRequest, WorkerView
from splitserve.routing.explain import explain, pending_views

EXPLAIN_REQUEST_ID = "explain"


def prompt_ids(tokenize: Callable[[GenerateRequest], list[int]], req: RouteExplainRequest) -> list[int]:
    """Token ids the way intake computes them (same tokenizer, same chat template)."""
    as_request = GenerateRequest(request_id=EXPLAIN_REQUEST_ID, tenant=req.tenant, prompt=req.prompt,
                                 messages=req.messages, prompt_token_ids=req.prompt_token_ids)
    return tokenize(as_request)


def answer(router_id: str, policy: Router, req: RouteExplainRequest, ids: list[int],
           heartbeats: Sequence[Heartbeat], view: Callable[[Heartbeat], WorkerView], now: float,
           cache_salt: str | None = None) -> RouteExplainReply:
    """``cache_salt``: the salt the router would give this request (its tenant's, see
    ``TenantsConfig.cache_salt``), so the dry run looks up the same blocks a real request would."""
    views = [view(hb) for hb in heartbeats]
    rreq = RoutingRequest(request_id=EXPLAIN_REQUEST_ID, tenant=req.tenant, token_ids=ids,
                          session_key=req.session_id, cache_salt=cache_salt)
    held = policy.index.lookup(rreq.hashes(policy.block_size)) if policy.index is not None and ids else {}
    seen = pending_views(policy, views, now)
    workers = [ExplainWorker(worker_id=v.worker_id, role=v.role, pool=v.pool, active_seqs=v.active_seqs,
                             queued_prefill_tokens=v.queued_prefill_tokens, free_blocks=v.free_blocks,
                             total_blocks=v.total_blocks, used_blocks=v.used_blocks,
                             prefill_tokens_per_s=v.prefill_tokens_per_s, step_ms=v.step_ms,
                             cached_blocks=held.get(v.worker_id, 0))
               for v in sorted(seen, key=lambda v: (v.role, v.worker_id))]
    results = [StrategyExplanation(**e.to_dict()) for e in explain(policy, rreq, views, now, req.strategies)]
    return RouteExplainReply(router_id=router_id, prompt_tokens=len(ids), block_size=policy.block_size,
                             live_strategy=policy.strategy_name, policy=policy.describe(), workers=workers,
                             results=results)
