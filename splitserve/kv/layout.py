"""The KV cache layout contract: what one request's KV looks like and how big it is.

A request's KV for T tokens is one tensor ``[num_layers, 2, num_kv_heads, T, head_dim]`` (2 = key, value).
Workers keep it in a paged pool (see :mod:`splitserve.kv.pool`) of ``block_size``-token blocks. Both ends of
a KV transfer must agree on this layout byte for byte; :meth:`KvLayout.fingerprint` is the compact form
they compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

# Only dtypes a KV cache is realistically stored in; the name is what goes on the wire.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; expected one of {sorted(_DTYPES)}")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown KV dtype name {name!r}; expected one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = field(default=torch.float32)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KvLayout.{name} must be a positive int, got {value!r}")
        dtype_name(self.dtype)  # validates

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """All layers, key and value, for one token."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def bytes_per_block_per_layer(self) -> int:
        """One block of one layer: the unit a transport moves (``[2, H, block_size, D]``, contiguous)."""
        return 2 * self.num_kv_heads * self.block_size * self.head_dim * self.element_size

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.bytes_per_block_per_layer

    def blocks_for_tokens(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return math.ceil(num_tokens / self.block_size)

    def kv_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of one request's KV tensor: ``[L, 2, H, T, D]``."""
        return (self.num_layers, 2, self.num_kv_heads, num_tokens, self.head_dim)

    def pool_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        """Shape of a block pool: ``[L, num_blocks, 2, H, block_size, D]``."""
        return (self.num_layers, num_blocks, 2, self.num_kv_heads, self.block_size, self.head_dim)

    def fingerprint(self) -> str:
        """Compact, human-readable identity of the layout; equal strings mean byte-compatible pools."""
        return (
            f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}"
            f"-B{self.block_size}-{dtype_name(self.dtype)}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "dtype": dtype_name(self.dtype),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KvLayout:
        return cls(
            num_layers=int(data["num_layers"]),
            num_kv_heads=int(data["num_kv_heads"]),
            head_dim=int(data["head_dim"]),
            block_size=int(data.get("block_size", 16)),
            dtype=dtype_from_name(str(data.get("dtype", "float32"))),
        )


# The bundled model (SmolLM2-135M-Instruct): 30 layers, 3 KV heads, head_dim 64; fp32 = 46,080 B/token.
SMOLLM2_135M = KvLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
