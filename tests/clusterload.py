"""Steady load against a running stack while something is killed, and the bookkeeping that proves nothing was
lost or run twice. Shared by the NATS-cluster failover tests (and meant for the multi-router ones: start the
stack, then ``await run_load(url, tenant, kill=...)``).

- Streaming (``generate``) and async (``submit`` / ``result``) requests, each with its own request id; a request
  refused before it was accepted (a retryable error while the cluster fails over) is re-sent with the same id.
- ``accepted``: the router answered Accepted. ``completed``: its full result reached the client. ``lost``:
  accepted but never completed. ``duplicated``: more than one distinct terminal message on the wire for one
  request id (each terminal is stored once per ``Nats-Msg-Id``; a retried publish keeps its id), or more
  than one ``RequestFinished`` kept in ``SS_USAGE``.
- ``max_stall_s``: the longest time a client waited for anything (acceptance, the next delta, the result).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats

from splitserve import errors, proto
from splitserve.client import Client
from splitserve.discovery import server_list
from splitserve.proto import StreamError, StreamFinal


@dataclass
class LoadReport:
    accepted: set[str] = field(default_factory=set)
    completed: set[str] = field(default_factory=set)
    failed_after_accept: dict[str, str] = field(default_factory=dict)
    resent_before_accept: int = 0
    stalls: list[float] = field(default_factory=list)  # waits for acceptance, and between stream messages
    accept_stalls: list[float] = field(default_factory=list)
    terminal_ids: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    usage_records: dict[str, int] = field(default_factory=dict)
    killed_at: float | None = None

    @property
    def lost(self) -> set[str]:
        return self.accepted - self.completed

    @property
    def duplicated(self) -> dict[str, int]:
        dup = {rid: len(ids) for rid, ids in self.terminal_ids.items() if len(ids) > 1}
        dup.update({rid: n for rid, n in self.usage_records.items() if n > 1})
        return dup

    @property
    def max_stall_s(self) -> float:
        return max(self.stalls, default=0.0)

    def assert_nothing_lost(self, min_accepted: int) -> None:
        """Enough load was accepted, every accepted request completed once, and its end was stored once (the wire
        saw it; SS_USAGE keeps it)."""
        assert len(self.accepted) > min_accepted, self.summary()
        assert not self.lost, (self.summary(), sorted(self.lost)[:10], list(self.failed_after_accept.items())[:10])
        assert not self.failed_after_accept, list(self.failed_after_accept.items())[:10]
        assert not self.duplicated, self.duplicated
        assert set(self.usage_records) >= self.accepted

    def summary(self) -> str:
        return (f"accepted {len(self.accepted)}, completed {len(self.completed)}, lost {len(self.lost)}, "
                f"duplicated {len(self.duplicated)}, failed after accept {len(self.failed_after_accept)}, "
                f"re-sent before accept {self.resent_before_accept}, max client stall {self.max_stall_s:.2f} s "
                f"(submit accepted after at most {max(self.accept_stalls, default=0.0):.2f} s)")


async def _watch_terminals(url: str, tenant: str, report: LoadReport) -> Any:
    """Every terminal message's Nats-Msg-Id per request id, from the stored-copy subjects."""
    nc = await nats.connect(server_list(url), max_reconnect_attempts=-1, reconnect_time_wait=0.2)

    async def cb(msg: Any) -> None:
        try:
            m = proto.decode_stream(msg.data)
        except proto.ProtocolError:
            return
        if isinstance(m, (StreamFinal, StreamError)) and m.request_id:
            report.terminal_ids[m.request_id].add((msg.headers or {}).get("Nats-Msg-Id", uuid.uuid4().hex))

    await nc.subscribe(f"ss.result.{tenant}.>", cb=cb)
    return nc


