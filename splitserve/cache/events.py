"""KV cache events: what a worker tells the rest of the system about the blocks it holds.

One vocabulary end to end: the wire models of ``proto.messages`` (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` inside a sequenced ``KvEventBatch``, after vLLM's ``vllm/distributed/kv_events.py``) are
also what a worker's prefix store emits, what the index applies and what the simulator passes around. (There were
two: slotted dataclasses here and the pydantic models on the wire, converted batch by batch on the routers' hot
path.) Hot paths build them with the constructors below, which skip validation: their inputs are the caller's
own block hashes, and whatever comes off the wire was validated when it was decoded.

Media (tiers): ``"gpu"`` is the engine's main KV pool (accelerator memory; on CPU-only workers the engine's
own KV tier), ``"cpu"`` is the host-memory L1 offload cache. Other names are accepted and indexed as their
own tier. The wire models lower-case them because vLLM spells them ``"GPU"`` / ``"CPU"``.

Sequence numbers are per worker and start at 0; each batch is the previous seq + 1. A jump means batches
were lost and the index must resync that worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from pydantic import TypeAdapter

from splitserve.proto import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, now_ms

__all__ = [
    "CPU",
    "GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KvEvent",
    "KvEventBatch",
    "batch",
    "cleared",
    "event_from_dict",
    "removed",
    "stored",
]

GPU: Final = "gpu"
CPU: Final = "cpu"


def stored(block_hashes: list[int], parent_block_hash: int | None = None, *, block_size: int, medium: str = GPU,
           token_ids: list[int] | None = None, lora_id: int | None = None) -> BlockStored:
    """Full blocks now cached, in chain order; ``parent_block_hash`` precedes the first one."""
    return BlockStored.model_construct(block_hashes=block_hashes, parent_block_hash=parent_block_hash,
                                       token_ids=token_ids, block_size=block_size, lora_id=lora_id, medium=medium)


def removed(block_hashes: list[int], medium: str = GPU) -> BlockRemoved:
    """Blocks evicted from one tier."""
    return BlockRemoved.model_construct(block_hashes=block_hashes, medium=medium)


def cleared(medium: str | None = None) -> AllBlocksCleared:
    """Every block of one tier dropped, or of every tier when ``medium`` is None."""
    return AllBlocksCleared.model_construct(medium=medium)


def batch(worker_id: str, seq: int, events: list[KvEvent], ts_ms: float | None = None) -> KvEventBatch:
    """One worker's events, in order, with its per-worker sequence number (0, 1, 2, ...)."""
    return KvEventBatch.model_construct(worker_id=worker_id, seq=seq, events=events,
                                        ts_ms=now_ms() if ts_ms is None else ts_ms)


_EVENT: TypeAdapter[KvEvent] = TypeAdapter(KvEvent)
# vLLM's msgspec tag names, so its events can be fed in after a msgpack -> dict decode.
_VLLM_TAGS: Final = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}


def event_from_dict(d: Mapping[str, Any]) -> KvEvent:
    """An event from its dict (validated), with our tags or vLLM's."""
    tag = d.get("type")
    if isinstance(tag, str) and tag in _VLLM_TAGS:
        d = {**d, "type": _VLLM_TAGS[tag]}
    return _EVENT.validate_python(d)
