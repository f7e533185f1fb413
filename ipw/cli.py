"""The ipw command line: a thin shell around pure functions. ``IpwError`` maps to its exit code."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import typing
from pathlib import Path
from typing import Any, List, Optional, cast

import typer

from ipw.options import (CalibrateOptions, CheckOutputs, CompareOptions, ConvertOptions, DoctorOptions, GateOptions,
                         MergeOptions, MlflowExportOptions, Option, PriceOptions, ProxyOptions, RerunOptions,
                         RescoreOptions, ReportOptions,
                         RouteRoles, RouterOptions, RouteScoreOptions, RouteTrainOptions, RoutingOptions, RunControl,
                         RunOptions, ServeOnly, WrapOnly, check_options, options_of)

# numpy's OpenBLAS keeps its idle threads spinning: on a busy or shared machine (a CI runner) that made
# `ipw check` and `ipw compare` 9-15x slower, while their matrix products are thin enough that one
# thread is as fast (docs/PERFORMANCE.md, "Analysis at scale").  Set before numpy loads; an explicit
# setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    # an unexpected exception is one line (main); never typer's rich traceback, which shows local variables
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
    help="ipw measures the intelligence efficiency of LLM inference: correct answers per joule (IPJ), "
    "accuracy per watt (IPW) and routing coverage, on your own hardware.",
)


def _version(value: bool) -> None:
    if value:
        from ipw import __version__

        print(f"ipw {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version of ipw and exit."),
    debug: bool = typer.Option(False, "--debug", help="On an unexpected error, show the traceback (also "
                               "accepted after the command, e.g. ipw run --debug; or set IPW_DEBUG=1)."),
) -> None:
    """ipw measures the intelligence efficiency of LLM inference."""


def _typer_option(option: Option) -> Any:
    """A typer option from its one declaration (``ipw.options``)."""
    return typer.Option(None if option.many else option.default, *option.flags, help=option.help,
                        envvar=option.envvar or None)


def with_options(command):
    """Each parameter of ``command`` typed with an option group of ``ipw.options`` becomes that group's options,
    after the command's arguments, for typer to parse; the command gets one object of the group, its values
    checked first (``ipw.options.check_options``: bounds, choices, ``requires``, ``excludes``; an IpwError, exit 2)."""
    hints = typing.get_type_hints(command)
    signature = inspect.signature(command)
    groups = {p.name: hints[p.name] for p in signature.parameters.values() if dataclasses.is_dataclass(hints[p.name])}
    declared = {name: options_of(group) for name, group in groups.items()}
    added = [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=_typer_option(o),
                               annotation=List[o.value_type] if o.many else
                               o.value_type if o.default is not None else Optional[o.value_type])
             for options in declared.values() for o in options]
    assert len({p.name for p in added}) == len(added), f"{command.__name__}: two options of one name"

    @functools.wraps(command)
    def parsed(**values: Any):
        made = {name: groups[name](**{o.name: tuple(values.pop(o.name) or ()) if o.many else values.pop(o.name)
                                      for o in options})
                for name, options in declared.items()}
        check_options(*made.values())
        return command(**values, **made)

    own = [p for p in signature.parameters.values() if p.name not in groups]
    parsed.__signature__ = signature.replace(parameters=own + added)
    parsed.__annotations__ = {**{p.name: hints[p.name] for p in own}, **{p.name: p.annotation for p in added}}
    return parsed


def _console():
    from rich.console import Console

    return Console(stderr=True)


@app.command()
@with_options
def run(
    config: Optional[Path] = typer.Argument(
        None, help="Run config (TOML) from configs/. Without one, the embedded default runs: 24 bundled "
        "queries through SmolLM2-135M-Instruct (chat) and Gemma-3-270M (few-shot)."),
    *, overrides: RunOptions, control: RunControl,
) -> None:
    """Run a query set through backends, measuring the energy of every query, and write a run folder."""
    from ipw.commands.run import run_command

    raise typer.Exit(run_command(config, overrides, control))


@app.command()
@with_options
def rescore(
    run: Path = typer.Argument(..., help="Run folder (results/<run_id>) to score again; it is not changed."),
    *, options: RescoreOptions,
) -> None:
    """Score a saved run again without re-running inference; writes a new run folder linked to it."""
    from ipw.commands.rescore import rescore_command

    raise typer.Exit(rescore_command(run, options))


@app.command("list")
def list_() -> None:
    """List backend kinds, bundled models and datasets, and the sensors this machine offers."""
    from ipw.commands.list import list_command

    raise typer.Exit(list_command())


@app.command()
@with_options
def compare(
    runs: List[Path] = typer.Argument(..., help="Run folders (results/<run_id>); every backend in them is compared."),
    *, routing: RoutingOptions, view: CompareOptions, prices: PriceOptions, router: RouterOptions,
) -> None:
    """Compare runs side by side (95% bootstrap CIs, paired differences) and the routing coverage."""
    from ipw.commands.compare import compare_command

    raise typer.Exit(compare_command(runs, routing, view, prices, router))


@app.command()
@with_options
def report(
    runs: List[Path] = typer.Argument(..., help="Run folders (results/<run_id>); every backend in them is shown."),
    *, routing: RoutingOptions, written: ReportOptions, router: RouterOptions,
) -> None:
    """A self-contained HTML report with plots (and a Markdown summary) of one or more runs."""
    from ipw.commands.report import report_command

    raise typer.Exit(report_command(runs, routing, written, router))


route_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, add_completion=False,
                          help="A router trained on a run's own records (hashed n-grams + logistic regression; "
                          "needs pip install 'ipw[route]'), scored out of sample (docs/ROUTING.md).")
app.add_typer(route_app, name="route")


@route_app.command("train")
@with_options
def route_train(
    runs: List[Path] = typer.Argument(..., help="Run folders with a cloud-role backend and local ones."),
    *, roles: RouteRoles, options: RouteTrainOptions,
) -> None:
    """Train a router on the runs' records and write it (JSON: versioned, states what it was trained on)."""
    from ipw.commands.route import train_command

    raise typer.Exit(train_command(runs, roles, options))


