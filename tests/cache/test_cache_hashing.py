"""Block hashing: chaining, determinism across processes, scoping keys, Mooncake mapping."""

from __future__ import annotations

import subprocess
import sys
from array import array

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from splitserve.cache import BlockHasher, hash_token_blocks, mooncake_block_hashes, pack_tokens, root_hash

TOKENS = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)


def test_only_full_blocks_are_hashed() -> None:
    assert hash_token_blocks([], 16) == []
    assert hash_token_blocks(list(range(15)), 16) == []
    assert len(hash_token_blocks(list(range(16)), 16)) == 1
    assert len(hash_token_blocks(list(range(47)), 16)) == 2


@settings(max_examples=200, deadline=None)
@given(TOKENS, TOKENS, st.sampled_from([1, 4, 16]))
def test_hash_of_block_i_depends_on_whole_prefix(a: list[int], b: list[int], bs: int) -> None:
    ha, hb = hash_token_blocks(a, bs), hash_token_blocks(b, bs)
    for i in range(min(len(ha), len(hb))):
        same_prefix = a[: (i + 1) * bs] == b[: (i + 1) * bs]
        assert (ha[i] == hb[i]) == same_prefix


@settings(max_examples=100, deadline=None)
@given(TOKENS, st.integers(min_value=0, max_value=12))
def test_extend_continues_the_chain(tokens: list[int], cut_blocks: int) -> None:
    hasher = BlockHasher(4)
    full = hasher(tokens)
    cut = min(cut_blocks, len(full)) * 4
    head = hasher(tokens[:cut])
    tail = hasher.extend(head[-1] if head else None, tokens[cut:])
    assert head + tail == full


def test_salt_and_lora_scope_the_chain() -> None:
    toks = list(range(64))
    plain = hash_token_blocks(toks)
    assert hash_token_blocks(toks, cache_salt="tenant-a") != plain
    assert hash_token_blocks(toks, cache_salt="tenant-a") != hash_token_blocks(toks, cache_salt="tenant-b")
    assert hash_token_blocks(toks, lora="adapter") != plain
    assert hash_token_blocks(toks, cache_salt="tenant-a") == BlockHasher(cache_salt="tenant-a")(toks)
    assert root_hash(None, None, ("ab", "c")) != root_hash(None, None, ("a", "bc"))
    assert root_hash(None, None, (1,)) != root_hash(None, None, ("1",))
    assert root_hash(None, None, (True,)) != root_hash(None, None, (1,))


def test_packed_inputs_hash_the_same() -> None:
    toks = list(range(1000, 1100))
    want = hash_token_blocks(toks)
    assert hash_token_blocks(array("I", toks)) == want
    assert hash_token_blocks(pack_tokens(toks)) == want
    np = pytest.importorskip("numpy")
    assert hash_token_blocks(np.asarray(toks, dtype="<u4").tobytes()) == want


def test_hashes_are_stable_across_processes() -> None:
    code = (
        "from splitserve.cache import hash_token_blocks, mooncake_block_hashes;"
        "print(hash_token_blocks(list(range(64)), 16, cache_salt='t'), mooncake_block_hashes([1, 2, 3]))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    assert (
        outs.pop().strip() == f"{hash_token_blocks(list(range(64)), 16, cache_salt='t')} "
        f"{mooncake_block_hashes([1, 2, 3])}"
    )


def test_known_vector() -> None:
    # Pinned: a change to the hash definition must show up here, not as a silent mismatch between a new
    # router and old workers.
    assert hash_token_blocks(list(range(32)), 16) == [13225694441504462260, 14289854655245344412]


def test_mooncake_prefix_sharing_and_expansion() -> None:
    a = mooncake_block_hashes([0, 1, 2, 3])
    b = mooncake_block_hashes([0, 1, 9])
    assert a[:2] == b[:2] and a[2] != b[2]
    fine_a = mooncake_block_hashes([0, 1, 2, 3], block_size=16)
    fine_b = mooncake_block_hashes([0, 1, 9], block_size=16)
    assert len(fine_a) == 4 * 32 and len(fine_b) == 3 * 32
    assert fine_a[:64] == fine_b[:64] and fine_a[64] != fine_b[64]
    assert len(set(fine_a)) == len(fine_a)
    with pytest.raises(ValueError):
        mooncake_block_hashes([1], block_size=100)
