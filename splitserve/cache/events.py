"""KV cache events: what a worker tells the rest of the system about the blocks it holds.

This module owns the in-process event structs. They follow vLLM's ``vllm/distributed/kv_events.py``
(``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` inside a sequenced batch) closely enough that
vLLM's own events can be bridged field for field, and their ``to_dict`` shape is the JSON/msgpack shape of
the wire models in ``proto.messages`` (tags ``"stored"`` / ``"removed"`` / ``"cleared"``, ``ts_ms``), so
``KvEventBatch.from_dict(wire_model.model_dump())`` works. They are plain slotted dataclasses because the
index applies millions of them per second: no validation happens here (the wire layer validates).

Media (tiers): ``"gpu"`` is the engine's main KV pool (accelerator memory; on CPU-only workers the engine's
own KV tier), ``"cpu"`` is the host-memory L1 offload cache. Other names are accepted and indexed as their
own tier. Names are lower-cased on the way in from dicts because vLLM spells them ``"GPU"`` / ``"CPU"``.

Sequence numbers are per worker and start at 0; each batch is the previous seq + 1. A jump means batches
were lost and the index must resync that worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "GPU",
    "CPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KvEvent",
    "KvEventBatch",
    "event_from_dict",
]

GPU: Final = "gpu"
CPU: Final = "cpu"


def _medium(value: Any, default: str | None) -> str | None:
    if value is None:
        return default
    return str(value).lower()


@dataclass(slots=True)
class BlockStored:
    """Full blocks now cached on a worker, in chain order; ``parent_block_hash`` precedes the first one."""

    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] | None = None  # all blocks' tokens, concatenated (vLLM sends them; optional here)
    block_size: int = 16
    lora_id: int | None = None
    medium: str = GPU

    TYPE = "stored"

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "stored",
            "block_hashes": list(self.block_hashes),
            "parent_block_hash": self.parent_block_hash,
            "token_ids": None if self.token_ids is None else list(self.token_ids),
            "block_size": self.block_size,
            "lora_id": self.lora_id,
            "medium": self.medium,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BlockStored:
        tok = d.get("token_ids")
        return cls(
            block_hashes=[int(h) for h in d["block_hashes"]],
            parent_block_hash=None if d.get("parent_block_hash") is None else int(d["parent_block_hash"]),
            token_ids=None if tok is None else [int(t) for t in tok],
            block_size=int(d.get("block_size", 16)),
            lora_id=d.get("lora_id"),
            medium=_medium(d.get("medium"), GPU) or GPU,
        )


@dataclass(slots=True)
class BlockRemoved:
    """Blocks a worker evicted from one tier."""

    block_hashes: list[int]
    medium: str = GPU

    TYPE = "removed"

    def to_dict(self) -> dict[str, Any]:
        return {"type": "removed", "block_hashes": list(self.block_hashes), "medium": self.medium}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BlockRemoved:
        return cls(
            block_hashes=[int(h) for h in d["block_hashes"]],
            medium=_medium(d.get("medium"), GPU) or GPU,
        )


@dataclass(slots=True)
class AllBlocksCleared:
    """The worker dropped every block of one tier, or of every tier when ``medium`` is None."""

    medium: str | None = None

    TYPE = "cleared"

    def to_dict(self) -> dict[str, Any]:
        return {"type": "cleared", "medium": self.medium}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AllBlocksCleared:
        return cls(medium=_medium(d.get("medium"), None))


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared

_BY_TAG: Final[dict[str, type[BlockStored] | type[BlockRemoved] | type[AllBlocksCleared]]] = {
    "stored": BlockStored,
    "removed": BlockRemoved,
    "cleared": AllBlocksCleared,
    # vLLM's msgspec tag names, so its events can be fed in after a msgpack -> dict decode.
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def event_from_dict(d: Mapping[str, Any]) -> KvEvent:
    tag = d.get("type")
    cls = _BY_TAG.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ValueError(f"unknown KV event type {tag!r}")
    return cls.from_dict(d)


@dataclass(slots=True)
class KvEventBatch:
    """One worker's events, in order, with its per-worker sequence number (0, 1, 2, ...)."""

    worker_id: str
    seq: int
    ts_ms: float = 0.0
    events: list[KvEvent] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "seq": self.seq,
            "ts_ms": self.ts_ms,
            "events": [e.to_dict() for e in self.events],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KvEventBatch:
        ts = d.get("ts_ms", d.get("ts", 0.0))
        events: Sequence[Mapping[str, Any]] = d.get("events") or ()
        return cls(
            worker_id=str(d["worker_id"]),
            seq=int(d["seq"]),
            ts_ms=float(ts or 0.0),
            events=[event_from_dict(e) for e in events],
        )
