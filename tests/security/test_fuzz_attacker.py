"""Fuzzing as an attacker against a real closed stack (``splitserve up --tenants FILE --engine mock``).

1. Tenant A, with its real credentials, on every subject the server lets it publish to (``ss.req.A``
   request/reply, ``ss.cancel.A``, the JetStream direct get of its own results): random bytes, mutated valid
   messages (wrong types, huge numbers, deep nesting, unicode, other tenants' names and subjects in every
   field), inputs of megabytes (prompt, messages, stop list, token ids) and random NATS headers (fake
   ``traceparent``, ``Nats-Msg-Id``, huge values, wrong ``Ss-Kind`` / ``Ss-V``, injected header lines).
2. An insider (the admin user's credentials, as a compromised service would have): garbage and mutated records
   in ``SS_REQUESTS`` / ``SS_QUOTA``, garbage in the ``SS_QUEUE`` work queue (including a body whose tenant
   differs from its lane, and lanes that are no priority class), and garbage heartbeats, KV events, finished
   and bounced events, dispatch notes, fair-share reports and admin requests.
3. The admin subjects (route explain, queue report) and the other service subjects are out of a tenant's
   reach: the server refuses the publish.

After each batch: every service is still up as the same process (its heartbeats on ``ss.hb.>``, seen through
an admin connection, keep coming with the pid it started with: the supervisor restarts a crashed service with
a new pid), no handler failed (``handler_failed``, a traceback or ``dispatch_error`` in the service logs), every
request/reply subject answered each message (an error reply for what does not decode), and tenant B's
requests (a real Client as B) still complete with their full output within a bound: no crash, no stall, no
cross-tenant effect. ``SPLITSERVE_ATTACK_FUZZ_EXAMPLES`` sets the number of examples per subject.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import nats
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from splitserve import errors, proto
from splitserve.client import Client
from splitserve.proto import (
    CancelRequest,
    DispatchNote,
    ErrorCode,
    FairShareReport,
    GenerateRequest,
    Heartbeat,
    JobBounced,
    KvEventBatch,
    QueuedRequest,
    QueueReportRequest,
    RequestFinished,
    RequestRecord,
    SamplingParams,
    StreamError,
    Subjects,
    TenantUsage,
    Usage,
    WorkerLoad,
)
from splitserve.proto.admin import RouteExplainRequest
from splitserve.runtime.bus import Bus, PermissionDenied
from splitserve.stackproc import StackProc, start_stack
from splitserve.tenancy.natsauth import read_admin_credentials, tenant_inbox

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("SPLITSERVE_ATTACK_FUZZ_EXAMPLES", "60"))
PW_A, PW_B = "password-of-tenant-a-fz", "password-of-tenant-b-fz"
WORKERS = ("router-0", "cache-index-0", "prefill-0", "decode-0", "frontend-0")
MAX_PAYLOAD = 8 * 1024 * 1024
# Room left for headers (up to 5 values of 100 kB): nats-server counts them in max_payload, and a message over it
# closes the sender's connection instead of reaching anyone.
BODY_MAX = MAX_PAYLOAD - 700_000
# What must never be in a service log while it is attacked: a handler that raised, an exception logged with
# its traceback (a loop that failed), the dispatch loop failing.
BAD_LOG = ('"handler_failed"', "Traceback", '"dispatch_error"', '"migration_failed"', '"redelivery_sweep_failed"')
MAX_LOG_LINE = 16_384  # a service's longest line here is a routing decision (about 1 kB)
T = TypeVar("T")


# --------------------------------------------------------------------------------------------- the world


@dataclass
class World:
    stack: StackProc
    loop: asyncio.AbstractEventLoop
    a: NATS  # tenant A, raw: anything in a body, only on A's subjects
    admin: NATS  # the operator's user: every subject (an insider, or a compromised service)
    pids: dict[str, int | None]  # worker -> pid at start
    seen: dict[str, tuple[int | None, float]] = field(default_factory=dict)  # worker -> (pid, last ts_ms)
    fake_workers: dict[str, Heartbeat] = field(default_factory=dict)  # forged heartbeats the router took
    log_read: dict[str, int] = field(default_factory=dict)  # log file -> bytes already judged by bad_log_lines

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProc]:
    tmp = tmp_path_factory.mktemp("fuzz-attack-stack")
    tenants = tmp / "tenants.yaml"
    # Both tenants have dynamic limits, so both have an SS_QUOTA record; A's max_tokens keeps a mutated request
    # that happens to be valid short. A's intake byte budget is raised far above the MBs it sends here, so every
    # message reaches decoding (the budget itself is tested in test_tenant_attacks).
    tenants.write_text(
        "tenants:\n"
        f"  A:\n    password: {PW_A}\n    max_tokens: 16\n    max_prompt_tokens: 2048\n    max_inflight: 400\n"
        "    request_bytes_per_s: 1073741824\n"
        f"  B:\n    password: {PW_B}\n    max_inflight: 40\n    tokens_per_minute: 50000000\n")
    env = dict(os.environ, SPLITSERVE_MOCK_STEP_MS="5")
    sp = start_stack(Path(tmp) / "state", "--prefill", "1", "--decode", "1", "--engine", "mock",
                     "--disagg-threshold", "64", "--tenants", str(tenants), env=env)
    try:
        yield sp
    finally:
        sp.stop()


@pytest.fixture(scope="module")
def world(stack: StackProc) -> Iterator[World]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="fuzz-attack-loop")
    thread.start()
    creds = read_admin_credentials(stack.state_dir)
    assert creds is not None, "no admin credentials in the stack's state dir"

    async def setup() -> World:
        a = await nats.connect(stack.nats_url, user="A", password=PW_A, inbox_prefix=tenant_inbox("A"),
                               max_reconnect_attempts=-1, error_cb=_quiet)
        admin = await nats.connect(stack.nats_url, user=creds[0], password=creds[1], max_reconnect_attempts=-1,
                                   error_cb=_quiet)
        w = World(stack=stack, loop=loop, a=a, admin=admin, pids={})

        async def on_hb(msg: Msg) -> None:
            try:
                hb = proto.decode(msg.data, Heartbeat)
            except Exception:
                return
            if hb.worker_id in WORKERS:
                w.seen[hb.worker_id] = (hb.pid, max(hb.ts_ms, w.seen.get(hb.worker_id, (None, 0.0))[1]))

        await admin.subscribe(Subjects.HEARTBEAT_ALL, cb=on_hb)
        for _ in range(100):
            if set(w.seen) == set(WORKERS):
                break
            await asyncio.sleep(0.1)
        w.pids = {k: v[0] for k, v in w.seen.items()}
        return w

    w = asyncio.run_coroutine_threadsafe(setup(), loop).result(60)
    assert set(w.pids) == set(WORKERS), w.pids
    try:
        yield w
    finally:
        async def close() -> None:
            await w.a.close()
            await w.admin.close()

        asyncio.run_coroutine_threadsafe(close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


async def _quiet(_: Exception) -> None:
    return None


async def b_completes(w: World, n: int = 4, max_tokens: int = 8, bound_s: float = 60.0) -> None:
    """B's requests complete with their whole output within ``bound_s``. A retryable refusal (busy, quota with a
    retry-after) is retried, so a record that needs a moment to heal passes; one that never heals fails."""

    async def one(b: Client) -> None:
        while True:
            try:
                res = await b.complete("Hello from tenant B", max_tokens=max_tokens)
                break
            except errors.SplitserveError as exc:
                if not (exc.retryable or exc.retry_after_s is not None):
                    raise
                await asyncio.sleep(min(2.0, max(0.1, exc.retry_after_s or 0.5)))
        assert res.finish_reason == "length", res
        assert len(res.token_ids) == max_tokens and res.usage.completion_tokens == max_tokens, res

    async with Client(w.stack.nats_url, user="B", password=PW_B, busy_retry_s=5.0, idle_timeout=30.0) as b:
        await asyncio.wait_for(asyncio.gather(*(one(b) for _ in range(n))), bound_s)


async def a_completes(w: World) -> None:
    async with Client(w.stack.nats_url, user="A", password=PW_A, idle_timeout=30.0) as a:
        res = await asyncio.wait_for(a.complete("Hello from tenant A", max_tokens=4), 60)
    assert res.finish_reason == "length" and len(res.token_ids) == 4, res


def bad_log_lines(w: World) -> list[str]:
    """Bad lines logged since the last call: each test is judged by what happened during it, and one bad line
    fails the test it happened in, not every later test of the module."""
    out = []
    for f in sorted((w.stack.state_dir / "logs").glob("*.log")):
        data = f.read_bytes()
        start = w.log_read.get(f.name, 0)
        end = data.rfind(b"\n", start) + 1  # a line still being written is judged next time, whole
        w.log_read[f.name] = max(start, end)
        for ln in data[start:end].decode(errors="replace").splitlines():
            # A live service declared dead: the one that declared it (or the one it watched) stalled.
            stalled = '"worker_dead"' in ln and any(f'"dead_worker": "{wid}"' in ln for wid in WORKERS)
            # A line that quotes what an attacker sent in full: one message of megabytes would make the service
            # write megabytes (and reply them) per message.
            echoed = len(ln) > MAX_LOG_LINE
            if stalled or echoed or any(p in ln for p in BAD_LOG):
                out.append(f"{f.name}: {f'a line of {len(ln):,} chars: ' if echoed else ''}{ln[:600]}")
    return out


def check_healthy(w: World, what: str) -> None:
    """Every service up as the same process and heartbeating, no handler failed, B and A served."""
    assert w.stack.proc.poll() is None, f"splitserve up exited during {what}"
    time.sleep(1.5)  # heartbeats are every 0.5 s: a service wedged by the batch has missed a few by now
    now_ms = time.time() * 1000
    for wid, pid in w.pids.items():
        got_pid, ts = w.seen[wid]
        assert got_pid == pid, f"{wid} was restarted during {what} (pid {pid} -> {got_pid}): it crashed"
        assert now_ms - ts < 3000, f"{wid} has not heartbeated for {(now_ms - ts) / 1000:.1f}s after {what}"
    bad = bad_log_lines(w)
    assert bad == [], f"after {what}: " + "\n".join(bad[:5])
    w.run(b_completes(w), 120)
    w.run(a_completes(w), 120)
    bad = bad_log_lines(w)
    assert bad == [], f"after {what}: " + "\n".join(bad[:5])


# --------------------------------------------------------------------------------------------- strategies

# Strings an attacker puts anywhere: other tenants, service users, subjects of others and of the system,
# wildcards, inbox prefixes, unicode look-alikes, a lone surrogate, control characters.
HOSTILE_STRINGS = ["B", "b", "A", "A.B", "svc.admin", "svc.router", "ss.stream.B.x", "ss.result.B.x", "ss.req.B",
                   "ss.q.B.default.p0", "ss.evt.finished.B.x", "$KV.SS_QUOTA.B", "$KV.SS_REQUESTS.x",
                   "$JS.API.STREAM.PURGE.SS_QUEUE", "$JS.API.DIRECT.GET.SS_RESULTS.ss.result.B.x", "_INBOX.B.x",
                   ">", "*", "", " ", "\x00", "\r\n", "Ａ", "\ud800", "A" * 65, "decode-0", "router-0", "../../etc",
                   "{\"tenant\": \"B\"}", "null"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=40) | st.sampled_from(HOSTILE_STRINGS),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10)

# Raw JSON text spliced in where a value goes: what json.dumps would never write.
RAW_VALUES = {
    "deep_list": "[" * 50_000 + "]" * 50_000,
    "deep_object": '{"a":' * 20_000 + "1" + "}" * 20_000,
    "huge_int": "1" + "0" * 5000,
    "overflow_float": "1e400",
    "nan": "NaN",
    "infinity": "-Infinity",
    "dup_v": '1, "v": 7',
}

# Values of megabytes, built from a drawn size (hypothesis draws no megabytes itself).
LARGE = {
    "text": lambda n: "x" * n,
    "unicode": lambda n: "é中😀" * (n // 9),
    "messages": lambda n: [{"role": "user", "content": "hi"}] * (n // 32),
    "stop": lambda n: ["stop"] * (n // 7),
    "token_ids": lambda n: list(range(n // 8)),
    "packed_ids": lambda n: base64.b64encode(b"\xff" * (n // 2)).decode(),
    "dict": lambda n: {f"k{i}": i for i in range(n // 12)},
}
LARGE_SIZES = st.sampled_from([200_000, 1_000_000, 3_000_000, 6_000_000])


@st.composite
def mutated(draw: st.DrawFn, valid: dict[str, Any], large_ok: bool = True) -> bytes:
    """A valid message's JSON with fields dropped, replaced (random JSON, hostile strings, values of megabytes,
    raw JSON no encoder writes) or added; nested objects are mutated too."""
    doc = json.loads(json.dumps(valid))
    raws: dict[str, str] = {}
    for _ in range(draw(st.integers(1, 3))):
        target = doc
        if draw(st.booleans()):
            nested = [k for k, v in doc.items() if isinstance(v, dict)]
            if nested:
                target = doc[draw(st.sampled_from(sorted(nested)))]
        keys = sorted(target)
        op = draw(st.sampled_from(["drop", "replace", "hostile", "large", "raw", "add"]))
        key = draw(st.sampled_from(keys)) if keys else draw(st.text(max_size=12))
        if op == "drop" and keys:
            target.pop(key)
        elif op == "replace":
            target[key] = draw(json_values)
        elif op == "hostile":
            target[key] = draw(st.sampled_from(HOSTILE_STRINGS))
        elif op == "large" and large_ok:
            target[key] = LARGE[draw(st.sampled_from(sorted(LARGE)))](draw(LARGE_SIZES))
        elif op == "raw":
            marker = f"@@raw{len(raws)}@@"
            raws[marker] = RAW_VALUES[draw(st.sampled_from(sorted(RAW_VALUES)))]
            target[key] = marker
        else:
            target[draw(st.text(max_size=12))] = draw(json_values)
    text = json.dumps(doc)
    for marker, raw in raws.items():
        text = text.replace(json.dumps(marker), raw)
    data = text.encode("utf-8", "surrogatepass")
    return data[:BODY_MAX]


def large_payload(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """The valid message with one field (top level or sampling) of megabytes."""

    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        doc = json.loads(json.dumps(valid))
        kind = draw(st.sampled_from(sorted(LARGE)))
        where = draw(st.sampled_from(["prompt", "messages", "prompt_token_ids", "session_id", "request_id",
                                      "sampling.stop", "cache_salt", "extra"]))
        value = LARGE[kind](draw(LARGE_SIZES))
        if where.startswith("sampling.") and isinstance(doc.get("sampling"), dict):
            doc["sampling"][where.split(".", 1)[1]] = value
        else:
            if where in ("messages", "prompt_token_ids"):
                doc.pop("prompt", None)
            doc[where] = value
        return json.dumps(doc).encode()[:BODY_MAX]

    return build()


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
header_names = st.sampled_from(["traceparent", "tracestate", "baggage", "Nats-Msg-Id", proto.HEADER_KIND,
                                proto.HEADER_VERSION, "Nats-Expected-Stream", "Nats-Rollup", "Status",
                                "Nats-TTL", "X-Tenant"]) | st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,20}",
                                                                          fullmatch=True)
header_values = (
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80)
    | st.sampled_from([TRACEPARENT, "00-" + "0" * 32 + "-" + "0" * 16 + "-01", "ff-" + "f" * 32 + "-" + "f" * 16
                       + "-ff", "00-zz-zz-zz", "generate_request", "error", "accepted", "heartbeat", "999", "-1",
                       "0", "B", "ss.req.B", "Z" * 64, "x\r\nSs-Kind: error", "x\r\n\r\n{}"])
    | st.integers(1_000, 100_000).map(lambda n: "h" * n)
    | st.text(max_size=20).filter(lambda s: "\r" not in s and "\n" not in s))
headers_st = st.none() | st.dictionaries(header_names, header_values, max_size=5)


def payloads(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=2048), mutated(valid), large_payload(valid),
                     st.just(json.dumps(valid).encode()), json_values.map(lambda v: json.dumps(v).encode()))


def _valid_request(tenant: str, rid: str) -> dict[str, Any]:
    return json.loads(proto.encode(GenerateRequest(request_id=rid, tenant=tenant, prompt="Once upon a time",
                                                   sampling=SamplingParams(max_tokens=4),
                                                   stream_subject=Subjects.stream(tenant, rid))))


def _local(data: bytes, model: type[proto.Message]) -> proto.Message | None:
    try:
        return proto.decode(data, model)
    except Exception:  # what the service cannot decode either (RecursionError included)
        return None


FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                         suppress_health_check=list(HealthCheck))


# --------------------------------------------------------------------------------------------- 1. tenant A


def test_fuzz_request_subject_as_tenant_a(world: World) -> None:
    """``ss.req.A`` request/reply: every message answered; what does not decode gets an error reply; a body naming
    any tenant but A is refused ``forbidden``; huge inputs do not stall anyone."""
    w = world
    unanswered: list[bytes] = []
    wrong: list[tuple[bytes, str]] = []
    counts = {"sent": 0, "accepted": 0, "error": 0}

    @FUZZ_SETTINGS
    @given(st.uuids().flatmap(lambda u: payloads(_valid_request("A", u.hex))), headers_st)
    # Always sent: values that an error names (the id, the version), of megabytes. The error must quote them cut
    # short, or each such message becomes a reply and log lines of megabytes (the line-length check).
    @example(json.dumps({**_valid_request("A", "x"), "request_id": "r" * 3_000_000}).encode(), None)
    @example(json.dumps({**_valid_request("A", "x"), "v": "v" * 3_000_000}).encode(), None)
    def send(data: bytes, headers: dict[str, str] | None) -> None:
        counts["sent"] += 1
        try:
            reply = w.run(w.a.request(Subjects.request("A"), data, timeout=30, headers=headers), 60)
        except Exception as exc:
            unanswered.append(data[:300] + f" ({exc!r}, {len(data)} bytes)".encode())
            return
        kind = (reply.headers or {}).get(proto.HEADER_KIND)
        counts["error" if kind == "error" else "accepted"] += 1
        local = _local(data, GenerateRequest)
        if local is None and kind != "error":
            wrong.append((data[:300], f"undecodable body answered {kind}: {reply.data[:200]!r}"))
        elif isinstance(local, GenerateRequest) and local.tenant != "A":
            err = _local(reply.data, StreamError)
            if not isinstance(err, StreamError) or err.code != ErrorCode.FORBIDDEN:
                wrong.append((data[:300], f"tenant {local.tenant!r} on ss.req.A answered {reply.data[:200]!r}"))
        elif kind not in ("error", "accepted"):
            wrong.append((data[:300], f"answered {kind}"))

    send()
    print(f"\nss.req.A: {counts}")
    assert unanswered == [], f"{len(unanswered)} requests got no reply, e.g. {unanswered[:3]}"
    assert wrong == [], wrong[:5]
    check_healthy(w, "the ss.req.A fuzz")


def test_fuzz_cancel_subject_as_tenant_a(world: World) -> None:
    """``ss.cancel.A``: garbage and mutated cancels, many naming B's running requests (B's id, tenant B, B's
    subjects). B's requests run to their full length."""
    w = world
    victims: list[str] = []

    async def start_victims() -> tuple[Client, list[Any], list[asyncio.Task[None]]]:
        b = await Client(w.stack.nats_url, user="B", password=PW_B, idle_timeout=120).connect()
        gens = [b.generate("A long story for B", max_tokens=800) for _ in range(3)]
        victims.extend(g.request_id for g in gens)

        async def drain(g: Any) -> None:
            async for _ in g:
                pass

        return b, gens, [asyncio.ensure_future(drain(g)) for g in gens]

    b, gens, tasks = w.run(start_victims(), 60)
    base = json.loads(proto.encode(CancelRequest(request_id=victims[0], tenant="A", reason="fuzz")))
    victim_ids = st.sampled_from(victims)

    @st.composite
    def cancel_payloads(draw: st.DrawFn) -> bytes:
        doc = dict(base, request_id=draw(victim_ids))
        if draw(st.booleans()):
            doc["tenant"] = draw(st.sampled_from(["A", "B", "ss.cancel.B", "*", "A.B"]))
        return draw(st.one_of(st.just(json.dumps(doc).encode()), mutated(doc), st.binary(max_size=1024)))

    sent = [0]

    @FUZZ_SETTINGS
    @given(cancel_payloads(), headers_st)
    def send(data: bytes, headers: dict[str, str] | None) -> None:
        sent[0] += 1
        w.run(w.a.publish(Subjects.cancel("A"), data, headers=headers), 30)

    send()
    w.run(w.a.flush(), 30)
    w.run(asyncio.wait_for(asyncio.gather(*tasks), 120), 130)
    reasons = [(g.result.finish_reason, g.result.usage.completion_tokens) if g.result else None for g in gens]
    w.run(b.close(), 30)
    print(f"\nss.cancel.A: {sent[0]} messages")
    assert reasons == [("length", 800)] * 3, reasons
    check_healthy(w, "the ss.cancel.A fuzz")


