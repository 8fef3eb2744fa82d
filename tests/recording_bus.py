"""A stand-in bus for driving a real ``RouterService`` in process (no NATS): it records what the router would
publish, its subscriptions go nowhere and the tasks it would spawn are dropped. The simulator-equivalence test
and the router's cache-salt test feed the service's own handlers through it."""

from __future__ import annotations

from typing import Any


class _Sub:
    async def unsubscribe(self) -> None:
        pass


class _NoNats:
    async def subscribe(self, *_: Any, **__: Any) -> _Sub:  # the router follows each request's stream
        return _Sub()


class RecordingBus:
    def __init__(self) -> None:
        self.published: list[tuple[str, Any]] = []
        self.nc = _NoNats()

    async def publish(self, subject: str, msg: Any, **_: Any) -> None:
        self.published.append((subject, msg))

    def spawn(self, coro: Any) -> None:
        coro.close()

    async def respond(self, _: Any, msg: Any, **__: Any) -> None:  # a reply to the caller (Accepted, a refusal)
        self.published.append(("(reply)", msg))
