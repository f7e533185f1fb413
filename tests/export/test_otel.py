"""OpenTelemetry export (ipw/export/otel.py, issue 56): the SDK's in-memory reader and exporter for the unit
tests; a real OTLP/HTTP receiver on 127.0.0.1 (``Collector``: POST /v1/metrics and /v1/traces, protobuf bodies
decoded with the opentelemetry-proto classes) for real ``ipw run`` and ``ipw serve`` processes, against the
loopback OpenAI stub; receivers that refuse connections, hang, or answer with a hostile reason phrase."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest, ExportMetricsServiceResponse)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)

from ipw.errors import IpwError
from ipw.export import otel
from ipw.results import QueryRecord
from openai_stub import Stub, stub_config

IPW = [sys.executable, "-m", "ipw.cli"]
SECRET = "otel-s3cret-header-value-42"


# -- a real OTLP/HTTP receiver ---------------------------------------------------------------------------------

class Collector:
    """An OTLP/HTTP receiver on 127.0.0.1.  ``mode``: ``ok`` (200, each body decoded and kept), ``hang`` (reads the
    body and never answers until closed), ``echo401`` (401 whose reason phrase is the request's Authorization
    header: a hostile collector that echoes a credential)."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.traces: list[ExportTraceServiceRequest] = []
        self.headers: list[dict[str, str]] = []
        self.posts = 0
        self.release = threading.Event()
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with collector.lock:
                    collector.posts += 1
                    collector.headers.append({k.lower(): v for k, v in self.headers.items()})
                if collector.mode == "hang":
                    collector.release.wait(120)
                    return
                if collector.mode == "echo401":
                    self.send_response(401, self.headers.get("Authorization", "none"))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path == "/v1/metrics":
                    request, response = ExportMetricsServiceRequest(), ExportMetricsServiceResponse()
                elif self.path == "/v1/traces":
                    request, response = ExportTraceServiceRequest(), ExportTraceServiceResponse()
                else:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                request.ParseFromString(body)
                with collector.lock:
                    (collector.metrics if self.path == "/v1/metrics" else collector.traces).append(request)
                payload = response.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def spans(self) -> list:
        return [s for r in self.traces for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]

    def resources(self) -> list[dict]:
        return [_attrs(rm.resource.attributes) for r in self.metrics for rm in r.resource_metrics] + [
            _attrs(rs.resource.attributes) for r in self.traces for rs in r.resource_spans]

    def last_metrics(self) -> dict[str, tuple[str, list]]:
        """Each metric's unit and data points in the last export that had it (cumulative: the totals)."""
        out: dict[str, tuple[str, list]] = {}
        for r in self.metrics:
            for rm in r.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        kind = m.WhichOneof("data")
                        out[m.name] = (m.unit, list(getattr(m, kind).data_points))
        return out


def _value(any_value):
    return getattr(any_value, any_value.WhichOneof("value"))


def _attrs(key_values) -> dict:
    return {kv.key: _value(kv.value) for kv in key_values}


def _point_value(point) -> float:
    return point.as_double if point.WhichOneof("value") == "as_double" else point.as_int


def _sum_by(points, key: str | None = None, value: str | None = None) -> float:
    return sum(_point_value(p) for p in points if key is None or _attrs(p.attributes).get(key) == value)


def _refused_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the in-memory SDK parts: the metrics and spans of records ---------------------------------------------------

def _record(**changes) -> QueryRecord:
    now = time.monotonic()
    fields = dict(run_id="r1", backend="b", model="m", role="local", query_id="q", category="chat", repeat=0,
                  scorer="exact", prompt="p", answer="a", output="o", correct=1.0, error=None, error_category=None,
                  prompt_tokens=10, completion_tokens=5, ttft_s=0.1, latency_s=1.0, start_s=now - 1.5, end_s=now - 0.5,
                  energy_j=2.5, energy_quality="measured", energy_source="rapl", energy_scope="package",
                  best_effort_energy_j=2.5, net_energy_j=1.5,
                  energy_parts=json.dumps([{"component": "cpu", "energy_j": 2.5, "duration_s": 1.0,
                                            "quality": "measured", "uncertainty_j": 0.1}]))
    fields.update(changes)
    return QueryRecord(**fields)