@route_app.command("score")
@with_options
def route_score(
    runs: List[Path] = typer.Argument(..., help="Run folders to score the router design on (out of sample)."),
    *, roles: RouteRoles, options: RouteScoreOptions, prices: PriceOptions,
) -> None:
    """Score a router design out of sample: k-fold by query and held-out categories, the curve over the threshold."""
    from ipw.commands.route import score_command

    raise typer.Exit(score_command(runs, roles, options, prices))


@app.command()
@with_options
def merge(
    shards: List[Path] = typer.Argument(..., help="The run folders of every shard (ipw run --shard K/N) of one run."),
    *, options: MergeOptions,
) -> None:
    """Combine the shard runs of one split (--shard 1/N ... N/N) into one run that compare, report and check
    treat like an unsharded run; prints its folder."""
    from ipw.commands.merge import merge_command

    raise typer.Exit(merge_command(shards, options))


@app.command()
@with_options
def check(
    ctx: typer.Context,
    paths: List[Path] = typer.Argument(..., help="BASELINE CANDIDATE: two run folders (same dataset); with --rerun, two "
                                       "config files; with --calibrate, two or more run folders of one configuration."),
    *, gate: GateOptions, outputs: CheckOutputs, rerun: RerunOptions, calibrate: CalibrateOptions,
) -> None:
    """CI gate: exit 1 when a metric regresses beyond its threshold and noise floor, significantly, or when the
    same queries took more tokens or failed more; 0 otherwise; 2 when the runs are not comparable (dataset,
    hardware, energy basis) or the usage is wrong."""
    from ipw.commands import check as command

    if calibrate.calibrate:
        raise typer.Exit(command.calibrate_command(paths, gate))
    if len(paths) != 2:  # the usage error of two plain arguments
        ctx.fail("Missing argument 'CANDIDATE'." if len(paths) < 2 else
                 f"Got unexpected extra argument ({' '.join(map(str, paths[2:]))})")
    base, cand = paths
    if rerun.rerun:
        raise typer.Exit(command.rerun_command(base, cand, gate, outputs, rerun))
    raise typer.Exit(command.pair_command(base, cand, gate, outputs))


