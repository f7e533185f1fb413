"""The ipw command line: a thin shell around pure functions. ``IpwError`` maps to its exit code."""

from __future__ import annotations

import functools
import inspect
import os
import sys
from pathlib import Path
from typing import Any, List, Optional, cast

import typer

from ipw.options import ROUTING_OPTIONS, RUN_OPTIONS, Option

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


def _typer_option(option: Option):
    """A typer option from its one declaration (``ipw.options``): out-of-bounds values are an IpwError (exit 2)
    naming the option, as the command line is parsed."""

    def check(value: Any) -> Any:
        return value if option.many else option.check(value, option.flags[0])

    return typer.Option(option.default, *option.flags, help=option.help, callback=check)


def with_options(group: tuple[Option, ...]):
    """Adds the options of ``group`` to a command's parameters, after its arguments, for typer to parse; the
    command gets them in its ``**keywords``, by name (a repeatable one as a list, empty when not given)."""

    def add(command):
        @functools.wraps(command)
        def parsed(**values: Any):
            return command(**{**values, **{o.name: list(values[o.name] or ()) for o in group if o.many}})

        signature = inspect.signature(command)
        own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        at = sum(1 for p in own if isinstance(p.default, typer.models.ArgumentInfo))
        added = [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=_typer_option(o),
                                   annotation=List[o.value_type] if o.many else
                                   o.value_type if o.default is not None else Optional[o.value_type])
                 for o in group]
        parsed.__signature__ = signature.replace(parameters=own[:at] + [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in added + own[at:]])
        parsed.__annotations__ = {**command.__annotations__, **{p.name: p.annotation for p in added}}
        return parsed

    return add


def _console():
    from rich.console import Console

    return Console(stderr=True)


@app.command()
@with_options(RUN_OPTIONS)
def run(
    config: Optional[Path] = typer.Argument(
        None, help="Run config (TOML) from configs/. Without one, the embedded default runs: 24 bundled "
        "queries through SmolLM2-135M-Instruct (chat) and Gemma-3-270M (few-shot)."),
    resume: Optional[Path] = typer.Option(
        None, "--resume", help="Continue an interrupted run folder: queries already recorded are kept, the "
        "rest run with the run's own config (give no other option than --shard, --ray, --shards)."),
    shard: Optional[str] = typer.Option(
        None, "--shard", help="K/N: run only shard K of N of the query set (query i goes to shard i % N + 1), e.g. "
        "--shard $SLURM_ARRAY_TASK_ID/4 with --array=1-4; combine the shard folders with ipw merge."),
    ray: Optional[str] = typer.Option(
        None, "--ray", help="ADDRESS: run on a Ray cluster, one task per (backend, shard), each measuring on its "
        "node: auto (RAY_ADDRESS or the cluster this machine joined), HOST:6379, ray://HOST:10001, or local. "
        "Needs pip install 'ipw[ray]'."),
    shards: Optional[int] = typer.Option(
        None, "--shards", help="With --ray: split the query set into N shards (default: as many tasks as the "
        "cluster runs at once)."),
    repair: bool = typer.Option(
        False, "--repair", help="With --resume: drop the damaged lines of the run's records.jsonl (a line torn "
        "before the end, which ipw otherwise refuses to read past); they are kept in records.dropped.jsonl and "
        "their queries run again."),
    full_table: bool = typer.Option(
        False, "--full-table", help="End with every metric of every backend (ipw compare's metrics table, one row "
        "per metric) instead of the summary: accuracy, J/query, IPJ and errors per backend, which fits 100 "
        "columns."),
    **overrides,
) -> None:
    """Run a query set through backends, measuring the energy of every query, and write a run folder."""
    from ipw.commands.run import run_command

    raise typer.Exit(run_command(config, overrides, resume=resume, shard=shard, ray=ray, shards=shards,
                                 repair=repair, full_table=full_table))


