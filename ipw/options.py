"""Every command's options, each declared once, in groups (issues 31 and 46).

A group is a frozen dataclass: each field is one option (``option(...)``: its flags, help, default, bounds,
choices and the options it ``requires`` or ``excludes``), its type the field's annotation.  ``cli.py`` makes
the typer options of a command from the groups its function takes (``cli.with_options``), checks what was
given (``check_options``: bounds, choices, ``requires``, ``excludes``) and hands the command one object per group.
``config.py`` checks a run config's fields against the bounds of ``RUN_OPTIONS``.  A value out of bounds or
a rule broken is an ``IpwError`` (exit 2) that names the option (``--repeats``, ``--blocks: only with
--rerun``) or the config field (``file.toml:3: field 'repeats'``), before anything runs.

No heavy import here: ``cli.py`` imports this module to build its commands.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ipw.errors import IpwError, ParameterError
from ipw.limits import MAX_G_PER_KWH, check_range


@dataclass(frozen=True)
class Option:
    """One option of a command.  ``flags``: its spellings, the first the long one (``--idle-s``; a switch with
    an off spelling: ``--work-gate/--no-work-gate``); its Python name is its group's field.  ``value_type``:
    what a value is (``many``: repeatable, a tuple of them).  ``key``: the run config field it overrides ("" =
    none).  ``default``: the command line's default (None: not given; the config or the library decides).
    ``low``/``high``: the bounds (``low_open``/``high_open``: the bound itself is out).  ``requires``: the
    flags it goes with, ``excludes``: those it cannot go with (given: set to other than its default).
    ``envvar``: an environment variable that gives it too."""

    flags: tuple[str, ...]
    value_type: type
    help: str
    name: str = ""
    key: str = ""
    default: Any = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    many: bool = False
    choices: tuple[str, ...] = ()  # the values it takes (none: any)
    requires: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    envvar: str = ""

    @property
    def flag(self) -> str:
        """The long flag, as messages name it (``--work-gate`` of ``--work-gate/--no-work-gate``)."""
        return self.flags[0].split("/")[0]

    @property
    def field_type(self) -> type:
        """The type of its config field's value in TOML: a path is a string, a repeatable option a list."""
        return list if self.many else str if self.value_type is Path else self.value_type

    def field_value(self, value: Any) -> Any:
        """A command-line value as its config field holds it (a path as a string, a list as a tuple)."""
        return tuple(value) if self.many else str(value) if self.value_type is Path else value

    def given(self, value: Any) -> bool:
        """Whether ``value`` was given: not the default (a repeatable option: not empty)."""
        return bool(value) if self.many else value is not None and value != self.default

    def check(self, value: Any, loc: str) -> Any:
        """``value`` (each value of a repeatable option) within the bounds and among the choices, else an
        IpwError at ``loc``; returns it (None: not given)."""
        for v in (value or ()) if self.many else (value,):
            if v is not None and (self.low is not None or self.high is not None):
                check_range(v, loc, low=self.low, high=self.high, low_open=self.low_open, high_open=self.high_open,
                            whole=self.value_type is int)
            if v is not None and self.choices and v not in self.choices:
                raise IpwError(f"{loc}: must be one of {', '.join(self.choices)}, got {v!r}")
        return value


def option(*flags: str, help: str, default: Any = None, **rules: Any) -> Any:
    """A field of a group: its default, and its option (``Option``'s fields: ``low``, ``high``, ``choices``,
    ``requires``, ...) in the field's metadata; its value type comes from the field's annotation."""
    return dataclasses.field(default=default, metadata={"option": (flags, help, rules)})


def options_of(group: type) -> tuple[Option, ...]:
    """The options a group declares, in its fields' order."""
    hints = typing.get_type_hints(group)
    out = []
    for f in dataclasses.fields(group):
        flags, help_text, rules = f.metadata["option"]
        value_type, many = _value_type(hints[f.name])
        out.append(Option(flags, value_type, help_text, name=f.name, default=f.default, many=many, **rules))
    return tuple(out)


def _value_type(hint: Any) -> tuple[type, bool]:
    """``int | None`` -> (int, False); ``tuple[str, ...]`` -> (str, True)."""
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return inner, False
    return hint, False


