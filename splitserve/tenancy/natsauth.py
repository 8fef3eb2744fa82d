"""NATS authentication and per-tenant permissions for ``splitserve up --tenants FILE``.

The isolation between tenants is enforced by nats-server itself, not by our services: every tenant connects
as its own NATS user whose permissions name only its own subjects, so a tenant that publishes to another
tenant's request subject or subscribes to another tenant's stream is refused by the server.

A tenant ``T`` may

- publish: ``ss.req.T`` (request/reply to a router), ``ss.cancel.T``, and the JetStream *direct get* API
  restricted to its own async results (``$JS.API.DIRECT.GET.SS_RESULTS.ss.result.T.>``: the subject to read is
  part of the request subject, which is what makes it permissionable per tenant);
- subscribe: ``ss.stream.T.>``, ``ss.result.T.>``, ``ss.evt.finished.T[.>]`` and its own reply inbox
  ``_INBOX.T.>`` (clients connect with ``inbox_prefix=_INBOX.T`` so replies to one tenant are invisible to the
  others).

Services (router, prefill, decode, cache index, front door) each authenticate as their role's user
(``svc.<role>``, one generated password per role, shared by the role's workers) and get *least privilege*:
only the subjects, JetStream streams / KV buckets / object store and JetStream API calls that role's code
uses (the tables ``ROUTER`` ... ``FRONTEND`` below, one line and one reason per grant). Only the operator
(``admin``: the supervisor and the CLI's operator commands) may publish and subscribe everything.

Replies. A service's own requests (request/reply, JetStream API calls, PubAcks, pull and push consumers'
deliveries) come back on its role's inbox ``_INBOX.$svc.<role>.>`` (:func:`service_inbox`: services connect
with that ``inbox_prefix``), which no tenant (``_INBOX.T.>``: ``$`` is not allowed in a tenant's name) and no
other role may subscribe to. A role that *answers*
requests (router, decode, prefill, cache index) has ``allow_responses``: nats-server lets it publish one
reply to the reply subject of a request it received, within 2 minutes, and nothing else on ``_INBOX``.

Rights per role (``*`` and ``>`` as in NATS; ``T`` a tenant, ``R`` a request, ``W`` a worker; every role also
publishes its own heartbeats ``ss.hb.<role>.>`` and spans ``ss.trace.spans.<role>``, may look up and create
(not update) SS_TRACES (``$JS.API.STREAM.INFO|CREATE.SS_TRACES``) and subscribes to its own inbox):

========== ==================================================================== ==================================
role       publish                                                              subscribe
========== ==================================================================== ==================================
router     ``ss.prefill.*.job``, ``ss.decode.*.job``, ``ss.decode.*.revoke``    ``ss.req.*``, ``ss.admin.queues``,
           (request), ``ss.stream.*.*``, ``ss.result.*.*``,                     ``ss.admin.route.explain``,
           ``ss.evt.finished.*.*``, ``ss.q.*.*.*``, ``ss.routed.*``,            ``ss.hb.>``, ``ss.evt.finished.>``,
           ``ss.fair.*``, ``ss.kv.*.held`` (request), ``$KV.SS_REQUESTS.>``,    ``ss.evt.bounced.>``, ``ss.kv.*``,
           ``$KV.SS_QUOTA.>``, ``$JS.ACK.SS_QUEUE.>``; API: STREAM.INFO /       ``ss.cancel.*``, ``ss.routed.*``,
           CREATE / UPDATE of SS_RESULTS, SS_QUEUE, SS_USAGE, KV_SS_REQUESTS,    ``ss.fair.*``, ``ss.stream.*.*``
           KV_SS_QUOTA, SS_TRACES; STREAM.MSG.GET of SS_QUEUE, SS_USAGE and the
           KV streams (and DIRECT.GET of the KV streams); every CONSUMER call on
           SS_QUEUE; read only, to warm-start its index replica: STREAM.INFO,
           ordered consumer creation and flow control of SS_KV_EVENTS and
           OBJ_ss-cache-index, STREAM.MSG.GET of OBJ_ss-cache-index;
           allow_responses
decode     ``ss.stream.*.*``, ``ss.result.*.*``, ``ss.evt.finished.*.*``,      ``ss.decode.*.job``,
           ``ss.kv.*``; allow_responses (reserve, revoke, KV resync)            ``ss.decode.*.reserve``,
                                                                                ``ss.decode.*.kvready``,
                                                                                ``ss.decode.*.revoke``,
                                                                                ``ss.cancel.*``, ``ss.kv.*.held``
prefill    ``ss.decode.*.reserve`` (request), ``ss.decode.*.kvready``,           ``ss.prefill.*.job``,
           ``ss.evt.bounced.*.*``, ``ss.stream.*.*``, ``ss.result.*.*``,         ``ss.cancel.*``, ``ss.kv.*.held``
           ``ss.evt.finished.*.*``, ``ss.kv.*``; allow_responses (KV resync)
cache_index ``ss.kv.*.held`` (request), ``$O.ss-cache-index.>``; API: STREAM.INFO  ``ss.hb.>``, ``ss.cache.query``,
           / CREATE / UPDATE of SS_KV_EVENTS and OBJ_ss-cache-index, STREAM.MSG.GET  ``ss.admin.cache.stats``
           and PURGE of OBJ_ss-cache-index, STREAM.NAMES, CONSUMER calls and flow
           control on both; allow_responses (cache queries, cache stats)
frontend   ``ss.req.*`` (request, for the tenant an API key names),              ``ss.stream.*.*``, ``ss.hb.>``,
           ``ss.cancel.*``, ``ss.admin.queues`` / ``ss.admin.route.explain``     ``ss.evt.finished.>``
           (request: the console); API: DIRECT.GET of SS_RESULTS, STREAM.INFO,
           consumer creation and flow control of SS_USAGE and SS_TRACES (the
           console's usage and trace views), STREAM.NAMES
admin      everything (``>``)                                                    everything (``>``)
========== ==================================================================== ==================================

Streams are created and updated only by the role that owns them: the router (SS_RESULTS, SS_QUEUE, SS_USAGE, the
KV buckets SS_REQUESTS and SS_QUOTA), the cache index (SS_KV_EVENTS and its object store). The span stream
SS_TRACES is the exception: every process creates it if it is missing when its tracing starts (whichever pod comes
up first), so every role may *create* it (a create cannot change a stream that exists); only the router may
*update* it. Routers only *read* the cache index's stream and object store (their warm start). Only the operator
asks ``ss.admin.cache.stats``. What no role may do: publish on ``ss.req.T`` except the
front door (a decoder cannot inject requests), write ``$KV.*`` except the router, write the queue ``ss.q.>``
except the router, publish jobs (``ss.*.*.job``) except the router, delete or purge any stream, or read another
role's inbox.

:func:`nats_auth_config` is pure (tenants + secrets -> config text). The helpers below it keep the generated
secrets in files under the stack's state directory (mode 0600), reused across restarts.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.proto.subjects import Subjects, check_token
from splitserve.tenancy.config import TenantsConfig

# Every service role that connects to NATS, plus the operator. Multiple workers of a role share one user.
SERVICE_ROLES: tuple[str, ...] = ("router", "prefill", "decode", "cache_index", "frontend", "admin")
ADMIN_ROLE = "admin"
INBOX_ROOT = "_INBOX"
# Services' reply inboxes: _INBOX.$svc.<role>.> (see service_inbox). Under _INBOX (services answer only replies
# to inboxes: splitserve.runtime.bus.reply_allowed), in a token no tenant can be named ('$' is not allowed in one).
SERVICE_INBOX_ROOT = "_INBOX.$svc"
AUTH_DIR = "auth"
SERVICES_FILE = "services.json"
TENANTS_FILE = "tenants.json"
# Environment variables through which a process is given its NATS credentials (services get them from the
# supervisor, the CLI from the user's shell).
ENV_USER = "SPLITSERVE_NATS_USER"
ENV_PASSWORD = "SPLITSERVE_NATS_PASSWORD"
ENV_NKEY_SEED = "SPLITSERVE_NATS_NKEY_SEED"


def service_user(role: str) -> str:
    """The NATS user of a service role. The dot cannot occur in a tenant name (a subject token), so a tenant
    can never be named like a service user."""
    if role not in SERVICE_ROLES:
        raise ValueError(f"unknown service role {role!r}")
    return f"svc.{role}"


def tenant_inbox(tenant: str) -> str:
    """The reply-inbox prefix of a tenant's connections (nats-py ``connect(inbox_prefix=...)``)."""
    return f"{INBOX_ROOT}.{check_token(tenant, 'tenant')}"


