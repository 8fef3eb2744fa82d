"""The engine thread: every call on one thread, in order; results and exceptions reach the caller; a call whose
caller gave up before it started is not run; a closed thread takes no more calls."""

from __future__ import annotations

import asyncio
import threading

import pytest

from splitserve.services.common.engine_thread import EngineThread


async def test_calls_run_in_order_on_one_named_thread() -> None:
    t = EngineThread("engine-x")
    seen: list[tuple[int, str]] = []

    def call(i: int, *, scale: int = 1) -> int:
        seen.append((i, threading.current_thread().name))
        return i * scale

    try:
        got = await asyncio.gather(*(t.run(call, i, scale=3) for i in range(50)))
        assert got == [i * 3 for i in range(50)]
        assert [i for i, _ in seen] == list(range(50))
        assert {name for _, name in seen} == {"engine-x"}
        assert threading.current_thread().name != "engine-x"
    finally:
        t.close()


async def test_an_exception_reaches_the_caller_and_the_thread_goes_on() -> None:
    t = EngineThread("engine-y")

    def boom() -> None:
        raise ValueError("engine failed")

    try:
        with pytest.raises(ValueError, match="engine failed"):
            await t.run(boom)
        assert await t.run(lambda: 7) == 7
    finally:
        t.close()


async def test_a_call_cancelled_before_it_starts_is_not_run() -> None:
    t = EngineThread("engine-z")
    gate = threading.Event()
    ran: list[str] = []

    def block() -> None:
        gate.wait(5)
        ran.append("block")

    try:
        first = asyncio.ensure_future(t.run(block))
        second = asyncio.ensure_future(t.run(ran.append, "second"))
        await asyncio.sleep(0.05)
        second.cancel()
        await asyncio.sleep(0)
        gate.set()
        await first
        assert await t.run(lambda: "after") == "after"
        assert ran == ["block"]
        assert second.cancelled()
    finally:
        t.close()


async def test_close_drops_queued_calls_and_refuses_new_ones() -> None:
    t = EngineThread("engine-w")
    gate = threading.Event()
    first = asyncio.ensure_future(t.run(gate.wait, 5))
    queued = asyncio.ensure_future(t.run(lambda: "never"))
    await asyncio.sleep(0.05)
    t.close()
    gate.set()
    assert await first is True
    with pytest.raises(asyncio.CancelledError):
        await queued
    with pytest.raises(RuntimeError, match="closed"):
        await t.run(lambda: 1)
