"""Least privilege per service role, enforced by nats-server itself.

A real nats-server runs the auth config ``splitserve up --tenants`` generates
(:func:`splitserve.tenancy.natsauth.nats_auth_config`). Each test connects as one service role, with the inbox
prefix the services use, and shows the server REFUSING what that role must never do (a decoder injecting a
request or writing a quota, a prefiller writing the request registry, the front door writing the queue, the
cache index dispatching jobs, ...) while letting through what the role's code does. A refusal is the server's
``Permissions Violation`` error on the connection; an allowed operation is one that completes with none.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.js.api import KeyValueConfig, ObjectStoreConfig, StreamConfig

from splitserve import proto
from splitserve.natsserver import NatsServer, start_nats
from splitserve.ops import read_usage
from splitserve.proto import Accepted, Subjects
from splitserve.runtime.jetstream import ensure_bucket, ensure_stream
from splitserve.tenancy.config import TenantsConfig
from splitserve.tenancy.natsauth import (
    INDEX_STORE,
    KV_EVENTS_STREAM,
    SERVICE_ROLES,
    TRACES_STREAM,
    nats_auth_config,
    service_inbox,
    service_user,
    tenant_inbox,
)

PW_A = "password-of-tenant-a"
SECRETS = {r: f"service-secret-{r}" for r in SERVICE_ROLES}


class Conn:
    """A raw nats-py connection as one user that records what the server refuses."""

    def __init__(self, nc: NATS, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors

    async def refused(self, verb: str, subject: str) -> bool:
        """Whether the server reported a permissions violation for ``subject`` (``verb``: publish or
        subscription). nats-py lower-cases the server's error text."""
        want = f'permissions violation for {verb} to "{subject}"'.lower()
        for _ in range(50):
            await self.nc.flush()
            if any(want in e.lower() for e in self.errors):
                return True
            await asyncio.sleep(0.02)
        return False

    async def publish_refused(self, subject: str) -> bool:
        await self.nc.publish(subject, b"{}")
        return await self.refused("publish", subject)

    async def subscribe_refused(self, subject: str) -> bool:
        await self.nc.subscribe(subject)
        return await self.refused("subscription", subject)

    async def clean(self) -> bool:
        """No refusal so far."""
        await self.nc.flush()
        await asyncio.sleep(0.05)
        return not any("permissions violation" in e.lower() for e in self.errors)


async def connect(srv: NatsServer, role: str | None = None, *, tenant: str | None = None) -> Conn:
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    if role is not None:
        nc = await nats.connect(srv.url, user=service_user(role), password=SECRETS[role],
                                inbox_prefix=service_inbox(role), error_cb=on_error, max_reconnect_attempts=0)
    else:
        assert tenant is not None
        nc = await nats.connect(srv.url, user=tenant, password=PW_A, inbox_prefix=tenant_inbox(tenant),
                                error_cb=on_error, max_reconnect_attempts=0)
    return Conn(nc, errors)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    tmp = tmp_path_factory.mktemp("role-rights")
    conf = nats_auth_config(TenantsConfig.model_validate({"tenants": {"A": {"password": PW_A}, "B": {}}}), SECRETS,
                            {"B": "password-of-tenant-b"})
    srv = start_nats(tmp / "nats", extra_config=conf, log_file=tmp / "nats.log")
    yield srv
    srv.stop()


@pytest.fixture
async def admin(server: NatsServer) -> AsyncIterator[NATS]:
    """The operator (everything allowed): makes the streams the routers would, and plays the other side."""
    nc = await nats.connect(server.url, user=service_user("admin"), password=SECRETS["admin"])
    js = nc.jetstream()
    await ensure_stream(js, StreamConfig(name=Subjects.RESULTS_STREAM, subjects=[Subjects.RESULTS_ALL],
                                         allow_direct=True), 1)
    await ensure_stream(js, StreamConfig(name=Subjects.USAGE_STREAM, subjects=[Subjects.FINISHED_ALL]), 1)
    await ensure_stream(js, StreamConfig(name=TRACES_STREAM, subjects=[Subjects.TRACE_SPANS_ALL]), 1)
    yield nc
    await nc.close()


@pytest.fixture
async def conns() -> AsyncIterator[list[Conn]]:
    made: list[Conn] = []
    yield made
    for c in made:
        await c.nc.close()