def check_options(*groups: Any) -> None:
    """The values of one command's groups against their options: bounds and choices, then each option given
    with the flags it ``requires`` and without those it ``excludes``.  An IpwError names the option (and the
    other one)."""
    declared = [(o, values[o.name]) for g in groups for values in (dataclasses.asdict(g),) for o in options_of(type(g))]
    for o, value in declared:
        o.check(value, o.flag)
    given = {o.flag for o, value in declared if o.given(value)}
    for o, _ in declared:
        if o.flag not in given:
            continue
        missing = [f for f in o.requires if f not in given]
        if missing:
            raise IpwError(f"{o.flag}: only with {' and '.join(o.requires)}")
        for other in o.excludes:
            if other in given:
                raise IpwError(f"{o.flag} and {other}: choose one")


def given(group: Any) -> dict[str, Any]:
    """A group's values by name, those not given (None, or an empty repeatable option) left out: the keywords of
    the library call it configures, whose own defaults then apply."""
    return {name: value for name, value in dataclasses.asdict(group).items() if value is not None and value != ()}


def by_name(group: tuple[Option, ...]) -> dict[str, Option]:
    return {o.name: o for o in group}


MAX_IDLE_S = 86_400.0  # a day: more is a typo, and would keep a run waiting
MAX_DOCTOR_S = 3600.0  # an hour of self-test or recording: more is a typo
MAX_TIMEOUT_S = 86_400.0  # a day for one request through ipw serve: more is a typo (1e300 overflows a socket's timeout)

# --- ipw run --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunOptions:
    """``ipw run``'s options that override the run config (``config.apply_overrides``); those with a ``key``
    are also the config's top-level fields of that name, checked against the same bounds."""

    dataset: str | None = option("--dataset", "-d", key="dataset", help="Query set: a bundled name (ipw-core, "
                                 "ipw-core-default) or a .jsonl/.csv/.parquet file with id, prompt, answer[, choices, "
                                 "category, scorer]. Overrides the config.")
    limit: int | None = option("--limit", "-n", key="limit", low=0, help="Run only the first N queries (0 = all).")
    backend: tuple[str, ...] = option("--backend", "-b", default=(), help="Backend to run: a name from the config, "
                                      "or KIND:MODEL such as llama-cpp:smollm2-135m or llama-cpp:/path/model.gguf. "
                                      "Repeat for several.")
    out: Path | None = option("--out", "-o", key="out_dir", help="Folder that receives the run folder (default "
                              "results/).")
    seed: int | None = option("--seed", key="seed", help="Sampling seed (greedy decoding ignores it).")
    repeats: int | None = option("--repeats", key="repeats", low=1, help="Times each query runs per backend.")
    warmup: int | None = option("--warmup", key="warmup", low=0, help="Unmeasured warm-up queries per backend.")
    idle_s: float | None = option("--idle-s", key="idle_s", low=0.0, high=MAX_IDLE_S,
                                  help="Seconds of idle baseline per backend (model loaded).")
    dataset_preset: str | None = option("--dataset-preset", key="dataset_preset", help="Layout of the dataset: mmlu, "
                                        "mmlu-pro, arc, gsm8k, math, problem-answer or ipw. Default: detected from the "
                                        "columns (and said).")
    split: str | None = option("--split", key="split", help="Split of a Hugging Face save_to_disk DatasetDict folder "
                               "(default test, validation, train).")
    category: tuple[str, ...] = option("--category", key="categories", default=(), help="Keep only queries of this "
                                       "category (repeat for several; case-insensitive).")
    sample: int | None = option("--sample", key="sample", low=0, help="Run a random sample of N queries, the same "
                                "for the same --seed (0 = all).")
    energy_split: str | None = option("--energy-split", key="energy_split", choices=("priced", "local"),
                                      help="How the energy of overlapping requests is split: priced (default: each "
                                      "accounting period by priced work, prompt and output tokens, so that identical "
                                      "work costs the same) or local (each moment by the work done in it). "
                                      "docs/SERVING.md.")
    concurrency: str | None = option("--concurrency", help="LEVELS: requests in flight, e.g. 1,4,16,64, swept on "
                                     "every backend that serves concurrent requests (kind openai, e.g. a managed "
                                     "llama-server); each level gets its own warm-up and idle baseline, and records "
                                     "carry their level. In-process engines stay at 1.")
    carbon_intensity: float | None = option("--carbon-intensity", key="carbon_intensity", low=0.0, high=MAX_G_PER_KWH,
                                            help="The grid's carbon intensity in gCO2e/kWh (0-2000), recorded in the "
                                            "manifest: compare, report and check then show gCO2e per query and per "
                                            "correct answer. No default: a run without one shows no carbon.")
    grid_region: str | None = option("--grid-region", key="grid_region", help="The grid's carbon intensity from the "
                                     "offline table (CodeCarbon's data): a country code (DE, FR, USA) or a cloud "
                                     "region (gcp:europe-west3); with --grid-live, an Electricity Maps zone.")
    grid_live: bool | None = option("--grid-live", key="grid_live", help="Ask Electricity Maps for --grid-region's "
                                    "latest intensity (key from ELECTRICITYMAPS_API_KEY); if it cannot be reached the "
                                    "run carries no intensity.")


