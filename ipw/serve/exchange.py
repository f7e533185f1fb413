"""One metered exchange of ``ipw serve``: a request forwarded upstream while the meter times it, its answer
relayed to the client (a stream event by event, or one body) with its energy in ``usage.energy``, and its
record made."""

from __future__ import annotations

import http.client
import json
import time
from typing import Any, cast

from ipw.backends.base import Completion, QueryError
from ipw.backends.openai_wire import READ_BYTES, Answer, event_data, server_timings, sse_events
from ipw.results import QueryRecord
from ipw.sanitize import scrub
from ipw.serve.clients import ClientGone
from ipw.serve.options import MAX_ERROR_BODY, MAX_RESPONSE_BODY
from ipw.serve.request import Ended, energy_object, prompt_digest
from ipw.serve.shell import Connection


class Exchange(Connection):
    """``Connection`` with the metered relay of one request (``_metered``)."""

    def _metered(self, api: str, path: str, body: dict[str, Any]) -> None:
        session = self.server.session
        self._route = session.pick(body)  # with --route: local or cloud; "" without
        stream = bool(body.get("stream"))
        asked_usage = False
        if stream:  # ask for usage always: exact token counts, and the chunk that carries the energy
            options = body.get("stream_options")
            options = options if isinstance(options, dict) else {}
            asked_usage = bool(options.get("include_usage"))
            body = {**body, "stream_options": {**options, "include_usage": True}}
            if session.llama_timings:  # llama-server: each chunk says how long the prompt took (the split's prefill)
                body.setdefault("timings_per_token", True)
        payload = json.dumps(body).encode()
        seen = Answer(api)
        job = session.meter.start()
        start = session.meter.started_s_of(job)
        error: QueryError | None = None
        # the request once it has ended; the record its answer carries (provisional, or with --energy-wait
        # settled), if any
        self._ended: Ended | None = None
        self._record: QueryRecord | None = None
        self._settled: QueryRecord | None = None
        try:
            try:
                conn, resp = self.open_upstream("POST", path, payload, stream,
                                                deadline=start + session.options.timeout_s)
            except (OSError, http.client.HTTPException) as exc:
                self._drop_upstream()
                error = QueryError(f"upstream {session.upstream.url}: {type(exc).__name__}: {scrub(str(exc))}",
                                   "connection")
                self._end(job, body, api, None, error)
                return self._error(502, str(error), "upstream_unreachable")
            if resp.status != 200:
                raw = resp.read(MAX_ERROR_BODY + 1)
                detail = session.hide_key(raw[:MAX_ERROR_BODY], cut=len(raw) > MAX_ERROR_BODY)  # an echoed key goes no further
                category = "http_429" if resp.status == 429 else "http_5xx" if resp.status >= 500 else "http_4xx"
                shown = (detail.decode("utf-8", errors="replace")[:300].strip() if session.options.log_prompts
                         else f"a body of {len(detail)} bytes (kept with --log-prompts: it may echo the prompt)")
                self._end(job, body, api, None, QueryError(f"HTTP {resp.status} from {session.upstream.url}: {shown}",
                                                           category))
                return self._send(resp.status, detail, resp.getheader("Content-Type"))  # passed through
            if "text/event-stream" in (resp.getheader("Content-Type") or ""):
                self._relay_stream(job, body, api, resp, seen, start, asked_usage)
            else:
                self._relay_json(job, body, api, resp, seen, start)
        except (ClientGone, BrokenPipeError, ConnectionResetError) as exc:
            self._drop_upstream()  # the server sees its connection close and stops generating
            error = QueryError(f"the client disconnected mid-answer ({type(exc).__name__}); the upstream request "
                               "was cancelled", "client_disconnect")
            self.close_connection = True
        except (OSError, http.client.HTTPException) as exc:  # the upstream failed or ran past --timeout-s
            self._drop_upstream()
            timeout = isinstance(exc, TimeoutError) or self._deadline is not None and self._deadline.expired
            error = QueryError(f"upstream {session.upstream.url} failed mid-answer: {type(exc).__name__}"
                               + (f" (--timeout-s {session.options.timeout_s:g})" if timeout else ""),
                               "timeout" if timeout else "connection")
            self.close_connection = True
        except QueryError as exc:  # the stream broke a limit (an event too long)
            self._drop_upstream()
            error = exc
            self.close_connection = True
        except Exception as exc:  # an answer of a shape nothing above expected: the request ends as an error
            self._drop_upstream()
            error = QueryError(f"upstream {session.upstream.url}: malformed answer ({type(exc).__name__}: "
                               f"{scrub(str(exc))[:120]})", "malformed_stream")
            self.close_connection = True
        finally:
            self._finish_upstream()
            if self._ended is None:  # ended by an error before the answer was complete: never left open in the meter
                try:
                    partial = (seen.completion(start, time.monotonic(), session.meter.token_times(job))
                               if seen.parts else None)
                except Exception:  # what was seen cannot be read: the request ends without it
                    partial = None
                self._end(job, body, api, partial, error or QueryError("no answer", "connection"))
            ended = cast(Ended, self._ended)
            if error is not None and error.category == "client_disconnect":
                ended.override = error
            if self._settled is None:  # settled on the meter's thread, and written, after the answer
                session.settle(job, ended, self._record)
            else:  # --energy-wait: settled before the answer; written after it (the client never waits for the disk)
                session.keep(self._settled, ended.override, ended.request_id)

    def _end(self, job: int, body: dict[str, Any], api: str, completion: Completion | None,
             error: Exception | None) -> QueryRecord | None:
        """The request ended now: cut its window; with the energy in the response, its record now: provisional
        (the default), or settled (``--energy-wait``: waits for the sensors and the split)."""
        session = self.server.session
        window = session.meter.end(job, completion)
        self._ended = Ended(body, api, session.next_repeat(prompt_digest(body)[0]), completion, error, window,
                            route=self._route)
        if session.options.energy_in_response:
            if session.options.energy_wait:
                self._settled = self._record = session.settle(job, self._ended, None, wait=True)
            else:
                self._record = session.provisional(job, self._ended)
        session.answered(job, self._ended, self._record, settled=self._settled is not None)  # on disk before the answer
        return self._record

    def _relay_json(self, job: int, body: dict[str, Any], api: str, resp: Any, seen: Answer, start: float) -> None:
        raw = resp.read(MAX_RESPONSE_BODY)
        end = time.monotonic()
        self._finish_upstream()  # idle again before the client has its answer (as for a stream)
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        record = None
        if isinstance(data, dict):
            seen.take(data)
            record = self._end(job, body, api, seen.completion(start, end, (end,) if seen.parts else ()), None)
        else:
            self._end(job, body, api, None, QueryError("upstream answer is not JSON", "malformed_stream"))
        if record is None:  # passed through as it came
            return self._send(200, raw, resp.getheader("Content-Type"))
        data["usage"] = {**(data.get("usage") if isinstance(data.get("usage"), dict) else {}),
                         "energy": self._energy(record)}
        self._json(200, data, {"x-ipw-energy-j": "" if record.energy_j is None else f"{record.energy_j:.6g}",
                               "x-ipw-energy-quality": record.energy_quality,
                               **({"x-ipw-route": record.backend} if self.server.session.router is not None else {})})

    def _relay_stream(self, job: int, body: dict[str, Any], api: str, resp: Any, seen: Answer,
                      start: float, asked_usage: bool) -> None:
        session = self.server.session
        meter = session.meter
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        ended = False
        last: dict[str, Any] = {}
        prefilled = False

        def read() -> bytes:  # what has come of the stream (of its current HTTP chunk), b"" at its end
            data = resp.read1(READ_BYTES)
            if self._deadline is not None and self._deadline.expired:  # it shut the socket: the read ended
                raise TimeoutError(f"no [DONE] within --timeout-s {session.options.timeout_s:g}")
            return cast(bytes, data)

        for event in sse_events(read):
            data = event_data(event)
            if data == b"[DONE]":
                if not ended:  # no usage chunk came: the energy goes in a last chunk of its own
                    ended, record = True, self.end_stream(job, body, api, seen, start)
                    if record is not None:
                        self.send_chunk(b"data: " + json.dumps(self._usage_chunk(last, record)).encode() + b"\n\n")
                self.send_chunk(event + b"\n")
                break
            try:
                chunk = json.loads(data) if data else None
            except ValueError:
                chunk = None
            if not isinstance(chunk, dict):
                self.send_chunk(event + b"\n")
                continue
            last = chunk
            if isinstance(chunk.get("usage"), dict) and not chunk.get("choices"):
                # the usage chunk (choices: []), which ipw asked for: the request's end; its energy goes in
                # it, and the client gets it whether it asked for usage or not (then as the last event)
                if not ended:
                    seen.take(chunk)
                    ended, record = True, self.end_stream(job, body, api, seen, start)
                    if record is not None:
                        chunk["usage"] = {**chunk["usage"], "energy": self._energy(record)}
                        self.send_chunk(b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n")
                    elif asked_usage:
                        self.send_chunk(event + b"\n")
                continue
            if seen.take(chunk):
                meter.token(job)
                if not prefilled and seen.timings:  # llama-server with timings_per_token: known at the first token
                    timings = server_timings(seen.timings)
                    if timings is not None:
                        meter.prefill(job, timings.prompt_ms, timings.prompt_n)
                        prefilled = True
            self.send_chunk(event + b"\n")
        if not ended:  # the stream ended without [DONE]
            record = self.end_stream(job, body, api, seen, start,
                                     None if seen.finish else QueryError("stream ended before [DONE]", "connection"))
            if record is not None:
                self.send_chunk(b"data: " + json.dumps(self._usage_chunk(last, record)).encode() + b"\n\n")
        if not resp.isclosed():  # ended at [DONE]
            self._drain_upstream(resp)
        # the upstream connection is idle again before the client's answer ends, so that the client's next
        # request finds it (else a kept-alive client could race the release and open a second one)
        self._finish_upstream()
        self.send_chunk(b"")  # the end of the chunked body

    def end_stream(self, job: int, body: dict[str, Any], api: str, seen: Answer, start: float,
                   error: Exception | None = None) -> QueryRecord | None:
        """A streamed answer is over (its usage event came, or the stream ended): its completion, from what the
        stream showed, and its record.  Public: bench/serving/serve_timeline.py times a request from here."""
        completion = seen.completion(start, time.monotonic(), self.server.session.meter.token_times(job))
        if error is None and not completion.text.strip():
            error = QueryError(f"empty answer (finish_reason={seen.finish or 'none'})", "empty_answer")
        return self._end(job, body, api, completion, error)

    def _energy(self, record: QueryRecord) -> dict[str, Any]:
        """The answer's ``usage.energy``: provisional unless it waited for the settled value."""
        out = energy_object(record, cast(Ended, self._ended).request_id, provisional=self._settled is None)
        if self.server.session.router is not None:  # --route: where this request went
            out["route"] = {"to": record.role, "backend": record.backend}
        return out

    def _usage_chunk(self, last: dict[str, Any], record: QueryRecord) -> dict[str, Any]:
        """A chunk as a server sends for ``stream_options.include_usage``: no choices, and usage (with
        the request's energy)."""
        return {"id": last.get("id", f"ipw-{cast(Ended, self._ended).request_id}"), "object": last.get("object", "chat.completion.chunk"),
                "created": last.get("created", int(time.time())), "model": last.get("model", ""), "choices": [],
                "usage": {"prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens,
                          "total_tokens": record.prompt_tokens + record.completion_tokens,
                          "energy": self._energy(record)}}