def test_fuzz_direct_get_as_tenant_a(world: World) -> None:
    """``$JS.API.DIRECT.GET.SS_RESULTS.ss.result.A.>``: random tails and bodies (one naming B's result subject,
    sequence numbers of B's stored result): the server answers, and never with B's data."""
    w = world

    async def jobs() -> tuple[str, str]:
        async with Client(w.stack.nats_url, user="B", password=PW_B) as b:
            b_rid = await b.submit("B's secret job", max_tokens=4)
            assert await b.result(b_rid, wait=30) is not None
        async with Client(w.stack.nats_url, user="A", password=PW_A) as a:
            a_rid = await a.submit("A's own job", max_tokens=4)
            assert await a.result(a_rid, wait=30) is not None
        return a_rid, b_rid

    a_rid, b_rid = w.run(jobs(), 90)
    prefix = f"$JS.API.DIRECT.GET.{Subjects.RESULTS_STREAM}.ss.result.A."
    # Sanity: A's own result is readable this way, so the checks below can see a served message.
    own = w.run(w.a.request(prefix + a_rid, b"", timeout=10), 20)
    assert a_rid.encode() in own.data and (own.headers or {}).get("Nats-Subject") == f"ss.result.A.{a_rid}"
    tails = st.one_of(st.sampled_from([a_rid, b_rid, f"{b_rid}.x", "B", f"B.{b_rid}", "x.y.z", "_", "%2A",
                                       "Ａ", "A" * 200]),
                      st.from_regex(r"[A-Za-z0-9_-]{1,30}(\.[A-Za-z0-9_-]{1,10}){0,3}", fullmatch=True))
    bodies = st.one_of(
        st.just(b""), st.binary(max_size=512),
        st.sampled_from([{"last_by_subj": f"ss.result.B.{b_rid}"}, {"seq": 1}, {"seq": 2}, {"seq": 3},
                         {"next_by_subj": "ss.result.B.>", "seq": 0}, {"multi_last": ["ss.result.>"]},
                         {"batch": 100, "next_by_subj": ">"}, {"last_by_subj": ">"}]).map(
            lambda d: json.dumps(d).encode()),
        st.integers(1000, 2_000_000).map(lambda n: b"{" * n))
    leaks: list[str] = []
    unanswered: list[str] = []

    @FUZZ_SETTINGS
    @given(tails, bodies, headers_st)
    def send(tail: str, body: bytes, headers: dict[str, str] | None) -> None:
        try:
            reply = w.run(w.a.request(prefix + tail, body, timeout=10, headers=headers), 30)
        except Exception as exc:
            if "permission" not in repr(exc).lower() and "invalid" not in repr(exc).lower():
                unanswered.append(f"{tail!r} {body[:80]!r}: {exc!r}")
            return
        subject = (reply.headers or {}).get("Nats-Subject", "")
        if b_rid.encode() in reply.data or (subject and not subject.startswith("ss.result.A.")):
            leaks.append(f"{tail!r} {body[:80]!r} -> {subject} {reply.data[:200]!r}")

    send()
    assert leaks == [], leaks[:5]
    assert unanswered == [], unanswered[:5]
    check_healthy(w, "the direct-get fuzz")


