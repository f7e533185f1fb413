"""The measuring side of ``ipw serve``: the meter, the run folder and the records (``Session``)."""

from __future__ import annotations

import collections
import dataclasses
import hmac
import threading
import time
from typing import Any, Callable

from ipw.backends.base import BackendSpec, QueryError
from ipw.inputs.datasets import Query
from ipw.errors import IpwError
from ipw.metering.meter import Meter
from ipw.metering.window import IdleBaseline
from ipw.results import QueryRecord, RunFolder
from ipw.sanitize import scrub, scrub_tail
from ipw.serve.options import ServeOptions, Upstream
from ipw.serve.request import UNSETTLED, Ended, hashed, energy_object, prompt_digest, routing_text, unsettled, with_override

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
            text = hashed(text)
            if completion is not None:
                completion = dataclasses.replace(completion, text=hashed(completion.text))
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

