"""The routes of ``ipw serve``: the metered POSTs, /v1/models, the settled energies, /health and /metrics."""

from __future__ import annotations

import http.client
import json

from ipw.serve.exchange import Exchange
from ipw.serve.options import ENERGY_PATH, MAX_RESPONSE_BODY, METERED, MODELS


class Handler(Exchange):
    """A client connection's requests, each to its route."""

    def do_GET(self) -> None:
        self._reader.done()  # the request (a head) is read
        self._route = ""
        if not self._framed(body=False):
            return
        path = self.path.split("?", 1)[0]
        if path == "/health":
            return self._json(200, {"status": "ok", "in_flight": self.server.session.meter.in_flight()})
        if path == "/metrics":
            return self._metrics()
        if path.startswith(ENERGY_PATH):
            if not self._authorized():
                return
            status, data = self.server.session.lookup(path[len(ENERGY_PATH):])
            return self._json(status, data)
        if path.rstrip("/") != MODELS:
            return self._error(404, f"ipw serve: no route {path} (it serves /v1/chat/completions, "
                               "/v1/completions and /v1/models)", "not_found")
        if not self._authorized() or self._looped():
            return
        try:
            conn, resp = self.open_upstream("GET", MODELS, None, stream=False)
            payload = resp.read(MAX_RESPONSE_BODY)
        except (OSError, http.client.HTTPException) as exc:
            self._drop_upstream()
            return self._error(502, f"ipw serve: upstream {self.server.session.upstream.url}: {type(exc).__name__}",
                               "upstream_unreachable")
        self._release_upstream()
        self._send(resp.status, payload, resp.getheader("Content-Type"))

    def do_POST(self) -> None:
        if not self._framed(body=True):
            return
        path = self.path.split("?", 1)[0].rstrip("/")
        api = METERED.get(path)
        if api is None:
            return self._error(404, f"ipw serve: no route {path} (it serves /v1/chat/completions, "
                               "/v1/completions and /v1/models)", "not_found")
        if not self._authorized() or self._looped():
            return
        session = self.server.session
        length = self.headers.get("Content-Length")
        if length is None:
            return self._error(411, "ipw serve: send the body with a Content-Length", "length_required")
        if not (length.isascii() and length.isdigit()):  # "³" is a digit to isdigit() and 3 to int()
            return self._error(400, "ipw serve: Content-Length must be a number of bytes in ASCII digits",
                               "invalid_request")
        if int(length) > session.options.max_body_bytes:
            return self._error(413, f"ipw serve: request body of {int(length)} bytes is over the limit of "
                               f"{session.options.max_body_bytes} (--max-body-mb)", "request_too_large")
        data = self.rfile.read(int(length))
        self._reader.done()  # the request is read: what follows has the idle timeout only
        try:
            body = json.loads(data)
        except (ValueError, RecursionError):
            return self._error(400, "ipw serve: the request body is not JSON", "invalid_request")
        if not isinstance(body, dict):
            return self._error(400, "ipw serve: the request body must be a JSON object", "invalid_request")
        self._metered(api, path, body)

    def _metrics(self) -> None:
        """``GET /metrics``: the session's Prometheus metrics (with --token, for a scrape that sends it)."""
        session = self.server.session
        if not self._authorized():
            return
        if session.metrics is None:
            why = "install it with: pip install 'ipw[prometheus]'" if session.options.metrics else "--no-metrics"
            return self._error(404, f"ipw serve: no /metrics ({why})", "not_found")
        self._send(200, *session.metrics.exposition())

