"""A KV receiver in its own OS process, driven over a pipe: the far end for benchmarks and tests.

The child owns a real :class:`BlockPool` and a real receiver (``make_receiver``); the parent allocates
blocks, fetches descriptors, waits for transfers and reads blocks back through small synchronous calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from splitserve.kv.layout import KvLayout
from splitserve.kv.pool import BlockPool


class PeerError(RuntimeError):
    """A command failed inside the receiver process (message: ``"ErrorType: text"``)."""


class ReceiverProcess:
    def __init__(
        self,
        transport: str,
        layout: KvLayout,
        num_blocks: int,
        *,
        start_timeout: float = 120.0,
        **opts: Any,
    ) -> None:
        self.transport = transport
        self.layout = layout
        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited NIXL/UCX or event-loop state
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, transport, layout.to_dict(), num_blocks, opts), daemon=True,
            name=f"kv-{transport}-receiver",
        )
        self.process.start()
        child.close()
        ready: dict[str, Any] = self._reply(start_timeout)
        self.pid: int = ready["pid"]
        self.setup_seconds: float = ready["setup_s"]  # pool + receiver (for NIXL: agent) creation

    def _reply(self, timeout: float | None) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"KV receiver process {self.process.pid} did not answer in {timeout}s")
        ok, value = self._conn.recv()
        if not ok:
            raise PeerError(value)
        return value

    def call(self, cmd: str, *args: Any, timeout: float | None = 120.0) -> Any:
        self._conn.send((cmd, args))
        return self._reply(timeout)

    def allocate(self, n: int) -> list[int]:
        ids: list[int] = self.call("allocate", n)
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        self.call("free", list(block_ids))

    def descriptor(self, block_ids: Sequence[int]) -> bytes:
        blob: bytes = self.call("descriptor", list(block_ids))
        return blob

    def wait(self, transfer_ids: Sequence[str], timeout: float) -> dict[str, str | None]:
        """Wait for all transfers concurrently; per id None (complete) or ``"ErrorType: message"``."""
        result: dict[str, str | None] = self.call("wait", list(transfer_ids), timeout, timeout=timeout + 60)
        return result

    def gather(self, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
        raw: bytes = self.call("gather", list(block_ids), num_tokens)
        flat = torch.frombuffer(bytearray(raw), dtype=self.layout.dtype)
        return flat.reshape(self.layout.kv_shape(num_tokens))

    def digest(self, block_ids: Sequence[int], layers: range | None = None) -> str:
        """sha256 of the raw bytes of these blocks (all layers, or ``num_layers``), in block order."""
        digest: str = self.call("digest", list(block_ids), layers)
        return digest

    def fill(self, value: float) -> None:
        self.call("fill", value)

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(PeerError, TimeoutError, OSError, EOFError):
                self.call("close", timeout=10)
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()

    def kill(self) -> None:
        """Die without any cleanup, like a crashed decoder."""
        self.process.kill()
        self.process.join(10)

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pool_digest(pool: BlockPool, block_ids: Sequence[int], layers: range | None = None) -> str:
    """sha256 of blocks' raw bytes, layer-major then block order, for comparing pools across processes."""
    h = hashlib.sha256()
    view = pool.byte_view()
    size = pool.layout.bytes_per_block_per_layer
    for layer in layers if layers is not None else range(pool.layout.num_layers):
        for b in block_ids:
            off = pool.offset(layer, b)
            h.update(view[off : off + size])
    return h.hexdigest()


def _serve(
    conn: Connection, transport: str, layout: dict[str, Any], num_blocks: int, opts: dict[str, Any]
) -> None:
    from splitserve.kv.transport import make_receiver

    t0 = time.perf_counter()
    pool = BlockPool(KvLayout.from_dict(layout), num_blocks)
    receiver = make_receiver(transport, pool, **opts)
    conn.send((True, {"pid": os.getpid(), "setup_s": time.perf_counter() - t0}))
    loop = asyncio.new_event_loop()

    async def wait_one(tid: str, seconds: float) -> str | None:
        try:
            await receiver.wait(tid, seconds)
            return None
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    async def wait_all(tids: list[str], seconds: float) -> dict[str, str | None]:
        results = await asyncio.gather(*(wait_one(t, seconds) for t in tids))
        return dict(zip(tids, results, strict=True))

    try:
        while True:
            try:
                cmd, args = conn.recv()
            except (EOFError, OSError):
                break  # the parent went away
            try:
                if cmd == "close":
                    conn.send((True, None))
                    break
                if cmd == "allocate":
                    result: Any = pool.allocate(*args)
                elif cmd == "free":
                    pool.free(*args)
                    result = None
                elif cmd == "descriptor":
                    result = receiver.descriptor(*args)
                elif cmd == "wait":
                    result = loop.run_until_complete(wait_all(*args))
                elif cmd == "gather":
                    result = pool.gather(*args).view(torch.uint8).numpy().tobytes()
                elif cmd == "digest":
                    result = pool_digest(pool, *args)
                elif cmd == "fill":
                    pool.tensor.fill_(*args)
                    result = None
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                conn.send((True, result))
            except Exception as e:
                conn.send((False, f"{type(e).__name__}: {e}"))
    finally:
        receiver.close()
        loop.run_until_complete(_cancel_pending())  # e.g. a NIXL notification poller between waits
        loop.close()


async def _cancel_pending() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
