"""PrefixIndex against a brute-force model, plus sequence-gap and persistence tests."""

from __future__ import annotations

from collections.abc import Sequence

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from splitserve import proto
from splitserve.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    PrefixIndex,
    TierOverlap,
    batch,
    cleared,
    event_from_dict,
    hash_token_blocks,
    removed,
    stored,
)

WORKERS = ["w0", "w1", "w2", "w3", "w4"]
MEDIA = ["gpu", "cpu"]
HASHES = st.integers(min_value=0, max_value=11)  # a small universe so that workers overlap a lot
HASH_LISTS = st.lists(HASHES, max_size=6)


class Model:
    """The obvious specification: worker -> medium -> set of hashes."""

    def __init__(self) -> None:
        self.held: dict[str, dict[str, set[int]]] = {}
        self.seq: dict[str, int] = {}

    def apply(self, batch: KvEventBatch) -> bool:
        w, seq = batch.worker_id, batch.seq
        last = self.seq.get(w)
        gap = False
        if last is None:
            self.held.setdefault(w, {})
            gap = seq != 0
        elif seq != last + 1:
            if seq > last:
                gap = True
            elif seq == 0:
                self.held[w] = {}
            else:
                return False
        self.seq[w] = seq
        tiers = self.held[w]
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                tiers.setdefault(ev.medium, set()).update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                tiers.setdefault(ev.medium, set()).difference_update(ev.block_hashes)
            elif ev.medium is None:
                tiers.clear()
            else:
                tiers.pop(ev.medium, None)
        return gap

    def lookup(self, hashes: Sequence[int], medium: str | None = None) -> dict[str, int]:
        out = {}
        for w, tiers in self.held.items():
            held = set().union(*tiers.values()) if medium is None else tiers.get(medium, set())
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            if n:
                out[w] = n
        return out


events_st = st.one_of(
    st.builds(BlockStored, block_hashes=HASH_LISTS, block_size=st.just(16), medium=st.sampled_from(MEDIA)),
    st.builds(BlockRemoved, block_hashes=HASH_LISTS, medium=st.sampled_from(MEDIA)),
    st.builds(AllBlocksCleared, medium=st.sampled_from([None, *MEDIA])),
)


class IndexMachine(RuleBasedStateMachine):
    @initialize(sweep_after=st.sampled_from([1, 2, 64]))
    def setup(self, sweep_after: int) -> None:
        self.index = PrefixIndex(sweep_after_retired=sweep_after)
        self.model = Model()

    @rule(
        worker=st.sampled_from(WORKERS),
        seq_kind=st.sampled_from(["next", "next", "next", "next", "gap", "dup", "zero"]),
        events=st.lists(events_st, max_size=4),
    )
    def apply(
        self, worker: str, seq_kind: str, events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    ) -> None:
        nxt = self.index.expected_seq(worker)
        seq = {"next": nxt, "gap": nxt + 2, "dup": max(nxt - 2, 0), "zero": 0}[seq_kind]
        b = batch(worker, seq, ts_ms=0.0, events=list(events))
        assert self.index.apply(b) == self.model.apply(b)

    @rule(worker=st.sampled_from(WORKERS), hashes=HASH_LISTS, medium=st.sampled_from(MEDIA))
    def direct_store(self, worker: str, hashes: list[int], medium: str) -> None:
        self.index.store(worker, hashes, medium)
        self.model.held.setdefault(worker, {}).setdefault(medium, set()).update(hashes)

    @rule(worker=st.sampled_from(WORKERS), hashes=HASH_LISTS, medium=st.sampled_from(MEDIA))
    def direct_remove(self, worker: str, hashes: list[int], medium: str) -> None:
        self.index.remove(worker, hashes, medium)
        if worker in self.model.held:
            self.model.held[worker].setdefault(medium, set()).difference_update(hashes)

    @rule(worker=st.sampled_from(WORKERS), seq=st.integers(0, 20), gpu=HASH_LISTS, cpu=HASH_LISTS)
    def resync(self, worker: str, seq: int, gpu: list[int], cpu: list[int]) -> None:
        self.index.resync(worker, seq, {"gpu": gpu, "cpu": cpu})
        self.model.held[worker] = {"gpu": set(gpu), "cpu": set(cpu)}
        self.model.seq[worker] = seq

    @rule(worker=st.sampled_from(WORKERS))
    def remove_worker(self, worker: str) -> None:
        self.index.remove_worker(worker)
        self.model.held.pop(worker, None)
        self.model.seq.pop(worker, None)

    @precondition(lambda self: hasattr(self, "index"))
    @rule()
    def snapshot_restore(self) -> None:
        fresh = PrefixIndex()
        fresh.restore(self.index.snapshot())
        self.index = fresh

    @rule(hashes=st.lists(HASHES, max_size=8), medium=st.sampled_from([None, *MEDIA]))
    def lookup(self, hashes: list[int], medium: str | None) -> None:
        assert self.index.lookup(hashes, medium) == self.model.lookup(hashes, medium)

    @rule(hashes=st.lists(HASHES, max_size=8))
    def lookup_tiers(self, hashes: list[int]) -> None:
        got = self.index.lookup_tiers(hashes)
        want_any = self.model.lookup(hashes)
        assert {w: o.any for w, o in got.items()} == want_any
        for medium in MEDIA:
            want = self.model.lookup(hashes, medium)
            assert {w: o.in_medium(medium) for w, o in got.items() if o.in_medium(medium)} == want

    @invariant()
    def counts_match(self) -> None:
        if not hasattr(self, "index"):
            return
        for w, tiers in self.model.held.items():
            for medium in MEDIA:
                assert self.index.worker_blocks(w, medium) == len(tiers.get(medium, set()))
            assert self.index.worker_blocks(w) == len(set().union(*tiers.values()))
        want = {w: {m: len(s) for m, s in t.items() if s} for w, t in self.model.held.items()}
        assert self.index.stats().worker_blocks == want

    @invariant()
    def stats_match(self) -> None:
        if not hasattr(self, "index"):
            return
        everything: set[int] = set()
        for tiers in self.model.held.values():
            for s in tiers.values():
                everything |= s
        stats = self.index.stats()
        assert stats.blocks == len(everything)
        assert stats.workers == len(self.model.held)
        for h in range(12):
            want = sorted(w for w, t in self.model.held.items() if any(h in s for s in t.values()))
            assert sorted(self.index.holders(h)) == want


IndexMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestIndexAgainstModel = IndexMachine.TestCase


# ---------------------------------------------------------------------------------------------- examples


def _stored(hashes: list[int], medium: str = "gpu") -> BlockStored:
    return stored(hashes, block_size=16, medium=medium)


def test_lookup_counts_leading_run_per_worker() -> None:
    idx = PrefixIndex()
    hs = hash_token_blocks(list(range(16 * 6)), 16)
    idx.apply(batch("a", 0, ts_ms=0.0, events=[_stored(hs[:5])]))
    idx.apply(batch("b", 0, ts_ms=0.0, events=[_stored(hs[:2]), _stored(hs[3:6])]))  # hole at block 2
    idx.apply(batch("c", 0, ts_ms=0.0, events=[_stored(hs[1:6])]))  # no first block: matches nothing
    assert idx.lookup(hs) == {"a": 5, "b": 2}
    assert idx.lookup(hs[:1]) == {"a": 1, "b": 1}
    assert idx.lookup([]) == {}
    assert idx.lookup([12345]) == {}


def test_tiers_any_and_per_medium() -> None:
    idx = PrefixIndex()
    idx.store("a", [1, 2], "gpu")
    idx.store("a", [3], "cpu")
    idx.store("b", [1], "cpu")
    assert idx.lookup([1, 2, 3, 4]) == {"a": 3, "b": 1}
    assert idx.lookup([1, 2, 3, 4], "gpu") == {"a": 2}
    assert idx.lookup([1, 2, 3, 4], "cpu") == {"b": 1}
    assert idx.lookup_tiers([1, 2, 3]) == {
        "a": TierOverlap(3, {"gpu": 2}),
        "b": TierOverlap(1, {"cpu": 1}),
    }
    # Evicting from one tier keeps the block in the any-tier view while another tier still has it.
    idx.store("a", [3], "gpu")
    idx.remove("a", [3], "cpu")
    assert idx.lookup([1, 2, 3]) == {"a": 3, "b": 1}
    idx.remove("a", [3], "gpu")
    assert idx.lookup([1, 2, 3]) == {"a": 2, "b": 1}


def test_sequence_gap_is_reported_and_batch_still_applied() -> None:
    idx = PrefixIndex()
    assert idx.apply(batch("a", 0, ts_ms=0.0, events=[_stored([1])])) is False
    assert idx.apply(batch("a", 1, ts_ms=0.0, events=[_stored([2])])) is False
    assert idx.apply(batch("a", 5, ts_ms=0.0, events=[_stored([3])])) is True  # 2..4 lost
    assert idx.lookup([1, 2, 3]) == {"a": 3}
    assert idx.expected_seq("a") == 6
    assert idx.stats().gaps == 1


def test_first_batch_mid_stream_is_a_gap() -> None:
    idx = PrefixIndex()
    assert idx.apply(batch("late", 41, ts_ms=0.0, events=[_stored([1])])) is True


def test_duplicate_batch_is_ignored() -> None:
    idx = PrefixIndex()
    idx.apply(batch("a", 0, ts_ms=0.0, events=[_stored([1, 2])]))
    idx.apply(batch("a", 1, ts_ms=0.0, events=[removed([2])]))
    assert idx.apply(batch("a", 0 + 1, ts_ms=0.0, events=[_stored([2])])) is False  # redelivered seq 1
    assert idx.lookup([1, 2]) == {"a": 1}
    assert idx.stats().stale_batches == 1


