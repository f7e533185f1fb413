"""``ipw serve``: a measuring OpenAI-compatible proxy.  Clients (an app, an agent, a load generator)
talk to it as to any OpenAI endpoint; it forwards ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models`` to an upstream server, meters this machine's devices with the sensors of ``ipw run``
while requests are in flight, and hands each response its own energy (``usage.energy``), split from
overlapping requests' as under ``ipw run``'s concurrent load (``ipw.metering.meter.Meter``).  Every request
becomes a record of a run folder that ``compare``, ``report`` and ``check`` read.

Standard library only (``http.server`` threads, ``http.client`` upstream): a stream passes through
event by event, unbuffered; only its last usage event waits for the sensors to cover the request's end.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import hashlib
import hmac
import http.client
import io
import json
import re
import secrets
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator, cast
from urllib.parse import urlsplit

from ipw import __version__
from ipw.backends.base import BackendSpec, Completion, QueryError
from ipw.backends.openai_http import MAX_LINE_BYTES, Deadline, choice_text, server_timings, token_count
from ipw.datasets import Query
from ipw.errors import IpwError
from ipw.metering.meter import SWITCH_INTERVAL_S, Meter
from ipw.results import QueryRecord, RunFolder, RunManifest, new_run_id
from ipw.sanitize import read_key, redact_url, register, scrub, scrub_tail
from ipw.metering.window import IdleBaseline, Window, measure_idle
from ipw.telemetry.uncertainty import measurement_90

#: the paths a client may call (under /v1); the first two are metered
METERED = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
MODELS = "/v1/models"
ENERGY_PATH = "/v1/ipw/energy/"  # + a request id: its settled energy
MAX_ERROR_BODY = 1 << 20  # an upstream error body passed through, at most
MAX_RESPONSE_BODY = 64 << 20  # a non-streamed upstream answer, at most
MAX_IDLE_UPSTREAM = 256  # upstream connections kept alive for the next requests, at most
#: a client connection that sends nothing for this long is closed (an idle keep-alive connection, or one that
#: stalls mid-request), so that idle clients cannot hold the proxy's threads and descriptors for ever
CLIENT_IDLE_S = 60.0
#: a client's request, its head and body, must have come within this many seconds of its first byte: the idle
#: timeout is per read, so that a client that sends a byte now and then would otherwise hold a thread for ever
CLIENT_REQUEST_S = 60.0
#: out of file descriptors, the accept loop waits this long before it tries again (else it spins on a core)
ACCEPT_BACKOFF_S = 0.05
DRAIN_S = 1.0  # after [DONE], how long the rest of the upstream's body (its last chunk) is waited for
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


def routing_text(body: dict[str, Any]) -> str:
    """The text a router scores: a completion's prompt, or the contents of a chat's messages (text parts)."""
    if "messages" not in body:
        prompt = body.get("prompt", "")
        return prompt if isinstance(prompt, str) else ""
    parts = []
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [c["text"] for c in content if isinstance(c, dict) and isinstance(c.get("text"), str)]
    return "\n".join(parts)


def prompt_digest(body: dict[str, Any]) -> tuple[str, str]:
    """A request's query id (the first 16 hex digits of the SHA-256 of its prompt: the same prompt
    pairs across runs) and its prompt as text (chat: the messages as JSON)."""
    prompt = body.get("messages") if "messages" in body else body.get("prompt", "")
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()[:16], text


def _hashed(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def energy_object(record: QueryRecord, request_id: str, provisional: bool = False) -> dict[str, Any]:
    """``usage.energy`` of a response: its record's energy, labeled as the record is.  ``provisional``: the
    record holds the provisional energy given at the answer (``Meter.provisional``), whose ±90% band is
    ``uncertainty_j``; the settled value follows in the run folder and at ``settled_url`` (``request_id``: the
    request's random id, ``Ended.request_id``)."""
    out: dict[str, Any] = {
        "energy_j": record.energy_j, "net_energy_j": record.net_energy_j, "provisional": provisional,
        "quality": record.energy_quality, "source": record.energy_source, "scope": record.energy_scope,
    }
    if provisional:
        out["uncertainty_j"] = record.provisional_uncertainty_j  # ±90% around the settled value to come
    else:
        # the ± that the choice of split adds (|priced - local|); null when the request ran alone; the
        # sensors' own error is in measurement_uncertainty_j (±90%; docs/SERVING.md)
        out["uncertainty_j"] = record.split_uncertainty_j
        out["measurement_uncertainty_j"] = measurement_90(record.energy_j, record.energy_parts)
    out.update({"split_method": record.split_method or "none",
                "prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens,
                "duration_s": round(record.end_s - record.start_s, 6), "request_id": request_id,
                "settled_url": f"/v1/ipw/energy/{request_id}"})
    return out


#: settled energies kept for ``GET /v1/ipw/energy/{id}``, the newest
SETTLED_KEEP = 100_000


class Session:
    """The measuring side of a proxy: the meter, the run folder and the records (thread-safe).

    A request's record is made once its share is settled (``settle``: on the meter's thread, or on the
    request's with ``--energy-wait``) and written by a writer thread of its own (``RecordWriter``: one
    write and one fsync per batch, never on a request's path).  Before its answer leaves, a request's record is
    in the folder's pending.jsonl (``answered``: the provisional one, labelled so, or the settled one), so that a
    kill before the final record is written loses no request a client saw answered."""

    def __init__(self, folder: RunFolder, options: ServeOptions, upstream: Upstream, meter: Meter,
                 idle: IdleBaseline, estimate: Any = None, key: str | None = None, token: str | None = None,
                 notice: Callable[[str], None] = lambda line: None, llama_timings: bool = False,
                 router: Any = None, cloud: Upstream | None = None) -> None:
        from ipw.metering.record import RecordWriter, make_record  # imported now, not by the first request

        self.make_record = make_record
        self.folder, self.options, self.upstream = folder, options, upstream
        self.llama_timings = llama_timings  # the upstream is llama.cpp's server: ask for timings_per_token
        self.meter, self.idle, self.estimate = meter, idle, estimate
        self.key, self.token = key, token
        self.spec = BackendSpec(name=options.name, kind="serve", model=options.model or options.name, role=options.role)
        # --route: the router, the cloud upstream, each route's backend (records), and what each route served
        self.router, self.cloud = router, cloud
        self.specs = {"": self.spec}
        if router is not None:
            self.spec = self.specs["local"] = dataclasses.replace(self.spec, role="local")
            self.specs["cloud"] = BackendSpec(name=options.cloud_name, kind="serve", model=options.cloud_name,
                                              role="cloud")
        self.routes: dict[str, dict[str, float]] = {r: {"requests": 0, "energy_j": 0.0, "tokens": 0, "unknown": 0}
                                                    for r in ("local", "cloud")}
        self.unscored = 0  # requests the router could not score (sent to the cloud)
        if router is not None:
            router.probabilities("warm up")  # its imports and hashing set up now, not on the first request
        self.route_s = 0.0  # time spent routing (features and dot products), all requests
        self.notice = notice
        self._lock = threading.Lock()
        self.repeats: dict[str, int] = {}
        self.queries: set[str] = set()
        self.requests = self.errors = 0
        self.split_methods: dict[str, int] = {}
        self.energy_j = 0.0
        self.energy_quality: set[str] = set()
        self.settled: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self.pending: set[str] = set()  # request ids answered whose energy is not settled yet
        for row in folder.log_frame().to_dict("records"):  # a resumed folder
            self.repeats[row["query_id"]] = max(self.repeats.get(row["query_id"], 0), int(row["repeat"]) + 1)
            self.queries.add(row["query_id"])
        self.pending_log = folder.pending_log()
        self.writer = RecordWriter(folder, self._written)
        from ipw.export.prometheus import for_session  # None without the prometheus extra: /metrics says so

        self.metrics = for_session(self) if options.metrics else None
        from ipw.export import otel  # OTLP: None unless OTEL_EXPORTER_OTLP_ENDPOINT asks for it

        self.otel = otel.for_session(self)

    def pick(self, body: dict[str, Any]) -> str:
        """With --route: "local" or "cloud" for this request (a request the router cannot score: the cloud);
        without: ""."""
        if self.router is None:
            return ""
        t0 = time.perf_counter()
        try:
            text = routing_text(body)
            if not text:
                raise ValueError("no prompt text")
            to = "cloud" if self.router.route(text) == self.router.cloud else "local"
        except Exception:
            with self._lock:
                self.unscored += 1
            to = "cloud"
        with self._lock:
            self.route_s += time.perf_counter() - t0
        return to

    def upstream_of(self, route: str) -> Upstream:
        return self.cloud if route == "cloud" and self.cloud is not None else self.upstream

    def key_of(self, route: str) -> str | None:
        """The key sent to ``route``'s upstream: with --route, --api-key-env's key is the cloud's, and the local
        upstream gets none (each upstream only its own credential); without, the one upstream's."""
        return self.key if self.router is None or route == "cloud" else None

    def routing_line(self) -> dict[str, Any] | None:
        """The session's routing (the manifest's session line, the summary): requests and measured energy per
        route, and the energy saved against sending every request to the cloud: the local requests' measured
        energy against the cloud's measured J/token this session times their tokens (an estimate, labeled)."""
        if self.router is None:
            return None
        with self._lock:
            local, cloud = dict(self.routes["local"]), dict(self.routes["cloud"])
            unscored, route_s = self.unscored, self.route_s
        n = local["requests"] + cloud["requests"]
        saved = None
        if cloud["tokens"] > 0 and not cloud["unknown"] and not local["unknown"] and local["requests"]:
            per_token = cloud["energy_j"] / cloud["tokens"]
            counterfactual = per_token * local["tokens"]
            saved = {"saved_j": round(counterfactual - local["energy_j"], 6),
                     "local_measured_j": round(local["energy_j"], 6),
                     "cloud_counterfactual_j": round(counterfactual, 6), "cloud_j_per_token": per_token,
                     "basis": "estimated: the cloud's measured J/token this session x the tokens of the requests "
                              "served locally (they were not sent to the cloud)"}
        return {"router": self.options.route, "local": {**local, "backend": self.specs["local"].name},
                "cloud": {**cloud, "backend": self.specs["cloud"].name}, "unscored_to_cloud": unscored,
                "routing_ms_per_request": round(1000 * route_s / n, 4) if n else None,
                "saved_vs_cloud_only": saved}

    def next_repeat(self, query_id: str) -> int:
        with self._lock:
            n = self.repeats.get(query_id, 0)
            self.repeats[query_id] = n + 1
            self.queries.add(query_id)
            return n

    def build(self, ended: "Ended", readings: list[Any], busy_s: float | None = None, split: Any = None,
              provisional: QueryRecord | None = None) -> QueryRecord:
        """The record of an ended request with these readings (its settled share, or its provisional energy);
        ``provisional``: the provisional record the answer carried, whose energy the settled one keeps beside its own."""
        query_id, text = prompt_digest(ended.body)
        completion = ended.completion
        if not self.options.log_prompts:
            text = _hashed(text)
            if completion is not None:
                completion = dataclasses.replace(completion, text=_hashed(completion.text))
        query = Query(id=query_id, prompt=text, answer="", category=ended.api, scorer="judge")
        spec = self.specs.get(ended.route, self.spec)
        record = self.make_record(self.folder.manifest.run_id, spec, query, ended.repeat, completion, ended.error,
                                  ended.window[0], ended.window[1], readings, idle=self.idle, estimate=self.estimate,
                                  busy_s=busy_s, split=split)
        if provisional is not None:
            record = dataclasses.replace(record, provisional_energy_j=provisional.provisional_energy_j,
                                         provisional_uncertainty_j=provisional.provisional_uncertainty_j)
        return record

    def provisional(self, job: int, ended: "Ended") -> QueryRecord:
        """The record an answer carries at once: its energy the meter's provisional value (``Meter.provisional``)."""
        estimate = self.meter.provisional(job)
        record = self.build(ended, estimate.readings, busy_s=None)
        band = None if record.energy_j is None else round(record.energy_j * estimate.rel_90, 6)
        return dataclasses.replace(record, provisional_energy_j=record.energy_j, provisional_uncertainty_j=band)

    def answered(self, job: int, ended: "Ended", record: QueryRecord | None, settled: bool) -> None:
        """Before ``ended``'s answer leaves: its record on disk (pending.jsonl, fsynced) until its final one is
        written.  ``record``: the settled one (``settled``, --energy-wait) or the provisional one the answer
        carries; None: none was made (the energy is not in the response), the provisional one is made now.  A
        provisional record is kept labelled as such (``unsettled``), never as measured."""
        if record is None or not settled:
            try:
                record = unsettled(record or self.provisional(job, ended))
            except Exception:  # no provisional value to be had: the request is kept without energy
                record = unsettled(self.build(ended, []))
        ended.on_disk = record
        try:
            self.pending_log.add(record)
        except IpwError as exc:  # the disk is full: the answer still goes; the writer reports the folder's state
            self.notice(f"ipw serve: {exc.message}")

    def settle(self, job: int, ended: "Ended", provisional: QueryRecord | None, wait: bool = False) -> QueryRecord | None:
        """Make ``job``'s record once its share is final and hand it to the writer: now (``wait``: this
        thread waits for the share, and gets the record), else on the meter's thread when the share is final."""
        request_id = f"{prompt_digest(ended.body)[0]}/{ended.repeat}"  # its record's key (not the id clients see)
        with self._lock:
            self.pending.add(ended.request_id)
        if self.metrics is not None:  # its label: the model the request asked for
            self.metrics.requested(request_id, ended.body.get("model"))
        if self.otel is not None:
            self.otel.requested(request_id, ended.body.get("model"))

        def done(share: Any, error: BaseException | None) -> QueryRecord | None:
            try:
                if share is None:
                    raise error or RuntimeError("no share")
                record = self.build(ended, share.readings, busy_s=share.busy_s, split=share, provisional=provisional)
                if not wait:
                    self.keep(record, ended.override, ended.request_id)
                return record
            except Exception as exc:  # never on a client's path: one line, and the record kept is the provisional one
                with self._lock:
                    self.pending.discard(ended.request_id)
                self.notice(f"ipw serve: the energy of request {request_id} was not settled: {type(exc).__name__}: "
                            f"{scrub(str(exc))[:200]}")
                if not wait and ended.on_disk is not None:
                    self.writer.put_record(with_override(ended.on_disk, ended.override))
                return None

        if wait:
            return done(self.meter.share(job), None)
        self.meter.on_share(job, done)
        return None

    def keep(self, record: QueryRecord, override: QueryError | None, request_id: str) -> None:
        """A settled record: with ``override`` as its error (the client went away after its end), kept for
        ``GET /v1/ipw/energy/{request_id}`` and handed to the writer."""
        record = with_override(record, override)
        with self._lock:
            self.pending.discard(request_id)
            self.settled[request_id] = energy_object(record, request_id)
            while len(self.settled) > SETTLED_KEEP:
                self.settled.popitem(last=False)
        self.writer.put_record(record)

    def lookup(self, request_id: str) -> tuple[int, dict[str, Any]]:
        """``GET /v1/ipw/energy/{id}``: the settled energy (200), pending (202), or unknown (404)."""
        with self._lock:
            if request_id in self.settled:
                return 200, self.settled[request_id]
            if request_id in self.pending:
                return 202, {"request_id": request_id, "status": "pending"}
        return 404, {"error": {"message": f"ipw serve: no request {request_id} in this session (or settled too long "
                               f"ago: the last {SETTLED_KEEP} are kept; every record is in the run folder)",
                               "type": "not_found", "code": 404}}

    def _written(self, record: QueryRecord) -> None:
        """A record is on disk (the writer's thread)."""
        self.pending_log.done(record)
        settled = not record.energy_source.startswith(UNSETTLED + ":")
        if self.metrics is not None:  # counted once, settled: never a provisional value (one that never settled)
            self.metrics.written(record, settled=settled)
        if self.otel is not None:  # its counts and its span, once, settled (exported by the SDK's threads)
            self.otel.written(record, settled=settled)
        with self._lock:
            self.requests += 1
            self.errors += record.error is not None
            method = record.split_method or "none"
            self.split_methods[method] = self.split_methods.get(method, 0) + 1
            if record.energy_j is not None:
                self.energy_j += record.energy_j
            self.energy_quality.add(record.energy_quality)
            if self.router is not None and record.role in self.routes:
                r = self.routes[record.role]
                r["requests"] += 1
                r["tokens"] += record.prompt_tokens + record.completion_tokens
                if record.energy_j is None:
                    r["unknown"] += 1
                else:
                    r["energy_j"] += record.energy_j

    def hide_key(self, data: bytes, cut: bool = False) -> bytes:
        """An upstream's body with every secret ipw holds (the upstream key, should it echo it, whole or any 8
        characters of it, shown or masked) replaced before it reaches a client; ``cut``: the body was cut by a
        read limit, so its tail goes too (the part of a key the cut left is too short to recognise)."""
        text = scrub(data.decode("utf-8", errors="surrogateescape"))
        return (scrub_tail(text) if cut else text).encode("utf-8", errors="surrogateescape")

    def check_token(self, header: str | None) -> bool:
        if self.token is None:
            return True
        expected = f"Bearer {self.token}".encode()
        return hmac.compare_digest((header or "").encode(errors="replace"), expected)


def with_override(record: QueryRecord, override: QueryError | None) -> QueryRecord:
    """``record`` with ``override`` as its error (the client went away after the request's end), if it had none."""
    if override is None or record.error is not None:
        return record
    return dataclasses.replace(record, error=f"QueryError: {override}", error_category=override.category)


UNSETTLED = "provisional"  # the energy source's prefix of a record whose energy never settled (pending.jsonl)


def unsettled(record: QueryRecord) -> QueryRecord:
    """A provisional record as the run folder keeps it until its settled one replaces it: its energy (the value
    the answer carried) labelled estimated, and its source ``provisional:...``, so that a folder read after a
    kill never shows it as settled or measured."""
    if record.energy_j is None:
        return record
    parts = [{**p, "quality": "estimated"} if str(p.get("quality", "")).startswith("measured") else p
             for p in json.loads(record.energy_parts)]
    return dataclasses.replace(record, energy_quality="estimated", energy_source=f"{UNSETTLED}:{record.energy_source}",
                               energy_parts=json.dumps(parts), phase_quality="estimated" if record.phase_quality else "",
                               provisional_energy_j=record.energy_j)


@dataclass
class Ended:
    """What a metered request was once it ended: its body, API, repeat, outcome and window; ``override``: an
    error that came after its end (the client went away while the answer was written)."""

    body: dict[str, Any]
    api: str
    repeat: int
    completion: Completion | None
    error: Exception | None
    window: tuple[float, float]
    override: QueryError | None = None
    route: str = ""  # with --route: "local" or "cloud" (the upstream it went to)
    on_disk: QueryRecord | None = None  # its record in pending.jsonl (``Session.answered``)
    # the id its answer carries, for its settled energy (``GET /v1/ipw/energy/ID``): random, so that it tells
    # nothing of the prompt (a hash of it would let any client test whether a given prompt was sent)
    request_id: str = dataclasses.field(default_factory=lambda: secrets.token_urlsafe(16))


class _Stream:
    """What the proxy saw of one upstream answer: content pieces, usage, server timings, finish."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.usage: dict[str, Any] = {}
        self.timings: Any = None
        self.finish = ""

    def take(self, data: dict[str, Any], api: str) -> bool:
        """Note one chunk (or a whole answer); True when it carried output text."""
        if isinstance(data.get("usage"), dict):
            self.usage = data["usage"]
        self.timings = data.get("timings") or self.timings
        got = False
        choices = data.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict):
                continue
            piece = choice_text(choice, api)
            if piece:
                self.parts.append(piece)
                got = True
            reason = choice.get("finish_reason")
            self.finish = reason if isinstance(reason, str) and reason else self.finish
        return got

    def completion(self, start: float, end: float, times: tuple[float, ...]) -> Completion:
        prompt, output = token_count(self.usage.get("prompt_tokens")), token_count(self.usage.get("completion_tokens"))
        return Completion(
            text="".join(self.parts), prompt_tokens=prompt or 0,
            completion_tokens=len(times) if output is None else output, start_s=start,
            first_token_s=times[0] if times else None, end_s=end, token_times_s=times,
            finish_reason=self.finish, server_timings=server_timings(self.timings))


#: at most this much of an upstream stream is read at once (a read returns what has come, up to the end of
#: its current HTTP chunk: usually one event)
READ_BYTES = 1 << 16
_BLANK_LINES = re.compile(rb"(?:[ \t\r\x0b\x0c]*\n)*")  # lines that are empty once stripped
_EVENT_END = re.compile(rb"\n[ \t\r\x0b\x0c]*\n")  # a line's end, then an empty line


def sse_events(read: Callable[[], bytes], limit: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """The events of a server-sent event stream, each as its lines (their line ends kept) without the
    empty line that ends it; ``read`` gives the stream's next bytes, b"" at its end (a last event that no
    empty line ended is dropped).  One search per event, not one ``readline`` per line, and each byte is
    searched about once: a read resumes at the last line end already seen.  An event not ended within
    ``limit`` bytes is a malformed stream (``QueryError``), so that an endless line holds neither memory nor
    a core."""
    buf = b""
    seen = 0  # where a search resumes: no event ends before the last line end of the bytes searched so far
    while True:
        data = read()
        if not data:
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
            raise QueryError(f"an upstream event longer than {limit} bytes", "malformed_stream")
        last = buf.rfind(b"\n")
        seen = last if last >= 0 else len(buf)


class _ClientReader(io.RawIOBase):
    """A client connection as its handler reads it (``rfile``, buffered on top): each read waits at most the
    socket's timeout (``CLIENT_IDLE_S``), and, from a request's first byte until it is read (``done``), at most
    what is left of ``CLIENT_REQUEST_S``; past it, a TimeoutError, on which the handler closes the connection."""

    def __init__(self, sock: socket.socket, idle_s: float | None, waiting: "_IdleClients") -> None:
        self._sock, self._idle_s, self._waiting = sock, idle_s, waiting
        self._armed = False  # a request is being read
        self._by: float | None = None  # its deadline (monotonic), from its first byte

    def start(self) -> None:
        """The handler waits for a request (idle until its first byte: ``_IdleClients``)."""
        self._armed, self._by = True, None
        self._waiting.add(self)

    def done(self) -> None:
        """The request is read: the socket's timeout is the idle one again (its writes' too)."""
        self._waiting.remove(self)
        if self._armed and self._by is not None:
            self._sock.settimeout(self._idle_s)
        self._armed, self._by = False, None

    def cut(self) -> None:
        """Close the connection's reading (and writing): its handler's wait for a request ends."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed already
            pass

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        if self._by is not None:
            left = self._by - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the request did not come whole within {CLIENT_REQUEST_S:g} s")
            self._sock.settimeout(left if self._idle_s is None else min(left, self._idle_s))
        n = self._sock.recv_into(buf)
        if self._armed and self._by is None and n:
            self._by = time.monotonic() + CLIENT_REQUEST_S
            self._waiting.remove(self)
        return n