def service_inbox(role: str) -> str:
    """The reply-inbox prefix of a service role's connections (nats-py ``connect(inbox_prefix=...)``): a tenant's
    inbox ``_INBOX.T`` can never name it, whatever the tenant is called (``$`` is not allowed in a tenant name)."""
    service_user(role)  # raises on an unknown role
    return f"{SERVICE_INBOX_ROOT}.{role}"


@dataclass(frozen=True)
class Permissions:
    """What one NATS user may do. ``allow_responses``: it may also publish one reply to the reply subject of a
    request it received (nats-server's ``allow_responses``), for request/reply handlers."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


ALL = Permissions(publish=(">",), subscribe=(">",))

# --------------------------------------------------------------------------------------- service roles
# Stream, bucket and object store names as the services spell them (kept literal here so that this module
# stays importable without the services; tests/tenancy/test_natsauth.py checks they match).
TRACES_STREAM = "SS_TRACES"  # splitserve.obs.tracing.TRACE_STREAM
KV_EVENTS_STREAM = "SS_KV_EVENTS"  # splitserve.services.cache_index.service.STREAM
INDEX_STORE = "ss-cache-index"  # splitserve.services.cache_index.service.BUCKET (its stream: OBJ_ss-cache-index)
_JS = "$JS.API"
_REQUESTS_KV = f"KV_{Subjects.REQUESTS_BUCKET}"
_QUOTA_KV = f"KV_{Subjects.QUOTA_BUCKET}"
_INDEX_OBJ = f"OBJ_{INDEX_STORE}"


def _common(role: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(publish, subscribe) every service role needs."""
    return ((
        f"ss.hb.{role}.>",  # its own heartbeats (a role cannot speak for another role)
        f"ss.trace.spans.{role}",  # its finished trace spans (captured by SS_TRACES)
        # Every process makes sure the span stream exists when its tracing starts (splitserve.obs.tracing.
        # ensure_trace_stream): look it up, create it if missing (an existing stream cannot be changed by a
        # create; only the router may update it).
        f"{_JS}.STREAM.INFO.{TRACES_STREAM}",
        f"{_JS}.STREAM.CREATE.{TRACES_STREAM}",
    ), (
        f"{SERVICE_INBOX_ROOT}.{role}.>",  # replies to its own requests, PubAcks, consumer deliveries
    ))