def test_seq_zero_from_known_worker_means_restart() -> None:
    idx = PrefixIndex()
    idx.apply(batch("a", 0, ts_ms=0.0, events=[_stored([1, 2])]))
    idx.apply(batch("a", 1, ts_ms=0.0, events=[_stored([3])]))
    assert idx.apply(batch("a", 0, ts_ms=0.0, events=[_stored([7])])) is False
    assert idx.lookup([1, 2, 3]) == {}
    assert idx.lookup([7]) == {"a": 1}
    assert idx.stats().restarts == 1


def test_remove_and_clear_worker() -> None:
    idx = PrefixIndex(sweep_after_retired=1)
    idx.store("a", [1, 2, 3])
    idx.store("b", [1, 2])
    idx.store("b", [3], "cpu")
    idx.apply(batch("b", 0, ts_ms=0.0, events=[cleared("cpu")]))
    assert idx.lookup([1, 2, 3]) == {"a": 3, "b": 2}
    idx.apply(batch("b", 1, ts_ms=0.0, events=[cleared()]))
    assert idx.lookup([1, 2, 3]) == {"a": 3}
    assert "b" in idx
    assert idx.remove_worker("a") is True
    assert idx.lookup([1, 2, 3]) == {}
    assert idx.remove_worker("a") is False
    assert len(idx) == 0
    assert idx.stats().workers == 1


def test_retired_positions_are_recycled() -> None:
    idx = PrefixIndex(sweep_after_retired=4)
    for i in range(100):
        idx.store(f"w{i}", [1, 2, 3])
        idx.remove_worker(f"w{i}")
    idx.store("last", [1])
    assert idx.stats().bits <= 5
    assert idx.lookup([1, 2]) == {"last": 1}


def test_snapshot_roundtrip_keeps_seq_and_tiers() -> None:
    idx = PrefixIndex()
    idx.apply(batch("a", 0, ts_ms=0.0, events=[_stored([1, 2, 3]), _stored([4], "cpu")]))
    idx.apply(batch("b", 0, ts_ms=0.0, events=[_stored([1, 2])]))
    idx.apply(batch("b", 1, ts_ms=0.0, events=[_stored([9])]))
    blob = idx.snapshot()
    other = PrefixIndex()
    other.restore(blob)
    assert other.lookup([1, 2, 3, 4]) == {"a": 4, "b": 2}
    assert other.lookup([1, 2, 3, 4], "gpu") == {"a": 3, "b": 2}
    assert other.expected_seq("b") == 2
    assert other.stats().worker_blocks == idx.stats().worker_blocks
    assert other.apply(batch("b", 2, ts_ms=0.0, events=[])) is False


def test_restore_rejects_garbage() -> None:
    import msgpack

    with pytest.raises(ValueError):
        PrefixIndex().restore(msgpack.packb({"v": 99}))


def test_the_index_applies_what_came_off_the_wire() -> None:
    """One vocabulary: the events a worker builds are the wire models; decoded, they are what the index applies."""
    sent = batch("w", 0, [stored([1, 2], parent_block_hash=7, token_ids=[5] * 32, block_size=16),
                          removed([2], medium="cpu"), cleared("cpu"), stored([3], block_size=16)], ts_ms=12.5)
    got = proto.decode(proto.encode(sent), KvEventBatch)
    assert got == sent and [e.type for e in got.events] == ["stored", "removed", "cleared", "stored"]
    idx = PrefixIndex()
    assert idx.apply(got) is False
    assert idx.lookup([1, 2]) == {"w": 2}  # the cpu tier was cleared; the gpu one holds the chain


def test_vllm_spellings_are_accepted() -> None:
    """vLLM's class-name tags and upper-case media decode to the same events."""
    ev = event_from_dict({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                          "token_ids": [1] * 16, "block_size": 16, "lora_id": None, "medium": "GPU"})
    assert isinstance(ev, BlockStored) and ev.medium == "gpu"
    wire = KvEventBatch.model_validate({"worker_id": "w", "seq": 0, "events": [
        {"type": "removed", "block_hashes": [1], "medium": "CPU"}]})
    assert wire.events[0].medium == "cpu"
    with pytest.raises(ValueError):
        event_from_dict({"type": "BlockMoved", "block_hashes": [1]})


def test_resync_replaces_a_workers_residency_after_a_gap() -> None:
    idx = PrefixIndex()
    idx.apply(batch("a", 0, ts_ms=0.0, events=[_stored([1, 2, 3])]))
    assert idx.apply(batch("a", 4, ts_ms=0.0, events=[removed([3])])) is True  # 1..3 lost
    idx.resync("a", 7, {"gpu": [1, 5], "cpu": [6]})  # the worker's full state as of its batch 7
    assert idx.lookup([1, 2]) == {"a": 1}
    assert idx.lookup([5, 6]) == {"a": 2}
    assert idx.apply(batch("a", 8, ts_ms=0.0, events=[_stored([2])])) is False
    assert idx.lookup([1, 2]) == {"a": 2}
