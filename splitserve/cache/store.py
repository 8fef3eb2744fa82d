"""PrefixKvStore: a worker's own cache of finished requests' KV, as reusable prefix blocks.

This module owns the worker-side prefix KV cache: which full blocks of which token prefixes a worker keeps,
in which tier, where their bytes live, what to evict, and the KV events that tell the rest of the system
about every change. A later request whose prompt starts with a cached prefix gets that prefix's KV back from
:meth:`PrefixKvStore.match` as one ``past_kv`` tensor, so the engine prefills only the rest.

Pure: torch only (no NATS, no asyncio, no engine imports). The worker drives it and publishes the events.

Identity: block ``i`` of a prompt is the chained xxh3 hash of :mod:`splitserve.cache.hashing` (the same
hashes the router and :class:`~splitserve.cache.index.PrefixIndex` use), scoped by ``cache_salt`` / LoRA,
so two tenants never share a block. Only full blocks are cached.

Tiers: ``"gpu"`` is the main tier (the engine's memory; plain RAM on CPU workers); ``"cpu"`` is an optional
L1 host-memory tier that main-tier evictions are demoted into. A block lives in exactly one tier. Each tier is
one tensor preallocated at construction, ``[num_layers, capacity, 2, num_kv_heads, block_size, head_dim]``
(the paged layout of :class:`splitserve.kv.pool.BlockPool`), plus a free list of slots; nothing is allocated
per block afterwards. The tensors are created with ``torch.empty``: on CPU the OS commits the pages only
when a slot is first written, so a large capacity costs address space, not RAM, until it fills.

Eviction: LRU per tier, kept so that it never orphans a block (leaves go before their parents). Two
invariants make that hold without any tree bookkeeping:

* **children before parents in every tier's LRU order.** Every operation that touches a block also touches
  its whole prefix (``match`` hits a leading run, ``insert`` stores a whole sequence), and it moves that run
  to the most-recent end deepest block first, so a parent is always more recent than its children. L1 is
  only ever appended to by demotion, whose order (main's LRU order) already puts children first;
* **the main tier is prefix-closed** (a main-tier block's parent is in the main tier). ``match`` promotes the
  L1 part of the run it hits, and ``insert`` stores the whole sequence in the main tier, promoting any of its
  blocks that sat in L1 (from the KV it was given: no L1 read).

So the LRU block of the main tier has no main-tier children (they would be older), and the LRU block of L1
has no children anywhere (main-tier children would break prefix-closure, L1 children would be older):
evicting a tier's LRU block never leaves a block whose parent is gone, in either tier. Consequently the
resident blocks of any chain are a leading run, its main-tier part a leading run of that: ``match`` stops at
the first missing block and never meets stranded orphans, and a match's gather is one ``index_select`` per
tier into one contiguous range each.

Events: every state change appends vLLM-style events (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, medium ``"gpu"``/``"cpu"``) to a buffer that :meth:`PrefixKvStore.drain_events`
hands to the worker, which wraps them in a sequenced ``KvEventBatch``. A block moving between tiers is a
store in the new tier followed by a removal from the old one ("make before break"), so an index never sees
it absent in between. ``BlockStored.token_ids`` is left None (the router keys blocks by our hashes, not
tokens), and the parent of a chain's first block is None. :meth:`PrefixKvStore.held` lists what is resident,
for an index resync after an event gap.

Threading: not thread-safe. One thread drives it: the worker's engine thread, which is also the thread
that runs prefill (``match`` before it, ``insert`` after a request finishes) and drains the events.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from torch import Tensor

from splitserve.cache.events import CPU, GPU, KvEvent, cleared, removed, stored
from splitserve.cache.hashing import DEFAULT_BLOCK_SIZE, hash_token_blocks, root_hash

__all__ = ["Match", "PrefixKvStore", "StoreStats"]


class _Default(enum.Enum):
    TOKEN = enum.auto()


_DEFAULT: Final = _Default.TOKEN  # "use the store's construction-time salt / LoRA"


@dataclass(frozen=True, slots=True)
class Match:
    """What :meth:`PrefixKvStore.match` found for a prompt.

    ``kv`` is a fresh ``[L, 2, H, num_tokens, D]`` tensor (None when nothing matched) that the caller owns:
    later evictions cannot change it. ``hashes`` are the chained hashes of *every* full block of the prompt
    (the first ``num_blocks`` of them matched), for the caller to report or reuse. ``tier_hits`` counts the
    matched blocks by the tier they were found in (L1 hits have been promoted since).
    """

    num_tokens: int
    kv: Tensor | None
    hashes: list[int]
    tier_hits: dict[str, int]
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def num_blocks(self) -> int:
        return self.num_tokens // self.block_size


@dataclass(slots=True)
class StoreStats:
    block_size: int
    bytes_per_block: int
    blocks: dict[str, int]  # medium -> resident blocks
    capacity: dict[str, int]  # medium -> capacity in blocks
    hit_blocks: int  # matched blocks, over all match() calls
    miss_blocks: int  # matchable blocks (full, within the never-whole-prompt cap) that were not resident
    hit_requests: int  # match() calls that reused at least one block
    miss_requests: int
    tier_hit_blocks: dict[str, int]  # hit_blocks by the tier each block was found in
    inserted_blocks: int  # blocks written by insert() (new, or promoted from L1 using the given KV)
    promotions: int  # L1 -> main moves by match()
    demotions: int  # main -> L1 moves
    evictions: dict[str, int]  # medium -> blocks evicted from that tier (demoted or dropped)
    dropped: int  # blocks that left the cache entirely (not counting clear())
    clears: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        """Matched blocks over matchable blocks (0.0 before any match)."""
        total = self.hit_blocks + self.miss_blocks
        return self.hit_blocks / total if total else 0.0

    @property
    def request_hit_ratio(self) -> float:
        total = self.hit_requests + self.miss_requests
        return self.hit_requests / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "bytes_per_block": self.bytes_per_block,
            "blocks": dict(self.blocks),
            "capacity": dict(self.capacity),
            "hit_blocks": self.hit_blocks,
            "miss_blocks": self.miss_blocks,
            "hit_requests": self.hit_requests,
            "miss_requests": self.miss_requests,
            "tier_hit_blocks": dict(self.tier_hit_blocks),
            "hit_ratio": self.hit_ratio,
            "request_hit_ratio": self.request_hit_ratio,
            "inserted_blocks": self.inserted_blocks,
            "promotions": self.promotions,
            "demotions": self.demotions,
            "evictions": dict(self.evictions),
            "dropped": self.dropped,
            "clears": self.clears,
            **self.extra,
        }


class _Tier:
    """One tier's storage: the preallocated block tensor, its LRU order and its free slots."""

    __slots__ = ("medium", "capacity", "tensor", "lru", "free")

    def __init__(self, medium: str, capacity: int, shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> None:
        self.medium = medium
        self.capacity = capacity
        self.tensor = torch.empty(shape, dtype=dtype, device=device)
        # hash -> slot, least recently used first; the order is also the eviction order
        self.lru: OrderedDict[int, int] = OrderedDict()
        # a stack popping the lowest slot first: fills the tensor from the front, so untouched pages stay
        # uncommitted for as long as possible
        self.free: list[int] = list(range(capacity - 1, -1, -1))

    def index(self, slots: Sequence[int]) -> Tensor:
        return torch.tensor(slots, dtype=torch.long, device=self.tensor.device)

    def reset(self) -> None:
        self.lru.clear()
        self.free = list(range(self.capacity - 1, -1, -1))


def _chain_segments(hashes: list[int], parents: list[int | None]) -> list[tuple[list[int], int | None]]:
    """Split blocks into runs where each block's parent is the previous block: one BlockStored per run."""
    out: list[tuple[list[int], int | None]] = []
    run: list[int] = []
    for h, p in zip(hashes, parents, strict=True):
        if run and p == run[-1]:
            run.append(h)
        else:
            run = [h]
            out.append((run, p))
    return out


class PrefixKvStore:
    """Full-block prefix KV cache with an LRU main tier and an optional L1 tier; emits KV events."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str = torch.float32,
        block_size: int = DEFAULT_BLOCK_SIZE,
        capacity_blocks: int,
        l1_capacity_blocks: int = 0,
        cache_salt: str | None = None,
        lora: str | int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("block_size", block_size),
            ("capacity_blocks", capacity_blocks),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(l1_capacity_blocks, int) or l1_capacity_blocks < 0:
            raise ValueError(f"l1_capacity_blocks must be an int >= 0, got {l1_capacity_blocks!r}")
        if isinstance(dtype, str):
            resolved = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(resolved, torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}")
            dtype = resolved
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype: torch.dtype = dtype
        self.block_size = block_size
        self.cache_salt = cache_salt
        self.lora = lora
        L, H, D, B = num_layers, num_kv_heads, head_dim, block_size
        self._main = _Tier(GPU, capacity_blocks, (L, capacity_blocks, 2, H, B, D), dtype, device)
        # L1 is host memory by definition, whatever the main tier's device
        self._l1 = (
            _Tier(CPU, l1_capacity_blocks, (L, l1_capacity_blocks, 2, H, B, D), dtype, "cpu")
            if l1_capacity_blocks
            else None
        )
        self.device = self._main.tensor.device
        self.bytes_per_block = L * 2 * H * B * D * self._main.tensor.element_size()
        # parent hash of every resident block (None for a chain's first block), for the events of tier moves
        self._parent: dict[int, int | None] = {}
        self._roots: dict[tuple[str | None, str | int | None], int] = {}
        self._events: list[KvEvent] = []
        self._hit_blocks = 0
        self._miss_blocks = 0
        self._hit_requests = 0
        self._miss_requests = 0
        self._tier_hits = {GPU: 0, CPU: 0}
        self._inserted = 0
        self._promotions = 0
        self._demotions = 0
        self._evictions = {GPU: 0, CPU: 0}
        self._dropped = 0
        self._clears = 0

    # ------------------------------------------------------------------------------------------ hashing
    def _root(self, cache_salt: str | None | _Default, lora: str | int | None | _Default) -> int:
        salt = self.cache_salt if cache_salt is _DEFAULT else cache_salt
        lo = self.lora if lora is _DEFAULT else lora
        key = (salt, lo)
        root = self._roots.get(key)
        if root is None:
            # bounded by the tenants/adapters a worker serves; a handful in practice
            if len(self._roots) > 4096:
                self._roots.clear()
            root = self._roots[key] = root_hash(salt, lo)
        return root

    def block_hashes(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None | _Default = _DEFAULT,
        lora: str | int | None | _Default = _DEFAULT,
    ) -> list[int]:
        """The chained hashes of every full block of ``token_ids``, in this store's salt / LoRA scope."""
        return hash_token_blocks(token_ids, self.block_size, parent=self._root(cache_salt, lora))

    # ------------------------------------------------------------------------------------------ queries
    def _resident_run(self, hashes: Sequence[int], limit: int) -> tuple[int, int]:
        """The leading resident run of ``hashes[:limit]``: blocks [0, a) in the main tier, then [a, b) in L1.

        Main is prefix-closed, so the run is main blocks first, then L1 blocks: two scans, no per-block tier.
        """
        mlru = self._main.lru
        a = 0
        while a < limit and hashes[a] in mlru:
            a += 1
        b = a
        if self._l1 is not None:
            llru = self._l1.lru
            while b < limit and hashes[b] in llru:
                b += 1
        return a, b

    def match(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None | _Default = _DEFAULT,
        lora: str | int | None | _Default = _DEFAULT,
    ) -> Match:
        """The longest run of leading full blocks resident in either tier, as one ``past_kv`` tensor.

        At most ``(len(token_ids) - 1) // block_size`` blocks match, so at least the last prompt token is
        left to compute (the engine needs its logits). Hit blocks become most recently used; L1 hits are
        promoted to the main tier (as far as it can hold them without evicting this very prefix).
        """
        bs = self.block_size
        hashes = self.block_hashes(token_ids, cache_salt=cache_salt, lora=lora)
        limit = min(len(hashes), max(len(token_ids) - 1, 0) // bs)
        main, l1 = self._main, self._l1
        mlru = main.lru
        a, b = self._resident_run(hashes, limit)
        self._hit_blocks += b
        self._miss_blocks += limit - b
        if not b:
            self._miss_requests += 1
            return Match(0, None, hashes, {}, bs)
        self._hit_requests += 1
        self._tier_hits[GPU] += a
        tier_hits = {GPU: a}
        if b > a:
            self._tier_hits[CPU] += b - a
            tier_hits[CPU] = b - a

        L, H, D = self.num_layers, self.num_kv_heads, self.head_dim
        out = torch.empty((L, 2, H, b, bs, D), dtype=self.dtype, device=self.device)
        # [L, n, 2, H, bs, D] view of ``out``: the pool's block order, so a tier's index_select can write
        # straight into it (one pass, no intermediate copy)
        blocks = out.permute(0, 3, 1, 2, 4, 5)
        if a:
            self._gather(main, [mlru[h] for h in hashes[:a]], blocks[:, :a])
        if b > a:
            assert l1 is not None
            self._gather(l1, [l1.lru[h] for h in hashes[a:b]], blocks[:, a:b])

        for h in reversed(hashes[:a]):  # deepest first: parents end up more recent than children
            mlru.move_to_end(h)
        if b > a:
            assert l1 is not None
            # Promote the L1 part. It always fits beside the main-tier part: every resident chain was once
            # wholly in the main tier (insert stores at most its capacity), so a run is never longer than
            # it. The min only guards that; blocks left in L1 would still extend a main-tier chain.
            p = min(b - a, main.capacity - a)
            if p > 0:
                promoted = hashes[a : a + p]
                for h in promoted:
                    l1.free.append(l1.lru.pop(h))  # first, so demotions below can reuse these L1 slots
                slots = self._take_main_slots(p)
                self._write(main, slots, blocks[:, a : a + p])
                for i in range(p - 1, -1, -1):  # deepest first, as above
                    mlru[promoted[i]] = slots[i]
                # the run's main-tier part must stay more recent than its newly promoted children
                for h in reversed(hashes[:a]):
                    mlru.move_to_end(h)
                self._promotions += p
                self._events.append(stored(list(promoted), self._parent[promoted[0]], block_size=bs, medium=GPU))
                self._events.append(removed(list(promoted), CPU))
        return Match(b * bs, out.view(L, 2, H, b * bs, D), hashes, tier_hits, bs)

    # ------------------------------------------------------------------------------------------ updates
    def insert(
        self,
        token_ids: Sequence[int],
        kv: Tensor,
        *,
        cache_salt: str | None | _Default = _DEFAULT,
        lora: str | int | None | _Default = _DEFAULT,
    ) -> int:
        """Store every full block of a finished sequence's KV (``[L, 2, H, T, D]``, T tokens from 0).

        Blocks are taken up to the shorter of ``token_ids`` and ``kv`` (a decoded sequence's KV usually
        lacks its last sampled token), and at most the main tier's capacity of them. Blocks already in the
        main tier are only touched; blocks sitting in L1 are promoted using ``kv``. Returns the number of
        blocks written.
        """
        L, H, D, bs = self.num_layers, self.num_kv_heads, self.head_dim, self.block_size
        if kv.dim() != 5 or kv.shape[0] != L or kv.shape[1] != 2 or kv.shape[2] != H or kv.shape[4] != D:
            raise ValueError(f"kv shape {tuple(kv.shape)} does not match [{L}, 2, {H}, T, {D}]")
        if kv.dtype != self.dtype:
            raise ValueError(f"kv dtype {kv.dtype} does not match the store's {self.dtype}")
        main, l1 = self._main, self._l1
        # A sequence longer than the whole main tier keeps only its leading blocks: caching its tail would
        # mean evicting its own head.
        k = min(len(token_ids), kv.shape[3]) // bs
        k = min(k, main.capacity)
        if not k:
            return 0
        hashes = hash_token_blocks(token_ids[: k * bs], bs, parent=self._root(cache_salt, lora))
        mlru = main.lru
        a, b = self._resident_run(hashes, k)
        # Past b nothing should be resident (residency is a leading run); stop at anything that is, rather
        # than store a block twice, should a 64-bit hash ever collide.
        parent = self._parent
        end = b
        while end < k and hashes[end] not in parent:
            end += 1
        k = end
        for h in reversed(hashes[:a]):
            mlru.move_to_end(h)  # protects them from the evictions below, and keeps parents after children
        m = k - a
        if not m:
            return 0
        if b > a:
            assert l1 is not None
            for h in hashes[a:b]:
                l1.free.append(l1.lru.pop(h))
        slots = self._take_main_slots(m)
        src = kv[:, :, :, a * bs : k * bs].reshape(L, 2, H, m, bs, D).permute(0, 3, 1, 2, 4, 5)
        self._write(main, slots, src)
        new = hashes[a:k]
        for h, s in zip(new, slots, strict=True):
            mlru[h] = s
        for i in range(k - 1, -1, -1):
            mlru.move_to_end(hashes[i])
        first_parent = hashes[a - 1] if a else None
        for i in range(b, k):  # promoted blocks [a, b) keep theirs
            parent[hashes[i]] = hashes[i - 1] if i else None
        self._inserted += m
        self._events.append(stored(list(new), first_parent, block_size=bs, medium=GPU))
        if b > a:
            self._events.append(removed(hashes[a:b], CPU))
        return m

    def clear(self) -> None:
        """Drop every block of every tier (emits one ``AllBlocksCleared``)."""
        self._main.reset()
        if self._l1 is not None:
            self._l1.reset()
        self._parent.clear()
        self._clears += 1
        self._events.append(cleared(None))

    def drain_events(self) -> list[KvEvent]:
        """Events since the last drain, in order; the caller publishes them as one sequenced batch."""
        events = self._events
        self._events = []
        return events

    @property
    def pending_events(self) -> int:
        return len(self._events)

    # ------------------------------------------------------------------------------------------ internals
    def _gather(self, tier: _Tier, slots: list[int], dst: Tensor) -> None:
        """Copy blocks ``slots`` of ``tier`` into ``dst`` (a ``[L, n, 2, H, bs, D]`` view of a match)."""
        idx = tier.index(slots)
        if tier.tensor.device == dst.device:
            torch.index_select(tier.tensor, 1, idx, out=dst)
        else:
            dst.copy_(tier.tensor.index_select(1, idx))

    def _write(self, tier: _Tier, slots: list[int], src: Tensor) -> None:
        """Write ``src`` (``[L, n, 2, H, bs, D]``, any strides/device) into blocks ``slots`` of ``tier``."""
        if src.device != tier.tensor.device:
            src = src.to(tier.tensor.device)
        tier.tensor.index_copy_(1, tier.index(slots), src)

    def _take_main_slots(self, n: int) -> list[int]:
        """``n`` free main-tier slots, evicting LRU blocks (demoted to L1 when it exists).

        The caller has moved the blocks it must keep to the most-recent end and asks for no more than the
        tier can hold beside them, so the LRU end never reaches them.
        """
        main = self._main
        free = main.free
        short = n - len(free)
        if short > 0:
            lru = main.lru
            evicted = [lru.popitem(last=False) for _ in range(short)]
            self._evictions[GPU] += short
            self._demote(evicted)  # copies their bytes out before their slots are reused
            free.extend(s for _, s in evicted)
        return [free.pop() for _ in range(n)]

    def _demote(self, evicted: list[tuple[int, int]]) -> None:
        """Move blocks just evicted from the main tier (in eviction order) into L1, or drop them.

        Same result as demoting them one at a time, each demotion evicting L1's LRU block when full: L1
        keeps the newest ``capacity`` of (its current blocks in LRU order, then ``evicted``). That order
        lists children before parents, so dropping from its front never strands a child.
        """
        parent = self._parent
        l1 = self._l1
        gone: list[int] = []
        if l1 is None:
            gone = [h for h, _ in evicted]
        else:
            overflow = max(0, len(l1.lru) + len(evicted) - l1.capacity)
            old = min(overflow, len(l1.lru))
            if old:
                dropped_old = [l1.lru.popitem(last=False) for _ in range(old)]
                l1.free.extend(s for _, s in dropped_old)
                old_hashes = [h for h, _ in dropped_old]
                for h in old_hashes:
                    del parent[h]
                self._evictions[CPU] += old
                self._dropped += old
                self._events.append(removed(old_hashes, CPU))
            gone = [h for h, _ in evicted[: overflow - old]]
            keep = evicted[overflow - old :]
            if keep:
                dst = [l1.free.pop() for _ in keep]
                mt, lt = self._main.tensor, l1.tensor
                if mt.device == lt.device:
                    # Slot-to-slot copies: about 4x faster here than index_select + index_copy_, which
                    # materialises (and page-faults) a temporary the size of the whole batch.
                    for (_, s), d in zip(keep, dst, strict=True):
                        lt.select(1, d).copy_(mt.select(1, s))
                else:
                    # across devices one batched transfer beats a synchronous copy per block
                    src = mt.index_select(1, self._main.index([s for _, s in keep]))
                    lt.index_copy_(1, l1.index(dst), src.to(lt.device))
                kept = [h for h, _ in keep]
                for h, s in zip(kept, dst, strict=True):
                    l1.lru[h] = s
                self._demotions += len(keep)
                # eviction order is leaf first; reversed, chains read root-to-leaf for the events
                kept.reverse()
                for run, p in _chain_segments(kept, [parent[h] for h in kept]):
                    self._events.append(stored(run, p, block_size=self.block_size, medium=CPU))
        for h in gone:
            del parent[h]
        self._dropped += len(gone)
        self._events.append(removed([h for h, _ in evicted], GPU))

    # ------------------------------------------------------------------------------------------ introspection
    def held(self) -> dict[str, list[int]]:
        """Resident block hashes per tier, least recently used first (for an index resync)."""
        out = {GPU: list(self._main.lru)}
        if self._l1 is not None:
            out[CPU] = list(self._l1.lru)
        return out

    def tier_of(self, block_hash: int) -> str | None:
        if block_hash in self._main.lru:
            return GPU
        if self._l1 is not None and block_hash in self._l1.lru:
            return CPU
        return None

    def parent_of(self, block_hash: int) -> int | None:
        """The resident block's parent hash (None for a chain's first block). KeyError if not resident."""
        return self._parent[block_hash]

    def __len__(self) -> int:
        return len(self._parent)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._parent

    def capacity(self, medium: str = GPU) -> int:
        if medium == GPU:
            return self._main.capacity
        return self._l1.capacity if (medium == CPU and self._l1 is not None) else 0

    @property
    def nbytes(self) -> dict[str, int]:
        """Bytes reserved per tier (address space; CPU pages are committed as slots are first written)."""
        out = {GPU: self._main.capacity * self.bytes_per_block}
        if self._l1 is not None:
            out[CPU] = self._l1.capacity * self.bytes_per_block
        return out

    def stats(self) -> StoreStats:
        blocks = {GPU: len(self._main.lru)}
        capacity = {GPU: self._main.capacity}
        if self._l1 is not None:
            blocks[CPU] = len(self._l1.lru)
            capacity[CPU] = self._l1.capacity
        return StoreStats(
            block_size=self.block_size,
            bytes_per_block=self.bytes_per_block,
            blocks=blocks,
            capacity=capacity,
            hit_blocks=self._hit_blocks,
            miss_blocks=self._miss_blocks,
            hit_requests=self._hit_requests,
            miss_requests=self._miss_requests,
            tier_hit_blocks=dict(self._tier_hits),
            inserted_blocks=self._inserted,
            promotions=self._promotions,
            demotions=self._demotions,
            evictions=dict(self._evictions),
            dropped=self._dropped,
            clears=self._clears,
        )
