"""Pure KV-cache bookkeeping: block hashing, KV event structs and the prefix residency index.

No I/O, no asyncio, no engine imports: the cache-index service, the router's in-process replica, the
benchmarks and the simulator all run these very objects.
"""

from splitserve.cache.events import (
    CPU,
    GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    batch,
    cleared,
    event_from_dict,
    removed,
    stored,
)
from splitserve.cache.hashing import (
    DEFAULT_BLOCK_SIZE,
    MOONCAKE_BLOCK_TOKENS,
    BlockHasher,
    hash_token_blocks,
    mooncake_block_hashes,
    num_full_blocks,
    pack_tokens,
    root_hash,
)
from splitserve.cache.index import IndexStats, PrefixIndex, TierOverlap

__all__ = [
    "CPU",
    "DEFAULT_BLOCK_SIZE",
    "GPU",
    "MOONCAKE_BLOCK_TOKENS",
    "AllBlocksCleared",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "IndexStats",
    "KvEvent",
    "KvEventBatch",
    "PrefixIndex",
    "TierOverlap",
    "batch",
    "cleared",
    "event_from_dict",
    "hash_token_blocks",
    "mooncake_block_hashes",
    "num_full_blocks",
    "pack_tokens",
    "removed",
    "root_hash",
    "stored",
]