@app.command()
def rescore(
    run: Path = typer.Argument(..., help="Run folder (results/<run_id>) to score again; it is not changed."),
    scorer: Optional[str] = typer.Option(
        None, "--scorer", "-s", help="Scorer for every record: mcq, exact, numeric, contains, regex or judge. "
        "Default: each record's own scorer (reproduces the run)."),
    judge: Optional[str] = typer.Option(
        None, "--judge", help="Judge backend: KIND:MODEL (e.g. llama-cpp:smollm2-135m) or a backend name of the "
        "run's config. Implies --scorer judge, except with --grading vs-backend:NAME (which keeps the dataset scores)."),
    grading: Optional[str] = typer.Option(
        None, "--grading", help="Judge grading: reference (CORRECT/INCORRECT vs the reference), pairwise (vs the "
        "reference in both orders, correct only when both agree) or vs-backend:NAME (coverage: win or tie in both "
        "orders against backend NAME's answer to the same query, kept in win_tie)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML file whose [judge] table sets the judge."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder that receives the new run folder "
                                       "(default: next to the original)."),
) -> None:
    """Score a saved run again without re-running inference; writes a new run folder linked to it."""
    from ipw.commands.rescore import rescore_command

    raise typer.Exit(rescore_command(run, scorer=scorer, judge=judge, grading=grading, config=config, out=out))


@app.command("list")
def list_() -> None:
    """List backend kinds, bundled models and datasets, and the sensors this machine offers."""
    from ipw.commands.list import list_command

    raise typer.Exit(list_command())


# options shared by ipw compare, ipw report and ipw route score
_USD_PER_KWH = typer.Option(
    None, "--usd-per-kwh", help="Electricity price: gives local backends a cost (their energy x price).")
_API_PRICE = typer.Option(
    None, "--api-price", help="NAME=IN,OUT: USD per million input and output tokens of a (cloud) backend.")
_ROUTER_FILE = typer.Option(
    None, "--router", help="A router file (ipw route train): its design is retrained in folds on these runs and "
    "shown, scored out of fold, beside the oracle and the α-router (docs/ROUTING.md).")
_ROUTER_THRESHOLD = typer.Option(
    None, "--router-threshold", help="With a router: the operating point's threshold (0..1; default the router's).")
_MAX_ACCURACY_LOSS = typer.Option(
    None, "--max-accuracy-loss", help="With a router: the operating point is the most energy-saving threshold "
    "whose out-of-fold accuracy loss against cloud-only is within this (e.g. 1%).")


@app.command()
@with_options(ROUTING_OPTIONS)
def compare(
    runs: List[Path] = typer.Argument(..., help="Run folders (results/<run_id>); every backend in them is compared."),
    fmt: str = typer.Option("table", "--format", "-f", help="table, json, csv or markdown."),
    n_boot: Optional[int] = typer.Option(
        None, "--n-boot", help="Bootstrap resamples (default 2000; fewer above 100,000 queries, see docs/PERFORMANCE.md)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the bootstrap resampling."),
    usd_per_kwh: Optional[float] = _USD_PER_KWH, api_price: Optional[List[str]] = _API_PRICE,
    router: Optional[Path] = _ROUTER_FILE, router_threshold: Optional[float] = _ROUTER_THRESHOLD,
    max_accuracy_loss: Optional[str] = _MAX_ACCURACY_LOSS,
    **routing,
) -> None:
    """Compare runs side by side (95% bootstrap CIs, paired differences) and the routing coverage."""
    from ipw.commands.compare import compare_command

    raise typer.Exit(compare_command(runs, fmt=fmt, n_boot=n_boot, seed=seed, usd_per_kwh=usd_per_kwh,
                                     api_prices=api_price or [], router=router, router_threshold=router_threshold,
                                     max_accuracy_loss=max_accuracy_loss, **routing))


