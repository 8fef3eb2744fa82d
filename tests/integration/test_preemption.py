"""Priority preemption on a real stack: nats-server, one router with a tenants file, one mock-engine decoder with
``--max-batch 2`` and a decode step cost. Tenant ``bulk`` (class 5) fills every decode slot with long
generations and queues more; then ``urgent`` (class 0) sends a request.

- ``bulk`` burst-funded: urgent's first token comes at once (a running bulk request is preempted, moved over
  prompt + tokens so far), far sooner than the time bulk's running requests still needed; every bulk request
  ends token-identical to an unpreempted reference run of its prompt (greedy), its seq numbers unbroken, nothing
  lost or duplicated; the router logged ``preempted``;
- ``bulk`` inside its guarantee (``decode_slots: {guaranteed: 2}``): nothing is preempted, urgent waits for a
  slot like anyone.

(With ``--no-preempt`` the first case fails: urgent's first token waits for a bulk request to end.)
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from splitserve.client import Client, Delta, Generation, Result
from splitserve.natsserver import start_nats
from tests.procs import log_events, spawn_service, stop, wait_ready

pytestmark = pytest.mark.slow

STEP_MS = 25
BULK_TOKENS = 120
PROMPTS = ["Bulk job zero: summarise the archive.", "Bulk job one: translate the ledger."]


@dataclass
class Stack:
    url: str
    tmp: Path
    refs: list[Result] = field(default_factory=list)  # unpreempted reference runs of PROMPTS (made once)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """nats-server and the decoder, shared by the cases (each starts a router of its own: its tenants file)."""
    tmp = tmp_path_factory.mktemp("preempt")
    srv = start_nats(tmp / "nats", port=None)
    env = dict(os.environ, SPLITSERVE_MOCK_STEP_MS=str(STEP_MS))
    dec = spawn_service("splitserve.services.decode", "--engine", "mock", "--transport", "tcp", "--max-batch", "2",
                        nats_url=srv.url, worker_id="decode-p", log_dir=tmp / "logs", env=env)
    try:
        yield Stack(srv.url, tmp)
    finally:
        stop(dec)
        srv.stop()


@pytest.fixture
def router(stack: Stack, request: pytest.FixtureRequest) -> Iterator[Callable[[str], Awaitable[Path]]]:
    """Starts this case's router with ``bulk``'s ``decode_slots`` contract; returns its log file."""
    procs: list[subprocess.Popen[bytes]] = []

    async def start(bulk_contract: str) -> Path:
        name = f"router-{request.node.name[5:20]}"
        tenants = stack.tmp / f"{name}.yaml"
        tenants.write_text("tenants:\n"
                           "  bulk:\n    priority: 5\n    max_queued: 50\n"
                           f"    contract:\n      decode_slots: {bulk_contract}\n"
                           "  urgent:\n    priority: 0\n")
        procs.append(spawn_service(
            "splitserve.services.router", "--tenants", str(tenants), "--disagg-threshold", "1000000000",
            "--queue-ack-wait-s", "5", *_extra_router_args(), nats_url=stack.url, worker_id=name,
            log_dir=stack.tmp / "logs"))
        await wait_ready(stack.url, [name, "decode-p"], timeout=180)
        return stack.tmp / "logs" / f"{name}.log"

    yield start
    stop(*procs)


def _extra_router_args() -> list[str]:
    return os.environ.get("SPLITSERVE_TEST_ROUTER_ARGS", "").split()  # e.g. --no-preempt, to see the test fail


async def _stream(gen: Generation) -> tuple[list[Delta], Result, float, float]:
    """Deltas, result, and when (monotonic) the first token and the end arrived."""
    deltas: list[Delta] = []
    first = 0.0
    async for d in gen:
        if not deltas:
            first = time.monotonic()
        deltas.append(d)
    assert gen.result is not None
    return deltas, gen.result, first, time.monotonic()


async def _flood_then_urgent(stack: Stack) -> tuple[list[tuple[str, int, list[Delta], Result, float, float]],
                                                     float, Result, float, list[Result]]:
    """References first; then bulk fills the decoder (2 running + 1 queued on it) and queues one more; then
    urgent asks. Returns bulk's (request id, prompt index, deltas, result, first token at, end at), when urgent
    was sent, urgent's result, its first token time, and the references."""
    url = stack.url
    async with Client(url, tenant="bulk", idle_timeout=90) as bc, Client(url, tenant="urgent", idle_timeout=90) as uc:
        if not stack.refs:
            stack.refs = list(await asyncio.gather(*(bc.generate(p, max_tokens=BULK_TOKENS, ignore_eos=True)
                                                     .collect() for p in PROMPTS)))
        refs = stack.refs
        assert all(r.finish_reason == "length" and len(r.token_ids) == BULK_TOKENS for r in refs)
        gens: list[tuple[int, Generation]] = []
        tasks = []
        for i in range(4):  # one at a time, so the decoder admits them in this order
            gen = bc.generate(PROMPTS[i % 2], max_tokens=BULK_TOKENS, ignore_eos=True)
            gens.append((i % 2, gen))
            tasks.append(asyncio.ensure_future(_stream(gen)))
            await asyncio.sleep(0.15)
        await asyncio.sleep(1.0)  # the two running ones are well into their generations
        sent = time.monotonic()
        ugen = uc.generate("Urgent: is the building on fire?", max_tokens=20, ignore_eos=True)
        _, ures, ufirst, _ = await _stream(ugen)
        done = await asyncio.wait_for(asyncio.gather(*tasks), 90)
    bulk = [(g.request.request_id, p, *d) for (p, g), d in zip(gens, done, strict=True)]
    return bulk, sent, ures, ufirst, list(refs)


