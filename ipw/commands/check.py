"""``ipw check``: the regression gate's command (the statistics: ``ipw.analysis.check``)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from ipw.commands.output import stdout
from ipw.errors import IpwError


def check_command(baseline, candidate, *, fail_if, alpha, strict, allow_hardware_mismatch, markdown_path, github,
                  junit_path) -> int:
    from ipw.analysis.check import DEFAULT_THRESHOLDS, check_runs, github_annotations, junit_xml, markdown, parse_threshold
    from ipw.results import load_run

    if not 0 < alpha < 1:
        raise IpwError(f"--alpha: must be between 0 and 1, got {alpha}")
    thresholds = [parse_threshold(t) for t in (fail_if or DEFAULT_THRESHOLDS)]
    for option, path in (("--markdown", markdown_path), ("--junit", junit_path)):
        if path is not None:
            _check_writable(Path(path), option)  # before the (long) analysis, not after it
    base_manifest, base = load_run(baseline, require=("dataset.fingerprint",))
    cand_manifest, cand = load_run(candidate, require=("dataset.fingerprint",))
    result = check_runs(base_manifest, base, cand_manifest, cand, thresholds, alpha=alpha, strict=strict,
                        allow_hardware_mismatch=allow_hardware_mismatch)
    table = Table(title=f"ipw check: {'FAIL' if result.exit_code else 'PASS'} (alpha={alpha:g})")
    for col in ("backend", "metric", "threshold", "baseline", "candidate", "change [95% CI]", "p", "verdict"):
        table.add_column(col)
    style = {"regression": "red", "inconclusive": "yellow", "improvement": "green", "pass": "green"}
    for v in result.verdicts:
        unit = "pp" if v.threshold.endswith("pp") else "%"
        table.add_row(v.backend, v.metric, v.threshold, f"{v.baseline:.4g}", f"{v.candidate:.4g}",
                      f"{v.change:+.2f}{unit} [{v.ci_lo:+.2f}, {v.ci_hi:+.2f}]", f"{v.p_value:.3g}",
                      f"[{style[v.status]}]{v.status}[/]")
    out = stdout()
    out.print(table)
    for note in result.notes:
        out.print(f"note: {note}")
    if markdown_path:
        _write_text(markdown_path, markdown(result), "--markdown")
    if junit_path:
        _write_text(junit_path, junit_xml(result), "--junit")
    if github:
        text = github_annotations(result)
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
