"""``ipw run``: run a query set through backends (``ipw.running.runner``), with live progress and, at the end, the
same numbers as ``ipw compare`` on the run folder."""

from __future__ import annotations

from pathlib import Path

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable

from ipw.commands.output import sigterm_as_interrupt, stdout
from ipw.errors import IpwError
from ipw.options import RUN, RunControl, RunOptions, given

if TYPE_CHECKING:
    from ipw.analysis.compare import Comparison
    from ipw.analysis.render import Table
    from ipw.inputs.config import RunConfig
    from ipw.inputs.datasets import QuerySet
    from ipw.results import KeptQueries


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


PROGRESS_UPDATE_S = 0.5  # the live numbers change at most this often (rich redraws twice a second)


def _watts(record) -> str:
    """Mean watts per device over the last query's window (measured devices only), for the live display."""
    import json

    parts = [p for p in json.loads(record.energy_parts)
             if p["energy_j"] is not None and p["duration_s"] > 0 and p["quality"] != "estimated"]
    return " ".join(f"{p['component']} {p['energy_j'] / p['duration_s']:.0f} W" for p in parts)


def run_command(config_path, overrides: RunOptions, control: RunControl) -> int:
    """``overrides``: the run options (``ipw.options.RunOptions``); those given win over the config."""
    from ipw.running.shard import parse_shard

    the_shard = parse_shard(control.shard) if control.shard is not None else None
    resume, shard = control.resume, control.shard
    if the_shard is not None and resume is not None:
        from ipw.results import RunManifest

        have = RunManifest.read(resume).shard
        if not have:
            raise IpwError(f"--shard {shard}: {resume} is not a shard run; resume it without --shard")
        if (have["index"], have["count"]) != (the_shard.index, the_shard.count):
            raise IpwError(f"--shard {shard}: {resume} is shard {have['index']}/{have['count']}; resume it with "
                           f"--shard {have['index']}/{have['count']} or without --shard")
    tracker = None
    if control.mlflow:  # MLFLOW_TRACKING_URI unset, or no MLflow server answering: one line, exit 2, before the folder
        from ipw.export.mlflow import connect as mlflow_connect

        tracker = mlflow_connect()
    metrics, server = None, None
    if control.metrics_port is not None:  # a port in use: one line, exit 2, before the run folder
        from ipw.export.prometheus import Metrics

        metrics = Metrics()
        server = metrics.serve_http(control.metrics_host, control.metrics_port)
    ray_options, connected = None, False
    try:
        if control.ray is not None:
            from ipw.running.ray_runner import RayOptions, connect

            connected = connect(control.ray)  # a missing extra or no cluster fails before the run folder exists
            ray_options = RayOptions(control.ray, control.shards)
        return _run(config_path, given(overrides), resume=resume, the_shard=the_shard, ray_options=ray_options,
                    repair=control.repair, full_table=control.full_table, metrics=metrics, tracker=tracker)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        if connected:
            import ray as ray_module

            ray_module.shutdown()