@app.command()
@with_options
def serve(*, proxy: ProxyOptions, options: ServeOnly) -> None:
    """A measuring OpenAI-compatible proxy: forwards /v1/chat/completions, /v1/completions and /v1/models to an
    upstream server and returns each response's energy in usage.energy (and the x-ipw-energy-j header), split
    among overlapping requests; every request is a record of a run folder. Ctrl-C or SIGTERM finishes it."""
    from ipw.commands.serve import serve_command

    raise typer.Exit(serve_command(proxy, options))


@app.command(context_settings={"allow_interspersed_args": False})
@with_options
def wrap(
    command: Optional[List[str]] = typer.Argument(None, help="The command to run, after --, e.g. -- python client.py"),
    *, proxy: ProxyOptions, options: WrapOnly,
) -> None:
    """Run COMMAND behind the measuring proxy of ipw serve: it gets OPENAI_BASE_URL (and OPENAI_API_BASE)
    pointing at the proxy, and the energy summary is printed when it exits (with its exit code)."""
    from ipw.commands.serve import wrap_command

    raise typer.Exit(wrap_command(list(command or []), proxy, options))


@app.command()
@with_options
def doctor(*, options: DoctorOptions) -> None:
    """What this machine can measure, and at what resolution (exit 1 when a self-test check fails)."""
    from ipw.commands.doctor import doctor_command

    raise typer.Exit(doctor_command(options))


@app.command()
@with_options
def convert(
    model: str = typer.Argument(..., help="A GGUF file or a bundled model (smollm2-135m, gemma3-270m)."),
    out_dir: Optional[Path] = typer.Argument(
        None, help="Folder to write. Default: the per-machine cache ~/.cache/ipw/models (IPW_MODEL_CACHE), "
        "where vllm backends and servers look for it."),
    *, options: ConvertOptions,
) -> None:
    """Convert a GGUF model to a Hugging Face folder (float32), e.g. for vLLM on the CPU; prints the folder."""
    from ipw.commands.convert import convert_command

    raise typer.Exit(convert_command(model, out_dir, options))


export_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, add_completion=False,
                         help="Export run folders into the tools operators already run (docs/guide/monitoring.md).")
app.add_typer(export_app, name="export")


@export_app.command("mlflow")
@with_options
def export_mlflow(
    runs: List[Path] = typer.Argument(..., help="Run folders (results/<run_id>); each is one MLflow run, found again "
                                      "by its ipw.run_id tag and updated when exported again."),
    *, options: MlflowExportOptions,
) -> None:
    """Log run folders to MLflow (MLFLOW_TRACKING_URI): the config as parameters, every backend's metrics with
    their CIs, the HTML report and manifest.json as artifacts. Needs pip install 'ipw[mlflow]'."""
    from ipw.commands.export import mlflow_command

    raise typer.Exit(mlflow_command(runs, options))


EXIT_USAGE = 2  # a usage error or bad input (IpwError's default)
EXIT_BUG = 3  # an unexpected exception: a bug in ipw (or in an engine); --debug shows the traceback


def _is_click_exception(exc: BaseException) -> bool:
    """A usage error of the click that typer brings: the click package (typer < 0.22) or typer's own copy
    of it (typer._click), whose classes are not click's; recognized by name, so any typer version works."""
    return any(cls.__name__ == "ClickException" for cls in type(exc).__mro__)


def _error(text: str) -> None:
    """One line on stderr: secrets scrubbed, URLs redacted, control characters escaped, rich markup off."""
    from ipw.sanitize import message, one_line

    _console().print(f"[bold red]error:[/] {_escape(one_line(message(text)))}", highlight=False, markup=True,
                     soft_wrap=True)


def _escape(text: str) -> str:
    from rich.markup import escape  # a message may hold brackets, e.g. pip install 'ipw[ray]'

    return escape(text)


def _traceback() -> None:
    import traceback

    from ipw.sanitize import scrub

    sys.stderr.write(scrub(traceback.format_exc()))


