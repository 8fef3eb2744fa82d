"""Attacks by a tenant with valid credentials against a real closed stack.

``splitserve up --tenants FILE --engine mock`` (a real nats-server with the generated users, the real router,
a decoder running the mock engine: the control plane is what is attacked here). Tenant A holds its own
password and nothing else; every test below is something A tried on main at 3bfffbf and that worked then:

- impersonation: A publishes on its own subject a request whose body says tenant B;
- subject injection: A names a stream subject that is not its request's own (B's result subject, a KV key);
- cross-tenant cancel: A cancels B's running and queued requests by id (on A's own cancel subject, the only
  one the server lets it publish on), or claims to be B in the cancel's body;
- request-id squatting: A uses the ids B will use first (B used to be refused, and A could tell B's ids);
- work before checks: A sends prompts of megabytes while B is being served.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from splitserve import proto
from splitserve.client import Client
from splitserve.proto import ErrorCode, GenerateRequest, SamplingParams, StreamError
from splitserve.stackproc import StackProc, start_stack
from splitserve.tenancy.natsauth import read_admin_credentials, tenant_inbox

pytestmark = pytest.mark.slow

PW_A, PW_B = "password-of-tenant-a", "password-of-tenant-b"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProc]:
    tmp = tmp_path_factory.mktemp("attack-stack")
    tenants = tmp / "tenants.yaml"
    # B has a small in-flight limit: a request charged to B by someone else would show in it.
    tenants.write_text(f"tenants:\n  A:\n    password: {PW_A}\n  B:\n    password: {PW_B}\n    max_inflight: 40\n")
    # The mock engine with 25 ms steps: a 120-token request runs ~3 s, so it can be cancelled mid-stream, and 16
    # slots per decoder leave the rest of a burst queued.
    env = dict(os.environ, SPLITSERVE_MOCK_STEP_MS="25")
    sp = start_stack(Path(tmp) / "state", "--prefill", "0", "--decode", "1", "--engine", "mock",
                     "--tenants", str(tenants), env=env)
    try:
        yield sp
    finally:
        sp.stop()


@pytest.fixture
async def raw_a(stack: StackProc) -> AsyncIterator[NATS]:
    """Tenant A as a raw NATS connection: it can put anything in a body, but only on the subjects its
    credentials allow."""
    nc = await nats.connect(stack.nats_url, user="A", password=PW_A, inbox_prefix=tenant_inbox("A"),
                            max_reconnect_attempts=0)
    yield nc
    await nc.close()


async def _ask(nc: NATS, subject: str, req: GenerateRequest) -> proto.Accepted | StreamError:
    reply = await nc.request(subject, proto.encode(req), timeout=15, headers=proto.headers_for(req))
    if json.loads(reply.data)["kind"] == "accepted":
        return proto.decode(reply.data, proto.Accepted)
    return proto.decode(reply.data, StreamError)


def _req(tenant: str, **kw: object) -> GenerateRequest:
    rid = uuid.uuid4().hex
    fields: dict[str, object] = {"request_id": rid, "tenant": tenant, "prompt": "Once upon a time",
                                 "sampling": SamplingParams(max_tokens=4),
                                 "stream_subject": proto.Subjects.stream(tenant, rid)}
    fields.update(kw)
    return GenerateRequest(**fields)  # type: ignore[arg-type]


async def test_a_request_claiming_another_tenant_is_refused(raw_a: NATS) -> None:
    # A's own subject, B's name in the body: refused, not run as B (it used to run, charged to B).
    reply = await _ask(raw_a, proto.Subjects.request("A"), _req("B"))
    assert isinstance(reply, StreamError) and reply.code == ErrorCode.FORBIDDEN
    assert "tenant 'B'" in reply.message and "ss.req.A" in reply.message
    # The same body with A's own name is served.
    ok = await _ask(raw_a, proto.Subjects.request("A"), _req("A"))
    assert isinstance(ok, proto.Accepted)


@pytest.mark.parametrize("subject", ["$KV.SS_QUOTA.B", "ss.result.B.planted", "$JS.API.STREAM.PURGE.SS_USAGE",
                                     "ss.stream.A.some-other-request", "ss.evt.finished.B.x"])
async def test_a_stream_subject_the_service_did_not_derive_is_refused(raw_a: NATS, subject: str) -> None:
    """The services publish with service rights, so a subject named by a body would let A write where A itself
    may not (B's quota record, B's results, the JetStream API). The message is refused when it is decoded."""
    req = _req("A")
    raw = req.model_dump(mode="json")
    raw["stream_subject"] = subject
    data = json.dumps(raw).encode()
    reply = await raw_a.request(proto.Subjects.request("A"), data, timeout=15)
    err = proto.decode(reply.data, StreamError)
    assert err.code == ErrorCode.BAD_REQUEST and "stream_subject must be" in err.message


async def test_a_flood_of_large_requests_is_refused_before_decoding(stack: StackProc, raw_a: NATS) -> None:
    """A sends 6 MB requests as fast as NATS carries them: past its intake byte budget (16 MiB/s per router by
    default) each is answered ``busy`` with a retry-after, unread, and B is served meanwhile."""
    big = _req("A", prompt="b" * 6_000_000)
    data = proto.encode(big)
    async with Client(stack.nats_url, user="B", password=PW_B) as b:
        replies = await asyncio.gather(*(raw_a.request(proto.Subjects.request("A"), data, timeout=30)
                                         for _ in range(12)))
        served = await asyncio.gather(*(b.complete("Hello there", max_tokens=4) for _ in range(5)))
    errs = [proto.decode(r.data, StreamError) for r in replies]
    busy = [e for e in errs if e.code == ErrorCode.BUSY]
    assert busy and all(e.retryable and e.retry_after_ms and "request bytes" in e.message for e in busy)
    assert {e.code for e in errs} <= {ErrorCode.BUSY, ErrorCode.PROMPT_TOO_LONG}
    assert [r.finish_reason for r in served] == ["length"] * 5
    # Leave A's budget full again for the tests after this one (24 MiB of burst refills at 16 MiB/s).
    await asyncio.sleep(2.0)


async def test_a_reply_subject_outside_an_inbox_is_not_answered(stack: StackProc, raw_a: NATS) -> None:
    """nats-server does not check a reply subject against the sender's rights, and the router answers with its
    own: A's request with reply-to B's quota key (or the JetStream API) used to have the router write its answer
    there. Now only inboxes are answered; B's quota record stays a quota record and B is served."""
    async with Client(stack.nats_url, user="B", password=PW_B) as b:
        assert (await b.complete("Hello", max_tokens=2)).finish_reason == "length"  # B's quota record exists
        for reply in ("$KV.SS_QUOTA.B", "ss.result.B.planted", "$JS.API.STREAM.PURGE.SS_USAGE"):
            req = _req("A")
            await raw_a.publish(proto.Subjects.request("A"), proto.encode(req), reply=reply,
                                headers=proto.headers_for(req))
            # A refused one too: its error reply would go to the same place.
            bad = _req("B")
            await raw_a.publish(proto.Subjects.request("A"), proto.encode(bad), reply=reply,
                                headers=proto.headers_for(bad))
        await raw_a.flush()
        await asyncio.sleep(1.0)
        results = await asyncio.gather(*(b.complete("Hello", max_tokens=2) for _ in range(5)))
    assert [r.finish_reason for r in results] == ["length"] * 5


