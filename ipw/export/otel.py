"""OpenTelemetry export (the ``otel`` extra): ``ipw run`` and ``ipw serve`` send their settled energy over
OTLP/HTTP through the OpenTelemetry SDK, configured as every OpenTelemetry exporter is, by the standard
``OTEL_*`` variables (docs/guide/monitoring.md, "OpenTelemetry").

It is on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or a signal's own ``..._TRACES_ENDPOINT`` /
``..._METRICS_ENDPOINT``) is set, and ``OTEL_SDK_DISABLED`` is not ``true``: the OpenTelemetry convention,
so no flag.  Each settled record adds to the counters and histograms and becomes one span over the
request's window; gauges are read at each export.  The SDK exports from its own background threads (a
batch span processor, a periodic metric reader) with bounded timeouts: a collector that is down or hangs
costs one warning, never an answer or a record, and the export's shutdown at the end waits at most
``SHUTDOWN_S``.  The values of the ``OTEL_EXPORTER_OTLP_*HEADERS`` variables (a collector's credentials)
are registered secrets: scrubbed from every text ipw writes, and never passed to an engine or a server.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import threading
import time
from typing import Any, Callable, Mapping
from urllib.parse import unquote, urlsplit

from ipw import __version__
from ipw.errors import IpwError
from ipw.export import prometheus
from ipw.results import QueryRecord
from ipw.sanitize import one_line, redact_url, register, register_env, scrub

SHUTDOWN_S = 5.0  # the export's shutdown at the end (its last batch of spans and metrics) waits at most this long

# metric attributes: the Prometheus labels of ipw.export.prometheus, so that a collector's Prometheus exporter
# (dots to underscores, the unit and _total appended: ipw.energy in J -> ipw_energy_joules_total) gives the
# same series as GET /metrics; OpenTelemetry GenAI names where they exist
MODEL, OPERATION, TOKEN_TYPE, ERROR = "gen_ai.request.model", "gen_ai.operation.name", "gen_ai.token.type", "error.type"
ROUTE, QUALITY, DEVICE, VALUE = prometheus.ROUTE, prometheus.QUALITY, prometheus.DEVICE, prometheus.VALUE

ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
#: each signal: its own endpoint variable, and the variable that turns it off (``none``)
SIGNALS = {"traces": ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER"),
           "metrics": ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_METRICS_EXPORTER")}
HEADERS = ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_METRICS_HEADERS")
PROTOCOLS = ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")
#: numbers the SDK reads; it would fall back to its default on a bad one with a log line, or raise in a thread
NUMBERS = ("OTEL_METRIC_EXPORT_INTERVAL", "OTEL_METRIC_EXPORT_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT",
           "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "OTEL_BSP_SCHEDULE_DELAY",
           "OTEL_BSP_EXPORT_TIMEOUT", "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE")


def signals(environ: Mapping[str, str] | None = None) -> list[str]:
    """The signals asked for ("traces", "metrics"): each whose endpoint is set (its own, or the common one) and
    whose exporter is not ``none``; [] when ``OTEL_SDK_DISABLED`` is ``true``."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    return [s for s, (endpoint, exporter) in SIGNALS.items()
            if (env.get(endpoint) or env.get(ENDPOINT)) and env.get(exporter, "otlp").strip().lower() != "none"]