def _run(config_path, overrides: dict[str, Any], *, resume, the_shard, ray_options, repair=False,
         full_table=False, metrics=None, tracker=None) -> int:
    """One pass: load (the config, the queries, the backends: everything checked before any run folder
    exists) -> plan (the run folder, the shard) -> execute (every backend; records appended as they come)
    -> write (the summary of the finished folder, judged when the config has a [judge])."""
    import time

    from ipw.inputs.config import apply_overrides, load_config
    from ipw.inputs.datasets import load_query_set
    from ipw.results import DoneKeys
    from ipw.running.runner import execute, plan_resume, plan_run

    # 1. load
    if resume is not None:
        extra = (["CONFIG"] if config_path else []) + [RUN[name].flag for name in overrides]
        if extra:
            raise IpwError(f"--resume continues a run with its own config; drop {', '.join(extra)}")
        if repair:
            _repair(Path(resume))
        config, kept = load_resumed(resume)
    else:
        config = apply_overrides(load_config(str(config_path) if config_path else None), overrides)
        query_set = load_query_set(config.dataset, limit=config.limit, **config.dataset_options())
    levels = check_run(config)
    from ipw.telemetry.node_power import check_configured

    check_configured()  # the BMC that IPW_NODE_POWER names answers with power data, before any folder exists
    from ipw.export import otel

    otel_on = otel.check()  # OTEL_EXPORTER_OTLP_ENDPOINT: its settings and the extra (exit 2), before any folder
    carbon, carbon_note = None, None
    if resume is None:  # the grid's carbon intensity (ipw.carbon): a bad value or zone fails here, before any folder
        from ipw.carbon import resolve

        carbon, carbon_note = resolve(config.carbon_intensity, config.grid_region, config.grid_live)

    # 2. plan
    if resume is not None:
        plan = plan_resume(resume, kept, config, levels, every_query=ray_options is not None)
        folder, queries, n_queries, done = plan.folder, plan.queries, plan.n_queries, plan.done
    else:
        folder, queries = plan_run(config, query_set, the_shard)
        n_queries, done = len(queries), DoneKeys()
        if carbon is not None:
            folder.write_manifest(carbon=carbon)

    # 3. execute
    sigterm_as_interrupt()
    console = Console(stderr=True)
    if carbon_note:
        console.print(f"note: {escape(carbon_note)}", highlight=False, soft_wrap=True)  # one line

    verb = f"resuming ({len(done)} records kept)" if resume is not None else "run"
    if folder.manifest.shard:
        verb += f" shard {folder.manifest.shard['index']}/{folder.manifest.shard['count']}"
    if ray_options is not None:
        verb += f" on Ray ({ray_options.address})"
    sweeps = "".join(f"; {name} at concurrency {', '.join(map(str, lv))}" for name, lv in levels.items() if len(lv) > 1)
    console.print(f"{verb} [bold]{folder.manifest.run_id}[/]: {n_queries} queries x {config.repeats} "
                  f"repeat(s) x {len(config.backends)} backend(s){sweeps} -> {folder.path}")
    state: dict[str, Any] = {"n": 0, "energy": 0.0, "n_e": 0, "correct": 0.0, "scored": 0, "t0": time.monotonic(),
                             "shown": 0.0, "last": None}
    with _progress_columns() as progress:
        task = progress.add_task("queries", total=n_queries * config.repeats * sum(map(len, levels.values())),
                                 completed=len(done), rate="-", jpq="-", acc="-")
        export = otel.start("run", lambda line: progress.console.print(escape(line), highlight=False, soft_wrap=True)
                            ) if otel_on else None

        def show() -> None:
            record = state["last"]
            elapsed = time.monotonic() - state["t0"]
            progress.update(
                task, completed=len(done) + state["n"], rate=f"{state['n'] / elapsed:.2f}",
                description=f"{record.backend} {_watts(record)}" if record is not None else "queries",
                jpq=f"{state['energy'] / state['n_e']:.3g}" if state["n_e"] else "n/a",
                acc=f"{state['correct'] / state['scored']:.0%}" if state["scored"] else "unscored",
            )
            state["shown"] = time.monotonic()

        def on_record(record) -> None:
            # called once a record is on disk, off the query's path (ipw.running.runner.RecordWriter); the display
            # takes the numbers at most every PROGRESS_UPDATE_S, not per query
            state["n"] += 1
            state["last"] = record
            if metrics is not None:  # --metrics-port: every record is final when written (ipw.export.prometheus)
                metrics.observe(record)
            if export is not None:  # OTLP: its counts and its span, exported by the SDK's threads
                export.add(record)
            if record.correct is not None:  # None: unscored (a judge item), never counted wrong
                state["correct"] += record.correct
                state["scored"] += 1
            if record.energy_j is not None:
                state["energy"] += record.energy_j
                state["n_e"] += 1
            if time.monotonic() - state["shown"] >= PROGRESS_UPDATE_S:
                show()

        def on_notice(line: str) -> None:
            from ipw.sanitize import one_line

            progress.console.print(f"[bold red]backend stopped:[/] {escape(one_line(line))}", highlight=False,
                                   soft_wrap=True)  # one line, however narrow the terminal

        dispatch = None
        if ray_options is not None:
            from ipw.running.ray_runner import run_on_ray

            def dispatch(folder, config, queries, progress, done):
                run_on_ray(folder, config, queries, progress, ray_options, levels, done)
        try:
            status = execute(folder, config, queries, on_record, done=done, dispatch=dispatch, notice=on_notice)
        finally:
            show()  # the final count
            if export is not None:
                export.close()  # the last export, bounded (otel.SHUTDOWN_S)

    # 4. write: the summary of the finished folder (judged first when the config has a [judge])
    from ipw.analysis.render import metrics_table, rich_tables, with_basis
    from ipw.telemetry.audit import audit_lines

    summary_dir, judge_failed = _judge_finished(folder.path, config, status, console)
    try:
        summary = end_summary(summary_dir)
        out = stdout()
        c = summary.comparison
        out.print(rich_tables(with_basis(c, [metrics_table(c)]))[0] if full_table else summary_table(c))
        for table in rich_tables(summary.routing):
            out.print(table)
        if c.query_set_note:  # a stopped backend: the table covers the shared queries
            console.print(f"note: {escape(c.query_set_note)}", highlight=False)
    except IpwError as exc:  # e.g. a failed run without records: the status line below says what to do
        console.print(f"no summary: {escape(str(exc))}", highlight=False)
    for line in audit_lines(folder.manifest):
        console.print(escape(line), highlight=False)
    console.print(f"wrote {folder.path}" + (f" (judged: {summary_dir})" if summary_dir != folder.path else ""))
    if tracker is not None:  # --mlflow: the folder the summary shows; a failed export is a warning, the folder stands
        from ipw.export.mlflow import after_run

        after_run(tracker, summary_dir, status,
                  lambda line: console.print(line, highlight=False, markup=False, soft_wrap=True))
    if status != "complete":
        console.print(f"[bold red]run {status}[/]: some queries have no record; continue it with "
                      f"ipw run --resume {escape(str(folder.path))}", highlight=False)
        return 1
    return 1 if judge_failed else 0


