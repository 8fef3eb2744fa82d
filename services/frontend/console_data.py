"""Where the web console's figures come from: the same sources as the operator commands, read through the
front door's own NATS connection.

* Cluster: the front door's :class:`~splitserve.obs.metrics.ClusterMetrics` (fed by every heartbeat and
  ``RequestFinished``, exactly what ``splitserve top`` builds), sampled every ``sample_s`` into a bounded
  history for the sparklines.
* Tenants: the router's queue report (``splitserve.ops.queue_report``, as ``splitserve queues``), the
  tenants file's limits, and ``SS_USAGE`` summed per tenant (``ops.read_usage`` / ``ops.sum_usage``, as
  ``splitserve usage``).
* Requests: spans from ``SS_TRACES`` (``tracing.read_spans``, ``slowest_requests``, ``spans_for_request``,
  as ``splitserve trace``) and the waterfall rows of ``splitserve.obs.waterfall``.
* Routing explorer: ``ss.admin.route.explain`` (``ops.route_explain``).

Reads that walk a stream are cached for a few seconds and shared between concurrent callers, so a console
left open (or several) costs the cluster one read per period, not one per browser poll.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from splitserve import ops
from splitserve.obs import tracing, waterfall
from splitserve.obs.log import get_logger
from splitserve.obs.metrics import ClusterMetrics
from splitserve.proto import ChatMessage, QueueReport, RouteExplainRequest
from splitserve.proto.admin import LoraAdminReply, LoraAdminRequest
from splitserve.tenancy.config import TenantsConfig

log = get_logger("frontend.console")
T = TypeVar("T")

WORKER_SERIES = ("active", "queued_prefill_tokens", "free_blocks", "cached_blocks", "prefill_tokens_per_s")
TENANT_SERIES = ("queued", "running", "inflight", "tokens_last_minute", "served_tokens")
LIMIT_FIELDS = ("weight", "max_inflight", "max_queued", "tokens_per_minute", "max_prompt_tokens", "max_tokens")
ACTIVE_VIEWER_S = 120.0  # the sampler asks the router for its queue report only while someone looks


class _Cached:
    """One value refreshed at most every ``ttl_s``; concurrent callers share one refresh."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._at = -1e18
        self._value: Any = None
        self._lock = asyncio.Lock()

    async def get(self, fetch: Callable[[], Awaitable[T]]) -> T:
        async with self._lock:
            now = time.monotonic()
            if now - self._at > self.ttl_s:
                self._value = await fetch()
                self._at = time.monotonic()
            return self._value  # type: ignore[no-any-return]


def trace_tenants(spans: Sequence[Mapping[str, Any]]) -> dict[str, set[str]]:
    """trace id -> the tenants its spans name (the router's and workers' spans carry ``tenant``)."""
    out: dict[str, set[str]] = {}
    for s in spans:
        t = (s.get("attributes") or {}).get("tenant")
        entry = out.setdefault(s["trace_id"], set())
        if isinstance(t, str):
            entry.add(t)
    return out


def visible(spans: Sequence[Mapping[str, Any]], tenant: str | None) -> list[Mapping[str, Any]]:
    """The spans a principal may see: all for an admin (None), else only traces that are wholly its tenant's.
    A trace naming no tenant at all (a client that never reached a router) is nobody's but the admin's."""
    if tenant is None:
        return list(spans)
    owners = trace_tenants(spans)
    return [s for s in spans if owners.get(s["trace_id"]) == {tenant}]