RUN_OPTIONS = options_of(RunOptions)
RUN = by_name(RUN_OPTIONS)


@dataclass(frozen=True)
class RunControl:
    """How ``ipw run`` runs: resumed, one shard, on Ray; and what it shows at the end."""

    resume: Path | None = option("--resume", help="Continue an interrupted run folder: queries already recorded are "
                                 "kept, the rest run with the run's own config (give no other option than --shard, "
                                 "--ray, --shards).")
    shard: str | None = option("--shard", help="K/N: run only shard K of N of the query set (query i goes to shard "
                               "i % N + 1), e.g. --shard $SLURM_ARRAY_TASK_ID/4 with --array=1-4; combine the shard "
                               "folders with ipw merge.")
    ray: str | None = option("--ray", excludes=("--shard",), help="ADDRESS: run on a Ray cluster, one task per "
                             "(backend, shard), each measuring on its node: auto (RAY_ADDRESS or the cluster this "
                             "machine joined), HOST:6379, ray://HOST:10001, or local. Needs pip install 'ipw[ray]'. "
                             "Not with --shard (it splits the run into shards itself).")
    shards: int | None = option("--shards", low=1, requires=("--ray",), help="With --ray: split the query set into N "
                                "shards (default: as many tasks as the cluster runs at once); for one shard of a run "
                                "without Ray, give --shard K/N.")
    repair: bool = option("--repair", default=False, requires=("--resume",), help="With --resume: drop the damaged "
                          "lines of the run's records.jsonl (a line torn before the end, which ipw otherwise refuses "
                          "to read past); they are kept in records.dropped.jsonl and their queries run again.")
    full_table: bool = option("--full-table", default=False, help="End with every metric of every backend (ipw "
                              "compare's metrics table, one row per metric) instead of the summary: accuracy, "
                              "J/query, IPJ and errors per backend, which fits 100 columns.")
    metrics_port: int | None = option("--metrics-port", low=1, high=65535, help="Serve Prometheus metrics of the "
                                      "records at http://--metrics-host:PORT/metrics while the run goes (energy, "
                                      "requests, tokens, errors; docs/guide/monitoring.md). Needs pip install "
                                      "'ipw[prometheus]'.")
    metrics_host: str = option("--metrics-host", default="127.0.0.1", requires=("--metrics-port",), help="With "
                               "--metrics-port: the address to listen on (default 127.0.0.1: this machine only).")
    mlflow: bool = option("--mlflow", default=False, help="Log the finished run to MLflow (MLFLOW_TRACKING_URI; "
                          "experiment MLFLOW_EXPERIMENT_NAME or ipw): its config, every backend's metrics with their "
                          "CIs, the HTML report and the manifest, as ipw export mlflow does. The server is checked "
                          "before the run starts. Needs pip install 'ipw[mlflow]'; docs/guide/monitoring.md.")


