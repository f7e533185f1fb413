"""Prometheus metrics (ipw/export/prometheus.py, issue 56): the in-process registry for the names, the bounded
labels and settled-only counting; ``ipw run --metrics-port``; and Debian's real ``prometheus`` server (installed by
``.ci/setup --dev``) scraping ``ipw serve`` in front of the real llama-server every second, its HTTP API's totals
checked against the run folder, and the Grafana dashboard's queries run through it."""

from __future__ import annotations

import json
import math
import socket
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from runfolders import record
from scripted import ScriptedBackend

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ipw.export.prometheus import MAX_LABEL_VALUES, OTHER, Metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "guide" / "grafana-ipw.json"


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
    # a value a counter cannot hold (NaN, negative) is not counted, and never breaks the writer that observes it
    metrics.observe(record(energy_j=math.nan))
    metrics.observe(record(energy_j=-1.0))
    text = scrape(metrics)
    assert total(text, "ipw_energy_joules_total") == 3.875 and total(text, "ipw_requests_total") == 5


def test_a_hostile_client_cannot_blow_up_the_series_count():
    """Each label keeps its first MAX_LABEL_VALUES values; every later one is counted under "other", nothing
    lost; a value is one line of at most 120 characters."""
    metrics = Metrics(operation=True)
    for i in range(500):
        metrics.observe(record(energy_j=1.0, category="chat"), model=f"model-{i}")
    metrics.observe(record(energy_j=1.0, category="chat"), model="evil\n" + "x" * 10_000)
    text = scrape(metrics)
    models = {dict(ls)["gen_ai_request_model"] for (n, ls) in samples(text) if n == "ipw_requests_total"}
    assert len(models) == MAX_LABEL_VALUES + 1 and OTHER in models
    assert total(text, "ipw_requests_total") == 501 and total(text, "ipw_energy_joules_total") == 501.0
    assert total(text, "ipw_requests_total", gen_ai_request_model=OTHER) == 501 - MAX_LABEL_VALUES
    assert len(text) < 200_000  # bounded whatever the clients send
    small = Metrics()
    small.observe(record(), model="evil\n\u202e" + "x" * 500)
    (model,) = {dict(ls)["gen_ai_request_model"] for (n, ls) in samples(scrape(small)) if n == "ipw_requests_total"}
    assert "\n" not in model and "\u202e" not in model and len(model) == 120


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
