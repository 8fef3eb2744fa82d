"""NATS subject names: the one place that spells them.

Layout (``ss`` is the product prefix; ``{tenant}`` and ``{worker}`` are single tokens without dots):

  ss.req.{tenant}                 client -> router, request/reply: GenerateRequest -> Accepted | ErrorMessage
  ss.stream.{tenant}.{request}    decoder/router -> client: StreamDelta*, then StreamFinal | StreamError
  ss.result.{tenant}.{request}    workers -> async-job owner: the terminal message of a submitted job, kept in
                                  the SS_RESULTS JetStream stream for a TTL (fetched later by id)
  ss.prefill.{worker}.job         router -> prefiller: PrefillJob
  ss.decode.{worker}.job          router -> decoder: DecodeJob (direct path, decoder prefills locally)
  ss.decode.{worker}.reserve      prefiller -> decoder, request/reply: KvReserveRequest -> KvReserveReply
  ss.decode.{worker}.kvready      prefiller -> decoder, request/reply: PrefillDone -> PrefillDoneAck (KV landed;
                                  carries the decode job; sent again while unanswered, taken once per transfer)
  ss.decode.{worker}.revoke       router -> decoder, request/reply: RevokeJob -> RevokeReply (the request
                                  moved elsewhere: drop this attempt silently)
  ss.evt.bounced.{tenant}.{req}   prefiller -> routers: JobBounced (the KV hand-off failed; dispatch again)
  ss.hb.{role}.{worker}           every service: Heartbeat
  ss.kv.{worker}                  workers: KvEventBatch (blocks stored/removed/cleared), sequenced
  ss.kv.{worker}.held             index -> worker, request/reply: KvHeldRequest -> KvHeld (resync after a gap)
  ss.evt.finished.{tenant}.{req}  decoder/prefiller/router: RequestFinished (accounting, in-flight tracking);
                                  kept in the SS_USAGE stream (usage metering, "already finished?" lookups)
  ss.q.{tenant}.{pool}.p{class}   router intake -> router dispatch: QueuedRequest, in the SS_QUEUE work-queue
                                  stream (Nats-Msg-Id = tenant.request); class 0 is served first within a tenant;
                                  {pool} is the model's token (``model_pool``): dispatch drains a model's lanes
                                  only while that model's decoders have free slots
  ss.routed.{router}              router -> routers: DispatchNote (its dispatches, for their pending-load ledgers)
  ss.fair.{router}                router -> routers: FairShareReport (virtual tokens charged per tenant)
  $KV.SS_REQUESTS.{tenant}.{req}  RequestRecord per request (create-only at intake, then compare-and-set)
  $KV.SS_QUOTA.{tenant}           TenantUsage per tenant with limits (compare-and-set)
  ss.admin.queues                 operator -> router, request/reply: QueueReportRequest -> QueueReport
  ss.admin.route.explain          operator -> router, request/reply: RouteExplainRequest -> RouteExplainReply
                                  (what each strategy would decide for a prompt now; nothing is dispatched)
  ss.admin.cache.stats            operator -> cache index, request/reply: CacheStatsRequest -> CacheStatsReply
                                  (blocks per worker and tier, stream position)
  ss.admin.lora                   operator/front door -> every worker, request/reply: LoraAdminRequest ->
                                  LoraAdminReply from each worker of the model (load or unload an adapter)
  ss.cancel.{tenant}              client/front door -> every worker: CancelRequest
  ss.cache.query                  router -> cache index, request/reply: CacheQuery -> CacheQueryReply
  ss.trace.spans.{service}        every process: SpanBatch (finished trace spans; kept in stream SS_TRACES)

Per-tenant tokens in the request and stream subjects are what lets NATS permissions isolate tenants.
"""

from __future__ import annotations

import hashlib
import re

