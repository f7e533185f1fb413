"""What each CLI command does, as functions that return an exit code (rendering with rich)."""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ipw.errors import IpwError



def _progress_columns():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]} q/s"), TextColumn("{task.fields[jpq]} J/query"),
        TextColumn("{task.fields[acc]} correct"), TimeElapsedColumn(),
        # 2 redraws a second, not rich's 10: the numbers change once per query, and at 10 a second the
        # redraw thread alone took ~0.8% of a core, which an in-process engine's CPU energy would include
        # (docs/PERFORMANCE.md, "Sampler CPU overhead")
        console=Console(stderr=True), transient=False, refresh_per_second=2,
    )


def _watts(record) -> str:
    """Mean watts per device over the last query's window (measured devices only), for the live display."""
    import json

    parts = [p for p in json.loads(record.energy_parts)
             if p["energy_j"] is not None and p["duration_s"] > 0 and p["quality"] != "estimated"]
    return " ".join(f"{p['component']} {p['energy_j'] / p['duration_s']:.0f} W" for p in parts)


def _sigterm_as_interrupt() -> None:
    """SIGTERM stops a run as gracefully as Ctrl-C: flush, then mark the run interrupted."""
    import signal

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def run_command(config_path, *, dataset, limit, backends, out, seed, repeats, warmup, idle_s, resume=None,
                dataset_preset=None, split=None, categories=None, sample=None, shard=None, ray=None,
                shards=None, repair=False) -> int:
    from ipw.shard import parse_shard

    if repair and resume is None:
        raise IpwError("--repair: only with --resume RUN_DIR (it drops the damaged lines of that run's records.jsonl)")

    the_shard = parse_shard(shard) if shard is not None else None
    if ray is not None and the_shard is not None:
        raise IpwError("--ray and --shard: choose one (--ray splits the run into shards itself)")
    if shards is not None and ray is None:
        raise IpwError("--shards: only with --ray (for one shard of a run without Ray, give --shard K/N)")
    if shards is not None and shards < 1:
        raise IpwError(f"--shards: must be >= 1, got {shards}")
    if the_shard is not None and resume is not None:
        from ipw.results import RunManifest

        have = RunManifest.read(resume).shard
        if not have:
            raise IpwError(f"--shard {shard}: {resume} is not a shard run; resume it without --shard")
        if (have["index"], have["count"]) != (the_shard.index, the_shard.count):
            raise IpwError(f"--shard {shard}: {resume} is shard {have['index']}/{have['count']}; resume it with "
                           f"--shard {have['index']}/{have['count']} or without --shard")
    ray_options, connected = None, False
    if ray is not None:
        from ipw.ray_runner import RayOptions, connect

        connected = connect(ray)  # a missing extra or no cluster fails before the run folder exists
        ray_options = RayOptions(ray, shards)
    try:
        return _run(config_path, dataset=dataset, limit=limit, backends=backends, out=out, seed=seed,
                    repeats=repeats, warmup=warmup, idle_s=idle_s, resume=resume, dataset_preset=dataset_preset,
                    split=split, categories=categories, sample=sample, the_shard=the_shard,
                    ray_options=ray_options, repair=repair)
    finally:
        if connected:
            import ray as ray_module

            ray_module.shutdown()


