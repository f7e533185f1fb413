"""Prometheus metrics of ``ipw serve`` (``GET /metrics`` on the proxy's own port) and ``ipw run --metrics-port``,
written with ``prometheus_client`` (the ``prometheus`` extra) into a registry of their own.

The counters are exact: a request is counted once, when its record is settled (``observe``), with its settled
energy; a provisional value never reaches them.  So ``sum(increase(ipw_energy_joules_total[...]))`` over a
session is the run folder's sum of ``energy_j``, and ``ipw_requests_total`` its record count.  Label values
that a client chooses (the request's model) are bounded: the first ``MAX_LABEL_VALUES`` distinct values of each
label keep their own series, later ones are counted under ``other`` (docs/guide/monitoring.md).

Names follow Prometheus's conventions (base units: joules, watts; ``_total`` counters) and, where the
OpenTelemetry GenAI semantic conventions name an attribute, its name with ``_`` for ``.``
(``gen_ai.request.model`` -> ``gen_ai_request_model``).
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any, Callable, Iterator

from ipw.errors import IpwError, missing_extra
from ipw.results import QueryRecord
from ipw.sanitize import one_line

MAX_LABEL_VALUES = 32  # distinct values of one label before the rest go to OTHER
MAX_LABEL_CHARS = 120  # a longer value is cut: a hostile model string cannot make a scrape large
OTHER = "other"

# label names: OpenTelemetry GenAI attributes (dots as underscores) where one exists, else ipw's own
MODEL = "gen_ai_request_model"  # the model the request asked for (ipw run: the backend's model)
OPERATION = "gen_ai_operation_name"  # chat | text_completion (ipw serve)
TOKEN_TYPE = "gen_ai_token_type"  # input | output
ERROR = "error_type"  # OpenTelemetry's error.type: the record's error category
ROUTE = "route"  # ipw serve --route: local | cloud
QUALITY = "energy_quality"  # measured | measured_interpolated | estimated (as the records say)
DEVICE = "device"  # a sensor's component: gpu0, cpu, ...
VALUE = "energy_value"  # provisional | settled

OPERATIONS = {"chat": "chat", "completions": "text_completion"}  # ipw serve's APIs -> GenAI operation names

#: joules per request, and per output token: log-spaced from a small CPU model's to a large GPU batch's
REQUEST_J_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0,
                     1000.0, 2500.0, 5000.0, 10000.0)
TOKEN_J_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0)


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise missing_extra("prometheus_client", "prometheus") from None
    return prometheus_client


class BoundedLabels:
    """Label values as exported: one line, at most ``MAX_LABEL_CHARS`` characters, and at most ``limit``
    distinct values per label name (the first seen); any later value is ``OTHER``.  Thread-safe."""

    def __init__(self, limit: int = MAX_LABEL_VALUES) -> None:
        self.limit = limit
        self.seen: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def __call__(self, label: str, value: object) -> str:
        text = one_line(value)[:MAX_LABEL_CHARS] or "unknown"
        with self._lock:
            seen = self.seen.setdefault(label, set())
            if text in seen:
                return text
            if len(seen) < self.limit:
                seen.add(text)
                return text
        return OTHER


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


class ServeRecords:
    """ipw serve's two calls for each request, shared by its Prometheus metrics and its OpenTelemetry export
    (``ipw.export.otel.OtelExport``): ``requested`` keeps the model the request asked for (its label) until
    ``written`` counts its record (``count``), once it is in the run folder."""

    def __init__(self) -> None:
        self.models: dict[str, str] = {}  # each request's model, by request id, until its record is written
        self._models_lock = threading.Lock()

    def count(self, record: QueryRecord, model: str | None = None) -> None:
        raise NotImplementedError

    def requested(self, request_id: str, model: Any) -> None:
        """The model a request asked for (its body's ``model``), until its record is written."""
        if isinstance(model, str):
            with self._models_lock:
                self.models[request_id] = model

    def written(self, record: QueryRecord, settled: bool = True) -> None:
        """A record is in the run folder; counted when its energy is ``settled`` (a record whose energy never
        settled is kept labelled provisional in the folder, and never counted)."""
        with self._models_lock:
            model = self.models.pop(f"{record.query_id}/{record.repeat}", None)
        if settled:
            self.count(record, model)


class Metrics(ServeRecords):
    """One registry: the counters and histograms of settled records (``observe``) and the live gauges
    (``watch``).  ``operation``: label requests by GenAI operation (ipw serve's chat or completions API);
    ``routed``: label by route (ipw serve --route)."""

    def __init__(self, *, operation: bool = False, routed: bool = False, limit: int = MAX_LABEL_VALUES) -> None:
        super().__init__()
        pc = _client()
        self.registry = pc.CollectorRegistry()
        self.bound = BoundedLabels(limit)
        self.operation, self.routed = operation, routed
        self.base = (MODEL, *((OPERATION,) if operation else ()), *((ROUTE,) if routed else ()))
        reg = {"registry": self.registry}
        self.energy = pc.Counter("ipw_energy_joules", "Settled energy of requests (J), by the quality of the "
                                 "measurement; provisional values are never counted", [*self.base, QUALITY], **reg)
        self.requests = pc.Counter("ipw_requests", "Requests whose record is settled (errors included)",
                                   self.base, **reg)
        self.tokens = pc.Counter("ipw_tokens", "Prompt (input) and completion (output) tokens of settled requests",
                                 [*self.base, TOKEN_TYPE], **reg)
        self.errors = pc.Counter("ipw_request_errors", "Settled requests that ended in an error, by category",
                                 [*self.base, ERROR], **reg)
        self.correct = pc.Counter("ipw_correct_answers", "Correct answers of scored requests (each 0..1; ipw run)",
                                  self.base, **reg)
        self.scored = pc.Counter("ipw_scored_requests", "Scored requests (ipw run)", self.base, **reg)
        self.answered = pc.Counter("ipw_answered_energy_joules", "Requests whose answer carried a provisional "
                                   "energy: that value and their settled one (J), counted at settlement",
                                   [*self.base, VALUE], **reg)
        self.request_energy = pc.Histogram("ipw_request_energy_joules", "Settled energy per request (J)",
                                           self.base, buckets=REQUEST_J_BUCKETS, **reg)
        self.token_energy = pc.Histogram("ipw_output_token_energy_joules", "Settled energy per output token of "
                                         "requests with output (J)", self.base, buckets=TOKEN_J_BUCKETS, **reg)
        self.last_power: dict[str, float] = {}  # ipw run: each device's mean power over its last lone request
        self.sources: dict[str, Callable[[], Any]] = {"power": lambda: dict(self.last_power)}
        self.registry.register(_Gauges(self))

    def watch(self, **sources: Callable[[], Any]) -> None:
        """The live gauges' sources, read at each scrape: ``power`` and ``idle`` (watts by device: dicts),
        ``in_flight`` and ``provisional`` (counts)."""
        self.sources.update(sources)

    def labels(self, record: QueryRecord, model: str | None = None) -> dict[str, str]:
        """A record's base labels: ``model`` (the request's, where known) else the record's model."""
        out = {MODEL: self.bound(MODEL, model if isinstance(model, str) and model else record.model)}
        if self.operation:
            out[OPERATION] = self.bound(OPERATION, OPERATIONS.get(record.category, record.category))
        if self.routed:
            out[ROUTE] = self.bound(ROUTE, record.role)
        return out

    def observe(self, record: QueryRecord, model: str | None = None) -> None:
        """Count one settled record (once: the caller hands each record here when it is settled)."""
        labels = self.labels(record, model)
        self.requests.labels(**labels).inc()
        for kind, n in (("input", record.prompt_tokens), ("output", record.completion_tokens)):
            if _finite(n) and n:
                self.tokens.labels(**labels, **{TOKEN_TYPE: kind}).inc(n)
        if record.correct is not None and _finite(record.correct):  # scored (ipw run)
            self.scored.labels(**labels).inc()
            self.correct.labels(**labels).inc(record.correct)
        if record.error is not None:
            self.errors.labels(**labels, **{ERROR: self.bound(ERROR, record.error_category or "other")}).inc()
        energy = record.energy_j
        if not _finite(energy):
            return
        assert energy is not None  # _finite
        self.energy.labels(**labels, **{QUALITY: self.bound(QUALITY, record.energy_quality)}).inc(energy)
        self.request_energy.labels(**labels).observe(energy)
        if _finite(record.completion_tokens) and record.completion_tokens > 0:
            self.token_energy.labels(**labels).observe(energy / record.completion_tokens)
        if _finite(record.provisional_energy_j):
            self.answered.labels(**labels, **{VALUE: "provisional"}).inc(record.provisional_energy_j)
            self.answered.labels(**labels, **{VALUE: "settled"}).inc(energy)
        if not record.split_method:  # the request's own window: its measured parts are the devices' power
            for part in json.loads(record.energy_parts):
                duration, joules = part.get("duration_s"), part.get("energy_j")
                device = self.bound(DEVICE, part.get("component"))
                if part.get("quality") != "estimated" and _finite(joules) and _finite(duration) and duration > 0:
                    self.last_power[device] = joules / duration

    count = observe  # ipw serve: ServeRecords.written's

    def exposition(self) -> tuple[bytes, str]:
        """The registry in Prometheus's text format, and its content type (``GET /metrics``)."""
        pc = _client()
        return pc.generate_latest(self.registry), pc.CONTENT_TYPE_LATEST

    def serve_http(self, host: str, port: int) -> Any:
        """Serve the registry at http://HOST:PORT/metrics on a thread of its own (prometheus_client's server);
        a port in use or a host that is not this machine's: an IpwError naming --metrics-port or --metrics-host."""
        import socket

        pc = _client()
        try:
            server, _thread = pc.start_http_server(port, addr=host, registry=self.registry)
        except socket.gaierror as exc:
            raise IpwError(f"--metrics-host {host!r}: not a name or address of this machine ({exc.strerror})") from None
        except OSError as exc:
            raise IpwError(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror})") from None
        return server