def _stream_owner(stream: str) -> tuple[str, ...]:
    """Creating a stream at startup and bringing it to the wanted config (splitserve.runtime.jetstream)."""
    return (f"{_JS}.STREAM.INFO.{stream}", f"{_JS}.STREAM.CREATE.{stream}", f"{_JS}.STREAM.UPDATE.{stream}")


def _stored_end_streams() -> tuple[str, ...]:
    """A worker whose stored end hears "no responders" for long asks whether its stream exists at all
    (splitserve.runtime.bus): only the info of those two streams."""
    return (f"{_JS}.STREAM.INFO.{Subjects.RESULTS_STREAM}", f"{_JS}.STREAM.INFO.{Subjects.USAGE_STREAM}")


def _read_only_replay(stream: str) -> tuple[str, ...]:
    """Replaying a stream once with an ordered consumer bound to it by name (no STREAM.NAMES lookup), and
    nothing else: no consumer delete (the ephemeral consumer goes with its interest), no write, purge or delete."""
    return (
        f"{_JS}.STREAM.INFO.{stream}",  # where the replay stops (last sequence)
        f"{_JS}.CONSUMER.CREATE.{stream}",  # the ephemeral ordered consumer
        f"{_JS}.CONSUMER.CREATE.{stream}.>",  # ... with a name and filter subject
        f"$JS.FC.{stream}.>",  # its flow-control replies
    )


