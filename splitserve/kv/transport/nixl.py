"""NIXL KV transport: one-sided UCX WRITEs from the prefiller's staging pool into the decoder's pool.

Owns the process's single NIXL agent (:func:`process_agent`): created once, every pool registered once,
remote agents loaded once per peer and cached by name. The descriptor carries the receiver's agent name,
its agent metadata (~0.5 KB), the pool's base address and block count, so the sender computes the remote
regions itself: no pickled NIXL descriptor lists cross the wire, and the blob stays about 0.5 KB + 4 B per
block. Each push sends a NIXL notification naming the transfer; the receiver counts them
(:class:`CompletionBoard`).

Settings applied, measured on a 2-core CPU box (see the package report):

* The UCX progress thread is kept but given a poll timeout. nixl-cu12 1.5.1's Python wrapper hardcodes
  ``pthrDelay = 0``, which the UCX engine turns into ``poll(fds, 0)``: an idle agent spins one core at
  ~99 %. :func:`_create_agent` sets ``progress_delay_us`` (default 10 ms): the thread then sleeps until
  UCX's event fd fires (data and notifications still wake it at once), idle CPU 0 %.
* Disabling the progress thread instead (``enable_prog_thread=False``) hung ``check_xfer_state`` here.
* ``NIXL_THREAD_SYNC_RW``: pushes run in worker threads; RW lets them post and poll transfers
  concurrently (shared lock) while metadata changes stay exclusive.
* One notification poller per event loop serves all waiters (0.1 ms to 1 ms backoff, only while someone
  waits). It calls ``getNotifs`` on the loop (microseconds) unless this process also sends: that call
  takes the agent's exclusive lock and could wait behind a push's copy, so then it runs in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import msgpack
import nixl_cu12._bindings as _bindings
import numpy as np
from nixl_cu12 import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from splitserve.kv.pool import BlockPool
from splitserve.kv.transport.base import (
    BadDescriptor,
    CompletionBoard,
    KvReceiver,
    KvSender,
    KvTransferError,
    KvTransferTimeout,
    PeerUnreachable,
    TargetDescriptor,
    TransferStats,
)
from splitserve.obs.log import adopt_loggers

adopt_loggers("nixl")  # NIXL installs its own plain-text handler on import: its lines go out as JSON instead

log = logging.getLogger(__name__)

DEFAULT_PROGRESS_DELAY_US = 10_000
# Notification polling backoff while someone waits: the cap bounds how late a completion is seen.
_POLL_MIN_S = 0.0001
_POLL_MAX_S = 0.001
_NOTIF_TAG = "sskv"


def _create_agent(name: str, backends: Sequence[str], progress_delay_us: int) -> Any:
    """Create a NIXL agent whose UCX progress thread sleeps between events instead of spinning.

    ``nixl_agent.__init__`` builds a ``nixlAgentConfig`` and writes ``pthrDelay = 0`` with no way to
    override it. For the few hundred ms of construction we swap in a subclass whose ``pthrDelay`` setter
    keeps our value; nothing else in the process creates agents concurrently (guarded by a lock).
    ``progress_delay_us <= 0`` gives the stock (busy-polling) agent.
    """
    cfg = nixl_agent_config(
        enable_prog_thread=True,
        backends=list(backends),
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
    )
    base: Any = getattr(_bindings, "nixlAgentConfig", None)
    if progress_delay_us <= 0 or base is None or not hasattr(base, "pthrDelay"):
        return nixl_agent(name, cfg)

    try:

        class _DelayedConfig(base):  # type: ignore[misc]
            @property
            def pthrDelay(self) -> int:  # noqa: N802 - the binding's attribute name
                return int(base.pthrDelay.__get__(self))

            @pthrDelay.setter
            def pthrDelay(self, value: int) -> None:  # noqa: N802
                base.pthrDelay.__set__(self, max(int(value), progress_delay_us))

    except TypeError:  # a future binding that forbids subclassing: stock agent, and say so
        log.warning("cannot set the NIXL progress-thread delay; the idle agent will busy-poll a core")
        return nixl_agent(name, cfg)

    with _PATCH_LOCK:
        _bindings.nixlAgentConfig = _DelayedConfig
        try:
            return nixl_agent(name, cfg)
        finally:
            _bindings.nixlAgentConfig = base


_PATCH_LOCK = threading.Lock()
_AGENT_LOCK = threading.Lock()
_AGENT: ProcessAgent | None = None


class ProcessAgent:
    """The NIXL agent of this process, shared by all its NIXL senders and receivers."""

    def __init__(self, name: str, backends: Sequence[str], progress_delay_us: int) -> None:
        t0 = time.perf_counter()
        self.agent = _create_agent(name, backends, progress_delay_us)
        self.setup_seconds = time.perf_counter() - t0
        self.name = name
        self.backends = tuple(backends)
        self.progress_delay_us = progress_delay_us
        self.board = CompletionBoard()
        self._lock = threading.Lock()  # registrations and remote-agent cache
        self._registered: dict[int, tuple[Any, int]] = {}  # data_ptr -> (reg descs, refcount)
        self._remotes: dict[str, bytes] = {}  # remote agent name -> metadata it was loaded from
        self._metadata: bytes | None = None
        self.senders = 0  # live NixlKvSenders in this process
        self._pollers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[None]] = (
            weakref.WeakKeyDictionary()
        )

# ---------------------------------------------------------------------------------------- memory

    def register(self, pool: BlockPool) -> None:
        with self._lock:
            reg, refs = self._registered.get(pool.data_ptr, (None, 0))
            if reg is None:
                reg = self.agent.register_memory(pool.tensor)
                self._metadata = None  # the metadata lists registered memory: peers must reload it
            self._registered[pool.data_ptr] = (reg, refs + 1)

    def deregister(self, pool: BlockPool) -> None:
        with self._lock:
            reg, refs = self._registered.get(pool.data_ptr, (None, 0))
            if reg is None:
                return
            if refs > 1:
                self._registered[pool.data_ptr] = (reg, refs - 1)
                return
            del self._registered[pool.data_ptr]
            self._metadata = None
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(reg)

    def metadata(self) -> bytes:
        with self._lock:
            if self._metadata is None:
                self._metadata = bytes(self.agent.get_agent_metadata())
            return self._metadata

    # --------------------------------------------------------------------------------------- receiving

    def poll_notifs(self) -> int:
        """Move newly arrived notifications onto the completion board; returns how many arrived."""
        count = 0
        for msgs in self.agent.get_new_notifs().values():
            for raw in msgs:
                count += 1
                try:
                    tag, transfer_id, final, total = msgpack.unpackb(raw)
                except Exception:
                    continue  # not ours
                if tag == _NOTIF_TAG:
                    self.board.landed(str(transfer_id), bool(final), int(total))
        return count

    def ensure_poller(self) -> None:
        """Run one notification poller on the calling event loop while anybody waits.

        One poller serves every waiter (their futures are resolved by the board), so many concurrent
        waits cost what one does (measured 3-6 % of a core at the 1 ms cap; nothing when nobody waits).
        """
        loop = asyncio.get_running_loop()
        task = self._pollers.get(loop)
        if task is None or task.done():
            self._pollers[loop] = loop.create_task(self._poll_while_waited())

    async def _poll_while_waited(self) -> None:
        interval = _POLL_MIN_S
        while self.board.has_waiters():
            if self.senders:
                # getNotifs takes the agent's exclusive lock, which waits for any push copying right now
                # (tens of ms for a long prompt): keep that off the event loop.
                arrived = await asyncio.to_thread(self.poll_notifs)
            else:
                arrived = self.poll_notifs()  # microseconds; a thread hop would cost more than the call
            interval = _POLL_MIN_S if arrived else min(interval * 2, _POLL_MAX_S)
            await asyncio.sleep(interval)

    # ----------------------------------------------------------------------------------------- sending

    def _ensure_remote(self, remote: str, metadata: bytes) -> None:
        if remote == self.name:
            return  # loopback: NIXL writes to its own registered memory without loading metadata
        with self._lock:
            if self._remotes.get(remote) == metadata:
                return
            if remote in self._remotes:  # the peer registered more memory since: reload it
                with contextlib.suppress(Exception):
                    self.agent.remove_remote_agent(remote)
                del self._remotes[remote]
            t0 = time.perf_counter()
            try:
                loaded = self.agent.add_remote_agent(metadata)  # UCX connects to the peer here
            except _bindings.nixlBackendError as e:
                raise PeerUnreachable(f"cannot connect to NIXL agent {remote!r} (exited?): {e}") from None
            except Exception as e:
                raise BadDescriptor(f"unusable NIXL agent metadata for {remote!r}: {e}") from None
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != remote:
                with contextlib.suppress(Exception):
                    self.agent.remove_remote_agent(loaded)
                raise BadDescriptor(
                    f"NIXL descriptor names agent {remote!r} but carries the metadata of {loaded!r}"
                )
            self._remotes[remote] = metadata
            ms = (time.perf_counter() - t0) * 1e3
            log.info("NIXL agent %s loaded peer %s in %.1f ms", self.name, remote, ms)

    def _forget_remote(self, remote: str) -> None:
        with self._lock:
            if self._remotes.pop(remote, None) is not None:
                with contextlib.suppress(Exception):
                    self.agent.remove_remote_agent(remote)

    def write(
        self,
        transfer_id: str,
        remote: str,
        metadata: bytes,
        local: np.ndarray,
        target: np.ndarray,
        notif: bytes,
        timeout: float,
    ) -> None:
        """Blocking: WRITE ``local`` regions into ``target`` regions of ``remote``; wait for completion.

        Regions are Nx3 uint64 arrays of (address, length, device id). Runs in a worker thread.
        """
        self._ensure_remote(remote, metadata)
        deadline = time.monotonic() + timeout
        where = f"NIXL agent {remote!r}"
        try:
            handle = self.agent.initialize_xfer(
                "WRITE",
                self.agent.get_xfer_descs(local, "DRAM"),
                self.agent.get_xfer_descs(target, "DRAM"),
                remote,
                notif,
            )
        except (_bindings.nixlRemoteDisconnectError, _bindings.nixlBackendError) as e:
            self._forget_remote(remote)
            raise PeerUnreachable(
                f"transfer {transfer_id!r} to {where} failed: {type(e).__name__}: {e}"
            ) from None
        except Exception as e:
            self._forget_remote(remote)
            raise BadDescriptor(
                f"transfer {transfer_id!r}: {where} rejected the target regions "
                f"({type(e).__name__}: {e}); stale descriptor or receiver pool closed?"
            ) from None
        try:
            state = self.agent.transfer(handle)
            interval = 20e-6
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise KvTransferTimeout(
                        f"transfer {transfer_id!r} to {where} not done after {timeout:g}s"
                    )
                time.sleep(interval)
                interval = min(interval * 2, 1e-3)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise PeerUnreachable(f"transfer {transfer_id!r} to {where} failed (state {state})")
        except KvTransferError:
            self._forget_remote(remote)
            raise
        except Exception as e:  # nixlRemoteDisconnectError and friends
            self._forget_remote(remote)
            raise PeerUnreachable(
                f"transfer {transfer_id!r} to {where} failed: {type(e).__name__}: {e}"
            ) from None
        finally:
            with contextlib.suppress(Exception):
                handle.release()


def process_agent(
    *, backends: Sequence[str] = ("UCX",), progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
    name: str | None = None,
) -> ProcessAgent:
    """This process's NIXL agent, created on first use (the settings of that first call stick)."""
    global _AGENT
    with _AGENT_LOCK:
        if _AGENT is None:
            name = name or f"splitserve-kv-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            _AGENT = ProcessAgent(name, backends, progress_delay_us)
            log.info("NIXL agent %s ready in %.3fs", name, _AGENT.setup_seconds)
        elif (tuple(backends), progress_delay_us) != (_AGENT.backends, _AGENT.progress_delay_us):
            log.warning(
                "NIXL agent %s already exists with backends=%s progress_delay_us=%s; ignoring %s/%s",
                _AGENT.name, _AGENT.backends, _AGENT.progress_delay_us, tuple(backends), progress_delay_us,
            )
        return _AGENT