@dataclass(frozen=True)
class RescoreOptions:
    """``ipw rescore``'s options."""

    scorer: str | None = option("--scorer", "-s", help="Scorer for every record: mcq, exact, numeric, contains, "
                                "regex or judge. Default: each record's own scorer (reproduces the run).")
    judge: str | None = option("--judge", help="Judge backend: KIND:MODEL (e.g. llama-cpp:smollm2-135m) or a backend "
                               "name of the run's config. Implies --scorer judge, except with --grading "
                               "vs-backend:NAME (which keeps the dataset scores).")
    grading: str | None = option("--grading", help="Judge grading: reference (CORRECT/INCORRECT vs the reference), "
                                 "pairwise (vs the reference in both orders, correct only when both agree) or "
                                 "vs-backend:NAME (coverage: win or tie in both orders against backend NAME's answer "
                                 "to the same query, kept in win_tie).")
    config: Path | None = option("--config", "-c", help="TOML file whose [judge] table sets the judge.")
    out: Path | None = option("--out", "-o", help="Folder that receives the new run folder (default: next to the "
                              "original).")


# --- ipw compare, ipw report, ipw route score -----------------------------------------------------------


@dataclass(frozen=True)
class RoutingOptions:
    """The options of ``ipw compare`` and ``ipw report`` that pick the reference and the roles and shape
    routing: the keywords of ``ipw.analysis.compare.compare`` (those not given: its defaults)."""

    reference: str | None = option("--reference", "-r", help="Backend the others are compared against (paired) and "
                                   "the cloud reference of routing: NAME, or NAME@cN for one concurrency level. "
                                   "Default: the first cloud-role backend, else the first backend; of one measured at "
                                   "several concurrency levels, the highest.")
    common_queries: bool = option("--common-queries", default=False, help="Runs of different query sets: compare "
                                  "them on the queries they share.")
    local: tuple[str, ...] = option("--local", default=(), help="Treat this backend as local (repeatable).")
    cloud: tuple[str, ...] = option("--cloud", default=(), help="Treat this backend as cloud (repeatable).")
    # the default, 0.8, is the library's (ipw.analysis.routing.ROUTER_ACCURACY; tests/commands/test_options.py keeps the two
    # in step): not given, compare uses its own
    router_accuracy: float | None = option("--router-accuracy", low=0.0, high=1.0, help="α: the share of queries a "
                                           "realistic router routes as the oracle would (0-1; default 0.8).")
    deadline: str | None = option("--deadline", help="METRIC=VALUE (METRIC: p50_latency, p95_latency, p50_ttft or "
                                  "p95_ttft; VALUE like 2s or 500ms): per backend, the concurrency level with the "
                                  "lowest J/query that meets it.")
    energy_basis: str = option("--energy-basis", default="chip", choices=("chip", "facility", "node"),
                               help="Which joules every table compares and routing minimises: chip (measured or "
                               "estimated at the chip), facility (chip x each backend's pue) or node (the whole "
                               "machine from its BMC). docs/ENERGY.md.")
    carbon_intensity: float | None = option("--carbon-intensity", low=0.0, high=MAX_G_PER_KWH, help="Re-price every "
                                            "run's carbon at this intensity (gCO2e/kWh, 0-2000), labelled; default: "
                                            "each run's own (none: no carbon shown).")
    grid_region: str | None = option("--grid-region", help="Re-price every run's carbon at this zone's intensity "
                                     "from the offline table (DE, FR, gcp:europe-west3), labelled.")
    pue: tuple[str, ...] = option("--pue", default=(), help="NAME=PUE: the facility overhead of a backend, or of "
                                  "every backend of a role (local, cloud), over the pue its run recorded (1-5; "
                                  "repeatable), e.g. cloud=1.2.")


ROUTING_OPTIONS = options_of(RoutingOptions)
ROUTING = by_name(ROUTING_OPTIONS)

#: The flag that sets each parameter of the analysis (``ipw.analysis.compare.compare``'s, and those of the
#: functions it shares with ``ipw check`` and ``ipw route``), whose errors name the parameter
#: (``ipw.errors.ParameterError``); a command names the flag (``naming_flags``).
PARAMETER_FLAGS = {"reference": "--reference", "local": "--local", "cloud": "--cloud",
                   "router_accuracy": "--router-accuracy", "deadline": "--deadline", "energy_basis": "--energy-basis",
                   "carbon_intensity": "--carbon-intensity", "grid_region": "--grid-region", "pue": "--pue",
                   "n_boot": "--n-boot", "usd_per_kwh": "--usd-per-kwh", "api_prices": "--api-price",
                   "fail_if": "--fail-if", "calibration_runs": "--calibrate", "floor": "--floor",
                   "router_threshold": "--router-threshold", "max_accuracy_loss": "--max-accuracy-loss",
                   "grading": "--grading", "folds": "--folds", "out": "--out"}