def load_resumed(run_dir) -> tuple[RunConfig, QuerySet | KeptQueries]:
    """The load step of ``--resume``: the unfinished run's config and its queries (a large run's checked
    copy, as an Arrow table: ``plan_resume`` builds only the queries left; else its dataset loaded again and
    cut to its shard)."""
    from ipw.inputs.config import RunConfig
    from ipw.inputs.datasets import Query, QuerySet, load_query_set, resolve_dataset
    from ipw.results import RunManifest, manifest_field, read_kept_queries
    from ipw.running.shard import Shard, shard_items

    manifest = RunManifest.read_unfinished(run_dir)
    assert manifest.config is not None and manifest.dataset is not None  # read_unfinished requires them
    config = RunConfig.from_dict(manifest.config, where=manifest_field(run_dir, "config"))
    try:
        source: Path | None = resolve_dataset(config.dataset)  # the file the run folder's copy is checked against
    except IpwError:
        source = None  # no copy is used; load_query_set below names the error
    kept = read_kept_queries(run_dir, manifest, source, Query)
    if kept is not None:
        return config, kept
    query_set = load_query_set(config.dataset, limit=config.limit, **config.dataset_options())
    if manifest.shard:
        shard = Shard(manifest.shard["index"], manifest.shard["count"])
        query_set = QuerySet(config.dataset, shard_items(query_set.queries, shard), query_set.source)
    return config, query_set


def check_run(config: RunConfig) -> dict[str, tuple[int, ...]]:
    """The load step's check of what runs: every backend made and preflighted (``check_backends``), the
    judge's prompt and model resolved (it grades the finished run: they fail here, not after); nothing
    loads.  Returns each backend's concurrency levels, by name."""
    from ipw.backends.base import check_backends

    levels = check_backends(config.backends)
    if config.judge is not None:
        from ipw.grading.judge import Judge

        Judge(config.judge)
    return levels


