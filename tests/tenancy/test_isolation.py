"""The NATS server itself keeps tenants apart: a real nats-server (from the wheel) runs the auth config that
``splitserve up --tenants`` generates, and every refusal below comes from the server, not from our code."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js.api import StreamConfig

from splitserve import errors, proto
from splitserve.client import Client
from splitserve.natsserver import NatsServer, start_nats
from splitserve.proto import Accepted, ErrorCode, StreamError
from splitserve.runtime.bus import Bus
from splitserve.tenancy.config import TenantsConfig
from splitserve.tenancy.natsauth import SERVICE_ROLES, nats_auth_config, service_inbox, service_user, tenant_inbox

PW_A, PW_B = "password-of-a", "password-of-b"
SECRETS = {r: f"service-secret-{r}" for r in SERVICE_ROLES}

try:
    import nkeys
except ImportError:  # nats-py's optional nkeys support is not installed: nkey users are not tested
    nkeys = None


@dataclass
class Cluster:
    srv: NatsServer
    nkey_seed: Path | None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("tenancy")
    tenants: dict[str, dict[str, object]] = {"A": {"password": PW_A}, "B": {"password": PW_B}}
    seed_file = None
    if nkeys is not None:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        seed_file = tmp / "c.nk"
        seed_file.write_bytes(seed)
        tenants["C"] = {"nkey": nkeys.from_seed(bytearray(seed)).public_key.decode()}
    conf = nats_auth_config(TenantsConfig.model_validate({"tenants": tenants}), SECRETS)
    srv = start_nats(tmp / "nats", port=None, extra_config=conf)
    yield Cluster(srv, seed_file)
    srv.stop()


@pytest.fixture
async def router(cluster: Cluster) -> AsyncIterator[NATS]:
    """The router's service user: creates SS_RESULTS with direct get (as the real router does) and answers
    ``ss.req.A`` with Accepted."""
    nc = await nats.connect(cluster.srv.url, user=service_user("router"), password=SECRETS["router"],
                            inbox_prefix=service_inbox("router"))  # the only inbox the router's user may read
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=proto.Subjects.RESULTS_STREAM, subjects=[proto.Subjects.RESULTS_ALL],
                                     allow_direct=True))

    async def accept(msg: object) -> None:
        req = proto.decode(msg.data, proto.GenerateRequest)  # type: ignore[attr-defined]
        await nc.publish(msg.reply, proto.encode(Accepted(request_id=req.request_id,  # type: ignore[attr-defined]
                                                          router_id="router-test", prompt_tokens=1)))

    await nc.subscribe(proto.Subjects.REQUEST_ALL, cb=accept)
    await nc.flush()
    yield nc
    await nc.close()


class Tenant:
    """A raw nats-py connection as tenant A that records what the server refuses."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc = NATS()

    async def connect(self, url: str) -> Tenant:
        async def on_error(e: Exception) -> None:
            self.errors.append(str(e))

        await self.nc.connect(url, user="A", password=PW_A, inbox_prefix=tenant_inbox("A"), error_cb=on_error,
                              max_reconnect_attempts=0)
        return self

    async def refused(self, verb: str, subject: str) -> bool:
        """Whether the server reported a permissions violation for ``subject`` (``verb``: Publish or
        Subscription)."""
        for _ in range(50):
            await self.nc.flush()
            # (nats-py lower-cases the server's error text)
            if any(f"permissions violation for {verb} to \"{subject}\"".lower() in e.lower() for e in self.errors):
                return True
            await asyncio.sleep(0.02)
        return False


@pytest.fixture
async def tenant_a(cluster: Cluster) -> AsyncIterator[Tenant]:
    t = await Tenant().connect(cluster.srv.url)
    yield t
    await t.nc.close()


async def _publish_result(nc: NATS, tenant: str, rid: str, data: bytes) -> None:
    await nc.jetstream().publish(proto.Subjects.result(tenant, rid), data)


# ---------------------------------------------------------------------------------------------- refusals