async def _request(c: Conn, subject: str, data: bytes) -> Msg:
    """A request that a just-made subscription answers. CI once saw "no responders" right after the responder's
    subscription was flushed, on a loaded machine (never locally): ask again a few times, so only a refusal
    that persists (a missing right) fails the test."""
    for _ in range(4):
        try:
            return await c.nc.request(subject, data, timeout=5)
        except NoRespondersError:
            await asyncio.sleep(0.25)
    return await c.nc.request(subject, data, timeout=5)


async def _as(server: NatsServer, conns: list[Conn], role: str | None = None, **kw: str) -> Conn:
    c = await connect(server, role, **kw)
    conns.append(c)
    return c


# ------------------------------------------------------------------------------------------------- decode


async def test_decode_cannot_inject_requests_write_quotas_or_the_queue(server: NatsServer, admin: NATS,
                                                                       conns: list[Conn]) -> None:
    dec = await _as(server, conns, "decode")
    for subject in ("ss.req.A", "$KV.SS_QUOTA.A", "$KV.SS_REQUESTS.r1", "ss.q.A.m-1.p0", "ss.prefill.p0.job",
                    "ss.decode.d1.job", "ss.hb.router.router-0", "ss.trace.spans.router", "ss.admin.queues",
                    "ss.admin.lora",
                    "ss.routed.router-0", "ss.evt.bounced.A.r1", "ss.cancel.A",
                    "$JS.API.STREAM.CREATE.SS_RESULTS", "$JS.API.STREAM.DELETE.SS_USAGE",
                    f"$JS.API.STREAM.UPDATE.{TRACES_STREAM}",  # it may create the span stream, never change it
                    "$JS.API.STREAM.PURGE.SS_RESULTS", "$JS.API.DIRECT.GET.SS_RESULTS.ss.result.A.r1",
                    "$JS.API.CONSUMER.CREATE.SS_USAGE", "_INBOX.A.x.y"):
        assert await dec.publish_refused(subject), subject
    # Nobody else's requests, streams or replies: not the intake, a tenant's inbox, nor another role's inbox.
    for subject in ("ss.req.*", "ss.stream.A.>", "ss.result.>", "_INBOX.A.>", "_INBOX.>",
                    f"{service_inbox('router')}.>", "ss.hb.>", "ss.admin.queues", ">"):
        assert await dec.subscribe_refused(subject), subject


async def test_decode_does_its_job(server: NatsServer, admin: NATS, conns: list[Conn]) -> None:
    dec = await _as(server, conns, "decode")
    pre = await _as(server, conns, "prefill")

    async def reserve(msg: Msg) -> None:
        await msg.respond(b"reserved")  # one reply to the request's inbox (allow_responses)

    await dec.nc.subscribe("ss.decode.decode-0.reserve", cb=reserve)
    for subject in ("ss.decode.decode-0.job", "ss.decode.decode-0.kvready", "ss.decode.decode-0.revoke",
                    "ss.cancel.*", "ss.kv.decode-0.held"):
        await dec.nc.subscribe(subject)
    await dec.nc.flush()
    assert await dec.clean(), dec.errors  # every subscription of the decoder's was allowed
    assert (await _request(pre, "ss.decode.decode-0.reserve", b"{}")).data == b"reserved"
    await dec.nc.publish("ss.stream.A.r1", b"delta")
    await dec.nc.publish("ss.kv.decode-0", b"events")
    await dec.nc.publish("ss.hb.decode.decode-0", b"hb")
    # A request's stored end: a JetStream publish, its PubAck back on the decoder's own inbox.
    ack = await dec.nc.jetstream().publish("ss.result.A.r1", b"final")
    assert ack.stream == Subjects.RESULTS_STREAM
    assert (await dec.nc.jetstream().publish("ss.evt.finished.A.r1", b"done")).stream == Subjects.USAGE_STREAM
    assert (await dec.nc.jetstream().stream_info(TRACES_STREAM)).config.name == TRACES_STREAM
    # Is a stored end's stream there at all (a long "no responders" is an election, or no stream)?
    for stream in (Subjects.RESULTS_STREAM, Subjects.USAGE_STREAM):
        assert (await dec.nc.jetstream().stream_info(stream)).config.name == stream
    assert await dec.clean(), dec.errors
    assert await pre.clean(), pre.errors