# --------------------------------------------------------------------------------------------- 3. reach


@pytest.mark.parametrize("subject", [Subjects.ADMIN_ROUTE_EXPLAIN, Subjects.ADMIN_QUEUES])
def test_admin_subjects_are_out_of_a_tenants_reach(world: World, subject: str) -> None:
    """A tenant cannot ask the route-explain or queue-report admin subjects anything: the server refuses the
    publish (the request fails at once as PermissionDenied), and the router never answers it."""
    w = world
    msg: proto.Message = (RouteExplainRequest(tenant="A", prompt="hello") if subject == Subjects.ADMIN_ROUTE_EXPLAIN
                          else QueueReportRequest())

    async def attempt() -> None:
        bus = await Bus.connect(w.stack.nats_url, "fuzz-a", user="A", password=PW_A, inbox_prefix=tenant_inbox("A"))
        try:
            with pytest.raises(PermissionDenied) as info:
                await bus.request(subject, msg, proto.Message, timeout=10)
            assert info.value.subject == subject
        finally:
            await bus.close()

    w.run(attempt(), 60)


@pytest.mark.parametrize("subject", ["ss.q.A.default.p0", "$KV.SS_QUOTA.A", "$KV.SS_REQUESTS.x", "ss.hb.decode.fz",
                                     "ss.routed.fz", "ss.fair.fz", "ss.evt.finished.A.x", "ss.kv.fz",
                                     "ss.decode.decode-0.job", "$JS.API.STREAM.PURGE.SS_QUEUE",
                                     "$JS.API.DIRECT.GET.SS_RESULTS.ss.result.B.x", "$JS.API.DIRECT.GET.SS_RESULTS"])