def _preempted(log: str) -> list[dict[str, object]]:
    return log_events(log, "preempted")


async def test_urgent_preempts_burst_funded_bulk_and_nothing_is_lost(
        stack: Stack, router: Callable[[str], Awaitable[Path]]) -> None:
    log = await router("{burst: 50}")
    bulk, sent, ures, ufirst, refs = await _flood_then_urgent(stack)
    assert ures.finish_reason == "length" and len(ures.token_ids) == 20
    for rid, p, deltas, res, _, _ in bulk:  # every bulk request whole, as an unpreempted run gives it
        assert [d.seq for d in deltas] == list(range(len(deltas))), rid  # every seq once, in order
        assert [t for d in deltas for t in d.token_ids] == res.token_ids == refs[p].token_ids, rid
        assert res.text == refs[p].text and res.finish_reason == "length", rid
        assert res.usage.completion_tokens == BULK_TOKENS
    events = _preempted(log.read_text())
    # Urgent's first token came long before bulk's running requests could have freed a slot: the time the
    # unpreempted one of the two still needed after urgent was sent.
    victims = {str(ev["request_id"]) for ev in events}
    still_needed = min(b[5] for b in bulk[:2] if b[0] not in victims) - sent
    ttft = ufirst - sent
    print(f"urgent TTFT {ttft * 1000:.0f} ms; the running bulk request still needed {still_needed * 1000:.0f} ms; "
          f"a bulk request took {(bulk[0][5] - bulk[0][4]) * 1000:.0f} ms from its first token; "
          f"{len(events)} preemption(s)")
    # Without preemption urgent waits for that request to end (TTFT >= still_needed). Under a loaded machine the
    # router's and decoder's handoff slows more than the pinned decode steps do (CI, 4 stacks on 2 cores: 764 ms
    # for 1,806 ms), so the bound is a clear fraction of the wait, not a small one.
    assert ttft < 0.6 * still_needed, (ttft, still_needed)
    assert len(events) == 1, events  # one urgent request: one preemption
    ev = events[0]
    assert ev["tenant"] == "bulk" and ev["priority_class"] == 5 and ev["by_tenant"] == "urgent"
    assert ev["by_request"] == ures.request_id and ev["request_id"] in {b[0] for b in bulk[:2]}


async def test_bulk_inside_its_guarantee_is_not_preempted(
        stack: Stack, router: Callable[[str], Awaitable[Path]]) -> None:
    log = await router("{guaranteed: 2, burst: 50}")
    bulk, sent, ures, ufirst, refs = await _flood_then_urgent(stack)
    assert ures.finish_reason == "length"
    for rid, p, deltas, res, _, _ in bulk:
        assert [d.seq for d in deltas] == list(range(len(deltas))), rid
        assert res.token_ids == refs[p].token_ids, rid
    assert _preempted(log.read_text()) == []
    # urgent waited for a running bulk request to end
    first_end = min(b[5] for b in bulk[:2])
    print(f"urgent TTFT {(ufirst - sent) * 1000:.0f} ms; the first running bulk request ended "
          f"{(first_end - sent) * 1000:.0f} ms after urgent was sent")
    assert ufirst >= first_end - 0.2