async def test_a_responder_answers_only_the_request_it_got(server: NatsServer, admin: NATS,
                                                           conns: list[Conn]) -> None:
    """``allow_responses`` is one reply to a received request's reply subject, not a right to publish into
    inboxes: a decoder cannot send an unsolicited "reply" to a prefiller's or a tenant's inbox."""
    dec = await _as(server, conns, "decode")
    assert await dec.publish_refused(f"{service_inbox('prefill')}.x.y")
    assert await dec.publish_refused("_INBOX.B.x.y")


# ------------------------------------------------------------------------------------------------ prefill


async def test_prefill_cannot_write_the_registry_or_dispatch(server: NatsServer, admin: NATS,
                                                             conns: list[Conn]) -> None:
    pre = await _as(server, conns, "prefill")
    for subject in ("$KV.SS_REQUESTS.r1", "$KV.SS_QUOTA.A", "ss.q.A.m-1.p0", "ss.req.A", "ss.decode.d0.job",
                    "ss.decode.d0.revoke", "ss.prefill.p1.job", "ss.hb.decode.d0", "ss.cancel.A",
                    "$JS.API.STREAM.CREATE.SS_QUEUE", "$JS.API.STREAM.MSG.GET.KV_SS_REQUESTS",
                    "$JS.API.STREAM.INFO.SS_QUEUE", "$JS.API.STREAM.NAMES"):
        assert await pre.publish_refused(subject), subject
    for subject in ("ss.decode.*.reserve", "ss.decode.d0.job", "ss.req.*", "ss.stream.A.>", "_INBOX.A.>",
                    f"{service_inbox('decode')}.>"):
        assert await pre.subscribe_refused(subject), subject


async def test_prefill_does_its_job(server: NatsServer, admin: NATS, conns: list[Conn]) -> None:
    pre = await _as(server, conns, "prefill")
    for subject in ("ss.prefill.prefill-0.job", "ss.cancel.*", "ss.kv.prefill-0.held"):
        await pre.nc.subscribe(subject)
    for subject in ("ss.decode.decode-0.kvready", "ss.evt.bounced.A.r1", "ss.stream.A.r1", "ss.kv.prefill-0",
                    "ss.hb.prefill.prefill-0", "ss.trace.spans.prefill"):
        await pre.nc.publish(subject, b"{}")
    assert (await pre.nc.jetstream().publish("ss.evt.finished.A.r2", b"done")).stream == Subjects.USAGE_STREAM
    assert (await pre.nc.jetstream().stream_info(Subjects.RESULTS_STREAM)).config.name == Subjects.RESULTS_STREAM
    assert await pre.clean(), pre.errors


# ----------------------------------------------------------------------------------------------- frontend


async def test_frontend_cannot_write_the_queue_or_read_workers(server: NatsServer, admin: NATS,
                                                               conns: list[Conn]) -> None:
    fe = await _as(server, conns, "frontend")
    for subject in ("ss.q.A.m-1.p0", "$KV.SS_QUOTA.A", "$KV.SS_REQUESTS.r1", "ss.decode.d0.job", "ss.prefill.p0.job",
                    "ss.stream.A.r1", "ss.result.A.r1", "ss.evt.finished.A.r1", "ss.hb.router.router-0",
                    "ss.kv.d0.held", "$JS.API.STREAM.DELETE.SS_USAGE", "$JS.API.STREAM.PURGE.SS_USAGE",
                    "$JS.API.STREAM.MSG.GET.SS_QUEUE", "$JS.API.CONSUMER.CREATE.SS_QUEUE"):
        assert await fe.publish_refused(subject), subject
    for subject in ("ss.req.*", "ss.decode.>", "ss.prefill.>", "ss.kv.*", "ss.q.>", "ss.cancel.*",
                    "ss.admin.queues", "_INBOX.A.>", f"{service_inbox('router')}.>"):
        assert await fe.subscribe_refused(subject), subject