async def test_wrong_or_missing_credentials_are_refused(cluster: Cluster) -> None:
    with pytest.raises(errors.NotAuthorized, match="refused the credentials"):
        await Client(cluster.srv.url, user="A", password="not-the-password").connect()
    with pytest.raises(errors.NotAuthorized, match="requires credentials"):
        await Client(cluster.srv.url, tenant="A").connect()
    with pytest.raises(errors.NotAuthorized):  # a tenant's password is no service password
        await Client(cluster.srv.url, user=service_user("router"), password=PW_A).connect()


async def test_tenant_cannot_publish_to_another_tenants_request_subject(cluster: Cluster, router: NATS,
                                                                        tenant_a: Tenant) -> None:
    got: list[bytes] = []

    async def record(m: object) -> None:
        got.append(m.data)  # type: ignore[attr-defined]

    await router.subscribe("ss.req.B", cb=record)
    await tenant_a.nc.publish("ss.req.B", b"x")
    assert await tenant_a.refused("Publish", "ss.req.B")
    with pytest.raises(nats.errors.TimeoutError):
        await tenant_a.nc.request("ss.req.B", b"{}", timeout=0.5)
    await router.flush()
    assert got == []
    # Through the SDK: the refusal is a prompt, typed error (not a 30 s accept timeout).
    async with Client(cluster.srv.url, user="A", password=PW_A) as c:
        assert c.tenant == "A"
        with pytest.raises(errors.NotAuthorized, match="ss.req.B"):
            await asyncio.wait_for(c.submit("hi", tenant="B"), 5)


@pytest.mark.parametrize("subject", ["ss.stream.B.>", "ss.result.B.>", "ss.decode.>", "ss.kv.*", "ss.q.>",
                                     "ss.evt.finished.B.>", "_INBOX.B.>", "_INBOX.>", "ss.hb.>", ">"])
async def test_tenant_cannot_subscribe_to_what_is_not_its_own(subject: str, router: NATS,
                                                              tenant_a: Tenant) -> None:
    got: list[str] = []

    async def cb(m: object) -> None:
        got.append(m.subject)  # type: ignore[attr-defined]

    await tenant_a.nc.subscribe(subject, cb=cb)
    assert await tenant_a.refused("Subscription", subject)
    probe = subject.replace(">", "x.y").replace("*", "w1")
    await router.publish(probe, b"secret")
    await router.flush()
    await asyncio.sleep(0.1)
    assert got == []


@pytest.mark.parametrize("subject", ["ss.q.A.m-1.p0", "ss.admin.queues", "ss.admin.lora", "ss.decode.d0.job",
                                     "ss.prefill.p0.job", "ss.kv.w0", "ss.hb.decode.d0", "ss.stream.A.r1",
                                     "ss.cancel.B",
                                     "$JS.API.STREAM.INFO.SS_RESULTS", "$JS.API.STREAM.MSG.GET.SS_RESULTS",
                                     "$JS.API.DIRECT.GET.SS_RESULTS", "$JS.API.INFO"])
async def test_tenant_cannot_publish_elsewhere(subject: str, router: NATS, tenant_a: Tenant) -> None:
    await tenant_a.nc.publish(subject, b"{}")
    assert await tenant_a.refused("Publish", subject)


async def test_tenant_cannot_read_another_tenants_results(router: NATS, tenant_a: Tenant) -> None:
    await _publish_result(router, "B", "r-b", b"B's secret result")
    subject = "$JS.API.DIRECT.GET.SS_RESULTS.ss.result.B.r-b"
    with pytest.raises(nats.errors.TimeoutError):
        await tenant_a.nc.request(subject, b"", timeout=0.5)
    assert await tenant_a.refused("Publish", subject)
    with pytest.raises(nats.errors.TimeoutError):
        await tenant_a.nc.jetstream().stream_info(proto.Subjects.RESULTS_STREAM)
    assert await tenant_a.refused("Publish", "$JS.API.STREAM.INFO.SS_RESULTS")
    # Its own direct-get subject with a body naming B's subject or a sequence is refused by JetStream.
    await _publish_result(router, "A", "r-a", b"A's result")
    for body in (b'{"last_by_subj":"ss.result.B.r-b"}', b'{"seq":1}', b'{"next_by_subj":"ss.result.B.r-b"}',
                 b'{"multi_last":["ss.result.B.r-b"],"batch":5}'):
        resp = await tenant_a.nc.request("$JS.API.DIRECT.GET.SS_RESULTS.ss.result.A.r-a", body, timeout=2)
        assert b"secret" not in resp.data
        assert (resp.headers or {}).get("Nats-Subject", "ss.result.A.r-a").startswith("ss.result.A.")