def test_service_subjects_are_out_of_a_tenants_reach(world: World, subject: str) -> None:
    w = world
    errs: list[str] = []

    async def attempt() -> None:
        async def on_error(e: Exception) -> None:
            errs.append(str(e))

        nc = await nats.connect(w.stack.nats_url, user="A", password=PW_A, inbox_prefix=tenant_inbox("A"),
                                max_reconnect_attempts=0, error_cb=on_error)
        try:
            await nc.publish(subject, b"{}")
            for _ in range(50):
                await nc.flush()
                if any("permissions violation" in e.lower() for e in errs):
                    break
                await asyncio.sleep(0.05)
        finally:
            await nc.close()

    w.run(attempt(), 30)
    assert any("permissions violation" in e.lower() and subject.lower() in e.lower() for e in errs), errs


# --------------------------------------------------------------------------------------------- 2. insider


def _usage(tenant: str, **kw: Any) -> dict[str, Any]:
    return json.loads(proto.encode(TenantUsage(tenant=tenant, **kw)))


def _corrupt_quota_values() -> dict[str, bytes]:
    now = time.time()
    return {
        "garbage": b"\x00\xffnot json",
        "empty": b"",
        "array": b"[1, 2, 3]",
        "wrong_version": json.dumps(dict(_usage("B"), v=99)).encode(),
        "wrong_types": json.dumps(dict(_usage("B"), inflight=[1, 2], settled="x")).encode(),
        "infinite_settled": json.dumps(_usage("B"), allow_nan=True).replace('"settled":[]',
                                                                           '"settled":[[Infinity,5]]').encode(),
        "nan_settled": json.dumps(_usage("B")).replace('"settled":[]', '"settled":[[NaN,5]]').encode(),
        "infinite_inflight": json.dumps(_usage("B")).replace('"inflight":{}',
                                                             '"inflight":{"fz-x":[Infinity,5]}').encode(),
        "nan_finishes": json.dumps(_usage("B")).replace('"finishes":[]', '"finishes":[NaN, Infinity]').encode(),
        "other_tenant": json.dumps(_usage("A", inflight={"x": (now, 1)})).encode(),
        # 60 reservations of requests that do not exist, older than the reconciliation horizon: B is over its
        # max_inflight (40) until the sweep releases them.
        "stale_reservations": json.dumps(_usage("B", inflight={f"fz-{i}": (now - 120, 10) for i in range(60)})
                                         ).encode(),
        "deep": b'{"v":1,"kind":"tenant_usage","tenant":"B","inflight":' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    }