def naming_flags(command: Callable[..., int]) -> Callable[..., int]:
    """``command`` (a command's function) with the analysis's ``ParameterError`` re-raised naming the flag that
    set the parameter (``PARAMETER_FLAGS``): the message the user reads names what they typed."""

    @functools.wraps(command)
    def named(*args: Any, **kwargs: Any) -> int:
        try:
            return command(*args, **kwargs)
        except ParameterError as exc:
            raise exc.named(PARAMETER_FLAGS) from None

    return named


@dataclass(frozen=True)
class CompareOptions:
    """How ``ipw compare`` shows its numbers."""

    format: str = option("--format", "-f", default="table", choices=("table", "json", "csv", "markdown"),
                         help="table, json, csv or markdown.")
    n_boot: int | None = option("--n-boot", low=1, help="Bootstrap resamples (default 2000; fewer above 100,000 "
                                "queries, see docs/PERFORMANCE.md).")
    seed: int = option("--seed", default=0, low=0, help="Seed of the bootstrap resampling.")


@dataclass(frozen=True)
class PriceOptions:
    """Prices, for costs beside the energy (``ipw compare``, ``ipw route score``)."""

    usd_per_kwh: float | None = option("--usd-per-kwh", low=0.0, help="Electricity price: gives local backends a "
                                       "cost (their energy x price).")
    api_price: tuple[str, ...] = option("--api-price", default=(), help="NAME=IN,OUT: USD per million input and "
                                        "output tokens of a (cloud) backend.")


@dataclass(frozen=True)
class RouterOptions:
    """A trained router shown beside the oracle and the α-router (``ipw compare``, ``ipw report``)."""

    router: Path | None = option("--router", help="A router file (ipw route train): its design is retrained in folds "
                                 "on these runs and shown, scored out of fold, beside the oracle and the α-router "
                                 "(docs/ROUTING.md).")
    router_threshold: float | None = option("--router-threshold", low=0.0, high=1.0, requires=("--router",),
                                            help="With --router: the operating point's threshold (0..1; default the "
                                            "router's).")
    max_accuracy_loss: str | None = option("--max-accuracy-loss", requires=("--router",), help="With --router: the "
                                           "operating point is the most energy-saving threshold whose out-of-fold "
                                           "accuracy loss against cloud-only is within this (e.g. 1%).")


@dataclass(frozen=True)
class ReportOptions:
    """What ``ipw report`` writes."""

    out: Path = option("--out", "-o", default=Path("report.html"), help="The HTML report to write (one "
                       "self-contained file: plots inlined, nothing fetched when viewed).")
    markdown: Path | None = option("--markdown", help="Also write a Markdown summary (a CI job summary or a "
                                   "pull-request comment).")


# --- ipw route train, ipw route score ------------------------------------------------------------------


@dataclass(frozen=True)
class RouteRoles:
    """Which backends a router chooses among (``ipw route train``, ``ipw route score``)."""

    local: tuple[str, ...] = option("--local", default=(), help="Treat backend NAME as local (repeat for several).")
    cloud: tuple[str, ...] = option("--cloud", default=(), help="Treat backend NAME as the cloud reference.")


@dataclass(frozen=True)
class RouteTrainOptions:
    """``ipw route train``'s options besides the roles."""

    out: Path = option("--out", "-o", default=Path("router.json"), help="The router file to write (JSON).")
    grading: str = option("--grading", default="answer", help="What 'answers as well as the "
                          "cloud' means: answer (correct against the dataset's answer) or vs-backend (win/tie in the "
                          "records' judged comparison against the reference's answer).")
    threshold: float = option("--threshold", default=0.5, low=0.0, high=1.0, help="Default threshold stored in the "
                              "router: a query goes to the cheapest local backend whose predicted probability is at "
                              "least this (0..1).")
    min_queries: int = option("--min-queries", default=20, low=0, help="Refuse to train on fewer scored queries.")
    folds: int = option("--folds", default=5, low=2, help="k of the k-fold (by query) out-of-sample scoring.")
    seed: int = option("--seed", default=0, low=0, help="Seed of the folds and the bootstrap.")
    score: bool = option("--score/--no-score", default=True, help="Also score the design out of sample (k-fold by "
                         "query, held-out category) and keep the scores in the file.")