class _Gauges:
    """The live gauges, read from their sources at each scrape (a source missing or failing: no sample)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Any]:
        return list(self._families())

    def collect(self) -> Iterator[Any]:
        yield from self._families(read=True)

    def _read(self, name: str) -> Any:
        source = self.metrics.sources.get(name)
        try:
            return source() if source is not None else None
        except Exception:  # a scrape never fails for one gauge
            return None

    def _families(self, read: bool = False) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        bound = self.metrics.bound
        for key, name, help_text in (("power", "ipw_device_power_watts", "Latest power of each measured device (W)"),
                                     ("idle", "ipw_idle_power_watts", "Idle baseline power of each device (W)")):
            family = GaugeMetricFamily(name, help_text, labels=[DEVICE])
            for device, watts in sorted((self._read(key) or {}).items()) if read else ():
                label = bound(DEVICE, device)
                if _finite(watts) and label != OTHER:  # a gauge of several devices at once would mean nothing
                    family.add_metric([label], watts)
            yield family
        for key, name, help_text in (("in_flight", "ipw_requests_in_flight", "Requests in flight"),
                                     ("provisional", "ipw_requests_provisional", "Requests answered whose energy is "
                                      "not settled yet (provisional)")):
            value: Any = self._read(key) if read else None
            family = GaugeMetricFamily(name, help_text)
            if _finite(value):
                family.add_metric([], value)
            yield family


def for_session(session: Any) -> Metrics | None:
    """``ipw serve``'s metrics, its gauges read from ``session`` (an ``ipw.serve.Session``); None without the
    ``prometheus`` extra (``GET /metrics`` then says which extra to install)."""
    try:
        metrics = Metrics(operation=True, routed=session.router is not None)
    except IpwError as exc:  # the proxy serves without it, and says so once
        session.notice(f"ipw serve: no GET /metrics: {exc.message}")
        return None
    metrics.watch(power=session.meter.window.power_w, idle=lambda: dict(session.idle.power_w),
                  in_flight=session.meter.in_flight, provisional=lambda: len(session.pending))
    return metrics
