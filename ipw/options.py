"""The option groups, each declared once: name, type, default, bounds and help (issue 31).

``cli.py`` makes its typer options from these tables (``cli.options``), ``config.py`` checks a run config's
fields against the same bounds (with file, line and field), and ``commands/run.py`` passes the given run
options on as one ``dict`` by name.  A value out of bounds is an ``IpwError`` (exit 2) that names the option
(``--repeats``) or the field (``file.toml:3: field 'repeats'``), when the command line is parsed or the
config is read, before anything runs.

No heavy import here: ``cli.py`` imports this module to build its commands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ipw.errors import IpwError


@dataclass(frozen=True)
class Option:
    """One option of a command.  ``flags``: its spellings, the first the long one (``--idle-s``); its Python
    name is that flag's (``idle_s``).  ``value_type``: what a value is.  ``key``: the run config field it
    overrides ("" = none).
    ``default``: the command line's default (None: the config decides, or not given).  ``low``/``high``:
    the bounds (``low_open``: ``low`` itself is out).  ``many``: repeatable, a list of values."""

    flags: tuple[str, ...]
    value_type: type
    help: str
    key: str = ""
    default: Any = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    many: bool = False
    choices: tuple[str, ...] = ()  # the values it takes (none: any)

    @property
    def name(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")

    @property
    def field_type(self) -> type:
        """The type of its config field's value in TOML: a path is a string, a repeatable option a list."""
        return list if self.many else str if self.value_type is Path else self.value_type

    def field_value(self, value: Any) -> Any:
        """A command-line value as its config field holds it (a path as a string, a list as a tuple)."""
        return tuple(value) if self.many else str(value) if self.value_type is Path else value

    def check(self, value: Any, loc: str) -> Any:
        """``value`` within the bounds, else an IpwError at ``loc``; returns it (None: not given)."""
        if value is not None and (self.low is not None or self.high is not None):
            check_range(value, loc, low=self.low, high=self.high, low_open=self.low_open, whole=self.value_type is int)
        if value is not None and self.choices and value not in self.choices:
            raise IpwError(f"{loc}: must be one of {', '.join(self.choices)}, got {value!r}")
        return value