# ---------------------------------------------------------------------------------------------- what A may do


async def test_tenant_requests_on_its_own_subject(cluster: Cluster, router: NATS) -> None:
    async with Client(cluster.srv.url, user="A", password=PW_A) as c:
        assert c.inbox_prefix == "_INBOX.A"
        rid = await asyncio.wait_for(c.submit("hello", max_tokens=4), 5)
        assert rid
        await c.cancel(rid)  # ss.cancel.A is allowed


async def test_tenant_subscribes_its_own_stream(cluster: Cluster, router: NATS, tenant_a: Tenant) -> None:
    sub = await tenant_a.nc.subscribe("ss.stream.A.r1")
    res = await tenant_a.nc.subscribe("ss.result.A.>")
    fin = await tenant_a.nc.subscribe("ss.evt.finished.A.>")
    await tenant_a.nc.flush()

    async def received(s: Any, send: Any, data: bytes) -> bool:
        # Sent once: flush() is a barrier (splitserve.runtime.natsflush), so the subscriptions are in place. (This
        # test used to send up to 10 times: nats-py's flush let its PING overtake the queued SUBs.)
        await send()
        try:
            return bool((await s.next_msg(timeout=10.0)).data == data)
        except nats.errors.TimeoutError:
            return False

    async def pub(subject: str, data: bytes) -> None:
        await router.publish(subject, data)
        await router.flush()

    assert await received(sub, lambda: pub("ss.stream.A.r1", b"delta"), b"delta")
    assert await received(fin, lambda: pub("ss.evt.finished.A.r1", b"done"), b"done")
    assert await received(res, lambda: _publish_result(router, "A", "r-sub", b"result"), b"result")
    assert tenant_a.errors == []


async def test_tenant_direct_gets_its_own_result(cluster: Cluster, router: NATS, tenant_a: Tenant) -> None:
    await _publish_result(router, "A", "r-own", b"mine")
    raw = await tenant_a.nc.jetstream().get_last_msg(proto.Subjects.RESULTS_STREAM, "ss.result.A.r-own",
                                                     direct=True)
    assert raw.data == b"mine"
    # Through the SDK: Client.result reads by direct get (here a stored error, raised typed).
    err = StreamError(request_id="r-err", code=ErrorCode.BAD_REQUEST, message="stored failure")
    await _publish_result(router, "A", "r-err", proto.encode(err))
    async with Client(cluster.srv.url, user="A", password=PW_A) as c:
        with pytest.raises(errors.BadRequest, match="stored failure"):
            await c.result("r-err")
        assert await c.result("r-missing") is None
    assert tenant_a.errors == []


async def test_operator_may_do_everything(cluster: Cluster, router: NATS) -> None:
    # Only the operator: every other service role has least privilege (tests/security/test_role_rights.py).
    bus = await Bus.connect(cluster.srv.url, "svc", user=service_user("admin"), password=SECRETS["admin"])
    try:
        sub = await bus.nc.subscribe(">")
        await bus.nc.publish("ss.q.A.m-1.p0", b"q")
        assert (await sub.next_msg(timeout=2)).subject == "ss.q.A.m-1.p0"
        info = await bus.nc.jetstream().stream_info(proto.Subjects.RESULTS_STREAM)
        assert info.config.allow_direct
        assert bus.denied == []
    finally:
        await bus.close()


@pytest.mark.skipif(nkeys is None, reason="nats-py nkeys support (the 'nkeys' package) is not installed")
async def test_nkey_tenant(cluster: Cluster, router: NATS) -> None:
    assert cluster.nkey_seed is not None
    async with Client(cluster.srv.url, tenant="C", nkey_seed=str(cluster.nkey_seed)) as c:
        assert c.inbox_prefix == "_INBOX.C"
        assert await asyncio.wait_for(c.submit("hello", max_tokens=4), 5)
        with pytest.raises(errors.NotAuthorized):
            await asyncio.wait_for(c.submit("hello", tenant="A"), 5)
