"""``ipw rescore``: score a saved run again, without running inference, into a new linked run folder.

The new folder holds the same records with ``scorer`` and ``correct`` recomputed; every other field,
energy included, is copied unchanged.  Its manifest copies the original's (config, dataset, hardware,
backends and their idle baselines) and adds ``rescored_from`` (the original run id and path, the
scorer).  With the ``judge`` scorer, each judge call's tokens, energy and cost go to ``judge.jsonl``
(one line per record) and the manifest's ``judge`` summary, never into the records' energy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, cast

from ipw import __version__
from ipw.errors import IpwError
from ipw.grading.spec import JudgeSpec
from ipw.grading.judge import Judge, Verdict
from ipw.results import JudgeEntry, QueryRecord, RunFolder, RunManifest, load_run, new_run_id
from ipw.grading.scoring import SCORERS, record_score

if TYPE_CHECKING:
    import pandas as pd

MCQ_TAIL = "\nAnswer with the letter of the correct option."  # what Query.render appends
_OPTION = re.compile(r"^\(([A-Z])\) (.*)$")
_NOT_COPIED = ("schema_version", "run_id", "status", "finished_at", "reason", "resumed_at", "rescored_from",
               "rescored_at", "judge", "command", "ipw_version")


def choices_from_prompt(prompt: str) -> tuple[str, ...] | None:
    """The options of a rendered multiple-choice prompt (``(A) text`` lines), or None."""
    if not prompt.endswith(MCQ_TAIL):
        return None
    lines = prompt[: -len(MCQ_TAIL)].split("\n")
    options: list[str] = []
    for line in reversed(lines):
        m = _OPTION.match(line)
        if not m:
            return None
        options.append(m.group(2))
        if m.group(1) == "A":
            break
    options.reverse()
    if [f"({chr(65 + i)})" for i in range(len(options))] != [ln[:3] for ln in lines[len(lines) - len(options):]]:
        return None
    return tuple(options)


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """A records frame's rows (pandas types a row's keys as any hashable; here they are field names)."""
    return cast(list[dict[str, Any]], frame.to_dict(orient="records"))


def _reference_text(answer: str, choices: tuple[str, ...] | None) -> str:
    letter = answer.strip().upper()
    if choices and len(letter) == 1 and ord(letter) - 65 < len(choices):
        return f"({letter}) {choices[ord(letter) - 65]}"
    return answer


def judge_entry(row: dict[str, Any], judge: Judge, verdict: Verdict | str) -> JudgeEntry:
    """One ``judge.jsonl`` entry: what the judge cost for one record (a string verdict: not judged, and why)."""
    calls = verdict.calls if isinstance(verdict, Verdict) else ()
    energies = [c.energy_j for c in calls]
    p_tok, c_tok = sum(c.prompt_tokens for c in calls), sum(c.completion_tokens for c in calls)
    return JudgeEntry(
        backend=row["backend"], query_id=row["query_id"], repeat=int(row["repeat"]), category=row["category"] or "",
        judge=judge.spec.backend.name, judge_model=judge.spec.backend.model, grading=judge.spec.grading,
        vs_backend=judge.spec.vs_backend, prompt_version=judge.prompt.version,
        correct=isinstance(verdict, Verdict) and verdict.correct,
        verdicts=tuple(verdict.verdicts) if isinstance(verdict, Verdict) else (verdict,),
        judge_outputs=tuple(c.output for c in calls), judge_errors=tuple(c.error for c in calls if c.error),
        judge_calls=len(calls), judge_prompt_tokens=p_tok, judge_completion_tokens=c_tok,
        judge_latency_s=sum(c.latency_s for c in calls),
        judge_energy_j=None if not calls or None in energies else sum(e for e in energies if e is not None),
        judge_energy_quality=",".join(sorted({c.energy_quality for c in calls})) or None,
        judge_energy_source=",".join(sorted({c.energy_source for c in calls if c.energy_source})) or None,
        judge_cost_usd=judge.cost_usd(p_tok, c_tok) if calls else None,
    )


def judge_spec(manifest: dict[str, Any], *, judge: str | None = None, grading: str | None = None,
               config: str | None = None) -> JudgeSpec | None:
    """The judge ``ipw rescore`` uses: ``--judge`` (KIND:MODEL or a backend name of the run's config),
    else ``--config``'s [judge] table, else the run's own [judge] table; ``--grading`` overrides its
    grading (and then its prompt, when that was another grading's default).  None: no judge given."""
    from ipw.backends.base import BackendSpec
    from ipw.inputs.config import load_judge_config
    from ipw.grading.spec import check_grading
    from ipw.grading.judge import judge_from_cli

    run_config = manifest.get("config") or {}
    if judge:
        spec = judge_from_cli(judge, tuple(BackendSpec(**b) for b in run_config.get("backends", [])))
    elif config:
        spec = load_judge_config(config)
    elif run_config.get("judge"):
        spec = JudgeSpec.from_dict(run_config["judge"])
    else:
        spec = None
    if grading is not None:
        if spec is None:
            raise IpwError("--grading applies to the judge: give --judge KIND:MODEL or --config with a [judge] table")
        if grading != spec.grading:
            spec = dataclasses.replace(spec, grading=check_grading(grading, "--grading"), prompt="")
    return spec


def rescore(
    run_dir: str | Path, *, scorer: str | None = None, judge: JudgeSpec | None = None,
    out_dir: str | Path | None = None, command: list[str] | None = None,
    progress: Callable[[QueryRecord], None] | None = None, probe: Callable | None = None,
) -> RunFolder:
    """Score every record of ``run_dir`` again: with ``scorer`` (one of SCORERS or ``judge``), or
    with each record's own scorer when None.  Error records stay 0.  A ``vs-backend:NAME`` judge keeps
    the dataset scores and adds ``win_tie`` against backend NAME's answers.  Returns the new run folder."""
    vs = judge.vs_backend if judge is not None else None
    if judge is not None and scorer is None and vs is None:
        scorer = "judge"
    if scorer is not None and scorer != "judge" and scorer not in SCORERS:
        raise IpwError(f"--scorer {scorer!r}: unknown scorer (known: {', '.join(sorted(SCORERS))}, judge)")
    if judge is not None and vs is None and scorer != "judge":
        raise IpwError(f"--judge applies to --scorer judge, not to --scorer {scorer}")
    manifest, frame = load_run(run_dir)
    if frame.empty:
        raise IpwError(f"{run_dir}: the run has no records to score")
    if scorer == "judge":
        judge = judge or judge_spec(manifest.to_dict())
        if judge is None:
            raise IpwError("--scorer judge needs a judge: --judge KIND:MODEL (or a backend name), or a [judge] "
                           "table in --config or in the run's config")
        vs = judge.vs_backend
        if vs is not None:
            raise IpwError(f"--scorer judge grades against the dataset's answers; vs-backend:{vs} keeps them and "
                           "adds win/tie coverage: leave out --scorer")
    references: dict[tuple[str, int], dict[str, Any]] = {}
    if vs is not None:
        if vs not in set(frame["backend"]):
            raise IpwError(f"vs-backend:{vs}: the run has no backend {vs!r} (backends: "
                           f"{', '.join(sorted(set(frame['backend'])))})")
        references = {(r["query_id"], int(r["repeat"])): dataclasses.asdict(QueryRecord.from_row(r))
                      for r in _records(frame[frame["backend"] == vs])}
    judge_ctx = Judge(judge, probe=probe) if judge is not None else None  # checks prompt and model first
    kept = RunManifest.from_dict({k: v for k, v in manifest.to_dict().items() if k not in _NOT_COPIED}
                                 | {"run_id": manifest.run_id})
    run_id = new_run_id()
    folder = RunFolder.create(out_dir or Path(run_dir).parent, run_id, dataclasses.replace(
        kept, run_id=run_id, ipw_version=__version__, command=list(command if command is not None else sys.argv),
        rescored_from={"run_id": manifest.run_id, "path": str(Path(run_dir).resolve()),
                       "status": manifest.status, "scorer": scorer or "per-record (as recorded)",
                       **({"vs_backend": vs} if vs else {})},
        rescored_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    ))
    folder.copy_power(run_dir)
    updates: dict[str, Any] = {}
    try:
        with contextlib.ExitStack() as stack:
            if judge_ctx is not None:
                judge_ctx.backend.attach(folder.path)  # e.g. a managed server's log
                stack.enter_context(judge_ctx)
                folder.start_judge()
                updates["judge"] = judge_ctx.describe()
            for raw in _records(frame):
                record = _rescore_one(dataclasses.asdict(QueryRecord.from_row(raw)), scorer, judge_ctx, folder,
                                      references)
                folder.append(record)
                if progress:
                    progress(record)
    except BaseException as exc:
        folder.finish("interrupted", reason=f"{type(exc).__name__}: {exc}", **updates)
        raise
    if judge_ctx is not None:
        updates["judge"]["totals"] = judge_totals(folder.read_judge())
    folder.finish("complete", **updates)
    return folder


def _rescore_one(row: dict[str, Any], scorer: str | None, judge: Judge | None, folder: RunFolder,
                 references: dict[tuple[str, int], dict[str, Any]]) -> QueryRecord:
    """One record scored again.  With a reference/pairwise judge, the judge decides ``correct``; with a
    ``vs-backend`` judge, ``correct`` keeps the dataset score and the judge decides ``win_tie`` against
    the reference backend's answer to the same query (``references``: (query_id, repeat) -> its row)."""
    name = scorer or row["scorer"]
    choices = row["choices"] or choices_from_prompt(row["prompt"])  # runs before records kept choices
    # coverage fields come only from a vs-backend judge in this rescore (the old judge's log is not copied)
    extra: dict[str, Any] = {"win_tie": None, "vs_backend": "", "judge_verdicts": ()}
    if judge is not None and judge.spec.vs_backend is None:
        answer = (row["answer"] or "").strip()
        verdict = _judge(judge, row, _reference_text(answer, choices) if answer else None, folder)
        correct = float(isinstance(verdict, Verdict) and verdict.correct) if answer else None  # no answer: unscored
    else:
        correct = record_score(name, row["output"], row["answer"], choices if name == "mcq" else None,
                               row["error"] is not None)
    if judge is not None and judge.spec.vs_backend is not None:
        vs = judge.spec.vs_backend
        extra["vs_backend"] = vs
        if row["backend"] != vs:  # the reference itself is not judged against itself (its fields stay empty)
            ref = references.get((row["query_id"], row["repeat"])) or references.get((row["query_id"], 0))
            usable = ref is not None and ref["error"] is None and (ref["output"] or "").strip()
            verdict = _judge(judge, row, ref["output"] if ref is not None and usable else None, folder)
            extra["win_tie"] = None if verdict == "unscored" else float(isinstance(verdict, Verdict) and verdict.correct)
            extra["judge_verdicts"] = verdict.verdicts if isinstance(verdict, Verdict) else (verdict,)
    return QueryRecord(**{**row, **extra, "run_id": folder.manifest.run_id, "scorer": name, "correct": correct})


def _judge(judge: Judge, row: dict[str, Any], reference: str | None, folder: RunFolder) -> Verdict | str:
    """Grade ``row``'s output against ``reference`` and log the cost to judge.jsonl.  Not judged: "error"
    and "empty" (both count as not covered), "unscored" (no reference to compare with)."""
    verdict: Verdict | str
    if row["error"] is not None:
        verdict = "error"
    elif not (row["output"] or "").strip():
        verdict = "empty"
    elif reference is None:
        verdict = "unscored"
    else:
        verdict = judge.grade(row["prompt"], reference, row["output"])
    folder.append_judge(judge_entry(row, judge, verdict))
    return verdict


def judge_totals(entries: list[JudgeEntry]) -> dict[str, Any]:
    """Sums over a run's judge entries: calls, tokens, energy (None if any call's is unavailable), cost."""
    judged = [e for e in entries if e.judge_calls]
    energies = [e.judge_energy_j for e in judged]
    costs = [e.judge_cost_usd for e in judged]
    return {
        "records": len(entries), "judged": len(judged), "calls": sum(e.judge_calls for e in entries),
        "prompt_tokens": sum(e.judge_prompt_tokens for e in entries),
        "completion_tokens": sum(e.judge_completion_tokens for e in entries),
        "energy_j": None if None in energies else sum(energies),
        "cost_usd": None if None in costs or not costs else sum(costs),
        "unparsed": sum("unparsed" in e.verdicts for e in entries),
    }
