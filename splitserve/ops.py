"""Operator views behind ``splitserve queues`` and ``splitserve usage`` (and the web console): what the
router's queues hold, what each tenant used, and where a prompt would be routed.

``queue_report`` asks a router (``ss.admin.queues``) for per-tenant depth, oldest wait and rates.
``route_explain`` asks a router (``ss.admin.route.explain``) what each strategy would decide for a prompt.
``cache_stats`` asks the cache index (``ss.admin.cache.stats``) what it holds per worker and tier.
``usage_summary`` reads the ``SS_USAGE`` stream (every request's ``RequestFinished``, kept a week) from a
start time and sums prompt / completion / cached tokens per tenant, counting each request once.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.api import ConsumerConfig, DeliverPolicy

from splitserve import errors, proto
from splitserve.proto import (
    CacheStatsReply,
    CacheStatsRequest,
    QueueReport,
    QueueReportRequest,
    RequestFinished,
    RouteExplainReply,
    RouteExplainRequest,
    StreamError,
    Subjects,
)
from splitserve.proto.admin import LoraAdminReply, LoraAdminRequest


async def queue_report(nc: NATS, timeout: float = 5.0) -> QueueReport:
    resp = await nc.request(Subjects.ADMIN_QUEUES, proto.encode(QueueReportRequest()), timeout=timeout)
    return proto.decode(resp.data, QueueReport)


async def cache_stats(nc: NATS, timeout: float = 5.0) -> CacheStatsReply:
    """The cache index's blocks per worker and tier (one replica answers: each holds the whole index)."""
    resp = await nc.request(Subjects.ADMIN_CACHE_STATS, proto.encode(CacheStatsRequest()), timeout=timeout)
    if resp.headers and resp.headers.get(proto.HEADER_KIND) == "error":
        raise errors.from_wire(proto.decode(resp.data, StreamError))
    return proto.decode(resp.data, CacheStatsReply)


async def route_explain(nc: NATS, req: RouteExplainRequest, timeout: float = 5.0) -> RouteExplainReply:
    """A router's dry run of ``req`` under every strategy. Raises the router's typed error (e.g. BadRequest
    for a prompt it cannot tokenize)."""
    resp = await nc.request(Subjects.ADMIN_ROUTE_EXPLAIN, proto.encode(req), timeout=timeout)
    if resp.headers and resp.headers.get(proto.HEADER_KIND) == "error":
        err = proto.decode(resp.data, StreamError)
        raise errors.from_wire(err)
    return proto.decode(resp.data, RouteExplainReply)


async def lora_admin(nc: NATS, req: LoraAdminRequest, *, expected: int | None = None, settle_s: float = 1.0,
                     timeout: float = 30.0) -> list[LoraAdminReply]:
    """Every answering worker's reply to an operator's LoRA load / unload (``ss.admin.lora``): collected until
    ``expected`` replies came (when known), else until ``settle_s`` passes with no new one after the first (a
    load may take a while: up to ``timeout``)."""
    inbox = nc.new_inbox()
    replies: list[LoraAdminReply] = []
    got = asyncio.Event()

    async def cb(msg: Any) -> None:
        try:
            replies.append(proto.decode(msg.data, LoraAdminReply))
        except proto.ProtocolError:
            return
        got.set()

    sub = await nc.subscribe(inbox, cb=cb)
    try:
        await nc.publish(Subjects.ADMIN_LORA, proto.encode(req), reply=inbox)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (expected is None or len(replies) < expected):
            got.clear()
            wait = settle_s if replies and expected is None else deadline - time.monotonic()
            try:
                await asyncio.wait_for(got.wait(), timeout=max(0.01, wait))
            except TimeoutError:
                if replies:
                    break
    finally:
        await sub.unsubscribe()
    return sorted(replies, key=lambda r: r.worker_id)