@pytest.mark.parametrize("case", sorted(_corrupt_quota_values()))
def test_corrupt_quota_record_of_b_heals(world: World, case: str) -> None:
    """An insider overwrites B's usage record in SS_QUOTA. B is still served (a retryable refusal meanwhile is
    allowed), and the record is a valid TenantUsage again afterwards."""
    w = world
    w.run(b_completes(w, n=1), 60)  # B's record exists, and the router has it cached

    async def corrupt() -> None:
        kv = await w.admin.jetstream().key_value(Subjects.QUOTA_BUCKET)
        await kv.put("B", _corrupt_quota_values()[case])

    w.run(corrupt(), 30)
    w.run(b_completes(w, n=3, bound_s=90), 100)

    async def record() -> bytes:
        kv = await w.admin.jetstream().key_value(Subjects.QUOTA_BUCKET)
        e = await kv.get("B")
        return e.value or b""

    usage = proto.decode(w.run(record(), 30), TenantUsage)
    assert all(math.isfinite(at) for at, _ in usage.settled), usage
    bad = bad_log_lines(w)
    assert bad == [], bad[:5]


def test_fuzz_kv_buckets_as_insider(world: World) -> None:
    """Garbage and mutated values in SS_REQUESTS (random keys, and the record of a request that ended, which A
    then re-sends) and SS_QUOTA (both tenants, random keys): nobody crashes or stalls."""
    w = world
    now = time.time()
    record = json.loads(proto.encode(RequestRecord(request_id="fz-r", tenant="A", state="queued", accepted_by="x")))
    usage = _usage("B", inflight={"fz-1": (now, 5)}, settled=[(now, 3)], finishes=[now])

    async def ended_request() -> str:
        async with Client(w.stack.nats_url, user="A", password=PW_A) as a:
            res = await a.complete("first run", max_tokens=2)
        return res.request_id

    ended = w.run(ended_request(), 60)
    keys = st.sampled_from(["fz-r", "A.fz-r", "fz-x", "A", "B", "x-" * 30, ended, proto.request_key("A", ended),
                            proto.request_key("B", ended)])

    @FUZZ_SETTINGS
    @given(st.sampled_from([Subjects.REQUESTS_BUCKET, Subjects.QUOTA_BUCKET]), keys,
           st.one_of(st.binary(max_size=512), mutated(record, large_ok=False), mutated(usage, large_ok=False)))
    def put(bucket: str, key: str, value: bytes) -> None:
        async def go() -> None:
            kv = await w.admin.jetstream().key_value(bucket)
            await kv.put(key, value)

        w.run(go(), 30)

    put()

    # A re-sends the request whose record is now garbage: an answer (an error), not silence.
    async def resend() -> None:
        kv = await w.admin.jetstream().key_value(Subjects.REQUESTS_BUCKET)
        await kv.put(proto.request_key("A", ended), b"\x00garbage")
        req = GenerateRequest(request_id=ended, tenant="A", prompt="first run", sampling=SamplingParams(max_tokens=2))
        reply = await w.a.request(Subjects.request("A"), proto.encode(req), timeout=30)
        assert (reply.headers or {}).get(proto.HEADER_KIND) == "error", reply.data

    w.run(resend(), 60)
    check_healthy(w, "the KV bucket fuzz")