#: out of file descriptors, this part of the client connections waiting for a request is closed (the longest waiting)
SHED_PART = 4


class _IdleClients:
    """The client connections that wait for a request (for its first byte), the longest-waiting first.  Out of file
    descriptors, the proxy closes a part of them (``shed``), so that a new connection (``/health``, a request) can be
    accepted instead of waiting in the listen queue until idle ones time out: an idle kept-alive connection may be
    closed at any time (RFC 9112, 9.6), and one that never sent a byte has no request to lose."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[_ClientReader, None] = {}  # in the order they began to wait

    def add(self, reader: _ClientReader) -> None:
        with self._lock:
            self._waiting[reader] = None

    def remove(self, reader: _ClientReader) -> None:
        with self._lock:
            self._waiting.pop(reader, None)

    def shed(self) -> int:
        """Close the longest-waiting part (``SHED_PART``) of the connections, at least one; how many."""
        with self._lock:
            cut = list(self._waiting)[:max(1, len(self._waiting) // SHED_PART)]
            for reader in cut:
                del self._waiting[reader]
        for reader in cut:
            reader.cut()
        return len(cut)


class _ClientGone(Exception):
    """The client closed its connection while the answer was being written."""


class Handler(BaseHTTPRequestHandler):
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
        self._reader = _ClientReader(self.connection, self.timeout, self.server.idle_clients)
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
        ``_ClientGone``.  Public: bench/serving/serve_timeline.py times the first event, the energy chunk and
        the terminal chunk sent."""
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        except (BrokenPipeError, ConnectionResetError, TimeoutError) as exc:
            raise _ClientGone(type(exc).__name__) from None

    # -- routes ---------------------------------------------------------------------------------

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
        seen = _Stream()
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
        except (_ClientGone, BrokenPipeError, ConnectionResetError) as exc:
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

    def _relay_json(self, job: int, body: dict[str, Any], api: str, resp: Any, seen: _Stream, start: float) -> None:
        raw = resp.read(MAX_RESPONSE_BODY)
        end = time.monotonic()
        self._finish_upstream()  # idle again before the client has its answer (as for a stream)
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        record = None
        if isinstance(data, dict):
            seen.take(data, api)
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

    def _relay_stream(self, job: int, body: dict[str, Any], api: str, resp: Any, seen: _Stream,
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
            data_lines = [ln[5:].strip() for ln in event.splitlines() if ln.startswith(b"data:")]
            data = b"\n".join(data_lines)
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
                    seen.take(chunk, api)
                    ended, record = True, self.end_stream(job, body, api, seen, start)
                    if record is not None:
                        chunk["usage"] = {**chunk["usage"], "energy": self._energy(record)}
                        self.send_chunk(b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n")
                    elif asked_usage:
                        self.send_chunk(event + b"\n")
                continue
            if seen.take(chunk, api):
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

    def end_stream(self, job: int, body: dict[str, Any], api: str, seen: _Stream, start: float,
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


class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # a load generator opens its connections at once
    session: Session  # set before it serves: the socket is bound first, so that a refusal leaves no run folder

    def __init__(self, address: tuple[str, int], session: Session | None = None) -> None:
        if session is not None:
            self.session = session
        self.hop_id = secrets.token_hex(8)
        self.idle_clients = _IdleClients()
        self._idle: list[http.client.HTTPConnection] = []  # upstream connections kept alive, the last used last
        self._idle_lock = threading.Lock()
        self._closed = False
        super().__init__(address, Handler)

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
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, _ClientGone, TimeoutError)):
            return
        self.session.notice(f"ipw serve: request from {client_address[0]} failed: {type(exc).__name__}: "
                            f"{scrub(str(exc))[:200]}")


@dataclass
class Proxy:
    """A running proxy (``start``): its URL, and ``stop`` to finish the run folder."""

    server: ProxyServer
    session: Session
    backend: Any  # a managed upstream server (an OpenAIBackend), or None
    sensors: list[Any]
    thread: threading.Thread
    started_s: float
    switch_interval_s: float = 0.005  # the interpreter's, restored at stop

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{cast(str, host)}:{port}/v1"  # an IP server's address: (host, port, ...)

    def stop(self, grace_s: float = 30.0, status: str = "complete", reason: str | None = None) -> dict[str, Any]:
        """Stop accepting, let the requests in flight finish (at most ``grace_s``), end the meter's span
        and finish the run folder; returns the session's manifest line."""
        self.server.shutdown()
        self.server.server_close()
        sys.setswitchinterval(self.switch_interval_s)
        deadline = time.monotonic() + grace_s
        while self.session.meter.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.session.meter.in_flight()
        energy = self.session.meter.close()  # every ended request settled: its record is with the writer
        session = self.session
        session.writer.close()
        session.pending_log.close()  # empty now: finish removes it
        folder = session.folder
        try:
            backends = folder.manifest.backends or []
            entry = dict(backends[0]) if backends else {}
            # before the power trace and the sensors' close: the audit's read of the counter past the end is in both
            audit = self._energy_audit(max(1, len(entry.get("sessions", []))))
            for sensor in self.sensors:
                if sensor.supports_trace:
                    folder.add_power(session.spec.name, sensor.trace())
            line = {
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - (time.monotonic() - self.started_s))),
                "start_s": session.meter.started_s, "end_s": session.meter.ended_s,
                "wall_s": round(time.monotonic() - self.started_s, 3), "requests": session.requests,
                "energy_split": session.options.energy_split, "split_methods": dict(session.split_methods),
                "pricing": asdict(session.meter.pricing()),
                "errors": session.errors, "in_flight_peak": session.meter.in_flight_peak,
                "unfinished_at_stop": left, "energy": energy, "idle_baseline": asdict(session.idle),
                "sampler_overhead": {s.name: s.overhead() for s in self.sensors},
                "meter_cost": {k: round(v, 4) for k, v in session.meter.cost.items()},
                **({"routing": session.routing_line()} if session.router is not None else {}),
                **({"energy_audit": audit} if audit else {}),
            }
            entry["sessions"] = [*entry.get("sessions", [])[:-1], line]  # the last session is this one
            folder.write_manifest(backends=[entry], dataset=_dataset(session))
            folder.finish(status, **({"reason": reason} if reason else {}))
        finally:
            if session.otel is not None:
                session.otel.close()  # the last export, bounded (otel.SHUTDOWN_S), once the folder is finished
            for sensor in self.sensors:
                sensor.close()
            if self.backend is not None:
                self.backend.close()
        return line

    def _energy_audit(self, n: int) -> list[dict[str, Any]]:
        """The session's energy audit (``ipw.telemetry.audit``; ``ipw run`` has one per backend and level): the
        counter over the span of this session's requests (both routes' with --route: they share the meter) vs
        their energies plus the idle between them, its lines "in session N"; [] without an NVML sensor."""
        from ipw.telemetry.audit import audit_dicts

        session = self.session
        if not any(s.supports_energy_windows for s in self.sensors):
            return []
        try:
            records = [r for name in dict.fromkeys(spec.name for spec in session.specs.values())
                       for r in session.folder.records_of(name)]
        except Exception as exc:  # the audit never costs the session
            return [{"error": f"{type(exc).__name__}: {exc}"}]
        return audit_dicts(self.sensors, records, since_s=session.meter.started_s, scope=f"in session {n}")