def _ordered_reader(stream: str) -> tuple[str, ...]:
    """Reading a stream with nats-py's ordered consumer (an ephemeral push consumer with flow control)."""
    return (
        f"{_JS}.STREAM.INFO.{stream}",  # where to stop reading (last sequence)
        f"{_JS}.CONSUMER.CREATE.{stream}",  # the ephemeral consumer (older servers / nats-py without a name)
        f"{_JS}.CONSUMER.CREATE.{stream}.>",  # ... with a name (and filter subject)
        f"{_JS}.CONSUMER.DELETE.{stream}.*",  # dropped when the reader is done
        f"$JS.FC.{stream}.>",  # flow-control replies to the server
    )


ROUTER = Permissions(
    publish=(
        *_common("router")[0],
        "ss.prefill.*.job",  # dispatch: a prefill job to the chosen prefiller
        "ss.decode.*.job",  # dispatch: a decode job to the chosen decoder (direct path)
        "ss.decode.*.revoke",  # request: take back a job that moved to another decoder
        "ss.stream.*.*",  # a request the router ends itself (refused, expired, already finished, cancelled queued)
        "ss.result.*.*",  # ... and the stored copy of that end (SS_RESULTS)
        "ss.evt.finished.*.*",  # ... and its RequestFinished (SS_USAGE)
        "ss.q.*.*.*",  # intake: accepted requests into the work queue SS_QUEUE (tenant, model pool, class)
        "ss.routed.*",  # its dispatch notes for the other routers' pending-load ledgers
        "ss.fair.*",  # its fair-share reports for the other routers
        "ss.kv.*.held",  # request: a worker's held KV blocks (the in-process index resyncs after a gap)
        f"$KV.{Subjects.REQUESTS_BUCKET}.>",  # the request registry: create / compare-and-set / delete
        f"$KV.{Subjects.QUOTA_BUCKET}.>",  # global quotas: compare-and-set per tenant
        f"$JS.ACK.{Subjects.QUEUE_STREAM}.>",  # ack / term / in-progress of queue messages (several per message)
        *_stream_owner(Subjects.RESULTS_STREAM),  # creates SS_RESULTS (async results, direct get on)
        *_stream_owner(Subjects.QUEUE_STREAM),  # creates SS_QUEUE (the work queue)
        *_stream_owner(Subjects.USAGE_STREAM),  # creates SS_USAGE (every RequestFinished)
        *_stream_owner(_REQUESTS_KV),  # creates the SS_REQUESTS bucket (ensure_bucket: info, create, scale up)
        *_stream_owner(_QUOTA_KV),  # creates the SS_QUOTA bucket
        *_stream_owner(TRACES_STREAM),  # brings SS_TRACES to the wanted config (scales it up on a cluster)
        f"{_JS}.STREAM.MSG.GET.{Subjects.QUEUE_STREAM}",  # the oldest waiting request of a lane (its wait)
        f"{_JS}.STREAM.MSG.GET.{Subjects.USAGE_STREAM}",  # "did this request already finish?"
        f"{_JS}.STREAM.MSG.GET.{_REQUESTS_KV}",  # KV get (buckets without direct get)
        f"{_JS}.STREAM.MSG.GET.{_QUOTA_KV}",  # KV get
        f"{_JS}.DIRECT.GET.{_REQUESTS_KV}.>",  # KV get (buckets with direct get)
        f"{_JS}.DIRECT.GET.{_QUOTA_KV}.>",  # KV get
        f"{_JS}.CONSUMER.*.{Subjects.QUEUE_STREAM}.>",  # the lanes: create, info, delete
        f"{_JS}.CONSUMER.MSG.NEXT.{Subjects.QUEUE_STREAM}.*",  # fetch from a lane (pull)
        f"{_JS}.CONSUMER.DURABLE.CREATE.{Subjects.QUEUE_STREAM}.*",  # lanes, by the legacy durable API
        # Warm start of its index replica (splitserve.cache.warmstart), read only: the cache index's snapshot
        # (object info by message get, chunks by an ordered consumer) and a replay of SS_KV_EVENTS after it.
        *_read_only_replay(_INDEX_OBJ),
        f"{_JS}.STREAM.MSG.GET.{_INDEX_OBJ}",  # the snapshot object's metadata
        *_read_only_replay(KV_EVENTS_STREAM),
    ),
    subscribe=(
        *_common("router")[1],
        Subjects.REQUEST_ALL,  # intake: every tenant's requests (queue group "routers")
        Subjects.ADMIN_QUEUES,  # the operator's / console's queue report
        Subjects.ADMIN_ROUTE_EXPLAIN,  # the operator's / console's route explorer
        Subjects.HEARTBEAT_ALL,  # the worker registry
        Subjects.FINISHED_ALL,  # request ends: free slots, settle records and quotas
        Subjects.BOUNCED_ALL,  # failed KV hand-offs: dispatch again
        Subjects.KV_EVENTS_ALL,  # its in-process prefix index
        Subjects.CANCEL_ALL,  # cancel queued requests
        Subjects.ROUTED_ALL,  # the other routers' dispatches
        Subjects.FAIR_ALL,  # the other routers' fair-share reports
        "ss.stream.*.*",  # follows a running stream: what a migration resumes from
    ),
    allow_responses=True,  # answers ss.req.T (Accepted / error) and ss.admin.* (reports)
)

