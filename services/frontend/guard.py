"""Connection-level guards of the front door's HTTP server, below the ASGI app.

uvicorn bounds the idle time *between* requests (``timeout_keep_alive``) and the number of connections
(``limit_concurrency``), but nothing bounds how long a client may take to send a request's headers: a
connection that sends ``GET / HTTP/1.1\\r\\nX-a: b`` and then one byte a minute (slowloris) is held forever,
and a few hundred of them exhaust the connection limit. :func:`guarded_httptools` is uvicorn's own httptools
protocol with a header deadline (armed when the connection opens and whenever a new request begins, disarmed
once its headers are complete) and a cap on the header bytes of one request. It also drains gently: at a graceful
shutdown uvicorn closes every connection with no request in progress, among them one accepted a moment ago whose
request has not been read yet (the client did nothing wrong, and it fails); here such a connection gets its
request answered (or ``DRAIN_FIRST_REQUEST_S`` to send it), then closes.

:func:`exposure_warning` is the check behind the loud warning of a front door that listens beyond loopback
with no API keys.
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# A request's headers must arrive within this from its first byte (or from the connection's opening).
HEADER_TIMEOUT_S = 10.0
# Far above any real client's headers (browsers send a few KiB); llhttp itself has no limit.
MAX_HEADER_BYTES = 64 * 1024
# Draining: how long a connection accepted just before gets to send its first byte before it is closed.
DRAIN_FIRST_REQUEST_S = 2.0

_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_TOO_LARGE_RESPONSE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n"
                       b"connection: close\r\n\r\n")


def guarded_httptools(header_timeout_s: float = HEADER_TIMEOUT_S,
                      max_header_bytes: int = MAX_HEADER_BYTES) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a header-read deadline and a header size cap (pass the class as
    ``uvicorn.Config(http=...)``)."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0
        _reading_headers = False
        _draining = False  # the server is shutting down: the request being received is this connection's last

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()  # a connection that never sends a byte is held no longer than a slow one

        def data_received(self, data: bytes) -> None:
            if self._reading_headers:
                if self._draining and self._header_bytes == 0:
                    self._arm()  # the first bytes after the drain began: the usual header deadline from here
                self._header_bytes += len(data)
            super().data_received(data)
            # Still in the headers after all that (a chunk's body bytes do not count once they are complete):
            # a request line and headers that never end cannot grow without bound.
            if self._reading_headers and self._header_bytes > max_header_bytes:
                self._refuse(_TOO_LARGE_RESPONSE)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if not self._reading_headers:  # a new request on a kept-alive connection: a fresh deadline
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()
            if self._draining and self.cycle is not None:
                self.cycle.keep_alive = False  # answered with "connection: close", then closed

        def shutdown(self) -> None:
            # A request is on its way in (its first bytes read, or none yet on a connection accepted just
            # before the server stopped accepting): answer it instead of closing under the client. Bounded: the
            # header deadline, and for a connection that has sent nothing, DRAIN_FIRST_REQUEST_S.
            if self._reading_headers and not self.transport.is_closing():
                self._draining = True
                if self._header_bytes == 0 and self.cycle is None:
                    self._disarm()
                    self._reading_headers = True  # still: the first bytes re-arm the header deadline
                    self._header_timer = self.loop.call_later(min(header_timeout_s, DRAIN_FIRST_REQUEST_S),
                                                              self._close_unused)
                return
            super().shutdown()

        def _close_unused(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.transport.close()  # nothing was sent: nothing to answer

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._reading_headers = True
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(header_timeout_s, self._refuse, _TIMEOUT_RESPONSE)

        def _disarm(self) -> None:
            self._reading_headers = False
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _refuse(self, response: bytes) -> None:
            self._disarm()
            if self.transport.is_closing():
                return
            # A status only when no response of an earlier (pipelined) request is still being written.
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(response)
            self.transport.close()

    return GuardedHttpToolsProtocol


def is_loopback(host: str) -> bool:
    """Whether ``host`` (what the server binds) is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to any interface


def exposure_warning(host: str, api_keys: Any) -> str | None:
    """The warning for a front door bound beyond loopback with no API keys (None when there is none)."""
    if api_keys or is_loopback(host):
        return None
    return (f"WARNING: the OpenAI API listens on {host} (beyond loopback) with NO API KEYS: anyone who can "
            "reach this port can run requests as tenant 'default' (and, without admin keys, open the console). "
            "Pass --api-keys FILE or --tenants FILE, or listen on 127.0.0.1.")