@pytest.fixture
def memory():
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    reader, spans, warnings = InMemoryMetricReader(), InMemorySpanExporter(), []

    def make(**options):
        return otel.OtelExport(options.pop("command", "serve"), warnings.append, reader=reader,
                               processor=SimpleSpanProcessor(spans), **options)

    make.reader, make.spans, make.warnings = reader, spans, warnings
    return make


def _metrics(reader) -> dict[str, tuple[str, list]]:
    data = reader.get_metrics_data()
    return {m.name: (m.unit, list(m.data.data_points)) for rm in data.resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics}


def test_a_settled_record_is_counted_and_becomes_one_span_over_its_window(memory):
    export = memory(operation=True)
    record = _record(provisional_energy_j=2.4, provisional_uncertainty_j=0.3, split_uncertainty_j=0.05,
                     split_method="priced", concurrency=4)
    export.add(record, model="asked-model")
    export.add(_record(query_id="q2", energy_j=None, net_energy_j=None, energy_quality="unavailable",
                       error="QueryError: boom", error_category="timeout", completion_tokens=0, correct=0.0,
                       category="completions"))
    data = memory.reader.get_metrics_data()
    sums = {m.name: m.data for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
            if m.name in ("ipw.energy", "ipw.requests", "ipw.tokens")}
    assert len(sums) == 3 and all(d.is_monotonic and d.aggregation_temporality == 2 for d in sums.values())  # counters
    m = _metrics(memory.reader)
    labels = {"gen_ai.request.model": "asked-model", "gen_ai.operation.name": "chat"}
    assert m["ipw.energy"][0] == "J"
    (energy,) = m["ipw.energy"][1]  # the record without energy adds none
    assert dict(energy.attributes) == {**labels, "energy_quality": "measured"} and energy.value == 2.5
    assert sorted((dict(p.attributes)["gen_ai.operation.name"], p.value) for p in m["ipw.requests"][1]) == [
        ("chat", 1), ("text_completion", 1)]
    assert sorted((dict(p.attributes)["gen_ai.token.type"], p.value) for p in m["ipw.tokens"][1]) == [
        ("input", 10), ("input", 10), ("output", 5)]
    (error,) = m["ipw.request_errors"][1]
    assert dict(error.attributes)["error.type"] == "timeout" and error.value == 1
    (per_request,) = m["ipw.request_energy"][1]
    assert per_request.count == 1 and per_request.sum == 2.5 and m["ipw.request_energy"][0] == "J"
    assert tuple(per_request.explicit_bounds) == otel.prometheus.REQUEST_J_BUCKETS
    (per_token,) = m["ipw.output_token_energy"][1]
    assert per_token.count == 1 and per_token.sum == pytest.approx(0.5)
    assert sorted((dict(p.attributes)["energy_value"], p.value) for p in m["ipw.answered_energy"][1]) == [
        ("provisional", 2.4), ("settled", 2.5)]

    first, second = memory.spans.get_finished_spans()
    assert first.name == "chat asked-model" and second.name == "text_completion m"
    a = dict(first.attributes)
    assert a["gen_ai.request.model"] == "asked-model" and a["ipw.model"] == "m"
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (10, 5)
    assert (a["ipw.energy_j"], a["ipw.net_energy_j"], a["ipw.energy_quality"]) == (2.5, 1.5, "measured")
    assert (a["ipw.provisional_energy_j"], a["ipw.provisional_uncertainty_j"]) == (2.4, 0.3)
    assert a["ipw.split_uncertainty_j"] == 0.05 and a["ipw.split_method"] == "priced"
    assert a["ipw.measurement_uncertainty_j"] > 0 and a["ipw.request_id"] == "q/0"
    # the window: the record's, in wall-clock nanoseconds (monotonic -> wall clock once)
    assert first.end_time - first.start_time == pytest.approx(1e9, abs=1000)
    assert abs(first.end_time - (time.time_ns() - 0.5e9)) < 5e9
    assert first.status.is_ok and not second.status.is_ok and second.status.description == "timeout"
    assert "ipw.energy_j" not in dict(second.attributes)  # absent values left out
    assert dict(second.attributes)["error.type"] == "timeout"
    assert first.resource.attributes["service.name"] == "ipw"
    assert memory.warnings == []


