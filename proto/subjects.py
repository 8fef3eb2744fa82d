"""NATS subject names: the one place that spells them.

Layout (``ss`` is the product prefix; ``{tenant}`` and ``{worker}`` are single tokens without dots):

  ss.req.{tenant}                 client -> router, request/reply: GenerateRequest -> Accepted | ErrorMessage
  ss.stream.{tenant}.{request}    decoder/router -> client: StreamDelta*, then StreamFinal | StreamError
  ss.result.{tenant}.{request}    workers -> async-job owner: the terminal message of a submitted job, kept in
                                  the SS_RESULTS JetStream stream for a TTL (fetched later by id)
  ss.prefill.{worker}.job         router -> prefiller: PrefillJob
  ss.decode.{worker}.job          router -> decoder: DecodeJob (direct path, decoder prefills locally)
  ss.decode.{worker}.reserve      prefiller -> decoder, request/reply: KvReserveRequest -> KvReserveReply
  ss.decode.{worker}.kvready      prefiller -> decoder: PrefillDone (KV landed; carries the decode job)
  ss.decode.{worker}.revoke       router -> decoder, request/reply: RevokeJob -> RevokeReply (the request
                                  moved elsewhere: drop this attempt silently)
  ss.evt.bounced.{tenant}.{req}   prefiller -> routers: JobBounced (the KV hand-off failed; dispatch again)
  ss.hb.{role}.{worker}           every service: Heartbeat
  ss.kv.{worker}                  workers: KvEventBatch (blocks stored/removed/cleared), sequenced
  ss.kv.{worker}.held             index -> worker, request/reply: KvHeldRequest -> KvHeld (resync after a gap)
  ss.evt.finished.{tenant}.{req}  decoder/prefiller/router: RequestFinished (accounting, in-flight tracking);
                                  kept in the SS_USAGE stream (usage metering, "already finished?" lookups)
  ss.q.{tenant}.p{class}          router intake -> router dispatch: QueuedRequest, in the SS_QUEUE work-queue
                                  stream (Nats-Msg-Id = request id); class 0 is served first within a tenant
  ss.routed.{router}              router -> routers: DispatchNote (its dispatches, for their pending-load ledgers)
  ss.fair.{router}                router -> routers: FairShareReport (virtual tokens charged per tenant)
  $KV.SS_REQUESTS.{request}       RequestRecord per request id (create-only at intake, then compare-and-set)
  $KV.SS_QUOTA.{tenant}           TenantUsage per tenant with limits (compare-and-set)
  ss.admin.queues                 operator -> router, request/reply: QueueReportRequest -> QueueReport
  ss.admin.route.explain          operator -> router, request/reply: RouteExplainRequest -> RouteExplainReply
                                  (what each strategy would decide for a prompt now; nothing is dispatched)
  ss.cancel.{tenant}              client/front door -> every worker: CancelRequest
  ss.cache.query                  router -> cache index, request/reply: CacheQuery -> CacheQueryReply
  ss.trace.spans.{service}        every process: SpanBatch (finished trace spans; kept in stream SS_TRACES)

Per-tenant tokens in the request and stream subjects are what lets NATS permissions isolate tenants.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_token(value: str, what: str) -> str:
    """Validate one subject token (tenant, worker or request id): no dots, wildcards or spaces."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must be 1-64 characters of letters, digits, '_' or '-'")
    return value


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
    USAGE_STREAM = "SS_USAGE"  # keeps every RequestFinished (usage metering; "did it finish?" after a restart)

    @staticmethod
    def queue(tenant: str, klass: int) -> str:
        return f"ss.q.{check_token(tenant, 'tenant')}.p{int(klass)}"

    QUEUE_ALL = "ss.q.>"
    QUEUE_STREAM = "SS_QUEUE"  # the durable per-tenant work queue between intake and dispatch
    ADMIN_QUEUES = "ss.admin.queues"
    ADMIN_ROUTE_EXPLAIN = "ss.admin.route.explain"

    @staticmethod
    def routed(router: str) -> str:
        return f"ss.routed.{check_token(router, 'router id')}"

    ROUTED_ALL = "ss.routed.*"

    @staticmethod
    def fair(router: str) -> str:
        return f"ss.fair.{check_token(router, 'router id')}"

    FAIR_ALL = "ss.fair.*"
    REQUESTS_BUCKET = "SS_REQUESTS"  # KV: request id -> RequestRecord (the cluster-wide request registry)
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
