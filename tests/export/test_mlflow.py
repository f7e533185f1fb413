"""MLflow export (issue 56, point 3): ``ipw export mlflow`` and ``ipw run --mlflow`` against a REAL ``mlflow server``
on 127.0.0.1 (one per module: SQLite store and artifacts in a temporary folder), read back through MLflow's own
client; a server that is down, one that answers junk, and one that fails after the run has started."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from openai_stub import Stub, stub_config
from runfolders import write_run

SECRET = "mlflow-tok-3f9a7c1e5b"  # MLFLOW_TRACKING_TOKEN and the URI's password: in no file and no output
START_S = 240.0  # the server's start on a loaded 2-core machine (12-60 s seen)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real MLflow tracking server; its URL."""
    pytest.importorskip("mlflow", reason="MLflow is not installed (pip install 'ipw[mlflow]'; .ci/setup --dev "
                        "installs the server too)")
    store = tmp_path_factory.mktemp("mlflow-store")
    port = _free_port()
    log = open(store / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
                             "--artifacts-destination", str(store / "artifacts"), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # its workers: one group
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.read().strip() == b"OK":
                        break
            except OSError:
                pass
            tail = (store / "server.log").read_bytes()[-3000:].decode(errors="replace")
            assert proc.poll() is None, f"mlflow server exited ({proc.returncode}):\n{tail}"
            assert time.monotonic() < deadline, f"mlflow server not up after {START_S:g} s:\n{tail}"
            time.sleep(0.5)
        yield url, store
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture
def uses(monkeypatch, request):
    """MLFLOW_TRACKING_URI (with the secret as its password) and the token set; an experiment of the test's own."""

    def set_uri(url: str) -> None:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url.replace("http://", f"http://ipw:{SECRET}@"))
        monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", SECRET)
        monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"ipw-{request.node.name}"[:200])

    return set_uri


def _client(url: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=url)


def _runs(url: str, experiment: str, run_id: str) -> list:
    client = _client(url)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id], f"tags.`ipw.run_id` = '{run_id}'")


def _no_secret(*places: Path | str) -> None:
    for place in places:
        if isinstance(place, Path):
            for path in [place] if place.is_file() else place.rglob("*"):
                if path.is_file():
                    assert SECRET.encode() not in path.read_bytes(), path
        else:
            assert SECRET not in place


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _two_backend_run(out: Path) -> Path:
    """A run folder of a local and a cloud backend (so routing has coverage and savings)."""
    return write_run(out, "mlflow-two", {
        "small": {"correct": [1, 0, 1, 1, 0, 1], "energy": [2.0, 3.0, 2.5, 1.5, 2.2, 1.8], "role": "local"},
        "big": {"correct": [1, 1, 1, 0, 1, 1], "energy": [9.0, 8.0, 7.0, 10.0, 8.5, 9.5], "role": "cloud"},
    })


def _stub_config(tmp_path: Path, stub: Stub) -> Path:
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Say {i}", "answer": "42"}) + "\n" for i in range(4)))
    return stub_config(tmp_path / "run.toml", data, stub.base_url, out_dir=tmp_path / "out")


@pytest.fixture(scope="module")
def stub():
    s = Stub()
    yield s
    s.close()


# --- a real server --------------------------------------------------------------------------------------------


