"""What leaves ipw as text: no secret, no credential in a URL, no forged CI annotation or Markdown link,
no raw terminal escape.

- API keys are read only through :func:`read_key`: stripped, checked (an HTTP header cannot carry a
  control character, and http.client would quote the whole header in its error), and registered, so
  that :func:`scrub` replaces them in every text written to a run folder or printed.  Scrub *before*
  cutting a text short: a key cut in two is no longer found.
- :func:`redact_url` drops ``user:password@`` and the values of secret-looking query parameters.
- :func:`github_escape` / :func:`github_property` escape GitHub workflow commands, :func:`md_text`
  Markdown, :func:`printable` control characters for the terminal.
"""

from __future__ import annotations

import json
import os
import re
from urllib.parse import urlsplit, urlunsplit

from ipw.errors import IpwError

_SECRETS: set[str] = set()
_MIN_SECRET = 8  # shorter values are not scrubbed from every text (they would mangle ordinary words)

SECRET_PARAM = re.compile(r"(?i)(?:key|token|secret|passw(?:or)?d|pwd|auth|signature|sig|credential|session)")
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")


def register(secret: str) -> None:
    if secret and len(secret) >= _MIN_SECRET:
        _SECRETS.add(secret)
        _SECRETS.add(json.dumps(secret)[1:-1])  # as it appears inside a JSON string


def scrub(text: str) -> str:
    """``text`` with every registered secret replaced by ``***``."""
    for secret in _SECRETS:
        if secret in text:
            text = text.replace(secret, "***")
    return text


def read_key(env: str, backend: str) -> str:
    """The API key in the environment variable ``env``, stripped of surrounding whitespace (a CRLF key
    file, a decoded secret); an IpwError, which never shows the value, when it is unset, empty or holds
    a character an HTTP header cannot carry."""
    where = f"backend {backend!r}: the environment variable {env} (api_key_env)"
    raw = os.environ.get(env)
    if raw is None:
        raise IpwError(f"{where} is not set")
    key = raw.strip()
    register(key)
    if not key:
        raise IpwError(f"{where} is empty")
    for i, ch in enumerate(key):
        if not 0x21 <= ord(ch) <= 0x7E:
            kind = "a control character" if ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 else (
                "a space" if ch.isspace() else "a non-ASCII character")
            raise IpwError(f"{where} holds {kind} at position {i + 1} of {len(key)}; an API key is printable "
                           "ASCII (the value is not shown)")
    return key


def redact_url(url: str) -> str:
    """``url`` without ``user:password@`` and with secret-looking query values (``api_key=``, ``token=``,
    ``sig=``...) replaced by ``***``."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
    except ValueError:
        return "<unparsable URL>"
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = "&".join(
        f"{k}=***" if SECRET_PARAM.search(k) else (f"{k}={v}" if sep else k)
        for k, sep, v in (item.partition("=") for item in parts.query.split("&") if item)
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_urls(text: str) -> str:
    """Every URL in a free text redacted (error messages, log lines)."""
    return _URL.sub(lambda m: redact_url(m.group(0)), text)


def message(text: str) -> str:
    """An error message as it may be shown or stored: secrets scrubbed, URLs redacted."""
    return redact_urls(scrub(text))


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """Control characters (an escape sequence, a carriage return) shown escaped, e.g. ``\\x1b``; newlines
    and tabs kept."""
    return _CONTROL.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), text)


def github_escape(text: str) -> str:
    """The message of a GitHub workflow command (``::error ...::MESSAGE``): one line, never a new command."""
    return str(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def github_property(text: str) -> str:
    """A property value of a workflow command (``title=...``): also ``:`` and ``,`` escaped."""
    return github_escape(text).replace(":", "%3A").replace(",", "%2C")


_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


def md_text(text: object) -> str:
    """Text shown literally in Markdown (GitHub flavour): one line, HTML shown as text, and no character
    that could start a link, an image, emphasis, code or a table cell."""
    t = str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    t = _MD_SPECIAL.sub(r"\\\1", t)
    return re.sub(r"[\r\n]+", " ", t)