@app.command()
@with_options(ROUTING_OPTIONS)
def report(
    runs: List[Path] = typer.Argument(..., help="Run folders (results/<run_id>); every backend in them is shown."),
    out: Path = typer.Option(Path("report.html"), "--out", "-o", help="The HTML report to write (one "
                             "self-contained file: plots inlined, nothing fetched when viewed)."),
    markdown: Optional[Path] = typer.Option(
        None, "--markdown", help="Also write a Markdown summary (a CI job summary or a pull-request comment)."),
    router: Optional[Path] = _ROUTER_FILE, router_threshold: Optional[float] = _ROUTER_THRESHOLD,
    max_accuracy_loss: Optional[str] = _MAX_ACCURACY_LOSS,
    **routing,
) -> None:
    """A self-contained HTML report with plots (and a Markdown summary) of one or more runs."""
    from ipw.commands.report import report_command

    raise typer.Exit(report_command(runs, out=out, markdown=markdown, router=router, router_threshold=router_threshold,
                                    max_accuracy_loss=max_accuracy_loss, **routing))


route_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, add_completion=False,
                          help="A router trained on a run's own records (hashed n-grams + logistic regression; "
                          "needs pip install 'ipw[route]'), scored out of sample (docs/ROUTING.md).")
app.add_typer(route_app, name="route")
_ROUTE_LOCAL = typer.Option(None, "--local", help="Treat backend NAME as local (repeat for several).")
_ROUTE_CLOUD = typer.Option(None, "--cloud", help="Treat backend NAME as the cloud reference.")
_ROUTE_GRADING = typer.Option("answer", "--grading", help="What 'answers as well as the cloud' means: answer "
                              "(correct against the dataset's answer) or vs-backend (win/tie in the records' judged "
                              "comparison against the reference's answer).")


@route_app.command("train")
def route_train(
    runs: List[Path] = typer.Argument(..., help="Run folders with a cloud-role backend and local ones."),
    out: Path = typer.Option(Path("router.json"), "--out", "-o", help="The router file to write (JSON)."),
    local: Optional[List[str]] = _ROUTE_LOCAL,
    cloud: Optional[List[str]] = _ROUTE_CLOUD,
    grading: str = _ROUTE_GRADING,
    threshold: float = typer.Option(0.5, "--threshold", help="Default threshold stored in the router: a query goes "
                                    "to the cheapest local backend whose predicted probability is at least this."),
    min_queries: int = typer.Option(20, "--min-queries", help="Refuse to train on fewer scored queries."),
    folds: int = typer.Option(5, "--folds", help="k of the k-fold (by query) out-of-sample scoring."),
    seed: int = typer.Option(0, "--seed", help="Seed of the folds and the bootstrap."),
    score: bool = typer.Option(True, "--score/--no-score", help="Also score the design out of sample (k-fold by "
                               "query, held-out category) and keep the scores in the file."),
) -> None:
    """Train a router on the runs' records and write it (JSON: versioned, states what it was trained on)."""
    from ipw.commands.route import train_command

    raise typer.Exit(train_command(runs, out=out, local=local or [], cloud=cloud or [], grading=grading,
                                   threshold=threshold, min_queries=min_queries, folds=folds, seed=seed, score=score))