def is_llama_server(upstream: Upstream, key: str | None) -> bool:
    """Whether the upstream is llama.cpp's server (its /v1/models says ``owned_by: llamacpp``)."""
    conn = upstream.connection(10.0)
    try:
        conn.request("GET", f"{upstream.prefix}/models", headers={"Authorization": f"Bearer {key}"} if key else {})
        resp = conn.getresponse()
        data = json.loads(resp.read(MAX_ERROR_BODY)) if resp.status == 200 else {}
    except (OSError, http.client.HTTPException, ValueError):
        return False
    finally:
        conn.close()
    models = data.get("data") if isinstance(data, dict) else None
    return any(isinstance(m, dict) and m.get("owned_by") == "llamacpp" for m in models or [])


def _dataset(session: Session) -> dict[str, Any]:
    """The run's "dataset": the distinct prompts its clients sent (by query id), so that two runs of the
    same client workload have the same fingerprint and ``ipw check`` pairs them."""
    digest = hashlib.sha256("\n".join(sorted(session.queries)).encode()).hexdigest()[:16]
    return {"name": "ipw serve", "n_queries": len(session.queries), "fingerprint": "sha256:" + digest,
            "categories": sorted(METERED.values())}


def managed_backend(kind_model: str, name: str | None, n_threads: int | None, n_gpu_layers: int | None,
                    parallel: int, n_ctx: int | None) -> Any:
    """``--backend SERVER:MODEL``: an OpenAIBackend whose managed server ipw starts (and stops)."""
    from ipw.backends.base import create_backend
    from ipw.backends.servers import SERVER_KINDS

    kind, sep, model = kind_model.partition(":")
    if not sep or kind not in SERVER_KINDS or not model:
        raise IpwError(f"--backend {kind_model!r}: expected SERVER:MODEL with SERVER one of {', '.join(SERVER_KINDS)}"
                       " (e.g. llama-server:smollm2-135m)")
    options: dict[str, Any] = {"server": kind, "concurrency": parallel}
    for key, value in (("n_threads", n_threads), ("n_gpu_layers", n_gpu_layers), ("n_ctx", n_ctx)):
        if value is not None:
            options[key] = value
    backend = create_backend(BackendSpec(name=name or f"{kind}:{Path(model).stem}", kind="openai", model=model,
                                         options=options))
    backend.preflight()
    return backend


