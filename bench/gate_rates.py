"""Measured error rates of ``ipw check`` (issue 28): false alarms on identical runs and power against real
regressions, in both modes (a committed baseline; interleaved A/B blocks in one job).

One stream of runs of the embedded default's local backend (``ipw run --backend smollm2-135m``: SmolLM2-135M in a
llama.cpp worker, the default's 24 queries, one thread, every other setting the default's) is made in cycles of
four, ``A A R R``: two runs of the default (A), then two of a regressed configuration (R), the regression kind
rotating over the cycles:

- ``max_tokens_x2``: output length up, ``[generation] max_tokens`` 48 -> 96;
- ``no_prefix_cache``: engine slowed, llama.cpp's prefix cache off (every query prefills the chat template's
  shared system prompt again);
- ``threads_x2``: engine slowed, ``n_threads`` 1 -> 2 on this 2-core machine (the barrier spin of docs/CHECK.md).

From the stream:

- **interleaved, false alarms**: every 4 consecutive A runs, as blocks A B B A of one job (A runs sit at times 4k
  and 4k+1, so each such window is symmetric in time: linear drift cancels as in a real job);
- **interleaved, power**: the second A of a cycle, its two R runs, the first A of the next cycle (A R R A);
- **committed baseline, false alarms**: every pair of A runs at least ``--lag`` runs apart, the earlier one
  as the baseline (a baseline recorded minutes before the candidate, as a committed one is);
- **committed baseline, power**: every R run against the A runs made before it;
- **smallest regression caught 95% of the time**: the null pairs/jobs again, with the candidate's energy of
  every query multiplied by 1 + d, for a grid of d (a synthetic regression on real noise), the smallest d
  caught in >= 95% of them; the real regressions above check it.

The stream is resumable: a run whose folder is complete is kept, others are made (again).  Each run's wall
time and the load average before and after it are logged, since the machine is shared.

    .venv/bin/python bench/gate_rates.py --cycles 17 --work /tmp/gate-rates     # runs (resumable), then analysis
    .venv/bin/python bench/gate_rates.py --analyse-only --work /tmp/gate-rates
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("max_tokens_x2", "no_prefix_cache", "threads_x2")
BACKEND = "smollm2-135m"


def default_text() -> str:
    return (ROOT / "ipw" / "default.toml").read_text()


def config_text(kind: str) -> str:
    """The embedded default, or one regression of it (text edits that must each match exactly once)."""
    text = default_text()
    edits = {
        "A": [],
        "max_tokens_x2": [(r"max_tokens = 48\n", "max_tokens = 96\n")],
        "no_prefix_cache": [(r'(model = "smollm2-135m"\n(?:.*\n)*?n_threads = 1\n)', r"\1prefix_cache = false\n")],
        "threads_x2": [(r'(model = "smollm2-135m"\n(?:.*\n)*?)n_threads = 1\n', r"\1n_threads = 2\n")],
    }[kind]
    for pattern, repl in edits:
        text, n = re.subn(pattern, repl, text, count=1)
        if n != 1:
            raise SystemExit(f"could not make config {kind}: {pattern!r} not found in ipw/default.toml")
    return text


def plan(cycles: int) -> list[tuple[int, str]]:
    out = []
    for c in range(cycles):
        kind = KINDS[c % len(KINDS)]
        out += [("A"), ("A"), (kind), (kind)]
    return list(enumerate(out))


def complete(folder: Path) -> Path | None:
    runs = [p for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []
    if len(runs) == 1 and (runs[0] / "manifest.json").is_file():
        if json.loads((runs[0] / "manifest.json").read_text()).get("status") == "complete":
            return runs[0]
    return None


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def make_runs(work: Path, cycles: int) -> None:
    (work / "configs").mkdir(parents=True, exist_ok=True)
    for kind in ("A", *KINDS):
        (work / "configs" / f"{kind}.toml").write_text(config_text(kind))
    log = work / "runs.jsonl"
    for i, kind in plan(cycles):
        folder = work / "runs" / f"{i:03d}-{kind}"
        if complete(folder):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        before, t0 = loadavg(), time.time()
        cmd = [str(ROOT / ".venv" / "bin" / "ipw"), "run", str(work / "configs" / f"{kind}.toml"),
               "--backend", BACKEND, "--out", str(folder)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        entry = {"index": i, "kind": kind, "rc": proc.returncode, "started": dt.datetime.fromtimestamp(t0, dt.timezone.utc)
                 .isoformat(timespec="seconds"), "wall_s": round(time.time() - t0, 1), "loadavg_before": before,
                 "loadavg_after": loadavg()}
        with log.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        print(json.dumps(entry), flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-2000:], file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=17)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gate-rates"))
    parser.add_argument("--analyse-only", action="store_true")
    parser.add_argument("--lag", type=int, default=8, help="committed mode: runs between baseline and candidate")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "gate-rates")
    args = parser.parse_args()
    if not args.analyse_only:
        make_runs(args.work, args.cycles)
    try:
        from gate_analysis import analyse  # noqa: F401  (written below once ipw check's interleaved mode exists)
    except ImportError:
        analyse = None
    if analyse is not None:
        analyse(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
