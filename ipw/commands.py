"""What each CLI command does, as functions that return an exit code (rendering with rich)."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from ipw.errors import IpwError



def _progress_columns():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]} q/s"), TextColumn("{task.fields[jpq]} J/query"),
        TextColumn("{task.fields[acc]} correct"), TimeElapsedColumn(),
        console=Console(stderr=True), transient=False,
    )


def _sigterm_as_interrupt() -> None:
    """SIGTERM stops a run as gracefully as Ctrl-C: flush, then mark the run interrupted."""
    import signal

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def run_command(config_path, *, dataset, limit, backends, out, seed, repeats, warmup, idle_s, resume=None) -> int:
    import time

    from ipw.config import apply_overrides, load_config
    from ipw.runner import execute, resume_run, start_run

    done: frozenset = frozenset()
    if resume is not None:
        given = [n for n, v in (("CONFIG", config_path), ("--dataset", dataset), ("--limit", limit),
                                ("--backend", backends), ("--out", out), ("--seed", seed), ("--repeats", repeats),
                                ("--warmup", warmup), ("--idle-s", idle_s)) if v]
        if given:
            raise IpwError(f"--resume continues a run with its own config; drop {', '.join(given)}")
        folder, config, queries, done = resume_run(str(resume))
    else:
        config = apply_overrides(
            load_config(str(config_path) if config_path else None), dataset=dataset, limit=limit,
            backends=backends, out_dir=str(out) if out else None, seed=seed, repeats=repeats, warmup=warmup,
            idle_s=idle_s,
        )
        folder, queries = start_run(config)
    _sigterm_as_interrupt()
    console = Console(stderr=True)
    verb = f"resuming ({len(done)} records kept)" if resume is not None else "run"
    console.print(f"{verb} [bold]{folder.manifest['run_id']}[/]: {len(queries)} queries x {config.repeats} "
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
                task, advance=1, description=record.backend, rate=f"{state['n'] / elapsed:.2f}",
                jpq=f"{state['energy'] / state['n_e']:.3g}" if state["n_e"] else "n/a",
                acc=f"{state['correct'] / state['n']:.0%}",
            )

        execute(folder, config, queries, on_record, done=done)
    from ipw.metrics import run_metrics
    from ipw.results import load_run

    _, frame = load_run(folder.path)
    _stdout().print(metrics_table(run_metrics(frame, seed=config.generation.seed)))
    console.print(f"wrote {folder.path}")
    return 0


def _stdout() -> Console:
    """Standard output; wide enough for the tables when it is not a terminal (CI logs, pipes)."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    return console


def _num(x: float, spec: str = ".3g") -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:{spec}}"


def metrics_table(metrics) -> Table:
    table = Table(title="ipw run: per backend (95% bootstrap CIs)")
    for col in ("backend", "role", "accuracy", "J/query", "IPJ (1/J)", "IPW (1/W)", "J/out token", "TTFT p50",
                "errors", "energy"):
        table.add_column(col, justify="left" if col in ("backend", "role", "energy") else "right")
    for m in metrics:
        table.add_row(
            m.backend, m.role,
            f"{m.accuracy.value:.1%} [{m.accuracy.lo:.0%}, {m.accuracy.hi:.0%}]",
            m.energy_per_query_j.fmt(), m.ipj.fmt(), m.ipw.fmt(), _num(m.j_per_output_token.value),
            f"{_num(m.ttft_p50_s * 1000, '.0f')} ms", str(m.n_errors), m.energy_quality,
        )
    return table


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