def test_ipw_serve_exports_a_written_record_once_settled_by_the_model_it_asked_for(memory):
    """ipw serve's calls (shared with the Prometheus metrics: prometheus.ServeRecords): ``requested`` keeps the
    request's model, ``written`` exports its record when settled; one that never settled is not exported."""
    export = memory()
    export.requested("q0/0", "asked")
    export.written(_record(query_id="q0", energy_source="provisional:model.cpu"), settled=False)
    export.requested("q1/0", "asked")
    export.written(_record(query_id="q1"))
    export.written(_record(query_id="q2"))  # no model asked for: the record's
    points = _metrics(memory.reader)["ipw.requests"][1]
    assert sorted((dict(p.attributes)["gen_ai.request.model"], p.value) for p in points) == [("asked", 1), ("m", 1)]
    assert [s.name for s in memory.spans.get_finished_spans()] == ["chat asked", "chat m"] and not export.models


def test_the_gauges_read_their_sources_at_each_export(memory):
    export = memory(command="run")
    export.add(_record())  # ipw run: a lone request's window gives each device's power
    m = _metrics(memory.reader)
    assert [(dict(p.attributes), p.value) for p in m["ipw.device.power"][1]] == [({"device": "cpu"}, 2.5)]
    assert m["ipw.device.power"][0] == "W" and "ipw.requests.in_flight" not in m  # no source: no point
    export.watch(power=lambda: {"gpu0": 250.0}, idle=lambda: {"gpu0": 60.0}, in_flight=lambda: 3,
                 provisional=lambda: 1 / 0)  # a failing source: no point, no failed export
    m = _metrics(memory.reader)
    assert [p.value for p in m["ipw.device.power"][1]] == [250.0] and [p.value for p in m["ipw.idle.power"][1]] == [60.0]
    assert [p.value for p in m["ipw.requests.in_flight"][1]] == [3] and "ipw.requests.provisional" not in m
    assert memory.warnings == []


def test_a_client_chosen_model_string_cannot_blow_up_the_series(memory):
    export = memory()
    for i in range(otel.prometheus.MAX_LABEL_VALUES + 20):
        export.add(_record(query_id=f"q{i}"), model=f"model-{i}\n" + "x" * 500)
    points = _metrics(memory.reader)["ipw.requests"][1]
    models = {dict(p.attributes)["gen_ai.request.model"] for p in points}
    assert len(models) == otel.prometheus.MAX_LABEL_VALUES + 1 and otel.prometheus.OTHER in models
    assert all("\n" not in m and len(m) <= otel.prometheus.MAX_LABEL_CHARS for m in models)
    assert sum(p.value for p in points) == otel.prometheus.MAX_LABEL_VALUES + 20  # every request counted


# -- the settings: off unless asked, checked before anything starts ----------------------------------------------