async def test_frontend_does_its_job(server: NatsServer, admin: NATS, conns: list[Conn]) -> None:
    fe = await _as(server, conns, "frontend")

    async def accept(msg: Msg) -> None:  # a router
        req = proto.decode(msg.data, proto.GenerateRequest)
        await admin.publish(msg.reply, proto.encode(Accepted(request_id=req.request_id, router_id="r",
                                                             prompt_tokens=1)))

    await admin.subscribe(Subjects.REQUEST_ALL, cb=accept)
    await admin.flush()
    req = proto.GenerateRequest(request_id="r9", tenant="A", prompt="hi",
                                stream_subject=Subjects.stream("A", "r9"))
    await fe.nc.subscribe(req.stream_subject)
    reply = await _request(fe, Subjects.request("A"), proto.encode(req))
    assert proto.decode(reply.data, Accepted).request_id == "r9"
    await fe.nc.publish(Subjects.cancel("A"), b"{}")
    await fe.nc.subscribe(Subjects.HEARTBEAT_ALL)
    await fe.nc.subscribe(Subjects.FINISHED_ALL)
    # A stream's stored end, by direct get; the console's usage view, read from SS_USAGE.
    await admin.jetstream().publish("ss.result.A.r9", b"stored end")
    raw = await fe.nc.jetstream().get_last_msg(Subjects.RESULTS_STREAM, "ss.result.A.r9", direct=True)
    assert raw.data == b"stored end"
    finished = proto.RequestFinished(request_id="r9", tenant="A", worker_id="decode-0", status="ok")
    await admin.jetstream().publish(Subjects.finished("A", "r9"), proto.encode(finished))
    assert any(ev.request_id == "r9" for ev in await read_usage(fe.nc, idle_timeout=1.0))
    assert await fe.clean(), fe.errors


# -------------------------------------------------------------------------------------------- cache index


async def test_cache_index_cannot_dispatch_or_answer_for_workers(server: NatsServer, admin: NATS,
                                                                 conns: list[Conn]) -> None:
    ci = await _as(server, conns, "cache_index")
    for subject in ("ss.decode.d0.job", "ss.prefill.p0.job", "ss.decode.d0.kvready", "ss.stream.A.r1",
                    "ss.result.A.r1", "ss.evt.finished.A.r1", "ss.req.A", "ss.kv.d0", "$KV.SS_REQUESTS.r1",
                    "$JS.API.STREAM.CREATE.SS_RESULTS", "$JS.API.STREAM.DELETE.SS_KV_EVENTS", "ss.q.A.m-1.p0"):
        assert await ci.publish_refused(subject), subject
    for subject in ("ss.req.*", "ss.stream.>", "ss.decode.>", "ss.evt.finished.>", "_INBOX.A.>"):
        assert await ci.subscribe_refused(subject), subject


async def test_cache_index_does_its_job(server: NatsServer, admin: NATS, conns: list[Conn]) -> None:
    ci = await _as(server, conns, "cache_index")
    js = ci.nc.jetstream()
    await ensure_stream(js, StreamConfig(name=KV_EVENTS_STREAM, subjects=[Subjects.KV_EVENTS_ALL]), 1)
    store = await js.create_object_store(INDEX_STORE, config=ObjectStoreConfig(replicas=1))
    await store.put("snapshot", b"x" * 1000)
    await store.put("snapshot", b"y" * 1000)  # a new snapshot purges the old one's chunks
    assert (await store.get("snapshot")).data == b"y" * 1000
    got: list[bytes] = []

    async def on_event(msg: Msg) -> None:
        got.append(msg.data)

    await js.subscribe(Subjects.KV_EVENTS_ALL, cb=on_event, ordered_consumer=True)
    await admin.publish("ss.kv.decode-0", b"blocks")
    for _ in range(100):
        if got:
            break
        await asyncio.sleep(0.05)
    assert got == [b"blocks"]
    await ci.nc.subscribe(Subjects.CACHE_QUERY, queue="cache_index")
    await ci.nc.subscribe(Subjects.HEARTBEAT_ALL)
    await ci.nc.publish("ss.hb.cache_index.ci0", b"hb")
    assert await ci.clean(), ci.errors


# ------------------------------------------------------------------------------------------------- router


