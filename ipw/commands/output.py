"""What the command modules share: standard output, SIGTERM taken as Ctrl-C, and the table of a rescored run
(``ipw rescore``, and ``ipw run`` when its config's [judge] grades the finished run)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rich.console import Console

if TYPE_CHECKING:
    from ipw.grading.spec import JudgeSpec
    from ipw.results import QueryRecord, RunFolder


def stdout() -> Console:
    """Standard output; wide enough for the tables when it is not a terminal (CI logs, pipes)."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    return console


def sigterm_as_interrupt() -> None:
    """SIGTERM stops ``ipw run`` and ``ipw serve`` as gracefully as Ctrl-C: the run folder is finished, then
    marked (a run: interrupted)."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def rescore_run(run: Path, *, scorer: str | None, judge: JudgeSpec | None, out_dir: Path | None,
                progress: Callable[[int, int], None]) -> tuple[RunFolder, list[dict[str, Any]]]:
    """``ipw.grading.rescore.rescore`` and the before/after rows of the two folders; ``progress(done, total)`` after
    each record.  Composed here: the running layer writes the folder, analysis reads both (issue 57)."""
    from ipw.analysis.rescored import before_after
    from ipw.grading.rescore import rescore
    from ipw.results import load_run

    manifest, original = load_run(run)
    done = [0]

    def step(record: QueryRecord) -> None:
        done[0] += 1
        progress(done[0], len(original))

    folder = rescore(run, scorer=scorer, judge=judge, out_dir=out_dir, progress=step)
    _, frame = load_run(folder.path)
    return folder, before_after(run, manifest, original, folder.path, folder.manifest, frame)


def rescore_and_show(run: Path, *, scorer: str | None = None, judge: Any = None, out_dir: Path | None = None) -> Path:
    """Rescore ``run`` (``ipw.grading.rescore.rescore``) with a progress bar, print the before/after table
    (``ipw.analysis.rescored.before_after``) and the judge's cost; returns the new folder."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ipw.analysis import fmt

    console = Console(stderr=True)
    what = f"judging ({judge.grading})" if judge is not None else "rescoring"
    progress = Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                        transient=True)
    task = progress.add_task(what, total=None)

    def advance(n: int, total: int) -> None:
        if not progress.live.is_started:  # at the first record: a run refused before it leaves one line on stderr
            progress.start()
        progress.update(task, completed=n, total=total)

    try:
        folder, rows = rescore_run(run, scorer=scorer, judge=judge, out_dir=out_dir, progress=advance)
    finally:
        if progress.live.is_started:
            progress.stop()
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


def _shown(x: float | None, metric: str) -> str:
    """A metric's value as the metric table shows it, or "unscored" when no record has one (every item needs a
    judge)."""
    from ipw.analysis import fmt
    from ipw.analysis.metrics import BY_NAME

    text = fmt.value(x, BY_NAME[metric].format)
    return "unscored" if text == fmt.NA else text