def test_off_unless_an_endpoint_is_set():
    assert otel.signals({}) == [] and not otel.check({})
    assert otel.signals({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == ["traces", "metrics"]
    assert otel.signals({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}) == []
    assert otel.signals({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == ["traces"]
    assert otel.signals({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_METRICS_EXPORTER": "none"}) == ["traces"]


@pytest.mark.parametrize("env, fragment", [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT='localhost:4318': expected"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://u:pw12345678@c:99999"}, "'http://***@c:99999': bad port"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTLP over HTTP only"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_METRIC_EXPORT_INTERVAL": "0"}, "expected a number above 0"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_TIMEOUT": "soon"}, "OTEL_EXPORTER_OTLP_TIMEOUT"),
])
def test_bad_settings_are_one_line(env, fragment):
    with pytest.raises(IpwError) as info:
        otel.check(env)
    assert fragment in str(info.value) and "\n" not in str(info.value) and "pw12345678" not in str(info.value)


def test_without_the_extra_the_endpoint_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(otel, "_installed", lambda module: False)
    with pytest.raises(IpwError, match=r"pip install 'ipw\[otel\]'"):
        otel.check({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})


def test_header_values_are_secrets():
    from ipw.sanitize import is_secret_env, scrub

    otel.check({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_EXPORTER_OTLP_HEADERS": "x-api-key=abc%2Fdef-ghi-12345,authorization=Bearer tok-0123456789"})
    text = scrub("key abc/def-ghi-12345 and abc%2Fdef-ghi-12345, token tok-0123456789")
    assert text.startswith("key *** and ***, token") and not any(s in text for s in ("abc", "def-ghi", "tok-", "6789"))
    assert is_secret_env("OTEL_EXPORTER_OTLP_HEADERS", "anything")  # no engine or server inherits it
    # the token is the secret, not its scheme: other texts keep their words (test_secrets ran after this one
    # and found "you sent Authorization: Bearer ***" scrubbed to "you sent Authorization: ***")
    assert scrub("you sent Authorization: Bearer ***") == "you sent Authorization: Bearer ***"


# -- real processes against a real receiver --------------------------------------------------------------------

@pytest.fixture(scope="module")
def stub():
    s = Stub()
    yield s
    s.close()


def _config(tmp_path: Path, stub: Stub, n: int = 4) -> Path:
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Say {i}", "answer": "42"}) + "\n" for i in range(n)))
    return stub_config(tmp_path / "run.toml", data, stub.base_url, out_dir=tmp_path / "out")


def _env(endpoint: str, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_HEADERS=f"authorization=Bearer {SECRET}",
               OTEL_METRIC_EXPORT_INTERVAL="500", OTEL_BSP_SCHEDULE_DELAY="200", **more)
    return env


def _records(out: Path) -> list[dict]:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]


def _no_secret(out: Path, *texts: str) -> None:
    for path in out.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    for text in texts:
        assert SECRET not in text


def test_ipw_run_exports_its_records_to_a_real_receiver(stub, tmp_path):
    collector = Collector()
    t0 = time.time_ns()
    try:
        proc = subprocess.run(IPW + ["run", str(_config(tmp_path, stub))], capture_output=True, text=True,
                              timeout=300, env=_env(collector.url, OTEL_SERVICE_NAME="ipw-test"))
    finally:
        collector.close()
    assert proc.returncode == 0, proc.stderr
    records = _records(tmp_path / "out")
    assert len(records) == 4 and "OpenTelemetry" not in proc.stderr
    # the header went to the collector, and nowhere else
    assert {h.get("authorization") for h in collector.headers} == {f"Bearer {SECRET}"}
    _no_secret(tmp_path / "out", proc.stdout, proc.stderr)
    assert {r.get("service.name") for r in collector.resources()} == {"ipw-test"}

    spans = {_attrs(s.attributes)["ipw.request_id"]: s for s in collector.spans()}
    assert sorted(spans) == sorted(f"{r['query_id']}/{r['repeat']}" for r in records)  # one span per record
    for r in records:
        span = spans[f"{r['query_id']}/{r['repeat']}"]
        a = _attrs(span.attributes)
        assert span.name == "chat stub" and a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "stub"
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
            r["prompt_tokens"], r["completion_tokens"])
        assert a["ipw.energy_quality"] == r["energy_quality"] and a.get("ipw.energy_j") == r["energy_j"]
        assert a["ipw.run_id"] == r["run_id"] and a["ipw.backend"] == "stub"
        assert span.end_time_unix_nano - span.start_time_unix_nano == pytest.approx(
            (r["end_s"] - r["start_s"]) * 1e9, abs=1000)
        assert t0 <= span.start_time_unix_nano <= span.end_time_unix_nano <= time.time_ns()

    metrics = collector.last_metrics()
    assert _sum_by(metrics["ipw.requests"][1]) == 4 and metrics["ipw.requests"][0] == "{request}"
    assert _sum_by(metrics["ipw.tokens"][1], "gen_ai.token.type", "input") == sum(r["prompt_tokens"] for r in records)
    assert _sum_by(metrics["ipw.tokens"][1], "gen_ai.token.type", "output") == sum(
        r["completion_tokens"] for r in records)
    with_energy = [r["energy_j"] for r in records if r["energy_j"] is not None]
    assert with_energy, "the stub run measured or estimated no energy"
    assert metrics["ipw.energy"][0] == "J"
    assert _sum_by(metrics["ipw.energy"][1]) == pytest.approx(sum(with_energy), rel=1e-9)
    (hist,) = metrics["ipw.request_energy"][1]
    assert hist.count == len(with_energy) and hist.sum == pytest.approx(sum(with_energy), rel=1e-9)
    assert {_attrs(p.attributes)["gen_ai.request.model"] for p in metrics["ipw.requests"][1]} == {"stub"}
    assert _sum_by(metrics["ipw.scored_requests"][1]) == 4
    assert _sum_by(metrics["ipw.correct_answers"][1]) == sum(r["correct"] for r in records)


@pytest.mark.parametrize("mode", ["refused", "hang", "echo401"])
def test_a_collector_that_is_down_hangs_or_refuses_costs_one_warning_and_no_record(stub, tmp_path, mode):
    collector = None if mode == "refused" else Collector(mode)
    url = f"http://127.0.0.1:{_refused_port()}" if collector is None else collector.url
    try:
        proc = subprocess.run(IPW + ["run", str(_config(tmp_path, stub, n=6))], capture_output=True, text=True,
                              timeout=300, env=_env(url))
    finally:
        if collector is not None:
            collector.close()
    assert proc.returncode == 0, proc.stderr
    assert len(_records(tmp_path / "out")) == 6  # every record, complete
    warnings = [line for line in proc.stderr.splitlines() if "OpenTelemetry export" in line]
    assert len(warnings) == 1, proc.stderr
    assert "ipw goes on and every record is in the run folder" in warnings[0]
    # the SDK's own log lines (one per failed batch and retry) stay off stderr, and so does any traceback
    others = [line for line in proc.stderr.splitlines() if line not in warnings]
    assert "Traceback" not in proc.stderr and not [line for line in others if "export" in line.lower()], proc.stderr
    _no_secret(tmp_path / "out", proc.stdout, proc.stderr)
    if mode == "echo401":  # the credential the collector echoed is scrubbed from the warning
        assert "***" in warnings[0]
    if collector is not None:
        assert collector.posts >= 1


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_bad_endpoint_is_refused_before_the_run_folder(stub, tmp_path, command):
    args = [str(_config(tmp_path, stub))] if command == "run" else [
        "--upstream", stub.base_url, "--port", "0", "--idle-s", "0", "--out", str(tmp_path / "out")]
    proc = subprocess.run(IPW + [command, *args], capture_output=True, text=True, timeout=300,
                          env=_env("collector:4318"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: OTEL_EXPORTER_OTLP_ENDPOINT='collector:4318': expected an http(s)://HOST[:PORT] URL of an OTLP/HTTP "
        "collector (e.g. http://localhost:4318)"]
    assert not (tmp_path / "out").exists()


def _ask(url: str, body: dict) -> bytes:
    """POST ``body`` to ``url``: the whole answer (a JSON body, or a stream's events)."""
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read()


ASKED = [("/chat/completions", {"model": "asked-a", "messages": [{"role": "user", "content": "one"}]}),
         ("/chat/completions", {"model": "asked-b", "messages": [{"role": "user", "content": "two"}], "stream": True}),
         ("/completions", {"model": "asked-a", "prompt": "three", "max_tokens": 2})]


def _serve_session(stub: Stub, tmp_path: Path, endpoint: str) -> tuple[list[dict], str]:
    """A real ``ipw serve`` in front of the stub, exporting to ``endpoint``: ``ASKED`` sent one by one (each
    answered), then SIGTERM; its records and its stderr."""
    import re
    import signal

    proc = subprocess.Popen([*IPW, "serve", "--upstream", stub.base_url, "--port", "0", "--idle-s", "0",
                             "--upstream-pid", str(os.getpid()), "--out", str(tmp_path / "out")],
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2], env=_env(endpoint))
    try:
        line = ""
        while "run folder" not in line:
            line = proc.stderr.readline()
            assert line, "ipw serve ended before it served"
        url = re.search(r"(http://127\.0\.0\.1:\d+/v1) -> ", line).group(1)
        for path, body in ASKED:
            assert b"[DONE]" in _ask(url + path, body)  # the stub streams every answer
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    records = _records(tmp_path / "out")
    assert len(records) == 3 and all(r["energy_j"] is not None for r in records)
    _no_secret(tmp_path / "out", err)
    return records, err


def test_ipw_serve_exports_each_settled_request_to_a_real_receiver(stub, tmp_path):
    collector = Collector()
    try:
        records, err = _serve_session(stub, tmp_path, collector.url)
    finally:
        collector.close()
    assert "OpenTelemetry" not in err
    spans = {_attrs(s.attributes)["ipw.request_id"]: s for s in collector.spans()}
    assert sorted(spans) == sorted(f"{r['query_id']}/{r['repeat']}" for r in records)  # one span per request
    by_prompt = {r["prompt"]: r for r in records}
    assert len(by_prompt) == 3
    for r in records:
        span = spans[f"{r['query_id']}/{r['repeat']}"]
        a = _attrs(span.attributes)
        assert span.kind == span.SPAN_KIND_SERVER and span.name == f"{a['gen_ai.operation.name']} " \
                                                                   f"{a['gen_ai.request.model']}"
        assert a["ipw.energy_j"] == r["energy_j"] and a["ipw.energy_quality"] == r["energy_quality"]
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
            r["prompt_tokens"], r["completion_tokens"])
        assert span.end_time_unix_nano - span.start_time_unix_nano == pytest.approx(
            (r["end_s"] - r["start_s"]) * 1e9, abs=1000)
    seen = sorted((a["gen_ai.operation.name"], a["gen_ai.request.model"])
                  for a in (_attrs(s.attributes) for s in spans.values()))
    assert seen == [("chat", "asked-a"), ("chat", "asked-b"), ("text_completion", "asked-a")]

    metrics = collector.last_metrics()
    assert _sum_by(metrics["ipw.requests"][1]) == 3
    assert sorted((_attrs(p.attributes)["gen_ai.request.model"], _attrs(p.attributes)["gen_ai.operation.name"],
                   _point_value(p)) for p in metrics["ipw.requests"][1]) == [
        ("asked-a", "chat", 1), ("asked-a", "text_completion", 1), ("asked-b", "chat", 1)]
    assert _sum_by(metrics["ipw.energy"][1]) == pytest.approx(sum(r["energy_j"] for r in records), rel=1e-9)
    assert _sum_by(metrics["ipw.tokens"][1], "gen_ai.token.type", "output") == sum(
        r["completion_tokens"] for r in records)
    assert [_point_value(p) for p in metrics["ipw.requests.in_flight"][1]] == [0]
    assert [_point_value(p) for p in metrics["ipw.requests.provisional"][1]] == [0]


def test_a_hung_collector_costs_ipw_serve_no_answer_and_no_record(stub, tmp_path):
    collector = Collector("hang")
    try:
        _, err = _serve_session(stub, tmp_path, collector.url)  # every answer came, every record is kept
    finally:
        collector.close()
    warnings = [line for line in err.splitlines() if "OpenTelemetry export" in line]
    assert len(warnings) == 1 and "ipw goes on" in warnings[0], err
    assert "Traceback" not in err and collector.posts >= 1