def check(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the OpenTelemetry export is asked for, its settings checked before anything starts: an IpwError
    (one line, exit 2) for an endpoint that is not an http(s) URL, a protocol other than http/protobuf, a number
    that is not one, or the extra not installed.  Registers the headers' values as secrets."""
    env = os.environ if environ is None else environ
    on = signals(env)
    if not on:
        return False
    for name in (ENDPOINT, *(SIGNALS[s][0] for s in on)):
        url = env.get(name)
        if not url:
            continue
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url.strip()):
            raise IpwError(f"{name}={redact_url(url)!r}: expected an http(s)://HOST[:PORT] URL of an OTLP/HTTP "
                           "collector (e.g. http://localhost:4318)")
        try:
            bad_port = parts.port == 0
        except ValueError:
            bad_port = True
        if bad_port:
            raise IpwError(f"{name}={redact_url(url)!r}: bad port")
    for name in PROTOCOLS:
        value = env.get(name, "").strip()
        if value and value != "http/protobuf":
            raise IpwError(f"{name}={value!r}: ipw exports OTLP over HTTP only (http/protobuf); set it to "
                           "http/protobuf or unset it, and point the endpoint at the collector's HTTP port (4318)")
    for name in NUMBERS:
        value = env.get(name, "").strip()
        try:
            bad = bool(value) and not (math.isfinite(float(value)) and float(value) > 0)
        except ValueError:
            bad = True
        if bad:
            raise IpwError(f"{name}={value!r}: expected a number above 0")
    for name in HEADERS:  # "key=value,key2=value2", values URL-encoded: each value is a credential
        register_env(name)
        for pair in env.get(name, "").split(","):
            value = pair.partition("=")[2].strip()
            for secret in {value, unquote(value)}:
                # "Bearer TOKEN": the token is the secret; registered whole, any 8 characters of "Bearer T"
                # would be scrubbed from every text ("…sent Authorization: Bearer ***" lost its words)
                scheme, _, credential = secret.partition(" ")
                register(credential.strip() if scheme.lower() in ("bearer", "basic") and credential.strip()
                         else secret)
    if not (_installed("opentelemetry.sdk") and _installed("opentelemetry.exporter.otlp.proto.http")):
        raise IpwError(f"{ENDPOINT} (or another OTLP endpoint variable) is set, but the OpenTelemetry SDK is not "
                       "installed: pip install 'ipw[otel]', or unset it")
    return True


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # its parent package is missing
        return False


class _Sum:
    """A counter kept here, by attributes, and reported by an observable counter at each export (a monotonic
    cumulative sum, as a counter's): an addition per record, where each measurement of the SDK's synchronous
    counter costs ~5 us (seven or more per record)."""

    def __init__(self, meter: Any, name: str, unit: str, description: str) -> None:
        self.totals: dict[tuple[tuple[str, str], ...], float] = {}
        self._lock = threading.Lock()
        meter.create_observable_counter(name, [self._observe], unit=unit, description=description)

    def add(self, value: float, attributes: dict[str, str]) -> None:
        key = tuple(attributes.items())  # each caller builds its attributes in one order
        with self._lock:
            self.totals[key] = self.totals.get(key, 0) + value

    def _observe(self, options: Any) -> list[Any]:
        from opentelemetry.metrics import Observation

        with self._lock:
            totals = list(self.totals.items())
        return [Observation(value, dict(key)) for key, value in totals]


class _Failures(logging.Handler):
    """The SDK's own log lines (a failed export, a retry, a full queue) kept from stderr: the first becomes
    the export's one warning."""

    def __init__(self, export: "OtelExport") -> None:
        super().__init__(logging.WARNING)
        self.export = export

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a log call whose arguments do not format: the warning still comes
            text = str(record.msg)
        self.export.failed(text)


