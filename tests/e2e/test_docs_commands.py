"""Every ``ipw`` command shown in a fenced code block of README.md and docs/**/*.md is run here, on this
CPU, or listed in SKIPPED with the reason it cannot run on a CPU test machine (issue 46: the docs cannot rot).

A command is a line of a ```` ``` ````, ```` ```bash ````, ```` ```console ```` or ```` ```yaml ```` (a CI
step's ``run:``) block that invokes ``ipw VERB`` (``.venv/bin/ipw`` is ``ipw``; ``$ ``, ``# comments``, ``\\``
continuations and the other links of an ``&&``/``|``/``;`` chain are dropped; a usage synopsis's indented
``[...]`` lines belong to it). A command shown but neither in RUNS nor in SKIPPED fails
``test_every_shown_command_is_run_or_listed`` with its file and line; an entry that no page shows any more
fails ``test_every_listed_command_is_still_shown``.

Running a command (``test_documented_command``): its text, with placeholders (``results/A``, ``RUN``,
``CONFIG``, ``~/data/...``, ports and URLs) replaced by real paths and a synopsis's ``[optional]`` parts left
out, runs in a scratch workspace (links to .venv, .ci and configs, so that the doc's relative paths work;
``ipw`` in process, ``serve``, ``wrap`` and ``--ray local`` as a process of their own) and must exit with the
code the doc implies; where the doc shows output, the fragments in ``expect`` (present in that doc's text,
whitespace aside) must be in the real output. RUNS states each command's substitutions and the limiting flags
added to it (``extra``). The inputs are real and small, made once per session by the documented commands
themselves, lazily, whatever order the tests run in:

- **default**: the embedded default (``ipw run``: SmolLM2 in process, Gemma-3-270M behind llama-server) and
  ``configs/local-vs-cloud.toml`` (three backends, 2 threads each), each on the bundled set's first science
  query, no warm-up, no idle baseline (``LIMIT``; the arithmetic queries run to max_tokens, ~100 s of a
  2-thread config on a busy 2-core VM): the README's output, then every ``compare``/``report``/``check``/
  ``rescore`` of ``results/A``/``results/B`` (A = local-vs-cloud, B = the default). A check's candidate is a
  copy of its baseline (exit 0; two real runs of one query on a shared VM can differ beyond +5%); the
  README's ``.ci/baseline-default`` check gets a copy of that committed 24-query run (a fresh one: ~100 s).
- **route**: ``ipw route train/score``, ``compare``/``report --router`` and ``serve --route`` (its local
  upstream the session's llama-server, its cloud a stub) on a copy of the committed baseline (a real run of
  the default: 24 queries, a router needs 20).
- **serving**: a tiny config (``TINY``: SmolLM2 behind llama-server, 8 tokens, ``--limit 2``) as ``CONFIG``:
  the ``--concurrency 1,4,16,64`` sweep, ``--energy-split local``, ``--ray local`` (a Ray instance on this
  machine, ~15 s), every ``--deadline`` command on the sweep; docs/CHECK.md's CI example
  (``configs/my-model.toml`` = TINY, ``baseline/my-model`` a copy of the candidate, ``baseline/floor.json``
  from check.md's ``ipw check --calibrate RUN RUN --floor FILE``); ``ipw merge`` of a ``--shard 1/1`` run.
- **datasets**: the ``--dataset``/``--backend``/``--repeats``/carbon/``--shard`` variants of ``ipw run`` at
  one query of SmolLM2 in process (``ONE``, ``SMALL``: the option is what they show, not the second backend);
  an MMLU-layout Parquet file made here, tests/data/presets' GSM8K ``save_to_disk`` folder.
- **serve**: ``ipw serve``/``ipw wrap`` (``--idle-s 0``: ``QUIET``) against one real llama-server (SmolLM2)
  started for the session, or one they start; one request each, then SIGTERM (exit 0); the run folder holds
  it with its estimated energy. ``wrap`` runs docs/guide/serve.md's ``my_client.py`` as the page shows it.
- **machine**: ``ipw list``, ``ipw doctor`` (without a BMC) and ``--record-trace`` (1 s instead of 24).
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ipw.cli import main

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# ---------------------------------------------------------------------------------------------------------------
# what the docs show

SHELL_FENCES = {"", "bash", "console", "sh", "shell", "yaml"}
VERBS = ("run", "rescore", "list", "compare", "report", "merge", "check", "serve", "wrap", "doctor", "convert",
         "route")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
IPW = re.compile(r"""(?:^|[\s"'])(?:[\w.-]*/)*ipw\s+(?:%s)(?=[\s"']|$)""" % "|".join(VERBS))


@dataclass(frozen=True)
class Shown:
    path: str  # relative to the repository
    line: int
    command: str  # whitespace collapsed, .venv/bin/ipw as ipw

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.command}"


def _strip_comment(line: str) -> str:
    """The line without a shell comment (a # outside quotes that starts a word)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _links(text: str) -> list[str]:
    """The commands of a chain: split at &&, ||, | and ; outside quotes and a synopsis's [...]."""
    parts, quote, depth, start, i = [], None, 0, 0, 0
    while i < len(text):
        ch = text[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[]":
            depth += 1 if ch == "[" else -1
        elif depth == 0:
            m = re.match(r"\s+(?:&&|\|\||\|)\s+|\s*;\s*", text[i:])
            if m:
                parts.append(text[start:i])
                i += m.end()
                start = i
                continue
        i += 1
    return [p for p in [*parts, text[start:]] if p.strip()]


def normalize(command: str) -> str:
    command = re.sub(r"(^|(?<=[\s\"']))\.venv/bin/ipw(?=\s|$)", "ipw", command.strip())
    return re.sub(r"\s+", " ", command)


def shown_in(text: str, path: str) -> list[Shown]:
    """The ipw commands of a Markdown text's shell-like fenced blocks."""
    out: list[Shown] = []
    lines = text.splitlines()
    fence: tuple[str, str] | None = None
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            if fence is None:
                fence = (m.group(1), m.group(2))
            elif m.group(1).startswith(fence[0]) and not m.group(2):
                fence = None
            i += 1
            continue
        if fence is None or fence[1] not in SHELL_FENCES:
            i += 1
            continue
        start, line = i, lines[i].strip()
        if fence[1] == "yaml":
            line = re.sub(r"^(?:-\s+)?run:\s*\|?\s*", "", line)
        line = _strip_comment(re.sub(r"^\$\s+", "", line)).rstrip()
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1].rstrip() + " " + _strip_comment(lines[i].strip()).rstrip()
        while "[" in line and i + 1 < len(lines) and re.match(r"^\s+\[", lines[i + 1]):  # a synopsis goes on
            i += 1
            line += " " + lines[i].strip()
        out += [Shown(path, start + 1, normalize(part)) for part in _links(line) if IPW.search(part)]
        i += 1
    return out


def shown_commands() -> list[Shown]:
    return [c for p in SOURCES for c in shown_in(p.read_text(encoding="utf-8"), p.relative_to(ROOT).as_posix())]


def flat(text: str) -> str:
    """Text with every run of whitespace (line breaks too: rich wraps titles) as one space."""
    return re.sub(r"\s+", " ", text)


# ---------------------------------------------------------------------------------------------------------------
# what cannot run here, and why

RERUN = ("16 blocks, each an ipw run process: minutes (at its least, 4 blocks of 2 queries of TINY, 29 s here, and "
         "an energy verdict over 2 block pairs of a shared VM that can flip); tests/running/test_interleave.py covers it")
SKIPPED: dict[str, str] = {
    "ipw run configs/gpu-serving.toml": "needs a GPU (SmolLM2 on llama-server built with CUDA, up to 64 in flight)",
    "ipw run configs/gpu-vllm.toml": "needs a GPU and vLLM with CUDA",
    "ipw run configs/cpu-serving.toml": "vLLM's CPU server: 25-35 s to start per level plus 3-4 GB, in .venv-vllm: "
                                        "minutes (tests/backends/test_vllm.py covers it)",
    ".venv-vllm/bin/ipw run --backend vllm:smollm2-135m --limit 3":
        "vLLM's CPU engine takes 25-35 s to start and 3-4 GB (tests/backends/test_vllm.py covers it)",
    "ipw run --grid-region DE --grid-live": "needs a hosted API key (ELECTRICITYMAPS_API_KEY) and the network",
    "ipw run configs/small-models.toml --ray auto": "needs a Ray cluster this machine joined (ray start)",
    "ipw run configs/small-models.toml --ray HEAD_IP:6379 --shards 16": "needs a multi-node Ray cluster",
    "ray job submit --address http://HEAD_IP:8265 -- ipw run configs/small-models.toml --ray auto":
        "needs a Ray cluster with its dashboard (ray[default])",
    'sbatch --dependency=afterok:$jobid --wrap "ipw merge results/shards-$jobid/* --out results"':
        "needs Slurm (sbatch); ipw merge itself runs here (its synopsis, docs/guide/ray.md)",
    "ipw check --rerun BASE.toml CAND.toml [--blocks 16] [--shards 4] [--out DIR] [--backend NAME ...] [--limit N] "
    "[--base-python PY] [--cand-python PY] [--fail-if ...] [--markdown FILE] [--github] [--junit FILE]":
        RERUN,
    "ipw check --rerun BASE.toml CAND.toml [--blocks 16] [--shards 4] [--base-python PY] [--cand-python PY] "
    "[--out DIR] [...]": RERUN,
    "cand/.venv/bin/ipw check --rerun base/configs/my-model.toml cand/configs/my-model.toml "
    "--base-python base/.venv/bin/python --cand-python cand/.venv/bin/python --out gate --github "
    "--markdown verdict.md --junit verdict.xml":
        "a GitHub Actions job: two checkouts, each set up, and 16 blocks of ipw run: minutes",
}

# ---------------------------------------------------------------------------------------------------------------
# what runs, and how

# a run of the bundled set (the default's or a repository config's): its first science query (a short answer:
# the arithmetic ones run to max_tokens), no warm-up, no idle baseline
LIMIT = "--category science --limit 1 --warmup 0 --idle-s 0"
ONE = "--limit 1 --warmup 0 --idle-s 0 --backend smollm2-135m"  # one query of the default's in-process SmolLM2
SMALL = f"--category science {ONE}"
QUIET = "--idle-s 0"  # ipw serve/wrap: no idle baseline before the proxy opens (3 s)
TINY = """dataset = "{queries}"
warmup = 0
idle_s = 0
[generation]
max_tokens = 8
[[backends]]
name = "smol-server"
kind = "openai"
model = "smollm2-135m"
role = "cloud"
mode = "chat"
server = "llama-server"
n_threads = 1
n_ctx = 1024
"""
QUERIES = [
    {"id": "a1", "prompt": "What is 2 + 3? Answer with just the number.", "answer": "5", "category": "arithmetic",
     "scorer": "numeric"},
    {"id": "s1", "prompt": "Write the word 'dog' in uppercase. Answer with just the word.", "answer": "DOG",
     "category": "strings", "scorer": "exact"},
    {"id": "c1", "prompt": "Repeat this word exactly: apple", "answer": "apple", "category": "copy",
     "scorer": "contains"},
    {"id": "a2", "prompt": "What is 10 - 4? Answer with just the number.", "answer": "6", "category": "arithmetic",
     "scorer": "numeric"},
]
COMPARE_JSON_KEYS = ("schema_version", "ipw_version", "runs", "queries", "bootstrap", "reference", "backends",
                     "serving", "deadline", "routing", "energy_basis", "facility", "carbon", "bases", "notes")


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + "\n" + self.err

    def folder(self, ws: Workspace) -> Path:
        """The run folder the command wrote (``wrote PATH``, a merge's printed path)."""
        m = re.search(r"^wrote (\S+)", self.text, re.M) or re.search(r"^(\S+)$", self.out.strip(), re.M)
        assert m, self.text[-2000:]
        path = ws.root / m.group(1)
        assert (path / "manifest.json").is_file(), path
        return path


@dataclass(frozen=True)
class Run:
    subs: tuple[tuple[str, str], ...] = ()  # doc text -> workspace value ("{name}": Workspace.value(name))
    extra: str = ""  # flags appended (a limit); stated in the docstring
    code: int = 0  # the exit code the doc implies
    expect: tuple[str, ...] = ()  # fragments of output that the doc shows (in shown_in) and the command prints
    shown_in: str = ""
    files: tuple[str, ...] = ()  # what it writes (relative to the workspace)
    env: tuple[tuple[str, str], ...] = ()  # for $VARIABLES in the command
    how: str = "ipw"  # ipw (in process), process (a process of its own, to its end), serve (one request, SIGTERM)
    same_as: str = ""  # a synopsis whose required form is that command: its result
    check: Callable[[Result, Workspace], None] | None = None


def _compare_json(result: Result, ws: Workspace) -> None:
    """The JSON layout of docs/guide/compare.md, "Output"."""
    data = json.loads(result.out)
    assert data["schema_version"] == 1
    assert set(COMPARE_JSON_KEYS) <= set(data), set(COMPARE_JSON_KEYS) - set(data)
    assert {"label", "metrics", "vs_reference", "energy_quality"} <= set(data["backends"][0])


def _trace(result: Result, ws: Workspace) -> None:
    json.loads(gzip.decompress((ws.root / "my-machine.json.gz").read_bytes()))


def _carbon(**expected: object) -> Callable[[Result, Workspace], None]:
    """The run folder carries the grid's carbon intensity: the number given, or the region's."""
    def check(result: Result, ws: Workspace) -> None:
        carbon = json.loads((result.folder(ws) / "manifest.json").read_text())["carbon"]
        assert {k: carbon[k] for k in expected} == expected and carbon["g_per_kwh"] > 0, carbon
    return check


def _merged(result: Result, ws: Workspace) -> None:
    """ipw merge prints the merged run folder's path (docs/guide/ray.md)."""
    manifest = json.loads((result.folder(ws) / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["merged_from"], manifest


def _serve_energy(route: bool = False) -> Callable[[Result, Workspace], None]:
    """The answer carried usage.energy (the first answer's provisional value is null on the CPU model: no
    power seen yet) and the run folder holds the request with its settled, estimated energy."""
    def check(result: Result, ws: Workspace) -> None:
        energy = json.loads(result.out.splitlines()[-1])
        assert {"energy_j", "quality", "split_method", "request_id"} <= set(energy), energy
        assert not route or energy["route"]["to"] in ("local", "cloud"), energy
        folder = re.search(r"run folder (\S+?)\.? ", result.err)
        assert folder, result.err
        path = ws.root / folder.group(1)
        records = [json.loads(line) for line in (path / "records.jsonl").read_text().splitlines()]
        assert len(records) == 1 and records[0]["energy_quality"] == "estimated" and records[0]["energy_j"] > 0
        assert json.loads((path / "manifest.json").read_text())["status"] == "complete", "SIGTERM finishes it"
    return check


RUNS: dict[str, Run] = {
    # default: the embedded default and local-vs-cloud, 2 queries each
    "ipw run": Run(extra=LIMIT, shown_in="README.md", expect=(
        "ipw run: per backend (95% bootstrap CIs, energy with measurement error; every metric: --full-table)",
        "┃ backend ┃ accuracy ┃ J/query ┃ IPJ (1/J) ┃ errors ┃ energy ┃",
        "routing (oracle: each query to the lowest-energy local backend that answers it, else the cloud)",
        "│ cloud reference │ gemma3-270m-server │", "│ local backends │ smollm2-135m │",
        "│ local coverage, win/tie │ n/a (vs a reference's answer, 0 judged) │",
        "coverage within a power envelope (local backends whose mean power fits)")),
    "ipw run [CONFIG] [--dataset PATH|NAME] [--limit N] [--backend NAME|KIND:MODEL ...] [--out DIR] [--seed N] "
    "[--repeats N] [--warmup N] [--idle-s SECONDS] [--dataset-preset NAME] [--split NAME] [--category NAME ...] "
    "[--sample N] [--resume RUN_DIR] [--shard K/N] [--ray ADDRESS [--shards N]] [--full-table] "
    "[--carbon-intensity G | --grid-region ZONE [--grid-live]]": Run(same_as="ipw run"),
    "ipw run configs/local-vs-cloud.toml --limit 50": Run(extra=LIMIT),
    "ipw run configs/local-vs-cloud.toml": Run(same_as="ipw run configs/local-vs-cloud.toml --limit 50"),
    "ipw compare results/A results/B --reference gemma3-270m --format markdown": Run(
        subs=(("results/A", "{lvc}"), ("results/B", "{default}")), expect=("gemma3-270m",)),
    "ipw compare results/A results/B --reference gemma3-270m": Run(
        subs=(("results/A", "{lvc}"), ("results/B", "{default}"))),
    "ipw compare results/A results/B --cloud big-model --router-accuracy 0.7 --format json": Run(
        subs=(("results/A", "{lvc}"), ("results/B", "{default}"), ("big-model", "gemma3-270m")), check=_compare_json),
    "ipw compare results/A results/other-set --common-queries": Run(
        subs=(("results/A", "{default}"), ("results/other-set", "{baseline}"))),
    "ipw compare results/20261129-162853-7749": Run(subs=(("results/20261129-162853-7749", "{default}"),)),
    "ipw compare RUN [RUN ...] [--reference NAME] [--common-queries] [--local NAME ...] [--cloud NAME ...] "
    "[--router-accuracy ALPHA] [--format table|json|csv|markdown] [--n-boot N] [--seed N] [--usd-per-kwh PRICE] "
    "[--api-price NAME=IN,OUT ...] [--deadline METRIC=VALUE]": Run(subs=(("RUN", "{default}"),)),
    "ipw report results/A results/B --out report.html --markdown summary.md": Run(
        subs=(("results/A", "{lvc}"), ("results/B", "{default}")), files=("report.html", "summary.md")),
    "ipw report results/A results/B --out report.html": Run(
        subs=(("results/A", "{lvc}"), ("results/B", "{default}")), files=("report.html",)),
    "ipw report RUN [RUN ...] [--out report.html] [--markdown summary.md] [--reference NAME] [--common-queries] "
    "[--local NAME ...] [--cloud NAME ...] [--router-accuracy 0.8] [--deadline METRIC=VALUE]": Run(
        subs=(("RUN", "{default}"),), files=("report.html",)),
    "ipw rescore RUN [--scorer NAME] [--judge KIND:MODEL|NAME] [--grading reference|pairwise|vs-backend:NAME] "
    "[--config FILE] [--out DIR]": Run(subs=(("RUN", "{default_copy}"),)),
    "ipw check .ci/baseline-default results/B --fail-if energy_per_query:+5% --fail-if accuracy:-2pp": Run(
        subs=(("results/B", "{baseline}"),), expect=("ipw check: PASS",)),
    "ipw check results/A results/B": Run(subs=(("results/A", "{default}"), ("results/B", "{default_copy}"))),
    "ipw check BASELINE_RUN CANDIDATE_RUN [--fail-if METRIC:THRESHOLD ...] [--alpha 0.01] [--strict] [--floor FILE] "
    "[--no-work-gate] [--allow-hardware-mismatch] [--markdown FILE] [--github] [--junit FILE]": Run(
        subs=(("BASELINE_RUN", "{default}"), ("CANDIDATE_RUN", "{default_copy}"))),
    # route: on a copy of the committed 24-query baseline
    "ipw route train results/RUN --out router.json": Run(subs=(("results/RUN", "{baseline}"),), files=("router.json",)),
    "ipw route score results/RUN --router router.json --max-accuracy-loss 1%": Run(
        subs=(("results/RUN", "{baseline}"), ("router.json", "{router}"))),
    "ipw compare results/RUN --router router.json": Run(subs=(("results/RUN", "{baseline}"), ("router.json", "{router}"))),
    "ipw compare results/RUN --router router.json --router-threshold 0.6": Run(
        subs=(("results/RUN", "{baseline}"), ("router.json", "{router}"))),
    "ipw report results/RUN --router router.json": Run(
        subs=(("results/RUN", "{baseline}"), ("router.json", "{router}")), files=("report.html",)),
    "ipw serve --route router.json --local http://127.0.0.1:8081/v1 --cloud http://127.0.0.1:8082/v1 --port 8000": Run(
        subs=(("router.json", "{router}"), ("http://127.0.0.1:8081/v1", "{llama}"), ("http://127.0.0.1:8082/v1", "{stub}"),
              ("--port 8000", "--port 0")), extra=QUIET, how="serve", check=_serve_energy(route=True)),
    # serving: the tiny config
    "ipw run CONFIG --concurrency 1,4,16,64": Run(subs=(("CONFIG", "{tiny}"),), extra="--limit 2"),
    "ipw run CONFIG --energy-split local": Run(subs=(("CONFIG", "{tiny}"),), extra="--limit 2"),
    "ipw run CONFIG --ray local": Run(subs=(("CONFIG", "{tiny}"),), extra="--limit 2", how="process"),
    "ipw compare results/<run> --deadline p95_latency=2s": Run(subs=(("results/<run>", "{sweep}"),)),
    "ipw report results/<run> --deadline p95_latency=2s": Run(subs=(("results/<run>", "{sweep}"),), files=("report.html",)),
    "ipw compare results/SWEEP --deadline p95_latency=2s": Run(subs=(("results/SWEEP", "{sweep}"),)),
    "ipw compare results/RUN --deadline p95_latency=2s": Run(subs=(("results/RUN", "{sweep}"),)),
    "ipw run configs/my-model.toml --out candidate": Run(subs=(("configs/my-model.toml", "{tiny}"),), extra="--limit 2"),
    "ipw check --calibrate RUN RUN [RUN ...] --floor FILE": Run(
        subs=(("RUN RUN", "{candidate} {baseline_model}"), ("FILE", "baseline/floor.json")),
        files=("baseline/floor.json",)),
    "ipw check baseline/my-model candidate/* --floor baseline/floor.json --fail-if energy_per_query:+5% "
    "--fail-if accuracy:-2pp --fail-if ttft_p50:+20% --github --markdown verdict.md --junit verdict.xml": Run(
        subs=(("baseline/my-model", "{baseline_model}"), ("candidate/*", "{candidate_dir}/*"),
              ("baseline/floor.json", "{floor}")), files=("verdict.md", "verdict.xml")),
    "ipw merge SHARD_RUN [SHARD_RUN ...] [--out DIR]": Run(subs=(("SHARD_RUN", "{shard}"),), check=_merged),
    # datasets: one query of the in-process SmolLM2
    "ipw run --dataset my_queries.jsonl --limit 20": Run(subs=(("my_queries.jsonl", "{queries}"),), extra=ONE),
    "ipw run --backend llama-cpp:smollm2-135m --dataset ipw-core": Run(extra=LIMIT),
    "ipw run --backend llama-cpp:/models/qwen2.5-1.5b-q4_k_m.gguf --limit 50": Run(
        subs=(("/models/qwen2.5-1.5b-q4_k_m.gguf", "{gguf}"),), extra=LIMIT),
    "ipw run configs/small-models.toml --repeats 3": Run(extra=SMALL),
    "ipw run --dataset ~/data/mmlu_test.parquet --category high_school_physics --sample 50 --seed 1": Run(
        subs=(("~/data/mmlu_test.parquet", "{mmlu}"),), extra=ONE, shown_in="docs/guide/benchmarks.md",
        expect=("detected dataset preset",)),
    "ipw run --dataset ~/data/gsm8k_saved --split test --dataset-preset gsm8k --limit 100": Run(
        subs=(("~/data/gsm8k_saved", "{gsm8k}"),), extra=ONE),
    "ipw run --carbon-intensity 350": Run(extra=SMALL, check=_carbon(g_per_kwh=350)),
    "ipw run --grid-region DE": Run(extra=SMALL, check=_carbon(zone="DE")),
    'ipw run configs/small-models.toml --shard "$SLURM_ARRAY_TASK_ID/8" --out "results/shards-$SLURM_ARRAY_JOB_ID"':
        Run(extra="--category science --limit 8 --warmup 0 --idle-s 0 --backend smollm2-135m",
            env=(("SLURM_ARRAY_TASK_ID", "1"), ("SLURM_ARRAY_JOB_ID", "42"))),
    # serve: one real llama-server for the session
    "ipw serve --upstream http://127.0.0.1:8080/v1 --port 8000 --out results/": Run(
        subs=(("http://127.0.0.1:8080/v1", "{llama}"), ("--port 8000", "--port 0")), extra=QUIET, how="serve",
        check=_serve_energy()),
    "ipw serve --backend llama-server:smollm2-135m --parallel 16 --port 8000": Run(
        subs=(("--port 8000", "--port 0"),), extra=QUIET, how="serve", check=_serve_energy()),
    "ipw wrap --backend llama-server:smollm2-135m --parallel 8 -- .venv/bin/python my_client.py": Run(
        subs=(("my_client.py", "{client}"),), extra=QUIET, how="process", shown_in="docs/guide/serve.md",
        expect=("{'energy_j': ", "'split_method': 'none'")),
    "ipw wrap --upstream http://127.0.0.1:8080/v1 -- sh -c 'my-bench --base-url \"$OPENAI_BASE_URL\"'": Run(
        subs=(("http://127.0.0.1:8080/v1", "{llama}"), ("my-bench", "{my_bench}")), extra=QUIET, how="process",
        expect=("'energy_j': ",)),
    # machine
    "ipw list": Run(expect=("smollm2-135m", "ipw-core", "llama-cpp")),
    "ipw doctor": Run(),
    "ipw doctor --record-trace my-machine.json.gz --seconds 24": Run(
        extra="--seconds 1", files=("my-machine.json.gz",), check=_trace),
}

CLIENT_BLOCK = re.compile(r"```python\n(import openai\n.*?)```", re.S)
MY_BENCH = """#!{python}
import json, sys, urllib.request
url = sys.argv[sys.argv.index("--base-url") + 1]
body = {{"model": "m", "messages": [{{"role": "user", "content": "Say hi."}}], "max_tokens": 4}}
req = urllib.request.Request(url + "/chat/completions", json.dumps(body).encode(), {{"Content-Type": "application/json"}})
print(json.load(urllib.request.urlopen(req, timeout=120))["usage"]["energy"])
"""


# ---------------------------------------------------------------------------------------------------------------
# the workspace: real inputs, made once, lazily


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _reduce(command: str) -> str:
    """A synopsis's required form: every [optional] part left out."""
    while True:
        reduced = re.sub(r"\s*\[[^\[\]]*\]", "", command)
        if reduced == command:
            return command
        command = reduced


def _ask(url: str) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    request = urllib.request.Request(url + "/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        body = answer.read().decode()
    if body.startswith("data:"):  # an upstream that streams whatever it is asked (the stub): the usage chunk
        chunks = [json.loads(e[5:]) for e in body.split("\n\n") if e.startswith("data: {")]
        return next(c["usage"]["energy"] for c in reversed(chunks) if c.get("usage"))
    return json.loads(body)["usage"]["energy"]


class Workspace:
    def __init__(self, root: Path, stack: contextlib.ExitStack) -> None:
        self.root = root
        self.stack = stack
        self.results: dict[str, Result] = {}
        self.values: dict[str, str] = {}
        for name in (".venv", ".ci", "configs"):
            (root / name).symlink_to(ROOT / name)
        (root / "bin").mkdir()
        self.env = {"COLUMNS": "150", "PATH": f"{root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}

    def __getitem__(self, name: str) -> str:  # str.format_map
        if name not in self.values:
            self.values[name] = str(self._make(name))
        return self.values[name]

    def _copy(self, folder: str | Path, name: str) -> Path:
        target = self.root / "copies" / name
        shutil.copytree(folder, target)
        return target

    def _make(self, name: str) -> Path | str:
        root = self.root
        if name == "default":
            return self.run("ipw run").folder(self)
        if name == "lvc":
            return self.run("ipw run configs/local-vs-cloud.toml --limit 50").folder(self)
        if name == "default_copy":
            return self._copy(self["default"], "default")
        if name == "baseline":
            return self._copy(ROOT / ".ci" / "baseline-default", "baseline")
        if name == "router":
            self.run("ipw route train results/RUN --out router.json")
            return root / "router.json"
        if name == "sweep":
            return self.run("ipw run CONFIG --concurrency 1,4,16,64").folder(self)
        if name == "candidate":
            return self.run("ipw run configs/my-model.toml --out candidate").folder(self)
        if name == "candidate_dir":
            return Path(self["candidate"]).parent
        if name == "floor":
            self.run("ipw check --calibrate RUN RUN [RUN ...] --floor FILE")
            return "baseline/floor.json"
        if name == "baseline_model":  # the CI example's committed baseline: a run of the same config
            (root / "baseline").mkdir(exist_ok=True)
            shutil.copytree(self["candidate"], root / "baseline" / "my-model")
            return "baseline/my-model"
        if name == "shard":
            result = self._ipw(["run", self["tiny"], "--shard", "1/1", "--limit", "2", "--out", "shards"], {})
            assert result.code == 0, result.text[-3000:]
            return result.folder(self)
        if name == "queries":
            path = root / "my_queries.jsonl"
            path.write_text("".join(json.dumps(q) + "\n" for q in QUERIES), encoding="utf-8")
            return path
        if name == "tiny":
            path = root / "tiny.toml"
            path.write_text(TINY.format(queries=self["queries"]), encoding="utf-8")
            return path
        if name == "mmlu":
            import pandas as pd

            path = root / "data" / "mmlu_test.parquet"
            path.parent.mkdir(exist_ok=True)
            pd.DataFrame({"question": ["Which quantity is measured in newtons?", "What is the SI unit of energy?",
                                       "Which planet is known as the Red Planet?"],
                          "subject": ["high_school_physics", "high_school_physics", "astronomy"],
                          "choices": [["force", "mass", "time", "charge"], ["watt", "joule", "volt", "ohm"],
                                      ["Venus", "Mars", "Jupiter", "Saturn"]],
                          "answer": [0, 1, 1]}).to_parquet(path)
            return path
        if name == "gsm8k":  # a save_to_disk DatasetDict (train, test) of GSM8K's layout, tests/data/presets
            path = root / "data" / "gsm8k_saved"
            shutil.copytree(ROOT / "tests" / "data" / "presets" / "gsm8k_hf", path)
            return path
        if name == "gguf":
            from ipw.inputs.models import resolve_model

            return resolve_model("smollm2-135m")[0]
        if name == "llama":
            return self._llama()
        if name == "stub":
            from openai_stub import Stub

            stub = Stub()
            self.stack.callback(stub.close)
            return stub.base_url
        if name == "client":  # docs/guide/serve.md's client, as the doc shows it
            match = CLIENT_BLOCK.search((ROOT / "docs" / "guide" / "serve.md").read_text(encoding="utf-8"))
            assert match, "docs/guide/serve.md: the my_client.py block"
            (root / "my_client.py").write_text(match.group(1), encoding="utf-8")
            return "my_client.py"
        if name == "my_bench":  # a load generator that takes the URL as a flag, on PATH
            bench = root / "bin" / "my-bench"
            bench.write_text(MY_BENCH.format(python=sys.executable), encoding="utf-8")
            bench.chmod(0o755)
            return "my-bench"
        raise KeyError(name)

    def _llama(self) -> str:
        """One real llama-server (SmolLM2-135M) for the session: the upstream a user runs."""
        from ipw.backends.base import BackendSpec, create_backend

        backend = create_backend(BackendSpec("smol", "openai", "smollm2-135m", options={
            "server": "llama-server", "n_threads": 1, "n_ctx": 512, "concurrency": 4, "server_timeout_s": 300.0}))
        backend.attach(self.root / "llama")
        backend.load()
        self.stack.callback(backend.close)
        return str(backend.base_url)

    def argv(self, command: str) -> tuple[list[str], Run]:
        spec = RUNS[command]
        text = _reduce(command)
        for old, new in spec.subs:
            assert old in text, (command, old)
            text = text.replace(old, new.format_map(self))
        args = shlex.split(text)
        end = args.index("--") if "--" in args else len(args)  # wrap's own options come before its command
        args[end:end] = shlex.split(spec.extra)
        if spec.how == "ipw":
            with _environ(dict(spec.env)):
                args = [os.path.expandvars(a) for a in args]
            args = [g for a in args for g in (sorted(glob.glob(a)) if "*" in a else [a])]
        assert args[0] in ("ipw", ".venv/bin/ipw"), args
        return args[1:], spec

    def run(self, command: str) -> Result:
        spec = RUNS[command]
        if spec.same_as:
            return self.run(spec.same_as)
        if command not in self.results:
            args, spec = self.argv(command)
            for name in spec.files:
                (self.root / name).unlink(missing_ok=True)
            self.results[command] = self._ipw(args, dict(spec.env)) if spec.how == "ipw" else self._launch(spec, args)
        return self.results[command]

    def _launch(self, spec: Run, args: list[str]) -> Result:
        return self._serve(args) if spec.how == "serve" else self._process(args, timeout=300)

    def _ipw(self, args: list[str], env: dict[str, str]) -> Result:
        out, err = io.StringIO(), io.StringIO()
        with (contextlib.chdir(self.root), _environ({**self.env, **env}), contextlib.redirect_stdout(out),
              contextlib.redirect_stderr(err)):
            code = main(args)
        return Result(code, out.getvalue(), err.getvalue())

    def _process(self, args: list[str], timeout: float) -> Result:
        done = subprocess.run([sys.executable, "-m", "ipw.cli", *args], capture_output=True, text=True,
                              timeout=timeout, cwd=self.root, env={**os.environ, **self.env})
        return Result(done.returncode, done.stdout, done.stderr)

    def _serve(self, args: list[str]) -> Result:
        """ipw serve as a process: wait for its URL, one request, then SIGTERM (its exit code is the result's);
        the request's usage.energy is the last line of the result's out."""
        proc = subprocess.Popen([sys.executable, "-m", "ipw.cli", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=self.root, env={**os.environ, **self.env})
        lines: list[str] = []
        try:
            deadline = time.monotonic() + 120
            while not any(re.search(r"ipw serve: http://", line) for line in lines):
                line = proc.stderr.readline() if proc.stderr else ""
                assert line and time.monotonic() < deadline, "".join(lines)
                lines.append(line)
            url = re.search(r"ipw serve: (http://\S+/v1)", "".join(lines))
            assert url, lines
            energy = _ask(url.group(1))
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return Result(proc.returncode, out + "\n" + json.dumps(energy), "".join(lines) + err)


@pytest.fixture(autouse=True)
def _signal_handlers_kept():
    """A command run in this process (``ipw serve``/``wrap``, Ray's ``ray.init``) may leave its own SIGINT or
    SIGTERM handler behind; later tests (test_serve's Ctrl-C and SIGTERM tests) need the ones they started with."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in before.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)


@pytest.fixture(scope="module")  # its llama-server stops with this module: test_llama_server counts strays
def docs_ws(tmp_path_factory) -> Iterator[Workspace]:
    with contextlib.ExitStack() as stack:
        yield Workspace(tmp_path_factory.mktemp("docs-commands"), stack)


# ---------------------------------------------------------------------------------------------------------------
# the tests


def test_extraction_of_a_markdown_text():
    """Prompts, comments, continuations, chains, yaml steps and synopses; output and other languages are not
    commands."""
    text = "\n".join([
        "```bash", "$ .venv/bin/ipw run --limit 3   # three", "bash .ci/setup && .venv/bin/ipw list",
        "ipw compare a \\", "   b --format json", "git archive HEAD ipw | tar -x", "```",
        "```", "ipw run [CONFIG] [--dataset PATH|NAME]", "        [--seed N]", "  ipw run: per backend", "```",
        "```yaml", "  run: .venv/bin/ipw check a b", "```", "```python", "ipw run x", "```",
        "```bash", "sbatch --wrap \".venv/bin/ipw merge r/* --out results\"", "```",
    ])
    assert [(c.line, c.command) for c in shown_in(text, "x.md")] == [
        (2, "ipw run --limit 3"), (3, "ipw list"), (4, "ipw compare a b --format json"),
        (9, "ipw run [CONFIG] [--dataset PATH|NAME] [--seed N]"), (14, "ipw check a b"),
        (20, 'sbatch --wrap "ipw merge r/* --out results"')]


def test_every_shown_command_is_run_or_listed():
    """A command the docs show that this test neither runs (RUNS) nor lists (SKIPPED) fails, named by file and
    line; RUNS and SKIPPED do not overlap."""
    unknown = [str(c) for c in shown_commands() if c.command not in RUNS and c.command not in SKIPPED]
    assert not unknown, "shown in the docs but neither run nor listed here:\n" + "\n".join(unknown)
    assert not set(RUNS) & set(SKIPPED)


def test_every_listed_command_is_still_shown():
    """An entry of RUNS or SKIPPED that no page shows any more fails (the tables cannot rot either); so does a
    shown output fragment that its page no longer shows."""
    shown = {c.command for c in shown_commands()}
    gone = [c for c in [*RUNS, *SKIPPED] if c not in shown]
    assert not gone, "listed here but shown nowhere:\n" + "\n".join(gone)
    for command, spec in RUNS.items():
        if spec.expect and spec.shown_in:
            page = flat((ROOT / spec.shown_in).read_text(encoding="utf-8"))
            missing = [f for f in spec.expect if flat(f) not in page]
            assert not missing, f"{spec.shown_in} no longer shows {missing} ({command})"


@pytest.mark.parametrize("command", list(RUNS), ids=[re.sub(r"[^\w./:=,+%<>*$-]+", "_", c)[:90] for c in RUNS])
def test_documented_command(docs_ws, command):
    """The command, with its placeholders real, exits as the doc says and prints what the doc shows."""
    spec = RUNS[command]
    result = docs_ws.run(command)
    assert result.code == spec.code, f"{command}: exit {result.code}\n{result.text[-4000:]}"
    printed = flat(result.text)
    missing = [f for f in spec.expect if flat(f) not in printed]
    assert not missing, f"{command}: {missing} not in its output:\n{result.text[-4000:]}"
    for name in spec.files:
        assert (docs_ws.root / name).is_file(), f"{command}: wrote no {name}"
    if spec.check:
        spec.check(result, docs_ws)