def main(argv: list[str] | None = None) -> int:
    """The ``ipw`` entry point: returns the exit code (0 ok, 1 a failed check or an unfinished run,
    2 a usage error or bad input, 3 an unexpected error, 130 interrupted)."""
    from ipw.errors import IpwError

    args = list(sys.argv[1:] if argv is None else argv)
    end = args.index("--") if "--" in args else len(args)
    debug = "--debug" in args[:end] or os.environ.get("IPW_DEBUG", "") not in ("", "0")
    args = [a for i, a in enumerate(args) if not (a == "--debug" and i < end)]  # accepted anywhere
    if not args:
        args = ["--help"]  # bare `ipw`: the help, exit 0, whatever click does with no_args_is_help
    try:
        result = app(args=args, prog_name="ipw", standalone_mode=False)
    except IpwError as exc:
        if debug:
            _traceback()
        _error(exc.message)
        return exc.exit_code
    except KeyboardInterrupt:
        _console().print("interrupted")
        return 130
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        _console().print("aborted")
        return 130
    except SystemExit as exc:
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:
        if _is_click_exception(exc):  # click's usage errors: bad option, bad type, missing argument
            ctx = getattr(exc, "ctx", None)
            hint = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
            _error(cast(Any, exc).format_message() + hint)  # click's class: not one importable type
            return int(getattr(exc, "exit_code", EXIT_USAGE) or EXIT_USAGE)
        if debug:
            _traceback()
        _error(f"unexpected {type(exc).__name__}: {_first_line(exc)} (a bug in ipw? rerun with --debug for the "
               "traceback)")
        return EXIT_BUG
    return result if isinstance(result, int) else 0


def _first_line(exc: BaseException) -> str:
    from ipw.sanitize import scrub

    text = scrub(str(exc)).strip()  # scrubbed before it is cut short
    return (text.splitlines() or [""])[0][:300]


#: After the command has returned, how long the process may take to exit (its threads, child processes and
#: exit handlers) before ``entry`` prints every thread's stack and ends it with the command's exit code.  On
#: the H200 a failed vLLM start once printed its error, finished its run folder and then did not exit for
#: about 8 minutes (docs/GPU.md); whatever holds an exit like that is named in the stacks, not waited for.
EXIT_GRACE_S = 30.0
#: How long the watchdog's report (the stacks, on stderr) may take before it ends the process anyway: a write
#: to a pipe nobody reads, or to a stream another thread holds locked while its own write blocks, never ends.
EXIT_REPORT_S = 5.0


def _exit_watchdog(code: int, grace_s: float) -> None:
    """A daemon thread that, if the process is still alive ``grace_s`` after the command returned, writes
    every thread's stack to stderr and ends the process with ``code`` (daemon threads run on while the
    interpreter joins the others and runs its exit handlers: where such a hang happens).  The report is
    written by a thread of its own, and the process ends ``EXIT_REPORT_S`` later whether or not it was; both
    threads start now (a thread cannot be started once the interpreter is finalizing)."""
    import faulthandler
    import threading
    import time

    reported = threading.Event()

    def report() -> None:
        time.sleep(grace_s)
        sys.stdout.flush()
        sys.stderr.write(f"ipw: the command ended (exit {code}) but the process was still running {grace_s:g} s "
                         "later; its threads' stacks follow (a bug in ipw? please report them). Exiting now.\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        reported.set()

    def bite() -> None:
        time.sleep(grace_s)
        reported.wait(EXIT_REPORT_S)
        os._exit(code)

    threading.Thread(target=report, name="ipw-exit-report", daemon=True).start()
    threading.Thread(target=bite, name="ipw-exit-watchdog", daemon=True).start()


def entry() -> None:
    """The ``ipw`` console script: ``main``, then an exit that cannot hang (``EXIT_GRACE_S``;
    ``IPW_EXIT_GRACE_S`` sets it, 0 turns the watchdog off).  Not armed by ``main``, which tests call in
    their own process."""
    code = main()
    try:
        grace_s = float(os.environ.get("IPW_EXIT_GRACE_S", EXIT_GRACE_S))
    except ValueError:
        grace_s = EXIT_GRACE_S
    if grace_s > 0:
        _exit_watchdog(code, grace_s)
    sys.exit(code)


if __name__ == "__main__":
    entry()