class OtelExport(prometheus.ServeRecords):
    """One command's export: ``add`` each settled record, ``close`` at the end (bounded).

    The metrics are ``ipw.export.prometheus.Metrics``'s, by the same labels: ``operation`` labels requests by
    GenAI operation (ipw serve's chat or completions API), ``routed`` by route (ipw serve --route); ``watch``
    gives the gauges' sources.  ``reader`` and ``processor`` are the SDK's metric reader and span processor
    (OTLP/HTTP ones from the environment: ``start``; in-memory ones in tests); ``warn`` gets the one warning
    line when an export fails."""

    def __init__(self, command: str, warn: Callable[[str], None], *, operation: bool = False, routed: bool = False,
                 reader: Any = None, processor: Any = None, endpoint: str = "") -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace import SpanKind

        from ipw.telemetry.hardware import node_identity

        super().__init__()  # requested and written: ipw serve's calls, as the Prometheus metrics'
        self.warn, self.endpoint = warn, endpoint
        self.operation, self.routed = operation, routed
        self.kind = SpanKind.SERVER if command == "serve" else SpanKind.CLIENT
        self.bound = prometheus.BoundedLabels()
        self.sources: dict[str, Callable[[], Any]] = {"power": lambda: dict(self.last_power)}
        self.last_power: dict[str, float] = {}  # ipw run: each device's mean power over its last lone request
        self.node = node_identity()[0].node
        # monotonic -> wall clock, once: each span's window is the record's [start_s, end_s] (monotonic seconds)
        self.offset_ns = time.time_ns() - time.monotonic_ns()
        self._warned = False
        self._lock = threading.Lock()
        self._logger = logging.getLogger("opentelemetry")
        self._handler = _Failures(self)
        self._propagate = self._logger.propagate
        self._logger.addHandler(self._handler)
        self._logger.propagate = False  # the SDK's lines reach no other handler (Python's last resort: stderr)
        resource = Resource.create({"service.version": __version__, "ipw.command": command})  # + OTEL_SERVICE_NAME...
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: "ipw"}))
        # no atexit shutdown (it would wait on a hung collector with the SDK's 30 s): close() bounds it
        self.meters = MeterProvider(resource=resource, metric_readers=[reader] if reader is not None else [],
                                    shutdown_on_exit=False)
        self.tracers = TracerProvider(resource=resource, shutdown_on_exit=False)
        if processor is not None:
            self.tracers.add_span_processor(processor)
        self.tracer = self.tracers.get_tracer("ipw", __version__)
        meter = self.meters.get_meter("ipw", __version__)
        # the counters: kept here, reported at each export (_Sum)
        self.energy = _Sum(meter, "ipw.energy", "J", "Settled energy of requests (J), by the quality of the "
                           "measurement; provisional values are never counted")
        self.requests = _Sum(meter, "ipw.requests", "{request}", "Requests whose record is settled (errors included)")
        self.tokens = _Sum(meter, "ipw.tokens", "{token}", "Prompt (input) and completion (output) tokens of settled "
                           "requests")
        self.errors = _Sum(meter, "ipw.request_errors", "{request}", "Settled requests that ended in an error, by "
                           "category")
        self.correct = _Sum(meter, "ipw.correct_answers", "{answer}", "Correct answers of scored requests (each 0..1; "
                            "ipw run)")
        self.scored = _Sum(meter, "ipw.scored_requests", "{request}", "Scored requests (ipw run)")
        self.answered = _Sum(meter, "ipw.answered_energy", "J", "Requests whose answer carried a provisional energy: "
                             "that value and their settled one (J)")
        self.request_energy = meter.create_histogram(
            "ipw.request_energy", unit="J", description="Settled energy per request (J)",
            explicit_bucket_boundaries_advisory=prometheus.REQUEST_J_BUCKETS)
        self.token_energy = meter.create_histogram(
            "ipw.output_token_energy", unit="J", description="Settled energy per output token of requests with "
            "output (J)", explicit_bucket_boundaries_advisory=prometheus.TOKEN_J_BUCKETS)
        self._gauges(meter)

    def watch(self, **sources: Callable[[], Any]) -> None:
        """The gauges' sources, read at each export: ``power`` and ``idle`` (watts by device: dicts), ``in_flight``
        and ``provisional`` (counts); as ``ipw.export.prometheus.Metrics.watch``."""
        self.sources.update(sources)

    def _read(self, name: str) -> Any:
        source = self.sources.get(name)
        try:
            return source() if source is not None else None
        except Exception:  # an export never fails for one gauge
            return None

    def _gauges(self, meter: Any) -> None:
        from opentelemetry.metrics import Observation

        def devices(name: str) -> Callable[[Any], list[Any]]:
            def callback(options: Any) -> list[Any]:
                watts = self._read(name) or {}
                labels = {device: self.bound(DEVICE, device) for device in sorted(watts)}
                # a gauge of several devices at once (past the label bound) would mean nothing: left out
                return [Observation(w, {DEVICE: labels[d]}) for d, w in watts.items()
                        if labels[d] != prometheus.OTHER and _finite(w)]
            return callback

        def count(name: str) -> Callable[[Any], list[Any]]:
            def callback(options: Any) -> list[Any]:
                value = self._read(name)
                return [Observation(value)] if _finite(value) else []
            return callback

        meter.create_observable_gauge("ipw.device.power", [devices("power")], unit="W",
                                      description="Latest power of each measured device (W)")
        meter.create_observable_gauge("ipw.idle.power", [devices("idle")], unit="W",
                                      description="Idle baseline power of each device (W)")
        meter.create_observable_gauge("ipw.requests.in_flight", [count("in_flight")], unit="{request}",
                                      description="Requests in flight")
        meter.create_observable_gauge("ipw.requests.provisional", [count("provisional")], unit="{request}",
                                      description="Requests answered whose energy is not settled yet (provisional)")

    def add(self, record: QueryRecord, model: str | None = None) -> None:
        """A settled record (once, when it is settled): its counts and its span; ``model``: the model the request
        asked for, where known (else the record's).  Never raises: the export never costs a record."""
        try:
            self._add(record, model)
        except Exception as exc:
            self.failed(f"{type(exc).__name__}: {exc}")

    count = add  # ipw serve: ServeRecords.written's (its counts and its span)

    def _add(self, record: QueryRecord, model: str | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        asked = model if isinstance(model, str) and model else record.model
        operation = prometheus.OPERATIONS.get(record.category, "chat")
        labels = {MODEL: self.bound(MODEL, asked)}
        if self.operation:
            labels[OPERATION] = self.bound(OPERATION, operation)
        if self.routed:
            labels[ROUTE] = self.bound(ROUTE, record.role)
        self.requests.add(1, labels)
        for kind, n in (("input", record.prompt_tokens), ("output", record.completion_tokens)):
            if _finite(n) and n:
                self.tokens.add(n, {**labels, TOKEN_TYPE: kind})
        if record.correct is not None and _finite(record.correct):  # scored (ipw run)
            self.scored.add(1, labels)
            self.correct.add(record.correct, labels)
        if record.error is not None:
            self.errors.add(1, {**labels, ERROR: self.bound(ERROR, record.error_category or "other")})
        energy = record.energy_j
        if energy is not None and _finite(energy):
            self.energy.add(energy, {**labels, QUALITY: self.bound(QUALITY, record.energy_quality)})
            self.request_energy.record(energy, labels)
            if _finite(record.completion_tokens) and record.completion_tokens > 0:
                self.token_energy.record(energy / record.completion_tokens, labels)
            if record.provisional_energy_j is not None and _finite(record.provisional_energy_j):
                self.answered.add(record.provisional_energy_j, {**labels, VALUE: "provisional"})
                self.answered.add(energy, {**labels, VALUE: "settled"})
            if not record.split_method:  # the request's own window: its measured parts are the devices' power
                self.last_power.update(window_power(record))
        start, end = self._window(record)
        span = self.tracer.start_span(f"{operation} {one_line(asked)[:prometheus.MAX_LABEL_CHARS]}", kind=self.kind,
                                      start_time=start, attributes=span_attributes(record, operation, asked))
        if record.error is not None:
            span.set_status(Status(StatusCode.ERROR, record.error_category or "error"))
        span.end(end_time=end)

    def _window(self, record: QueryRecord) -> tuple[int, int]:
        """The span's start and end (ns since the epoch): the record's window; a record measured on another
        machine (a Ray worker's: another monotonic clock) keeps its duration and ends now."""
        if record.node and record.node != self.node:
            end = time.time_ns()
            return end - int((record.end_s - record.start_s) * 1e9), end
        return int(record.start_s * 1e9) + self.offset_ns, int(record.end_s * 1e9) + self.offset_ns

    def failed(self, reason: str) -> None:
        """An export failed (or the SDK said something went wrong): one warning for the whole command."""
        with self._lock:
            if self._warned:
                return
            self._warned = True
        where = f" to {redact_url(self.endpoint)}" if self.endpoint else ""
        self.warn(f"warning: the OpenTelemetry export{where} failed ({one_line(scrub(reason))[:300]}); ipw goes on "
                  "and every record is in the run folder (no further warning about it)")

    def close(self) -> None:
        """The last spans and metrics exported, waiting at most ``SHUTDOWN_S`` (a hung collector: then a warning)."""
        def shutdown() -> None:
            self.tracers.shutdown()
            self.meters.shutdown(timeout_millis=SHUTDOWN_S * 1000)

        worker = threading.Thread(target=shutdown, name="ipw-otel-shutdown", daemon=True)
        worker.start()
        worker.join(SHUTDOWN_S)
        if worker.is_alive():
            self.failed(f"its last export did not end within {SHUTDOWN_S:g} s")
        self._logger.removeHandler(self._handler)
        self._logger.propagate = self._propagate


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def window_power(record: QueryRecord) -> dict[str, float]:
    """Each measured device's mean power (W) over a record's window, by component."""
    power = {}
    for part in json.loads(record.energy_parts):
        duration, joules = part.get("duration_s"), part.get("energy_j")
        if part.get("quality") != "estimated" and _finite(joules) and _finite(duration) and duration > 0:
            power[str(part.get("component"))] = joules / duration
    return power


def span_attributes(record: QueryRecord, operation: str, model: str) -> dict[str, Any]:
    """A record's span attributes: the OpenTelemetry GenAI conventions' names where they have one
    (``model``: the model the request asked for), ipw's own (``ipw.`` + the record's field) for the rest;
    absent values left out."""
    from ipw.telemetry.uncertainty import measurement_90

    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation, "gen_ai.request.model": model,
        "gen_ai.usage.input_tokens": record.prompt_tokens, "gen_ai.usage.output_tokens": record.completion_tokens,
        "error.type": record.error_category,
        "ipw.run_id": record.run_id, "ipw.backend": record.backend, "ipw.model": record.model, "ipw.role": record.role,
        "ipw.request_id": f"{record.query_id}/{record.repeat}",
        "ipw.energy_j": record.energy_j, "ipw.net_energy_j": record.net_energy_j,
        "ipw.energy_quality": record.energy_quality, "ipw.energy_source": record.energy_source,
        "ipw.energy_scope": record.energy_scope,
        "ipw.measurement_uncertainty_j": measurement_90(record.energy_j, record.energy_parts), "ipw.split_uncertainty_j": record.split_uncertainty_j,
        "ipw.split_method": record.split_method or None,
        "ipw.provisional_energy_j": record.provisional_energy_j,
        "ipw.provisional_uncertainty_j": record.provisional_uncertainty_j,
        "ipw.prefill_energy_j": record.prefill_energy_j, "ipw.decode_energy_j": record.decode_energy_j,
        "ipw.ttft_s": record.ttft_s, "ipw.concurrency": record.concurrency, "ipw.correct": record.correct,
    }
    return {k: v for k, v in attributes.items() if v is not None}


