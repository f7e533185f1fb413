"""``ipw check``: the regression gate's commands, one per mode: a pair of run folders, the interleaved job
(``--rerun``) and the noise floor (``--calibrate``); the statistics: ``ipw.analysis.check``."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ipw.commands.output import stdout
from ipw.errors import IpwError
from ipw.options import CheckOutputs, GateOptions, RerunOptions, naming_flags
from ipw.sanitize import github_escape, one_line


def _change_unit(name: str) -> str:
    """The change unit of a gated metric of ``ipw check --calibrate``'s floors."""
    from ipw.analysis.metrics import gated_metric

    metric = gated_metric(name)
    assert metric is not None  # the floors are by gated metric
    return metric.change_unit


@naming_flags
def pair_command(base: Path, cand: Path, gate: GateOptions, outputs: CheckOutputs) -> int:
    """``ipw check BASELINE CANDIDATE``: two run folders, judged by ``ipw.analysis.check.check_runs``."""
    from ipw.analysis import check as verdict
    from ipw.results import load_run

    thresholds, floors = _gate(gate, outputs)
    base_manifest, base_records = load_run(base, require=("dataset.fingerprint",))
    cand_manifest, cand_records = load_run(cand, require=("dataset.fingerprint",))
    result = verdict.check_runs(base_manifest, base_records, cand_manifest, cand_records, thresholds, alpha=gate.alpha,
                                strict=gate.strict, allow_hardware_mismatch=gate.allow_hardware_mismatch,
                                floors=floors, work_gate=gate.work_gate, energy_basis=gate.energy_basis)
    return _show(result, gate, outputs)


@naming_flags
def rerun_command(base: Path, cand: Path, gate: GateOptions, outputs: CheckOutputs, rerun: RerunOptions) -> int:
    """``ipw check --rerun BASELINE.toml CANDIDATE.toml``: the interleaved job (``ipw.running.interleave.run_job``), judged
    by ``ipw.analysis.check.check_interleaved``."""
    from ipw.analysis.check import check_interleaved
    from ipw.running.interleave import job_plan, run_job

    if gate.energy_basis != "chip":
        raise IpwError("--energy-basis: with --rerun only chip (the interleaved blocks are judged on the chip's joules)")
    plan = job_plan(rerun.blocks, rerun.shards)  # a usage error before anything runs
    thresholds, floors = _gate(gate, outputs)
    blocks = run_job((base, cand), plan, n_shards=rerun.shards, out=rerun.out,
                     pythons=(rerun.base_python, rerun.cand_python), backends=rerun.backend, limit=rerun.limit,
                     progress=Console(stderr=True).print)
    result = check_interleaved(blocks, thresholds, alpha=gate.alpha, strict=gate.strict, floors=floors,
                               work_gate=gate.work_gate)
    return _show(result, gate, outputs)


@naming_flags
def calibrate_command(paths: list[Path], gate: GateOptions) -> int:
    """``ipw check --calibrate RUN...``: the noise floor of identical runs (``ipw.analysis.check.calibrate``),
    written to ``--floor``."""
    from ipw.analysis import check as verdict
    from ipw.analysis import fmt
    from ipw.results import RunManifest, load_run

    floor = gate.floor
    assert floor is not None  # --calibrate requires --floor (ipw.options)
    thresholds = _thresholds(gate)
    _check_writable(floor, "--floor")
    runs: list[tuple[RunManifest, object]] = [load_run(p, require=("dataset.fingerprint",)) for p in paths]
    data = verdict.calibrate(runs, thresholds)
    _write_text(floor, json.dumps(data, indent=2) + "\n", "--floor")
    for backend, by in data["floors"].items():
        stdout().print(f"{backend}: " + ", ".join(
            f"{m} ±{fmt.change(x, _change_unit(m), sign=False)}" for m, x in by.items()))
    stdout().print(f"noise floor of {len(runs)} identical runs written to {floor}")
    return 0


def _thresholds(gate: GateOptions) -> list:
    from ipw.analysis import check as verdict

    return [verdict.parse_threshold(t) for t in (gate.fail_if or verdict.DEFAULT_THRESHOLDS)]


def _gate(gate: GateOptions, outputs: CheckOutputs) -> tuple[list, dict | None]:
    """The thresholds and the noise floors of a pair or a job, the output files checked writable: before the
    (long) analysis, not after it."""
    from ipw.analysis import check as verdict

    thresholds = _thresholds(gate)
    for option, path in (("--markdown", outputs.markdown), ("--junit", outputs.junit)):
        if path is not None:
            _check_writable(path, option)
    return thresholds, verdict.read_floors(gate.floor) if gate.floor is not None else None


def _show(result, gate: GateOptions, outputs: CheckOutputs) -> int:
    """The verdict table, the drift and notes, and the files and annotations asked for; the exit code."""
    from ipw.analysis import check as verdict

    table = Table(title=f"ipw check: {'FAIL' if result.exit_code else 'PASS'} (alpha={gate.alpha:g}) · energy basis: "
                        f"{gate.energy_basis}")
    for col in verdict.COLUMNS:
        table.add_column(col)
    style = {"regression": "red", "inconclusive": "yellow", "improvement": "green", "pass": "green", "changed": "yellow"}
    for v in result.verdicts:
        *rest, status = verdict.cells(v)
        table.add_row(*rest, f"[{style[v.status]}]{status}[/]")
    out_console = stdout()
    out_console.print(table)
    # a backend name is the user's text: each line stays one line (escaped as GitHub's workflow commands are with
    # --github), unwrapped and without markup, so that no name starts a line of its own (a forged ::error)
    for line in (*verdict.drift_lines(result), *(f"note: {note}" for note in result.notes)):
        out_console.print(github_escape(line) if outputs.github else one_line(line), markup=False, highlight=False,
                          soft_wrap=True)
    if outputs.markdown:
        _write_text(outputs.markdown, verdict.markdown(result), "--markdown")
    if outputs.junit:
        _write_text(outputs.junit, verdict.junit_xml(result), "--junit")
    if outputs.github:
        text = verdict.github_annotations(result)
        if text:
            print(text)
    return result.exit_code


def _check_writable(path: Path, option: str) -> None:
    if path.is_dir():
        raise IpwError(f"{option} {path}: is a folder; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise IpwError(f"{option} {path}: the folder {parent} does not exist")
    import os

    if not os.access(parent, os.W_OK) or path.exists() and not os.access(path, os.W_OK):
        raise IpwError(f"{option} {path}: not writable (permission denied)")


def _write_text(path, text: str, option: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise IpwError(f"{option} {path}: cannot write it ({exc.strerror or type(exc).__name__})") from None
