"""Runs all calls into an engine on one dedicated thread, or inline when the engine costs nothing.

Engines are synchronous torch code; running them on a single thread keeps the asyncio loop (heartbeats,
NATS I/O, reservations) responsive while a step or a prefill computes, and serialises engine access.

An engine whose calls return at once (the ``mock`` engine with no step, prefill or load time: the control
plane's load tests and ``bench.peers``) runs inline instead (:attr:`EngineThread.inline`, set from
``Engine.blocking``). Each hand-off to a thread and back costs ~100 µs of CPU (two wake-ups, the GIL passed
twice), more than such a call itself; with nothing to wait for, a zero-cost decoder stepped a few sequences at
a time as fast as hand-offs allowed, and on two cores the hand-offs took CPU from the front door and the router
(``bench.peers`` at c=32, interleaved A/B: 153 -> 196 req/s, CPU per request 13.0 -> 9.9 ms). An inline call
still yields to the loop once after it, where a threaded one would have waited: a decoder's steps let NATS I/O
in between, as with a real engine.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    def __init__(self, name: str, *, inline: bool = False) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        # Set once the engine is loaded (its ``blocking``); loading itself always runs on the thread.
        self.inline = inline

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self.inline:
            # In a context of its own, as on the thread: what an engine call sets never leaks into the caller's
            result = contextvars.copy_context().run(fn, *args, **kwargs)
            await asyncio.sleep(0)
            return result
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
