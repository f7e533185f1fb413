"""A rescored run against its original: per backend and concurrency level, accuracy before and after, the
records whose score changed, win/tie and the records judged (the table of ``ipw rescore`` and of ``ipw run``'s
judging).  Numbers from the two run folders only, with the metric table's own definitions: ``ipw.grading.rescore``
writes the new folder and never computes metrics (issue 57)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ipw.analysis.load import concurrency_of, parts_of
from ipw.analysis.metrics import point_values
from ipw.results import RunManifest

if TYPE_CHECKING:
    import pandas as pd


def before_after(run: str | Path, manifest: RunManifest, original: pd.DataFrame, new_run: str | Path,
                 new_manifest: RunManifest, rescored: pd.DataFrame) -> list[dict[str, Any]]:
    """Per backend: records, accuracy before and after and win/tie after (the metric table's own
    definitions, ``ipw.analysis.metrics``), records whose score changed, records judged."""
    before = {p.info.label: point_values(p.values) for p in parts_of(Path(run), manifest, original)}
    rows = []
    for part in parts_of(Path(new_run), new_manifest, rescored):  # one per backend and concurrency level
        info, after = part.info, point_values(part.values)

        def of(frame: pd.DataFrame) -> pd.DataFrame:
            mine: pd.DataFrame = frame[(frame["backend"] == info.backend)
                                       & (concurrency_of(frame["concurrency"]) == info.concurrency)]
            return mine

        new = of(rescored)
        merged = of(original).merge(new, on=["query_id", "repeat"], suffixes=("_old", "_new"))
        rows.append({"backend": info.label, "records": len(new), "accuracy_before": before[info.label]["accuracy"],
                     "accuracy_after": after["accuracy"],
                     "changed": int((merged["correct_old"].fillna(-1) != merged["correct_new"].fillna(-1)).sum()),
                     "win_tie": after["win_tie_rate"], "judged": int(new["win_tie"].notna().sum())})
    return rows
