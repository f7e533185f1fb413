"""Any OpenAI-compatible HTTP endpoint (chat and completions APIs), streamed, with the standard library.

- Streaming (SSE) gives the time of the first token (TTFT) and of every content chunk.  Token usage
  comes from the response (``stream_options.include_usage``); when the server sends none (llama.cpp's
  server does not while streaming) completion tokens are counted as content chunks, and prompt tokens
  are counted with the model's own tokenizer and chat template for a managed llama.cpp server
  (``PromptTokenCounter``), else 0 (unknown).
- Every generation setting is sent explicitly (llama.cpp's server would otherwise apply
  ``repeat_penalty`` 1.1); ``top_k`` and ``repeat_penalty`` are not part of OpenAI's own API, so
  ``sampling_extensions = false`` leaves them out for endpoints that reject them.
- 429, 5xx and connection errors are retried with exponential backoff (``Retry-After`` honored);
  a query that still fails raises :class:`QueryError` with a category, which the runner turns into
  an error record.
- The API key is read from the environment variable named by ``api_key_env`` and only ever sent in
  the ``Authorization`` header; the manifest records the variable's name, never its value.
- ``server = "llama-cpp"``, ``"llama-server"`` or ``"vllm"`` starts a managed local server
  (``ipw.backends.servers``) serving ``model`` (vLLM: a Hugging Face folder, or a GGUF converted once;
  ``repeat_penalty`` is sent under vLLM's name ``repetition_penalty``); the machine's own sensors then
  measure it through the server's PID tree.  llama-server gets as many slots as the highest
  ``concurrency`` level (an int or a list of ints), sends usage while streaming, and its own
  per-request ``timings`` (in the last chunk) become ``Completion.server_timings``.  A remote
  endpoint (host not loopback) is not measured: its energy is estimated (``estimate.api``).
"""

from __future__ import annotations

import dataclasses
import http.client
import ipaddress
import json
import tempfile
import time
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import psutil

from ipw.backends.base import FEW_SHOT_STOP, BackendBase, BackendSpec, Completion, GenerationSettings, QueryError, few_shot_prompt
from ipw.backends.openai_wire import READ_BYTES, Answer, Deadline, sse_events
from ipw.backends.servers import VLLM_OPTIONS, VllmSettings
from ipw.errors import IpwError
from ipw.sanitize import read_key, redact_url, scrub

APIS = ("chat", "completions")
MAX_BODY_BYTES = 16 * 1024 * 1024  # a completion sent as one JSON body
MAX_ERROR_BYTES = 64 * 1024  # what is kept of an error body (scrubbed, then cut to a message)
_MODE_TO_API = {"chat": "chat", "completion": "completions"}


#: the most requests a level keeps in flight (a thread each)
MAX_CONCURRENCY = 10_000


def concurrency_levels(value: Any, backend: str = "openai", where: str | None = None) -> tuple[int, ...]:
    """The concurrency levels of ``value`` (an int, or a list of ints: the levels a run sweeps), each
    >= 1, sorted, without repeats; ``where`` names the source in an error (default: the backend's field)."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    where = where or f"backend {backend!r}: field 'concurrency'"
    if not items:
        raise IpwError(f"{where}: give at least one level (an integer >= 1 or a list of them)")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= MAX_CONCURRENCY:
            raise IpwError(f"{where}: each level must be an integer from 1 to {MAX_CONCURRENCY}, got {item!r}")
    return tuple(sorted(set(items)))


def _read_bounded(resp: Any, limit: int) -> tuple[bytes, bool]:
    """At most ``limit`` bytes of a response body, and whether more was left unread."""
    data = resp.read(limit + 1)
    return data[:limit], len(data) > limit


class _Retryable(Exception):
    def __init__(self, message: str, category: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.category, self.retry_after_s = category, retry_after_s


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening_pids(port: int) -> list[int]:
    """PIDs of this user's processes listening on a TCP port (empty when not visible)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return []
    return sorted({c.pid for c in conns
                   if c.pid and c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port})