@route_app.command("score")
def route_score(
    runs: List[Path] = typer.Argument(..., help="Run folders to score the router design on (out of sample)."),
    router: Optional[Path] = typer.Option(None, "--router", help="A router file whose settings to retrain in folds "
                                          "(default: ipw route train's defaults)."),
    local: Optional[List[str]] = _ROUTE_LOCAL,
    cloud: Optional[List[str]] = _ROUTE_CLOUD,
    grading: Optional[str] = typer.Option(None, "--grading", help="answer or vs-backend (default: the router's, "
                                          "else answer)."),
    router_threshold: Optional[float] = _ROUTER_THRESHOLD, max_accuracy_loss: Optional[str] = _MAX_ACCURACY_LOSS,
    min_queries: Optional[int] = typer.Option(None, "--min-queries", help="Refuse fewer scored queries (default 20)."),
    folds: int = typer.Option(5, "--folds", help="k of the k-fold by query."),
    seed: int = typer.Option(0, "--seed", help="Seed of the folds and the bootstrap."),
    fmt: str = typer.Option("table", "--format", "-f", help="table or json."),
    usd_per_kwh: Optional[float] = _USD_PER_KWH, api_price: Optional[List[str]] = _API_PRICE,
) -> None:
    """Score a router design out of sample: k-fold by query and held-out categories, the curve over the threshold."""
    from ipw.commands.route import score_command

    raise typer.Exit(score_command(runs, router_path=router, local=local or [], cloud=cloud or [], grading=grading,
                                   threshold=router_threshold, max_accuracy_loss=max_accuracy_loss,
                                   min_queries=min_queries, folds=folds, seed=seed, fmt=fmt, usd_per_kwh=usd_per_kwh,
                                   api_prices=api_price or []))


@app.command()
def merge(
    shards: List[Path] = typer.Argument(..., help="The run folders of every shard (ipw run --shard K/N) of one run."),
    out: Path = typer.Option(Path("results"), "--out", "-o", help="Folder that receives the merged run folder."),
) -> None:
    """Combine the shard runs of one split (--shard 1/N ... N/N) into one run that compare, report and check
    treat like an unsharded run; prints its folder."""
    from ipw.commands.merge import merge_command

    raise typer.Exit(merge_command(shards, out=out))


