"""The HTTP shell of ``ipw serve``: the listening server with its pool of kept-alive upstream connections
(``ProxyServer``) and the base of its request handler (``Connection``)."""

from __future__ import annotations

import errno
import http.client
import io
import json
import secrets
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ipw import __version__
from ipw.backends.openai_wire import Deadline
from ipw.sanitize import scrub
from ipw.serve.clients import CLIENT_IDLE_S, ClientGone, ClientReader, IdleClients
from ipw.serve.options import HOP_HEADER, MAX_ERROR_BODY, MAX_HOPS, Upstream
from ipw.serve.session import Session

MAX_IDLE_UPSTREAM = 256  # upstream connections kept alive for the next requests, at most
#: out of file descriptors, the accept loop waits this long before it tries again (else it spins on a core)
ACCEPT_BACKOFF_S = 0.05
DRAIN_S = 1.0  # after [DONE], how long the rest of the upstream's body (its last chunk) is waited for


class Connection(BaseHTTPRequestHandler):
    """The HTTP side of one client connection: its reads and answers, its upstream connection, the checks of
    every request (token, loop, framing).  ``Exchange`` meters a request on it, ``Handler`` routes them."""


    protocol_version = "HTTP/1.1"
    timeout = CLIENT_IDLE_S  # the client socket's: reads and writes
    server: "ProxyServer"
    server_version = f"ipw-serve/{__version__}"
    _up: "http.client.HTTPConnection | None" = None  # this request's upstream connection
    _route = ""  # with --route: this request's route (local or cloud); a GET goes to the local upstream
    _resp: "http.client.HTTPResponse | None" = None  # and its answer
    _deadline: Deadline | None = None  # the request's total deadline (--timeout-s)

    def log_message(self, format: str, *args: Any) -> None:  # no access log on stderr (bodies never logged)
        pass

    def setup(self) -> None:
        """A plain answer is two writes (its headers, then its body): without TCP_NODELAY the body waits for
        the client's delayed ACK of the headers (Nagle), ~40 ms on Linux."""
        super().setup()
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # not a TCP socket
            pass
        self.rfile.close()  # read through a deadline for each request instead
        self._reader = ClientReader(self.connection, self.timeout, self.server.idle_clients)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        self._reader.start()
        try:
            super().handle_one_request()
        finally:
            self._reader.done()

    # -- plumbing -------------------------------------------------------------------------------

    def _send(self, status: int, payload: bytes, content_type: str | None,
              headers: dict[str, str] | None = None) -> None:
        """A whole (not streamed) answer."""
        self.send_response(status)
        self.send_header("Content-Type", content_type or "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(payload)

    def _json(self, status: int, data: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(data, ensure_ascii=False).encode(), "application/json", headers)

    def _error(self, status: int, message: str, kind: str) -> None:
        self.close_connection = True
        self._json(status, {"error": {"message": scrub(message), "type": kind, "code": status}}, {"Connection": "close"})

    def _authorized(self) -> bool:
        if self.server.session.check_token(self.headers.get("Authorization")):
            return True
        self._error(401, "ipw serve: missing or wrong token (send Authorization: Bearer <token>)", "unauthorized")
        return False

    def _hops(self) -> list[str]:
        """The ids of the proxies this request went through before this one (``HOP_HEADER``)."""
        return [h for h in (self.headers.get(HOP_HEADER) or "").replace(" ", "").split(",") if h]

    def _looped(self) -> bool:
        """Whether this request already went through this proxy (its upstream leads back to it): then 508."""
        hops = self._hops()
        if self.server.hop_id not in hops and len(hops) < MAX_HOPS:
            return False
        self._error(508, f"ipw serve: a loop: the request came back to this proxy through its upstream "
                    f"{self.server.session.upstream.url} (give --upstream the server to forward to)", "loop_detected")
        return True

    def _upstream_headers(self, stream: bool) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "User-Agent": f"ipw-serve/{__version__}",
                   "Accept": "text/event-stream" if stream else "application/json",
                   HOP_HEADER: ",".join([*self._hops()[-(MAX_HOPS - 1):], self.server.hop_id])}
        key = self.server.session.key_of(self._route)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def open_upstream(self, method: str, path: str, body: bytes | None, stream: bool,
                      deadline: float | None = None) -> tuple[http.client.HTTPConnection, Any]:
        """Send the request upstream on a kept-alive upstream connection if one is idle, else a new one (one
        retry on a new connection when a kept-alive one was closed by the server), and read the response's
        headers.  Public, with ``send_chunk`` and ``end_stream``, as the steps of a request through the proxy
        that bench/serving/serve_timeline.py times."""
        session = self.server.session
        upstream = session.upstream_of(self._route)
        for attempt in (0, 1):
            conn, reused = self.server.upstream_connection(idle=attempt == 0, upstream=upstream)
            self._up = conn
            try:
                conn.request(method, upstream.prefix + path[len("/v1"):], body=body,
                             headers=self._upstream_headers(stream))
                if deadline is not None:  # a trickle that never ends is cut at the deadline
                    if self._deadline is not None:
                        self._deadline.cancel()  # a kept-alive connection's, that failed
                    self._deadline = Deadline(conn, deadline)
                self._resp = conn.getresponse()
                return conn, self._resp
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._drop_upstream()
                if not reused:
                    raise
        raise AssertionError("unreachable")

    def _drop_upstream(self) -> None:
        conn = self._up
        if conn is not None:
            conn.close()  # the server sees the connection close and stops generating
        self._up = self._resp = None

    def _release_upstream(self) -> None:
        """The request is over: its upstream connection goes back to the server's idle ones when its answer
        was read to the end (and the upstream keeps it open), else it is closed."""
        conn, resp = self._up, self._resp
        self._up = self._resp = None
        if conn is not None and resp is not None and resp.isclosed() and conn.sock is not None:
            self.server.keep_upstream(conn)
        elif conn is not None:
            conn.close()

    def _finish_upstream(self) -> None:
        """The request's deadline is cancelled (its connection dropped if it fired), then the connection
        released: it never fires on a connection that serves another request."""
        if self._deadline is not None:
            self._deadline.cancel()
            if self._deadline.expired:  # it shut the upstream's socket
                self._drop_upstream()
            self._deadline = None
        self._release_upstream()

    def _drain_upstream(self, resp: Any) -> None:
        """After [DONE] (the client's answer is complete): the rest of the upstream's body, its last chunk,
        read for ``DRAIN_S`` at most, so that its connection can serve another request (else it is closed)."""
        sock = self._up.sock if self._up is not None else None
        if sock is None:
            return
        try:
            sock.settimeout(DRAIN_S)
            resp.read(MAX_ERROR_BODY)
            sock.settimeout(self.server.session.options.timeout_s)
        except (OSError, http.client.HTTPException):
            self._drop_upstream()

    def send_chunk(self, data: bytes) -> None:
        """One chunk of the chunked answer to the client (``b""``: the terminal one); a client gone raises
        ``ClientGone``.  Public: bench/serving/serve_timeline.py times the first event, the energy chunk and
        the terminal chunk sent."""
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        except (BrokenPipeError, ConnectionResetError, TimeoutError) as exc:
            raise ClientGone(type(exc).__name__) from None

    def _framed(self, body: bool) -> bool:
        """Whether the request's body is framed one way only (else a 400, and the connection closed: bytes that
        a server or proxy in front of this one reads as a body could be read here as a request, or the
        reverse, request smuggling).  ``body``: the route takes one (by Content-Length, one value)."""
        lengths = self.headers.get_all("Content-Length") or []
        chunked = self.headers.get_all("Transfer-Encoding")
        if chunked and lengths:
            problem = "both Content-Length and Transfer-Encoding"
        elif any("\n" in value for value in self.headers.values()):  # a line folded into the one before it
            problem = "a folded header line (obs-fold)"
        elif len(set(lengths)) > 1:
            problem = f"Content-Length given {len(lengths)} times, differently"
        elif not body and (chunked or any(v.strip() not in ("", "0") for v in lengths)):
            problem = "a body on a GET request"
        else:
            return True
        self._error(400, f"ipw serve: {problem}: refused (a request read two ways: request smuggling)",
                    "invalid_request")
        return False



