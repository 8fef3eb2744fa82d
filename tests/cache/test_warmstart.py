"""Warm start of an index replica (``splitserve.cache.warmstart``) on a real nats-server: snapshot + replay +
hand-off to the live subscription apply every batch exactly once, in each worker's order, also when batches
(a worker's restart among them) arrive while the replay runs; without a cache index it gives up at once; and
what it costs (printed: ``pytest -s``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgpack
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js.api import ObjectStoreConfig, StreamConfig

from splitserve import proto
from splitserve.cache.events import batch as make_batch
from splitserve.cache.events import cleared, stored
from splitserve.cache.index import PrefixIndex
from splitserve.cache.warmstart import BUCKET, SNAPSHOT_KEY, STREAM, WarmStart, WarmStartReport
from splitserve.natsserver import NatsServer
from splitserve.proto import KvEventBatch, Subjects


@pytest.fixture
async def nc(fresh_nats: NatsServer) -> AsyncIterator[NATS]:
    c = await nats.connect(fresh_nats.url)
    yield c
    await c.close()


class Worker:
    """A worker's KV event publisher (per-worker seq from 0; a restart starts over with a clear)."""

    def __init__(self, nc: NATS, wid: str) -> None:
        self.nc, self.wid, self.seq, self.next_hash = nc, wid, 0, int(wid[1:]) * 1_000_000

    def restart(self) -> None:
        self.seq = 0

    async def publish(self, blocks: int = 4) -> KvEventBatch:
        hashes = list(range(self.next_hash, self.next_hash + blocks))
        self.next_hash += blocks
        events = [cleared()] if self.seq == 0 else []
        b = make_batch(self.wid, self.seq, [*events, stored(hashes, block_size=16)])
        self.seq += 1
        await self.nc.publish(Subjects.kv_events(self.wid), proto.encode(b))
        return b


async def _setup_cache_index(nc: NATS) -> None:
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=[Subjects.KV_EVENTS_ALL]))
    await js.create_object_store(BUCKET, config=ObjectStoreConfig())


async def _stored(nc: NATS, published: int, timeout: float = 60.0) -> int:
    """Wait until the stream holds the ``published`` batches sent so far (they are plain publishes: a busy
    server stores them a while after the flush); its last sequence."""
    js = nc.jetstream()
    await nc.flush()
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        seq = int((await js.stream_info(STREAM)).state.last_seq)
        if seq >= published or asyncio.get_running_loop().time() > deadline:
            return seq
        await asyncio.sleep(0.05)


async def _snapshot(nc: NATS, reference: PrefixIndex, published: int) -> int:
    """What the cache-index service stores: the index as of the stream's last sequence (once the ``published``
    batches are stored)."""
    js = nc.jetstream()
    seq = await _stored(nc, published)
    store = await js.object_store(BUCKET)
    await store.put(SNAPSHOT_KEY, msgpack.packb({"stream_seq": seq, "index": reference.snapshot()}))
    return int(seq)


async def _warm(nc: NATS, replica: PrefixIndex, during: Callable[[], Awaitable[None]] | None = None,
                after: Callable[[], Awaitable[None]] | None = None,
                budget_s: float = 3.0) -> tuple[WarmStartReport, list[KvEventBatch]]:
    """Run a warm start as the router does, with a live subscription; ``during`` publishes once the live
    subscription exists (so those batches are both held and in the stream), ``after`` once it is live."""
    live_applied: list[KvEventBatch] = []
    warm = WarmStart(nc, replica.apply, replica.restore)

    async def on_live(msg: object) -> None:
        b = proto.decode(msg.data, KvEventBatch)  # type: ignore[attr-defined]
        if not warm.hold(b, msg.data):  # type: ignore[attr-defined]
            live_applied.append(b)
            replica.apply(b)

    async def subscribe_live() -> None:
        await nc.subscribe(Subjects.KV_EVENTS_ALL, cb=on_live)
        await nc.flush()
        if during is not None:
            await during()
            await nc.flush()

    rep = await warm.run(subscribe_live, budget_s)
    if after is not None:
        await after()
        await nc.flush()
        await asyncio.sleep(0.3)
    return rep, live_applied


def _same(replica: PrefixIndex, reference: PrefixIndex) -> None:
    assert replica.stats().worker_blocks == reference.stats().worker_blocks
    for w in reference.workers():
        assert replica.expected_seq(w) == reference.expected_seq(w), w
    assert replica.gaps == 0 and replica.stale_batches == 0  # nothing lost, nothing seen twice