async def test_a_cannot_publish_on_b_subjects(stack: StackProc) -> None:
    # A may not publish on B's subjects at all: nats-server refuses it (the server is the first wall).
    errs: list[str] = []

    async def on_error(e: Exception) -> None:
        errs.append(str(e))

    nc = await nats.connect(stack.nats_url, user="A", password=PW_A, inbox_prefix=tenant_inbox("A"),
                            max_reconnect_attempts=0, error_cb=on_error)
    try:
        await nc.publish(proto.Subjects.request("B"), proto.encode(_req("B")))
        await nc.publish(proto.Subjects.cancel("B"), b"{}")
        for _ in range(50):
            await nc.flush()
            if sum("permissions violation" in e.lower() for e in errs) >= 2:
                break
            await asyncio.sleep(0.05)
        assert sum("permissions violation" in e.lower() for e in errs) >= 2, errs
    finally:
        await nc.close()


async def test_a_cannot_cancel_b_running_or_queued_requests(stack: StackProc, raw_a: NATS) -> None:
    """B fills the decoder (16 slots) and more wait in the queue; A cancels every one of them by id, on its own
    cancel subject (as tenant A, and claiming to be B). Every B request still runs to its full length."""
    async with Client(stack.nats_url, user="B", password=PW_B) as b:
        gens = [b.generate("Once upon a time", max_tokens=120) for _ in range(24)]
        iters = [g.__aiter__() for g in gens]
        firsts = [asyncio.ensure_future(it.__anext__()) for it in iters[:4]]
        await asyncio.wait_for(asyncio.gather(*firsts), 60)  # B's requests are accepted and running
        await asyncio.sleep(0.3)
        for g in gens:
            for claimed in ("A", "B"):
                c = proto.CancelRequest(request_id=g.request_id, tenant=claimed, reason="attack")
                await raw_a.publish(proto.Subjects.cancel("A"), proto.encode(c), headers=proto.headers_for(c))
        await raw_a.flush()

        async def drain(it: AsyncIterator[object]) -> None:
            async for _ in it:
                pass

        await asyncio.wait_for(asyncio.gather(*(drain(it) for it in iters)), 120)
    reasons = [g.result.finish_reason for g in gens if g.result is not None]
    assert reasons == ["length"] * 24, reasons
    assert all(g.result is not None and g.result.usage.completion_tokens == 120 for g in gens)