def start(options: ServeOptions, out_dir: str | Path, *, token: str | None = None, backend: Any = None,
          upstream_pids: list[int] | None = None, resume: str | Path | None = None, command: list[str] | None = None,
          notice: Callable[[str], None] = lambda line: None, probe: Callable[..., list[Any]] | None = None,
          router: Any = None) -> Proxy:
    """Start the proxy: the managed server (``backend``) if any, the sensors and their idle baseline,
    the run folder (new, or ``resume``'s), then the listening socket.  Returns once it accepts requests."""
    from ipw.backends.openai_http import listening_pids
    from ipw.telemetry.cpu_model import CpuModelSensor
    from ipw.telemetry.hardware import node_identity, software_fingerprint
    from ipw.telemetry.probe import probe_sensors

    if options.route and router is None:  # a bad router file: one line, before the socket and the folder
        from ipw.analysis.router import load_router

        router = load_router(options.route)
    if options.route:  # what --resume of the folder compares (a router retrained at the same path is another one)
        options = dataclasses.replace(options, route_sha256=hashlib.sha256(Path(options.route).read_bytes()).hexdigest())
    key = read_key(options.api_key_env, options.name) if options.api_key_env else None
    if token is not None:  # the clients' token is a secret too: scrubbed from every text ipw writes
        register(token)
    from ipw.export import otel

    otel.check()  # OTEL_EXPORTER_OTLP_ENDPOINT: its settings and the extra (exit 2), before the socket and the folder
    server = listen(options.host, options.port)  # before the run folder: a refusal leaves none
    try:
        if resume is not None:  # before the folder is touched
            _check_resume(RunManifest.read_unfinished(resume), options, resume)
        if backend is None:
            refuse_self(Upstream.parse(options.upstream), options.host, server.server_address[1])
            refuse_unreachable(Upstream.parse(options.upstream), "--local" if options.route else "--upstream")
        if options.route:
            refuse_self(Upstream.parse(options.cloud_upstream), options.host, server.server_address[1])
            refuse_unreachable(Upstream.parse(options.cloud_upstream), "--cloud")
        if probe is None:  # the BMC that IPW_NODE_POWER names answers with power data (as ipw run checks it)
            from ipw.telemetry.node_power import check_configured

            check_configured()
        folder = _folder(options, out_dir, resume, command)
    except BaseException:
        server.server_close()
        raise
    sensors: list[Any] = []
    try:
        if backend is not None:
            backend.attach(folder.path)
            backend.load()
            options = dataclasses.replace(options, upstream=backend.base_url, model=options.model or backend.spec.model)
        upstream = Upstream.parse(options.upstream)
        cloud = Upstream.parse(options.cloud_upstream) if options.route else None
        if backend is not None:
            pids_fn = backend.pids
        else:
            found = upstream_pids if upstream_pids is not None else (
                [] if upstream.remote else listening_pids(upstream.port))
            if cloud is not None and upstream_pids is None and not cloud.remote:  # --route: both servers' work
                found = [*found, *(p for p in listening_pids(cloud.port) if p not in found)]
            pids_fn = lambda: list(found)  # noqa: E731 - a one-line local helper
        sensors = (probe or probe_sensors)(pids_fn, remote=upstream.remote)
        if any(isinstance(s, CpuModelSensor) for s in sensors) and not pids_fn():
            raise IpwError(f"--upstream {upstream.url}: no process of this user listens on port {upstream.port}, so "
                           "the CPU model (this machine has no RAPL) cannot see its work; give --upstream-pid PID")
        estimate = None
        if upstream.remote:
            from ipw.telemetry.api_estimate import ApiEnergyEstimate

            estimate = ApiEnergyEstimate.load(None)
        window = Window(sensors)
        idle = measure_idle(window, options.idle_s) if options.idle_s > 0 and sensors else IdleBaseline({}, {}, 0.0)
        llama = ((backend.server_kind == "llama-server") if backend is not None
                 else is_llama_server(upstream, None if options.route else key))  # --route: the key is the cloud's
        # tokens are timed as they pass, and llama-server reports each prefill at the first token
        meter = Meter(window, split=options.energy_split, live_tokens=True, expect_prefill=llama, idle_w=idle.power_w)
        session = Session(folder, options, upstream, meter, idle, estimate, key, token, notice, llama,
                          router=router, cloud=cloud)
        identity, hardware = node_identity()
        entry = {"name": options.name, "kind": "serve", "model": session.spec.model, "role": options.role,
                 "upstream": upstream.url, "remote": upstream.remote, "llama_server_timings": llama,
                 "sensors": [asdict(s.info()) for s in sensors] + ([asdict(estimate.info())] if estimate else []),
                 "idle_baseline": asdict(idle),
                 **({"managed": backend.describe()} if backend is not None else {"upstream_pids": pids_fn()}),
                 **({"route": {"router": options.route, "cloud_upstream": cloud.url, "cloud_name": options.cloud_name,
                               "local_name": options.name}} if cloud is not None else {}),
                 "sessions": [*((folder.manifest.backends or [{}])[0].get("sessions", [])), {"status": "serving"}]}
        folder.write_manifest(backends=[entry], hardware_by_id={**(folder.manifest.hardware_by_id or {}),
                                                                identity.hardware_id: hardware},
                              software=folder.manifest.software or software_fingerprint())
        server.session = session
    except BaseException as exc:
        server.server_close()
        _abandon(folder, sensors, backend, f"{type(exc).__name__}: {exc}")
        raise
    meter.open()
    switch_interval_s = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # a streamed token waits less for the interpreter lock
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="ipw-serve", daemon=True)
    thread.start()
    return Proxy(server, session, backend, sensors, thread, time.monotonic(), switch_interval_s)


