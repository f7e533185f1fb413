"""``ipw check``: the regression gate's command (the statistics: ``ipw.analysis.check``)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

import json

from rich.console import Console

from ipw.commands.output import stdout
from ipw.errors import IpwError
from ipw.sanitize import github_escape, one_line


def _change_unit(name: str) -> str:
    """The change unit of a gated metric of ``ipw check --calibrate``'s floors."""
    from ipw.analysis.metrics import gated_metric

    metric = gated_metric(name)
    assert metric is not None  # the floors are by gated metric
    return metric.change_unit


def check_command(paths, *, fail_if, alpha, strict, allow_hardware_mismatch, markdown_path, github,
                  junit_path, rerun=False, blocks=16, shards=4, out=None, base_python=None, cand_python=None, backends=(),
                  limit=None, calibrate=False, floor_path=None, work_gate=True, energy_basis="chip") -> int:
    from ipw.analysis import check as gate
    from ipw.analysis import fmt
    from ipw.results import RunManifest, load_run

    from ipw.analysis.basis import check_basis

    check_basis(energy_basis)
    if rerun and energy_basis != "chip":
        raise IpwError("--energy-basis: with --rerun only chip (the interleaved blocks are judged on the chip's joules)")
    if not 0 < alpha < 1:
        raise IpwError(f"--alpha: must be between 0 and 1, got {alpha}")
    thresholds = [gate.parse_threshold(t) for t in (fail_if or gate.DEFAULT_THRESHOLDS)]
    if calibrate and rerun:
        raise IpwError("--calibrate and --rerun: give one of them")
    if (base_python or cand_python or backends or limit is not None or out is not None) and not rerun:
        raise IpwError("--base-python, --cand-python, --backend, --limit and --out go with --rerun")
    if rerun:
        from ipw.interleave import job_plan

        plan = job_plan(blocks, shards)  # a usage error before anything runs
    if calibrate:
        if floor_path is None:
            raise IpwError("--calibrate: give --floor FILE, the file that receives the noise floor")
        _check_writable(Path(floor_path), "--floor")
        runs: list[tuple[RunManifest, object]] = [load_run(p, require=("dataset.fingerprint",)) for p in paths]
        data = gate.calibrate(runs, thresholds)
        _write_text(floor_path, json.dumps(data, indent=2) + "\n", "--floor")
        for backend, by in data["floors"].items():
            stdout().print(f"{backend}: " + ", ".join(
                f"{m} ±{fmt.change(x, _change_unit(m), sign=False)}" for m, x in by.items()))
        stdout().print(f"noise floor of {len(runs)} identical runs written to {floor_path}")
        return 0
    if len(paths) != 2:
        raise IpwError(f"give a baseline and a candidate ({'configs' if rerun else 'run folders'}), got {len(paths)} "
                       "path(s)")
    for option, path in (("--markdown", markdown_path), ("--junit", junit_path)):
        if path is not None:
            _check_writable(Path(path), option)  # before the (long) analysis, not after it
    floors = gate.read_floors(floor_path) if floor_path is not None else None
    if rerun:
        result = _rerun(paths, thresholds, plan=plan, n_shards=shards, out=out, pythons=(base_python, cand_python),
                        backends=backends, limit=limit, alpha=alpha, strict=strict, floors=floors, work_gate=work_gate)
    else:
        base_manifest, base = load_run(paths[0], require=("dataset.fingerprint",))
        cand_manifest, cand = load_run(paths[1], require=("dataset.fingerprint",))
        result = gate.check_runs(base_manifest, base, cand_manifest, cand, thresholds, alpha=alpha, strict=strict,
                                 allow_hardware_mismatch=allow_hardware_mismatch, floors=floors, work_gate=work_gate,
                                 energy_basis=energy_basis)
    table = Table(title=f"ipw check: {'FAIL' if result.exit_code else 'PASS'} (alpha={alpha:g}) · energy basis: "
                        f"{energy_basis}")
    for col in gate.COLUMNS:
        table.add_column(col)
    style = {"regression": "red", "inconclusive": "yellow", "improvement": "green", "pass": "green", "changed": "yellow"}
    for v in result.verdicts:
        *rest, status = gate.cells(v)
        table.add_row(*rest, f"[{style[v.status]}]{status}[/]")
    out_console = stdout()
    out_console.print(table)
    # a backend name is the user's text: each line stays one line (escaped as GitHub's workflow commands are with
    # --github), unwrapped and without markup, so that no name starts a line of its own (a forged ::error)
    for line in (*gate.drift_lines(result), *(f"note: {note}" for note in result.notes)):
        out_console.print(github_escape(line) if github else one_line(line), markup=False, highlight=False,
                          soft_wrap=True)
    if markdown_path:
        _write_text(markdown_path, gate.markdown(result), "--markdown")
    if junit_path:
        _write_text(junit_path, gate.junit_xml(result), "--junit")
    if github:
        text = gate.github_annotations(result)
        if text:
            print(text)
    return result.exit_code


