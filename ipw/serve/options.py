"""What ``ipw serve`` was asked to do: its options (the manifest's ``config.serve``), its upstream's address,
and the paths and limits of the OpenAI API it serves."""

from __future__ import annotations

import http.client
from dataclasses import dataclass
from urllib.parse import urlsplit

from ipw.errors import IpwError
from ipw.sanitize import redact_url

#: the paths a client may call (under /v1); the first two are metered
METERED = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
MODELS = "/v1/models"
ENERGY_PATH = "/v1/ipw/energy/"  # + a request id: its settled energy
MAX_ERROR_BODY = 1 << 20  # an upstream error body passed through, at most
MAX_RESPONSE_BODY = 64 << 20  # a non-streamed upstream answer, at most
#: the proxies a request went through (each one's random id): one that comes back to a proxy it went through is a
#: loop (an --upstream that leads back to the proxy), refused with 508 instead of nesting until a limit
HOP_HEADER = "X-Ipw-Serve-Hops"
MAX_HOPS = 16  # ids kept in the header: a longer chain is a loop too


@dataclass(frozen=True)
class ServeOptions:
    """What ``ipw serve`` was asked to do (the manifest's ``config.serve``; no secret in it)."""

    upstream: str  # base URL of the upstream OpenAI-compatible API, e.g. http://127.0.0.1:8080/v1
    name: str  # the backend name of the records
    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free port
    api_key_env: str | None = None  # the variable holding the upstream's key (sent upstream only)
    token_required: bool = False  # clients must send Authorization: Bearer <token>
    log_prompts: bool = False  # keep prompts and outputs in the records (else their SHA-256)
    max_body_bytes: int = 16 << 20
    timeout_s: float = 600.0  # per upstream request, from its start to its last byte
    energy_in_response: bool = True  # else the answer carries no energy: in the run folder only
    energy_wait: bool = False  # the answer waits for its settled energy (else it carries a provisional one)
    energy_split: str = "priced"  # how overlapping requests' energy is split (ipw.metering.split.SPLITS)
    idle_s: float = 3.0
    role: str = "local"
    model: str = ""  # what the upstream serves, when known (a managed server's model)
    # --route ROUTER --local URL --cloud URL (issue 44): each request goes where the router says; ``upstream`` and
    # ``name`` are then the local ones, these the cloud's (records: backend and role of the route taken)
    route: str = ""  # the router file (ipw route train)
    cloud_upstream: str = ""
    cloud_name: str = ""
    route_sha256: str = ""  # the router file's, when the proxy started (--resume takes the same router only)
    metrics: bool = True  # GET /metrics: Prometheus metrics of the settled records (ipw.export.prometheus)


@dataclass(frozen=True)
class Upstream:
    scheme: str
    host: str
    port: int
    prefix: str  # the path before /chat/completions, e.g. /v1
    remote: bool  # not on this machine: its energy is the API estimate, labeled estimated

    @classmethod
    def parse(cls, url: str) -> "Upstream":
        from ipw.backends.openai_http import is_loopback

        if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
            raise IpwError(f"--upstream {redact_url(url)!r}: a URL with a space or a control character is refused")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise IpwError(f"--upstream {redact_url(url)!r}: expected http(s)://HOST[:PORT]/v1")
        if parts.username or parts.password:
            raise IpwError("--upstream: a user or password in the URL is refused; put the key in a variable and "
                           "give --api-key-env NAME")
        if parts.query:
            raise IpwError("--upstream: a query string is refused; give the base URL, e.g. http://HOST:PORT/v1")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise IpwError(f"--upstream {redact_url(url)!r}: bad port") from None
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"), not is_loopback(parts.hostname))

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.prefix}"

    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout_s)

