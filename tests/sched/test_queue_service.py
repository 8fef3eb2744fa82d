"""The durable multi-tenant queue against real processes: nats-server (JetStream), a router with a tenants
file, and decode workers running the ``mock`` engine (a control-plane load test: hundreds of requests on a
2-core machine; the engine is not the subject here).

- a flood from one tenant does not hold up a light tenant, and both get every result;
- token shares follow the weights while both are backlogged;
- quotas refuse precisely (which limit, retry-after) and the refusal costs the tenant nothing else;
- a router SIGKILLed mid-load and restarted loses no accepted request: each gets exactly one terminal message;
- cancel and deadline of a request still waiting in the queue end it at once.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg

from splitserve import errors, proto
from splitserve.client import Client, Result
from splitserve.natsserver import NatsServer
from splitserve.ops import queue_report, read_usage, sum_usage
from splitserve.proto import StreamError, StreamFinal
from tests.procs import spawn_service, stop, wait_ready

pytestmark = pytest.mark.slow

TENANTS = """
defaults: {max_tokens: 64}
tenants:
  flood: {weight: 1}
  light: {weight: 1}
  heavy: {weight: 3}
  slim: {weight: 1}
  capped: {max_inflight: 3, max_prompt_tokens: 40, tokens_per_minute: 2000}
  killme: {}
  waiting: {}
  adopt: {max_tokens: 200}
"""


@pytest.fixture(autouse=True)
def _mock_speed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_MOCK_STEP_MS", "4")  # inherited by the worker processes


def _spawn_router(url: str, logs: Path, tenants: Path, worker_id: str = "router-q"):  # type: ignore[no-untyped-def]
    return spawn_service("splitserve.services.router", "--tenants", str(tenants), "--disagg-threshold", "1000000000",
                         "--queue-ack-wait-s", "3", nats_url=url, worker_id=worker_id, log_dir=logs)


def _spawn_decoder(url: str, logs: Path, worker_id: str, max_batch: int = 4,  # type: ignore[no-untyped-def]
                   step_ms: int | None = None):
    # step_ms: the mock engine's time per decode step for this worker (default: the environment's)
    env = None if step_ms is None else dict(os.environ, SPLITSERVE_MOCK_STEP_MS=str(step_ms))
    return spawn_service("splitserve.services.decode", "--engine", "mock", "--transport", "tcp", "--max-batch",
                         str(max_batch),
                         nats_url=url, worker_id=worker_id, log_dir=logs, env=env)


def _own_stack(nats: NatsServer, tmp_path: Path) -> tuple[str, Path, Path]:
    """URL, log folder and tenants file for a test that runs a router of its own on its own server."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    return nats.url, tmp_path / "logs", tenants