async def test_a_squatting_b_request_ids_neither_blocks_b_nor_learns_anything(stack: StackProc) -> None:
    """Request ids are the clients' own, so A may learn or guess ids B will use (a predictable scheme, a log line,
    a trace id). A sends requests under those ids first, long ones still running when B comes, and finished ones;
    then the same ids again while B's run. B's requests under those ids are served as B's own (they used to be
    refused: "request id ... is already in use", which also told A which ids B had used). A's answers for B's
    ids are exactly those for fresh ids (no oracle), and A's own requests run to their own end."""
    running_ids = [f"b-next-{i}" for i in range(4)]
    done_ids = [f"b-done-{i}" for i in range(2)]
    async with Client(stack.nats_url, user="A", password=PW_A) as a, \
            Client(stack.nats_url, user="B", password=PW_B) as b:
        # A first: finished requests under two of the ids, long running ones under the others.
        done_a = [await a.complete("A was here first", max_tokens=2, request_id=rid) for rid in done_ids]
        assert [r.request_id for r in done_a] == done_ids
        a_gens = [a.generate("A squats", max_tokens=120, request_id=rid) for rid in running_ids]
        a_iters = [g.__aiter__() for g in a_gens]
        await asyncio.wait_for(asyncio.gather(*(it.__anext__() for it in a_iters)), 60)
        # B now uses those very ids: served, its own output, while A's still run.
        b_gens = [b.generate("Once upon a time", max_tokens=8, request_id=rid) for rid in running_ids + done_ids]
        b_results = await asyncio.wait_for(asyncio.gather(*(g.collect() for g in b_gens)), 60)
        assert [r.finish_reason for r in b_results] == ["length"] * 6
        assert [r.usage.completion_tokens for r in b_results] == [8] * 6
        # A re-sends B's ids while B's are known everywhere: the same answers as for ids B never used.
        probe, fresh = [], []
        for rid in [*running_ids, *done_ids]:
            probe.append(await _answer_kind(a, rid))
            fresh.append(await _answer_kind(a, "never-used-" + rid))
        assert probe[:4] == ["accepted"] * 4  # A's own running requests: a re-send reattaches
        assert probe[4:] == ["bad_request:already ended"] * 2  # A's own ended ones
        assert fresh == ["accepted"] * 6

        async def drain(it: AsyncIterator[object]) -> None:
            async for _ in it:
                pass

        await asyncio.wait_for(asyncio.gather(*(drain(it) for it in a_iters)), 120)
    assert [g.result.usage.completion_tokens for g in a_gens if g.result] == [120] * 4


