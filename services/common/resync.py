"""Resyncing an index replica with one worker after a gap in its KV-event sequence (torch-free: the router
and the cache-index service use it)."""

from __future__ import annotations

from typing import Any

from splitserve.cache.index import PrefixIndex
from splitserve.proto import KvHeld, KvHeldRequest, Subjects
from splitserve.runtime.bus import Bus


async def resync_index(bus: Bus, index: PrefixIndex, worker_id: str, log: Any) -> None:
    """Events from this worker were lost: replace what the index believes it holds with its own dump."""
    try:
        reply = await bus.request(Subjects.kv_held(worker_id), KvHeldRequest(), KvHeld, timeout=5.0)
    except Exception as exc:
        log.warning("kv_resync_failed", target=worker_id, error=str(exc))
        return
    if isinstance(reply, KvHeld):
        index.resync(worker_id, reply.seq, reply.held)
        log.info("kv_resynced", target=worker_id, seq=reply.seq, blocks=sum(len(v) for v in reply.held.values()))
