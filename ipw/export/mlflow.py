"""MLflow: ``ipw run --mlflow`` and ``ipw export mlflow RUN...`` log each run folder as one MLflow run.

What a run carries: the run config as parameters (flattened: ``generation.max_tokens``, ``backends.0.model``), the
numbers of ``ipw compare RUN --common-queries`` (the same as ``ipw run``'s summary) as metrics, each with its CI
bounds (``BACKEND/accuracy``, ``BACKEND/accuracy_lo``, ``BACKEND/accuracy_hi``; the routing coverage and savings as
``routing/...``), the HTML report (``ipw report``'s, made in a temporary folder) and manifest.json as artifacts, and
the tag ``ipw.run_id``.  Exporting a folder again finds its run by that tag and updates it (no duplicate); MLflow
parameters cannot change, so a parameter already there keeps its value (said in a note when it differs).

The tracking server is ``MLFLOW_TRACKING_URI`` (MLflow's own variable, as its credentials are:
``MLFLOW_TRACKING_TOKEN``, ``MLFLOW_TRACKING_USERNAME``/``_PASSWORD``), the experiment ``MLFLOW_EXPERIMENT_NAME`` or
``ipw``.  :func:`connect` asks the server for the experiment once, without retries, before anything else: unset,
down, or answering something that is not MLflow's API is one line, exit 2.  The URI is only ever shown through
``ipw.sanitize.redact_url``, and the credentials are registered secrets, scrubbed from every message.

Only MLflow's client is needed (``pip install 'ipw[mlflow]'``: mlflow-skinny), imported here lazily.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ipw.errors import IpwError, missing_extra

EXPERIMENT = "ipw"  # the experiment when MLFLOW_EXPERIMENT_NAME names none
TAG = "ipw.run_id"  # the tag that finds a run folder's MLflow run again
CHECK_TIMEOUT_S = 10  # the reachability check: one request, no retry (a server that hangs costs this much)
# the export's requests, unless MLFLOW_HTTP_REQUEST_* say otherwise: MLflow's defaults (7 retries, backoff factor
# 2, 120 s) would keep a finished ipw run waiting ~4 minutes on a server that went down during it
EXPORT_RETRIES = 2
EXPORT_TIMEOUT_S = 30
# what one log_batch call may carry (MLflow's limits: 1000 metrics, 100 params, 1000 entries in all)
BATCH_METRICS = 1000
BATCH_PARAMS = 100
MAX_PARAM_VALUE = 6000  # MLflow's longest parameter value; a longer one is cut, and says so
SECRET_VARIABLES = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_CLIENT_CERT_PATH")
# ipw's run statuses as MLflow's
STATUS = {"complete": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}
_KEY = re.compile(r"[^\w.\- :]")  # MLflow's key characters are [\w.\- :/]; "/" is ipw's separator in keys


def _client_class() -> Any:
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise missing_extra("MLflow's client (mlflow-skinny)", "mlflow") from None
    return MlflowClient


@dataclass(frozen=True)
class Tracker:
    """A tracking server that answered (``connect``): its client, the URI shown redacted, the experiment."""

    client: Any  # mlflow.tracking.MlflowClient
    shown_uri: str
    experiment: str

    def run_url(self, experiment_id: str, run_id: str) -> str:
        """The run's page in MLflow's UI (an http server's), redacted; "" for a local store."""
        if not self.shown_uri.startswith(("http://", "https://")):
            return ""
        return f"{self.shown_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def tracking_uri() -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if not uri:
        raise IpwError("MLFLOW_TRACKING_URI is not set: set it to the MLflow tracking server's URL, e.g. "
                       "export MLFLOW_TRACKING_URI=http://127.0.0.1:5000")
    return uri


def _register_secrets(uri: str) -> None:
    """MLflow's credentials are secrets: scrubbed from every message ipw shows or writes."""
    from urllib.parse import urlsplit

    from ipw.sanitize import register

    for name in SECRET_VARIABLES:
        register(os.environ.get(name, ""))
    with contextlib.suppress(ValueError):
        register(urlsplit(uri).password or "")


@contextlib.contextmanager
def _requests(retries: int, timeout_s: int, *, force: bool) -> Iterator[None]:
    """MLflow's HTTP settings for the calls within (it reads its variables at each request): the variables the
    user set win unless ``force``; MLflow never prints the run's URL (it would show the URI unredacted)."""
    settings = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(retries), "MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout_s),
                "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
    before = {name: os.environ.get(name) for name in settings}
    for name, value in settings.items():
        if force or name == "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT" or before[name] is None:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, old in before.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


_ERRNO = re.compile(r"\[Errno -?\d+\] ([^\"'()]+)")


def _reason(exc: BaseException) -> str:
    """Why an MLflow call failed, short: the socket's error (connection refused, timed out) where there is one,
    else the first sentence of MLflow's message; secrets scrubbed and URLs redacted before it is cut."""
    from ipw.sanitize import message, one_line

    text = one_line(message(str(exc)))
    errno = _ERRNO.search(text)
    if errno:
        return errno.group(1).strip().lower()
    if "timed out" in text.lower():
        return "timed out"
    return text.split(". ")[0][:200]


def _not_mlflow(tracker_uri: str, why: str) -> IpwError:
    from ipw.sanitize import redact_url

    return IpwError(f"MLflow at {redact_url(tracker_uri)} does not answer as an MLflow tracking server ({why}); "
                    "check MLFLOW_TRACKING_URI and that the server runs (mlflow server)")


def connect(experiment: str | None = None) -> Tracker:
    """The tracking server of MLFLOW_TRACKING_URI, checked: the client installed, the URI set, and the server
    answering MLflow's API for the experiment (one request, no retry, ``CHECK_TIMEOUT_S``); else an IpwError."""
    from ipw.sanitize import redact_url

    client_class = _client_class()
    uri = tracking_uri()
    _register_secrets(uri)
    name = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME", "").strip() or EXPERIMENT
    try:
        client = client_class(tracking_uri=uri)
        with _requests(0, CHECK_TIMEOUT_S, force=True):
            found = client.get_experiment_by_name(name)
    except Exception as exc:  # whatever the server (or no server) made MLflow's client raise: it did not answer
        raise _not_mlflow(uri, _reason(exc)) from None
    if found is not None and not getattr(found, "experiment_id", ""):  # e.g. "{}": JSON, but not MLflow's answer
        raise _not_mlflow(uri, "its answer has no experiment")
    return Tracker(client, redact_url(uri), name)


# --- what a run folder logs ---------------------------------------------------------------------------


def key(*parts: str) -> str:
    """An MLflow metric or parameter key of ``parts`` joined by "/": each part's characters that MLflow refuses
    (and "/" itself) are "_"."""
    return "/".join(_KEY.sub("_", p) for p in parts if p)


def params_of(config: dict[str, Any]) -> dict[str, str]:
    """The run config flattened into parameters: nested tables joined by ".", lists of tables by index
    (``backends.0.model``), other lists as JSON; None left out; values scrubbed and URLs in them redacted."""
    from ipw.sanitize import message

    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        elif value is not None:
            text = message(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
            if len(text) > MAX_PARAM_VALUE:
                text = text[: MAX_PARAM_VALUE - 20] + "... (cut by ipw)"
            out[_KEY.sub("_", prefix)] = text

    walk("", config)
    return out


LOGGED_SECTIONS = ("metric", "routing")  # of compare's long format: the metrics table and the routing numbers


def metrics_of(comparison: Any) -> dict[str, float]:
    """The numbers of ``ipw compare`` (its long format, ``ipw.analysis.render.csv_rows``: every metric of every
    backend, and the routing coverage and savings), each with its CI bounds as ``..._lo`` and ``..._hi``;
    a number that is not there (n/a, NaN) is left out."""
    from ipw.analysis.render import csv_rows

    out: dict[str, float] = {}
    for section, backend, where, metric, value, lo, hi in csv_rows(comparison):
        if section not in LOGGED_SECTIONS:
            continue
        name = key("routing" if section == "routing" else "", backend, where, metric)
        for k, v in ((name, value), (f"{name}_lo", lo), (f"{name}_hi", hi)):
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out[k] = float(v)
    return out


def _millis(iso: str | None) -> int | None:
    try:
        return int(dt.datetime.fromisoformat(iso).timestamp() * 1000) if iso else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Exported:
    run_dir: Path
    mlflow_run_id: str
    experiment_id: str
    created: bool  # False: the folder's earlier MLflow run was updated
    notes: tuple[str, ...]


def export(tracker: Tracker, run_dir: str | Path) -> Exported:
    """Log ``run_dir`` as one MLflow run (created, or found by its ``ipw.run_id`` tag and updated). An IpwError
    when the folder cannot be read or the server fails (a one-line reason)."""
    from ipw.analysis.compare import compare
    from ipw.results import RunManifest, manifest_file

    run_dir = Path(run_dir)
    manifest = RunManifest.read(run_dir)
    comparison = compare([run_dir], common_queries=True)  # ipw run's summary, ipw compare's numbers
    metrics = metrics_of(comparison)
    params = params_of(manifest.config or {})
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ipw-mlflow-") as tmp:
        artifacts = [manifest_file(run_dir)]
        try:
            from ipw.analysis.report import write

            report = Path(tmp) / "report.html"
            write([run_dir], report, common_queries=True)
            artifacts.append(report)
        except IpwError as exc:  # e.g. the report extra missing: the numbers are logged all the same
            notes.append(f"no report artifact: {exc.message}")
        try:
            with _requests(EXPORT_RETRIES, EXPORT_TIMEOUT_S, force=False):
                return _log(tracker, run_dir, manifest, params, metrics, artifacts, notes)
        except IpwError:
            raise
        except Exception as exc:  # MLflow's client: the server failed or refused (a reason, one line)
            raise IpwError(f"{run_dir}: not exported to MLflow at {tracker.shown_uri} ({_reason(exc)})") from None


def _log(tracker: Tracker, run_dir: Path, manifest: Any, params: dict[str, str], metrics: dict[str, float],
         artifacts: list[Path], notes: list[str]) -> Exported:
    from mlflow.entities import Metric, Param, RunTag

    client = tracker.client
    experiment = client.get_experiment_by_name(tracker.experiment)
    experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(tracker.experiment)
    run_id = manifest.run_id
    found = [r for r in client.search_runs([experiment_id], filter_string=f"tags.`{TAG}` = '{run_id}'",
                                           max_results=10) if r.data.tags.get(TAG) == run_id]
    from ipw import __version__

    tags = {TAG: run_id, "ipw.status": manifest.status, "ipw.version": __version__}
    if found:
        run = found[0]
        had = run.data.params
        changed = sorted(k for k, v in params.items() if k in had and had[k] != v)
        if changed:
            notes.append(f"MLflow parameters cannot change: the run keeps its earlier {', '.join(changed[:5])}"
                         + (f" and {len(changed) - 5} more" if len(changed) > 5 else ""))
        params = {k: v for k, v in params.items() if k not in had}
    else:
        run = client.create_run(experiment_id, start_time=_millis(manifest.started_at), tags=tags, run_name=run_id)
    mlflow_run_id = run.info.run_id
    now = int(time.time() * 1000)
    client.log_batch(mlflow_run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    items = list(params.items())
    for i in range(0, len(items), BATCH_PARAMS):
        client.log_batch(mlflow_run_id, params=[Param(k, v) for k, v in items[i: i + BATCH_PARAMS]])
    values = list(metrics.items())
    for i in range(0, len(values), BATCH_METRICS):
        client.log_batch(mlflow_run_id, metrics=[Metric(k, v, now, 0) for k, v in values[i: i + BATCH_METRICS]])
    for path in artifacts:
        client.log_artifact(mlflow_run_id, str(path))
    status = STATUS.get(manifest.status)
    if status is not None:  # a run still running stays RUNNING
        client.set_terminated(mlflow_run_id, status, end_time=_millis(manifest.finished_at))
    return Exported(run_dir, mlflow_run_id, experiment_id, not found, tuple(notes))


def exported_line(tracker: Tracker, done: Exported) -> str:
    url = tracker.run_url(done.experiment_id, done.mlflow_run_id)
    return (f"{'exported' if done.created else 'updated'} {done.run_dir} -> MLflow run {done.mlflow_run_id} "
            f"(experiment {tracker.experiment}{', ' + url if url else ''})")


def after_run(tracker: Tracker, run_dir: Path, status: str, say: Callable[[str], None]) -> None:
    """``ipw run --mlflow``, after the run: export its folder; a failure is a warning (the run folder is complete,
    and ``ipw export mlflow`` exports it later), never the run's failure. An unfinished run is not exported."""
    if status != "complete":
        say(f"note: not exported to MLflow: the run is {status}; ipw run --resume --mlflow exports it when it "
            "completes")
        return
    try:
        done = export(tracker, run_dir)
    except Exception as exc:  # an IpwError's reason, or anything else: the run stands either way
        from ipw.sanitize import message, one_line

        why = exc.message if isinstance(exc, IpwError) else f"unexpected {type(exc).__name__}: {exc}"
        say(f"warning: {one_line(message(why))[:500]}; the run folder is complete: retry with "
            f"ipw export mlflow {run_dir}")
        return
    for note in done.notes:
        say(f"note: {note}")
    say(exported_line(tracker, done))
