"""TCP KV transport: plain asyncio sockets and a small framed protocol, bytes straight into pool memory.

The receiver listens on its own thread and event loop, so KV lands even while the decoder's loop is busy.
Per push the sender sends one frame on a pooled connection and waits for the receiver's acknowledgement:

    header (``_HEADER``) | layout fingerprint | transfer id | uint32 target block ids | payload
    payload = for each layer in the range, for each block in order: ``bytes_per_block_per_layer`` bytes

Both ends read/write the payload through memoryviews of the pool tensors: no intermediate buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.kv.pool import BlockPool
from splitserve.kv.transport.base import (
    BadDescriptor,
    CompletionBoard,
    KvReceiver,
    KvSender,
    KvTransferError,
    KvTransferTimeout,
    LayoutMismatch,
    PeerUnreachable,
    TargetDescriptor,
    TransferStats,
    block_runs,
)

log = logging.getLogger(__name__)

_MAGIC = b"SSKT"
_VERSION = 1
_FINAL = 0x01
# magic, version, flags, fingerprint len, transfer id len, n blocks, layer start/stop/step, total pushes,
# payload bytes
_HEADER = struct.Struct("<4sBBBHIHHHIQ")
# status, message length; then the UTF-8 message
_ACK = struct.Struct("<BI")
_OK, _ERR_PROTOCOL, _ERR_LAYOUT, _ERR_BLOCKS = 0, 1, 2, 3
_MAX_IDLE_PER_PEER = 8  # pooled connections kept per receiver; more only while pushes overlap


class _Eof(ConnectionError):
    pass


class _BadFrame(Exception):
    pass


@dataclass(frozen=True)
class _Frame:
    final: bool
    total: int
    fingerprint: str
    transfer_id: str
    block_ids: list[int]
    layers: range
    payload: int


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    while view:
        n = await loop.sock_recv_into(sock, view)
        if n == 0:
            raise _Eof("peer closed the connection")
        view = view[n:]


async def _discard(loop: asyncio.AbstractEventLoop, sock: socket.socket, nbytes: int) -> None:
    scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
    while nbytes > 0:
        n = await loop.sock_recv_into(sock, scratch[: min(nbytes, len(scratch))])
        if n == 0:
            raise _Eof("peer closed the connection")
        nbytes -= n


class TcpKvReceiver(KvReceiver):
    transport = "tcp"

    def __init__(
        self,
        pool: BlockPool,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
    ) -> None:
        super().__init__(pool)
        self._listener = socket.create_server((host, port), backlog=128)
        self._listener.setblocking(False)
        bound = self._listener.getsockname()[0]
        # A wildcard bind is reachable by name, not by "0.0.0.0".
        self.host: str = advertise_host or (socket.gethostname() if bound in ("0.0.0.0", "::") else bound)
        self.port: int = self._listener.getsockname()[1]
        self._board = CompletionBoard()
        self._view = pool.byte_view()
        self._fingerprint = pool.layout.fingerprint()
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kv-tcp-recv:{self.port}", daemon=True)
        self._thread.start()

    def descriptor(self, block_ids: Sequence[int]) -> bytes:
        self._check_target_blocks(block_ids)
        return TargetDescriptor(
            "tcp", self._fingerprint, tuple(block_ids), {"host": self.host, "port": self.port}
        ).encode()

    async def wait(self, transfer_id: str, timeout: float) -> None:  # noqa: ASYNC109
        await self._board.wait(transfer_id, timeout, what=f"KV transfer (tcp {self.host}:{self.port})")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def stop() -> None:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._listener.close()
        if not self._thread.is_alive():
            self._loop.close()

    # ---------------------------------------------------------------------------------- receiver thread

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._spawn(self._accept_loop())
        self._loop.run_forever()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = await self._loop.sock_accept(self._listener)
            except OSError as e:  # e.g. out of file descriptors: keep serving the connections we have
                log.warning("KV TCP receiver %s:%s: accept failed: %s", self.host, self.port, e)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._spawn(self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
        try:
            while (frame := await self._read_frame(conn)) is not None:
                misfit = self._misfit(frame)
                if misfit is not None:
                    # Reject, then read past the payload: the stream stays in frame and the sender, still
                    # sending, gets this answer rather than a reset connection.
                    await self._reply(conn, *misfit)
                    await _discard(self._loop, conn, frame.payload)
                    continue
                await self._land(conn, frame)
                self._board.landed(frame.transfer_id, frame.final, frame.total)
                await self._reply(conn, _OK, "")
        except _BadFrame as e:
            await self._reply(conn, _ERR_PROTOCOL, str(e))
        except (ConnectionError, OSError) as e:
            log.debug("KV TCP receiver: connection dropped: %s", e)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("KV TCP receiver: connection failed")
        finally:
            conn.close()

    async def _read_frame(self, conn: socket.socket) -> _Frame | None:
        head = bytearray(_HEADER.size)
        try:
            await _recv_exact(self._loop, conn, memoryview(head))
        except ConnectionError:
            return None  # the sender closed its pooled connection between frames
        magic, version, flags, fp_len, tid_len, nblocks, l0, l1, lstep, total, plen = _HEADER.unpack(head)
        if magic != _MAGIC or version != _VERSION:
            raise _BadFrame(f"not a splitserve KV frame (this receiver speaks v{_VERSION})")
        if nblocks > self.pool.num_blocks:  # refuse before allocating for a block list that cannot fit
            raise _BadFrame(f"frame names {nblocks} blocks, the receiver pool has {self.pool.num_blocks}")
        meta = bytearray(fp_len + tid_len + 4 * nblocks)
        await _recv_exact(self._loop, conn, memoryview(meta))
        return _Frame(
            final=bool(flags & _FINAL),
            total=total,
            fingerprint=meta[:fp_len].decode(errors="replace"),
            transfer_id=meta[fp_len : fp_len + tid_len].decode(errors="replace"),
            block_ids=np.frombuffer(bytes(meta[fp_len + tid_len :]), dtype="<u4").tolist(),
            layers=range(l0, l1, max(lstep, 1)),
            payload=plen,
        )

    def _misfit(self, frame: _Frame) -> tuple[int, str] | None:
        lay = self.pool.layout
        if frame.fingerprint != self._fingerprint:
            return _ERR_LAYOUT, f"receiver layout {self._fingerprint}, sender layout {frame.fingerprint}"
        bad = [b for b in frame.block_ids if b >= self.pool.num_blocks]
        expected = len(frame.layers) * len(frame.block_ids) * lay.bytes_per_block_per_layer
        if bad or not frame.layers or frame.layers[-1] >= lay.num_layers or frame.payload != expected:
            return _ERR_BLOCKS, (
                f"frame does not fit the receiver pool ({self.pool.num_blocks} blocks, {lay.num_layers} "
                f"layers): blocks out of range {bad[:8]}, layers {frame.layers}, payload {frame.payload} B "
                f"(expected {expected} B)"
            )
        return None

    async def _land(self, conn: socket.socket, frame: _Frame) -> None:
        """Receive the payload straight into the target blocks, one region per layer and contiguous run."""
        size_per_block = self.pool.layout.bytes_per_block_per_layer
        runs = block_runs(frame.block_ids, frame.block_ids)
        got = 0
        try:
            for layer in frame.layers:
                for d0, _, n in runs:
                    off = self.pool.offset(layer, d0)
                    await _recv_exact(self._loop, conn, self._view[off : off + n * size_per_block])
                    got += n * size_per_block
        except (ConnectionError, OSError):
            self._board.failed(
                frame.transfer_id, f"sender disconnected mid-push after {got} of {frame.payload} bytes"
            )
            raise

    async def _reply(self, conn: socket.socket, status: int, message: str) -> None:
        data = message.encode()
        with contextlib.suppress(OSError):
            await self._loop.sock_sendall(conn, _ACK.pack(status, len(data)) + data)


class TcpKvSender(KvSender):
    transport = "tcp"

    def __init__(
        self, pool: BlockPool, *, connect_timeout: float = 5.0, push_timeout: float = 60.0
    ) -> None:
        super().__init__(pool)
        self.connect_timeout = connect_timeout
        self.push_timeout = push_timeout
        self._view = pool.byte_view()
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}

    async def push(
        self,
        transfer_id: str,
        src_block_ids: Sequence[int],
        target_descriptor: bytes,
        *,
        layers: range | None = None,
        notify: bool = True,
    ) -> TransferStats:
        target, layers, _ = self._prepare(transfer_id, src_block_ids, target_descriptor, layers)
        host = target.require("host", str)
        port = target.require("port", int)
        total = self._begin(transfer_id)
        ok = False
        t0 = time.perf_counter()
        try:
            nbytes = await asyncio.wait_for(
                self._push(transfer_id, host, port, src_block_ids, target, layers, notify, total),
                self.push_timeout,
            )
            ok = True
        except TimeoutError:
            raise KvTransferTimeout(
                f"KV push {transfer_id!r} to tcp {host}:{port} not acknowledged after {self.push_timeout:g}s"
            ) from None
        finally:
            self._end(transfer_id, notify, ok)
        return TransferStats(nbytes, time.perf_counter() - t0, "tcp")

    async def _push(
        self,
        transfer_id: str,
        host: str,
        port: int,
        src: Sequence[int],
        target: TargetDescriptor,
        layers: range,
        notify: bool,
        total: int,
    ) -> int:
        loop = asyncio.get_running_loop()
        lay = self.pool.layout
        fingerprint = lay.fingerprint().encode()
        tid = transfer_id.encode()
        payload = len(layers) * len(src) * lay.bytes_per_block_per_layer
        head = _HEADER.pack(
            _MAGIC, _VERSION, _FINAL if notify else 0, len(fingerprint), len(tid), len(target.block_ids),
            layers.start, layers.stop, layers.step, total, payload,
        )
        ids = np.asarray(target.block_ids, dtype="<u4").tobytes()
        sock = await self._checkout(host, port, transfer_id)
        try:
            await loop.sock_sendall(sock, head + fingerprint + tid + ids)
            for layer in layers:
                for s0, _, n in block_runs(src, src):
                    off = self.pool.offset(layer, s0)
                    await loop.sock_sendall(sock, self._view[off : off + n * lay.bytes_per_block_per_layer])
            ack = bytearray(_ACK.size)
            await _recv_exact(loop, sock, memoryview(ack))
            status, mlen = _ACK.unpack(ack)
            msg = bytearray(mlen)
            await _recv_exact(loop, sock, memoryview(msg))
        except (ConnectionError, OSError) as e:
            sock.close()
            raise PeerUnreachable(
                f"KV receiver tcp {host}:{port} went away during push {transfer_id!r}: {e}"
            ) from None
        except BaseException:
            sock.close()  # cancelled or timed out mid-frame: the stream is no longer in sync
            raise
        if status != _OK:
            sock.close()
            text = f"KV push {transfer_id!r} rejected by tcp {host}:{port}: {msg.decode(errors='replace')}"
            raise {_ERR_LAYOUT: LayoutMismatch, _ERR_BLOCKS: BadDescriptor}.get(status, KvTransferError)(text)
        idle = self._idle.setdefault((host, port), [])
        if len(idle) < _MAX_IDLE_PER_PEER:
            idle.append(sock)
        else:
            sock.close()
        return payload

    async def _checkout(self, host: str, port: int, transfer_id: str) -> socket.socket:
        idle = self._idle.get((host, port), [])
        while idle:
            sock = idle.pop()
            if _alive(sock):
                return sock
            sock.close()
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, proto, _, addr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM, proto)
        except OSError as e:
            raise PeerUnreachable(
                f"KV receiver tcp {host}:{port} unresolvable for transfer {transfer_id!r}: {e}"
            ) from None
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, addr), self.connect_timeout)
        except (OSError, TimeoutError) as e:
            sock.close()
            reason = "connect timed out" if isinstance(e, TimeoutError) else str(e)
            raise PeerUnreachable(
                f"KV receiver tcp {host}:{port} unreachable for transfer {transfer_id!r}: {reason}"
            ) from None
        return sock

    def close(self) -> None:
        for socks in self._idle.values():
            for sock in socks:
                sock.close()
        self._idle.clear()


def _alive(sock: socket.socket) -> bool:
    """An idle pooled connection is usable if reading it would block (no EOF, no error, no stray bytes)."""
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False