DECODE = Permissions(
    publish=(
        *_common("decode")[0],
        "ss.stream.*.*",  # the tokens of the requests it decodes (deltas, final, error)
        "ss.result.*.*",  # the stored end of a request (JetStream publish into SS_RESULTS)
        "ss.evt.finished.*.*",  # RequestFinished (JetStream publish into SS_USAGE)
        *_stored_end_streams(),  # is a stored end's stream there (no leader) or not at all?
        "ss.kv.*",  # its KV cache events (blocks stored / removed) for the indexes
    ),
    subscribe=(
        *_common("decode")[1],
        "ss.decode.*.job",  # jobs routed to it (its own worker id: ids are not known in advance)
        "ss.decode.*.reserve",  # a prefiller reserving KV blocks (request)
        "ss.decode.*.kvready",  # a prefiller's KV landed: decode
        "ss.decode.*.revoke",  # the router takes a job back (request)
        Subjects.CANCEL_ALL,  # cancels of any tenant's requests (checked against the subject's tenant)
        "ss.kv.*.held",  # an index resyncing its view of this worker (request)
        Subjects.ADMIN_LORA,  # the operator loads / unloads a LoRA adapter (request)
    ),
    allow_responses=True,  # answers reserve, revoke, held and LoRA admin requests
)

PREFILL = Permissions(
    publish=(
        *_common("prefill")[0],
        "ss.decode.*.reserve",  # request: reserve KV blocks at the chosen decoder
        "ss.decode.*.kvready",  # the KV landed at the decoder: its decode job
        "ss.evt.bounced.*.*",  # the KV hand-off failed: routers dispatch the request again
        "ss.stream.*.*",  # a request it ends itself (prefill-only request, an error)
        "ss.result.*.*",  # ... its stored copy
        "ss.evt.finished.*.*",  # ... its RequestFinished
        *_stored_end_streams(),  # is a stored end's stream there (no leader) or not at all?
        "ss.kv.*",  # its KV cache events for the indexes
    ),
    subscribe=(
        *_common("prefill")[1],
        "ss.prefill.*.job",  # jobs routed to it
        Subjects.CANCEL_ALL,  # cancels
        "ss.kv.*.held",  # an index resyncing its view of this worker (request)
        Subjects.ADMIN_LORA,  # the operator loads / unloads a LoRA adapter (request)
    ),
    allow_responses=True,  # answers held and LoRA admin requests
)

