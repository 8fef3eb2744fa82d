"""PrefixIndex: which worker holds which KV blocks, per tier, and how much of a prompt each can reuse.

This module owns residency bookkeeping for the cache-index service, the router's in-process replica, the
``prefixaware`` strategy's local tree, the benchmarks and the simulator. It is pure and synchronous.

Layout (chosen for CPython speed; see ``bench/index_bench.py``):

* every worker id is interned to a bit position; a block's holders are one ``int`` bitmask;
* one ``dict[block_hash, mask]`` per tier (medium), plus an ``any``-tier dict that is the union. While only
  one tier is in use (the common case) the ``any`` dict *is* that tier's dict, so a store or removal costs
  one dict read and one write per block;
* ``lookup`` walks the prompt's chained hashes AND-ing masks, so each step costs one dict probe no matter
  how many workers there are; it stops as soon as no worker is left, and reads each worker's count off the
  position where its bit drops out. Cost is O(matched depth + workers), not O(depth x workers);
* clearing or removing a worker is O(1): its bit position is *retired* (dropped from the live mask, so
  lookups ignore it at once) and the worker gets a fresh position; retired bits are swept out of the dicts
  in one pass once ``sweep_after_retired`` have accumulated or the index has doubled since the last sweep
  (and before ``stats`` / ``snapshot``), which is amortised O(1) per block;
* per-worker block counts are not kept on the hot path (they would cost a check per block); ``stats`` and
  ``worker_blocks`` count them in O(blocks).

Correctness is defined against the obvious model (``dict[worker, set[hash]]`` per tier; a worker's count
is the length of the prompt's leading run of hashes it holds); ``tests/cache`` checks this with
hypothesis over random event streams.

One writer: the object is not thread-safe (the router and the cache-index service apply events and look
up from one event loop).

Sequence numbers: each worker's batches must arrive as 0, 1, 2, ... ``apply`` returns True when a batch
skipped ahead (events were lost; the batch is still applied, and the caller should resync that worker),
drops batches it has already seen, and treats a ``seq == 0`` from a known worker as a restarted worker
whose old residency is gone.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from splitserve.cache.events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch

__all__ = ["IndexStats", "PrefixIndex", "TierOverlap"]

_SNAPSHOT_VERSION = 1
_MIN_SWEEP_AT = 1 << 16


@dataclass(frozen=True, slots=True)
class TierOverlap:
    """Leading blocks of a prompt that one worker holds: in any tier, and in each tier alone."""

    any: int
    by_medium: dict[str, int]

    def in_medium(self, medium: str) -> int:
        return self.by_medium.get(medium, 0)


@dataclass(slots=True)
class IndexStats:
    workers: int
    blocks: int  # distinct block hashes held by at least one worker in some tier
    blocks_by_medium: dict[str, int]
    worker_blocks: dict[str, dict[str, int]]  # worker -> medium -> blocks held
    batches: int
    events: int
    gaps: int
    stale_batches: int
    restarts: int
    sweeps: int
    bits: int = 0  # width of the masks (live + retired positions)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "blocks": self.blocks,
            "blocks_by_medium": dict(self.blocks_by_medium),
            "worker_blocks": {w: dict(m) for w, m in self.worker_blocks.items()},
            "batches": self.batches,
            "events": self.events,
            "gaps": self.gaps,
            "stale_batches": self.stale_batches,
            "restarts": self.restarts,
            "sweeps": self.sweeps,
            "bits": self.bits,
            **self.extra,
        }


class PrefixIndex:
    """Prefix residency per worker and tier, fed by KV event batches; answers leading-block overlap."""

    def __init__(self, *, sweep_after_retired: int = 64) -> None:
        self._sweep_after = max(1, sweep_after_retired)
        self._reset()

    def _reset(self) -> None:
        self._pos: dict[str, int] = {}
        self._ids: list[str | None] = []
        self._free: list[int] = []  # min-heap: reuse low positions so masks stay narrow
        self._live = 0
        self._retired = 0
        self._nretired = 0
        self._sweep_at = _MIN_SWEEP_AT  # with retired bits around, sweep once the index grows past this
        self._tiers: dict[str, dict[int, int]] = {}
        self._any: dict[int, int] = {}
        self._aliased = True  # True while _any is the only tier's dict (or no tier exists yet)
        self._seq: dict[str, int] = {}
        self._bit: dict[str, int] = {}  # worker -> its current mask bit (1 << position)
        self.batches = 0
        self.events = 0
        self.gaps = 0
        self.stale_batches = 0
        self.restarts = 0
        self.sweeps = 0
        # Bumped by every mutation: lets callers memoise a lookup within one routing decision.
        self.version = getattr(self, "version", 0) + 1

    # ------------------------------------------------------------------------------------------ workers
    def _alloc(self, worker_id: str) -> int:
        if self._free:
            pos = heapq.heappop(self._free)
            self._ids[pos] = worker_id
        else:
            pos = len(self._ids)
            self._ids.append(worker_id)
        self._pos[worker_id] = pos
        self._bit[worker_id] = 1 << pos
        self._live |= 1 << pos
        return pos

    def add_worker(self, worker_id: str) -> None:
        """Make a worker known (it holds nothing yet). Applying its first batch does this implicitly."""
        if worker_id not in self._pos:
            self._alloc(worker_id)

    def _retire(self, worker_id: str) -> None:
        self.version += 1
        pos = self._pos.pop(worker_id)
        del self._bit[worker_id]
        bit = 1 << pos
        self._live &= ~bit
        self._retired |= bit
        self._nretired += 1
        self._ids[pos] = None
        if self._nretired >= self._sweep_after:
            self._sweep()

    def remove_worker(self, worker_id: str) -> bool:
        """Forget a worker entirely (dead, drained). O(1); its blocks stop matching at once."""
        self._seq.pop(worker_id, None)
        if worker_id not in self._pos:
            return False
        self._retire(worker_id)
        return True

    def clear_worker(self, worker_id: str, medium: str | None = None) -> None:
        """Drop a worker's residency (all tiers: O(1); one tier: O(blocks of that tier)), keeping its seq."""
        if worker_id not in self._pos:
            return
        if medium is None:
            self._retire(worker_id)
            self._alloc(worker_id)
            return
        bit = self._bit[worker_id]
        td = self._tiers.get(medium)
        if td is not None:
            self._remove(bit, medium, [h for h, m in td.items() if m & bit])

    def resync(self, worker_id: str, seq: int, held: Mapping[str, Iterable[int]]) -> None:
        """Replace a worker's residency with a full dump it took at ``seq`` (the answer to a gap).

        ``held`` maps medium -> block hashes. Batches after ``seq`` then apply normally.
        """
        self.add_worker(worker_id)
        self.clear_worker(worker_id)
        for medium, hashes in held.items():
            self.store(worker_id, hashes, medium)
        self._seq[worker_id] = seq

    def workers(self) -> list[str]:
        return list(self._pos)

    def media(self) -> list[str]:
        """Tiers that have held blocks (e.g. ["gpu", "cpu"])."""
        return list(self._tiers)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._pos

    def expected_seq(self, worker_id: str) -> int:
        """The sequence number the next batch from this worker should carry."""
        last = self._seq.get(worker_id)
        return 0 if last is None else last + 1

    # ------------------------------------------------------------------------------------------ events
    def _check_seq(self, wid: str, seq: int, last: int | None) -> int:
        """Out-of-line sequence handling: -1 drop the batch, 0 apply, 1 apply and report a gap."""
        if last is None:
            self.add_worker(wid)
            return 1 if seq != 0 else 0
        if seq > last:
            return 1
        if seq == 0:
            # The worker restarted (its publisher counts from 0 again): its old KV is gone.
            self.clear_worker(wid)
            self.restarts += 1
            return 0
        self.stale_batches += 1  # a duplicate or reordered old batch: already applied
        return -1

    def apply(self, batch: KvEventBatch) -> bool:
        """Apply one worker's batch. Returns True if a sequence gap was detected (caller should resync).

        The common single-tier store/remove loops are inlined here: a method call per event costs as much
        as a dozen blocks.
        """
        wid = batch.worker_id
        seq = batch.seq
        last = self._seq.get(wid)
        gap = False
        if last is None or seq != last + 1:
            verdict = self._check_seq(wid, seq, last)
            if verdict < 0:
                return False
            if verdict:
                gap = True
                self.gaps += 1
        self._seq[wid] = seq
        self.batches += 1
        self.version += 1
        bit = self._bit[wid]
        tiers = self._tiers
        aliased = self._aliased
        live = self._live
        events = batch.events
        for ev in events:
            t = type(ev)
            # ``type(ev) is X`` is cheaper than isinstance; the annotated rebinding is for the type checker.
            if t is BlockStored:
                st: BlockStored = ev  # type: ignore[assignment]
                td = tiers.get(st.medium)
                if td is not None and aliased:
                    get = td.get
                    for h in st.block_hashes:
                        td[h] = get(h, 0) | bit
                    if len(td) > self._sweep_at:
                        self._grown()
                else:
                    self._store(bit, st.medium, st.block_hashes)
                    aliased = self._aliased  # a new tier may have split the any-tier view off
            elif t is BlockRemoved:
                rm: BlockRemoved = ev  # type: ignore[assignment]
                td = tiers.get(rm.medium)
                if td is None:
                    continue
                if aliased:
                    get = td.get
                    for h in rm.block_hashes:
                        m = get(h, 0)
                        if m & bit:
                            m ^= bit
                            if m & live:
                                td[h] = m
                            else:
                                del td[h]  # nobody live holds it (retired bits, if any, are garbage)
                else:
                    self._remove(bit, rm.medium, rm.block_hashes)
            elif t is AllBlocksCleared:
                cl: AllBlocksCleared = ev  # type: ignore[assignment]
                self.clear_worker(wid, cl.medium)
                bit = self._bit[wid]
                live = self._live
                tiers = self._tiers  # a sweep may have rebuilt the dicts
            else:
                raise TypeError(f"not a KV event: {t.__name__}")
        self.events += len(events)
        return gap

    def store(self, worker_id: str, block_hashes: Iterable[int], medium: str = GPU) -> None:
        """Record blocks as held (no sequence numbers: for local bookkeeping and simulators)."""
        if worker_id not in self._pos:
            self.add_worker(worker_id)
        self._store(self._bit[worker_id], medium, block_hashes)

    def remove(self, worker_id: str, block_hashes: Iterable[int], medium: str = GPU) -> None:
        """Record blocks as evicted (no sequence numbers)."""
        if worker_id in self._pos:
            self._remove(self._bit[worker_id], medium, block_hashes)

    def _add_tier(self, medium: str) -> dict[int, int]:
        if not self._tiers:
            td = self._any  # the first tier shares its dict with the any-tier view
        else:
            if self._aliased:
                self._any = dict(self._any)
                self._aliased = False
            td = {}
        self._tiers[medium] = td
        return td

    def _store(self, bit: int, medium: str, hashes: Iterable[int]) -> None:
        self.version += 1
        td = self._tiers.get(medium)
        if td is None:
            td = self._add_tier(medium)
        get = td.get
        if self._aliased:
            for h in hashes:
                td[h] = get(h, 0) | bit
        else:
            ad = self._any
            aget = ad.get
            for h in hashes:
                td[h] = get(h, 0) | bit
                ad[h] = aget(h, 0) | bit
        if len(self._any) > self._sweep_at:
            self._grown()

    def _remove(self, bit: int, medium: str, hashes: Iterable[int]) -> None:
        self.version += 1
        td = self._tiers.get(medium)
        if td is None:
            return
        get = td.get
        live = self._live
        if self._aliased:
            for h in hashes:
                m = get(h, 0)
                if m & bit:
                    m ^= bit
                    if m & live:
                        td[h] = m
                    else:
                        del td[h]
            return
        ad = self._any
        others = [d for d in self._tiers.values() if d is not td]
        for h in hashes:
            m = get(h, 0)
            if not m & bit:
                continue
            m ^= bit
            if m & live:
                td[h] = m
            else:
                del td[h]
            for od in others:
                if od.get(h, 0) & bit:
                    break  # still held in another tier: the any-tier view keeps the bit
            else:
                am = ad[h] ^ bit
                if am & live:
                    ad[h] = am
                else:
                    del ad[h]

    def _grown(self) -> None:
        """The index doubled since the last sweep: entries only retired workers held may be bloating it."""
        if self._nretired:
            self._sweep()
        self._sweep_at = max(_MIN_SWEEP_AT, 2 * len(self._any))

    def _sweep(self) -> None:
        """Strip retired bits from every mask and recycle their positions (one O(blocks) pass)."""
        live = self._live
        for medium, td in list(self._tiers.items()):
            new = {h: m & live for h, m in td.items() if m & live}
            if self._aliased:
                self._any = new
            self._tiers[medium] = new
        if not self._aliased:
            self._any = {h: m & live for h, m in self._any.items() if m & live}
        retired = self._retired
        while retired:
            low = retired & -retired
            heapq.heappush(self._free, low.bit_length() - 1)
            retired ^= low
        self._retired = 0
        self._nretired = 0
        self._sweep_at = max(_MIN_SWEEP_AT, 2 * len(self._any))
        self.sweeps += 1

    # ------------------------------------------------------------------------------------------ queries
    def lookup(self, block_hashes: Iterable[int], medium: str | None = None) -> dict[str, int]:
        """Leading blocks of the prompt held per worker (any tier, or only ``medium``). Absent means 0."""
        d = self._any if medium is None else self._tiers.get(medium)
        m = self._live
        if d is None or not m:
            return {}
        get = d.get
        ids = self._ids
        out: dict[str, int] = {}
        i = 0
        it = iter(block_hashes)
        for h in it:
            nm = m & get(h, 0)
            if nm != m:
                if i:
                    dropped = m ^ nm
                    while dropped:
                        low = dropped & -dropped
                        out[ids[low.bit_length() - 1]] = i  # type: ignore[index]
                        dropped ^= low
                if not nm:
                    return out
                m = nm
                if not m & (m - 1):
                    # One worker left (the usual case after the first block): a tighter loop for the rest.
                    i += 1
                    for h in it:
                        if not get(h, 0) & m:
                            break
                        i += 1
                    break
            i += 1
        if not i:
            return out  # empty prompt: nobody holds anything of it
        while m:
            low = m & -m
            out[ids[low.bit_length() - 1]] = i  # type: ignore[index]
            m ^= low
        return out

    def lookup_tiers(self, block_hashes: Sequence[int]) -> dict[str, TierOverlap]:
        """Per worker: leading blocks held in any tier, and in each tier on its own."""
        overall = self.lookup(block_hashes)
        if not overall:
            return {}
        per = {medium: self.lookup(block_hashes, medium) for medium in self._tiers}
        return {
            w: TierOverlap(n, {medium: hits[w] for medium, hits in per.items() if w in hits})
            for w, n in overall.items()
        }

    def holders(self, block_hash: int, medium: str | None = None) -> list[str]:
        d = self._any if medium is None else self._tiers.get(medium, {})
        m = d.get(block_hash, 0) & self._live
        out = []
        while m:
            low = m & -m
            wid = self._ids[low.bit_length() - 1]
            assert wid is not None
            out.append(wid)
            m ^= low
        return out

    def worker_blocks(self, worker_id: str, medium: str | None = None) -> int:
        """Blocks a worker holds (in ``medium``, or in any tier). O(blocks): for stats, not the hot path."""
        bit = self._bit.get(worker_id)
        d = self._any if medium is None else self._tiers.get(medium)
        if bit is None or d is None:
            return 0
        return sum(1 for m in d.values() if m & bit)

    def _per_worker_counts(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {w: {} for w in self._pos}
        ids = self._ids
        for medium, td in self._tiers.items():
            counts: dict[int, int] = {}
            for m in td.values():
                counts[m] = counts.get(m, 0) + 1
            for mask, n in counts.items():
                mask &= self._live
                while mask:
                    low = mask & -mask
                    wid = ids[low.bit_length() - 1]
                    assert wid is not None
                    per = out[wid]
                    per[medium] = per.get(medium, 0) + n
                    mask ^= low
        return out

    def __len__(self) -> int:
        if self._nretired:
            self._sweep()
        return len(self._any)

    def stats(self) -> IndexStats:
        if self._nretired:
            self._sweep()  # makes the block counts exact
        return IndexStats(
            workers=len(self._pos),
            blocks=len(self._any),
            blocks_by_medium={m: len(d) for m, d in self._tiers.items()},
            worker_blocks=self._per_worker_counts(),
            batches=self.batches,
            events=self.events,
            gaps=self.gaps,
            stale_batches=self.stale_batches,
            restarts=self.restarts,
            sweeps=self.sweeps,
            bits=len(self._ids),
        )

    # ------------------------------------------------------------------------------------------ persistence
    def snapshot(self) -> bytes:
        """Residency and sequence numbers as msgpack; independent of bit positions."""
        if self._nretired:
            self._sweep()
        ids = self._ids
        tiers: dict[str, list[list[Any]]] = {}
        for medium, td in self._tiers.items():
            groups: dict[int, list[int]] = {}
            for h, m in td.items():
                g = groups.get(m)
                if g is None:
                    groups[m] = [h]
                else:
                    g.append(h)
            out = []
            for mask, hashes in groups.items():
                holders = []
                while mask:
                    low = mask & -mask
                    holders.append(ids[low.bit_length() - 1])
                    mask ^= low
                out.append([holders, hashes])
            tiers[medium] = out
        doc = {
            "v": _SNAPSHOT_VERSION,
            "workers": [[w, self._seq.get(w)] for w in self._pos],
            "tiers": tiers,
        }
        return msgpack.packb(doc, use_bin_type=True)

    def restore(self, data: bytes) -> None:
        """Replace the whole state with a snapshot taken by :meth:`snapshot`."""
        doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if not isinstance(doc, dict) or doc.get("v") != _SNAPSHOT_VERSION:
            raise ValueError("not a PrefixIndex snapshot (or an unsupported version)")
        self._reset()
        for wid, seq in doc["workers"]:
            self.add_worker(wid)
            if seq is not None:
                self._seq[wid] = int(seq)
        pos = self._pos
        for medium, groups in doc["tiers"].items():
            td = self._add_tier(medium)
            for holders, hashes in groups:
                mask = 0
                for w in holders:
                    mask |= 1 << pos[w]
                td.update(dict.fromkeys(hashes, mask))
        if not self._aliased:
            ad: dict[int, int] = {}
            for td in self._tiers.values():
                aget = ad.get
                for h, m in td.items():
                    ad[h] = aget(h, 0) | m
            self._any = ad