def test_export_logs_the_config_the_compare_numbers_and_the_artifacts(server, uses, run_cli, tmp_path):
    url, store = server
    uses(url)
    run = _two_backend_run(tmp_path / "res")
    code, out, err = run_cli("export", "mlflow", run)
    assert code == 0, err
    assert "exported" in err and "http://***@127.0.0.1" in err  # the run's page, the URI redacted
    (logged,) = _runs(url, os.environ["MLFLOW_EXPERIMENT_NAME"], "mlflow-two")
    assert logged.info.status == "FINISHED" and logged.info.run_name == "mlflow-two"

    # every number of ipw compare, with its CI bounds; routing's coverage and savings
    code, shown, _ = run_cli("compare", run, "--common-queries", "--format", "json")
    assert code == 0
    doc = json.loads(shown)
    metrics = logged.data.metrics
    checked = 0
    for b in doc["backends"]:
        for name, est in b["metrics"].items():
            for suffix, part in (("", "value"), ("_lo", "lo"), ("_hi", "hi")):
                k = f"{b['label']}/{name}{suffix}"
                if est is None or est[part] is None:
                    assert k not in metrics
                else:
                    assert metrics[k] == pytest.approx(est[part], rel=1e-12), k
                    checked += 1
    for name in ("accuracy", "energy_per_query_j", "ipj", "ipw", "j_per_output_token"):
        assert {f"small/{name}", f"small/{name}_lo", f"small/{name}_hi"} <= set(metrics)
    r = doc["routing"]
    assert metrics["routing/local_coverage"] == pytest.approx(r["local_coverage"]["value"])
    assert metrics["routing/local_coverage_lo"] == pytest.approx(r["local_coverage"]["lo"])
    saved = r["oracle"]["energy"]["saved_fraction"]
    assert metrics["routing/oracle_energy_saved_fraction"] == pytest.approx(saved["value"])
    assert metrics["routing/oracle_energy_saved_fraction_hi"] == pytest.approx(saved["hi"])
    assert checked > 30

    # the artifacts: the folder's manifest as it is, and ipw's HTML report
    client = _client(url)
    assert {a.path for a in client.list_artifacts(logged.info.run_id)} == {"manifest.json", "report.html"}
    got = Path(client.download_artifacts(logged.info.run_id, "manifest.json", str(tmp_path)))
    assert got.read_bytes() == (run / "manifest.json").read_bytes()
    html = Path(client.download_artifacts(logged.info.run_id, "report.html", str(tmp_path))).read_text()
    assert html.startswith("<!DOCTYPE html>") and "mlflow-two" in html

    # exported again: the same MLflow run, updated, not a second one
    code, _, err = run_cli("export", "mlflow", run)
    assert code == 0 and "updated" in err, err
    assert [x.info.run_id for x in _runs(url, os.environ["MLFLOW_EXPERIMENT_NAME"], "mlflow-two")] == \
        [logged.info.run_id]
    _no_secret(run, store, out, err)


def test_ipw_run_mlflow_logs_the_finished_run(server, uses, stub, run_cli, tmp_path):
    url, store = server
    uses(url)
    code, out, err = run_cli("run", _stub_config(tmp_path, stub), "--mlflow")
    assert code == 0, err
    (run,) = (tmp_path / "out").iterdir()
    assert "exported" in err and str(run) in err
    (logged,) = _runs(url, os.environ["MLFLOW_EXPERIMENT_NAME"], run.name)
    params = logged.data.params
    assert params["backends.0.kind"] == "openai" and params["generation.max_tokens"] == "4"
    assert params["backends.0.name"] == "stub" and params["warmup"] == "0"
    assert logged.data.metrics["stub/accuracy"] == 1.0 and "stub/energy_per_query_j_hi" in logged.data.metrics
    _no_secret(run, store, out, err)


def test_a_server_that_fails_after_the_run_started_costs_a_warning_and_export_retries(server, uses, stub, run_cli,
                                                                                      tmp_path):
    url, store = server
    junk = Junk(answer_check=True)  # answers the check before the run as MLflow does, then junk
    try:
        uses(junk.url)
        code, out, err = run_cli("run", _stub_config(tmp_path, stub), "--mlflow")
    finally:
        junk.close()
    assert code == 0, err  # the run stands
    (run,) = (tmp_path / "out").iterdir()
    assert json.loads((run / "manifest.json").read_text())["status"] == "complete"
    assert len((run / "records.jsonl").read_text().splitlines()) == 4
    (warning,) = [line for line in err.splitlines() if line.startswith("warning:")]
    assert f"retry with ipw export mlflow {run}" in warning and "not exported to MLflow" in warning
    uses(url)  # the server is back: the retry the warning names
    code, _, err = run_cli("export", "mlflow", run)
    assert code == 0, err
    assert len(_runs(url, os.environ["MLFLOW_EXPERIMENT_NAME"], run.name)) == 1
    _no_secret(run, out, err, warning)