def listen(host: str, port: int) -> ProxyServer:
    """The proxy's listening socket (not serving yet), or one line naming --host or --port (exit 2)."""
    try:
        return ProxyServer((host, port))
    except socket.gaierror as exc:
        raise IpwError(f"--host {host!r}: not a name or address of this machine ({exc.strerror})") from None
    except OverflowError:  # a port the socket module refuses (checked earlier by the command)
        raise IpwError(f"--port {port}: must be 0 (a free port) to 65535") from None
    except (TypeError, ValueError) as exc:  # a NUL in the name
        raise IpwError(f"--host {host!r}: {exc}") from None
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            raise IpwError(f"--host {host!r}: not an address of this machine ({exc.strerror})") from None
        raise IpwError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})") from None


def refuse_self(upstream: Upstream, host: str, port: int) -> None:
    """An IpwError when ``upstream`` is the proxy's own address (``host``:``port``, where it listens): each
    request would be forwarded to itself."""
    import ipaddress

    import psutil

    if upstream.port != port:
        return
    try:
        targets = {ai[4][0] for ai in socket.getaddrinfo(upstream.host, port, socket.AF_INET, socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return  # a name that does not resolve here is not this machine
    if host in ("", "0.0.0.0"):  # every address of this machine
        mine = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
        looped = any(ipaddress.ip_address(t).is_loopback or t in mine for t in targets)
    else:
        try:
            bound = {ai[4][0] for ai in socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)}
        except (OSError, UnicodeError):
            return
        looped = bool(targets & bound)
    if looped:
        raise IpwError(f"--upstream {upstream.url}: that is this proxy's own address ({host or '0.0.0.0'}:{port}), "
                       "so every request would be forwarded to itself; give the server to forward to")


#: how long the start waits for an upstream to accept a connection (a hosted API across the world: well under this)
CONNECT_PROBE_S = 10.0


def refuse_unreachable(upstream: Upstream, option: str) -> None:
    """An IpwError naming ``option`` when nothing accepts a connection at ``upstream``'s address (a port nobody
    listens on, a name that does not resolve): every request would fail, so the proxy does not start."""
    try:
        socket.create_connection((upstream.host, upstream.port), timeout=CONNECT_PROBE_S).close()
    except (OSError, UnicodeError) as exc:
        why = (exc.strerror if isinstance(exc, OSError) else None) or type(exc).__name__
        raise IpwError(f"{option} {upstream.url}: nothing accepts a connection there ({why}); start the server "
                       "first, or give the address where it listens") from None


def _abandon(folder: RunFolder, sensors: list[Any], backend: Any, reason: str) -> None:
    for sensor in sensors:
        sensor.close()
    if backend is not None:
        backend.close()
    folder.finish("failed", reason=scrub(reason))


def _check_resume(manifest: RunManifest, options: ServeOptions, resume: str | Path) -> None:
    """``--resume`` of a serve folder with the routing, upstream and name it was made with (else two backends' or
    routings' records would mix in one run under one name): an IpwError naming both values."""
    made = (manifest.config or {}).get("serve")
    if not isinstance(made, dict):
        raise IpwError(f"{resume}: not a folder of ipw serve (resume a run with ipw run --resume)")
    _check_resume_route(made, options, resume)

    def upstream(url: Any) -> str:
        if not url:
            return "--backend (a server ipw starts)"
        try:
            return f"--upstream {Upstream.parse(str(url)).url}"
        except IpwError:
            return f"--upstream {redact_url(str(url))}"

    then, now = upstream(made.get("upstream")), upstream(options.upstream)
    if then != now:
        raise IpwError(f"--resume {resume}: the folder was made with {then}, not {now}: resume it with the same "
                       "upstream, or start a new folder")
    if made.get("name") != options.name:
        raise IpwError(f"--resume {resume}: the folder's records are named {made.get('name')!r}, not "
                       f"{options.name!r} (--name): resume it with --name {made.get('name')!r}, or start a new folder")


def _check_resume_route(made: dict[str, Any], options: ServeOptions, resume: str | Path) -> None:
    """``--resume`` of a ``--route`` folder with the router (its content: its SHA-256, or its path in folders
    written before the digest) and the cloud it was made with, and of a folder without --route without one."""
    then = str(made.get("route") or "")
    if bool(then) != bool(options.route):
        was = f"with --route {then}" if then else "without --route"
        now = f"with --route {options.route}" if options.route else "without --route"
        raise IpwError(f"--resume {resume}: the folder was made {was}, not {now}: resume it as it was made, or start "
                       "a new folder")
    if not then:
        return
    digest = str(made.get("route_sha256") or "")
    if (digest != options.route_sha256) if digest else Path(then).resolve() != Path(options.route).resolve():
        def router(path: str, sha: str) -> str:
            return f"{path}" + (f" (sha256 {sha[:12]})" if sha else "")

        raise IpwError(f"--resume {resume}: the folder was made with the router {router(then, digest)}, not "
                       f"{router(options.route, options.route_sha256)}: resume it with the router it was made with, "
                       "or start a new folder")

    def cloud(url: Any) -> str:
        try:
            return Upstream.parse(str(url)).url
        except IpwError:
            return redact_url(str(url))

    if cloud(made.get("cloud_upstream")) != cloud(options.cloud_upstream):
        raise IpwError(f"--resume {resume}: the folder was made with --cloud {cloud(made.get('cloud_upstream'))}, not "
                       f"--cloud {cloud(options.cloud_upstream)}: resume it with the same cloud, or start a new folder")


def _folder(options: ServeOptions, out_dir: str | Path, resume: str | Path | None,
            command: list[str] | None) -> RunFolder:
    """A new run folder, or the one ``--resume`` names (a serve folder that did not finish)."""
    from ipw.telemetry.hardware import node_identity

    config = {"source": "ipw serve", "serve": asdict(options)}
    if resume is not None:  # checked (_check_resume) by the caller
        folder = RunFolder.reopen(resume)
        folder.write_manifest(status="running", resumed_at=(folder.manifest.resumed_at or [])
                              + [time.strftime("%Y-%m-%dT%H:%M:%S")])
        return folder
    identity, hardware = node_identity()
    run_id = new_run_id()
    return RunFolder.create(out_dir, run_id, RunManifest(
        run_id=run_id, ipw_version=__version__, command=[scrub(a) for a in (command if command is not None else sys.argv)],
        config=config, dataset={"name": "ipw serve", "n_queries": 0, "fingerprint": "sha256:" + "0" * 16},
        hardware=hardware, hardware_by_id={identity.hardware_id: hardware},
        started_at=time.strftime("%Y-%m-%dT%H:%M:%S"), backends=[]))
