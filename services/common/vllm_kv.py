"""vLLM's own KV events, bridged onto splitserve's KV-event subjects.

vLLM publishes ``KVEventBatch`` (msgpack, via msgspec) on a ZMQ PUB socket as ``(topic, seq: 8 bytes
big-endian, payload)``, and keeps recent batches for a ROUTER replay socket (send ``(b"", start_seq)``; get
``(b"", topic, seq, payload)`` frames until seq -1). Its block hashes are its own (sha256 or builtin hash of
(parent, tokens, extra keys)); splitserve's router hashes token blocks itself (``splitserve.cache.hashing``,
xxh3 chains over ``route_block_size``-token blocks). So, like Dynamo's KV router, the bridge re-keys each
stored block from its tokens: one vLLM block of ``engine_block_size`` tokens becomes
``engine_block_size // route_block_size`` splitserve blocks chained from the parent's last one, and it keeps
vLLM hash -> splitserve hashes so removals map back. Routing therefore never depends on vLLM's hash
algorithm or ``PYTHONHASHSEED``; it only needs the engine block size to be a multiple of the router's.

The translated events go out as sequenced :class:`proto.KvEventBatch` on ``ss.kv.{worker}`` (seq 0 is an
``AllBlocksCleared``), and ``ss.kv.{worker}.held`` answers an index resync from the bridge's own map.

Cache salts: the workers hand vLLM each request's tenant salt (``cache_salt`` on the prompt), which vLLM mixes
into the first block's hash and publishes in that block's ``extra_keys``. The bridge roots a re-keyed chain at
the same salt (``hash_token_blocks(..., cache_salt=...)``), so the router's index matches a tenant's prompt
only against blocks stored under that tenant's salt, as with the hf engine's own store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from nats.aio.msg import Msg

from splitserve.cache.hashing import hash_token_blocks
from splitserve.proto import KvEventBatch, KvHeld, KvHeldRequest, Subjects
from splitserve.runtime.bus import Bus

log = logging.getLogger(__name__)

END_SEQ = -1


def _first_block_salt(ev: Any) -> str | None:
    """The ``cache_salt`` vLLM hashed into a chain's first block, from the event's per-block ``extra_keys``.

    vLLM publishes them untagged, in order: the LoRA name (a str, only when ``lora_name`` is set), multimodal
    ``(identifier, offset)`` pairs, the cache salt (a str, first block only), prompt-embeds digests (bytes).
    So the salt is the first string after the LoRA name. None when the request had no salt (or the vLLM
    build publishes no extra keys), which keys the chain as an unsalted prompt.
    """
    keys = getattr(ev, "extra_keys", None)
    first = keys[0] if keys else None
    if not first:
        return None
    strings = [k for k in first if isinstance(k, str)]
    if getattr(ev, "lora_name", None) is not None and strings:
        strings = strings[1:]
    return strings[0] if strings else None


class VllmKvBridge:
    def __init__(self, bus: Bus, worker_id: str, endpoint: str, replay_endpoint: str | None, *,
                 engine_block_size: int, route_block_size: int = 16) -> None:
        if engine_block_size % route_block_size:
            raise ValueError(f"vLLM block size {engine_block_size} is not a multiple of the router's "
                             f"{route_block_size}")
        self.bus = bus
        self.worker_id = worker_id
        # vLLM binds its PUB socket for wildcard / ipc endpoints and connects it otherwise: the bridge does
        # the opposite. The replay socket is always bound by vLLM.
        self.bind = not ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")))
        self.endpoint = endpoint.replace("*", "127.0.0.1")
        self.replay_endpoint = replay_endpoint.replace("*", "127.0.0.1") if replay_endpoint else None
        self.engine_block_size = engine_block_size
        self.route_block_size = route_block_size
        self.seq = 0  # our outgoing batch seq
        self.last_engine_seq: int | None = None
        # vLLM block hash -> (medium, our hashes for its sub-blocks, in order)
        self.blocks: dict[Any, tuple[str, list[int]]] = {}
        self.stored_events = 0
        self.removed_events = 0
        self._task: asyncio.Task[None] | None = None
        self._ctx: Any = None
        self._decoder: Any = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        import msgspec
        import zmq
        import zmq.asyncio
        from vllm.distributed.kv_events import KVEventBatch as VllmBatch

        self._decoder = msgspec.msgpack.Decoder(type=VllmBatch)
        self._ctx = zmq.asyncio.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if self.bind:
            sub.bind(self.endpoint)  # vLLM's PUB connects to a concrete tcp address, binds only wildcards/ipc
        else:
            sub.connect(self.endpoint)
        await self.bus.subscribe(Subjects.kv_held(self.worker_id), KvHeldRequest, self.on_held)
        await self._publish([{"type": "cleared", "medium": None}])
        self._task = asyncio.create_task(self._run(sub))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    async def _run(self, sub: Any) -> None:
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if self.last_engine_seq is not None and seq > self.last_engine_seq + 1:
                    await self._replay(self.last_engine_seq + 1, seq)
                if self.last_engine_seq is None or seq > self.last_engine_seq:
                    await self._handle(seq, payload)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("vllm_kv_bridge_failed")
        finally:
            sub.close(linger=0)

    async def _replay(self, start: int, upto: int) -> None:
        """Fetch the batches [start, upto) that the SUB socket missed from vLLM's replay buffer."""
        if self.replay_endpoint is None:
            log.warning("vllm_kv_gap start=%s upto=%s (no replay endpoint): the index will resync", start, upto)
            return
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), 5.0)
                if len(frames) != 4:
                    continue
                _, _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    break
                if seq < upto and (self.last_engine_seq is None or seq > self.last_engine_seq):
                    await self._handle(seq, payload)
        except TimeoutError:
            log.warning("vllm_kv_replay_timeout start=%s", start)
        finally:
            sock.close(linger=0)

    async def _handle(self, seq: int, payload: bytes) -> None:
        self.last_engine_seq = seq
        batch = self._decoder.decode(payload)
        out = self.translate(batch.events)
        if out:
            await self._publish(out)

    def translate(self, events: list[Any]) -> list[dict[str, Any]]:
        """vLLM events -> splitserve event dicts (the wire shape of ``proto.KvEvent``)."""
        out: list[dict[str, Any]] = []
        rb = self.route_block_size
        for ev in events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                medium = (ev.medium or "GPU").lower()
                tokens = list(ev.token_ids or [])
                parent = None
                if ev.parent_block_hash is not None:
                    known = self.blocks.get(ev.parent_block_hash)
                    if known is None:
                        # a chain whose start we never saw (events lost before a replay could help):
                        # without the parent's tokens the blocks cannot be re-keyed
                        log.warning("vllm_kv_unknown_parent blocks=%s", len(ev.block_hashes))
                        continue
                    parent = known[1][-1]
                    ours = hash_token_blocks(tokens, rb, parent=parent)
                else:  # a chain's first block: its hash is rooted at the request's salt, as the router's
                    ours = hash_token_blocks(tokens, rb, cache_salt=_first_block_salt(ev))
                size = ev.block_size or self.engine_block_size
                per = size // rb
                if len(ours) != per * len(ev.block_hashes):
                    log.warning("vllm_kv_bad_stored tokens=%s blocks=%s", len(tokens), len(ev.block_hashes))
                    continue
                for i, h in enumerate(ev.block_hashes):
                    self.blocks[h] = (medium, ours[i * per:(i + 1) * per])
                self.stored_events += 1
                out.append({"type": "stored", "block_hashes": ours, "parent_block_hash": parent,
                            "block_size": rb, "medium": medium})
            elif kind == "BlockRemoved":
                removed: list[int] = []
                medium = (ev.medium or "GPU").lower()
                for h in ev.block_hashes:
                    entry = self.blocks.pop(h, None)
                    if entry is not None:
                        removed.extend(entry[1])
                self.removed_events += 1
                if removed:
                    out.append({"type": "removed", "block_hashes": removed, "medium": medium})
            elif kind == "AllBlocksCleared":
                self.blocks.clear()
                out.append({"type": "cleared", "medium": None})
        return out

    async def _publish(self, events: list[dict[str, Any]]) -> None:
        async with self._lock:
            batch = KvEventBatch.model_validate({"worker_id": self.worker_id, "seq": self.seq, "events": events})
            self.seq += 1
            await self.bus.publish(Subjects.kv_events(self.worker_id), batch)

    def held(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for medium, hashes in self.blocks.values():
            out.setdefault(medium, []).extend(hashes)
        return out

    def num_blocks(self) -> int:
        return len(self.blocks)

    async def on_held(self, _: KvHeldRequest, msg: Msg) -> None:
        async with self._lock:
            await self.bus.respond(msg, KvHeld(worker_id=self.worker_id, seq=self.seq - 1, held=self.held()))