def _regions(base: int, num_blocks: int, block_bytes: int, layers: range, starts: list[int],
             counts: list[int]) -> np.ndarray:
    """Nx3 (address, length, device 0) array: one region per (layer, run of contiguous blocks)."""
    lay = np.asarray(layers, dtype=np.uint64)[:, None]
    start = np.asarray(starts, dtype=np.uint64)[None, :]
    count = np.asarray(counts, dtype=np.uint64)[None, :]
    addr = np.uint64(base) + (lay * np.uint64(num_blocks) + start) * np.uint64(block_bytes)
    length = np.broadcast_to(count * np.uint64(block_bytes), addr.shape)
    out = np.zeros((addr.size, 3), dtype=np.uint64)
    out[:, 0] = addr.reshape(-1)
    out[:, 1] = length.reshape(-1)
    return out


class NixlKvReceiver(KvReceiver):
    transport = "nixl"

    def __init__(
        self,
        pool: BlockPool,
        *,
        backends: Sequence[str] = ("UCX",),
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
        agent_name: str | None = None,
    ) -> None:
        super().__init__(pool)
        self._agent = process_agent(backends=backends, progress_delay_us=progress_delay_us, name=agent_name)
        self._agent.register(pool)
        self._closed = False

    @property
    def agent(self) -> ProcessAgent:
        return self._agent

    def descriptor(self, block_ids: Sequence[int]) -> bytes:
        self._check_target_blocks(block_ids)
        endpoint = {
            "agent": self._agent.name,
            "md": self._agent.metadata(),
            "base": self.pool.data_ptr,
            "blocks": self.pool.num_blocks,
        }
        return TargetDescriptor("nixl", self.pool.layout.fingerprint(), tuple(block_ids), endpoint).encode()

    async def wait(self, transfer_id: str, timeout: float) -> None:  # noqa: ASYNC109
        self._agent.ensure_poller()
        what = f"KV transfer (nixl {self._agent.name})"
        await self._agent.board.wait(transfer_id, timeout, what=what)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._agent.deregister(self.pool)