async def test_snapshot_replay_and_live_handoff_apply_each_batch_once(nc: NATS) -> None:
    await _setup_cache_index(nc)
    reference = PrefixIndex()  # fed every batch once, in order: what the replica must equal
    w1, w2, w3 = Worker(nc, "w1"), Worker(nc, "w2"), Worker(nc, "w3")

    async def pub(w: Worker, n: int = 1) -> None:
        for _ in range(n):
            reference.apply(await w.publish())

    await pub(w1, 10)
    await pub(w3, 3)
    snap_seq = await _snapshot(nc, reference, 13)  # covers w1 0..9, w3 0..2
    await pub(w1, 10)  # after the snapshot: replayed
    await pub(w2, 5)
    await _stored(nc, 13 + 15)

    async def during() -> None:
        # Held by the live subscription AND in the stream before the replay reads its end: the overlap the
        # hand-off must apply once. w3 restarts here: its seq 0 applied twice would wipe what seq 1 stored.
        await pub(w1, 3)
        w3.restart()
        await pub(w3, 2)
        await pub(w2)
        await _stored(nc, 13 + 15 + 6)

    async def after() -> None:
        await pub(w1, 2)
        await pub(w3)

    replica = PrefixIndex()
    rep, live = await _warm(nc, replica, during, after)
    assert rep.snapshot_seq == snap_seq and rep.complete and rep.skipped is None, rep
    assert rep.replayed == 15 + 6  # after the snapshot: 15, plus the overlap (6, also held)
    assert rep.held == 6 and rep.duplicates == 6  # each held batch was the replay's: skipped at the hand-off
    assert len(live) == 3  # after the hand-off, applied live
    assert not rep.gaps
    _same(replica, reference)
    assert replica.restarts == 1  # w3's restart, once


async def test_held_batches_past_the_replay_are_applied_at_the_handoff(nc: NATS) -> None:
    """Batches that arrive while the replay runs and that it did not reach are applied from the hold."""
    await _setup_cache_index(nc)
    reference = PrefixIndex()
    w1 = Worker(nc, "w1")
    for _ in range(20):
        reference.apply(await w1.publish())
    replica = PrefixIndex()
    warm = WarmStart(nc, replica.apply, replica.restore)
    extra = [make_batch("w1", 20 + i, [stored([9_000_000 + i], block_size=16)]) for i in range(3)]

    async def subscribe_live() -> None:
        for b in extra:  # as if they came live before the replay's end: held, never in the stream
            assert warm.hold(b, proto.encode(b))
            reference.apply(b)

    rep = await warm.run(subscribe_live, 3.0)
    assert rep.snapshot_seq is None and rep.replayed == 20 and rep.held == 3 and rep.duplicates == 0
    _same(replica, reference)
    assert not warm.hold(extra[0], b"")  # live now: nothing is held any more


async def test_no_cache_index_gives_up_at_once(nc: NATS) -> None:
    replica = PrefixIndex()
    t0 = time.monotonic()
    rep, _ = await _warm(nc, replica)
    assert time.monotonic() - t0 < 1.0
    assert rep.skipped is not None and "no stream" in rep.skipped
    assert rep.snapshot_seq is None and rep.replayed == 0 and len(replica) == 0


async def test_stream_without_snapshot_replays_from_the_start(nc: NATS) -> None:
    await _setup_cache_index(nc)  # the cache index is up but has not snapshotted yet
    reference = PrefixIndex()
    w = Worker(nc, "w1")
    for _ in range(5):
        reference.apply(await w.publish())
    replica = PrefixIndex()
    rep, _ = await _warm(nc, replica)
    assert rep.snapshot_seq is None and rep.replayed == 5 and rep.complete
    _same(replica, reference)


async def test_the_time_bound_holds_and_what_was_loaded_stays(nc: NATS) -> None:
    await _setup_cache_index(nc)
    reference = PrefixIndex()
    w = Worker(nc, "w1")
    for _ in range(10_000):  # ~0.4 s to replay
        reference.apply(await w.publish())
    await _stored(nc, 10_000)
    replica = PrefixIndex()
    t0 = time.monotonic()
    rep, _ = await _warm(nc, replica, budget_s=0.15)
    assert time.monotonic() - t0 < 1.0
    assert not rep.complete and rep.skipped is not None and "time bound" in rep.skipped
    assert 0 < replica.expected_seq("w1") < 10_000  # a prefix applied; the next live batch resyncs the rest


async def test_warm_start_cost(nc: NATS) -> None:
    """The figures behind the README: load a snapshot of 64 workers x 2,000 blocks, replay 5,000 batches."""
    await _setup_cache_index(nc)
    reference = PrefixIndex()
    workers = [Worker(nc, f"w{i}") for i in range(64)]
    for w in workers:
        for _ in range(50):
            reference.apply(await w.publish(blocks=40))
    snap_seq = await _snapshot(nc, reference, 64 * 50)
    for i in range(5000):
        reference.apply(await workers[i % 64].publish(blocks=8))
    await _stored(nc, 64 * 50 + 5000)
    replica = PrefixIndex()
    rep, _ = await _warm(nc, replica, budget_s=10.0)
    assert rep.snapshot_seq == snap_seq and rep.replayed == 5000 and rep.complete
    _same(replica, reference)
    print(f"\nwarm start: snapshot of {len(reference):,} blocks / 64 workers loaded in {rep.snapshot_ms:.0f} ms; "
          f"{rep.replayed:,} batches replayed; total {rep.total_ms:.0f} ms")