@dataclass(frozen=True)
class RouteScoreOptions:
    """``ipw route score``'s options besides the roles and prices."""

    router: Path | None = option("--router", help="A router file whose settings to retrain in folds (default: ipw "
                                 "route train's defaults).")
    grading: str | None = option("--grading", help="answer or vs-backend (default: the router's, "
                                 "else answer).")
    router_threshold: float | None = option("--router-threshold", low=0.0, high=1.0, help="With a router: the "
                                            "operating point's threshold (0..1; default the router's).")
    max_accuracy_loss: str | None = option("--max-accuracy-loss", help="With a router: the operating point is the "
                                           "most energy-saving threshold whose out-of-fold accuracy loss against "
                                           "cloud-only is within this (e.g. 1%).")
    min_queries: int | None = option("--min-queries", low=0, help="Refuse fewer scored queries (default 20).")
    folds: int = option("--folds", default=5, low=2, help="k of the k-fold by query.")
    seed: int = option("--seed", default=0, low=0, help="Seed of the folds and the bootstrap.")
    format: str = option("--format", "-f", default="table", choices=("table", "json"), help="table or json.")


# --- ipw merge, ipw check -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MergeOptions:
    out: Path = option("--out", "-o", default=Path("results"), help="Folder that receives the merged run folder.")


@dataclass(frozen=True)
class GateOptions:
    """What ``ipw check`` judges a change by (every mode)."""

    fail_if: tuple[str, ...] = option("--fail-if", default=(), help="METRIC:THRESHOLD, e.g. energy_per_query:+5%, "
                                      "accuracy:-2pp, j_per_token:+10%, ipj:-5%, ttft_p50:+20%, error_rate:+2pp. "
                                      "Repeat for several. Default: energy_per_query:+5%, accuracy:-2pp and "
                                      "error_rate:+2pp.")
    alpha: float = option("--alpha", default=0.01, low=0.0, high=1.0, low_open=True, high_open=True,
                          help="Significance level of the paired bootstrap test (0-1).")
    strict: bool = option("--strict", default=False, help="Fail on inconclusive changes too (beyond the threshold, "
                          "not significant or within the noise floor), and on changed token counts.")
    allow_hardware_mismatch: bool = option("--allow-hardware-mismatch", default=False,
                                           help="Compare runs made on different hardware.")
    floor: Path | None = option("--floor", help="Noise floor file (written by --calibrate): a change within a "
                                "metric's floor is noise, inconclusive at most.")
    work_gate: bool = option("--work-gate/--no-work-gate", default=True, help="Compare each query's prompt and output "
                             "tokens and errors exactly (greedy runs): more is a regression. Off for a model change, "
                             "whose answers differ by design.")
    energy_basis: str = option("--energy-basis", default="chip", choices=("chip", "facility", "node"),
                               help="Which joules the energy metrics compare: chip, facility (chip x each backend's "
                               "pue) or node (the BMC's); with --rerun only chip. docs/ENERGY.md.")


@dataclass(frozen=True)
class CheckOutputs:
    """Where ``ipw check`` writes its verdict besides the table."""

    markdown: Path | None = option("--markdown", help="Write a Markdown verdict table (job summary).")
    github: bool = option("--github", default=False, help="Print GitHub Actions annotations for failing metrics.")
    junit: Path | None = option("--junit", help="Write JUnit XML (one test case per metric).")