def _run(config_path, *, dataset, limit, backends, out, seed, repeats, warmup, idle_s, resume, dataset_preset, split,
         categories, sample, the_shard, ray_options, repair=False) -> int:
    import time

    from ipw.config import apply_overrides, load_config
    from ipw.runner import execute, resume_run, start_run

    done: frozenset = frozenset()
    if resume is not None:
        given = [n for n, v in (("CONFIG", config_path), ("--dataset", dataset), ("--limit", limit),
                                ("--backend", backends), ("--out", out), ("--seed", seed), ("--repeats", repeats),
                                ("--warmup", warmup), ("--idle-s", idle_s), ("--dataset-preset", dataset_preset),
                                ("--split", split), ("--category", categories), ("--sample", sample)) if v]
        if given:
            raise IpwError(f"--resume continues a run with its own config; drop {', '.join(given)}")
        if repair:
            _repair(Path(resume))
        folder, config, queries, done = resume_run(str(resume))
    else:
        config = apply_overrides(
            load_config(str(config_path) if config_path else None), dataset=dataset, limit=limit,
            backends=backends, out_dir=str(out) if out else None, seed=seed, repeats=repeats, warmup=warmup,
            idle_s=idle_s, dataset_preset=dataset_preset, split=split, categories=categories, sample=sample,
        )
        folder, queries = start_run(config, shard=the_shard)
    _sigterm_as_interrupt()
    console = Console(stderr=True)
    verb = f"resuming ({len(done)} records kept)" if resume is not None else "run"
    if folder.manifest.shard:
        verb += f" shard {folder.manifest.shard['index']}/{folder.manifest.shard['count']}"
    if ray_options is not None:
        verb += f" on Ray ({ray_options.address})"
    console.print(f"{verb} [bold]{folder.manifest.run_id}[/]: {len(queries)} queries x {config.repeats} "
                  f"repeat(s) x {len(config.backends)} backend(s) -> {folder.path}")
    state = {"n": 0, "energy": 0.0, "n_e": 0, "correct": 0.0, "t0": time.monotonic()}
    with _progress_columns() as progress:
        task = progress.add_task("queries", total=len(queries) * config.repeats * len(config.backends),
                                 completed=len(done), rate="-", jpq="-", acc="-")

        def on_record(record) -> None:
            state["n"] += 1
            state["correct"] += record.correct
            if record.energy_j is not None:
                state["energy"] += record.energy_j
                state["n_e"] += 1
            elapsed = time.monotonic() - state["t0"]
            progress.update(
                task, advance=1, description=f"{record.backend} {_watts(record)}", rate=f"{state['n'] / elapsed:.2f}",
                jpq=f"{state['energy'] / state['n_e']:.3g}" if state["n_e"] else "n/a",
                acc=f"{state['correct'] / state['n']:.0%}",
            )

        def on_notice(line: str) -> None:
            progress.console.print(f"[bold red]backend stopped:[/] {escape(line)}", highlight=False)

        dispatch = None
        if ray_options is not None:
            from ipw.ray_runner import run_on_ray

            def dispatch(folder, config, queries, progress, done):
                run_on_ray(folder, config, queries, progress, ray_options, done)
        status = execute(folder, config, queries, on_record, done=done, dispatch=dispatch, notice=on_notice)
    from ipw.compare import compare

    # the same numbers as ``ipw compare RUN_DIR`` (one metric table, ipw.metrics)
    try:
        summary = compare([folder.path], seed=config.generation.seed, common_queries=True)
        _stdout().print(metrics_table(summary))
        for note in summary.notes:
            if note.startswith("--common-queries"):  # a stopped backend: the table covers the shared queries
                console.print(f"note: {escape(note)}", highlight=False)
    except IpwError as exc:  # e.g. a failed run without records: the status line below says what to do
        console.print(f"no summary: {escape(str(exc))}", highlight=False)
    console.print(f"wrote {folder.path}")
    if status != "complete":
        console.print(f"[bold red]run {status}[/]: some queries have no record; continue it with "
                      f"ipw run --resume {escape(str(folder.path))}", highlight=False)
        return 1
    return 0


def _repair(run_dir: Path) -> None:
    """``--resume --repair``: drop the lines of the log that are not records (kept in records.dropped.jsonl)."""
    from ipw.results import RunManifest, repair_records

    if RunManifest.read(run_dir).status == "complete":
        raise IpwError(f"{run_dir}: the run is already complete; nothing to resume or repair")
    dropped = repair_records(run_dir / "records.jsonl")
    Console(stderr=True).print(
        f"repaired {run_dir / 'records.jsonl'}: dropped line(s) {', '.join(map(str, dropped))} (kept in "
        "records.dropped.jsonl); their queries run again" if dropped else
        f"{run_dir / 'records.jsonl'}: every line is a record; nothing to repair", highlight=False, markup=False)