async def usage_records(url: str, tenant: str) -> dict[str, int]:
    """RequestFinished records kept in SS_USAGE per request id of this tenant."""
    from nats.js.api import ConsumerConfig, DeliverPolicy
    from nats.js.errors import ServiceUnavailableError

    nc = await nats.connect(server_list(url))
    counts: dict[str, int] = defaultdict(int)
    try:
        js = nc.jetstream()
        # After a node was killed the cluster may still be electing its JetStream leaders: the observer's own
        # stream lookup then answers 503 "temporarily unavailable" (CI run 39). Asked again for up to 30 s.
        deadline = time.monotonic() + 30.0
        while True:
            try:
                sub = await js.subscribe(f"ss.evt.finished.{tenant}.*", ordered_consumer=True,
                                         config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
                break
            except (ServiceUnavailableError, nats.errors.TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        while True:
            try:
                msg = await sub.next_msg(timeout=2.0)
            except (TimeoutError, nats.errors.TimeoutError):
                break
            counts[msg.subject.rsplit(".", 1)[-1]] += 1
    finally:
        await nc.close()
    return dict(counts)


async def run_load(url: str, tenant: str, *, duration_s: float = 16.0, kill_at_s: float = 6.0,
                   kill: Callable[[], Any] | None = None, streams: int = 6, submit_every_s: float = 0.05,
                   max_tokens: int = 16, settle_s: float = 60.0, observer_url: str | None = None) -> LoadReport:
    """Run the load for ``duration_s`` (calling ``kill`` at ``kill_at_s``), then wait for every accepted request
    (up to ``settle_s``) and count. ``url``: the clients' NATS URL (comma-separated for a cluster);
    ``observer_url``: where the wire is watched and SS_USAGE read (default ``url``; not the node to be killed)."""
    report = LoadReport()
    observer_url = observer_url or url
    watcher = await _watch_terminals(observer_url, tenant, report)
    t0 = time.monotonic()
    stop_at = t0 + duration_s
    submitted: list[str] = []

    async def accept(send: Callable[[], Any], rid: str) -> Any:
        started = time.monotonic()
        while True:
            try:
                out = await send()
            except errors.SplitserveError as exc:
                if not (exc.retryable or isinstance(exc, (errors.Unavailable, errors.Timeout))):
                    raise
                report.resent_before_accept += 1
                await asyncio.sleep(0.2)
                continue
            report.stalls.append(time.monotonic() - started)
            report.accept_stalls.append(time.monotonic() - started)
            report.accepted.add(rid)
            return out

    async def streamer(c: Client, k: int) -> None:
        i = 0
        while time.monotonic() < stop_at:
            i += 1
            rid = f"s{k}-{i}-{uuid.uuid4().hex[:6]}"
            while True:
                gen = c.generate(f"stream {k} {i}", max_tokens=max_tokens, ignore_eos=True, request_id=rid)
                last = time.monotonic()
                try:
                    async for _ in gen:
                        now = time.monotonic()
                        report.stalls.append(now - last)
                        last = now
                except errors.SplitserveError as exc:
                    if gen.accepted is None and (exc.retryable or isinstance(exc, (errors.Unavailable,
                                                                                  errors.Timeout))):
                        report.resent_before_accept += 1
                        await asyncio.sleep(0.2)
                        continue  # never accepted: send it again (same id)
                    if gen.accepted is not None:
                        report.accepted.add(rid)
                    report.failed_after_accept[rid] = f"{type(exc).__name__}: {exc}"
                    break
                report.accepted.add(rid)
                report.stalls.append(time.monotonic() - last)
                if gen.result is not None and len(gen.result.token_ids) == max_tokens:
                    report.completed.add(rid)
                else:
                    report.failed_after_accept[rid] = f"incomplete result {gen.result}"
                break

    async def submitter(c: Client) -> None:
        i = 0
        while time.monotonic() < stop_at:
            i += 1
            rid = f"a{i}-{uuid.uuid4().hex[:6]}"
            def send(r: str = rid) -> Any:
                return c.submit(f"job {r}", max_tokens=max_tokens, ignore_eos=True, request_id=r)

            try:
                await accept(send, rid)
            except errors.SplitserveError as exc:
                report.failed_after_accept[rid] = f"refused: {exc}"
                continue
            submitted.append(rid)
            await asyncio.sleep(submit_every_s)

    async def killer() -> None:
        if kill is None:
            return
        await asyncio.sleep(kill_at_s)
        report.killed_at = time.monotonic() - t0
        await asyncio.to_thread(kill)

    try:
        async with Client(url, tenant=tenant, idle_timeout=60) as c:
            await asyncio.gather(killer(), submitter(c), *(streamer(c, k) for k in range(streams)))
            deadline = time.monotonic() + settle_s
            for rid in submitted:
                started = time.monotonic()
                try:
                    res = await c.result(rid, wait=max(0.0, deadline - time.monotonic()))
                except errors.SplitserveError as exc:
                    report.failed_after_accept[rid] = f"{type(exc).__name__}: {exc}"
                    continue
                if res is not None and len(res.token_ids) == max_tokens:
                    report.completed.add(rid)
                elif res is None:
                    report.failed_after_accept[rid] = f"no result within {settle_s:.0f}s of the end"
                del started
        await asyncio.sleep(1.0)  # late duplicates would show now
    finally:
        await watcher.close()
    report.usage_records = await usage_records(observer_url, tenant)
    return report
