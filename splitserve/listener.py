"""Listening TCP sockets for the HTTP front door, and the one ``splitserve up`` holds for all its front doors.

The supervisor binds the API's socket once and hands the same socket (not a copy bound again) to every front
door process it starts (``--listen-fd``). The kernel keeps one accept queue for it, whichever processes accept
from it: a front door that drains stops accepting (it closes its own descriptor, the socket stays open in the
supervisor and the other front doors) and what is queued is taken by the others; with every front door down at
once (restarting), new connections wait in the queue instead of being refused. Separate sockets bound with
SO_REUSEPORT would each have their own queue, and closing one resets what is queued on it (unless the host set
``net.ipv4.tcp_migrate_req``), so a draining front door would fail the clients whose connections it had not
accepted yet.

Light on purpose (the supervisor imports it): no web framework here.
"""

from __future__ import annotations

import socket

BACKLOG = 2048  # connections the kernel queues for the front doors (they accept them in a burst)


def bind_listener(host: str, port: int, backlog: int = BACKLOG) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port). A taken port raises OSError naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and with Nagle left
    # on, every small SSE chunk after the first waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(backlog)
    return sock


def inherited_listener(fd: int) -> socket.socket:
    """The listening socket a supervisor passed down as file descriptor ``fd``."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise OSError(exc.errno, f"--listen-fd {fd}: not an open socket ({exc.strerror})") from None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.detach()
        raise OSError(f"--listen-fd {fd}: not a TCP socket")
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()
        raise OSError(f"--listen-fd {fd}: the socket is not listening")
    return sock