@dataclass(frozen=True)
class RerunOptions:
    """``ipw check --rerun``: the interleaved A/B job."""

    rerun: bool = option("--rerun", default=False, excludes=("--calibrate",), help="Interleaved A/B in this job: run "
                         "BASELINE.toml and CANDIDATE.toml in short blocks, pairs A B then B A over shards of the "
                         "same queries, then judge energy and time over the pairs (a drift of the machine's speed "
                         "cancels; the drift seen is reported).")
    blocks: int = option("--blocks", default=16, requires=("--rerun",), help="With --rerun: blocks in all, a "
                         "multiple of 4 and of 2 x --shards (each shard runs once a side per round; two rounds "
                         "measure the drift).")
    shards: int = option("--shards", default=4, requires=("--rerun",), help="With --rerun: split the query set into "
                         "N shards, one block pair each per round (1: every block runs every query).")
    out: Path | None = option("--out", "-o", requires=("--rerun",), help="With --rerun: folder that receives the "
                              "job's blocks (default results/).")
    base_python: str | None = option("--base-python", requires=("--rerun",), help="With --rerun: the interpreter (of "
                                     "another checkout or virtual environment) that runs the baseline's blocks.")
    cand_python: str | None = option("--cand-python", requires=("--rerun",), help="With --rerun: the interpreter that "
                                     "runs the candidate's blocks (a code change: the candidate checkout's venv).")
    backend: tuple[str, ...] = option("--backend", "-b", default=(), requires=("--rerun",), help="With --rerun: run "
                                      "only this backend of both configs (repeat for several).")
    limit: int | None = option("--limit", "-n", low=0, requires=("--rerun",), help="With --rerun: only the first N "
                               "queries.")


@dataclass(frozen=True)
class CalibrateOptions:
    """``ipw check --calibrate``: the noise floor."""

    calibrate: bool = option("--calibrate", default=False, requires=("--floor",), help="Measure the noise floor: the "
                             "largest change between any two of the given identical runs, per backend and metric, "
                             "written to --floor FILE.")


# --- ipw serve, ipw wrap --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProxyOptions:
    """The measuring proxy's options (``ipw serve``, ``ipw wrap``)."""

    upstream: str | None = option("--upstream", help="Base URL of a running OpenAI-compatible server to forward to, "
                                  "e.g. http://127.0.0.1:8080/v1 (llama.cpp, vLLM, SGLang, Ollama) or a hosted API (its "
                                  "energy is then the labeled API estimate). Or --backend.")
    backend: str | None = option("--backend", "-b", help="SERVER:MODEL: a server ipw starts and stops, e.g. "
                                 "llama-server:smollm2-135m (SERVER: llama-server, llama-cpp or vllm). Or --upstream.")
    out: Path | None = option("--out", "-o", help="Folder that receives the run folder (default results/).")
    name: str | None = option("--name", help="Backend name of the records (default: the server, or HOST:PORT).")
    host: str = option("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1: this machine "
                       "only).")
    api_key_env: str | None = option("--api-key-env", help="Environment variable holding the upstream's API key: "
                                     "sent upstream only, never written anywhere (with --route: the cloud's; the "
                                     "local upstream gets none). The clients' own Authorization is not forwarded.")
    token: str | None = option("--token", envvar="IPW_SERVE_TOKEN", help="Require clients to send Authorization: "
                               "Bearer TOKEN (or set IPW_SERVE_TOKEN, which keeps it out of the process list).")
    log_prompts: bool = option("--log-prompts", default=False, help="Keep prompts and outputs in the records "
                               "(default: their SHA-256 only).")
    max_body_mb: float = option("--max-body-mb", default=16.0, low=0.0, low_open=True, help="Largest request body "
                                "accepted (413 above it).")
    timeout_s: float = option("--timeout-s", default=600.0, low=0.0, low_open=True, high=MAX_TIMEOUT_S,
                              help="Longest an upstream request may take, start to last byte (at most a day).")
    idle_s: float = option("--idle-s", default=3.0, low=0.0, high=MAX_IDLE_S, help="Seconds of idle baseline "
                           "measured before the proxy opens.")
    role: str = option("--role", default="local", choices=("local", "cloud"), help="Role of the records for routing: "
                       "local or cloud.")
    parallel: int = option("--parallel", default=8, low=1, help="With --backend llama-server: its slots (most "
                           "requests in flight).")
    n_threads: int | None = option("--n-threads", help="With --backend: the server's CPU threads.")
    n_gpu_layers: int | None = option("--n-gpu-layers", help="With --backend llama-server: layers offloaded (default: "
                                      "all with a GPU).")
    n_ctx: int | None = option("--n-ctx", help="With --backend: context tokens per slot (default 4096).")
    upstream_pid: tuple[int, ...] = option("--upstream-pid", default=(), low=1, help="PID of the upstream server, for "
                                           "the CPU model on a machine without RAPL (default: the process listening "
                                           "on the upstream's port). Repeat for several.")
    energy_in_response: bool = option("--energy-in-response/--no-energy-in-response", default=True, help="Put each "
                                      "answer's energy in usage.energy: a provisional value with its ±90% at once "
                                      "(settled later in the run folder and at GET /v1/ipw/energy/ID). With "
                                      "--no-energy-in-response answers carry none: the energy is in the run folder "
                                      "only.")
    energy_wait: bool = option("--energy-wait", default=False, help="Hold each answer's last event until its energy "
                               "is settled (the sensors cover its end and its accounting period is split: on NVML "
                               "~0.1 s when it ran alone, up to a period of 5 s under continuous load), and put the "
                               "settled value in it instead of a provisional one. Not with --no-energy-in-response.")
    energy_split: str = option("--energy-split", default="priced", choices=("priced", "local"), help="How "
                               "overlapping requests' energy is split: priced (each accounting period by priced work: "
                               "identical work costs the same) or local (each moment by the work done in it). "
                               "docs/SERVING.md.")
    metrics: bool = option("--metrics/--no-metrics", default=True, help="Serve Prometheus metrics at GET /metrics on "
                           "the proxy's port (settled energy, requests, tokens, errors, power; with --token, for a "
                           "scrape that sends it): docs/guide/monitoring.md. Needs pip install 'ipw[prometheus]'.")


