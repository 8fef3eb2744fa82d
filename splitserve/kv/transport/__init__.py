"""KV transports by name: ``make_receiver`` / ``make_sender`` for ``"tcp"`` and ``"nixl"``.

Backends are imported on first use, so a process that only speaks TCP never loads NIXL/UCX.
"""

from __future__ import annotations

import importlib
from typing import Any

from splitserve.kv.pool import BlockPool
from splitserve.kv.transport.base import (
    BadDescriptor,
    KvReceiver,
    KvSender,
    KvTransferError,
    KvTransferTimeout,
    LayoutMismatch,
    PeerUnreachable,
    TransferStats,
)

# name -> (module, receiver class, sender class)
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "tcp": ("splitserve.kv.transport.tcp", "TcpKvReceiver", "TcpKvSender"),
    "nixl": ("splitserve.kv.transport.nixl", "NixlKvReceiver", "NixlKvSender"),
}

TRANSPORTS: tuple[str, ...] = tuple(_BACKENDS)


def _load(name: str, index: int) -> Any:
    try:
        spec = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; choose one of {list(_BACKENDS)}") from None
    return getattr(importlib.import_module(spec[0]), spec[index])


def make_receiver(name: str, pool: BlockPool, **opts: Any) -> KvReceiver:
    """Decoder side. tcp opts: host, port, advertise_host.
    nixl opts: backends, progress_delay_us, agent_name."""
    receiver: KvReceiver = _load(name, 1)(pool, **opts)
    return receiver


def make_sender(name: str, pool: BlockPool, **opts: Any) -> KvSender:
    """Prefill side. tcp opts: connect_timeout, push_timeout. nixl opts: backends, progress_delay_us,
    agent_name, push_timeout."""
    sender: KvSender = _load(name, 2)(pool, **opts)
    return sender


__all__ = [
    "TRANSPORTS",
    "BadDescriptor",
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