def _judge_finished(run_dir: Path, config, status: str, console: Console) -> tuple[Path, bool]:
    """The config's [judge] grades a finished run into a linked folder (``ipw rescore``'s path); returns
    the folder the summary shows and whether judging failed (the run and its summary stand)."""
    judge = config.judge
    if judge is None:
        return run_dir, False
    why = None
    if judge.vs_backend and judge.vs_backend not in {b.name for b in config.backends}:
        why = f"the [judge] compares answers with {judge.vs_backend}'s, and this run has no such backend"
    elif status != "complete":
        why = f"the run is {status}; it is judged when a --resume completes it"
    if why:
        console.print(f"note: not judged: {escape(why)}", highlight=False)
        return run_dir, False
    from ipw.commands.output import rescore_and_show

    try:
        return rescore_and_show(run_dir, judge=judge, out_dir=run_dir.parent), False
    except IpwError as exc:
        console.print(f"[bold red]not judged:[/] {escape(str(exc))}; judge it with ipw rescore "
                      f"{escape(str(run_dir))}", highlight=False)
        return run_dir, True


def _repair(run_dir: Path) -> None:
    """``--resume --repair``: drop the lines of the log that are not records (kept in records.dropped.jsonl)."""
    from ipw.results import repair_log

    log, dropped = repair_log(run_dir)
    Console(stderr=True).print(
        f"repaired {log}: dropped line(s) {', '.join(map(str, dropped))} (kept in "
        "records.dropped.jsonl); their queries run again" if dropped else
        f"{log}: every line is a record; nothing to repair", highlight=False, markup=False)


RUN_END_ROUTING = ("routing", "power_envelope")  # compare's routing tables that ``ipw run`` ends with


@dataclass(frozen=True)
class EndSummary:
    comparison: Comparison  # ``ipw compare RUN_DIR``'s (its defaults: the same seed, so the same CIs)
    routing: list[Table]  # compare's routing summary and power envelope (with a cloud-role backend), its judge table


def end_summary(run_dir) -> EndSummary:
    """What ``ipw run`` ends with: the numbers of ``ipw compare RUN_DIR`` and, when a backend has the cloud
    role, compare's own routing tables (``ipw.analysis.render.routing_tables``: local coverage, the
    oracle's and the α-router's energy saved, coverage within the local backends' power envelope, with
    CIs and energy quality)."""
    from ipw.analysis.compare import compare
    from ipw.analysis.render import bases_tables, carbon_tables, judge_table, routing_tables, with_basis

    c = compare([run_dir], common_queries=True)
    cloud = any(b.role == "cloud" for b in c.backends)
    routing = [t for t in routing_tables(c) if t.key in RUN_END_ROUTING] if cloud else []
    return EndSummary(c, with_basis(c, carbon_tables(c) + routing + bases_tables(c) + judge_table(c)))


def summary_table(c: Comparison) -> RichTable:
    """``ipw run``'s final table: per backend, the metrics the metric table marks ``summary``
    (``ipw.analysis.metrics``), each value over its interval, and the backend's energy quality; it fits 100
    columns for names up to ~15 characters. Every metric: ``--full-table`` (compare's metrics table)."""
    from ipw.analysis.fmt import estimate
    from ipw.analysis.metrics import METRICS
    from ipw.analysis.stats import LEVEL
    from ipw.sanitize import one_line  # backend names are the user's text

    shown = [m for m in METRICS if m.summary]
    measured = ", energy with measurement error" if c.with_measurement_error else ""
    table = RichTable(title=f"ipw run: per backend ({LEVEL:.0%} bootstrap CIs{measured}; every metric: --full-table)"
                            f" · energy basis: {c.energy_basis}")
    table.add_column("backend")
    for m in shown:
        table.add_column(m.label, justify="right")
    table.add_column("energy")
    for b in c.backends:
        # the value over its interval: two short lines, not one long one
        cells = [estimate(c.metrics[b.label][m.name], m.format).replace(" [", "\n[", 1) for m in shown]
        table.add_row(escape(one_line(b.label)), *(escape(x) for x in cells), b.energy_quality)
    return table