MAX_PORT = 65535


@dataclass(frozen=True)
class ServeOnly:
    """``ipw serve``'s options besides the proxy's: its port, a resumed folder, a router between two upstreams."""

    port: int = option("--port", "-p", default=8000, low=0, high=MAX_PORT, help="Port to listen on (0: a free one, "
                       "printed).")
    resume: Path | None = option("--resume", help="Continue the run folder of an ipw serve that was killed: new "
                                 "requests are added to it.")
    route: Path | None = option("--route", requires=("--local", "--cloud"), excludes=("--upstream", "--backend"),
                                help="A router file (ipw route train): each request goes to --local or --cloud as the "
                                "router says (one it cannot score: the cloud); docs/ROUTING.md.")
    local: str | None = option("--local", requires=("--route",), help="With --route: base URL of the local upstream.")
    cloud: str | None = option("--cloud", requires=("--route",), help="With --route: base URL of the cloud upstream.")


@dataclass(frozen=True)
class WrapOnly:
    """``ipw wrap``'s options besides the proxy's."""

    port: int = option("--port", "-p", default=0, low=0, high=MAX_PORT, help="Port of the proxy (default 0: a free "
                       "one).")


# --- ipw doctor, ipw convert ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DoctorOptions:
    """``ipw doctor``'s options (``python -m ipw.commands.doctor`` takes the same)."""

    self_test: bool = option("--self-test", default=False, help="On a GPU machine: ~60 s of call costs, update "
                             "periods, a 5 s idle / 5 s load step and the sampler's own overhead.")
    seconds: float = option("--seconds", default=60.0, low=0.0, low_open=True, high=MAX_DOCTOR_S,
                            help="Length of the self-test (or of --record-trace), at most an hour.")
    json: Path | None = option("--json", requires=("--self-test",), help="Also write the self-test's findings as "
                               "JSON.")
    record_trace: Path | None = option("--record-trace", help="Record every sensor library's raw readings for "
                                       "--seconds into this file (.json or .json.gz), the format the tests replay "
                                       "(docs/PLATFORMS.md).")


@dataclass(frozen=True)
class ConvertOptions:
    force: bool = option("--force", default=False, help="Convert again even when the folder holds a conversion.")


# --- ipw export -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MlflowExportOptions:
    experiment: str | None = option("--experiment", help="MLflow experiment (created if missing; default "
                                    "MLFLOW_EXPERIMENT_NAME, else ipw).")