def _rerun(configs, thresholds, *, plan, n_shards, out, pythons, backends, limit, alpha, strict, floors, work_gate):
    """The interleaved job: the blocks of ``plan`` (``ipw.interleave.job_plan``), each an ``ipw run`` of its side
    over its shard, then the verdict."""
    import datetime as dt
    import shutil

    from ipw.analysis.check import check_interleaved
    from ipw.interleave import default_python, run_blocks, subprocess_runner
    from ipw.results import load_run

    for config in configs:
        if not Path(config).is_file():
            raise IpwError(f"--rerun {config}: not found (give two config files, baseline then candidate)")
    _paired(configs, backends, limit)  # before the first block, not after the last
    python = {}
    for side, given, option in (("A", pythons[0], "--base-python"), ("B", pythons[1], "--cand-python")):
        found = shutil.which(given) if given else default_python()
        if not found:
            raise IpwError(f"{option} {given}: not found or not executable")
        python[side] = found
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    job = Path(out or "results") / f"interleaved-{stamp}"
    job.mkdir(parents=True, exist_ok=False)
    run_args = [a for b in backends for a in ("--backend", b)] + (["--limit", str(limit)] if limit is not None else [])
    err = Console(stderr=True)
    err.print(f"interleaved job {job}: {len(plan)} blocks over {n_shards} shard(s), "
              f"{' '.join(side for side, _ in plan)}, A = {configs[0]} ({python['A']}), "
              f"B = {configs[1]} ({python['B']})")
    done = run_blocks(plan, subprocess_runner({"A": Path(configs[0]), "B": Path(configs[1])}, python, job, run_args,
                                              n_shards),
                      progress=err.print)
    loaded = [(b.side, *load_run(b.run_dir, require=("dataset.fingerprint",))) for b in done]
    return check_interleaved(loaded, thresholds, alpha=alpha, strict=strict, floors=floors, work_gate=work_gate)


def _paired(configs, backends, limit) -> None:
    """What the verdict pairs the blocks on, compared from the two configs as each block's ``ipw run`` loads
    them (with the job's --backend and --limit): the query set (its fingerprint) and the backends (each of the
    baseline's, by name, in the candidate). One line naming what differs (exit 2)."""
    from ipw.config import apply_overrides, load_config
    from ipw.datasets import load_query_set

    loaded = []
    for config in configs:
        c = apply_overrides(load_config(str(config)), {"backend": list(backends), "limit": limit})
        loaded.append((c, load_query_set(c.dataset, limit=c.limit, **c.dataset_options())))
    (a, qa), (b, qb) = loaded
    reasons = []
    if qa.fingerprint != qb.fingerprint:
        reasons.append(f"the query sets differ (dataset {a.dataset}: {len(qa)} queries, {qa.fingerprint}; dataset "
                       f"{b.dataset}: {len(qb)} queries, {qb.fingerprint})")
    names = [x.name for x in b.backends]
    missing = [x.name for x in a.backends if x.name not in names]
    if missing:
        reasons.append(f"backend(s) {', '.join(missing)} of the baseline missing from the candidate (its backends: "
                       f"{', '.join(names)})")
    if reasons:
        raise IpwError(f"--rerun {configs[0]} {configs[1]}: not comparable: " + "; ".join(reasons))


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