@app.command()
def check(
    ctx: typer.Context,
    paths: List[Path] = typer.Argument(..., help="BASELINE CANDIDATE: two run folders (same dataset); with --rerun, two "
                                       "config files; with --calibrate, two or more run folders of one configuration."),
    fail_if: Optional[List[str]] = typer.Option(
        None, "--fail-if", help="METRIC:THRESHOLD, e.g. energy_per_query:+5%, accuracy:-2pp, j_per_token:+10%, "
        "ipj:-5%, ttft_p50:+20%, error_rate:+2pp. Repeat for several. Default: energy_per_query:+5%, accuracy:-2pp "
        "and error_rate:+2pp."),
    alpha: float = typer.Option(0.01, "--alpha", help="Significance level of the paired bootstrap test."),
    strict: bool = typer.Option(False, "--strict", help="Fail on inconclusive changes too (beyond the threshold, "
                                "not significant or within the noise floor), and on changed token counts."),
    allow_hardware_mismatch: bool = typer.Option(False, "--allow-hardware-mismatch",
                                                 help="Compare runs made on different hardware."),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Write a Markdown verdict table (job summary)."),
    github: bool = typer.Option(False, "--github", help="Print GitHub Actions annotations for failing metrics."),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Write JUnit XML (one test case per metric)."),
    rerun: bool = typer.Option(False, "--rerun", help="Interleaved A/B in this job: run BASELINE.toml and "
                               "CANDIDATE.toml in short blocks, pairs A B then B A over shards of the same queries, "
                               "then judge energy and time over the pairs (a drift of the machine's speed cancels; "
                               "the drift seen is reported)."),
    blocks: int = typer.Option(16, "--blocks", help="With --rerun: blocks in all, a multiple of 4 and of 2 x --shards "
                               "(each shard runs once a side per round; two rounds measure the drift)."),
    shards: int = typer.Option(4, "--shards", help="With --rerun: split the query set into N shards, one block pair "
                               "each per round (1: every block runs every query)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="With --rerun: folder that receives the job's "
                                       "blocks (default results/)."),
    base_python: Optional[str] = typer.Option(None, "--base-python", help="With --rerun: the interpreter (of another "
                                              "checkout or virtual environment) that runs the baseline's blocks."),
    cand_python: Optional[str] = typer.Option(None, "--cand-python", help="With --rerun: the interpreter that runs "
                                              "the candidate's blocks (a code change: the candidate checkout's venv)."),
    backend: Optional[List[str]] = typer.Option(None, "--backend", "-b", help="With --rerun: run only this backend "
                                                "of both configs (repeat for several)."),
    limit: Optional[int] = typer.Option(None, "--limit", "-n", help="With --rerun: only the first N queries."),
    calibrate: bool = typer.Option(False, "--calibrate", help="Measure the noise floor: the largest change between any "
                                   "two of the given identical runs, per backend and metric, written to --floor FILE."),
    floor: Optional[Path] = typer.Option(None, "--floor", help="Noise floor file (written by --calibrate): a change "
                                         "within a metric's floor is noise, inconclusive at most."),
    work_gate: bool = typer.Option(True, "--work-gate/--no-work-gate", help="Compare each query's prompt and output "
                                   "tokens and errors exactly (greedy runs): more is a regression. Off for a model "
                                   "change, whose answers differ by design."),
    energy_basis: str = typer.Option("chip", "--energy-basis", help="Which joules the energy metrics compare: chip, "
                                     "facility (chip x each backend's pue) or node (the BMC's). docs/ENERGY.md."),
) -> None:
    """CI gate: exit 1 when a metric regresses beyond its threshold and noise floor, significantly, or when the
    same queries took more tokens or failed more; 0 otherwise; 2 when the runs are not comparable (dataset,
    hardware, energy basis) or the usage is wrong."""
    from ipw.commands.check import check_command

    if not calibrate and len(paths) != 2:  # the usage error of two plain arguments
        ctx.fail("Missing argument 'CANDIDATE'." if len(paths) < 2 else
                 f"Got unexpected extra argument ({' '.join(map(str, paths[2:]))})")
    raise typer.Exit(check_command(paths, fail_if=fail_if, alpha=alpha, strict=strict,
                                   allow_hardware_mismatch=allow_hardware_mismatch, markdown_path=markdown,
                                   github=github, junit_path=junit, rerun=rerun, blocks=blocks, shards=shards, out=out,
                                   base_python=base_python, cand_python=cand_python, backends=backend or [],
                                   limit=limit, calibrate=calibrate, floor_path=floor, work_gate=work_gate,
                                   energy_basis=energy_basis))


_UPSTREAM = typer.Option(None, "--upstream", help="Base URL of a running OpenAI-compatible server to forward to, e.g. "
                         "http://127.0.0.1:8080/v1 (llama.cpp, vLLM, SGLang, Ollama) or a hosted API (its energy is then "
                         "the labeled API estimate). Or --backend.")
_SERVE_BACKEND = typer.Option(None, "--backend", "-b", help="SERVER:MODEL: a server ipw starts and stops, e.g. "
                              "llama-server:smollm2-135m (SERVER: llama-server, llama-cpp or vllm). Or --upstream.")
_NAME = typer.Option(None, "--name", help="Backend name of the records (default: the server, or HOST:PORT).")
_HOST = typer.Option("127.0.0.1", "--host", help="Address to listen on (default 127.0.0.1: this machine only).")
_API_KEY_ENV = typer.Option(None, "--api-key-env", help="Environment variable holding the upstream's API key: sent "
                            "upstream only, never written anywhere. The clients' own Authorization is not forwarded.")
_TOKEN = typer.Option(None, "--token", envvar="IPW_SERVE_TOKEN", help="Require clients to send Authorization: Bearer "
                      "TOKEN (or set IPW_SERVE_TOKEN, which keeps it out of the process list).")
_LOG_PROMPTS = typer.Option(False, "--log-prompts", help="Keep prompts and outputs in the records (default: their "
                            "SHA-256 only).")