async def test_router_cannot_speak_for_workers_or_drop_streams(server: NatsServer, admin: NATS,
                                                               conns: list[Conn]) -> None:
    r = await _as(server, conns, "router")
    for subject in ("ss.hb.decode.d0", "ss.kv.d0", "ss.decode.d0.kvready", "ss.decode.d0.reserve",
                    "ss.evt.bounced.A.r1", "ss.trace.spans.decode", f"$O.{INDEX_STORE}.M.x",
                    "$JS.API.STREAM.DELETE.SS_QUEUE", "$JS.API.STREAM.PURGE.SS_RESULTS",
                    f"$JS.API.STREAM.CREATE.{KV_EVENTS_STREAM}", "$JS.API.STREAM.CREATE.OTHER", "_INBOX.A.x.y"):
        assert await r.publish_refused(subject), subject
    for subject in ("ss.decode.*.job", "ss.decode.*.reserve", "ss.prefill.>", "_INBOX.A.>",
                    f"{service_inbox('frontend')}.>", ">"):
        assert await r.subscribe_refused(subject), subject


async def test_router_does_its_job(server: NatsServer, admin: NATS, conns: list[Conn]) -> None:
    """The router's own JetStream code: the work queue and a lane, the request registry, a quota bucket."""
    from splitserve.runtime.bus import Bus
    from splitserve.runtime.workqueue import WorkQueue
    from splitserve.services.router.shared import RequestRegistry

    r = await _as(server, conns, "router")
    bus = await Bus.connect(server.url, "router:test", user=service_user("router"), password=SECRETS["router"],
                            inbox_prefix=service_inbox("router"))
    try:
        wq = WorkQueue(bus, ack_wait_s=30.0)
        await wq.setup()  # SS_QUEUE and SS_USAGE
        lane = await wq.lane("A", 0, "m-1")
        ack = await bus.nc.jetstream().publish(Subjects.queue("A", 0, "m-1"), b"queued request")
        assert ack.stream == Subjects.QUEUE_STREAM
        msgs = await lane.sub.fetch(1, timeout=5)
        await msgs[0].in_progress()
        await msgs[0].ack()  # several answers to one message: granted explicitly, not by allow_responses
        await wq.refresh()
        registry = RequestRegistry(bus.nc.jetstream(), ttl_s=60.0)
        await registry.setup()
        rec = proto.RequestRecord(request_id="r1", tenant="A", state="queued", accepted_by="router-test")
        rev = await registry.create(rec)
        assert rev is not None and (got := await registry.get("A", "r1")) is not None
        assert await registry.cas(got[0], got[1]) is not None
        kv = await ensure_bucket(bus.nc.jetstream(), KeyValueConfig(bucket=Subjects.QUOTA_BUCKET, history=1), 1)
        await kv.put("A", b"usage")
        assert (await kv.get("A")).value == b"usage"
        assert bus.denied == []
    finally:
        await bus.close()
    for subject in (Subjects.REQUEST_ALL, Subjects.ADMIN_QUEUES, Subjects.HEARTBEAT_ALL, Subjects.FINISHED_ALL,
                    Subjects.BOUNCED_ALL, Subjects.KV_EVENTS_ALL, Subjects.CANCEL_ALL, Subjects.ROUTED_ALL,
                    Subjects.FAIR_ALL, "ss.stream.A.r1"):
        await r.nc.subscribe(subject)
    for subject in ("ss.decode.d0.job", "ss.prefill.p0.job", "ss.stream.A.r1", "ss.routed.router-0",
                    "ss.fair.router-0", "ss.hb.router.router-0"):
        await r.nc.publish(subject, b"{}")
    assert await r.clean(), r.errors


async def _cache_index_state(admin: NATS) -> tuple[int, bytes]:
    """What a running cache index leaves (its event stream with a batch, its snapshot object); returns the
    stream's message count and the snapshot's bytes, to check that nothing a router tried changed them."""
    import msgpack
    from nats.js.errors import NotFoundError

    from splitserve.cache.events import batch, stored
    from splitserve.cache.index import PrefixIndex

    js = admin.jetstream()
    await ensure_stream(js, StreamConfig(name=KV_EVENTS_STREAM, subjects=[Subjects.KV_EVENTS_ALL]), 1)
    try:
        store = await js.object_store(INDEX_STORE)
    except NotFoundError:
        store = await js.create_object_store(INDEX_STORE, config=ObjectStoreConfig(replicas=1))
    index = PrefixIndex()
    index.store("decode-0", [1, 2, 3])
    seq = (await js.stream_info(KV_EVENTS_STREAM)).state.last_seq
    snapshot = msgpack.packb({"stream_seq": seq, "index": index.snapshot()})
    await store.put("snapshot", snapshot)
    await js.publish(Subjects.kv_events("decode-0"),
                     proto.encode(batch("decode-0", 0, [stored([7, 8], block_size=16)])))
    return (await js.stream_info(KV_EVENTS_STREAM)).state.messages, snapshot


