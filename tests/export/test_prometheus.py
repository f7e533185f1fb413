"""Prometheus metrics (ipw/export/prometheus.py, issue 56): the in-process registry for the names, the bounded
labels and settled-only counting; ``ipw run --metrics-port``; and Debian's real ``prometheus`` server (installed by
``.ci/setup --dev``) scraping ``ipw serve`` in front of the real llama-server every second, its HTTP API's totals
checked against the run folder, and the Grafana dashboard's queries run through it."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from runfolders import record
from scripted import ScriptedBackend

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ipw.export.prometheus import MAX_LABEL_VALUES, OTHER, Metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "configs" / "grafana" / "ipw.json"


def samples(metrics_text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics_text) for s in family.samples}


def total(metrics_text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples(metrics_text).items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


def scrape(metrics: Metrics) -> str:
    body, content_type = metrics.exposition()
    assert content_type.startswith("text/plain")
    return body.decode()


# -- the in-process registry -------------------------------------------------------------------------------


def test_names_units_and_labels_follow_prometheus_and_the_genai_conventions():
    metrics = Metrics(operation=True)
    parts = json.dumps([{"component": "gpu0", "energy_j": 30.0, "duration_s": 0.5, "quality": "measured"},
                        {"component": "cpu", "energy_j": 2.0, "duration_s": 0.5, "quality": "estimated"}])
    metrics.observe(record(energy_j=32.0, energy_quality="measured", prompt_tokens=7, completion_tokens=16,
                           category="chat", energy_parts=parts), model="smol")
    metrics.observe(record(energy_j=None, error="QueryError: boom", error_category="timeout", category="completions",
                           completion_tokens=0), model="smol")
    text = scrape(metrics)
    names = {family.name: family.type for family in text_string_to_metric_families(text)
             if not family.name.endswith("_created")}  # prometheus_client's start time of each counter series
    assert names == {"ipw_energy_joules": "counter", "ipw_requests": "counter", "ipw_tokens": "counter",
                     "ipw_request_errors": "counter", "ipw_answered_energy_joules": "counter",
                     "ipw_correct_answers": "counter", "ipw_scored_requests": "counter",
                     "ipw_request_energy_joules": "histogram", "ipw_output_token_energy_joules": "histogram",
                     "ipw_device_power_watts": "gauge", "ipw_idle_power_watts": "gauge",
                     "ipw_requests_in_flight": "gauge", "ipw_requests_provisional": "gauge"}
    chat = {"gen_ai_request_model": "smol", "gen_ai_operation_name": "chat"}
    assert total(text, "ipw_energy_joules_total", **chat, energy_quality="measured") == 32.0
    assert total(text, "ipw_requests_total") == 2 and total(text, "ipw_requests_total", **chat) == 1
    assert total(text, "ipw_tokens_total", gen_ai_token_type="input") == 7 + 10
    assert total(text, "ipw_tokens_total", gen_ai_token_type="output") == 16
    assert total(text, "ipw_request_errors_total", gen_ai_operation_name="text_completion", error_type="timeout") == 1
    assert total(text, "ipw_request_energy_joules_count") == 1  # the request without energy is not in it
    assert total(text, "ipw_output_token_energy_joules_sum") == pytest.approx(2.0)
    # the measured device's power over the request's own window; the estimated CPU is not a device reading
    assert total(text, "ipw_device_power_watts", device="gpu0") == 60.0
    assert total(text, "ipw_device_power_watts", device="cpu") == 0


def test_counters_count_settled_energy_only():
    """A record is observed once, at settlement, with its settled energy; the provisional value the answer
    carried goes only into ipw_answered_energy_joules (beside the settled one), never into the energy total."""
    metrics = Metrics()
    settled = [record(energy_j=2.5, provisional_energy_j=9.0, provisional_uncertainty_j=1.0),
               record(energy_j=1.25, provisional_energy_j=None), record(energy_j=0.125, provisional_energy_j=0.5)]
    for r in settled:
        metrics.observe(r)
    text = scrape(metrics)
    assert total(text, "ipw_energy_joules_total") == sum(r.energy_j for r in settled)
    assert total(text, "ipw_answered_energy_joules_total", energy_value="provisional") == 9.5
    assert total(text, "ipw_answered_energy_joules_total", energy_value="settled") == 2.625
    # ipw serve: a record written without a settled energy (its settlement failed: the folder keeps the provisional
    # record, labelled so) is not counted; the model its request asked for is forgotten either way
    metrics.requested("q0/0", "asked")
    metrics.written(record(energy_j=7.0, energy_source="provisional:model.cpu"), settled=False)
    metrics.requested("q1/0", "asked")
    metrics.written(record(query_id="q1", energy_j=0.0))
    text = scrape(metrics)
    assert total(text, "ipw_energy_joules_total") == 3.875 and total(text, "ipw_requests_total") == 4
    assert total(text, "ipw_requests_total", gen_ai_request_model="asked") == 1 and not metrics.models
    # a value a counter cannot hold (NaN, negative) is not counted, and never breaks the writer that observes it
    metrics.observe(record(energy_j=math.nan))
    metrics.observe(record(energy_j=-1.0))
    text = scrape(metrics)
    assert total(text, "ipw_energy_joules_total") == 3.875 and total(text, "ipw_requests_total") == 6


def test_a_hostile_client_cannot_blow_up_the_series_count():
    """Each label keeps its first MAX_LABEL_VALUES values; every later one is counted under "other", nothing
    lost; a value is one line of at most 120 characters."""
    metrics = Metrics(operation=True)
    for i in range(500):
        metrics.observe(record(energy_j=1.0, category="chat"), model=f"model-{i}")
        if i == MAX_LABEL_VALUES:  # one value past the bound: "other" has its series
            series = len(samples(scrape(metrics)))
    metrics.observe(record(energy_j=1.0, category="chat"), model="evil\n" + "x" * 10_000)
    text = scrape(metrics)
    assert len(samples(text)) == series  # 468 more names made no new series
    models = {dict(ls)["gen_ai_request_model"] for (n, ls) in samples(text) if n == "ipw_requests_total"}
    assert len(models) == MAX_LABEL_VALUES + 1 and OTHER in models
    assert total(text, "ipw_requests_total") == 501 and total(text, "ipw_energy_joules_total") == 501.0
    assert total(text, "ipw_requests_total", gen_ai_request_model=OTHER) == 501 - MAX_LABEL_VALUES
    small = Metrics()
    small.observe(record(), model="evil\n\u202e" + "x" * 500)
    (model,) = {dict(ls)["gen_ai_request_model"] for (n, ls) in samples(scrape(small)) if n == "ipw_requests_total"}
    assert "\n" not in model and "\u202e" not in model and len(model) == 120


def test_serve_route_labels_each_request_with_the_route_it_took():
    metrics = Metrics(operation=True, routed=True)
    metrics.observe(record(role="local", category="completions"), model="m")
    metrics.observe(record(role="cloud", category="chat", energy_j=2.0), model="m")
    text = scrape(metrics)
    assert total(text, "ipw_energy_joules_total", route="cloud", gen_ai_operation_name="chat") == 2.0
    assert total(text, "ipw_requests_total", route="local", gen_ai_operation_name="text_completion") == 1


def test_live_gauges_read_their_sources_at_each_scrape_and_a_failing_one_is_left_out():
    metrics = Metrics()
    flight = [3]

    def broken():
        raise RuntimeError("sensor gone")

    metrics.watch(power=lambda: {"gpu0": 250.0, "gpu1": None}, idle=broken, in_flight=lambda: flight[0],
                  provisional=lambda: 2)
    text = scrape(metrics)
    assert total(text, "ipw_device_power_watts", device="gpu0") == 250.0
    assert total(text, "ipw_requests_in_flight") == 3 and total(text, "ipw_requests_provisional") == 2
    assert not [n for (n, _ls) in samples(text) if n == "ipw_idle_power_watts"]
    flight[0] = 0
    assert total(scrape(metrics), "ipw_requests_in_flight") == 0


def test_without_the_extra_the_error_names_it(monkeypatch):
    import sys

    from ipw.errors import IpwError

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(IpwError, match=r"pip install 'ipw\[prometheus\]'"):
        Metrics()


# -- ipw run --metrics-port ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


class ScriptedJudge(ScriptedBackend):
    """The ``scripted`` fixture's backend kind.  Its last query reads the run's /metrics until every earlier
    record is counted there (the records are written on a thread of their own) and keeps that scrape."""

    port = 0
    last_prompt = ""
    seen: list[str] = []

    def reply(self, prompt):
        if prompt == type(self).last_prompt:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                text = _get(f"http://127.0.0.1:{type(self).port}/metrics")
                if total(text, "ipw_requests_total") >= 3:
                    type(self).seen.append(text)
                    break
                time.sleep(0.05)
        return "5"


def test_run_serves_the_records_metrics_while_it_runs(tmp_path, run_cli, scripted, small_jsonl):
    port = _free_port()
    ScriptedJudge.port, ScriptedJudge.seen = port, []
    ScriptedJudge.last_prompt = json.loads(small_jsonl.read_text().splitlines()[-1])["prompt"]
    config = tmp_path / "run.toml"
    config.write_text(f'dataset = "{small_jsonl}"\nwarmup = 0\nidle_s = 0.0\n'
                      '[[backends]]\nname = "s"\nkind = "scripted"\nmodel = "x"\n')
    code, out, err = run_cli("run", config, "-o", tmp_path / "runs", "--metrics-port", port)
    assert code == 0, err
    (text,) = ScriptedJudge.seen
    (run,) = list((tmp_path / "runs").iterdir())
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert len(records) == 4
    first = records[:3]  # the records written before the last query's scrape
    assert total(text, "ipw_requests_total", gen_ai_request_model="x") == 3
    assert total(text, "ipw_energy_joules_total") == pytest.approx(
        sum(r["energy_j"] for r in first if r["energy_j"] is not None), rel=1e-9, abs=1e-12)
    assert total(text, "ipw_tokens_total", gen_ai_token_type="output") == sum(r["completion_tokens"] for r in first)
    with pytest.raises(OSError):  # the server ends with the run
        _get(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_run_metrics_port_in_use_is_one_line_before_anything_starts(tmp_path, run_cli, small_jsonl):
    config = tmp_path / "run.toml"
    config.write_text(f'dataset = "{small_jsonl}"\nwarmup = 0\nidle_s = 0.0\n'
                      '[[backends]]\nname = "s"\nkind = "scripted"\nmodel = "x"\n')
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, out, err = run_cli("run", config, "-o", tmp_path / "runs", "--metrics-port", port)
    assert code == 2 and f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "runs").exists()
    code, out, err = run_cli("run", config, "-o", tmp_path / "runs", "--metrics-host", "0.0.0.0")
    assert code == 2 and "--metrics-host: only with --metrics-port" in err
    code, out, err = run_cli("run", config, "-o", tmp_path / "runs", "--metrics-port", "70000")
    assert code == 2 and "--metrics-port" in err and not (tmp_path / "runs").exists()


# -- ipw serve: GET /metrics -----------------------------------------------------------------------------------


def _proxy(tmp_path, upstream: str, pids: list[int], token: str | None = None, **options):
    from ipw.serve import ServeOptions, start

    opts = ServeOptions(upstream=upstream, name="smol", port=0, idle_s=options.pop("idle_s", 0.5),
                        token_required=token is not None, **options)
    return start(opts, tmp_path / "out", token=token, upstream_pids=pids, command=["test"])


def _records(proxy) -> list[dict]:
    return [json.loads(line) for line in (proxy.session.folder.path / "records.jsonl").read_text().splitlines()]


def _chat(base: str, model: str, text: str, stream: bool = False, token: str | None = None) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8,
                       "temperature": 0, "stream": stream}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(base + "/chat/completions", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=300) as resp:
        return {"status": resp.status, "body": resp.read()}


def _settled(proxy, n: int) -> None:
    """Wait (at most 120 s) until ``n`` records are written and no answered request is provisional."""
    deadline = time.monotonic() + 120
    while (proxy.session.requests < n or proxy.session.pending) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proxy.session.requests == n and not proxy.session.pending


def test_serve_metrics_count_each_settled_record_once_by_the_model_asked_for(tmp_path):
    """The stub answers at once; each request is counted when its record is written, by the model its body
    named (a hostile client's many names end in "other"), and /metrics wants the token when the proxy does."""
    from openai_stub import Stub

    stub = Stub()
    stub.llama_server = True
    token = "token-123456"
    proxy = _proxy(tmp_path, stub.base_url, [os.getpid()], token=token, idle_s=0.0)
    base = proxy.url.removesuffix("/v1")
    try:
        for i in range(80):  # "stub", and 40 other names
            _chat(proxy.url, "stub" if i % 2 else f"m{i}", f"q{i}", stream=bool(i % 3), token=token)
        _settled(proxy, 80)
        with pytest.raises(urllib.error.HTTPError) as refused:
            _get(base + "/metrics")
        assert refused.value.code == 401
        request = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain; version=")
            text = resp.read().decode()
    finally:
        proxy.stop()
        stub.close()
    records = _records(proxy)
    assert len(records) == 80
    assert total(text, "ipw_requests_total") == 80
    assert total(text, "ipw_requests_total", gen_ai_request_model="stub", gen_ai_operation_name="chat") == 40
    assert total(text, "ipw_energy_joules_total") == pytest.approx(sum(r["energy_j"] or 0 for r in records), rel=1e-12)
    assert total(text, "ipw_tokens_total", gen_ai_token_type="output") == sum(r["completion_tokens"] for r in records)
    models = {dict(ls)["gen_ai_request_model"] for (n, ls) in samples(text) if n == "ipw_requests_total"}
    assert len(models) == MAX_LABEL_VALUES + 1 and OTHER in models  # "stub", the first 31 other names, "other"
    assert total(text, "ipw_requests_in_flight") == 0 and total(text, "ipw_requests_provisional") == 0


@pytest.mark.parametrize("why", ["--no-metrics", "no extra"])
def test_without_metrics_the_route_says_why(tmp_path, monkeypatch, why):
    """--no-metrics, or prometheus_client not installed: the proxy serves, /metrics answers 404 saying why (the
    missing extra: also one line at the start)."""
    import sys

    from openai_stub import Stub

    if why == "no extra":
        monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    stub = Stub()
    notices: list[str] = []
    from ipw.serve import ServeOptions, start

    proxy = start(ServeOptions(upstream=stub.base_url, name="smol", port=0, idle_s=0.0, metrics=why == "no extra"),
                  tmp_path / "out", upstream_pids=[os.getpid()], command=["test"], notice=notices.append)
    try:
        assert _chat(proxy.url, "m", "hi")["status"] == 200
        with pytest.raises(urllib.error.HTTPError) as off:
            _get(proxy.url.removesuffix("/v1") + "/metrics")
    finally:
        proxy.stop()
        stub.close()
    body = off.value.read().decode()
    assert off.value.code == 404 and (why in body if why == "--no-metrics" else "pip install 'ipw[prometheus]'" in body)
    assert notices == ([] if why == "--no-metrics" else [
        "ipw serve: no GET /metrics: prometheus_client is not installed; install it with: pip install 'ipw[prometheus]'"])


# -- a real Prometheus scraping ipw serve in front of the real llama-server ------------------------------------

PROMETHEUS = os.environ.get("IPW_PROMETHEUS", "/usr/bin/prometheus")


def _llama_server_built() -> bool:
    from ipw.backends.servers import find_llama_server
    from ipw.errors import IpwError

    try:
        return bool(find_llama_server())
    except IpwError:
        return False


class Prometheus:
    """Debian's prometheus server on a free port, scraping ``target`` (HOST:PORT) every second; its config and
    storage in ``folder``."""

    def __init__(self, folder: Path, target: str) -> None:
        self.port = _free_port()
        config = folder / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                          "scrape_configs:\n  - job_name: ipw\n    scrape_interval: 1s\n    scrape_timeout: 1s\n"
                          f"    static_configs:\n      - targets: ['{target}']\n")
        self.log = folder / "prometheus.log"
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                                     stdout=subprocess.DEVNULL, stderr=self.log.open("wb"))
        deadline = time.monotonic() + 60
        while True:
            try:
                _get(f"{self.url}/-/ready", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"prometheus did not start: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def query(self, expr: str) -> list[dict]:
        """An instant query through the HTTP API: its result vector (an error status fails the test)."""
        data = json.loads(_get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        assert data["status"] == "success", (expr, data)
        return data["data"]["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, want: float, timeout_s: float = 60.0) -> None:
        """Until ``expr`` is ``want`` (a scrape after the records were written)."""
        deadline = time.monotonic() + timeout_s
        while self.value(expr) != want and time.monotonic() < deadline:
            time.sleep(0.25)
        assert self.value(expr) == want, f"{expr} never became {want} ({self.value(expr)})"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def cookbook_queries() -> list[str]:
    """The PromQL blocks of docs/guide/monitoring.md."""
    text = (ROOT / "docs" / "guide" / "monitoring.md").read_text()
    return re.findall(r"```promql\n(.*?)```", text, re.S)


def dashboard_queries() -> list[tuple[str, str]]:
    """Each panel's title and PromQL of the Grafana dashboard, its variables given values as Grafana would."""
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = (target["expr"].replace("$__rate_interval", "1m").replace("$__range", "5m")
                    .replace("$model", ".*").replace("${model:regex}", ".*"))
            out.append((panel["title"], expr))
    return out


@pytest.mark.llama
@pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason=f"no Prometheus server at {PROMETHEUS}: bash .ci/setup --dev "
                    "installs Debian's (apt), or set IPW_PROMETHEUS")
@pytest.mark.skipif(not _llama_server_built(), reason="llama-server is not built: run `bash .ci/setup`")
def test_a_real_prometheus_scraping_serve_sees_the_run_folders_totals(tmp_path):
    from ipw.backends.base import BackendSpec, create_backend

    backend = create_backend(BackendSpec("smol", "openai", "smollm2-135m", options={
        "server": "llama-server", "n_threads": 1, "n_ctx": 256, "concurrency": 4, "server_timeout_s": 300.0}))
    backend.attach(tmp_path / "llama")
    backend.load()
    proxy = prometheus = None
    try:
        proxy = _proxy(tmp_path, backend.base_url, backend.pids())
        host, port = proxy.server.server_address[:2]
        prometheus = Prometheus(tmp_path, f"{host}:{port}")
        prometheus.wait_for('up{job="ipw"}', 1.0)
        import concurrent.futures

        asks = [(("smol", "smol-b")[i % 2], f"Name a colour, number {i}.", i % 3 == 0) for i in range(16)]
        for wave in (asks[:8], asks[8:]):  # the second wave's answers carry a provisional energy (on the CPU model
            # none is known before a period of the first was split)
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda a: _chat(proxy.url, *a), wave))
            assert all(a["status"] == 200 for a in answers)
            _settled(proxy, asks.index(wave[-1]) + 1)
        prometheus.wait_for("sum(ipw_requests_total)", len(asks))  # the last scrape after settlement
        energy = prometheus.value("sum(ipw_energy_joules_total)")
        by_model = {r["metric"]["gen_ai_request_model"]: float(r["value"][1])
                    for r in prometheus.query("sum by (gen_ai_request_model) (ipw_requests_total)")}
        time.sleep(3)  # a few more scrapes: the rate() panels see the requests
        panels = {(title, expr): prometheus.query(expr) for title, expr in dashboard_queries()}
        cookbook = {expr: prometheus.query(expr) for expr in cookbook_queries()}  # each parses and runs
        live_power = bool(proxy.session.meter.window.power_w())
    finally:
        if prometheus is not None:
            prometheus.close()
        if proxy is not None:
            proxy.stop()
        backend.close()
    records = _records(proxy)
    assert len(records) == len(asks) and by_model == {"smol": 8.0, "smol-b": 8.0}  # requests: exact
    assert all(r["energy_j"] is not None and r["energy_j"] > 0 for r in records)
    assert any(r["provisional_energy_j"] for r in records)
    folder_j = sum(r["energy_j"] for r in records)
    assert energy == pytest.approx(folder_j, rel=0.005)  # joules: within 0.5% (the exposition prints them exactly)
    # every query of the dashboard parses and runs; each has data (W per device: where a sensor reads live power,
    # which the CPU model of a machine without RAPL does not; errors: where there were some)
    assert panels
    for (title, expr), result in panels.items():
        if "ipw_device_power_watts" in expr and not live_power or "errors" in expr and not any(r["error"] for r in records):
            continue
        assert result, f"dashboard panel {title!r}: {expr} returned no data"
    assert len(cookbook) >= 7 and cookbook[cookbook_queries()[0]], "J per output token per model over 5 minutes"
