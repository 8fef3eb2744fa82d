"""KV transports by name: ``make_receiver`` / ``make_sender`` for ``"tcp"`` and ``"nixl"``.

Backends are imported on first use, so a process that only speaks TCP never loads NIXL/UCX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from splitserve.kv.pool import BlockPool


def _load(name: str, index: int) -> Any:
    try:
        spec = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; choose one of {list(_BACKENDS)}") from None
    return getattr(importlib.import_module(spec[0]), spec[index])


def nixl_missing() -> str | None:
    """None when NIXL imports here, else why not (``nixl-cu12`` is the ``nixl`` extra, not a requirement)."""
    import importlib.util

    if importlib.util.find_spec("nixl_cu12") is None:
        return "the nixl-cu12 package is not installed (pip install 'splitserve[nixl]')"
    try:
        importlib.import_module("nixl_cu12")
    except Exception as exc:  # a broken build raises more than ImportError
        return f"nixl_cu12 does not import: {type(exc).__name__}: {exc}"
    return None


def usable_transport(name: str) -> tuple[str, str | None]:
    """The transport to use for ``name``: "nixl" falls back to "tcp" when NIXL cannot load here; the second
    value says why (for a log line), None when nothing changed."""
    if name == "nixl":
        why = nixl_missing()
        if why is not None:
            return "tcp", f"NIXL unavailable ({why}): using --transport tcp"
    return name, None


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
    "nixl_missing",
    "usable_transport",
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
