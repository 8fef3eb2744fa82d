"""Make nats-py's ``flush()`` a barrier again: a PING that waits its turn behind the commands already queued.

nats-py 2.16 queues SUB, UNSUB and PUB in the client's pending buffer (written by its flusher task) but writes
the PING of ``flush()`` (and of ``rtt()`` and the keep-alive) straight to the socket. The PING can overtake a
SUB still in that buffer: the server answers PONG before it has seen the SUB, ``flush()`` returns, and a message
another connection publishes right then finds no subscriber and is dropped. Measured on this 2-core machine
(``subscribe``, ``flush``, a publish from a second connection, 200-300 rounds, one nats-server): 13-22 of 200
messages lost, with and without authentication, on nats-server 2.15.1 and 2.10.26 alike; 0 of 300 with the PING
queued behind them (this module). The same bug was fixed once in nats.py2 (pull request 24, "Fix flush API
which drops commands in some cases because of calling io.write directly").

``apply()`` replaces ``Client._send_ping`` with one that appends the PING to the pending buffer, so the wire
order is the call order. It is applied when :mod:`splitserve.runtime.bus` is imported (every service, the SDK,
the CLI: each connects through the bus) and by the tests' conftest; it is idempotent, and leaves a nats-py
without these internals alone (checked by ``tests/wire/test_nats_flush.py``, which reads the server's protocol
trace).
"""

from __future__ import annotations

import asyncio
from typing import Any

_PATCHED = "_splitserve_ordered_ping"


async def _send_ping(self: Any, future: asyncio.Future[Any] | None = None) -> None:
    from nats.aio.client import PING_PROTO

    if future is None:
        future = asyncio.Future()
    self._pongs.append(future)
    self._pending.append(PING_PROTO)
    self._pending_data_size += len(PING_PROTO)
    await self._flush_pending()


def apply() -> bool:
    """Queue nats-py's PINGs behind pending commands; True if the client is (now) patched."""
    try:
        from nats.aio.client import PING_PROTO, Client  # noqa: F401  (PING_PROTO: the internals used)
    except ImportError:
        return False
    if getattr(Client, _PATCHED, False):
        return True
    if not all(hasattr(Client, a) for a in ("_send_ping", "_flush_pending", "_send_command")):
        return False  # another nats-py: its flush is what it is
    Client._send_ping = _send_ping  # type: ignore[method-assign]
    setattr(Client, _PATCHED, True)
    return True