def _stdout() -> Console:
    """Standard output; wide enough for the tables when it is not a terminal (CI logs, pipes)."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    return console


def _num(x: float, spec: str = ".3g") -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:{spec}}"


def metrics_table(c) -> Table:
    """``ipw run``'s final table: a few of compare's metrics per backend (a ``Comparison``)."""
    table = Table(title="ipw run: per backend (95% bootstrap CIs)")
    for col in ("backend", "role", "accuracy", "J/query", "IPJ (1/J)", "IPW (1/W)", "J/out token",
                "J/prefill token", "J/decode token", "TTFT p50", "errors", "energy"):
        table.add_column(col, justify="left" if col in ("backend", "role", "energy") else "right")
    for b in c.backends:
        m = c.metrics[b.label]
        acc = m["accuracy"]
        table.add_row(
            b.backend, b.role,
            f"{acc.value:.1%} [{acc.lo:.0%}, {acc.hi:.0%}]" if math.isfinite(acc.lo) else f"{acc.value:.1%}",
            m["energy_per_query_j"].fmt(), m["ipj"].fmt(), m["ipw"].fmt(), _num(m["j_per_output_token"].value),
            m["j_per_prefill_token"].fmt(), m["j_per_decode_token"].fmt(),
            f"{_num(m['ttft_p50_s'].value * 1000, '.0f')} ms", f"{m['errors'].value:.0f}", b.energy_quality,
        )
    return table


def compare_command(runs, *, reference, common_queries, local, cloud, router_accuracy, fmt, n_boot, seed,
                    usd_per_kwh, api_prices) -> int:
    import sys

    from ipw import compare as cmp

    if fmt not in cmp.FORMATS:
        raise IpwError(f"--format {fmt!r}: must be one of {', '.join(cmp.FORMATS)}")
    result = cmp.compare(runs, reference=reference, common_queries=common_queries, local=local, cloud=cloud,
                         router_accuracy=router_accuracy, n_boot=n_boot, seed=seed, usd_per_kwh=usd_per_kwh,
                         api_prices=api_prices)
    if fmt == "table":
        console = _stdout()
        for table in cmp.rich_tables(result):
            console.print(table)
        for note in result.notes:
            console.print(f"note: {note}", highlight=False, markup=False)
    else:
        sys.stdout.write({"json": cmp.to_json, "csv": cmp.to_csv, "markdown": cmp.to_markdown}[fmt](result))
    return 0


def report_command(runs, *, out, markdown, reference, common_queries, local, cloud, router_accuracy) -> int:
    from ipw.report import write

    ctx = write(runs, out, markdown, reference=reference, common_queries=common_queries, local=local, cloud=cloud,
                router_accuracy=router_accuracy)
    console = Console(stderr=True)
    console.print(f"wrote {out} ({len(ctx['figures'])} plots, {ctx['n_records']:,} records)"
                  + (f" and {markdown}" if markdown else ""), highlight=False, markup=False, soft_wrap=True)
    return 0


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
    _stdout().print(table)
    totals = (folder.manifest.judge or {}).get("totals")
    if totals:
        energy = "n/a" if totals["energy_j"] is None else f"{totals['energy_j']:.3g} J"
        console.print(f"judge {folder.manifest.judge['backend']['name']} ({folder.manifest.judge['prompt_version']}): "
                      f"{totals['calls']} calls, {totals['prompt_tokens']} + {totals['completion_tokens']} tokens, "
                      f"{energy}, {totals['unparsed']} unparsed (in judge.jsonl, not in the records' energy)",
                      highlight=False, markup=False)
    console.print(f"wrote {folder.path} (rescored from {run})")
    return 0


def list_command() -> int:
    from ipw.backends.base import backend_kinds
    from ipw.datasets import BUNDLED, DATASETS_DIR
    from ipw.models import BUNDLED_MODELS, model_available
    from ipw.telemetry.probe import describe_sensors

    console = _stdout()
    t = Table(title="backend kinds")
    t.add_column("kind")
    for kind in backend_kinds():
        t.add_row(kind)
    console.print(t)
    t = Table(title="bundled models (--backend llama-cpp:NAME)")
    for col in ("name", "package", "mode", "installed", "description"):
        t.add_column(col)
    for m in BUNDLED_MODELS.values():
        t.add_row(m.name, m.package, m.mode, "yes" if model_available(m.name) else "no", m.description)
    console.print(t)
    t = Table(title="bundled datasets (--dataset NAME)")
    for col in ("name", "file", "queries"):
        t.add_column(col)
    for name, (file, subset) in BUNDLED.items():
        path = DATASETS_DIR / (subset or file)
        count = sum(1 for line in path.read_text().splitlines() if line.strip()) if path.exists() else 0
        t.add_row(name, file + (f" (ids in {subset})" if subset else ""), str(count))
    console.print(t)
    t = Table(title="sensors on this machine (probed in this order)")
    for col in ("sensor", "available", "source", "quality", "scope", "detail"):
        t.add_column(col)
    for info in describe_sensors():
        t.add_row(info.name, "yes" if info.available else "no", info.source, info.quality, info.scope, info.detail)
    console.print(t)
    return 0




def merge_command(shards, *, out) -> int:
    """``ipw merge``: the merged run folder's path goes to stdout."""
    from ipw.merge import merge_runs

    folder = merge_runs(shards, out)
    info = folder.manifest.dataset
    Console(stderr=True).print(
        f"merged {len(folder.manifest.merged_from)} shards: {info['n_queries']} queries "
        f"({info['fingerprint']}), {sum(s['n_records'] for s in folder.manifest.merged_from)} records, "
        f"{len(folder.manifest.hardware_by_id)} machine fingerprint(s)", highlight=False, markup=False)
    print(folder.path)
    return 0


def check_command(baseline, candidate, *, fail_if, alpha, strict, allow_hardware_mismatch, markdown_path, github,
                  junit_path) -> int:
    from ipw.check import DEFAULT_THRESHOLDS, check_runs, github_annotations, junit_xml, markdown, parse_threshold
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
    out = _stdout()
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


def convert_command(model, out_dir, *, force) -> int:
    """GGUF -> Hugging Face folder (``ipw.convert``); the folder's path goes to stdout."""
    from ipw.convert import convert_gguf

    print(convert_gguf(model, out_dir, force=force))
    return 0
