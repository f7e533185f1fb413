"""``ipw rescore``: score a saved run again (the work: ``ipw.grading.rescore``; the table: ``commands.output``)."""

from __future__ import annotations

from pathlib import Path

from ipw.commands.output import rescore_and_show
from ipw.options import RescoreOptions


def rescore_command(run: Path, options: RescoreOptions) -> int:
    from ipw.grading.rescore import judge_spec
    from ipw.results import read_manifest

    manifest = read_manifest(run)  # only its config: the records are read once, by rescore_run
    spec = None
    if options.scorer in (None, "judge") or options.judge or options.grading or options.config:
        # --scorer exact: the run's own [judge] stays out
        spec = judge_spec(manifest, judge=options.judge, grading=options.grading,
                          config=str(options.config) if options.config else None)
    rescore_and_show(run, scorer=options.scorer, judge=spec, out_dir=options.out)
    return 0
