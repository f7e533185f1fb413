"""``ipw export mlflow RUN...``: existing run folders into MLflow (``ipw.export.mlflow``)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from ipw.options import MlflowExportOptions


def mlflow_command(runs: list[Path], options: MlflowExportOptions) -> int:
    """Every folder is read before the server is asked, and the server is asked before anything is logged: a bad
    folder, an unset MLFLOW_TRACKING_URI or a server that does not answer is one line, exit 2, nothing logged."""
    from ipw.export import mlflow
    from ipw.results import RunManifest

    for run in runs:
        RunManifest.read(run)
    tracker = mlflow.connect(options.experiment)
    console = Console(stderr=True)
    for run in runs:
        done = mlflow.export(tracker, run)
        for note in done.notes:
            console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
        console.print(mlflow.exported_line(tracker, done), highlight=False, markup=False, soft_wrap=True)
    return 0