_MAX_BODY = typer.Option(16.0, "--max-body-mb", help="Largest request body accepted (413 above it).")
_TIMEOUT = typer.Option(600.0, "--timeout-s", help="Longest an upstream request may take, start to last byte.")
_SERVE_IDLE = typer.Option(3.0, "--idle-s", help="Seconds of idle baseline measured before the proxy opens.")
_ROLE = typer.Option("local", "--role", help="Role of the records for routing: local or cloud.")
_PARALLEL = typer.Option(8, "--parallel", help="With --backend llama-server: its slots (most requests in flight).")
_N_THREADS = typer.Option(None, "--n-threads", help="With --backend: the server's CPU threads.")
_NGL = typer.Option(None, "--n-gpu-layers", help="With --backend llama-server: layers offloaded (default: all with a GPU).")
_N_CTX = typer.Option(None, "--n-ctx", help="With --backend: context tokens per slot (default 4096).")
_SERVE_OUT = typer.Option(None, "--out", "-o", help="Folder that receives the run folder (default results/).")
_ENERGY_IN_RESPONSE = typer.Option(True, "--energy-in-response/--no-energy-in-response", help="Put each answer's "
                                   "energy in usage.energy: a provisional value with its ±90% at once (settled later "
                                   "in the run folder and at GET /v1/ipw/energy/ID). With --no-energy-in-response "
                                   "answers carry none: the energy is in the run folder only.")
_ENERGY_WAIT = typer.Option(False, "--energy-wait", help="Hold each answer's last event until its energy is settled "
                            "(the sensors cover its end and its accounting period is split: on NVML ~0.1 s when it "
                            "ran alone, up to a period of 5 s under continuous load), and put the settled value in "
                            "it instead of a provisional one.")
_ENERGY_SPLIT = typer.Option("priced", "--energy-split", help="How overlapping requests' energy is split: priced "
                             "(each accounting period by priced work: identical work costs the same) or local (each "
                             "moment by the work done in it). docs/SERVING.md.")
_UPSTREAM_PID = typer.Option(None, "--upstream-pid", help="PID of the upstream server, for the CPU model on a machine "
                             "without RAPL (default: the process listening on the upstream's port). Repeat for several.")


@app.command()
def serve(
    upstream: Optional[str] = _UPSTREAM, backend: Optional[str] = _SERVE_BACKEND,
    port: int = typer.Option(8000, "--port", "-p", help="Port to listen on (0: a free one, printed)."),
    out: Optional[Path] = _SERVE_OUT, name: Optional[str] = _NAME, host: str = _HOST,
    api_key_env: Optional[str] = _API_KEY_ENV, token: Optional[str] = _TOKEN, log_prompts: bool = _LOG_PROMPTS,
    max_body_mb: float = _MAX_BODY, timeout_s: float = _TIMEOUT, idle_s: float = _SERVE_IDLE, role: str = _ROLE,
    parallel: int = _PARALLEL, n_threads: Optional[int] = _N_THREADS, n_gpu_layers: Optional[int] = _NGL,
    n_ctx: Optional[int] = _N_CTX, upstream_pid: Optional[List[int]] = _UPSTREAM_PID,
    energy_in_response: bool = _ENERGY_IN_RESPONSE, energy_wait: bool = _ENERGY_WAIT,
    energy_split: str = _ENERGY_SPLIT,
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run folder of an ipw serve that was "
                                          "killed: new requests are added to it."),
    route: Optional[Path] = typer.Option(None, "--route", help="A router file (ipw route train): each request goes to "
                                         "--local or --cloud as the router says (one it cannot score: the cloud); "
                                         "docs/ROUTING.md."),
    local: Optional[str] = typer.Option(None, "--local", help="With --route: base URL of the local upstream."),
    cloud: Optional[str] = typer.Option(None, "--cloud", help="With --route: base URL of the cloud upstream."),
) -> None:
    """A measuring OpenAI-compatible proxy: forwards /v1/chat/completions, /v1/completions and /v1/models to an
    upstream server and returns each response's energy in usage.energy (and the x-ipw-energy-j header), split
    among overlapping requests; every request is a record of a run folder. Ctrl-C or SIGTERM finishes it."""
    from ipw.commands.serve import proxy_options, serve_command

    options, managed = proxy_options(**locals())
    raise typer.Exit(serve_command(options, managed, out=out, token=token, upstream_pid=upstream_pid, resume=resume))


