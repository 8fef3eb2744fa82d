"""The hf engine's decode batch: which sequences are active and where their KV lives.

All active sequences share per-layer buffers [row_capacity, H, col_capacity, D]. Rows 0..B-1 are in use;
each row is right-aligned at column `width` (left-padded), so one step appends column `width` for every row,
with an explicit position id per row and an attention mask hiding the padding.

Joins and leaves are done in place, because rebuilding the whole padded batch (what a stock DynamicCache
approach needs) was measured at 200-600 ms for 8 x 1,000 tokens -- several decode steps' worth of stall
for every stream, at every join:

* join: the new KV is copied into row B (cost: that sequence only). Only a prompt longer than every active
  sequence forces a re-layout (all rows shifted right);
* leave: the row's KV is copied out, and the last row is moved into its slot (cost: one sequence);
* the buffers are reused across joins/leaves and grow geometrically, so fresh memory (page faults, the
  other big cost on CPU) is touched rarely; the layout is compacted when over half of it is padding.

Rows of very different lengths (a 3,000-token prompt joining 100-token streams) are attended in groups of
similar length (``splitserve.engines.attention.row_groups``), each over its own columns only: a short row no
longer pays, every step, for the long row's width. Padding a group reads must be finite (masked weights are
exactly 0, but 0 * NaN garbage is NaN), so it is zeroed lazily, only as far as the row's group reaches: a join
no longer writes zeros across every short row's full width (the bulk of a long join's cost).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from splitserve.engines.attention import RowGroup
from splitserve.engines.base import KvSource, ModelInfo, Sampling
from splitserve.engines.kvcache import BatchCache

# A row starts a new attention group when it is this much longer than the group's shortest row.
GROUP_RATIO = 2
GROUP_SLACK = 256


@dataclass
class _Seq:
    seq_id: str
    length: int  # tokens in KV
    last_token: int  # fed at position `length` by the next step
    sampling: Sampling
    zero_from: int = 0  # columns [zero_from, width - length) of its row are zeros (finite padding)
    lora: str | None = None  # its LoRA adapter (None: the base model); moves with the row


@dataclass(frozen=True)
class StepInputs:
    input_ids: Tensor  # [B, 1]
    position_ids: Tensor  # [B, 1]
    attention_mask: Tensor | None  # [B, width + 1], None when no row is padded
    cache: BatchCache
    seq_ids: list[str]
    samplings: list[Sampling]
    sample_positions: list[int]  # absolute position of the token each row samples
    groups: list[RowGroup] | None = None  # attention row groups (None: one group over every column)
    loras: list[str | None] | None = None  # each row's LoRA adapter, in row order (None: no row has one)


class DecodeBatch:
    def __init__(self, info: ModelInfo, dtype: torch.dtype, device: torch.device, min_headroom: int = 64,
                 grouped: bool = False) -> None:
        self.info, self.dtype, self.device = info, dtype, device
        # grouped: the model's attention honours row groups; otherwise every row attends over all columns,
        # so all padding must be zeroed
        self.grouped = grouped
        self.min_headroom = min_headroom  # columns reserved beyond the width when (re)allocating
        self.rows: list[_Seq] = []  # row order
        self.keys: list[Tensor] = []  # per layer [row_capacity, H, col_capacity, D]
        self.values: list[Tensor] = []
        self.width = 0  # columns in use
        self.relayouts = 0  # copies of the whole batch (shift, compaction, growth); for tests and metrics

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def seq_ids(self) -> list[str]:
        return [s.seq_id for s in self.rows]

    def _row(self, seq_id: str) -> int:
        for row, seq in enumerate(self.rows):
            if seq.seq_id == seq_id:
                return row
        raise KeyError(seq_id)

    def _capacity(self) -> tuple[int, int]:
        return (self.keys[0].shape[0], self.keys[0].shape[2]) if self.keys else (0, 0)

    def _empty(self, shape: tuple[int, ...]) -> Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _relayout(self, width: int, rows: int, columns: int) -> None:
        """Re-align the active rows at `width`, in buffers of at least rows x columns (reused if they fit)."""
        row_cap, col_cap = self._capacity()
        old_keys, old_values, old_width = self.keys, self.values, self.width
        in_place = rows <= row_cap and columns <= col_cap
        if not in_place:
            row_cap = max(rows, 2 * row_cap if rows > row_cap else row_cap, 8)
            col_cap = max(columns + self.min_headroom, columns * 3 // 2)
            shape = (row_cap, self.info.num_kv_heads, col_cap, self.info.head_dim)
            # empty, not zeros: spare rows/columns are written before they are ever read, and untouched pages
            # of a big allocation cost nothing, while zeroing them all was the bulk of a re-layout's time
            # ordinary tensors even when called from step()'s inference mode: add() writes them outside it
            with torch.inference_mode(False):
                self.keys = [self._empty(shape) for _ in range(self.info.num_layers)]
                self.values = [self._empty(shape) for _ in range(self.info.num_layers)]
        self.width = width
        if not self.rows:
            return
        for layer in range(self.info.num_layers):
            for new, old in ((self.keys[layer], old_keys), (self.values[layer], old_values)):
                for row, seq in enumerate(self.rows):
                    source = old[layer][row, :, old_width - seq.length : old_width]
                    start = width - seq.length
                    new[row, :, start:width] = source.clone() if in_place else source  # clone: overlap
        for seq in self.rows:
            seq.zero_from = width - seq.length  # padding is zeroed lazily, as far as attention reads it
        self.relayouts += 1

    def uses(self, lora: str) -> list[str]:
        """The sequences decoding with LoRA adapter ``lora``."""
        return [s.seq_id for s in self.rows if s.lora == lora]

    def add(self, seq_id: str, kv: Tensor | KvSource, last_token: int, sampling: Sampling,
            lora: str | None = None) -> None:
        if any(s.seq_id == seq_id for s in self.rows):
            raise ValueError(f"sequence {seq_id!r} is already active")
        length = int(kv.shape[3]) if isinstance(kv, Tensor) else kv.num_tokens
        row_cap, col_cap = self._capacity()
        width = max(self.width, length)
        if width != self.width or len(self.rows) + 1 > row_cap or width + 1 > col_cap:
            self._relayout(width, len(self.rows) + 1, width + 1)
        row, start = len(self.rows), self.width - length
        for layer in range(self.info.num_layers):
            k_out, v_out = self.keys[layer][row, :, start : self.width], self.values[layer][row, :, start : self.width]
            if isinstance(kv, Tensor):
                k_out.copy_(kv[layer, 0])  # copy_ converts dtype when they differ
                v_out.copy_(kv[layer, 1])
            else:
                kv.copy_layer(layer, k_out, v_out)
        self.rows.append(_Seq(seq_id, length, int(last_token), sampling, zero_from=start, lora=lora))

    def remove(self, seq_id: str, keep_kv: bool = True) -> Tensor | None:
        try:
            row = self._row(seq_id)
        except KeyError:
            return None
        seq, last = self.rows[row], len(self.rows) - 1
        out = None
        if keep_kv:
            with torch.inference_mode(False):  # an ordinary tensor: callers may keep and modify it freely
                out = self._empty(self.info.kv_shape(seq.length))
        start = self.width - seq.length
        moved = self.rows[last]
        moved_start = self.width - moved.length
        for layer in range(self.info.num_layers):
            for buf, part in ((self.keys[layer], 0), (self.values[layer], 1)):
                if out is not None:
                    out[layer, part] = buf[row, :, start : self.width]
                if row != last:  # keep rows dense: the last row's data moves into the hole
                    buf[row, :, moved_start : self.width] = buf[last, :, moved_start : self.width]
        moved.zero_from = moved_start
        self.rows[row] = moved
        self.rows.pop()
        longest = max((s.length for s in self.rows), default=0)
        if not self.rows:
            self.width = 0  # keep the buffers: the next join reuses them
        elif longest * 2 < self.width:
            # mostly padding now: attention would keep paying for it every step
            self._relayout(longest, len(self.rows), longest + 1)
        return out

    def prepare(self) -> StepInputs | None:
        """Inputs for one decode step; None when the batch is empty."""
        if not self.rows:
            return None
        if self.width + 1 > self._capacity()[1]:
            self._relayout(self.width, len(self.rows), self.width + 1)
        b = len(self.rows)
        lengths = torch.tensor([s.length for s in self.rows], dtype=torch.long)
        mask = None
        groups = None
        if any(s.length != self.width for s in self.rows):
            # a row's first real column is width - length; the new column (index width) is always real
            columns = torch.arange(self.width + 1)
            mask = (columns.unsqueeze(0) >= (self.width - lengths).unsqueeze(1)).to(self.device)
            groups = self._groups()
        return StepInputs(
            input_ids=torch.tensor([[s.last_token] for s in self.rows], device=self.device),
            position_ids=lengths.unsqueeze(1).to(self.device),
            attention_mask=mask,
            cache=BatchCache([k[:b] for k in self.keys], [v[:b] for v in self.values], self.width),
            seq_ids=self.seq_ids,
            samplings=[s.sampling for s in self.rows],
            sample_positions=[s.length + 1 for s in self.rows],
            groups=groups,
            loras=[s.lora for s in self.rows] if any(s.lora is not None for s in self.rows) else None,
        )

    def _groups(self) -> list[RowGroup] | None:
        """Rows grouped by length, each group reading only its own columns; zeroes the padding they read."""
        order = sorted(range(len(self.rows)), key=lambda r: self.rows[r].length)
        members: list[list[int]] = []
        for r in order:
            length = self.rows[r].length
            if members and (not self.grouped
                            or length <= GROUP_RATIO * self.rows[members[-1][0]].length + GROUP_SLACK):
                members[-1].append(r)
            else:
                members.append([r])
        groups = []
        for rows in members:
            # ungrouped: every row reads from column 0
            first = self.width - max(self.rows[r].length for r in rows) if self.grouped else 0
            for r in rows:
                self._zero(r, first)
            lo, hi = min(rows), max(rows)
            sel: slice | Tensor = slice(lo, hi + 1) if hi - lo + 1 == len(rows) else \
                torch.tensor(sorted(rows), dtype=torch.long, device=self.device)
            groups.append(RowGroup(sel, first))
        return groups if self.grouped else None

    def _zero(self, row: int, first: int) -> None:
        seq = self.rows[row]
        if seq.zero_from > first:
            for layer in range(self.info.num_layers):
                self.keys[layer][row, :, first : seq.zero_from] = 0
                self.values[layer][row, :, first : seq.zero_from] = 0
            seq.zero_from = first

    def advance(self, new_tokens: dict[str, int]) -> None:
        """Record a finished step: each fed token is now in KV and the sampled one is next to feed."""
        for seq in self.rows:
            seq.length += 1
            seq.last_token = new_tokens[seq.seq_id]
        self.width += 1