def decision_of(spans: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The routing decision record the router attached to the trace (router.dispatch, or router.request
    with --no-queue), the last one if a request was dispatched more than once."""
    found = None
    for s in sorted(spans, key=lambda s: s["start_ns"]):
        raw = (s.get("attributes") or {}).get("decision_json")
        if isinstance(raw, str):
            try:
                found = json.loads(raw)
            except ValueError:
                continue
    return found


class ConsoleData:
    def __init__(self, metrics: ClusterMetrics, nc: Callable[[], Any], *, tenants: TenantsConfig | None = None,
                 sample_s: float = 2.0, history: int = 300, spans_ttl_s: float = 3.0) -> None:
        self.metrics = metrics
        self._nc = nc
        self.tenants = tenants
        self.sample_s = sample_s
        self.times: deque[float] = deque(maxlen=history)  # unix seconds of each sample
        self.workers: dict[str, dict[str, deque[float | None]]] = {}
        self.tenant_series: dict[str, dict[str, deque[float | None]]] = {}
        self.tenant_times: deque[float] = deque(maxlen=history)
        self._history = history
        self._spans = _Cached(spans_ttl_s)
        self._queues = _Cached(1.0)
        self._usage: dict[tuple[float | None, str | None], _Cached] = {}
        self.last_viewed = -1e18

    # --- plumbing -----------------------------------------------------------------------------------
    def nc(self) -> Any:
        nc = self._nc()
        if nc is None or not nc.is_connected:
            raise ConnectionError("the front door is not connected to NATS (reconnecting)")
        return nc

    def viewed(self) -> None:
        self.last_viewed = time.monotonic()

    # --- history (sparklines) -----------------------------------------------------------------------
    def sample(self, now_unix: float | None = None) -> None:
        """Record every known worker's load now (missing samples stay None so series stay aligned)."""
        now_unix = time.time() if now_unix is None else now_unix
        snap = self.metrics.snapshot()
        self.times.append(now_unix)
        seen = set()
        for w in snap["workers"]:
            seen.add(w["worker"])
            series = self.workers.get(w["worker"])
            if series is None:
                series = self.workers[w["worker"]] = {
                    k: deque([None] * (len(self.times) - 1), maxlen=self._history) for k in WORKER_SERIES}
            for k in WORKER_SERIES:
                v = w.get(k)
                series[k].append(None if w["state"] == "silent" else v)
        for wid in list(self.workers):
            if wid not in seen:
                for q in self.workers[wid].values():
                    q.append(None)
                if all(v is None for v in self.workers[wid]["active"]):
                    del self.workers[wid]

    def sample_tenants(self, report: QueueReport, now_unix: float | None = None) -> None:
        now_unix = time.time() if now_unix is None else now_unix
        self.tenant_times.append(now_unix)
        rows = {r.tenant: r for r in report.tenants}
        for name in set(rows) | set(self.tenant_series):
            series = self.tenant_series.get(name)
            if series is None:
                series = self.tenant_series[name] = {
                    k: deque([None] * (len(self.tenant_times) - 1), maxlen=self._history) for k in TENANT_SERIES}
            row = rows.get(name)
            for k in TENANT_SERIES:
                series[k].append(None if row is None else float(getattr(row, k)))

    async def run_sampler(self) -> None:
        while True:
            try:
                self.sample()
                if time.monotonic() - self.last_viewed < ACTIVE_VIEWER_S:
                    self.sample_tenants(await self.queue_report())
            except Exception as exc:  # no router yet, a NATS hiccup: the next sample tries again
                log.debug("console_sample_failed", error=str(exc))
            await asyncio.sleep(self.sample_s)

    # --- views ----------------------------------------------------------------------------------------
    def cluster(self) -> dict[str, Any]:
        snap = self.metrics.snapshot()
        for w in snap["workers"]:
            # What a heartbeat says besides the load `top` shows: pool, engine, batch size, KV pool size.
            seen = self.metrics.workers.get(w["worker"])
            if seen is not None:
                hb = seen[0]
                w.update(pool=hb.pool, engine=hb.engine, model=hb.model, pid=hb.pid, transport=hb.transport,
                         total_blocks=hb.load.total_blocks, used_blocks=hb.load.used_blocks,
                         max_seqs=hb.load.max_seqs, step_ms=hb.load.step_ms)
        return {
            "workers": snap["workers"],
            "rates": snap["tenants"],
            "window_s": snap["window_s"],
            "prefix_cache_hit_ratio": snap["prefix_cache_hit_ratio"],
            "history": {"t": list(self.times),
                        "workers": {w: {k: list(q) for k, q in s.items()} for w, s in self.workers.items()}},
        }

    async def queue_report(self) -> QueueReport:
        return await self._queues.get(lambda: ops.queue_report(self.nc(), timeout=3.0))

    def limits(self, tenant: str) -> dict[str, Any] | None:
        if self.tenants is None:
            return None
        lim = self.tenants.limits(tenant)
        if lim is None:
            return None
        out = {k: getattr(lim, k) for k in LIMIT_FIELDS}
        out["priority"] = lim.priority
        out["contract"] = lim.contract.model_dump(exclude_none=True) if lim.contract is not None else None
        return out

    async def tenant_view(self, only: str | None) -> dict[str, Any]:
        """Queue report rows (with limits, recent rates and history), for every tenant or only ``only``."""
        error = None
        rows: list[dict[str, Any]] = []
        head: dict[str, Any] = {}
        try:
            rep = await self.queue_report()
            head = {"router_id": rep.router_id, "capacity": rep.capacity, "running": rep.running,
                    "contract_problems": rep.contract_problems}
            rows = [r.model_dump() for r in rep.tenants]
        except Exception as exc:
            error = f"no router answered the queue report: {exc or type(exc).__name__}"
        rates = self.metrics.snapshot()["tenants"]
        names = {r["tenant"] for r in rows} | set(rates)
        if self.tenants is not None and not self.tenants.open:
            names |= set(self.tenants.tenants)
        by = {r["tenant"]: r for r in rows}
        out = []
        for name in sorted(names):
            if only is not None and name != only:
                continue
            row = by.get(name) or {"tenant": name}
            row["limits"] = self.limits(name)
            row["rates"] = rates.get(name, {"requests_per_s": 0.0, "tokens_per_s": 0.0, "errors": 0.0})
            s = self.tenant_series.get(name)
            row["history"] = {k: list(q) for k, q in s.items()} if s else {}
            out.append(row)
        if only is not None:
            head = {}  # cluster-wide capacity is the operator's business
        return {**head, "tenants": out, "history_t": list(self.tenant_times), "error": error}

    async def usage(self, since_s: float | None, tenant: str | None) -> dict[str, Any]:
        key = (since_s, tenant)
        cache = self._usage.get(key)
        if cache is None:
            if len(self._usage) > 32:
                self._usage.clear()
            cache = self._usage[key] = _Cached(5.0)

        async def fetch() -> dict[str, Any]:
            events = await ops.read_usage(self.nc(), since_s=since_s, tenant=tenant, idle_timeout=1.0)
            return {"tenants": {t: u.to_dict() for t, u in sorted(ops.sum_usage(events).items())},
                    "by_model": [u.to_dict() for u in ops.usage_rows(events, "adapter")]}

        return {"since_s": since_s, **await cache.get(fetch)}

    async def spans(self) -> list[dict[str, Any]]:
        return await self._spans.get(lambda: tracing.read_spans(self.nc()))

    async def requests(self, tenant: str | None, n: int) -> dict[str, Any]:
        spans = visible(await self.spans(), tenant)
        every = tracing.slowest_requests(spans, len(spans) or 1)
        owners = trace_tenants(spans)
        for r in every:
            r["tenants"] = sorted(owners.get(r["trace_id"], ()))
        failed = sorted((r for r in every if r["error"]), key=lambda r: -int(r["start_ns"]))
        return {"slowest": every[:n], "failed": failed[:n], "traces": len(every), "spans": len(spans)}

    async def trace(self, ref: str, tenant: str | None) -> dict[str, Any] | None:
        """A request's trace by request id (or trace id): spans, waterfall rows, its routing decision and KV
        transfers. None when there is none the principal may see."""
        spans = visible(await self.spans(), tenant)
        picked = tracing.spans_for_request(spans, ref)
        if not picked:
            picked = sorted((dict(s) for s in spans if s["trace_id"] == ref),
                            key=lambda s: (s["start_ns"], s["end_ns"]))
        if not picked:
            return None
        t0 = min(s["start_ns"] for s in picked)
        t1 = max(s["end_ns"] for s in picked)
        kv = [{"worker_id": s.get("worker_id"), **{k: v for k, v in (s.get("attributes") or {}).items()
                                                    if k.startswith("kv.")}}
              for s in picked if s["name"] == "kv.push"]
        errors = [{"service": s["service"], "worker_id": s.get("worker_id"), "name": s["name"],
                   "message": s.get("status_message"), "code": (s.get("attributes") or {}).get("error.code")
                   or (s.get("attributes") or {}).get("error_code")}
                  for s in picked if s.get("status") == "error"]
        rid = next((s["attributes"]["request_id"] for s in picked if "request_id" in (s.get("attributes") or {})),
                   None)
        return {"request_id": rid, "trace_id": picked[0]["trace_id"], "duration_ms": (t1 - t0) / 1e6,
                "rows": waterfall.rows(picked), "decision": decision_of(picked), "kv": kv, "errors": errors,
                "spans": picked}

    async def lora_admin(self, req: LoraAdminRequest) -> list[LoraAdminReply]:
        """Every targeted worker's answer: the live decoders and prefillers of ``req.model`` (all, without one) as
        their heartbeats show them. None targeted: no request at all (an unknown model answers at once)."""
        now = time.monotonic()
        stale = self.metrics.stale_s
        targets = [hb for hb, seen in list(self.metrics.workers.values())
                   if now - seen <= stale and hb.role in ("decode", "prefill") and hb.state == "ready"
                   and (req.model is None or hb.model == req.model)]
        if not targets:
            return []
        return await ops.lora_admin(self.nc(), req, expected=len(targets))

    async def explain(self, *, prompt: str, chat: bool, session_id: str | None, tenant: str,
                      strategies: list[str] | None, model: str | None = None) -> dict[str, Any]:
        req = RouteExplainRequest(tenant=tenant, session_id=session_id, strategies=strategies, model=model,
                                  **({"messages": [ChatMessage(role="user", content=prompt)]} if chat
                                     else {"prompt": prompt}))
        return (await ops.route_explain(self.nc(), req)).model_dump(mode="json")