@pytest.fixture(scope="module")
def stack(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    logs = Path(tmp_path_factory.mktemp("logs"))
    tenants = logs / "tenants.yaml"
    tenants.write_text(TENANTS)
    mp = pytest.MonkeyPatch()
    mp.setenv("SPLITSERVE_MOCK_STEP_MS", "4")
    procs = [_spawn_router(nats_server.url, logs, tenants), _spawn_decoder(nats_server.url, logs, "decode-q")]
    mp.undo()
    try:
        asyncio.run(wait_ready(nats_server.url, ["router-q", "decode-q"], timeout=180))
        yield nats_server.url, logs, tenants
    finally:
        stop(*procs)
        for name in ("router-q", "decode-q"):
            log = logs / f"{name}.log"
            print(f"--- {name}\n{log.read_text(errors='replace')[-2500:] if log.exists() else ''}")


def _routed_ms(r: Result) -> float:
    """When the router dispatched it (the request's creation + its queue wait)."""
    assert r.timings.queue_ms is not None
    return r.timings.queue_ms


async def _collect(client: Client, rids: list[str], timeout: float = 240.0) -> list[Result]:
    out: list[Result] = []
    deadline = time.monotonic() + timeout
    for rid in rids:
        res = await client.result(rid, wait=max(0.0, deadline - time.monotonic()))
        assert res is not None, f"no result for {rid}"
        out.append(res)
    return out


async def test_flood_does_not_hold_up_a_light_tenant(stack: tuple[str, Path, Path]) -> None:
    url, _, _ = stack
    watch = await nats.connect(url)
    notes: list[str] = []

    async def on_note(m: Msg) -> None:
        notes.append(m.subject)

    await watch.subscribe("ss.routed.>", cb=on_note)
    async with Client(url, tenant="flood") as fc, Client(url, tenant="light") as lc:
        t0 = time.time() * 1000
        flood_ids = await asyncio.gather(*(fc.submit(f"flood {i}", max_tokens=8) for i in range(500)))
        accepted_all = time.time() * 1000
        light = await asyncio.gather(*(lc.complete(f"light {i}", max_tokens=8) for i in range(5)))
        flood = await _collect(fc, list(flood_ids))
    assert all(r.finish_reason == "length" and len(r.token_ids) == 8 for r in flood + light)
    await watch.close()
    assert notes == []  # a router alone tells no peer where it routed (DispatchNote: only with other routers live)
    light_wait = [r.timings.queue_ms or 0.0 for r in light]
    flood_wait = [r.timings.queue_ms or 0.0 for r in flood]
    print(f"flood: 500 accepted in {accepted_all - t0:.0f} ms; queue wait p50 {statistics.median(flood_wait):.0f} "
          f"max {max(flood_wait):.0f} ms; light: max {max(light_wait):.0f} ms")
    # The light tenant waited behind at most a few of the flood's requests, not behind the flood.
    assert max(light_wait) < 0.25 * max(flood_wait)
    # Most of the flood was still waiting when the light tenant was served.
    later = sum(1 for r in flood if (r.timings.queue_ms or 0) > max(light_wait) + (accepted_all - t0))
    assert later > 200, later


async def test_token_shares_follow_weights(stack: tuple[str, Path, Path]) -> None:
    url, _, _ = stack
    async with Client(url, tenant="heavy") as hc, Client(url, tenant="slim") as sc:
        jobs: list[tuple[str, Client, asyncio.Future[str]]] = []
        for i in range(120):
            for name, c in (("heavy", hc), ("slim", sc)):
                jobs.append((name, c, asyncio.ensure_future(c.submit(f"{name} {i}: same size", max_tokens=8))))
        rids = [(name, c, await fut) for name, c, fut in jobs]
        results = [(name, (await _collect(c, [rid]))[0]) for name, c, rid in rids]
        async with await nats.connect(url) as nc:
            report = await queue_report(nc)
    # Order of dispatch: absolute routed time = created + queue wait; created ~ equal across the burst.
    order = sorted(results, key=lambda nr: nr[1].timings.queue_ms or 0.0)
    first = Counter(name for name, _ in order[20:100])  # both still backlogged here
    ratio = first["heavy"] / max(1, first["slim"])
    served = {t.tenant: t.served_tokens for t in report.tenants}
    print(f"dispatches 20-100: {dict(first)} ratio {ratio:.2f} (weights 3:1); served tokens {served}")
    assert 2.0 <= ratio <= 4.5
    assert all(r.finish_reason == "length" for _, r in results)


async def test_quota_refusals_are_precise_and_cost_nothing_else(stack: tuple[str, Path, Path]) -> None:
    url, _, _ = stack
    async with Client(url, tenant="capped") as c:
        with pytest.raises(errors.PromptTooLong, match="max_prompt_tokens"):
            await c.complete("word " * 80, max_tokens=4)
        with pytest.raises(errors.BadRequest, match="max_tokens"):
            await c.complete("hi", max_tokens=65)  # over the file's default max_tokens of 64
        # max_inflight 3: hold three in flight (long outputs), the fourth is refused with a retry-after
        held = [c.generate("hold", max_tokens=60) for _ in range(3)]
        its = [g.__aiter__() for g in held]
        for it in its:
            await it.__anext__()  # accepted and streaming
        with pytest.raises(errors.QuotaExceeded, match="max_inflight") as ei:
            await c.complete("one more", max_tokens=4)
        assert ei.value.retryable and ei.value.retry_after_s is not None
        for it in its:
            await _drain(it)
        # the refusal lost nothing: the three finish whole
        assert all(g.result is not None and len(g.result.token_ids) == 60 for g in held)
        # tokens_per_minute 2000: each request reserves prompt + max_tokens; the minute runs out
        with pytest.raises(errors.QuotaExceeded, match="tokens_per_minute") as ei:
            for _ in range(40):
                await c.complete("word " * 30, max_tokens=64)
        assert ei.value.retry_after_s is not None and 0 < ei.value.retry_after_s <= 60
    async with Client(url, tenant="nobody") as c:
        with pytest.raises(errors.SplitserveError) as ei:
            await c.complete("hi", max_tokens=2)
        assert ei.value.code == proto.ErrorCode.UNKNOWN_TENANT


async def _drain(it: AsyncIterator[object]) -> int:
    n = 0
    async for _ in it:
        n += 1
    return n


async def test_cancel_and_deadline_while_queued(fresh_nats: NatsServer, tmp_path: Path) -> None:
    # A stack of its own whose only decoder is busy with long requests, so the next ones wait in the queue.
    url, logs, tenants = _own_stack(fresh_nats, tmp_path)  # a server of its own: no other test's router
    procs = [_spawn_router(url, logs, tenants, "router-w"),
             _spawn_decoder(url, logs, "decode-w", max_batch=1, step_ms=50)]  # 64 tokens: 3.2 s per request
    try:
        await wait_ready(url, ["router-w", "decode-w"], timeout=180)
        async with Client(url, tenant="waiting") as c:
            busy = [await c.submit("busy", max_tokens=64) for _ in range(3)]
            cancelled = c.generate("to cancel", max_tokens=4)
            it = cancelled.__aiter__()
            task = asyncio.ensure_future(_drain(it))
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            await cancelled.cancel()
            await task
            assert cancelled.result is not None and cancelled.result.finish_reason == "cancelled"
            assert time.monotonic() - t0 < 2.0  # ended while queued, not when it reached the decoder
            exp = await c.complete("deadline", max_tokens=4, timeout=0.5)
            assert exp.finish_reason == "expired" and exp.token_ids == []
            # priority classes within a tenant: urgent requests sent after low-priority ones run before them
            low = [await c.submit(f"low {i}", max_tokens=2, priority=9) for i in range(2)]
            high = [await c.submit(f"high {i}", max_tokens=2, priority=0) for i in range(2)]
            low_r = [await c.result(rid, wait=60) for rid in low]
            high_r = [await c.result(rid, wait=60) for rid in high]
            assert all(r is not None for r in low_r + high_r)
            assert max(r.timings.queue_ms or 0 for r in high_r if r) < min(r.timings.queue_ms or 0 for r in low_r if r)
            for rid in busy:
                r = await c.result(rid, wait=60)
                assert r is not None and len(r.token_ids) == 64
    finally:
        stop(*procs)


async def test_router_killed_mid_load_loses_no_accepted_request(fresh_nats: NatsServer, tmp_path: Path) -> None:
    url, logs, tenants = _own_stack(fresh_nats, tmp_path)  # a server of its own: no other test's router
    router = _spawn_router(url, logs, tenants, "router-k1")
    decoders = [_spawn_decoder(url, logs, "decode-k1"), _spawn_decoder(url, logs, "decode-k2")]
    terminals: Counter[str] = Counter()
    kinds: dict[str, str] = {}
    try:
        await wait_ready(url, ["router-k1", "decode-k1", "decode-k2"], timeout=180)
        watch = await nats.connect(url)

        async def count(msg: object) -> None:
            data = msg.data  # type: ignore[attr-defined]
            try:
                m = proto.decode_stream(data)
            except proto.ProtocolError:
                return
            if isinstance(m, (StreamFinal, StreamError)) and m.request_id:
                # A streaming request's end is sent live and stored as a copy (one Nats-Msg-Id for both):
                # count distinct terminal messages.
                msg_id = (msg.headers or {}).get("Nats-Msg-Id")  # type: ignore[attr-defined]
                if msg_id is None or msg_id not in seen_ids:
                    seen_ids.add(msg_id or "")
                    terminals[m.request_id] += 1
                kinds[m.request_id] = m.kind

        seen_ids: set[str] = set()
        await watch.subscribe("ss.result.killme.>", cb=count)
        await watch.subscribe("ss.stream.killme.>", cb=count)
        async with Client(url, tenant="killme") as c:
            rids = list(await asyncio.gather(*(c.submit(f"job {i}", max_tokens=16) for i in range(200))))
            streams = [asyncio.ensure_future(c.complete(f"stream {i}", max_tokens=16)) for i in range(20)]
            deadline = time.monotonic() + 60
            while len(terminals) < 10 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # some done, some running, most queued
            done_before = len(terminals)
            router.kill()  # SIGKILL: no goodbye, its un-acked queue messages are redelivered later
            router.wait()
            await asyncio.sleep(1.0)
            router = _spawn_router(url, logs, tenants, "router-k2")
            await wait_ready(url, ["router-k2"], timeout=180)
            stream_results = await asyncio.gather(*streams, return_exceptions=True)
            results = await _collect(c, rids, timeout=240)
        await asyncio.sleep(4.0)  # past the ack wait: anything delivered twice would show up now
        await watch.close()
        print(f"{done_before} ended before the kill; terminal kinds {Counter(kinds.values())}")
        assert 0 < done_before < 200
        assert all(not isinstance(r, BaseException) for r in stream_results), stream_results
        assert len(results) == 200 and all(r.finish_reason == "length" for r in results)
        every = set(rids) | {r.request_id for r in stream_results if isinstance(r, Result)}
        assert len(every) == 220
        twice = {rid: n for rid, n in terminals.items() if n != 1}
        assert not twice, f"requests with more than one terminal message: {twice}"
        assert set(terminals) == every
        async with await nats.connect(url) as nc:
            usage = sum_usage(await read_usage(nc, tenant="killme"))
        assert usage["killme"].requests == 220 and usage["killme"].ok == 220
        # The kill left requests mid-flight whose queue messages came back to the new router: it recognised
        # them (finished meanwhile, or still running on a decoder) instead of running them again.
        log2 = (logs / "router-k2.log").read_text()
        assert "redelivered_already_finished" in log2 or "redelivered_adopted" in log2
    finally:
        stop(router, *decoders)
        for name in ("router-k1", "router-k2"):
            log = logs / f"{name}.log"
            print(f"--- {name}\n{log.read_text(errors='replace')[-2500:] if log.exists() else ''}")


def test_queues_and_usage_commands(stack: tuple[str, Path, Path]) -> None:
    import json
    import subprocess
    import sys

    url, _, _ = stack
    exe = str(Path(sys.executable).parent / "splitserve")

    async def traffic() -> list[Result]:
        async with Client(url, tenant="light") as c:
            return list(await asyncio.gather(*(c.complete(f"metered {i}", max_tokens=5) for i in range(3))))

    done = asyncio.run(traffic())
    out = subprocess.run([exe, "queues", "--nats-url", url, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    rows = {r["tenant"]: r for r in rep["tenants"]}
    assert rows["light"]["served_tokens"] > 0 and rows["heavy"]["weight"] == 3
    assert {"queued", "oldest_wait_ms", "accepted_per_s", "queued_by_class"} <= set(rows["light"])
    import os

    table = subprocess.run([exe, "queues", "--nats-url", url], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, COLUMNS="200"))
    assert table.returncode == 0 and "light" in table.stdout

    out = subprocess.run([exe, "usage", "--nats-url", url, "--since", "1h", "--tenant", "light", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    light = json.loads(out.stdout)["light"]
    assert light["ok"] >= 3
    # the three just sent are in the sums, token for token
    assert light["completion_tokens"] >= sum(len(r.token_ids) for r in done)
    assert light["prompt_tokens"] >= sum(r.usage.prompt_tokens for r in done)
    bad = subprocess.run([exe, "usage", "--nats-url", url, "--since", "soon"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode != 0 and "--since" in bad.stderr


async def test_new_router_adopts_requests_still_running(fresh_nats: NatsServer, tmp_path: Path) -> None:
    # Requests that outlive the ack wait: when their router dies, the new router finds them in the decoder's
    # heartbeat and adopts them (no second run); it then still watches them, so a decoder death afterwards
    # is reported as worker_died rather than leaving the caller waiting.
    url, logs, tenants = _own_stack(fresh_nats, tmp_path)  # a server of its own: no other test's router
    router = _spawn_router(url, logs, tenants, "router-a1")
    slow = _spawn_decoder(url, logs, "decode-slow", max_batch=4, step_ms=300)
    procs = [slow]
    try:
        await wait_ready(url, ["router-a1", "decode-slow"], timeout=180)
        async with Client(url, tenant="adopt", idle_timeout=60) as c:
            gens = [c.generate(f"long {i}", max_tokens=200) for i in range(3)]  # ~60 s each: outlive a slow restart
            its = [g.__aiter__() for g in gens]
            for it in its:
                await it.__anext__()  # running on the decoder
            router.kill()
            router.wait()
            router = _spawn_router(url, logs, tenants, "router-a2")
            await wait_ready(url, ["router-a2"], timeout=180)
            # let the ack wait (3 s) pass so the messages are redelivered and adopted, then kill the decoder
            deadline = time.monotonic() + 30
            log2 = logs / "router-a2.log"
            while time.monotonic() < deadline and (not log2.exists() or
                                                    log2.read_text().count("redelivered_adopted") < 3):
                await asyncio.sleep(0.2)
            assert log2.read_text().count("redelivered_adopted") == 3
            assert "routed" not in log2.read_text()  # nothing ran twice
            slow.kill()
            for it in its:
                with pytest.raises(errors.WorkerDied, match="decode-slow"):
                    await _drain(it)
    finally:
        stop(router, *procs)


async def test_request_cancelled_in_queue_stays_cancelled_across_a_router_restart(fresh_nats: NatsServer,
                                                                                    tmp_path: Path) -> None:
    # The cancelled final went out while the request waited; a new router must not run it when it reaches
    # the head of the queue (the router that saw the cancel is gone, its RequestFinished is in SS_USAGE).
    url, logs, tenants = _own_stack(fresh_nats, tmp_path)  # a server of its own: no other test's router
    router = _spawn_router(url, logs, tenants, "router-c1")
    dec = _spawn_decoder(url, logs, "decode-c", max_batch=1, step_ms=100)
    terminals: Counter[str] = Counter()
    try:
        await wait_ready(url, ["router-c1", "decode-c"], timeout=180)
        watch = await nats.connect(url)

        async def count(msg: object) -> None:
            m = proto.decode_stream(msg.data)  # type: ignore[attr-defined]
            if isinstance(m, (StreamFinal, StreamError)) and m.request_id:
                terminals[m.request_id] += 1

        await watch.subscribe("ss.result.waiting.>", cb=count)
        async with Client(url, tenant="waiting") as c:
            busy = [await c.submit("busy", max_tokens=30) for _ in range(3)]  # ~3 s each, one at a time
            victim = await c.submit("never run me", max_tokens=4)
            await c.cancel(victim)
            first = await c.result(victim, wait=10)
            assert first is not None and first.finish_reason == "cancelled"
            router.kill()
            router.wait()
            router = _spawn_router(url, logs, tenants, "router-c2")
            await wait_ready(url, ["router-c2"], timeout=180)
            for rid in busy:
                assert (r := await c.result(rid, wait=60)) is not None and len(r.token_ids) == 30
        await asyncio.sleep(4.0)  # past the ack wait
        await watch.close()
        assert terminals[victim] == 1
        assert victim not in (logs / "decode-c.log").read_text()  # never reached a decoder
    finally:
        stop(router, dec)


async def test_resending_a_finished_request_id_is_refused_not_rerun(stack: tuple[str, Path, Path]) -> None:
    url, _, _ = stack
    async with Client(url, tenant="light") as c:
        done = await c.complete("once only", max_tokens=3, request_id="fixed-id-1")
        assert len(done.token_ids) == 3
        await asyncio.sleep(0.5)  # its RequestFinished reaches SS_USAGE
        with pytest.raises(errors.BadRequest, match="already ended"):
            await c.complete("once only", max_tokens=3, request_id="fixed-id-1")