def start(command: str, warn: Callable[[str], None], *, operation: bool = False,
          routed: bool = False) -> OtelExport | None:
    """The export that the environment asks for (``check`` said it does): OTLP/HTTP exporters, a batch span
    processor and a periodic metric reader, each configured by its ``OTEL_*`` variables; None, with a warning,
    where the SDK refuses its settings (the export never costs a run)."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    on = signals()
    endpoint = os.environ.get(ENDPOINT) or os.environ.get(SIGNALS[on[0]][0], "")
    try:
        reader = PeriodicExportingMetricReader(OTLPMetricExporter()) if "metrics" in on else None
        processor = BatchSpanProcessor(OTLPSpanExporter()) if "traces" in on else None
        return OtelExport(command, warn, operation=operation, routed=routed, reader=reader, processor=processor,
                          endpoint=endpoint)
    except Exception as exc:
        warn(f"warning: no OpenTelemetry export to {redact_url(endpoint)}: {one_line(scrub(str(exc)))[:300]}")
        return None


def for_session(session: Any) -> OtelExport | None:
    """``ipw serve``'s export, its gauges read from ``session`` (an ``ipw.serve.Session``), as its Prometheus
    metrics' are (``ipw.export.prometheus.for_session``); None unless the environment asks for it."""
    if not check():
        return None
    export = start("serve", session.notice, operation=True, routed=session.router is not None)
    if export is not None:
        export.watch(power=session.meter.window.power_w, idle=lambda: dict(session.idle.power_w),
                     in_flight=session.meter.in_flight, provisional=lambda: len(session.pending))
    return export
