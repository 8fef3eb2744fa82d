"""What operators and the console ask a router: the per-tenant queue report and the route explorer (a dry run
of every strategy, :mod:`splitserve.services.router.explain`).
"""

from __future__ import annotations

from typing import Any

from nats.aio.msg import Msg

from splitserve import proto
from splitserve.proto import (
    ErrorCode,
    GenerateRequest,
    QueueReport,
    QueueReportRequest,
    TenantQueue,
)
from splitserve.services.router.core import RouterCore


class Admin(RouterCore):
    """The queue report and the route explorer."""

    async def on_queue_report(self, _: QueueReportRequest, msg: Msg) -> None:
        now = self.clock()
        await self.wq.refresh()
        pending = self.wq.pending_by_tenant()
        running: dict[str, int] = {}
        for inf in self.inflight.values():
            running[inf.tenant] = running.get(inf.tenant, 0) + 1
        served = self.fair.served()
        names = sorted(set(pending) | set(running) | set(served) | set(self.tenants.tenants)
                       | {t for t, _ in self._rates})
        rows = []
        for t in names:
            rows.append(TenantQueue(
                tenant=t, weight=self.tenants.weight(t), queued=pending.get(t, 0),
                queued_by_class=self.wq.pending_by_class(t), running=running.get(t, 0),
                inflight=self.quota.inflight(t),
                oldest_wait_ms=await self.wq.oldest_wait_ms(t) if pending.get(t) else None,
                accepted_per_s=self._rate(t, "accepted").per_s(now),
                dispatched_per_s=self._rate(t, "dispatched").per_s(now),
                refused_per_s=self._rate(t, "refused").per_s(now),
                served_tokens=served.get(t, 0), tokens_last_minute=self.quota.tokens_in_window(t, now),
                priority=self.tenants.priority(t), **self._contract_columns(t, now)))
        await self.b.respond(msg, QueueReport(router_id=self.worker_id, capacity=self.free_slots(now),
                                              running=len(self.inflight), tenants=rows,
                                              contract_problems=self._contract_problems))

    def _contract_columns(self, tenant: str, now: float) -> dict[str, Any]:
        if not self.contracts_on:
            return {}
        funding = self.contracts.funding(tenant, now)
        return {"cluster_running": self.contracts.running(tenant),
                "funding": "capped" if funding is None else funding.value}

    async def on_route_explain(self, req: proto.RouteExplainRequest, msg: Msg) -> None:
        """What each strategy would decide for this prompt now: a dry run that dispatches nothing and leaves
        every routing state as it was (``splitserve.services.router.explain``)."""
        from splitserve.services.router import explain

        served = self.models.resolve(req.model)
        if served is None:
            await self.b.reply_error(msg, ErrorCode.MODEL_NOT_FOUND, self.models.not_found(req.model or ""))
            return
        try:
            ids = explain.prompt_ids(served.tok.token_ids, req)
        except Exception as exc:
            await self.b.reply_error(msg, ErrorCode.BAD_REQUEST, f"could not tokenize the prompt: {exc}")
            return
        now = self.clock()
        live = self._live("decode", served.name, now) + self._live("prefill", served.name, now)
        salt = self._cache_salt(GenerateRequest(request_id="explain", tenant=req.tenant, prompt_token_ids=[0],
                                                cache_salt=req.cache_salt, model=served.name))
        await self.b.respond(msg, explain.answer(self.worker_id, self.policy.of(served.name), req, ids, live,
                                                 self._view, now, cache_salt=salt))
