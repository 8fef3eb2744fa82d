"""Fast unit tests: KvLayout arithmetic, BlockPool allocation and scatter/gather, descriptor envelope,
completion tally. No processes, no transports."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.kv import SMOLLM2_135M, BlockPool, BlockPoolExhausted, KvLayout
from splitserve.kv.transport.base import (
    BadDescriptor,
    CompletionBoard,
    KvTransferError,
    KvTransferTimeout,
    TargetDescriptor,
    block_runs,
)

SMALL = KvLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4)


def test_bundled_model_layout_sizes() -> None:
    lay = SMOLLM2_135M
    assert lay.bytes_per_token == 46_080
    assert lay.bytes_per_block_per_layer == 2 * 3 * 16 * 64 * 4
    assert lay.bytes_per_block == 16 * 46_080
    assert lay.blocks_for_tokens(0) == 0
    assert lay.blocks_for_tokens(16) == 1
    assert lay.blocks_for_tokens(2000) == 125
    assert lay.blocks_for_tokens(2001) == 126
    assert lay.kv_shape(7) == (30, 2, 3, 7, 64)
    assert lay.fingerprint() == "L30-H3-D64-B16-float32"


def test_layout_serialises_dtype_by_name() -> None:
    lay = KvLayout(4, 2, 8, block_size=8, dtype=torch.bfloat16)
    data = lay.to_dict()
    assert data["dtype"] == "bfloat16"
    assert KvLayout.from_dict(data) == lay
    assert lay.bytes_per_token == 4 * 2 * 2 * 8 * 2


@pytest.mark.parametrize("bad", [{"num_layers": 0}, {"head_dim": -1}, {"block_size": 1.5}])
def test_layout_rejects_bad_values(bad: dict[str, object]) -> None:
    args = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "block_size": 4} | bad
    with pytest.raises(ValueError):
        KvLayout(**args)  # type: ignore[arg-type]


def test_layout_rejects_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        KvLayout(2, 2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="unknown KV dtype"):
        KvLayout.from_dict({"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "dtype": "float64"})


def test_pool_allocates_within_bounds_and_frees() -> None:
    pool = BlockPool(SMALL, 8)
    assert pool.tensor.shape == (3, 8, 2, 2, 4, 4)
    a = pool.allocate(5)
    assert a == [0, 1, 2, 3, 4] and pool.num_free == 3
    with pytest.raises(BlockPoolExhausted, match="need 4 blocks, only 3 of 8 free"):
        pool.allocate(4)
    assert pool.try_allocate(4) is None
    assert pool.num_free == 3  # a failed allocation takes nothing
    pool.free(a[1:3])
    assert pool.allocate(2) == [1, 2]  # lowest ids first
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([7])
    pool.free([0])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([0])  # double free
    with pytest.raises(ValueError, match="listed twice"):
        pool.free([3, 3])
    assert pool.allocate(0) == []


def test_pool_offsets_match_tensor_indexing() -> None:
    pool = BlockPool(SMALL, 5)
    pool.tensor[2, 3].fill_(7.0)
    view = pool.byte_view()
    off = pool.offset(2, 3)
    size = SMALL.bytes_per_block_per_layer
    block = torch.frombuffer(bytearray(view[off : off + size]), dtype=torch.float32)
    assert torch.all(block == 7.0)
    assert pool.nbytes == 3 * 5 * size
    view[0:4] = torch.tensor([1.5]).numpy().tobytes()  # the view is writable and shared
    assert pool.tensor.flatten()[0].item() == 1.5


@settings(max_examples=40, deadline=None)
@given(num_tokens=st.integers(0, 33), data=st.data())
def test_scatter_gather_roundtrip(num_tokens: int, data: st.DataObject) -> None:
    pool = BlockPool(SMALL, 12)
    n = SMALL.blocks_for_tokens(num_tokens)
    ids = data.draw(st.permutations(list(range(12))))[:n]
    kv = torch.randn(SMALL.kv_shape(num_tokens))
    pool.scatter(kv, ids)
    assert torch.equal(pool.gather(ids, num_tokens), kv)


def test_scatter_leaves_other_blocks_alone() -> None:
    pool = BlockPool(SMALL, 6)
    pool.tensor.fill_(-1.0)
    kv = torch.randn(SMALL.kv_shape(6))  # one full block, one partial
    pool.scatter(kv, [4, 1])
    untouched = [b for b in range(6) if b not in (4, 1)]
    assert torch.all(pool.tensor[:, untouched] == -1.0)
    assert torch.all(pool.tensor[:, 1, :, :, 2:, :] == -1.0)  # tail of the partial block
    assert torch.equal(pool.gather([4, 1], 6), kv)


def test_scatter_gather_validate_inputs() -> None:
    pool = BlockPool(SMALL, 4)
    with pytest.raises(ValueError, match="need 2 blocks"):
        pool.scatter(torch.zeros(SMALL.kv_shape(5)), [0])
    with pytest.raises(ValueError, match="does not match layout"):
        pool.scatter(torch.zeros(3, 2, 2, 4, 5), [0])
    with pytest.raises(ValueError, match="dtype"):
        pool.scatter(torch.zeros(SMALL.kv_shape(4), dtype=torch.float16), [0])
    with pytest.raises(ValueError, match="out of range"):
        pool.gather([0, 9], 8)


def test_block_runs_merge_only_when_both_sides_contiguous() -> None:
    assert block_runs([0, 1, 2, 7], [5, 6, 7, 8]) == [(0, 5, 3), (7, 8, 1)]
    assert block_runs([3, 4], [1, 0]) == [(3, 1, 1), (4, 0, 1)]
    assert block_runs([], []) == []


def test_descriptor_roundtrip_and_rejections() -> None:
    desc = TargetDescriptor("tcp", SMALL.fingerprint(), (3, 1, 2), {"host": "127.0.0.1", "port": 5})
    blob = desc.encode()
    assert TargetDescriptor.decode(blob, "tcp") == desc
    assert len(blob) < 100
    with pytest.raises(BadDescriptor, match="undecodable|not a splitserve"):
        TargetDescriptor.decode(blob[: len(blob) // 2], "tcp")
    with pytest.raises(BadDescriptor, match="for transport 'tcp'"):
        TargetDescriptor.decode(blob, "nixl")
    with pytest.raises(BadDescriptor):
        TargetDescriptor.decode(b"\x00garbage", "tcp")
    with pytest.raises(BadDescriptor, match="must be bytes"):
        TargetDescriptor.decode("text", "tcp")  # type: ignore[arg-type]
    with pytest.raises(BadDescriptor, match="lacks a valid 'port'"):
        TargetDescriptor.decode(blob, "tcp").require("port", str)


async def test_completion_board_counts_out_of_order_pushes() -> None:
    board = CompletionBoard()
    board.landed("t", final=True, total=3)  # the final push overtook two others
    with pytest.raises(KvTransferTimeout, match="1 push\\(es\\) landed, 3 expected"):
        await board.wait("t", 0.05)
    waiter = asyncio.create_task(board.wait("t", 5))
    board.landed("t", final=False, total=0)
    await asyncio.sleep(0.01)
    assert not waiter.done()
    board.landed("t", final=False, total=0)
    await asyncio.wait_for(waiter, 1)
    await board.wait("t", 0.01)  # completed transfers are remembered

    board.failed("x", "sender disconnected")
    with pytest.raises(KvTransferError, match="sender disconnected"):
        await board.wait("x", 1)


async def test_completion_board_wakes_waiters_from_other_threads() -> None:
    board = CompletionBoard()
    waiter = asyncio.create_task(board.wait("t", 5))
    await asyncio.sleep(0.01)
    await asyncio.to_thread(board.landed, "t", True, 1)
    await asyncio.wait_for(waiter, 1)


def test_scatter_layer_matches_whole_scatter() -> None:
    import torch

    from splitserve.kv import BlockPool, KvLayout

    lay = KvLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4)
    kv = torch.randn(lay.kv_shape(10))
    a, b = BlockPool(lay, 8), BlockPool(lay, 8)
    blocks = [5, 1, 6]
    a.scatter(kv, blocks)
    for layer in range(3):
        b.scatter_layer(layer, kv[layer, 0], kv[layer, 1], blocks)
    assert torch.equal(a.gather(blocks, 10), kv)
    assert torch.equal(b.gather(blocks, 10), kv)


@settings(max_examples=25, deadline=None)
@given(num_tokens=st.integers(min_value=1, max_value=70), data=st.data())
def test_block_source_reads_what_gather_reads(num_tokens: int, data: st.DataObject) -> None:
    lay = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=8, dtype=torch.float32)
    pool = BlockPool(lay, 16)
    n = lay.blocks_for_tokens(num_tokens)
    ids = data.draw(st.sampled_from([list(range(n)), list(range(3, 3 + n)),
                                     data.draw(st.permutations(list(range(16))))[:n]]))
    kv = torch.randn(lay.num_layers, 2, lay.num_kv_heads, num_tokens, lay.head_dim)
    pool.scatter(kv, ids)
    src = pool.source(ids, num_tokens)
    assert src.num_tokens == num_tokens
    for layer in range(lay.num_layers):
        k, v = src.layer(layer)
        assert torch.equal(k, kv[layer, 0]) and torch.equal(v, kv[layer, 1])
        # straight into a strided destination (a batch row's columns), block runs and a partial last block
        dest = torch.zeros(2, lay.num_kv_heads, num_tokens + 5, lay.head_dim)
        src.copy_layer(layer, dest[0, :, 3 : 3 + num_tokens], dest[1, :, 3 : 3 + num_tokens])
        assert torch.equal(dest[0, :, 3 : 3 + num_tokens], kv[layer, 0])
        assert torch.equal(dest[1, :, 3 : 3 + num_tokens], kv[layer, 1])
        assert not dest[:, :, :3].any() and not dest[:, :, 3 + num_tokens :].any()
    with pytest.raises(ValueError, match="blocks"):
        pool.source(ids[:-1] if len(ids) > 1 else [], num_tokens)


def test_engine_joins_straight_from_blocks() -> None:
    # hf engine: a sequence added from pool blocks decodes exactly as one added from the gathered tensor
    from splitserve.engines.base import Sampling
    from splitserve.engines.hf import HfEngine
    from tests.engines.enginetest import make_tiny_model, make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    eng = HfEngine(make_tiny_model(len(tok)), tok, name="tiny")
    info = eng.info
    lay = KvLayout(num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                   block_size=16, dtype=torch.float32)
    pool = BlockPool(lay, 8)
    res = eng.prefill(eng.encode("the quick brown fox jumps over the lazy dog"), Sampling())
    ids = pool.allocate(lay.blocks_for_tokens(res.kv.shape[3]))
    pool.scatter(res.kv, ids)
    eng.add_sequence("from-blocks", pool.source(ids, res.kv.shape[3]), res.first_token, Sampling())
    eng.add_sequence("from-tensor", pool.gather(ids, res.kv.shape[3]), res.first_token, Sampling())
    for _ in range(5):
        out = eng.step()
        assert out["from-blocks"] == out["from-tensor"]
