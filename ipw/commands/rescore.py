"""``ipw rescore``: score a saved run again (the work: ``ipw.rescore``)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ipw.commands.output import stdout


def rescore_command(run, *, scorer, judge, grading, config, out) -> int:
    from ipw.rescore import judge_spec, rescore, summary
    from ipw.results import load_run

    manifest, original = load_run(run)
    spec = judge_spec(manifest, judge=judge, grading=grading, config=str(config) if config else None)
    console = Console(stderr=True)
    folder = rescore(run, scorer=scorer, judge=spec, out_dir=out)
    _, frame = load_run(folder.path)
    table = Table(title=f"ipw rescore: {folder.manifest.rescored_from['scorer']}")
    for col in ("backend", "records", "accuracy before", "accuracy after", "changed"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for row in summary(original, frame):
        table.add_row(row["backend"], str(row["records"]), f"{row['accuracy_before']:.1%}",
                      f"{row['accuracy_after']:.1%}", str(row["changed"]))
    stdout().print(table)
    totals = (folder.manifest.judge or {}).get("totals")
    if totals:
        energy = "n/a" if totals["energy_j"] is None else f"{totals['energy_j']:.3g} J"
        console.print(f"judge {folder.manifest.judge['backend']['name']} ({folder.manifest.judge['prompt_version']}): "
                      f"{totals['calls']} calls, {totals['prompt_tokens']} + {totals['completion_tokens']} tokens, "
                      f"{energy}, {totals['unparsed']} unparsed (in judge.jsonl, not in the records' energy)",
                      highlight=False, markup=False)
    console.print(f"wrote {folder.path} (rescored from {run})")
    return 0
