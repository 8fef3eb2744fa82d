"""``ss.admin.cache.stats``: the cache-index service's answer (blocks per worker and tier, stream position) is what
its index holds, and survives the wire (``splitserve cache stats`` prints it)."""

from __future__ import annotations

from typing import Any

from splitserve import proto
from splitserve.cache.events import CPU, GPU, batch, removed, stored
from splitserve.proto import CacheStatsReply, CacheStatsRequest
from splitserve.services.cache_index.service import CacheIndexService


class _Bus:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def respond(self, msg: Any, reply: Any) -> None:
        self.sent.append(reply)


async def test_stats_report_blocks_per_worker_and_tier() -> None:
    svc = CacheIndexService("cache-index-t", "nats://unused", log_level="WARNING")
    bus = _Bus()
    svc.bus = bus  # type: ignore[assignment]
    svc.index.apply(batch("d0", 0, [stored([1, 2, 3], block_size=16), stored([1, 2], block_size=16, medium=CPU)]))
    svc.index.apply(batch("d0", 1, [removed([3])]))
    svc.index.apply(batch("d1", 0, [stored([1, 9], block_size=16)]))
    svc.applied_seq, svc.snapshot_seq = 7, 5
    await svc.on_stats(CacheStatsRequest(), None)  # type: ignore[arg-type]
    rep = proto.decode(proto.encode(bus.sent[0]), CacheStatsReply)
    assert rep.index_id == "cache-index-t" and rep.applied_seq == 7 and rep.snapshot_seq == 5
    assert rep.blocks == 3 and rep.blocks_by_medium == {GPU: 3, CPU: 2}  # 1, 2, 9 (3 was evicted)
    by = {w.worker_id: w for w in rep.workers}
    assert by["d0"].blocks == 2 and by["d0"].blocks_by_medium == {GPU: 2, CPU: 2} and by["d0"].last_batch_seq == 1
    assert by["d1"].blocks == 2 and by["d1"].blocks_by_medium == {GPU: 2} and by["d1"].last_batch_seq == 0
    assert rep.batches == 3 and rep.gaps == 0
