"""A paged KV block pool: one contiguous CPU tensor plus a bounded allocator of block ids.

Memory is ``[num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]`` (vLLM-like: per layer, per
block), so one block of one layer is a contiguous run of ``layout.bytes_per_block_per_layer`` bytes at
:meth:`BlockPool.offset`. Transports move those runs; ``scatter``/``gather`` convert between a request's
``[L, 2, H, T, D]`` tensor and its blocks. The pool is allocated once and never reallocated, so its address
can be registered with a transport for the pool's whole life.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from splitserve.kv.layout import KvLayout


class BlockPoolExhausted(RuntimeError):
    """Not enough free blocks for an allocation."""


class BlockPool:
    def __init__(self, layout: KvLayout, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.tensor = torch.zeros(layout.pool_shape(num_blocks), dtype=layout.dtype)
        self._free: list[int] = list(range(num_blocks))  # a heap: lowest ids first keeps runs contiguous
        self._allocated: set[int] = set()

    # ------------------------------------------------------------------------------------------ allocator

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free block ids (lowest first). Raises :class:`BlockPoolExhausted` if there are fewer."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise BlockPoolExhausted(
                f"need {n} blocks, only {len(self._free)} of {self.num_blocks} free"
            )
        ids = [heapq.heappop(self._free) for _ in range(n)]
        self._allocated.update(ids)
        return ids

    def try_allocate(self, n: int) -> list[int] | None:
        """Like :meth:`allocate` but returns None when the pool cannot satisfy the request."""
        try:
            return self.allocate(n)
        except BlockPoolExhausted:
            return None

    def free(self, block_ids: Sequence[int]) -> None:
        unknown = [b for b in block_ids if b not in self._allocated]
        if unknown or len(set(block_ids)) != len(block_ids):
            raise ValueError(f"freeing blocks not allocated (or listed twice): {unknown or list(block_ids)}")
        for b in block_ids:
            self._allocated.remove(b)
            heapq.heappush(self._free, b)

    # ------------------------------------------------------------------------------------------- memory

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def offset(self, layer: int, block_id: int) -> int:
        """Byte offset of (layer, block) from the start of the pool."""
        return (layer * self.num_blocks + block_id) * self.layout.bytes_per_block_per_layer

    def byte_view(self) -> memoryview:
        """A writable, flat uint8 view of the whole pool (shares memory; no copy)."""
        view: memoryview = self.tensor.view(torch.uint8).reshape(-1).numpy().data
        return view

    def check_block_ids(self, block_ids: Sequence[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids out of range [0, {self.num_blocks}): {bad[:8]}")

    def scatter(self, kv: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Write one request's ``[L, 2, H, T, D]`` KV into its blocks (the last block may be partial)."""
        lay = self.layout
        want = (lay.num_layers, 2, lay.num_kv_heads)
        if kv.dim() != 5 or tuple(kv.shape[:3]) != want or kv.shape[4] != lay.head_dim:
            raise ValueError(
                f"kv shape {tuple(kv.shape)} does not match layout "
                f"[{lay.num_layers}, 2, {lay.num_kv_heads}, T, {lay.head_dim}]"
            )
        if kv.dtype != lay.dtype:
            raise ValueError(f"kv dtype {kv.dtype} does not match layout dtype {lay.dtype}")
        num_tokens = kv.shape[3]
        if len(block_ids) != lay.blocks_for_tokens(num_tokens):
            raise ValueError(
                f"{num_tokens} tokens need {lay.blocks_for_tokens(num_tokens)} blocks, got {len(block_ids)}"
            )
        self.check_block_ids(block_ids)
        bs = lay.block_size
        full = num_tokens // bs
        if full:
            src = kv[:, :, :, : full * bs, :].reshape(
                lay.num_layers, 2, lay.num_kv_heads, full, bs, lay.head_dim
            )
            # [L, 2, H, n, bs, D] -> [L, n, 2, H, bs, D], the pool's per-block order
            idx = torch.tensor(block_ids[:full], dtype=torch.long)
            self.tensor.index_copy_(1, idx, src.permute(0, 3, 1, 2, 4, 5))
        rest = num_tokens - full * bs
        if rest:
            self.tensor[:, block_ids[full], :, :, :rest, :] = kv[:, :, :, full * bs :, :]

    def scatter_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Write one layer's ``[H, T, D]`` keys and values into the blocks (layer-by-layer push: each
        layer is staged as soon as it is computed, while later layers still compute)."""
        lay = self.layout
        num_tokens = k.shape[1]
        if len(block_ids) != lay.blocks_for_tokens(num_tokens):
            raise ValueError(
                f"{num_tokens} tokens need {lay.blocks_for_tokens(num_tokens)} blocks, got {len(block_ids)}"
            )
        bs = lay.block_size
        full = num_tokens // bs
        kv = torch.stack((k, v))  # [2, H, T, D]
        if full:
            src = kv[:, :, : full * bs, :].reshape(2, lay.num_kv_heads, full, bs, lay.head_dim)
            idx = torch.tensor(block_ids[:full], dtype=torch.long)
            self.tensor[layer].index_copy_(0, idx, src.permute(2, 0, 1, 3, 4))
        rest = num_tokens - full * bs
        if rest:
            self.tensor[layer, block_ids[full], :, :, :rest, :] = kv[:, :, full * bs :, :]

    def source(self, block_ids: Sequence[int], num_tokens: int) -> BlockKv:
        """The KV in these blocks, for an engine to read layer by layer (see ``engines.KvSource``); valid
        until the blocks are freed."""
        self._check_span(block_ids, num_tokens)
        return BlockKv(self, list(block_ids), num_tokens)

    def _check_span(self, block_ids: Sequence[int], num_tokens: int) -> None:
        """The blocks exist, are allocated, and are exactly as many as num_tokens needs."""
        need = self.layout.blocks_for_tokens(num_tokens)
        if need != len(block_ids):
            raise ValueError(f"{num_tokens} tokens need {need} blocks, got {len(block_ids)}")
        self.check_block_ids(block_ids)

    def gather(self, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
        """Read ``num_tokens`` of KV out of ``block_ids`` as a fresh ``[L, 2, H, T, D]`` tensor."""
        lay = self.layout
        self._check_span(block_ids, num_tokens)
        n = len(block_ids)
        blocks = self.tensor.index_select(1, torch.tensor(list(block_ids), dtype=torch.long))
        kv = blocks.permute(0, 2, 3, 1, 4, 5).reshape(
            lay.num_layers, 2, lay.num_kv_heads, n * lay.block_size, lay.head_dim
        )
        return kv[:, :, :, :num_tokens, :].contiguous()


class BlockKv:
    """One sequence's KV in pool blocks, read one layer at a time (an ``engines.KvSource``)."""

    def __init__(self, pool: BlockPool, block_ids: list[int], num_tokens: int) -> None:
        self.pool, self.block_ids, self._num_tokens = pool, block_ids, num_tokens
        self._idx = torch.tensor(block_ids, dtype=torch.long)
        # runs of consecutive block ids (the allocator hands out low ids first, so usually one or a few):
        # each run is a strided view of the pool, copied out with no temporary
        self._runs: list[tuple[int, int, int]] = []  # (first block id, blocks, first token)
        for i, b in enumerate(block_ids):
            if self._runs and self._runs[-1][0] + self._runs[-1][1] == b:
                first, n, tok = self._runs[-1]
                self._runs[-1] = (first, n + 1, tok)
            else:
                self._runs.append((b, 1, i * pool.layout.block_size))

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self.pool.layout
        # one layer's blocks [n, 2, H, bs, D] -> [2, H, n * bs, D]: a few MB, cache-resident
        blocks = self.pool.tensor[layer].index_select(0, self._idx)
        kv = blocks.permute(1, 2, 0, 3, 4).reshape(2, lay.num_kv_heads, len(self.block_ids) * lay.block_size,
                                                    lay.head_dim)
        return kv[0, :, : self._num_tokens], kv[1, :, : self._num_tokens]

    def copy_layer(self, layer: int, keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
        bs = self.pool.layout.block_size
        lay_t = self.pool.tensor[layer]  # [num_blocks, 2, H, bs, D]
        for first, n, tok in self._runs:
            take = min(n * bs, self._num_tokens - tok)  # the last run may end inside its last block
            full, rest = divmod(take, bs)
            for part, out in ((0, keys_out), (1, values_out)):
                if full:
                    src = lay_t[first : first + full, part].permute(1, 0, 2, 3)  # [H, full, bs, D]
                    dst = out[:, tok : tok + full * bs].unflatten(1, (full, bs))
                    dst.copy_(src)
                if rest:
                    out[:, tok + full * bs : tok + take] = lay_t[first + full, part, :, :rest]