@app.command(context_settings={"allow_interspersed_args": False})
def wrap(
    command: Optional[List[str]] = typer.Argument(None, help="The command to run, after --, e.g. -- python client.py"),
    upstream: Optional[str] = _UPSTREAM, backend: Optional[str] = _SERVE_BACKEND,
    port: int = typer.Option(0, "--port", "-p", help="Port of the proxy (default 0: a free one)."),
    out: Optional[Path] = _SERVE_OUT, name: Optional[str] = _NAME, host: str = _HOST,
    api_key_env: Optional[str] = _API_KEY_ENV, token: Optional[str] = _TOKEN, log_prompts: bool = _LOG_PROMPTS,
    max_body_mb: float = _MAX_BODY, timeout_s: float = _TIMEOUT, idle_s: float = _SERVE_IDLE, role: str = _ROLE,
    parallel: int = _PARALLEL, n_threads: Optional[int] = _N_THREADS, n_gpu_layers: Optional[int] = _NGL,
    n_ctx: Optional[int] = _N_CTX, upstream_pid: Optional[List[int]] = _UPSTREAM_PID,
    energy_in_response: bool = _ENERGY_IN_RESPONSE, energy_wait: bool = _ENERGY_WAIT,
    energy_split: str = _ENERGY_SPLIT,
) -> None:
    """Run COMMAND behind the measuring proxy of ipw serve: it gets OPENAI_BASE_URL (and OPENAI_API_BASE)
    pointing at the proxy, and the energy summary is printed when it exits (with its exit code)."""
    from ipw.commands.serve import proxy_options, wrap_command

    options, managed = proxy_options(**locals())
    raise typer.Exit(wrap_command(options, managed, list(command or []), out=out, token=token, upstream_pid=upstream_pid))


@app.command()
def doctor(
    self_test: bool = typer.Option(False, "--self-test", help="On a GPU machine: ~60 s of call costs, update "
                                   "periods, a 5 s idle / 5 s load step and the sampler's own overhead."),
    seconds: float = typer.Option(60.0, "--seconds", help="Length of the self-test."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the findings as JSON."),
    record_trace: Optional[Path] = typer.Option(
        None, "--record-trace", help="Record every sensor library's raw readings for --seconds into this file "
        "(.json or .json.gz), the format the tests replay (docs/PLATFORMS.md)."),
) -> None:
    """What this machine can measure, and at what resolution (exit 1 when a self-test check fails)."""
    from ipw.commands.doctor import doctor as run_doctor

    raise typer.Exit(run_doctor(self_test=self_test, seconds=seconds, json_path=str(json_path) if json_path else None,
                                record_trace=str(record_trace) if record_trace else None))


@app.command()
def convert(
    model: str = typer.Argument(..., help="A GGUF file or a bundled model (smollm2-135m, gemma3-270m)."),
    out_dir: Optional[Path] = typer.Argument(
        None, help="Folder to write. Default: the per-machine cache ~/.cache/ipw/models (IPW_MODEL_CACHE), "
        "where vllm backends and servers look for it."),
    force: bool = typer.Option(False, "--force", help="Convert again even when the folder holds a conversion."),
) -> None:
    """Convert a GGUF model to a Hugging Face folder (float32), e.g. for vLLM on the CPU; prints the folder."""
    from ipw.commands.convert import convert_command

    raise typer.Exit(convert_command(model, out_dir, force=force))


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


if __name__ == "__main__":
    sys.exit(main())
