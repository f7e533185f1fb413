"""A small OpenAI-compatible stub on 127.0.0.1 for tests that need a backend that answers at once.

Every answer is ``ANSWER``, streamed as SSE.  ``modes`` is a list of actions for the next POSTs
(then ``ok``): ``500:N`` answers HTTP 500 with a body that echoes the request's headers after N
filler characters (``500:N+M``: and M more after them; ``500s:N``: N spaces), ``401text:TEXT`` answers HTTP 401 with an error message TEXT,
``400echo`` answers HTTP 400 with the request body in its message, ``badchunk`` sends a stream chunk that is not JSON and echoes the headers in it,
``errchunk`` an ``{"error": ...}`` chunk holding the headers, ``json`` one JSON body instead of a stream.
``required_key`` makes ``GET /models`` answer 401 unless the Authorization header carries that key.

``llama_server = True`` streams exactly as llama.cpp's ``llama-server`` does (the chunk shapes were
recorded from the real binary, llama.cpp 0c1e570): a chat stream opens with a role chunk whose
content is null; ``usage`` and the server's own ``timings`` come in the last chunk before ``[DONE]``:
with ``stream_options.include_usage``, for the chat API, an extra chunk with ``"choices": []``,
``usage`` and ``timings``; without it, ``timings`` on the finish chunk; for the completions API, always
``usage`` and ``timings`` on the finish chunk.  A JSON body carries ``timings`` at the top level.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ANSWER = "42"
# what the llama-server flavor reports for every answer (prompt_n as in usage: no prompt cache)
TIMINGS = {"cache_n": 0, "prompt_n": 31, "prompt_ms": 12.5, "prompt_per_token_ms": 0.403, "prompt_per_second": 2480.0,
           "predicted_n": 1, "predicted_ms": 0.001, "predicted_per_token_ms": 0.0, "predicted_per_second": 0.0}


def llama_server_events(chat: bool, include_usage: bool, text: str = ANSWER) -> list[dict]:
    """The chunks llama-server streams for a one-token answer (without the final ``[DONE]``)."""
    meta = {"created": 1796139499, "id": "chatcmpl-stub", "model": "stub", "system_fingerprint": "b1-0c1e570",
            "object": "chat.completion.chunk" if chat else "text_completion"}
    usage = {"completion_tokens": TIMINGS["predicted_n"], "prompt_tokens": TIMINGS["prompt_n"],
             "total_tokens": TIMINGS["predicted_n"] + TIMINGS["prompt_n"],
             "prompt_tokens_details": {"cached_tokens": 0}}
    if not chat:
        return [{"choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}], **meta},
                {"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}], **meta,
                 "usage": usage, "timings": TIMINGS}]
    role = {"role": "assistant", "content": None}
    events = [{"choices": [{"finish_reason": None, "index": 0, "delta": role}], **meta},
              {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": text}}], **meta},
              {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], **meta}]
    if include_usage:
        events.append({"choices": [], **meta, "usage": usage})
    events[-1]["timings"] = TIMINGS
    return events


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A client that closed a kept-alive connection (a finished run's pool, collected later) is no error;
        printed, it lands in the stderr of whatever command a test is capturing then."""
        import sys

        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)


class Stub:
    def __init__(self) -> None:
        self.modes: list[str] = []
        self.required_key: str | None = None
        self.auth_seen: list[str | None] = []
        self.bodies: list[dict] = []  # the JSON body of every completion request
        self.paths: list[str] = []  # the path (and query string) of every completion request
        self.llama_server = False  # stream as llama-server does (usage and timings in the last chunk)
        self.delay_s = 0.0  # seconds before every completion answer
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                ok = not stub.required_key or self.headers.get("Authorization") == f"Bearer {stub.required_key}"
                self._send(200 if ok else 401, json.dumps({"object": "list", "data": [{"id": "stub"}]}).encode())

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    parsed = json.loads(body)
                except ValueError:
                    parsed = {}
                if stub.delay_s:
                    import time

                    time.sleep(stub.delay_s)
                with stub.lock:
                    stub.bodies.append(parsed)
                    stub.paths.append(self.path)
                    stub.auth_seen.append(self.headers.get("Authorization"))
                    mode = stub.modes.pop(0) if stub.modes else "ok"
                # the Authorization header first, so that the key falls inside what an error message keeps
                items = sorted(self.headers.items(), key=lambda kv: kv[0].lower() != "authorization")
                echoed = "".join(f"{k}: {v}\r\n" for k, v in items)
                if mode.startswith("500s:"):  # filler of spaces, then the echo (a strip moves what is cut)
                    self._send(500, (" " * int(mode[5:]) + "you sent " + echoed).encode(), "text/plain")
                    return
                if mode.startswith("500"):  # 500:N+M: N filler characters, the echo, then M more
                    filler, _, tail = (mode.split(":")[1] if ":" in mode else "0").partition("+")
                    body = "x" * int(filler) + "you sent " + echoed + "y" * int(tail or 0)
                    self._send(500, body.encode(), "text/plain")
                    return
                if mode == "400echo":  # an error that echoes the request body (the prompt among it)
                    self._send(400, json.dumps({"error": {"message": "invalid request: " + body.decode()}}).encode())
                    return
                if mode.startswith("401text:"):  # an error body of the given text (an API's "incorrect key")
                    self._send(401, json.dumps({"error": {"message": mode[8:]}}).encode())
                    return
                chat = self.path.endswith("/chat/completions")
                if mode == "json":
                    choice = {"message": {"role": "assistant", "content": ANSWER}} if chat else {"text": ANSWER}
                    data = {"choices": [{"index": 0, "finish_reason": "length", **choice}],
                            "usage": {"prompt_tokens": TIMINGS["prompt_n"],
                                      "completion_tokens": TIMINGS["predicted_n"]}}
                    if stub.llama_server:
                        data["timings"] = TIMINGS
                    self._send(200, json.dumps(data).encode())
                    return
                events = []
                if mode == "badchunk":
                    events.append(echoed.replace("\r\n", " | "))
                elif mode == "errchunk":
                    events.append(json.dumps({"error": {"message": echoed}}))
                elif stub.llama_server:
                    options = (parsed.get("stream_options") if isinstance(parsed, dict) else None) or {}
                    include_usage = bool(options.get("include_usage"))
                    events += [json.dumps(e) for e in llama_server_events(chat, include_usage)] + ["[DONE]"]
                else:
                    events += [json.dumps({"choices": [{"index": 0, "delta": {"content": ANSWER}, "finish_reason": None}]}),
                               json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
                               json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}),
                               "[DONE]"]
                self._send(200, "".join(f"data: {e}\n\n" for e in events).encode(), "text/event-stream")

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def stub_config(path, dataset, base_url: str, *, out_dir, extra: str = "", backend_extra: str = "") -> "object":
    """A run config of one ``openai`` backend at ``base_url``: no warm-up, no idle baseline, no retries."""
    path.write_text(f'dataset = "{dataset}"\nout_dir = "{out_dir}"\nwarmup = 0\nidle_s = 0\n{extra}\n'
                    '[generation]\nmax_tokens = 4\n'
                    '[[backends]]\nname = "stub"\nkind = "openai"\nmodel = "stub"\n'
                    f'base_url = "{base_url}"\nmax_retries = 0\ntimeout_s = 10\n{backend_extra}')
    return path
