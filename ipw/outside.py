"""One GET to a service outside ipw that holds a credential: the carbon feed (``ipw.carbon``) and a BMC's
Redfish service (``ipw.telemetry.node_power``); issue 55.

- **Credentials stay with their origin.**  urllib's redirect handler copies every header of a request to
  wherever a ``Location`` points, ``Authorization`` and ``auth-token`` included.  Here a redirect is followed
  only to the same scheme, host and port (a BMC's ``/redfish/v1`` to ``/redfish/v1/``); one to another origin
  is refused, and nothing is sent there.
- **A total deadline.**  A socket timeout bounds each read, and a server that trickles a byte now and then
  resets it for ever; the whole call (every redirect, the headers, the body) is cut at ``timeout_s`` by the
  HTTP backend's mechanism (:class:`ipw.backends.openai_wire.Deadline`).
- **Bounded.**  At most ``limit`` bytes of a body; a URL that a request cannot carry (a control character in
  a link) is an error of the call, not an exception from http.client.

Plain ``http.client``, as the HTTP backend: no proxy from the environment is used (a BMC is on the
management network; a feed behind a proxy is unreachable, said so in its note).
"""

from __future__ import annotations

import http.client
import ssl
import time
import urllib.parse

#: redirects followed (each to the same origin) before the call is given up
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)


class OutsideError(Exception):
    """The call gave no answer to use: ``status`` is the HTTP status of an answer that was not 200 (None
    when there was none), ``cause`` the exception behind it (a certificate error, ...)."""

    def __init__(self, message: str, status: int | None = None, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.cause = cause


def _origin(url: str) -> tuple[str, str, int | None]:
    """Scheme, host and port: where a credential may go."""
    from ipw.sanitize import one_line, redact_url

    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:  # a port that is not a number, an unbalanced [
        raise OutsideError(f"not a URL: {redact_url(one_line(url))[:200]}") from None
    if any(not 0x21 <= ord(c) <= 0x7E for c in url):  # http.client would refuse it, or send a control character
        raise OutsideError(f"not a URL a request can carry: {redact_url(one_line(url))[:200]}")
    return parts.scheme, (parts.hostname or "").lower(), port


def get(url: str, headers: dict[str, str], *, timeout_s: float, limit: int,
        context: ssl.SSLContext | None = None) -> bytes:
    """The body of a 200 answer to ``GET url`` (at most ``limit`` bytes), within ``timeout_s`` in all;
    OutsideError (one line, no credential) otherwise."""
    from ipw.sanitize import one_line, redact_url

    deadline = time.monotonic() + timeout_s
    origin = _origin(url)  # also refuses a URL no request can carry (a redirect's is checked below)
    for _ in range(MAX_REDIRECTS + 1):
        status, location, body = _once(url, headers, deadline, timeout_s, limit, context)
        if status in REDIRECTS and location:
            url = urllib.parse.urljoin(url, location.strip())
            if _origin(url) != origin:
                raise OutsideError(f"HTTP {status}: redirected to another origin ({redact_url(one_line(url))[:200]}); "
                                   "not followed, so that the credential is not sent there", status=status)
            continue
        if status != 200:
            raise OutsideError(f"HTTP {status}", status=status)
        if len(body) > limit:
            raise OutsideError(f"an answer over {limit} bytes")
        return body
    raise OutsideError(f"more than {MAX_REDIRECTS} redirects")


def _once(url: str, headers: dict[str, str], deadline: float, timeout_s: float, limit: int,
          context: ssl.SSLContext | None) -> tuple[int, str | None, bytes]:
    """One request of :func:`get`: the status, the ``Location`` and at most ``limit + 1`` bytes of the body."""
    from ipw.backends.openai_wire import Deadline
    from ipw.sanitize import one_line

    late = OutsideError(f"no complete answer within {timeout_s:g} s (the request's total deadline)")
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise late
    parts = urllib.parse.urlsplit(url)
    conn = (http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=remaining, context=context)
            if parts.scheme == "https" else http.client.HTTPConnection(parts.hostname or "", parts.port,
                                                                       timeout=remaining))
    cutter = None
    try:
        conn.connect()
        cutter = Deadline(conn, deadline)  # each read has its timeout; this bounds them all together
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), headers=headers)
        response = conn.getresponse()
        body = response.read(limit + 1)
        if cutter.expired:  # the body ended because the deadline shut the socket
            raise late
        return response.status, response.getheader("Location"), body
    except (OSError, http.client.HTTPException) as exc:  # before ValueError: a certificate's error is both
        if isinstance(exc, TimeoutError) or cutter is not None and cutter.expired:
            raise late from None
        raise OutsideError(one_line(str(exc) or type(exc).__name__), cause=exc) from None
    except ValueError:  # a header value that HTTP cannot carry: its text (a key) is never shown
        raise OutsideError("the request could not be sent (a header holds a character HTTP cannot carry)") from None
    finally:
        if cutter is not None:
            cutter.cancel()
        conn.close()
