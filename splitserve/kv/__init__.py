"""KV cache movement between prefill and decode workers: the layout contract, the paged block pool and
the transports (TCP, NIXL) that write one worker's blocks into another's. KV bytes never travel over NATS;
only the receiver's compact descriptor does.

Decoder::

    receiver = make_receiver("nixl", BlockPool(SMOLLM2_135M, num_blocks=4096))   # once per process
    dst = receiver.pool.allocate(SMOLLM2_135M.blocks_for_tokens(n_tokens))
    reply.descriptor = receiver.descriptor(dst)                                   # goes over NATS
    await receiver.wait(transfer_id, timeout=30)                                  # KV is in dst now
    kv = receiver.pool.gather(dst, n_tokens)                                      # [L, 2, H, T, D]

Prefiller::

    sender = make_sender("nixl", BlockPool(SMOLLM2_135M, num_blocks=1024))        # once per process
    src = sender.pool.allocate(SMOLLM2_135M.blocks_for_tokens(n_tokens))
    sender.pool.scatter(kv, src)                                                  # or compute into it
    for layer in range(L):                                                        # as layers finish
        await sender.push(transfer_id, src, descriptor, layers=range(layer, layer + 1), notify=layer == L - 1)
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.kv.layout import SMOLLM2_135M, KvLayout
    from splitserve.kv.pool import BlockPool, BlockPoolExhausted
    from splitserve.kv.transport import (
        TRANSPORTS,
        BadDescriptor,
        KvReceiver,
        KvSender,
        KvTransferError,
        KvTransferTimeout,
        LayoutMismatch,
        PeerUnreachable,
        TransferStats,
        make_receiver,
        make_sender,
    )

# Loaded on first use (PEP 562): the layout and the pool import torch (~1.2 CPU-s), which a process that only asks
# which transport is usable (``splitserve up``, the supervisor) never needs.
_HOMES = {"SMOLLM2_135M": "layout", "KvLayout": "layout", "BlockPool": "pool", "BlockPoolExhausted": "pool"}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _HOMES:
        return getattr(importlib.import_module(f"splitserve.kv.{_HOMES[name]}"), name)
    if name in __all__:
        return getattr(importlib.import_module("splitserve.kv.transport"), name)
    raise AttributeError(f"module 'splitserve.kv' has no attribute {name!r}")


__all__ = [
    "SMOLLM2_135M",
    "TRANSPORTS",
    "BadDescriptor",
    "BlockPool",
    "BlockPoolExhausted",
    "KvLayout",
    "KvReceiver",
    "KvSender",
    "KvTransferError",
    "KvTransferTimeout",
    "LayoutMismatch",
    "PeerUnreachable",
    "TransferStats",
    "make_receiver",
    "make_sender",
]