def _queued(tenant: str, lane_tenant: str | None = None) -> tuple[str, dict[str, Any]]:
    rid = "fzq" + uuid.uuid4().hex[:16]
    q = QueuedRequest(request=GenerateRequest(request_id=rid, tenant=tenant, prompt="queued by an insider",
                                              sampling=SamplingParams(max_tokens=2)),
                      prompt_token_ids=[1, 2, 3], router_id="fz-router")
    return rid, json.loads(proto.encode(q))


def test_fuzz_work_queue_as_insider(world: World) -> None:
    """Garbage in SS_QUEUE on the tenants' lanes and on lanes that are no priority class; a message whose body is
    tenant B's on A's lane is terminated (``queue_message_forbidden``) and never runs as B."""
    w = world
    lanes = st.sampled_from(["ss.q.A.default.p0", "ss.q.B.default.p0", "ss.q.B.default.p1", "ss.q.B.default.p2",
                             "ss.q.B.default.p7", "ss.q.A.default.p99", "ss.q.B.default.p0.extra",
                             "ss.q.fz.default.p0", "ss.q.A.default.px", "ss.q.A.p0", "ss.q.B.other-pool.p0",
                             "ss.q.A.x.y.p0"])
    _, valid = _queued("A")

    @FUZZ_SETTINGS
    @given(lanes, st.one_of(st.binary(max_size=512), mutated(valid), mutated(valid["request"])))
    def put(lane: str, data: bytes) -> None:
        async def go() -> None:
            await w.admin.jetstream().publish(lane, data, timeout=10)

        w.run(go(), 30)

    put()

    # B's request on A's lane: terminated, never run as B (nothing on its stream or its finished subject).
    async def forbidden() -> list[bytes]:
        rid, body = _queued("B")
        got: list[bytes] = []

        async def cb(msg: Msg) -> None:
            got.append(msg.subject.encode() + b" " + msg.data[:200])

        subs = [await w.admin.subscribe(Subjects.stream("B", rid), cb=cb),
                await w.admin.subscribe(Subjects.finished("B", rid), cb=cb)]
        await w.admin.jetstream().publish("ss.q.A.default.p0", json.dumps(body).encode(), timeout=10)
        await asyncio.sleep(4)
        for s in subs:
            await s.unsubscribe()
        return got

    assert w.run(forbidden(), 60) == []
    router_log = w.stack.logs("router-0")
    assert '"queue_message_forbidden"' in router_log
    check_healthy(w, "the work-queue fuzz")