# --- faults: one line, exit 2, before anything ----------------------------------------------------------------


class Junk:
    """A tiny HTTP server on 127.0.0.1 that answers every request 200 with junk (``answer_check``: MLflow's answer
    to the experiment lookup first, junk to everything after it)."""

    def __init__(self, answer_check: bool = False, body: bytes = b"<html>\x1b[31mnot \x00 MLflow</html>") -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                text = body
                if answer_check and "experiments/get-by-name" in self.path:
                    text = json.dumps({"experiment": {"experiment_id": "1", "name": "x", "lifecycle_stage": "active",
                                                      "artifact_location": "mlflow-artifacts:/1"}}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            do_GET = do_POST = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("body", [b"<html>\x1b[31mnot \x00 MLflow</html>", b"{}"], ids=["junk", "empty-json"])
def test_a_server_that_answers_junk_is_one_line(uses, run_cli, tmp_path, body):
    pytest.importorskip("mlflow", reason="MLflow is not installed")
    junk = Junk(body=body)
    try:
        uses(junk.url)
        run = _two_backend_run(tmp_path / "res")
        code, out, err = run_cli("export", "mlflow", run)
    finally:
        junk.close()
    assert code == 2
    line = _one_line(err)
    assert "does not answer as an MLflow tracking server" in line and "http://***@127.0.0.1" in line
    assert "\x1b" not in line and "\x00" not in line
    _no_secret(run, out, err)


def test_a_server_that_is_down_is_one_line_and_ipw_run_starts_nothing(uses, stub, run_cli, tmp_path):
    pytest.importorskip("mlflow", reason="MLflow is not installed")
    uses(f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    run = _two_backend_run(tmp_path / "res")
    t0 = time.monotonic()
    code, out, err = run_cli("export", "mlflow", run)
    assert code == 2
    assert "connection refused" in _one_line(err)
    assert time.monotonic() - t0 < 60  # no retries with backoff (MLflow's default waits ~4 minutes)
    code, out2, err2 = run_cli("run", _stub_config(tmp_path, stub), "--mlflow")
    assert code == 2 and "connection refused" in _one_line(err2)
    assert not (tmp_path / "out").exists()  # checked before the run folder
    _no_secret(run, out, err, out2, err2)


def test_no_tracking_uri_is_one_line(monkeypatch, run_cli, tmp_path):
    pytest.importorskip("mlflow", reason="MLflow is not installed")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    code, _, err = run_cli("export", "mlflow", _two_backend_run(tmp_path / "res"))
    assert code == 2 and "MLFLOW_TRACKING_URI is not set" in _one_line(err)


def test_without_the_client_the_error_names_the_extra(monkeypatch, run_cli, tmp_path):
    for name in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    code, _, err = run_cli("export", "mlflow", _two_backend_run(tmp_path / "res"))
    assert code == 2 and "pip install 'ipw[mlflow]'" in _one_line(err)


def test_a_bad_run_folder_is_refused_before_the_server_is_asked(monkeypatch, run_cli, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    code, _, err = run_cli("export", "mlflow", tmp_path / "nope")
    assert code == 2 and "nope" in _one_line(err)


def test_metric_keys_keep_to_mlflow_characters():
    from ipw.export.mlflow import key, params_of

    assert key("", "a<b>/c", "", "accuracy") == "a_b__c/accuracy"
    params = params_of({"backends": [{"name": "x", "base_url": f"http://u:{SECRET}@h/v1"}], "stop": ["a"],
                        "judge": None})
    assert params == {"backends.0.name": "x", "backends.0.base_url": "http://***@h/v1", "stop": '["a"]'}