async def test_router_warm_starts_its_index_from_the_cache_index(server: NatsServer, admin: NATS,
                                                                 conns: list[Conn]) -> None:
    """The router's warm start (splitserve.cache.warmstart) with the router's own rights: the snapshot and a
    replay of SS_KV_EVENTS, and not one refusal."""
    from splitserve.cache.index import PrefixIndex
    from splitserve.cache.warmstart import WarmStart

    await _cache_index_state(admin)
    r = await _as(server, conns, "router")
    replica = PrefixIndex()
    warm = WarmStart(r.nc, replica.apply, replica.restore)

    async def live() -> None:
        await r.nc.subscribe(Subjects.KV_EVENTS_ALL)
        await r.nc.flush()

    rep = await warm.run(live, 5.0)
    assert rep.skipped is None and rep.complete and rep.snapshot_seq is not None and rep.replayed >= 1, rep
    assert replica.lookup([1, 2, 3]) == {"decode-0": 3} and replica.lookup([7, 8]) == {"decode-0": 2}
    assert await r.clean(), r.errors


async def test_router_cannot_write_purge_or_delete_the_cache_index(server: NatsServer, admin: NATS,
                                                                   conns: list[Conn]) -> None:
    """Reading the cache index's stream and object store is all a router may do with them: no put, delete or
    purge of the snapshot, no purge, update or delete of the event stream or its messages, no deleting the
    cache index's consumers, and no reading of streams it could not read before (the rights are bound to
    those two streams by name: no STREAM.NAMES, no consumer on SS_RESULTS / SS_USAGE / SS_TRACES)."""
    import nats.errors

    messages, snapshot = await _cache_index_state(admin)
    r = await _as(server, conns, "router")
    obj = f"OBJ_{INDEX_STORE}"
    for subject in (f"$JS.API.STREAM.DELETE.{KV_EVENTS_STREAM}", f"$JS.API.STREAM.PURGE.{KV_EVENTS_STREAM}",
                    f"$JS.API.STREAM.UPDATE.{KV_EVENTS_STREAM}", f"$JS.API.STREAM.MSG.DELETE.{KV_EVENTS_STREAM}",
                    f"$JS.API.CONSUMER.DELETE.{KV_EVENTS_STREAM}.c1", f"$JS.API.STREAM.DELETE.{obj}",
                    f"$JS.API.STREAM.PURGE.{obj}", f"$JS.API.STREAM.UPDATE.{obj}", f"$JS.API.STREAM.MSG.DELETE.{obj}",
                    f"$JS.API.CONSUMER.DELETE.{obj}.c1", f"$O.{INDEX_STORE}.C.x", f"$O.{INDEX_STORE}.M.x",
                    "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST", f"$JS.API.CONSUMER.CREATE.{Subjects.RESULTS_STREAM}",
                    f"$JS.API.CONSUMER.CREATE.{Subjects.USAGE_STREAM}", f"$JS.API.CONSUMER.CREATE.{TRACES_STREAM}",
                    f"$JS.API.STREAM.MSG.GET.{Subjects.RESULTS_STREAM}", f"$JS.API.STREAM.MSG.GET.{KV_EVENTS_STREAM}",
                    f"$JS.API.DIRECT.GET.{KV_EVENTS_STREAM}.ss.kv.decode-0", Subjects.ADMIN_CACHE_STATS):
        assert await r.publish_refused(subject), subject
    # The same through the client's own calls: each one refused, and the state is as it was.
    js = r.nc.jetstream(timeout=1.0)
    store = await js.object_store(INDEX_STORE)  # reading the store's info is allowed
    for attempt in (store.put("snapshot", b"poisoned"), store.delete("snapshot"), js.purge_stream(KV_EVENTS_STREAM),
                    js.delete_stream(KV_EVENTS_STREAM), js.delete_stream(obj)):
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await attempt
    ajs = admin.jetstream()
    assert (await ajs.stream_info(KV_EVENTS_STREAM)).state.messages == messages
    assert (await (await ajs.object_store(INDEX_STORE)).get("snapshot")).data == snapshot