from splitserve.proto.quoting import quoted

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_token(value: str, what: str) -> str:
    """Validate one subject token (tenant, worker or request id): no dots, wildcards or spaces."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {quoted(value)} must be 1-64 characters of letters, digits, '_' or '-'")
    return value


# Where the tenant (and the request id) stand in every tenant-scoped subject. These are the tokens nats-server's
# per-tenant permissions bind to a tenant's credentials, so they are the only trustworthy statement of who sent
# a message: a body's ``tenant`` field is whatever the sender wrote.
_SCOPED: dict[tuple[str, ...], tuple[int, int | None, int]] = {  # prefix -> (tenant pos, request pos, length)
    ("ss", "req"): (2, None, 3),
    ("ss", "cancel"): (2, None, 3),
    ("ss", "stream"): (2, 3, 4),
    ("ss", "result"): (2, 3, 4),
    ("ss", "q"): (2, None, 5),
    ("ss", "evt", "finished"): (3, 4, 5),
    ("ss", "evt", "bounced"): (3, 4, 5),
}


def subject_identity(subject: str) -> tuple[str, str | None]:
    """The (tenant, request id or None) a tenant-scoped subject names, e.g. ``ss.req.T`` -> ``("T", None)``,
    ``ss.evt.finished.T.R`` -> ``("T", "R")``. ValueError for a subject that names no tenant."""
    parts = subject.split(".")
    for prefix, (t_pos, r_pos, length) in _SCOPED.items():
        if len(parts) == length and tuple(parts[: len(prefix)]) == prefix:
            tenant = check_token(parts[t_pos], "tenant")
            return tenant, (check_token(parts[r_pos], "request id") if r_pos is not None else None)
    raise ValueError(f"subject {quoted(subject)} names no tenant")


def model_pool(model: str) -> str:
    """The subject token of a served model's pool (its queue lanes): the name's subject-safe characters (at most
    40), then 8 hex digits of its SHA-256, so names differing only in characters a token cannot hold (``/``,
    ``.``) still get lanes of their own. Deterministic: every router and `splitserve k8s lanes` agree."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", model)[:40] or "model"
    return f"{safe}-{hashlib.sha256(model.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"


SINGLE_POOL = "default"  # the one pool of a router that serves one model (whatever its files are named)


def model_pools(models: list[str]) -> list[str]:
    """The queue pool token of each served model, in order: a router serving one model has one pool,
    ``default`` (its lanes do not change when the model's files are renamed or replaced); several models have
    one pool each, ``model_pool(name)``."""
    if len(models) <= 1:
        return [SINGLE_POOL] * len(models)
    return [model_pool(m) for m in models]


def request_key(tenant: str, request_id: str) -> str:
    """One string naming a request across tenants (``tenant.request``: neither token holds a dot), for the maps
    a service keys by request: a request id alone is only unique within its tenant."""
    return f"{tenant}.{request_id}"


def reply_subjects(tenant: str, request_id: str) -> tuple[str, str]:
    """The only subjects a request's stream may be delivered on: its live stream and its stored result. A
    message naming any other subject is refused when it is decoded (services never publish where a body says)."""
    return Subjects.stream(tenant, request_id), Subjects.result(tenant, request_id)