class OpenAIBackend(BackendBase):
    OPTIONS = {
        "base_url": str, "api_key_env": str, "model_name": str, "api": str, "timeout_s": float,
        "max_retries": int, "retry_backoff_s": float, "concurrency": (int, list),  # one level or the levels of a sweep
        "sampling_extensions": bool,
        "logprobs": bool,  # ask for each output token's log-probability (the answer's mean_logprob)
        "remote": bool, "energy_table": str,
        # managed local server
        "server": str, "n_threads": int, "n_ctx": int, "server_timeout_s": float,
        "n_gpu_layers": int,  # llama-server: layers offloaded (default: all with a GPU, else 0; negative: all)
        "python": str,  # the interpreter of a vLLM server (default: one with vllm, e.g. .venv-vllm/bin/python)
        **VLLM_OPTIONS,  # a vLLM server's engine settings (ipw.backends.servers.VllmSettings)
    }

    def __init__(self, spec: BackendSpec) -> None:
        from ipw.backends.servers import SERVER_KINDS

        self.spec = spec
        opts = spec.options
        name = f"backend {spec.name!r}"
        self.server_kind: str | None = opts.get("server")
        self.model_path: Path | None = None
        default_api = None
        if self.server_kind is not None:
            if self.server_kind not in SERVER_KINDS:
                raise IpwError(f"{name}: server must be one of {', '.join(SERVER_KINDS)}, got {self.server_kind!r}")
            if "base_url" in opts:
                raise IpwError(f"{name}: give either server (a managed local server) or base_url, not both")
            from ipw.backends.servers import server_model

            self.model_path, default_mode = server_model(self.server_kind, spec.model)
            default_api = _MODE_TO_API.get(default_mode or "")
        elif "base_url" not in opts:
            raise IpwError(f"{name}: kind 'openai' needs base_url (e.g. \"http://127.0.0.1:8000/v1\") "
                           "or server = \"llama-cpp\" / \"llama-server\" / \"vllm\"")
        if "n_gpu_layers" in opts and self.server_kind != "llama-server":
            raise IpwError(f"{name}: n_gpu_layers applies to server = \"llama-server\" only")
        engine_opts = sorted(set(VLLM_OPTIONS) & set(opts))
        if engine_opts and self.server_kind != "vllm":
            raise IpwError(f"{name}: {', '.join(engine_opts)} apply to server = \"vllm\" only")
        self.vllm = VllmSettings.of(opts, name)
        api = opts.get("api")
        if api is not None and api not in APIS:
            raise IpwError(f"{name}: api must be one of {', '.join(APIS)}, got {api!r}")
        mode_api = _MODE_TO_API.get(spec.mode or "")
        if api and mode_api and api != mode_api:
            raise IpwError(f"{name}: mode {spec.mode!r} contradicts api {api!r}")
        self.api = api or mode_api or default_api or "chat"
        self.timeout_s = float(opts.get("timeout_s", 120.0))
        self.max_retries = int(opts.get("max_retries", 3))
        self.retry_backoff_s = float(opts.get("retry_backoff_s", 0.5))
        # the levels a run may sweep; the runner sets self.concurrency to the level it runs
        self.levels = concurrency_levels(opts.get("concurrency", 1), spec.name)
        self.concurrency = self.levels[0]
        for key, value, low in (("timeout_s", self.timeout_s, 1e-9), ("max_retries", self.max_retries, 0),
                                ("retry_backoff_s", self.retry_backoff_s, 0)):
            if value < low:
                raise IpwError(f"{name}: {key} must be >= {low:g}, got {value}")
        self.extensions = bool(opts.get("sampling_extensions", True))
        self.logprobs = bool(opts.get("logprobs", False))
        if self.logprobs and self.server_kind == "llama-cpp":
            raise IpwError(f"{name}: logprobs: llama-cpp-python's server gives log-probabilities only for a model "
                           "loaded with logits_all, which slows every token; use server = \"llama-server\" (or "
                           "kind = \"llama-cpp\" in process)")
        self.model_name = opts.get("model_name") or (
            spec.model if self.server_kind is None or "/" not in spec.model else Path(spec.model).stem)
        self.server: Any = None
        self.run_dir: Path | None = None
        self.energy_estimate: Any = None
        self.sent_params: dict[str, Any] | None = None  # the last request's parameters (set by generate)
        # read and checked now, before the run folder exists: unset, empty or unsendable fails here
        env = opts.get("api_key_env")
        self._key: str | None = read_key(env, spec.name) if env else None
        self._local_pids: list[int] = []
        self._prompt_tokens: Any = None  # a PromptTokenCounter for a managed llama.cpp server
        self._set_url(opts.get("base_url", "http://127.0.0.1:0/v1"))
        self.remote = bool(opts.get("remote", self.server_kind is None and not is_loopback(self.host)))

    def _set_url(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise IpwError(f"backend {self.spec.name!r}: base_url must be http(s)://HOST[:PORT]/PATH, got "
                           f"{redact_url(base_url)!r}")
        if parts.username is not None or parts.password is not None:
            raise IpwError(f"backend {self.spec.name!r}: base_url holds a user name or password "
                           f"({redact_url(base_url)!r}); ipw sends no credentials in a URL: put the key in an "
                           "environment variable and name it with api_key_env")
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        # a query string is sent with every request (Azure's api-version=...); the manifest shows it with
        # secret-looking values redacted (describe's base_url_query)
        self.query = f"?{parts.query}" if parts.query else ""
        self.base_url = f"{self.scheme}://{self.host}:{self.port}{self.prefix}"

    # -- lifecycle ------------------------------------------------------------------------------

    def preflight(self) -> None:
        """Before the run folder exists: a managed llama-server must be there to start, and an endpoint
        that is already up must accept the key (a 401 leaves no failed run folder behind)."""
        if self.server_kind is None:
            self._check_auth()
        if self.server_kind == "llama-server":
            from ipw.backends.servers import find_llama_server

            find_llama_server()

    def attach(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)

    def load(self) -> None:
        if self.server_kind is not None:
            from ipw.backends.servers import start_server

            assert self.model_path is not None  # set with server_kind (__init__)

            log_dir = self.run_dir or Path(tempfile.mkdtemp(prefix="ipw-server-"))
            from ipw.sanitize import file_part

            safe = file_part(self.spec.name)
            opts = self.spec.options
            self.server = start_server(
                self.server_kind, self.model_path, log_dir / f"server-{safe}.log",
                n_threads=opts.get("n_threads"), n_ctx=opts.get("n_ctx", 4096), alias=self.model_name,
                timeout_s=opts.get("server_timeout_s", 180.0), python=opts.get("python"),
                parallel=max(self.levels), n_gpu_layers=opts.get("n_gpu_layers"), vllm=self.vllm)
            self._set_url(self.server.base_url)
            if self.server_kind == "llama-cpp":
                from ipw.backends.llama_cpp import PromptTokenCounter

                self._prompt_tokens = PromptTokenCounter(self.model_path, self.spec.name, opts.get("chat_template"))
        try:
            if self.remote:
                from ipw.telemetry.api_estimate import ApiEnergyEstimate

                self.energy_estimate = ApiEnergyEstimate.load(self.spec.options.get("energy_table"))
            elif self.server is None:
                self._local_pids = listening_pids(self.port)
            self._check_auth()
        except BaseException:
            self.close()  # the runner only closes backends that loaded
            raise

    def _check_auth(self) -> None:
        """Fail before the run when the endpoint rejects the key; anything else shows up per query."""
        timeout_s = min(self.timeout_s, 30.0)
        conn = self._connection(timeout_s)
        cutter = None
        try:
            conn.connect()
            cutter = Deadline(conn, time.monotonic() + timeout_s)
            conn.request("GET", f"{self.prefix}/models{self.query}", headers=self._headers())
            status = conn.getresponse().status
        except (OSError, http.client.HTTPException):
            return
        finally:
            if cutter is not None:
                cutter.cancel()
            conn.close()
        if status in (401, 403):
            env = self.spec.options.get("api_key_env")
            raise IpwError(f"backend {self.spec.name!r}: {self.base_url} answered HTTP {status} (unauthorized); "
                           + (f"check the key in ${env}" if env else "set api_key_env to the variable holding the key"))

    def pids(self) -> list[int]:
        if self.server is not None:
            return [self.server.pid] if self.server.pid else []
        return list(self._local_pids)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self._prompt_tokens is not None:  # its tokenizer worker
            self._prompt_tokens.close()
            self._prompt_tokens = None

    # -- requests -------------------------------------------------------------------------------

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout_s)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream", "User-Agent": "ipw"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        return headers

    def _scrub(self, text: str) -> str:
        """Scrub before cutting a text short: a key cut in two is no longer found."""
        text = text.replace(self._key, "***") if self._key else text
        return scrub(text)

    def _error_detail(self, resp: Any) -> str:
        """An error body as a message may quote it: read up to MAX_ERROR_BYTES, scrubbed whole, then cut.
        A body longer than that loses its last characters too, as many as a key has: the read may have cut
        a key there, and a key's fragment is no longer recognised (sanitize.scrub_tail)."""
        from ipw.sanitize import scrub_tail

        raw, more = _read_bounded(resp, MAX_ERROR_BYTES)
        text = raw.decode("utf-8", errors="replace")
        if more:
            text = scrub_tail(text)
        return self._scrub(text).strip()[:300]

    def request_params(self, settings: GenerationSettings) -> dict[str, Any]:
        """The generation parameters sent with every request (recorded in the manifest)."""
        params: dict[str, Any] = {
            "model": self.model_name, "max_tokens": settings.max_tokens, "temperature": settings.temperature,
            "top_p": settings.top_p, "seed": settings.seed,
        }
        if self.extensions:  # vLLM's name for it is repetition_penalty (it ignores repeat_penalty)
            penalty = "repetition_penalty" if self.server_kind == "vllm" else "repeat_penalty"
            params.update({"top_k": settings.top_k, penalty: settings.repeat_penalty})
        stop = list(settings.stop) + (list(FEW_SHOT_STOP) if self.api == "completions" else [])
        if stop:
            params["stop"] = stop
        if self.logprobs:  # the chat API's flag (one top entry: llama-server sends 20 without it, none with 0);
            # the completions API's count of top entries
            params.update({"logprobs": True, "top_logprobs": 1} if self.api == "chat" else {"logprobs": 1})
        params.update(stream=True, stream_options={"include_usage": True})
        return params

    def generate(self, prompt: str, settings: GenerationSettings) -> Completion:
        body = self.request_params(settings)
        self.sent_params = dict(body)  # what the manifest records (no prompt, no key)
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = few_shot_prompt(prompt)
        payload = json.dumps(body).encode("utf-8")
        start = time.monotonic()
        attempt = 0
        while True:
            try:
                completion = self._attempt(payload, start, body.get("stop", []))
                if completion.prompt_tokens == 0 and self._prompt_tokens is not None:
                    n = self._prompt_tokens.count(messages=body.get("messages"), prompt=body.get("prompt"))
                    completion = dataclasses.replace(completion, prompt_tokens=n)
                return completion
            except _Retryable as exc:
                self._stop_if_server_exited(exc.category)
                if attempt >= self.max_retries:
                    raise QueryError(f"{exc} (after {attempt + 1} attempts)", exc.category) from None
                delay = self.retry_backoff_s * 2 ** attempt
                if exc.retry_after_s is not None:
                    delay = max(delay, min(exc.retry_after_s, 60.0))
                time.sleep(delay)
                attempt += 1

    def _stop_if_server_exited(self, category: str) -> None:
        """A request to a managed server failed: if the server has exited, raise ``EngineStopped`` at once (no
        retries, no error record per query left: the runner stops this backend, the run ends ``failed``, and
        ``ipw run --resume`` retries its queries) with one line: how it exited, the root cause its log names
        and the log's path.  A connection refused or cut is waited on for up to a second (the process closes
        its sockets a moment before its exit can be seen); a 5xx or 429 is only looked at."""
        if self.server is None or not self.server.exited(1.0 if category == "connection" else 0.0):
            return
        from ipw.backends.worker import EngineStopped

        raise EngineStopped(f"backend {self.spec.name!r}: {self.server.failure('mid-run')}")

    def _attempt(self, payload: bytes, start: float, stops: list[str]) -> Completion:
        deadline = time.monotonic() + self.timeout_s
        path = f"{self.prefix}/{'chat/completions' if self.api == 'chat' else 'completions'}{self.query}"
        conn = self._connection(self.timeout_s)
        cutter: Deadline | None = None
        try:
            conn.connect()
            cutter = Deadline(conn, deadline)  # the total deadline; timeout_s is also each read's timeout
            conn.request("POST", path, body=payload, headers=self._headers())
            resp = conn.getresponse()
            if resp.status != 200:
                detail = self._error_detail(resp)
                message = f"HTTP {resp.status} from {self.base_url}: {detail}"
                if resp.status == 429:
                    raise _Retryable(message, "http_429", _retry_after(resp.getheader("Retry-After")))
                if resp.status >= 500:
                    raise _Retryable(message, "http_5xx")
                raise QueryError(message, "http_4xx")
            if "text/event-stream" in (resp.getheader("Content-Type") or ""):
                completion = self._read_stream(resp, start, deadline, stops)
            else:
                completion = self._read_json(resp, start, stops)
            if cutter.expired:  # the body ended because the deadline shut the socket
                raise TimeoutError
            return completion
        except (TimeoutError, QueryError, _Retryable, OSError, http.client.HTTPException) as exc:
            if isinstance(exc, TimeoutError) or cutter is not None and cutter.expired:
                raise QueryError(f"no complete answer from {self.base_url} within timeout_s={self.timeout_s:g} "
                                 "(the request's total deadline)", "timeout") from None
            if isinstance(exc, (QueryError, _Retryable)):
                raise
            raise _Retryable(f"connection to {self.base_url} failed: {type(exc).__name__}: "
                             f"{self._scrub(str(exc))}", "connection") from None
        finally:
            if cutter is not None:
                cutter.cancel()
            conn.close()

    def _read_stream(self, resp: Any, start: float, deadline: float, stops: list[str]) -> Completion:
        answer = Answer(self.api, self.logprobs)
        times: list[float] = []
        done = False
        for event in sse_events(lambda: cast(bytes, resp.read1(READ_BYTES)), tail=True):
            now = time.monotonic()
            if now > deadline:
                raise QueryError(f"stream from {self.base_url} exceeded timeout_s={self.timeout_s:g}", "timeout")
            for raw in event.splitlines():  # each data line is a chunk (a server that ends no event is read too)
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue  # comments (":"), event:/id: fields
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    raise QueryError(f"malformed stream chunk: {self._scrub(data)[:120]!r}", "malformed_stream") from None
                if not isinstance(chunk, dict) or "error" in chunk:
                    raise QueryError(f"error in stream: {self._scrub(str(chunk))[:200]}", "malformed_stream")
                if not isinstance(chunk.get("choices"), list) and not (chunk.get("usage") or chunk.get("timings")):
                    raise QueryError(f"stream chunk without choices: {self._scrub(data)[:120]!r}", "malformed_stream")
                times += [now] * answer.take(chunk)
            if done:
                break
        if not done and not answer.finish:
            # the connection closed mid-answer (e.g. the server died): retried like a connection error
            raise _Retryable("stream ended before [DONE] or a finish_reason", "connection")
        return self._completion(answer, start, times, stops)

    def _read_json(self, resp: Any, start: float, stops: list[str]) -> Completion:
        """A server that ignores ``stream`` and answers with one JSON body: TTFT is the end."""
        raw, more = _read_bounded(resp, MAX_BODY_BYTES)
        if more:
            raise QueryError(f"a response body longer than {MAX_BODY_BYTES} bytes", "malformed_stream")
        try:
            data = json.loads(raw)
            choice = data["choices"][0]
            if not isinstance(choice, dict):
                raise TypeError("a choice that is not an object")
        except (ValueError, KeyError, IndexError, TypeError):
            raise QueryError("response is neither an event stream nor a completion JSON", "malformed_stream") from None
        answer = Answer(self.api, self.logprobs)
        answer.take({**data, "choices": [choice]})
        return self._completion(answer, start, [time.monotonic()] if answer.parts else [], stops)

    def _completion(self, answer: Answer, start: float, times: list[float], stops: list[str]) -> Completion:
        text = answer.text
        cut = min((text.find(s) for s in stops if s and s in text), default=-1)
        if cut >= 0:
            text = text[:cut]
        if not text.strip():
            raise QueryError(f"empty answer (finish_reason={answer.finish or 'none'})", "empty_answer")
        return answer.completion(start, time.monotonic(), tuple(times), text=text.strip())

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "engine": "openai-http", "base_url": self.base_url, "model_name": self.model_name, "api": self.api,
            "base_url_query": redact_url(f"{self.base_url}{self.query}").partition("?")[2] or None,
            "remote": self.remote, "concurrency": self.concurrency, "concurrency_levels": list(self.levels),
            "timeout_s": self.timeout_s,
            "max_retries": self.max_retries, "retry_backoff_s": self.retry_backoff_s,
            "api_key_env": self.spec.options.get("api_key_env"), "api_key_sent": bool(self._key),
            "sampling_extensions": self.extensions, "logprobs": self.logprobs,
            "usage_source": "response usage when sent, else content chunks counted and prompt tokens "
                            + ("counted with the GGUF's tokenizer" if self._prompt_tokens is not None else "unknown (0)"),
            "request_params": self.sent_params,
        }
        if self.server is not None:
            out["server"] = {
                "kind": self.server_kind, "pid": self.server.pid, "port": self.server.port,
                "command": self.server.command, "log": str(self.server.log_path),
                "startup_s": round(self.server.startup_s or 0.0, 3),
                **self.server.info,  # engine, engine_version, model file or folder, model_bytes
            }
            if self.server.exit_code() is not None:  # it exited before ipw stopped it
                from ipw.backends.worker import exit_text

                out["server"]["exited"] = exit_text(self.server.exit_code())
        elif not self.remote:
            out["server_pids"] = self._local_pids
        return out


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None