def test_fuzz_events_as_insider(world: World) -> None:
    """Garbage heartbeats (forged workers), KV events, finished and bounced events, dispatch notes, fair-share
    reports; and the admin request/reply subjects, which must always answer."""
    w = world
    hb = json.loads(proto.encode(Heartbeat(worker_id="fz-worker", role="decode", seq=1, pid=1, interval_ms=500,
                                           load=WorkerLoad(max_seqs=4))))
    kv = json.loads(proto.encode(KvEventBatch(worker_id="fz-worker", seq=1, events=[])))
    fin = json.loads(proto.encode(RequestFinished(request_id="fz-f", tenant="B", worker_id="fz", status="ok",
                                                  usage=Usage(prompt_tokens=1, completion_tokens=1))))
    bounced = json.loads(proto.encode(JobBounced(request_id="fz-f", tenant="B", worker_id="fz",
                                                 code=ErrorCode.TIMEOUT, message="x")))
    note = json.loads(proto.encode(DispatchNote(router_id="fz-router", request_id="fz-n", decoder="decode-0",
                                                tenant="B", virtual_tokens=1.0)))
    fair = json.loads(proto.encode(FairShareReport(router_id="fz-router", incarnation="fz",
                                                   virtual_tokens={"B": 1.0})))
    cases: dict[str, tuple[Callable[[], str], dict[str, Any]]] = {
        "hb": (lambda: "ss.hb.decode.fz-worker", hb),
        "kv": (lambda: "ss.kv.fz-worker", kv),
        "kv_real": (lambda: "ss.kv.decode-0", dict(kv, worker_id="decode-0", seq=10**9)),
        "finished": (lambda: "ss.evt.finished.B.fz-f", fin),
        "bounced": (lambda: "ss.evt.bounced.B.fz-f", bounced),
        "routed": (lambda: "ss.routed.fz-router", note),
        "fair": (lambda: "ss.fair.fz-router", fair),
    }

    @FUZZ_SETTINGS
    @given(st.sampled_from(sorted(cases)), st.data())
    def publish(case: str, data: st.DataObject) -> None:
        subject, valid = cases[case][0](), cases[case][1]
        payload = data.draw(st.one_of(st.binary(max_size=512), mutated(valid)))
        decoded = _local(payload, Heartbeat) if case == "hb" else None
        if isinstance(decoded, Heartbeat):
            if decoded.worker_id in WORKERS:  # forging a real worker is not what this test looks at
                return
            w.fake_workers[decoded.worker_id] = decoded
        w.run(w.admin.publish(subject, payload), 30)

    publish()

    # The admin request/reply subjects always answer, garbage or not.
    explain = json.loads(proto.encode(RouteExplainRequest(tenant="B", prompt="hello")))
    unanswered: list[str] = []

    @FUZZ_SETTINGS
    @given(st.sampled_from([Subjects.ADMIN_ROUTE_EXPLAIN, Subjects.ADMIN_QUEUES]),
           st.one_of(st.binary(max_size=512), mutated(explain, large_ok=False),
                     mutated(json.loads(proto.encode(QueueReportRequest())), large_ok=False)), headers_st)
    def ask(subject: str, payload: bytes, headers: dict[str, str] | None) -> None:
        try:
            w.run(w.admin.request(subject, payload, timeout=20, headers=headers), 40)
        except Exception as exc:
            unanswered.append(f"{subject} {payload[:100]!r}: {exc!r}")

    ask()

    # Forged workers announce their stop, so the router forgets them (a forged ready decoder would otherwise
    # take B's requests into the void until it is reaped).
    async def stop_fakes() -> None:
        for fake in w.fake_workers.values():
            await w.admin.publish("ss.hb.decode.fz-worker",
                                  proto.encode(fake.model_copy(update={"seq": 2**62, "state": "stopped"})))
        await w.admin.flush()
        await asyncio.sleep(max([4 * f.interval_ms / 1000 for f in w.fake_workers.values()] + [2.0])
                            if all(f.interval_ms < 10_000 for f in w.fake_workers.values()) else 2.0)

    w.run(stop_fakes(), 120)
    assert unanswered == [], unanswered[:5]
    check_healthy(w, "the event fuzz")