@dataclass
class TenantUsage:
    """Totals of one row: a tenant, or (grouped by model) a tenant's use of a model, or of one adapter of it.
    ``model`` / ``adapter`` are None where the row is not grouped by them or the events did not say (a request
    refused before its model was resolved)."""

    tenant: str
    requests: int = 0
    ok: int = 0
    errors: int = 0
    cancelled: int = 0
    expired: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    by_error: dict[str, int] = field(default_factory=dict)
    model: str | None = None
    adapter: str | None = None
    # Chargeback: the worker-seconds its requests caused per stage, and what their cache hits saved (StageCost)
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    decode_s: float = 0.0
    saved_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


USAGE_GROUPS = ("tenant", "model", "adapter")  # ``usage --by``: each one splits the rows of the one before


def _last_per_request(events: list[RequestFinished]) -> list[RequestFinished]:
    """A request can end with more than one event (a cancel seen by the router and by a worker): the one with
    usage, else the last, counts."""
    last: dict[tuple[str, str], RequestFinished] = {}
    for ev in events:
        key = (ev.tenant, ev.request_id)
        prev = last.get(key)
        if prev is None or ev.usage is not None or prev.usage is None:
            last[key] = ev
    return list(last.values())


def usage_rows(events: list[RequestFinished], by: str = "tenant") -> list[TenantUsage]:
    """Totals per tenant (``by="tenant"``), per tenant and model (``"model"``), or per tenant, model and LoRA
    adapter (``"adapter"``; the base model's row has adapter None), sorted."""
    if by not in USAGE_GROUPS:
        raise ValueError(f"usage by {by!r}: one of {', '.join(USAGE_GROUPS)}")
    depth = USAGE_GROUPS.index(by)
    out: dict[tuple[str, str | None, str | None], TenantUsage] = {}
    for ev in _last_per_request(events):
        model = ev.model if depth >= 1 else None
        adapter = ev.lora if depth >= 2 else None
        u = out.setdefault((ev.tenant, model, adapter), TenantUsage(ev.tenant, model=model, adapter=adapter))
        u.requests += 1
        if ev.status == "ok":
            u.ok += 1
        elif ev.status == "cancelled":
            u.cancelled += 1
        elif ev.status == "expired":
            u.expired += 1
        else:
            u.errors += 1
            code = str(ev.error_code or "unknown")
            u.by_error[code] = u.by_error.get(code, 0) + 1
        if ev.usage is not None:
            u.prompt_tokens += ev.usage.prompt_tokens
            u.completion_tokens += ev.usage.completion_tokens
            u.cached_tokens += ev.usage.cached_tokens
        if ev.cost is not None:
            u.prefill_s += ev.cost.prefill_s
            u.transfer_s += ev.cost.transfer_s
            u.decode_s += ev.cost.decode_s
            u.saved_s += ev.cost.saved_s
    return [out[k] for k in sorted(out, key=lambda k: (k[0], k[1] or "", k[2] or ""))]


def sum_usage(events: list[RequestFinished]) -> dict[str, TenantUsage]:
    """Per tenant totals (:func:`usage_rows` by tenant, keyed by tenant)."""
    return {u.tenant: u for u in usage_rows(events)}


async def read_usage(nc: NATS, *, since_s: float | None = None, tenant: str | None = None,
                     idle_timeout: float = 2.0) -> list[RequestFinished]:
    """Every RequestFinished kept in SS_USAGE (optionally only the last ``since_s`` seconds, one tenant)."""
    js = nc.jetstream()
    info = await js.stream_info(Subjects.USAGE_STREAM)
    last_seq = int(info.state.last_seq or 0)
    if not info.state.messages:
        return []
    subject = f"ss.evt.finished.{proto.subjects.check_token(tenant, 'tenant')}.>" if tenant else Subjects.FINISHED_ALL
    if since_s is not None:
        start = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=since_s)
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start)
    else:
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    sub = await js.subscribe(subject, stream=Subjects.USAGE_STREAM, ordered_consumer=True, config=cfg)
    events: list[RequestFinished] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=idle_timeout)
            except TimeoutError:
                break  # nothing (more) in the range asked for
            with contextlib.suppress(proto.ProtocolError):
                events.append(proto.decode(msg.data, RequestFinished))
            if msg.metadata.sequence.stream >= last_seq or msg.metadata.num_pending == 0:
                break
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return events