class Subjects:
    PREFIX = "ss"
    ROUTER_QUEUE = "routers"

    @staticmethod
    def request(tenant: str) -> str:
        return f"ss.req.{check_token(tenant, 'tenant')}"

    REQUEST_ALL = "ss.req.*"

    @staticmethod
    def stream(tenant: str, request_id: str) -> str:
        return f"ss.stream.{check_token(tenant, 'tenant')}.{check_token(request_id, 'request id')}"

    @staticmethod
    def result(tenant: str, request_id: str) -> str:
        return f"ss.result.{check_token(tenant, 'tenant')}.{check_token(request_id, 'request id')}"

    RESULTS_ALL = "ss.result.>"
    RESULTS_STREAM = "SS_RESULTS"  # JetStream stream keeping async jobs' terminal messages for a TTL

    @staticmethod
    def prefill_job(worker: str) -> str:
        return f"ss.prefill.{check_token(worker, 'worker id')}.job"

    @staticmethod
    def decode_job(worker: str) -> str:
        return f"ss.decode.{check_token(worker, 'worker id')}.job"

    @staticmethod
    def kv_reserve(worker: str) -> str:
        return f"ss.decode.{check_token(worker, 'worker id')}.reserve"

    @staticmethod
    def kv_ready(worker: str) -> str:
        return f"ss.decode.{check_token(worker, 'worker id')}.kvready"

    @staticmethod
    def revoke(worker: str) -> str:
        return f"ss.decode.{check_token(worker, 'worker id')}.revoke"

    @staticmethod
    def bounced(tenant: str, request_id: str) -> str:
        return f"ss.evt.bounced.{check_token(tenant, 'tenant')}.{check_token(request_id, 'request id')}"

    BOUNCED_ALL = "ss.evt.bounced.>"

    @staticmethod
    def heartbeat(role: str, worker: str) -> str:
        return f"ss.hb.{check_token(role, 'role')}.{check_token(worker, 'worker id')}"

    HEARTBEAT_ALL = "ss.hb.>"

    @staticmethod
    def kv_events(worker: str) -> str:
        return f"ss.kv.{check_token(worker, 'worker id')}"

    KV_EVENTS_ALL = "ss.kv.*"

    @staticmethod
    def kv_held(worker: str) -> str:
        return f"ss.kv.{check_token(worker, 'worker id')}.held"

    @staticmethod
    def finished(tenant: str, request_id: str) -> str:
        return f"ss.evt.finished.{check_token(tenant, 'tenant')}.{check_token(request_id, 'request id')}"

    FINISHED_ALL = "ss.evt.finished.>"
    # the front doors' queue group on FINISHED_ALL for the metrics they count (each request by one front door)
    FINISHED_COUNTERS_QUEUE = "frontend-metrics"
    USAGE_STREAM = "SS_USAGE"  # keeps every RequestFinished (usage metering; "did it finish?" after a restart)

    @staticmethod
    def queue(tenant: str, klass: int, pool: str) -> str:
        return f"ss.q.{check_token(tenant, 'tenant')}.{check_token(pool, 'model pool')}.p{int(klass)}"

    # A tenant's queue has one lane per priority class, each drained through one durable consumer that every
    # router shares; `splitserve k8s lanes` makes them ahead of the routers and KEDA's scaler reads them by name.
    QUEUE_CLASSES = 3  # priority 0-3 -> p0, 4-7 -> p1, 8-9 -> p2

    @staticmethod
    def priority_class(priority: int) -> int:
        return min(Subjects.QUEUE_CLASSES - 1, max(0, priority) // 4)

    @staticmethod
    def queue_consumer(tenant: str, klass: int, pool: str) -> str:
        return f"dispatch_{check_token(tenant, 'tenant')}_{check_token(pool, 'model pool')}_p{int(klass)}"

    QUEUE_ALL = "ss.q.>"
    SINGLE_POOL = SINGLE_POOL
    QUEUE_STREAM = "SS_QUEUE"  # the durable per-tenant work queue between intake and dispatch
    ADMIN_QUEUES = "ss.admin.queues"
    ADMIN_ROUTE_EXPLAIN = "ss.admin.route.explain"
    ADMIN_CACHE_STATS = "ss.admin.cache.stats"  # operator -> cache index: CacheStatsRequest -> CacheStatsReply
    ADMIN_LORA = "ss.admin.lora"  # operator -> every worker: LoraAdminRequest -> LoraAdminReply (one per worker)

    @staticmethod
    def routed(router: str) -> str:
        return f"ss.routed.{check_token(router, 'router id')}"

    ROUTED_ALL = "ss.routed.*"

    @staticmethod
    def fair(router: str) -> str:
        return f"ss.fair.{check_token(router, 'router id')}"

    FAIR_ALL = "ss.fair.*"
    REQUESTS_BUCKET = "SS_REQUESTS"  # KV: tenant.request -> RequestRecord (the cluster-wide request registry)
    QUOTA_BUCKET = "SS_QUOTA"  # KV: tenant -> TenantUsage (global quotas)

    @staticmethod
    def cancel(tenant: str) -> str:
        return f"ss.cancel.{check_token(tenant, 'tenant')}"

    CANCEL_ALL = "ss.cancel.*"
    CACHE_QUERY = "ss.cache.query"

    @staticmethod
    def trace_spans(service: str) -> str:
        return f"ss.trace.spans.{check_token(service, 'service')}"

    TRACE_SPANS_ALL = "ss.trace.spans.>"