CACHE_INDEX = Permissions(
    publish=(
        *_common("cache_index")[0],
        "ss.kv.*.held",  # request: a worker's held KV blocks (resync after a gap in its events)
        *_stream_owner(KV_EVENTS_STREAM),  # creates SS_KV_EVENTS (the workers' KV events, replayed at start)
        *_ordered_reader(KV_EVENTS_STREAM),  # replays and follows it
        f"{_JS}.STREAM.NAMES",  # nats-py looks up the stream of the subject it subscribes to
        *_stream_owner(_INDEX_OBJ),  # creates its snapshot object store
        f"{_JS}.STREAM.MSG.GET.{_INDEX_OBJ}",  # object metadata
        f"{_JS}.DIRECT.GET.{_INDEX_OBJ}.>",  # ... by direct get where the store allows it
        f"{_JS}.STREAM.PURGE.{_INDEX_OBJ}",  # a new snapshot replaces the old one's chunks
        *_ordered_reader(_INDEX_OBJ),  # reads the snapshot back at start
        f"$O.{INDEX_STORE}.>",  # writes snapshots (chunks and metadata)
    ),
    subscribe=(
        *_common("cache_index")[1],
        Subjects.HEARTBEAT_ALL,  # drops the blocks of workers that died
        Subjects.CACHE_QUERY,  # prefix queries (request, queue group)
        Subjects.ADMIN_CACHE_STATS,  # the operator's `splitserve cache stats` (request, queue group)
    ),
    allow_responses=True,  # answers cache queries and the operator's cache stats
)

FRONTEND = Permissions(
    publish=(
        *_common("frontend")[0],
        Subjects.REQUEST_ALL,  # request: a tenant's request, for the tenant its API key names
        Subjects.CANCEL_ALL,  # the HTTP caller went away: cancel its request
        f"{_JS}.DIRECT.GET.{Subjects.RESULTS_STREAM}.>",  # a stream's stored end (recovery after a gap)
        Subjects.ADMIN_QUEUES,  # request: the console's tenants view
        Subjects.ADMIN_ROUTE_EXPLAIN,  # request: the console's routing explorer
        Subjects.ADMIN_LORA,  # request: an operator's runtime LoRA load / unload (admin key)
        *_ordered_reader(Subjects.USAGE_STREAM),  # the console's usage view (reads SS_USAGE)
        *_ordered_reader(TRACES_STREAM),  # the console's request traces (reads SS_TRACES)
        f"{_JS}.STREAM.NAMES",  # nats-py looks up the stream of the subject it reads
    ),
    subscribe=(
        *_common("frontend")[1],
        "ss.stream.*.*",  # the streams of the requests it relays
        Subjects.HEARTBEAT_ALL,  # readiness, model name, /metrics, the console
        Subjects.FINISHED_ALL,  # /metrics and the console (per-tenant figures)
    ),
)

SERVICE_PERMISSIONS: dict[str, Permissions] = {
    "router": ROUTER, "decode": DECODE, "prefill": PREFILL, "cache_index": CACHE_INDEX, "frontend": FRONTEND,
    ADMIN_ROLE: ALL,  # the supervisor and the operator's CLI: everything
}


def service_permissions(role: str) -> Permissions:
    """The permissions of a service role's NATS user."""
    service_user(role)  # raises on an unknown role
    return SERVICE_PERMISSIONS[role]


def tenant_permissions(tenant: str) -> Permissions:
    check_token(tenant, "tenant")
    return Permissions(
        publish=(
            Subjects.request(tenant),
            Subjects.cancel(tenant),
            f"$JS.API.DIRECT.GET.{Subjects.RESULTS_STREAM}.ss.result.{tenant}.>",
        ),
        subscribe=(
            f"ss.stream.{tenant}.>",
            f"ss.result.{tenant}.>",
            # Both layouts: ``ss.evt.finished.T`` and the per-request ``ss.evt.finished.T.{request}``.
            f"ss.evt.finished.{tenant}",
            f"ss.evt.finished.{tenant}.>",
            f"{tenant_inbox(tenant)}.>",
        ),
    )