async def _answer_kind(client: Client, rid: str) -> str:
    """What the router answers a tenant sending a short request with this id: ``accepted`` or the error code and
    the gist of its message."""
    req = client._build("probe", max_tokens=2, request_id=rid)
    nc = client._require().nc
    reply = await nc.request(proto.Subjects.request(req.tenant), proto.encode(req), timeout=15,
                             headers=proto.headers_for(req))
    if json.loads(reply.data)["kind"] == "accepted":
        return "accepted"
    err = proto.decode(reply.data, StreamError)
    return f"{err.code}:already ended" if "already ended" in err.message else f"{err.code}:{err.message}"


async def test_corrupt_registry_records_lose_no_request(stack: StackProc) -> None:
    """An insider (or a damaged store) overwrites the registry records of B's running and queued requests with
    garbage and with another request's record: each still runs once and ends once, with its whole output."""
    creds = read_admin_credentials(stack.state_dir)
    assert creds is not None
    admin = await nats.connect(stack.nats_url, user=creds[0], password=creds[1], max_reconnect_attempts=0)
    finals: dict[str, int] = {}

    async def count(msg: Msg) -> None:
        if (msg.headers or {}).get(proto.HEADER_KIND) == "final":
            rid = msg.subject.split(".")[-1]
            finals[rid] = finals.get(rid, 0) + 1

    await admin.subscribe("ss.stream.B.*", cb=count)
    kv = await admin.jetstream().key_value(proto.Subjects.REQUESTS_BUCKET)
    try:
        async with Client(stack.nats_url, user="B", password=PW_B) as b:
            gens = [b.generate("Once upon a time", max_tokens=120) for _ in range(24)]
            iters = [g.__aiter__() for g in gens]
            await asyncio.wait_for(iters[0].__anext__(), 60)
            others = asyncio.gather(*(it.__anext__() for it in iters[1:]))  # every request accepted
            await asyncio.sleep(0.5)
            for i, g in enumerate(gens):
                first = proto.request_key("B", gens[0].request_id)  # the registry's key: tenant.request
                value = b"\x00 not a record" if i % 2 else (await kv.get(first)).value or b""
                await kv.put(proto.request_key("B", g.request_id), value)

            async def drain(it: AsyncIterator[object]) -> None:
                async for _ in it:
                    pass

            await asyncio.wait_for(others, 120)
            await asyncio.wait_for(asyncio.gather(*(drain(it) for it in iters)), 120)
        await asyncio.sleep(1.0)
    finally:
        await admin.close()
    assert [g.result.usage.completion_tokens if g.result else None for g in gens] == [120] * 24
    assert finals == {g.request_id: 1 for g in gens}


async def test_b_can_still_cancel_its_own_request(stack: StackProc) -> None:
    async with Client(stack.nats_url, user="B", password=PW_B) as b:
        gen = b.generate("Once upon a time", max_tokens=400)
        it = gen.__aiter__()
        await asyncio.wait_for(it.__anext__(), 60)
        await gen.cancel()
        async for _ in it:
            pass
    assert gen.result is not None and gen.result.finish_reason == "cancelled"


async def test_megabyte_prompts_are_refused_before_tokenizing_and_others_are_served(stack: StackProc,
                                                                                    raw_a: NATS) -> None:
    """Three 6 MB prompts from A (each would take ~5 s to tokenize here) while B streams: A's are refused as too
    long from their size alone, and B's requests all complete."""
    big = "a" * 6_000_000

    async def attack() -> list[proto.Accepted | StreamError]:
        return list(await asyncio.gather(*(_ask(raw_a, proto.Subjects.request("A"), _req("A", prompt=big))
                                           for _ in range(3))))

    async with Client(stack.nats_url, user="B", password=PW_B) as b:
        t0 = time.monotonic()
        attacks = asyncio.ensure_future(attack())
        results = await asyncio.gather(*(b.complete("Hello there", max_tokens=8) for _ in range(20)))
        replies = await attacks
    assert all(r.finish_reason == "length" for r in results)
    for r in replies:
        assert isinstance(r, StreamError) and r.code == ErrorCode.PROMPT_TOO_LONG, r
        assert "at least" in r.message  # refused from its size, without tokenizing
    assert time.monotonic() - t0 < 120  # a generous bound: only that nothing hung
