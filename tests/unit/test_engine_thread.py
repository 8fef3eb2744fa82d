"""EngineThread: engine calls on one thread of their own, or inline for an engine that costs nothing."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from splitserve.services.common.engine_thread import EngineThread

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


def _where(arg: int, *, kw: int) -> tuple[int, int]:
    VAR.set("set by the call")
    return threading.get_ident(), arg + kw


def _boom() -> None:
    raise KeyError("engine failure")


@pytest.mark.parametrize("inline", [False, True])
async def test_a_call_returns_its_result_and_raises_its_error(inline: bool) -> None:
    t = EngineThread("t", inline=inline)
    try:
        ident, total = await t.run(_where, 1, kw=2)
        assert total == 3
        # threaded: never the loop's thread (a step must not stall NATS I/O); inline: the loop's own
        assert (ident == threading.get_ident()) is inline
        assert VAR.get() == "unset"  # what the call set stays with it, both ways
        with pytest.raises(KeyError, match="engine failure"):
            await t.run(_boom)
    finally:
        t.close()


async def test_an_inline_call_yields_to_the_loop_once_after_it() -> None:
    """A zero-cost decoder's loop of steps must still let NATS I/O in between (a real engine's step awaits)."""
    t = EngineThread("t", inline=True)
    ran: list[str] = []

    async def other() -> None:
        ran.append("other")

    async def steps() -> None:
        for _ in range(3):
            await t.run(ran.append, "step")

    task = asyncio.ensure_future(other())
    await steps()
    await task
    assert ran[0] == "step" and ran[1] == "other" and ran.count("step") == 3
    t.close()


async def test_calls_keep_their_order() -> None:
    for inline in (False, True):
        t = EngineThread("t", inline=inline)
        seen: list[int] = []
        await asyncio.gather(*(t.run(seen.append, i) for i in range(50)))
        assert seen == list(range(50))
        t.close()
