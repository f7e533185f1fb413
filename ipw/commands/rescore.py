"""``ipw rescore``: score a saved run again (the work: ``ipw.rescore``); ``ipw run`` uses it too, to
grade a run with its config's ``[judge]`` when the run ends."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from ipw.analysis import fmt
from ipw.commands.output import stdout


def rescore_command(run, *, scorer, judge, grading, config, out) -> int:
    from ipw.rescore import judge_spec
    from ipw.results import read_manifest

    manifest = read_manifest(run)  # only its config: the records are read once, by rescore_and_show
    spec = None
    if scorer in (None, "judge") or judge or grading or config:  # --scorer exact: the run's own [judge] stays out
        spec = judge_spec(manifest, judge=judge, grading=grading, config=str(config) if config else None)
    rescore_and_show(run, scorer=scorer, judge=spec, out_dir=out)
    return 0


def rescore_and_show(run, *, scorer=None, judge=None, out_dir=None) -> Path:
    """Rescore ``run`` with a progress bar, print the before/after table and the judge's cost; returns
    the new folder."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ipw.rescore import rescore
    from ipw.results import load_run

    manifest, original = load_run(run)
    console = Console(stderr=True)
    what = f"judging ({judge.grading})" if judge is not None else "rescoring"
    with Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        task = progress.add_task(what, total=len(original))
        folder = rescore(run, scorer=scorer, judge=judge, out_dir=out_dir,
                         progress=lambda record: progress.advance(task))
    _, frame = load_run(folder.path)
    rows = summary(run, manifest, original, folder.path, folder.manifest, frame)
    judged = any(row["judged"] for row in rows)
    rescored_from = folder.manifest.rescored_from
    assert rescored_from is not None  # rescore() writes it
    title = rescored_from["scorer"] + (f", win/tie vs {judge.vs_backend}" if judged else "")
    table = Table(title=f"ipw rescore: {title}")
    columns = ["backend", "records", "accuracy before", "accuracy after", "changed"]
    for col in columns + (["win/tie", "judged"] if judged else []):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for row in rows:
        cells = [row["backend"], str(row["records"]), _shown(row["accuracy_before"], "accuracy"),
                 _shown(row["accuracy_after"], "accuracy"), str(row["changed"])]
        if judged:
            cells += [_shown(row["win_tie"], "win_tie_rate"), str(row["judged"])]
        table.add_row(*cells)
    stdout().print(table)
    judge_info = folder.manifest.judge or {}
    totals = judge_info.get("totals")
    if totals:
        energy = "n/a" if totals["energy_j"] is None else f"{fmt.value(totals['energy_j'])} J"
        console.print(f"judge {judge_info['backend']['name']} ({judge_info['prompt_version']}): "
                      f"{totals['calls']} calls, {totals['prompt_tokens']} + {totals['completion_tokens']} tokens, "
                      f"{energy}, {totals['unparsed']} unparsed (in judge.jsonl, not in the records' energy)",
                      highlight=False, markup=False)
    console.print(f"wrote {folder.path} (rescored from {run})", highlight=False, markup=False)
    return folder.path


def summary(run, manifest, original, new_run, new_manifest, rescored) -> list[dict]:
    """Per backend: records, accuracy before and after and win/tie after (the metric table's own
    definitions, ``ipw.analysis.metrics``), records whose score changed, records judged."""
    from ipw.analysis.load import concurrency_of, parts_of
    from ipw.analysis.metrics import point_values

    before = {p.info.label: point_values(p.values) for p in parts_of(run, manifest, original)}
    rows = []
    for part in parts_of(new_run, new_manifest, rescored):  # one per backend and concurrency level
        info, after = part.info, point_values(part.values)

        def of(frame):
            return frame[(frame["backend"] == info.backend) & (concurrency_of(frame["concurrency"]) == info.concurrency)]

        new = of(rescored)
        merged = of(original).merge(new, on=["query_id", "repeat"], suffixes=("_old", "_new"))
        rows.append({"backend": info.label, "records": len(new), "accuracy_before": before[info.label]["accuracy"],
                     "accuracy_after": after["accuracy"],
                     "changed": int((merged["correct_old"].fillna(-1) != merged["correct_new"].fillna(-1)).sum()),
                     "win_tie": after["win_tie_rate"], "judged": int(new["win_tie"].notna().sum())})
    return rows


def _shown(x: float | None, metric: str) -> str:
    """A metric's value as the metric table shows it, or "unscored" when no record has one (every item needs a
    judge)."""
    from ipw.analysis.metrics import BY_NAME

    text = fmt.value(x, BY_NAME[metric].format)
    return "unscored" if text == fmt.NA else text
