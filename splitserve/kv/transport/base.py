"""The KV transport contract shared by every backend: receiver/sender interfaces, typed errors, the
target descriptor envelope and the receiver-side record of which transfers have landed.

Flow: the decoder's :class:`KvReceiver` owns its pool and hands out ``descriptor(block_ids)`` (opaque bytes
that travel over NATS); the prefiller's :class:`KvSender` ``push``es blocks of its own staging pool into
exactly those blocks, possibly one layer range at a time; the push marked ``notify=True`` is the last one,
and the receiver's ``wait(transfer_id)`` returns once it and every earlier push of that transfer landed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar

import msgpack
import numpy as np

if TYPE_CHECKING:  # (the pool imports torch; the base classes only name it)
    from splitserve.kv.pool import BlockPool

# --------------------------------------------------------------------------------------------------- errors


class KvTransferError(RuntimeError):
    """A KV transfer failed; the message says which transfer, which peer and why."""


class PeerUnreachable(KvTransferError):
    """The other side cannot be reached or went away mid-transfer."""


class LayoutMismatch(KvTransferError):
    """Sender and receiver pools do not share one KV layout, so their blocks are not byte-compatible."""


class BadDescriptor(KvTransferError):
    """A target descriptor is malformed, truncated, for another transport, or names unusable blocks."""


class KvTransferTimeout(KvTransferError, TimeoutError):
    """A transfer did not complete in time."""


# ---------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class TransferStats:
    bytes: int
    seconds: float
    transport: str

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


# ------------------------------------------------------------------------------------------- descriptor

_MAGIC = "sskv"
_VERSION = 1


@dataclass(frozen=True)
class TargetDescriptor:
    """Decoded form of the bytes from :meth:`KvReceiver.descriptor`."""

    transport: str
    layout: str  # KvLayout.fingerprint() of the receiver's pool
    block_ids: tuple[int, ...]
    endpoint: dict[str, Any]  # transport-specific: where and how to write

    def encode(self) -> bytes:
        ids = np.asarray(self.block_ids, dtype="<u4").tobytes()
        out: bytes = msgpack.packb([_MAGIC, _VERSION, self.transport, self.layout, ids, self.endpoint])
        return out

    @classmethod
    def decode(cls, blob: bytes, transport: str) -> TargetDescriptor:
        if not isinstance(blob, bytes | bytearray | memoryview):
            raise BadDescriptor(f"descriptor must be bytes, got {type(blob).__name__}")
        try:
            obj = msgpack.unpackb(bytes(blob), raw=False)
        except Exception as e:  # msgpack raises several unrelated types for bad input
            raise BadDescriptor(f"undecodable KV descriptor ({len(blob)} bytes): {e}") from None
        if not (isinstance(obj, list) and len(obj) == 6 and obj[0] == _MAGIC):
            raise BadDescriptor(f"not a splitserve KV descriptor ({len(blob)} bytes)")
        _, version, kind, layout, ids, endpoint = obj
        if version != _VERSION:
            raise BadDescriptor(f"KV descriptor version {version}, this build speaks {_VERSION}")
        if kind != transport:
            raise BadDescriptor(f"KV descriptor is for transport {kind!r}, this sender is {transport!r}")
        if not (isinstance(layout, str) and isinstance(ids, bytes) and isinstance(endpoint, dict)):
            raise BadDescriptor("KV descriptor fields have the wrong types")
        if len(ids) % 4:
            raise BadDescriptor(f"KV descriptor block list is truncated ({len(ids)} bytes)")
        block_ids = tuple(int(b) for b in np.frombuffer(ids, dtype="<u4"))
        return cls(kind, layout, block_ids, endpoint)

    def require(self, key: str, kind: type | tuple[type, ...]) -> Any:
        value = self.endpoint.get(key)
        if not isinstance(value, kind):
            raise BadDescriptor(f"{self.transport} KV descriptor lacks a valid {key!r}")
        return value


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split paired block lists into (src_start, dst_start, count) runs contiguous on both sides, so a
    transport moves one region per run and layer instead of one per block."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


# -------------------------------------------------------------------------------------- completion board


class CompletionBoard:
    """Receiver-side, thread-safe tally of landed pushes per transfer.

    Each push that lands is reported with ``final`` (it was the ``notify=True`` push) and ``total`` (how
    many pushes the sender made for that transfer, known on the final one). A transfer is complete when
    the final push and ``total`` pushes have landed, whatever order they arrived in. Completed and failed
    ids are remembered (bounded) so a ``wait`` that starts late still returns at once.
    """

    _REMEMBER = 65536

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._landed: dict[str, int] = {}
        self._expected: dict[str, int] = {}
        self._finished: OrderedDict[str, str | None] = OrderedDict()  # id -> None (done) or error text
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}

    def landed(self, transfer_id: str, final: bool, total: int) -> None:
        with self._lock:
            if transfer_id in self._finished:
                return
            n = self._landed.get(transfer_id, 0) + 1
            self._landed[transfer_id] = n
            if final:
                self._expected[transfer_id] = total
            expected = self._expected.get(transfer_id)
            if expected is None or n < expected:
                return
            self._finish_locked(transfer_id, None)

    def failed(self, transfer_id: str, reason: str) -> None:
        with self._lock:
            if transfer_id not in self._finished:
                self._finish_locked(transfer_id, reason)

    def _finish_locked(self, transfer_id: str, error: str | None) -> None:
        self._landed.pop(transfer_id, None)
        self._expected.pop(transfer_id, None)
        self._finished[transfer_id] = error
        while len(self._finished) > self._REMEMBER:
            self._finished.popitem(last=False)
        for loop, fut in self._waiters.pop(transfer_id, []):
            with contextlib.suppress(RuntimeError):  # that waiter's loop is already closed
                loop.call_soon_threadsafe(_resolve, fut)

    def _state(self, transfer_id: str) -> tuple[bool, str | None, str]:
        with self._lock:
            if transfer_id in self._finished:
                return True, self._finished[transfer_id], ""
            landed = self._landed.get(transfer_id, 0)
            expected = self._expected.get(transfer_id)
            seen = f"{landed} push(es) landed, " + (
                f"{expected} expected" if expected is not None else "final push not seen"
            )
            return False, None, seen

    def has_waiters(self) -> bool:
        with self._lock:
            return bool(self._waiters)

    async def wait(
        self,
        transfer_id: str,
        timeout: float,  # noqa: ASYNC109 - a deadline is part of the receiver contract
        *,
        what: str = "KV transfer",
    ) -> None:
        """Return when ``transfer_id`` completes; raise on failure or after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._waiters.setdefault(transfer_id, []).append((loop, fut))
        try:
            done, error, seen = self._state(transfer_id)
            if not done:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(fut, timeout)
                done, error, seen = self._state(transfer_id)
            if not done:
                raise KvTransferTimeout(f"{what} {transfer_id!r} not complete after {timeout:g}s ({seen})")
            if error is not None:
                raise KvTransferError(f"{what} {transfer_id!r} failed: {error}")
        finally:
            with self._lock:
                waiters = self._waiters.get(transfer_id, [])
                if (loop, fut) in waiters:
                    waiters.remove((loop, fut))
                    if not waiters:
                        del self._waiters[transfer_id]


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