def _quote(value: str, what: str) -> str:
    """A double-quoted nats-server config string. JSON escaping is what its lexer understands; control
    characters are refused rather than trusted to the parser, and a leading ``$2`` would make the server read
    the password as a bcrypt hash."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ValueError(f"{what} contains control characters")
    if what.endswith("password") and value.startswith("$2"):
        raise ValueError(f"{what} must not start with '$2' (nats-server would read it as a bcrypt hash)")
    return json.dumps(value, ensure_ascii=False)


def _perms(p: Permissions) -> str:
    pub = ", ".join(_quote(s, "subject") for s in dict.fromkeys(p.publish))  # once each, in order
    sub = ", ".join(_quote(s, "subject") for s in dict.fromkeys(p.subscribe))
    responses = ", allow_responses: true" if p.allow_responses else ""
    return f"permissions: {{ publish: {{ allow: [{pub}] }}, subscribe: {{ allow: [{sub}] }}{responses} }}"


def nats_auth_config(tenants: TenantsConfig, service_secrets: Mapping[str, str],
                     tenant_passwords: Mapping[str, str] | None = None) -> str:
    """The ``authorization { users = [...] }`` block of nats-server's config.

    ``service_secrets``: role -> password for every role in :data:`SERVICE_ROLES`. ``tenant_passwords``:
    passwords for the tenants whose spec sets neither ``password`` nor ``nkey`` (generated by the caller).
    """
    tenant_passwords = tenant_passwords or {}
    if tenants.open:
        raise ValueError("open mode has no tenant users: start without a tenants file instead")
    lines = ["authorization {", "  users = ["]
    for role in SERVICE_ROLES:
        pw = service_secrets.get(role)
        if not pw:
            raise ValueError(f"no secret for service role {role!r}")
        lines.append(f"    {{ user: {_quote(service_user(role), 'user')}, password: "
                     f"{_quote(pw, f'{role} password')}, {_perms(service_permissions(role))} }}")
    for name, spec in sorted(tenants.tenants.items()):
        perms = _perms(tenant_permissions(name))
        if spec.nkey:
            # An nkey user is known by its public key alone; its name is the tenant the client says it is,
            # and the permissions stop it from using any other tenant's subjects.
            lines.append(f"    {{ nkey: {_quote(spec.nkey, 'nkey')}, {perms} }}")
            continue
        pw = spec.password or tenant_passwords.get(name)
        if not pw:
            raise ValueError(f"tenant {name!r} has no password or nkey (and none was generated)")
        lines.append(f"    {{ user: {_quote(name, 'user')}, password: {_quote(pw, f'tenant {name} password')}, "
                     f"{perms} }}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- secret files


@dataclass
class StackAuth:
    """What ``splitserve up --tenants`` needs: the server's auth block and every service's credentials."""

    config: str
    service_secrets: dict[str, str]
    generated_tenants: dict[str, str] = field(default_factory=dict)  # tenant -> generated password
    auth_dir: Path | None = None

    def credentials(self, role: str) -> tuple[str, str]:
        return service_user(role), self.service_secrets[role]


def write_private(path: Path, text: str) -> None:
    """Write a file readable by its owner only: created 0600 (never briefly world-readable), in a 0700
    directory, replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def _write_secret_json(path: Path, data: Mapping[str, str]) -> None:
    write_private(path, json.dumps(dict(data), indent=2))


def _read_secret_json(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _new_secret() -> str:
    return secrets.token_urlsafe(24)


def prepare_stack_auth(state_dir: Path, tenants: TenantsConfig) -> StackAuth:
    """Load (or create) the service secrets and the generated tenant passwords under ``state_dir/auth`` and
    build the server's auth block. Secrets are reused across restarts so running clients keep working."""
    auth_dir = state_dir / AUTH_DIR
    svc_path, ten_path = auth_dir / SERVICES_FILE, auth_dir / TENANTS_FILE
    svc = _read_secret_json(svc_path)
    if any(not svc.get(r) for r in SERVICE_ROLES):
        svc = {r: svc.get(r) or _new_secret() for r in SERVICE_ROLES}
        _write_secret_json(svc_path, svc)
    old = _read_secret_json(ten_path)
    generated = {name: old.get(name) or _new_secret() for name, spec in tenants.tenants.items()
                 if not spec.password and not spec.nkey}
    if generated != old:
        if generated:
            _write_secret_json(ten_path, generated)
        else:
            ten_path.unlink(missing_ok=True)
    return StackAuth(config=nats_auth_config(tenants, svc, generated), service_secrets=svc,
                     generated_tenants=generated, auth_dir=auth_dir)


def read_admin_credentials(state_dir: Path) -> tuple[str, str] | None:
    """The operator's credentials of the stack whose state directory this is (None if it runs without auth
    or the file is not readable by this user)."""
    pw = _read_secret_json(state_dir / AUTH_DIR / SERVICES_FILE).get(ADMIN_ROLE)
    return (service_user(ADMIN_ROLE), pw) if pw else None
