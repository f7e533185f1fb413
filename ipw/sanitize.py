"""What leaves ipw as text: no secret, no credential in a URL, no forged CI annotation or Markdown link,
no raw terminal escape.

- API keys are read only through :func:`read_key`: stripped, checked (an HTTP header cannot carry a
  control character, and http.client would quote the whole header in its error), and registered, so
  that :func:`scrub` replaces them in every text written to a run folder or printed: the whole key, and
  any 8 characters of it in a row, also where some of them are masked with ``*`` (``sk-SENT****``, as
  an API's "incorrect key" message shows it).  Scrub *before* cutting a text short; a text cut at an
  arbitrary point loses its tail too (:func:`scrub_tail`).
- The names of the variables a config gives as ``api_key_env`` are registered too
  (:func:`register_env`): no engine worker or managed server inherits them, whatever they are called.
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
_SECRET_ENV: set[str] = set()  # names of the variables a config gives as api_key_env
_MIN_SECRET = 8  # shorter values are not scrubbed from every text (they would mangle ordinary words)
WINDOW = 8  # any this many characters of a key in a row are scrubbed
_MIN_SHOWN = 4  # ... of which at least this many are shown (not masked with "*")
_windows: re.Pattern[str] | None = None

SECRET_PARAM = re.compile(r"(?i)(?:key|token|secret|passw(?:or)?d|pwd|auth|signature|sig|credential|session)")
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")


def register(secret: str) -> None:
    global _windows
    if secret and len(secret) >= _MIN_SECRET and secret not in _SECRETS:
        _SECRETS.add(secret)
        _SECRETS.add(json.dumps(secret)[1:-1])  # as it appears inside a JSON string
        # one lookahead alternative per window of every secret; a character may be shown or masked ("*")
        alternatives = sorted({"".join(f"[{re.escape(c)}*]" for c in s[i: i + WINDOW])
                               for s in _SECRETS for i in range(len(s) - WINDOW + 1)})
        _windows = re.compile(f"(?=(?:{'|'.join(alternatives)}))")


def register_env(name: str) -> None:
    """``name`` holds a secret (a config's ``api_key_env``): never passed to a worker or server."""
    _SECRET_ENV.add(name)


def is_secret_env(name: str, value: str) -> bool:
    """Whether an environment variable is a secret: named by a config's ``api_key_env``, or holding a
    registered key."""
    return name in _SECRET_ENV or any(secret in value for secret in _SECRETS)


def scrub(text: str) -> str:
    """``text`` with every registered secret replaced by ``***``: the whole key, and every run of
    characters that holds any 8 of its characters in a row, shown or masked with ``*`` (at least 4
    shown), together with the ``*`` around it."""
    if _windows is None:
        return text
    spans: list[list[int]] = []
    for match in _windows.finditer(text):
        start = match.start()
        if text.count("*", start, start + WINDOW) > WINDOW - _MIN_SHOWN:
            continue
        if spans and start <= spans[-1][1]:
            spans[-1][1] = start + WINDOW
        else:
            spans.append([start, start + WINDOW])
    if not spans:
        return text
    out: list[str] = []
    at = 0
    for start, end in spans:
        while start > at and text[start - 1] == "*":  # the mask around a shown part
            start -= 1
        while end < len(text) and text[end] == "*":
            end += 1
        start, end = _json_safe(text, start, end)
        if start >= end:  # nothing left that can go without breaking the text
            continue
        if start > at or not out:
            out.append(text[at:start] + "***")
        at = max(at, end)
    return "".join(out) + text[at:]


_HEX = frozenset("0123456789abcdefABCDEF")


def _json_safe(text: str, start: int, end: int) -> tuple[int, int]:
    """The span ``[start, end)`` of a text to scrub, narrowed so that replacing it never breaks the JSON it is
    in (a manifest, a record), nor a JSON text inside that JSON: it neither starts nor ends inside a
    backslash escape (``\\r``, ``\\"``, ``\\u00e9``, ``\\\\\\"`` a level down), nor ends with a backslash,
    nor starts or ends with a quote (escaped or not: a level down it may end a string).  What it leaves out
    is at most an escape at each end; the rest of the key goes."""
    k = start  # inside a \uXXXX (after its u): past its hex digits
    while k > 0 and start - k < 3 and text[k - 1] in _HEX:
        k -= 1
    if k > 1 and text[k - 1] == "u" and text[k - 2] == "\\":
        start = k + 4
    elif start > 0 and text[start - 1] == "\\":  # inside a run of backslashes: past the run and what it escapes
        start = _past_escape(text, start)
    while start < end and text[start] in '"\\':  # a quote, or backslashes before one: a string's end a level down
        past = _past_escape(text, start) if text[start] == "\\" else start + 1
        if text[past - 1] != '"':
            break  # an escape of any other character goes whole
        start = past
    while end > start and text[end - 1] in '"\\':
        end -= 1
    return start, end


def _past_escape(text: str, i: int) -> int:
    """The end of the escape whose run of backslashes ``text[i]`` is in (or follows): past the backslashes,
    the character they escape, and a ``u``'s four hex digits."""
    while i < len(text) and text[i] == "\\":
        i += 1
    return min(len(text), i + (5 if text[i: i + 1] == "u" else 1))


def scrub_tail(text: str) -> str:
    """A text that was cut at an arbitrary point (a bounded read), without its last characters, as many as
    the longest registered key has: the part of a key that the cut left there is too short to be
    recognised, so it goes whole."""
    n = max((len(s) for s in _SECRETS), default=0)
    return text[: max(0, len(text) - n)]


def read_key(env: str, backend: str, where: str = "") -> str:
    """The API key in the environment variable ``env``, stripped of surrounding whitespace (a CRLF key
    file, a decoded secret); an IpwError, which never shows the value, when it is unset, empty or holds
    a character an HTTP header cannot carry.  ``where`` starts the error (default: the backend's
    api_key_env)."""
    where = where or f"backend {backend!r}: the environment variable {env} (api_key_env)"
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


# control characters, and the bidi controls that reorder what a terminal, a page or an editor shows
# (a right-to-left override makes "api\u202eevil" print as "apilive")
_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(f"[\\x00-\\x08\\x0b-\\x1f\\x7f-\\x9f{_BIDI}]")
_CONTROL_OR_NEWLINE = re.compile(f"[\\x00-\\x1f\\x7f-\\x9f{_BIDI}]")


def _escaped(m: re.Match) -> str:
    return m.group(0).encode("unicode_escape").decode("ascii")


def printable(text: str) -> str:
    """Control and bidi characters (an escape sequence, a carriage return, a right-to-left override) shown
    escaped, e.g. ``\\x1b``, ``\\u202e``; newlines and tabs kept."""
    return _CONTROL.sub(_escaped, text)


def one_line(text: object) -> str:
    """A table cell or a name as shown: every control and bidi character escaped, newlines too, so that no
    text starts a line of its own (a forged ``::error`` workflow command)."""
    return _CONTROL_OR_NEWLINE.sub(_escaped, str(text))


def show_bidi(text: str) -> str:
    """``text`` with its bidi controls shown escaped (``\\u202e``), everything else as it is (HTML)."""
    return re.sub(f"[{_BIDI}]", _escaped, text)


def json_bidi(text: str) -> str:
    """A JSON text with its bidi controls written as ``\\u202e`` escapes: the same data, shown in order."""
    return re.sub(f"[{_BIDI}]", lambda m: f"\\u{ord(m.group(0)):04x}", text)


def csv_cell(value: object) -> object:
    """A CSV cell: text on one line, and text that a spreadsheet would run as a formula (``= + - @``, a tab
    or CR first) neutralised with a leading ``'``; numbers as they are."""
    if not isinstance(value, str):
        return value
    text = one_line(value)
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") or value[:1] in ("\t", "\r") else text


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
    return one_line(re.sub(r"[\r\n]+", " ", t))


MAX_FILE_PART = 80  # characters of a name that go into a file name (NAME_MAX is 255 bytes)


def file_part(name: str) -> str:
    """A name as part of a file name: letters, digits, ``_.-`` only; a long name is cut and keeps a hash of
    the whole, so that two long names never share a file."""
    import hashlib

    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    if len(safe) <= MAX_FILE_PART:
        return safe
    return safe[: MAX_FILE_PART - 11] + "-" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:10]