# --------------------------------------------------------------------------------------------- interfaces


class KvReceiver(ABC):
    """Decoder side: owns (registers) the decoder's pool and learns when transfers into it completed."""

    transport: ClassVar[str]

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    @abstractmethod
    def descriptor(self, block_ids: Sequence[int]) -> bytes:
        """Opaque, compact bytes telling a remote sender how to write into exactly these blocks."""

    @abstractmethod
    async def wait(self, transfer_id: str, timeout: float) -> None:  # noqa: ASYNC109
        """Return when all pushes of ``transfer_id`` landed; raise :class:`KvTransferTimeout` otherwise."""

    @abstractmethod
    def close(self) -> None: ...

    def _check_target_blocks(self, block_ids: Sequence[int]) -> None:
        try:
            self.pool.check_block_ids(block_ids)
        except ValueError as e:
            raise BadDescriptor(str(e)) from None

    def __enter__(self) -> KvReceiver:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class KvSender(ABC):
    """Prefill side: owns a registered staging pool and writes its blocks into a receiver's blocks."""

    transport: ClassVar[str]

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._pushes: dict[str, int] = {}  # pushes started per transfer not yet finalised

    @abstractmethod
    async def push(
        self,
        transfer_id: str,
        src_block_ids: Sequence[int],
        target_descriptor: bytes,
        *,
        layers: range | None = None,
        notify: bool = True,
    ) -> TransferStats:
        """Write ``src_block_ids`` (all layers, or ``layers``) into the descriptor's blocks, same order.

        Returns once the bytes are in the receiver's memory. ``notify=True`` marks the transfer's last push:
        the receiver's ``wait`` then returns once this and all earlier pushes of the transfer landed.
        """

    @abstractmethod
    def close(self) -> None: ...

    def _prepare(
        self, transfer_id: str, src_block_ids: Sequence[int], blob: bytes, layers: range | None
    ) -> tuple[TargetDescriptor, range, list[tuple[int, int, int]]]:
        """Decode and check a push request against this pool; returns (descriptor, layers, block runs)."""
        if not transfer_id or len(transfer_id.encode()) > 1024:
            raise KvTransferError(f"transfer_id must be 1 to 1024 bytes of text, got {transfer_id[:40]!r}...")
        target = TargetDescriptor.decode(blob, self.transport)
        mine = self.pool.layout.fingerprint()
        if target.layout != mine:
            raise LayoutMismatch(
                f"transfer {transfer_id!r}: receiver layout {target.layout}, sender layout {mine}"
            )
        if len(src_block_ids) != len(target.block_ids):
            raise KvTransferError(
                f"transfer {transfer_id!r}: {len(src_block_ids)} source blocks but the target descriptor "
                f"names {len(target.block_ids)}"
            )
        if not src_block_ids:
            raise KvTransferError(f"transfer {transfer_id!r}: no blocks to push")
        try:
            self.pool.check_block_ids(src_block_ids)
        except ValueError as e:
            raise KvTransferError(f"transfer {transfer_id!r}: source {e}") from None
        num_layers = self.pool.layout.num_layers
        if layers is None:
            layers = range(num_layers)
        if not (
            isinstance(layers, range) and len(layers) > 0 and layers.step > 0
            and layers.start >= 0 and layers[-1] < num_layers
        ):
            raise KvTransferError(
                f"transfer {transfer_id!r}: bad layer range {layers!r} for {num_layers} layers"
            )
        return target, layers, block_runs(src_block_ids, target.block_ids)

    def _begin(self, transfer_id: str) -> int:
        """Count a push; returns the transfer's total pushes (meaningful on the final, notifying one)."""
        n = self._pushes.get(transfer_id, 0) + 1
        self._pushes[transfer_id] = n
        return n

    def _end(self, transfer_id: str, notify: bool, ok: bool) -> None:
        if not ok:
            # The push did not land, so it must not be counted towards the total the final push announces.
            n = self._pushes.get(transfer_id, 1) - 1
            if n > 0:
                self._pushes[transfer_id] = n
            else:
                self._pushes.pop(transfer_id, None)
        elif notify:
            self._pushes.pop(transfer_id, None)

    def __enter__(self) -> KvSender:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
