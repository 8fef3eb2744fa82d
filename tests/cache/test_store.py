"""PrefixKvStore: exact KV round trips, the never-whole-prompt cap, salt scoping, LRU order (leaves first),
L1 demotion/promotion, and events that replay into a PrefixIndex agreeing with match() and held();
plus prefix reuse through the real hf engine on the tiny random Llama."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from splitserve.cache import (
    CPU,
    GPU,
    BlockRemoved,
    KvEvent,
    PrefixIndex,
    batch,
    cleared,
    hash_token_blocks,
    removed,
    stored,
)
from splitserve.cache.store import PrefixKvStore

L, H, D = 2, 2, 3  # tiny geometry: the logic is what is under test, not bandwidth
WORKER = "w"


def make_store(cap: int, l1: int = 0, bs: int = 4, salt: str | None = None) -> PrefixKvStore:
    return PrefixKvStore(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        block_size=bs,
        capacity_blocks=cap,
        l1_capacity_blocks=l1,
        cache_salt=salt,
    )


def kv_for(tokens: Sequence[int], bs: int = 4, salt: str | None = None) -> torch.Tensor:
    """Deterministic KV for a sequence: each full block's values depend only on its whole prefix (its chained
    hash), like a real model's, so two sequences sharing a prefix share that prefix's KV exactly."""
    g = torch.Generator()
    parts = []
    for h in hash_token_blocks(tokens, bs, cache_salt=salt):
        g.manual_seed(h & (2**63 - 1))
        parts.append(torch.randn(L, 2, H, bs, D, generator=g))
    tail = len(tokens) % bs
    if tail:
        parts.append(torch.randn(L, 2, H, tail, D))
    return torch.cat(parts, dim=3) if parts else torch.empty(L, 2, H, 0, D)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


class Replica:
    """A PrefixIndex fed with the store's drained events, as the router's would be."""

    def __init__(self) -> None:
        self.index = PrefixIndex()
        self.seq = 0

    def feed(self, events: list[KvEvent]) -> None:
        assert not self.index.apply(batch(WORKER, self.seq, ts_ms=0.0, events=events))
        self.seq += 1

    def assert_agrees(self, store: PrefixKvStore) -> None:
        held = store.held()
        by_medium = self.index.stats().blocks_by_medium
        for medium, hashes in held.items():
            assert len(set(hashes)) == len(hashes)
            assert by_medium.get(medium, 0) == len(hashes), medium
            for h in hashes:
                assert self.index.holders(h, medium) == [WORKER]
        for medium, n in by_medium.items():
            assert n == len(held.get(medium, ())), medium


def check_structure(store: PrefixKvStore) -> None:
    """Capacity bounds, one tier per block, no orphans, and a prefix-closed main tier."""
    held = store.held()
    gpu, cpu = set(held[GPU]), set(held.get(CPU, ()))
    assert len(gpu) <= store.capacity(GPU)
    assert len(cpu) <= store.capacity(CPU)
    assert not gpu & cpu
    assert len(store) == len(gpu) + len(cpu)
    for h in gpu:
        p = store.parent_of(h)
        assert p is None or p in gpu
    for h in cpu:
        p = store.parent_of(h)
        assert p is None or p in gpu or p in cpu


# ---------------------------------------------------------------------------------------------- basics


def test_match_returns_exact_stored_bytes() -> None:
    store = make_store(cap=64)
    seq = toks(100, 43)  # 10 full blocks + 3
    kv = kv_for(seq)
    assert store.insert(seq, kv) == 10
    m = store.match(seq)
    assert m.num_tokens == 40 and m.num_blocks == 10
    assert m.kv is not None and m.kv.is_contiguous()
    assert tuple(m.kv.shape) == (L, 2, H, 40, D)
    assert torch.equal(m.kv, kv[:, :, :, :40])
    assert m.hashes == hash_token_blocks(seq, 4)
    assert m.tier_hits == {GPU: 10}


def test_partial_prefix_and_divergent_continuations() -> None:
    store = make_store(cap=64)
    shared = toks(0, 20)  # 5 blocks
    a, b = shared + toks(500, 12), shared + toks(900, 12)
    store.insert(a, kv_for(a))
    assert len(store) == 8
    assert store.insert(b, kv_for(b)) == 3  # the shared 5 blocks are skipped
    assert len(store) == 11
    for seq in (a, b):
        m = store.match(seq + [7])
        assert m.num_blocks == 8
        assert m.kv is not None and torch.equal(m.kv, kv_for(seq)[:, :, :, :32])
    c = shared + toks(700, 30)
    m = store.match(c)
    assert m.num_blocks == 5
    assert m.kv is not None and torch.equal(m.kv, kv_for(c)[:, :, :, :20])
    # diverging inside the first block matches nothing
    assert store.match([1] + shared[1:]).num_tokens == 0


def test_never_matches_whole_prompt() -> None:
    store = make_store(cap=64)
    seq = toks(0, 16)
    store.insert(seq, kv_for(seq))
    assert store.match(seq).num_blocks == 3  # (16 - 1) // 4: the last token is left to compute
    assert store.match(seq[:13]).num_blocks == 3
    assert store.match(seq[:12]).num_blocks == 2
    assert store.match(seq[:5]).num_blocks == 1
    assert store.match(seq[:4]).num_blocks == 0
    assert store.match(seq[:1]).kv is None
    assert store.match([]).num_tokens == 0
    assert store.match(seq + [99]).num_blocks == 4


def test_salt_isolation() -> None:
    store = make_store(cap=64)
    seq = toks(0, 33)
    store.insert(seq, kv_for(seq, salt="tenant-a"), cache_salt="tenant-a")
    assert store.match(seq).num_tokens == 0
    assert store.match(seq, cache_salt="tenant-b").num_tokens == 0
    m = store.match(seq, cache_salt="tenant-a")
    assert m.num_tokens == 32
    assert m.hashes == hash_token_blocks(seq, 4, cache_salt="tenant-a")
    # the construction-time salt is the default scope
    salted = make_store(cap=64, salt="tenant-a")
    salted.insert(seq, kv_for(seq, salt="tenant-a"))
    assert salted.match(seq).num_tokens == 32
    assert salted.match(seq, cache_salt=None).num_tokens == 0


def test_insert_takes_the_shorter_of_tokens_and_kv_and_validates() -> None:
    store = make_store(cap=64)
    seq = toks(0, 24)
    kv = kv_for(seq)
    assert store.insert(seq, kv[:, :, :, :23]) == 5  # a decoded sequence's KV lacks its last token
    assert store.insert(seq[:8], kv) == 0  # already resident
    assert len(store) == 5
    with pytest.raises(ValueError, match="shape"):
        store.insert(seq, kv[:, :, :1])
    with pytest.raises(ValueError, match="dtype"):
        store.insert(seq, kv.double())
    with pytest.raises(ValueError):
        make_store(cap=0)


def test_sequence_longer_than_main_tier_keeps_its_head() -> None:
    store = make_store(cap=3)
    seq = toks(0, 40)
    assert store.insert(seq, kv_for(seq)) == 3
    assert store.match(seq).num_blocks == 3


def test_clear_and_stats() -> None:
    store = make_store(cap=8, l1=4)
    seq = toks(0, 20)
    store.insert(seq, kv_for(seq))
    store.match(seq)  # 4 of 4 matchable blocks
    store.match(toks(50, 9))  # 0 of 2
    s = store.stats()
    assert (s.hit_blocks, s.miss_blocks, s.hit_requests, s.miss_requests) == (4, 2, 1, 1)
    assert s.blocks == {GPU: 5, CPU: 0} and s.capacity == {GPU: 8, CPU: 4}
    assert s.hit_ratio == pytest.approx(4 / 6)
    assert s.bytes_per_block == L * 2 * H * 4 * D * 4
    assert s.to_dict()["request_hit_ratio"] == 0.5
    store.drain_events()
    store.clear()
    assert store.drain_events() == [cleared(None)]
    assert store.held() == {GPU: [], CPU: []}
    assert store.match(seq).num_tokens == 0
    assert store.insert(seq, kv_for(seq)) == 5  # the free lists were reset


# ------------------------------------------------------------------------------------- eviction and tiers


def test_lru_eviction_order_and_events() -> None:
    store = make_store(cap=4)
    a, b, c = toks(0, 8), toks(100, 8), toks(200, 8)
    ha, hb, hc = (hash_token_blocks(s, 4) for s in (a, b, c))
    store.insert(a, kv_for(a))
    store.insert(b, kv_for(b))
    assert store.drain_events() == [stored(ha, None, block_size=4), stored(hb, None, block_size=4)]
    assert store.match(a + [1]).num_blocks == 2  # touches a: b is now least recently used
    store.insert(c, kv_for(c))
    # leaf first, then its parent; one removal event for the batch
    assert store.drain_events() == [removed([hb[1], hb[0]], GPU), stored(hc, None, block_size=4)]
    assert store.held() == {GPU: [ha[1], ha[0], hc[1], hc[0]]}  # LRU first; each chain's root after its leaf
    assert store.stats().evictions[GPU] == 2 and store.stats().dropped == 2


def test_evicts_leaves_before_parents() -> None:
    store = make_store(cap=4)
    p = toks(0, 12)  # P1-P2-P3
    q = p[:4] + toks(300, 4)  # P1-Q2
    hp, hq = hash_token_blocks(p, 4), hash_token_blocks(q, 4)
    store.insert(p, kv_for(p))
    store.insert(q, kv_for(q))
    assert store.held()[GPU] == [hp[2], hp[1], hq[1], hp[0]]  # LRU first; the shared root is the newest
    evicted: list[int] = []
    for i in range(4):
        store.drain_events()
        r = toks(1000 + 10 * i, 4)
        store.insert(r, kv_for(r))
        (gone,) = (e for e in store.drain_events() if isinstance(e, BlockRemoved))
        evicted += gone.block_hashes
        check_structure(store)
    assert evicted == [hp[2], hp[1], hq[1], hp[0]]


def test_demotion_to_l1_and_promotion_back() -> None:
    store = make_store(cap=2, l1=4)
    a, b = toks(0, 8), toks(100, 8)
    ha, hb = hash_token_blocks(a, 4), hash_token_blocks(b, 4)
    store.insert(a, kv_for(a))
    store.drain_events()
    store.insert(b, kv_for(b))
    assert store.drain_events() == [
        stored(ha, None, block_size=4, medium=CPU),  # chain order, make before break
        removed([ha[1], ha[0]], GPU),
        stored(hb, None, block_size=4, medium=GPU),
    ]
    assert store.held() == {GPU: [hb[1], hb[0]], CPU: [ha[1], ha[0]]}
    m = store.match(a + [5])
    assert m.tier_hits == {GPU: 0, CPU: 2}
    assert m.kv is not None and torch.equal(m.kv, kv_for(a))
    assert store.drain_events() == [
        stored(hb, None, block_size=4, medium=CPU),
        removed([hb[1], hb[0]], GPU),
        stored(ha, None, block_size=4, medium=GPU),
        removed(ha, CPU),
    ]
    assert store.held() == {GPU: [ha[1], ha[0]], CPU: [hb[1], hb[0]]}
    s = store.stats()
    assert (s.promotions, s.demotions, s.tier_hit_blocks[CPU]) == (2, 4, 2)
    # b's KV survived two tier moves byte for byte
    m = store.match(b + [5])
    assert m.kv is not None and torch.equal(m.kv, kv_for(b))


def test_mixed_tier_match() -> None:
    store = make_store(cap=3, l1=8)
    seq = toks(0, 24)  # 6 blocks: only 3 fit the main tier
    h = hash_token_blocks(seq, 4)
    store.insert(seq[:12], kv_for(seq[:12]))  # blocks 0-2 in main
    store.insert(toks(500, 12), kv_for(toks(500, 12)))  # demotes 0-2
    store.insert(seq[:4], kv_for(seq[:4]))  # block 0 back in main (promoted with the given KV)
    assert store.tier_of(h[0]) == GPU and store.tier_of(h[1]) == CPU
    check_structure(store)
    m = store.match(seq)
    assert m.num_blocks == 3 and m.tier_hits == {GPU: 1, CPU: 2}
    assert m.kv is not None and torch.equal(m.kv, kv_for(seq)[:, :, :, :12])
    assert [store.tier_of(x) for x in h[:3]] == [GPU, GPU, GPU]
    check_structure(store)


def test_promotion_keeps_parents_more_recent_than_children() -> None:
    store = make_store(cap=3, l1=4)
    seq = toks(0, 12)
    h = hash_token_blocks(seq, 4)
    store.insert(seq, kv_for(seq))
    store.insert(toks(100, 4), kv_for(toks(100, 4)))  # demotes the leaf S2 only
    assert [store.tier_of(x) for x in h] == [GPU, GPU, CPU]
    m = store.match(seq + [1])
    assert m.tier_hits == {GPU: 2, CPU: 1}
    assert store.held()[GPU] == [h[2], h[1], h[0]]  # the promoted leaf is the oldest of its chain
    store.insert(toks(200, 4), kv_for(toks(200, 4)))
    assert store.tier_of(h[2]) == CPU  # so it is what goes next
    check_structure(store)


def test_l1_overflow_drops_leaves_first() -> None:
    store = make_store(cap=2, l1=2)
    chains = [toks(1000 * i, 8) for i in range(4)]
    for c in chains:
        store.insert(c, kv_for(c))
        check_structure(store)
    h = [hash_token_blocks(c, 4) for c in chains]
    assert store.held() == {GPU: [h[3][1], h[3][0]], CPU: [h[2][1], h[2][0]]}
    # a demotion batch bigger than L1: only its newest blocks are copied, the rest dropped straight away
    big = toks(9000, 8)
    store2 = make_store(cap=4, l1=1)
    for c in chains[:2]:
        store2.insert(c, kv_for(c))
    store2.insert(big[:4] + toks(7000, 12), kv_for(big[:4] + toks(7000, 12)))
    check_structure(store2)
    # four evicted at once (A1 A0 B1 B0, leaves first) into a one-block L1: only B's root is kept
    assert store2.held()[CPU] == [h[1][0]]


# ------------------------------------------------------------------------------------- events vs index


# Prefixes of a few documents that themselves share prefixes, plus a random tail: most requests hit a
# cached chain part of the way, which is where tier moves and eviction order matter.
DOCS = [
    [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1],
    [0, 1, 2, 0, 2, 2, 1, 1, 0, 0, 2, 1, 1, 0],
    [0, 1, 1, 1, 0, 2, 2, 0, 1, 2, 1, 0, 0, 2],
    [2, 2, 0, 1, 0, 1, 2, 2, 0, 0, 1, 1, 2, 2],
]
SEQS = st.builds(
    lambda doc, n, tail: DOCS[doc][:n] + tail,
    st.integers(0, len(DOCS) - 1),
    st.integers(0, 14),
    st.lists(st.integers(min_value=0, max_value=2), max_size=4),
)


class StoreVsIndex(RuleBasedStateMachine):
    """Random inserts/matches over a tiny alphabet (lots of shared prefixes) with tiny tiers: replaying the
    drained events into a PrefixIndex must reproduce held(), and the index's lookup must predict match()."""

    def __init__(self) -> None:
        super().__init__()
        self.store: PrefixKvStore | None = None
        self.replica = Replica()

    @initialize(cap=st.integers(1, 6), l1=st.integers(0, 6))
    def configure(self, cap: int, l1: int) -> None:
        self.store = PrefixKvStore(
            num_layers=L, num_kv_heads=H, head_dim=D, block_size=2, capacity_blocks=cap, l1_capacity_blocks=l1
        )

    def _store(self) -> PrefixKvStore:
        assert self.store is not None
        return self.store

    @rule(seq=SEQS, short=st.booleans())
    def insert(self, seq: list[int], short: bool) -> None:
        store = self._store()
        kv = kv_for(seq, 2)
        store.insert(seq, kv[:, :, :, : max(len(seq) - 1, 0)] if short else kv)
        self.replica.feed(store.drain_events())

    @rule(seq=SEQS)
    def match(self, seq: list[int]) -> None:
        store = self._store()
        hashes = hash_token_blocks(seq, 2)
        limit = min(len(hashes), max(len(seq) - 1, 0) // 2)
        expect_any = self.replica.index.lookup(hashes[:limit]).get(WORKER, 0)
        expect_gpu = self.replica.index.lookup(hashes[:limit], GPU).get(WORKER, 0)
        m = store.match(seq)
        assert m.num_blocks == expect_any
        assert m.tier_hits.get(GPU, 0) == expect_gpu
        assert sum(m.tier_hits.values()) == m.num_blocks
        if m.num_blocks:
            assert m.kv is not None and torch.equal(m.kv, kv_for(seq, 2)[:, :, :, : m.num_tokens])
        else:
            assert m.kv is None
        self.replica.feed(store.drain_events())
        # after a hit the whole run is resident in the main tier, as far as it fits
        held_gpu = set(store.held()[GPU])
        in_main = sum(1 for h in hashes[: m.num_blocks] if h in held_gpu)
        assert in_main == min(m.num_blocks, store.capacity(GPU))

    @rule()
    def clear(self) -> None:
        store = self._store()
        store.clear()
        self.replica.feed(store.drain_events())

    @invariant()
    def agrees(self) -> None:
        if self.store is not None:
            assert self.store.pending_events == 0
            check_structure(self.store)
            self.replica.assert_agrees(self.store)


TestStoreVsIndex = StoreVsIndex.TestCase
TestStoreVsIndex.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_resync_from_held_matches_replay() -> None:
    store = make_store(cap=5, l1=3, bs=2)
    replica = Replica()
    for i in range(30):
        seq = [(i * 7 + j) % 3 for j in range(2 + i % 9)]
        store.insert(seq, kv_for(seq, 2))
        store.match(seq[::-1])
        replica.feed(store.drain_events())
    fresh = PrefixIndex()
    fresh.resync(WORKER, replica.seq - 1, store.held())
    probe = [[(i * 7 + j) % 3 for j in range(12)] for i in range(30)]
    for seq in probe:
        hashes = hash_token_blocks(seq, 2)
        assert fresh.lookup(hashes) == replica.index.lookup(hashes)
        assert fresh.lookup(hashes, CPU) == replica.index.lookup(hashes, CPU)


# ------------------------------------------------------------------------------------- the real engine


@pytest.fixture()
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_engine_prefill_with_matched_prefix(one_thread: None) -> None:
    from splitserve.engines import Sampling
    from splitserve.engines.hf import HfEngine
    from tests.engines.enginetest import make_tiny_model, make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    engine = HfEngine(make_tiny_model(len(tokenizer)), tokenizer, name="tiny")
    info = engine.info
    store = PrefixKvStore(
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        dtype=info.dtype,
        capacity_blocks=16,
    )
    greedy = Sampling()
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, info.vocab_size, (53,), generator=gen).tolist()
    first = engine.prefill(prompt, greedy)
    store.insert(prompt, first.kv)

    # same prefix, different continuation
    other = prompt[:40] + torch.randint(3, info.vocab_size, (9,), generator=gen).tolist()
    m = store.match(other)
    assert m.num_tokens == 32
    reused = engine.prefill(other, greedy, past_kv=m.kv)
    full = engine.prefill(other, greedy)
    assert reused.num_computed_tokens == len(other) - 32
    assert reused.first_token == full.first_token
    torch.testing.assert_close(reused.kv, full.kv, rtol=1e-5, atol=1e-5)

    # the whole prompt again: every full block but never the last token
    m = store.match(prompt)
    assert m.num_tokens == 48
    again = engine.prefill(prompt, greedy, past_kv=m.kv)
    assert again.num_computed_tokens == 5
    assert again.first_token == first.first_token
    torch.testing.assert_close(again.kv, first.kv, rtol=1e-5, atol=1e-5)
