"""The proxy's client connections: each request read within its deadlines (``ClientReader``), and the ones
waiting for a request, which the proxy closes a part of when out of file descriptors (``IdleClients``)."""

from __future__ import annotations

import io
import socket
import threading
import time
from typing import Any

#: a client connection that sends nothing for this long is closed (an idle keep-alive connection, or one that
#: stalls mid-request), so that idle clients cannot hold the proxy's threads and descriptors for ever
CLIENT_IDLE_S = 60.0
#: a client's request, its head and body, must have come within this many seconds of its first byte: the idle
#: timeout is per read, so that a client that sends a byte now and then would otherwise hold a thread for ever
CLIENT_REQUEST_S = 60.0


class ClientReader(io.RawIOBase):
    """A client connection as its handler reads it (``rfile``, buffered on top): each read waits at most the
    socket's timeout (``CLIENT_IDLE_S``), and, from a request's first byte until it is read (``done``), at most
    what is left of ``CLIENT_REQUEST_S``; past it, a TimeoutError, on which the handler closes the connection."""

    def __init__(self, sock: socket.socket, idle_s: float | None, waiting: "IdleClients") -> None:
        self._sock, self._idle_s, self._waiting = sock, idle_s, waiting
        self._armed = False  # a request is being read
        self._by: float | None = None  # its deadline (monotonic), from its first byte

    def start(self) -> None:
        """The handler waits for a request (idle until its first byte: ``IdleClients``)."""
        self._armed, self._by = True, None
        self._waiting.add(self)

    def done(self) -> None:
        """The request is read: the socket's timeout is the idle one again (its writes' too)."""
        self._waiting.remove(self)
        if self._armed and self._by is not None:
            self._sock.settimeout(self._idle_s)
        self._armed, self._by = False, None

    def cut(self) -> None:
        """Close the connection's reading (and writing): its handler's wait for a request ends."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed already
            pass

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        if self._by is not None:
            left = self._by - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the request did not come whole within {CLIENT_REQUEST_S:g} s")
            self._sock.settimeout(left if self._idle_s is None else min(left, self._idle_s))
        n = self._sock.recv_into(buf)
        if self._armed and self._by is None and n:
            self._by = time.monotonic() + CLIENT_REQUEST_S
            self._waiting.remove(self)
        return n


#: out of file descriptors, this part of the client connections waiting for a request is closed (the longest waiting)
SHED_PART = 4


class IdleClients:
    """The client connections that wait for a request (for its first byte), the longest-waiting first.  Out of file
    descriptors, the proxy closes a part of them (``shed``), so that a new connection (``/health``, a request) can be
    accepted instead of waiting in the listen queue until idle ones time out: an idle kept-alive connection may be
    closed at any time (RFC 9112, 9.6), and one that never sent a byte has no request to lose."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[ClientReader, None] = {}  # in the order they began to wait

    def add(self, reader: ClientReader) -> None:
        with self._lock:
            self._waiting[reader] = None

    def remove(self, reader: ClientReader) -> None:
        with self._lock:
            self._waiting.pop(reader, None)

    def shed(self) -> int:
        """Close the longest-waiting part (``SHED_PART``) of the connections, at least one; how many."""
        with self._lock:
            cut = list(self._waiting)[:max(1, len(self._waiting) // SHED_PART)]
            for reader in cut:
                del self._waiting[reader]
        for reader in cut:
            reader.cut()
        return len(cut)


class ClientGone(Exception):
    """The client closed its connection while the answer was being written."""

