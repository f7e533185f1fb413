"""The OpenAI wire format, read once for the HTTP backend (``ipw.backends.openai_http``) and the proxy
(``ipw.serve``): server-sent events, a choice's text, token counts and usage, llama-server's timings, log
probabilities, and a request's total deadline.  Standard library only.

An answer, streamed or whole, is read into an :class:`Answer` chunk by chunk (``take``); its
:class:`~ipw.backends.base.Completion` comes from what it saw (``completion``)."""

from __future__ import annotations

import http.client
import math
import re
import socket
import threading
import time
from typing import Any, Callable, Iterator, cast

from ipw.backends.base import Completion, QueryError, ServerTimings

MAX_LINE_BYTES = 1024 * 1024  # one event of a stream (its lines), at most
#: at most this much of a stream is read at once (a read returns what has come, up to the end of its current
#: HTTP chunk: usually one event)
READ_BYTES = 1 << 16
#: the most tokens one answer is taken to have: a count above it (or not a whole number) is not believed
MAX_TOKEN_COUNT = 10**8


def token_count(value: Any) -> int | None:
    """A token count from an answer's ``usage``: a whole number from 0 to ``MAX_TOKEN_COUNT``, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_TOKEN_COUNT:
        return None
    return int(value) if float(value).is_integer() else None


def server_timings(data: Any) -> ServerTimings | None:
    """llama-server's ``timings`` object (prompt_n, prompt_ms, predicted_n, predicted_ms); None when
    absent or incomplete."""
    if not isinstance(data, dict):
        return None
    try:
        values = [data[k] for k in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms")]
    except KeyError:
        return None
    counts = [token_count(values[0]), token_count(values[2])]
    times = [values[1], values[3]]
    if None in counts or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e9
                             for v in times):
        return None
    return ServerTimings(prompt_n=cast(int, counts[0]), prompt_ms=float(times[0]),
                         predicted_n=cast(int, counts[1]), predicted_ms=float(times[1]))


def choice_text(choice: Any, api: str) -> str:
    """The text of one choice of a chat (``delta`` or ``message``) or completions answer; "" where the
    answer does not have the shape (a choice, delta or message that is not an object, text that is not a
    string)."""
    if not isinstance(choice, dict):
        return ""
    if api == "chat":
        part = choice.get("delta") or choice.get("message")
        text = part.get("content") if isinstance(part, dict) else None
    else:
        text = choice.get("text")
    return text if isinstance(text, str) else ""


def token_logprobs(data: Any) -> list[float]:
    """The output tokens' log-probabilities in one choice's ``logprobs``: the chat API's (and llama-server's)
    ``{"content": [{"logprob": x}, ...]}`` or the completions API's ``{"token_logprobs": [x, ...]}``;
    values that are not finite numbers <= 0 are left out (a rounding's 1e-6 above 0 is read as 0), and so is
    anything of another shape."""
    if not isinstance(data, dict):
        return []
    items, plain = data.get("content"), data.get("token_logprobs")
    values: list[Any] = ([item.get("logprob") for item in items if isinstance(item, dict)] if isinstance(items, list)
                         else plain if isinstance(plain, list) else [])
    return [min(float(v), 0.0) for v in values
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v <= 1e-6]


class Answer:
    """What was seen of one answer, chunk by chunk (a stream's) or at once (a JSON body's): its text pieces,
    usage, llama-server's timings, finish reason and, with ``logprobs``, its tokens' log-probabilities."""

    def __init__(self, api: str, logprobs: bool = False) -> None:
        self.api, self.logprobs = api, logprobs
        self.parts: list[str] = []
        self.usage: dict[str, Any] = {}
        self.timings: Any = None
        self.finish = ""
        self.token_logprobs: list[float] = []

    def take(self, data: dict[str, Any]) -> int:
        """Note one chunk (or a whole answer); how many of its choices carried output text."""
        if isinstance(data.get("usage"), dict) and data["usage"]:
            self.usage = data["usage"]
        self.timings = data.get("timings") or self.timings  # llama-server: in the last chunk (or each, if asked)
        pieces = 0
        choices = data.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict):
                continue
            piece = choice_text(choice, self.api)
            if piece:
                self.parts.append(piece)
                pieces += 1
            if self.logprobs:
                self.token_logprobs += token_logprobs(choice.get("logprobs"))
            reason = choice.get("finish_reason")
            self.finish = reason if isinstance(reason, str) and reason else self.finish
        return pieces

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def completion(self, start: float, end: float, times: tuple[float, ...], text: str | None = None) -> Completion:
        """The answer as a completion: ``times`` its tokens' (one per content chunk where the usage gives no
        count), ``text`` what the caller keeps of it (default: all of it)."""
        prompt, output = token_count(self.usage.get("prompt_tokens")), token_count(self.usage.get("completion_tokens"))
        logprobs = self.token_logprobs
        return Completion(
            text=self.text if text is None else text, prompt_tokens=prompt or 0,
            completion_tokens=len(times) if output is None else output, start_s=start,
            first_token_s=times[0] if times else None, end_s=end, token_times_s=times,
            finish_reason=self.finish, server_timings=server_timings(self.timings),
            mean_logprob=sum(logprobs) / len(logprobs) if logprobs else None)


_BLANK_LINES = re.compile(rb"(?:[ \t\r\x0b\x0c]*\n)*")  # lines that are empty once stripped
_EVENT_END = re.compile(rb"\n[ \t\r\x0b\x0c]*\n")  # a line's end, then an empty line


def sse_events(read: Callable[[], bytes], limit: int | None = None, tail: bool = False) -> Iterator[bytes]:
    """The events of a server-sent event stream, each as its lines (their line ends kept) without the
    empty line that ends it; ``read`` gives the stream's next bytes, b"" at its end.  A last event that no
    empty line ended is dropped, or with ``tail`` given as it is.  One search per event, not one ``readline``
    per line, and each byte is searched about once: a read resumes at the last line end already seen.  An
    event not ended within ``limit`` bytes (default ``MAX_LINE_BYTES``) is a malformed stream
    (``QueryError``), so that an endless line holds neither memory nor a core."""
    limit = MAX_LINE_BYTES if limit is None else limit
    buf = b""
    seen = 0  # where a search resumes: no event ends before the last line end of the bytes searched so far
    while True:
        data = read()
        if not data:
            if tail and buf.strip():
                yield buf
            return
        buf += data
        at = 0
        while True:
            at = cast(re.Match[bytes], _BLANK_LINES.match(buf, at)).end()  # empty lines between events
            end = _EVENT_END.search(buf, max(at, seen))
            if end is None:
                break
            yield buf[at:end.start() + 1]
            at = end.end()
        buf = buf[at:]
        if len(buf) > limit:
            raise QueryError(f"a stream event longer than {limit} bytes", "malformed_stream")
        last = buf.rfind(b"\n")
        seen = last if last >= 0 else len(buf)


def event_data(event: bytes) -> bytes:
    """An event's data: its ``data:`` lines' values, joined by line ends (the SSE rule)."""
    return b"\n".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))


class Deadline:
    """A request's total deadline: at ``deadline`` (monotonic seconds) the socket is shut down, so that a
    server that trickles a byte now and then (each one resetting the read timeout) cannot hold a query
    past it, whether it is sending headers, a stream or a body.  ``expired`` says it fired."""

    def __init__(self, conn: http.client.HTTPConnection, deadline: float) -> None:
        self.expired = False
        self._sock = conn.sock
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._cut)
        self._timer.daemon = True
        self._timer.start()

    def _cut(self) -> None:
        self.expired = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed

    def cancel(self) -> None:
        self._timer.cancel()