class NixlKvSender(KvSender):
    transport = "nixl"

    def __init__(
        self,
        pool: BlockPool,
        *,
        backends: Sequence[str] = ("UCX",),
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
        agent_name: str | None = None,
        push_timeout: float = 60.0,
    ) -> None:
        super().__init__(pool)
        self.push_timeout = push_timeout
        self._agent = process_agent(backends=backends, progress_delay_us=progress_delay_us, name=agent_name)
        self._agent.register(pool)
        self._agent.senders += 1
        self._closed = False

    @property
    def agent(self) -> ProcessAgent:
        return self._agent

    async def push(
        self,
        transfer_id: str,
        src_block_ids: Sequence[int],
        target_descriptor: bytes,
        *,
        layers: range | None = None,
        notify: bool = True,
    ) -> TransferStats:
        target, layers, runs = self._prepare(transfer_id, src_block_ids, target_descriptor, layers)
        remote = target.require("agent", str)
        metadata = target.require("md", bytes)
        base = target.require("base", int)
        num_blocks = target.require("blocks", int)
        if max(target.block_ids) >= num_blocks:
            raise BadDescriptor(f"NIXL descriptor names blocks beyond its pool of {num_blocks}")
        block_bytes = self.pool.layout.bytes_per_block_per_layer
        src_starts, dst_starts, counts = ([r[i] for r in runs] for i in range(3))
        local = _regions(self.pool.data_ptr, self.pool.num_blocks, block_bytes, layers, src_starts, counts)
        remote_regions = _regions(base, num_blocks, block_bytes, layers, dst_starts, counts)
        total = self._begin(transfer_id)
        notif: bytes = msgpack.packb([_NOTIF_TAG, transfer_id, notify, total])
        ok = False
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(
                self._agent.write,
                transfer_id, remote, metadata, local, remote_regions, notif, self.push_timeout,
            )
            ok = True
        finally:
            self._end(transfer_id, notify, ok)
        nbytes = len(layers) * len(src_block_ids) * block_bytes
        return TransferStats(nbytes, time.perf_counter() - t0, "nixl")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._agent.senders -= 1
            self._agent.deregister(self.pool)