def check_range(value: float, loc: str, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, whole: bool = False) -> None:
    """``low <= value <= high`` (``low < value`` when ``low_open``) and finite, else an IpwError at ``loc``
    (``whole``: the message speaks of a count, not of a finite number)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        bounds = " and ".join(b for b in ((f"> {low:g}" if low_open else f">= {low:g}") if low is not None else "",
                                          f"<= {high:g}" if high is not None else "") if b)
        raise IpwError(f"{loc}: must be {'' if whole else 'a finite number '}{bounds}, got {value!r}")


def by_name(group: tuple[Option, ...]) -> dict[str, Option]:
    return {o.name: o for o in group}


MAX_IDLE_S = 86_400.0  # a day: more is a typo, and would keep a run waiting
MAX_G_PER_KWH = 2000.0  # the dirtiest grids are ~1,000 gCO2e/kWh: more is a typo (ipw.carbon)
MAX_PUE = 5.0  # a datacenter's PUE: the Uptime Institute's surveys average ~1.56, the worst sites ~2.5-3; more is a typo

#: ``ipw run``'s options that override the run config (``config.apply_overrides``); those with a ``key`` are
#: also the config's top-level fields of that name, checked against the same bounds
RUN_OPTIONS: tuple[Option, ...] = (
    Option(("--dataset", "-d"), str, "Query set: a bundled name (ipw-core, ipw-core-default) or a .jsonl/.csv/"
           ".parquet file with id, prompt, answer[, choices, category, scorer]. Overrides the config.", key="dataset"),
    Option(("--limit", "-n"), int, "Run only the first N queries (0 = all).", key="limit", low=0),
    Option(("--backend", "-b"), str, "Backend to run: a name from the config, or KIND:MODEL such as "
           "llama-cpp:smollm2-135m or llama-cpp:/path/model.gguf. Repeat for several.", many=True),
    Option(("--out", "-o"), Path, "Folder that receives the run folder (default results/).", key="out_dir"),
    Option(("--seed",), int, "Sampling seed (greedy decoding ignores it).", key="seed"),
    Option(("--repeats",), int, "Times each query runs per backend.", key="repeats", low=1),
    Option(("--warmup",), int, "Unmeasured warm-up queries per backend.", key="warmup", low=0),
    Option(("--idle-s",), float, "Seconds of idle baseline per backend (model loaded).", key="idle_s",
           low=0.0, high=MAX_IDLE_S),
    Option(("--dataset-preset",), str, "Layout of the dataset: mmlu, mmlu-pro, arc, gsm8k, math, problem-answer or "
           "ipw. Default: detected from the columns (and said).", key="dataset_preset"),
    Option(("--split",), str, "Split of a Hugging Face save_to_disk DatasetDict folder (default test, validation, "
           "train).", key="split"),
    Option(("--category",), str, "Keep only queries of this category (repeat for several; case-insensitive).",
           key="categories", many=True),
    Option(("--sample",), int, "Run a random sample of N queries, the same for the same --seed (0 = all).",
           key="sample", low=0),
    Option(("--energy-split",), str, "How the energy of overlapping requests is split: priced (default: each "
           "accounting period by priced work, prompt and output tokens, so that identical work costs the same) or "
           "local (each moment by the work done in it). docs/SERVING.md.", key="energy_split", choices=("priced", "local")),
    Option(("--concurrency",), str, "LEVELS: requests in flight, e.g. 1,4,16,64, swept on every backend that serves "
           "concurrent requests (kind openai, e.g. a managed llama-server); each level gets its own warm-up and idle "
           "baseline, and records carry their level. In-process engines stay at 1."),
    Option(("--carbon-intensity",), float, "The grid's carbon intensity in gCO2e/kWh (0-2000), recorded in the "
           "manifest: compare, report and check then show gCO2e per query and per correct answer. No default: a "
           "run without one shows no carbon.", key="carbon_intensity", low=0.0, high=MAX_G_PER_KWH),
    Option(("--grid-region",), str, "The grid's carbon intensity from the offline table (CodeCarbon's data): a "
           "country code (DE, FR, USA) or a cloud region (gcp:europe-west3); with --grid-live, an Electricity Maps "
           "zone.", key="grid_region"),
    Option(("--grid-live",), bool, "Ask Electricity Maps for --grid-region's latest intensity (key from "
           "ELECTRICITYMAPS_API_KEY); if it cannot be reached the run carries no intensity.", key="grid_live"),
)
RUN = by_name(RUN_OPTIONS)

ROUTER_ACCURACY = 0.8  # α of the realistic router, when none is given

#: the options of ``ipw compare`` and ``ipw report`` that pick the reference and the roles and shape routing
ROUTING_OPTIONS: tuple[Option, ...] = (
    Option(("--reference", "-r"), str, "Backend the others are compared against (paired) and the cloud reference "
           "of routing: NAME, or NAME@cN for one concurrency level. Default: the first cloud-role backend, else the "
           "first backend; of one measured at several concurrency levels, the highest."),
    Option(("--common-queries",), bool, "Runs of different query sets: compare them on the queries they share.",
           default=False),
    Option(("--local",), str, "Treat this backend as local (repeatable).", many=True),
    Option(("--cloud",), str, "Treat this backend as cloud (repeatable).", many=True),
    Option(("--router-accuracy",), float, "α: the share of queries a realistic router routes as the oracle would.",
           default=ROUTER_ACCURACY, low=0.0, high=1.0),
    Option(("--deadline",), str, "METRIC=VALUE (METRIC: p50_latency, p95_latency, p50_ttft or p95_ttft; VALUE like "
           "2s or 500ms): per backend, the concurrency level with the lowest J/query that meets it."),
    Option(("--energy-basis",), str, "Which joules every table compares and routing minimises: chip (measured or "
           "estimated at the chip), facility (chip x each backend's pue) or node (the whole machine from its BMC). "
           "docs/ENERGY.md.", default="chip", choices=("chip", "facility", "node")),
    Option(("--carbon-intensity",), float, "Re-price every run's carbon at this intensity (gCO2e/kWh, 0-2000), "
           "labelled; default: each run's own (none: no carbon shown).", low=0.0, high=MAX_G_PER_KWH),
    Option(("--grid-region",), str, "Re-price every run's carbon at this zone's intensity from the offline table "
           "(DE, FR, gcp:europe-west3), labelled."),
    Option(("--pue",), str, "NAME=PUE: the facility overhead of a backend, or of every backend of a role (local, "
           "cloud), over the pue its run recorded (1-5; repeatable), e.g. cloud=1.2.", many=True),
)
ROUTING = by_name(ROUTING_OPTIONS)