async def test_only_the_operator_asks_for_cache_stats(server: NatsServer, admin: NATS, conns: list[Conn]) -> None:
    ci = await _as(server, conns, "cache_index")

    async def answer(msg: Msg) -> None:
        await msg.respond(b"stats")

    await ci.nc.subscribe(Subjects.ADMIN_CACHE_STATS, queue="cache_index", cb=answer)
    await ci.nc.flush()
    assert (await admin.request(Subjects.ADMIN_CACHE_STATS, b"{}", timeout=5)).data == b"stats"
    assert await ci.clean(), ci.errors
    for role in ("router", "decode", "prefill", "frontend"):
        c = await _as(server, conns, role)
        assert await c.publish_refused(Subjects.ADMIN_CACHE_STATS), role
    t = await _as(server, conns, tenant="A")
    assert await t.publish_refused(Subjects.ADMIN_CACHE_STATS)


# -------------------------------------------------------------------------------------------------- admin


async def test_admin_may_do_everything(server: NatsServer, admin: NATS, conns: list[Conn]) -> None:
    a = await _as(server, conns, "admin")
    sub = await a.nc.subscribe(">")
    await a.nc.publish("ss.q.A.m-1.p0", b"q")
    assert (await sub.next_msg(timeout=2)).subject == "ss.q.A.m-1.p0"
    assert (await a.nc.jetstream().stream_info(Subjects.RESULTS_STREAM)).config.allow_direct
    assert await a.clean(), a.errors


# ------------------------------------------------------------------------------------------------- tenant


@pytest.mark.parametrize("subject", [
    "$KV.SS_QUOTA.A", "$KV.SS_REQUESTS.r1", "$JS.API.INFO", "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.INFO.SS_USAGE", "$JS.API.CONSUMER.CREATE.SS_USAGE", "$JS.API.STREAM.MSG.GET.SS_RESULTS",
    "$JS.API.DIRECT.GET.SS_RESULTS.ss.result.B.r1", "$JS.API.DIRECT.GET.SS_USAGE.ss.evt.finished.A.r1",
    "$JS.ACK.SS_QUEUE.x", "ss.q.A.m-1.p0", "ss.hb.decode.d0", "ss.kv.d0", "ss.kv.d0.held", "ss.evt.finished.A.r1",
    "ss.evt.bounced.A.r1", "ss.routed.router-0", "ss.fair.router-0", "ss.admin.queues", "ss.admin.route.explain",
    "ss.trace.spans.client", "ss.stream.A.r1", f"{service_inbox('router')}.x.y"])
async def test_tenant_cannot_publish_on_system_subjects(subject: str, server: NatsServer, admin: NATS,
                                                        conns: list[Conn]) -> None:
    t = await _as(server, conns, tenant="A")
    assert await t.publish_refused(subject)


async def test_tenant_keeps_its_own_rights(server: NatsServer, admin: NATS, conns: list[Conn]) -> None:
    t = await _as(server, conns, tenant="A")
    await admin.jetstream().publish("ss.result.A.own", b"mine")
    raw = await t.nc.jetstream().get_last_msg(Subjects.RESULTS_STREAM, "ss.result.A.own", direct=True)
    assert raw.data == b"mine"
    await t.nc.publish("ss.cancel.A", b"{}")
    await t.nc.subscribe("ss.stream.A.>")
    assert await t.clean(), t.errors


def test_generated_config_is_accepted_by_nats_server(tmp_path: Path) -> None:
    """``nats-server -t``: the permissions (allow_responses included) parse."""
    import subprocess

    from splitserve.natsserver import nats_server_binary, write_config

    conf = nats_auth_config(TenantsConfig.model_validate({"tenants": {"A": {"password": PW_A}}}), SECRETS)
    path = write_config(tmp_path / "nats.conf", port=4222, store_dir=tmp_path / "js", extra=conf)
    cp = subprocess.run([nats_server_binary(), "-t", "-c", str(path)], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0, cp.stdout + cp.stderr