class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # a load generator opens its connections at once
    session: Session  # set before it serves: the socket is bound first, so that a refusal leaves no run folder

    def __init__(self, address: tuple[str, int], handler: type[Connection], session: Session | None = None) -> None:
        if session is not None:
            self.session = session
        self.hop_id = secrets.token_hex(8)
        self.idle_clients = IdleClients()
        self._idle: list[http.client.HTTPConnection] = []  # upstream connections kept alive, the last used last
        self._idle_lock = threading.Lock()
        self._closed = False
        super().__init__(address, handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as exc:  # the caller drops the attempt; out of descriptors, close idle clients, wait for them
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self.idle_clients.shed()
                time.sleep(ACCEPT_BACKOFF_S)
            raise

    def upstream_connection(self, idle: bool = True, upstream: Upstream | None = None,
                            ) -> tuple[http.client.HTTPConnection, bool]:
        """An upstream connection for a request to ``upstream`` (default the session's): the idle one to it used
        last (``idle``), else a new one; and whether it was kept alive from an earlier request (the upstream may
        have closed it since)."""
        upstream = upstream or self.session.upstream
        with self._idle_lock:
            if idle and self._idle:
                if self.session.cloud is None:
                    return self._idle.pop(), True
                for i in range(len(self._idle) - 1, -1, -1):  # --route: two upstreams share the idle list
                    if (self._idle[i].host, self._idle[i].port) == (upstream.host, upstream.port):
                        return self._idle.pop(i), True
        return upstream.connection(self.session.options.timeout_s), False

    def keep_upstream(self, conn: http.client.HTTPConnection) -> None:
        """An upstream connection whose answer was read to the end, kept for the next request."""
        with self._idle_lock:
            if not self._closed and len(self._idle) < MAX_IDLE_UPSTREAM:
                self._idle.append(conn)
                return
        conn.close()

    def server_close(self) -> None:
        super().server_close()
        with self._idle_lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away is not an error of the proxy; anything else is one line on stderr."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, ClientGone, TimeoutError)):
            return
        self.session.notice(f"ipw serve: request from {client_address[0]} failed: {type(exc).__name__}: "
                            f"{scrub(str(exc))[:200]}")

