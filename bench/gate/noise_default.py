"""Run-to-run noise of the embedded default, and what it means for ``ipw check`` thresholds.

Runs the embedded default (``ipw run``, nothing else on the machine) ``--runs`` times one after the
other (or reads existing run folders with ``--dirs``), then:

- per backend and metric, the level of each run and its spread (mean, standard deviation, coefficient
  of variation, max/min - 1);
- every ordered pair of runs through ``ipw check``'s own statistics (``ipw.analysis.check.check_runs``, the
  default α and 4,000 paired resamples): the largest adverse change seen, and how many pairs each
  candidate threshold would have failed (regression) or flagged (inconclusive). Identical code on the
  same machine, so every failure here is a false alarm.

It writes the section "Run-to-run spread of the embedded default" of docs/CHECK.md.

    .venv/bin/python bench/gate/noise_default.py --runs 5
    .venv/bin/python bench/gate/noise_default.py --dirs /tmp/noise/r*/*      # analyse existing runs

Output: docs/CHECK.md, section "Run-to-run spread of the embedded default" (``--json``: the raw result).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py
sys.path.insert(0, str(ROOT / "bench"))
from _shared import machine, write_section  # noqa: E402

DOC = ROOT / "docs" / "CHECK.md"
SECTION = "## Run-to-run spread of the embedded default"
IPW = str(Path(sys.executable).with_name("ipw"))
# thresholds tried against every pair of runs (the first two are the defaults)
CANDIDATES = {
    "energy_per_query": [5, 10, 15, 20],
    "accuracy": [-2],
    "j_per_token": [5, 10, 15, 20],
    "ipj": [-5, -10, -15, -20],
    "ttft_p50": [10, 20, 30, 50],
}


def run_default(n: int, out: Path) -> list[Path]:
    dirs = []
    for i in range(n):
        before = os.getloadavg()[0]
        start = time.monotonic()
        subprocess.run([IPW, "run", "--out", str(out / f"r{i + 1}")], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        print(f"run {i + 1}: {time.monotonic() - start:.1f} s, load before {before:.2f}", file=sys.stderr)
        dirs += sorted((out / f"r{i + 1}").iterdir())
    return dirs


def analyse(dirs: list[Path], alpha: float) -> dict:
    from ipw.analysis.check import check_runs, parse_threshold
    from ipw.results import load_run

    runs = [load_run(d) for d in dirs]
    thresholds = [parse_threshold(f"{m}:{v:+g}{'pp' if m == 'accuracy' else '%'}")
                  for m, vs in CANDIDATES.items() for v in vs]
    levels: dict[tuple[str, str], dict[int, float]] = {}  # (backend, metric) -> run index -> level
    pairs: dict[tuple[str, str], list[dict]] = {}
    for (i, (bm, b)), (j, (cm, c)) in itertools.permutations(enumerate(runs), 2):
        res = check_runs(bm, b, cm, c, thresholds, alpha=alpha)
        for v in res.verdicts:
            pairs.setdefault((v.backend, v.threshold), []).append({"change": v.change, "p": v.p_value,
                                                                    "status": v.status})
            levels.setdefault((v.backend, v.metric), {}).update({i: v.baseline, j: v.candidate})
    meta = []
    for d, (m, frame) in zip(dirs, runs):
        started = m.get("started_at", "")
        meta.append({"dir": str(d), "started_at": started, "n_records": len(frame),
                     "errors": int(frame["error"].notna().sum()) if "error" in frame else 0,
                     "quality": sorted(set(frame["energy_quality"].dropna()))})
    return {"runs": meta, "levels": {f"{b}|{m}": [v[k] for k in sorted(v)] for (b, m), v in levels.items()},
            "pairs": {f"{b}|{t}": v for (b, t), v in pairs.items()}, "alpha": alpha}


def table(res: dict) -> str:
    unit = {"energy_per_query": "J", "accuracy": "", "j_per_token": "J/token", "ipj": "correct/J", "ttft_p50": "s"}
    lines = ["| backend | metric | each run | mean | sd | CV | max/min - 1 |", "|---|---|---|---|---|---|---|"]
    for key, vals in res["levels"].items():
        backend, metric = key.split("|")
        mean = statistics.fmean(vals)
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        shown = ", ".join(f"{v:.4g}" for v in vals)
        if metric == "accuracy":
            lines.append(f"| {backend} | accuracy | {shown} | {mean:.1%} | {100 * sd:.2f} pp | | "
                         f"{100 * (max(vals) - min(vals)):.1f} pp |")
        else:
            lines.append(f"| {backend} | {metric} ({unit[metric]}) | {shown} | {mean:.4g} | {sd:.3g} | "
                         f"{sd / mean:.1%} | {max(vals) / min(vals) - 1:.1%} |")
    return "\n".join(lines)


def pair_table(res: dict) -> str:
    n_pairs = len(next(iter(res["pairs"].values())))
    lines = [f"| backend | threshold | largest adverse change over {n_pairs} ordered pairs | regression | "
             "inconclusive |", "|---|---|---|---|---|"]
    for key, rows in res["pairs"].items():
        backend, threshold = key.split("|")
        up = "+" in threshold.split(":")[1]
        worst = max(r["change"] for r in rows) if up else min(r["change"] for r in rows)
        unit = "pp" if threshold.endswith("pp") else "%"
        reg = sum(r["status"] == "regression" for r in rows)
        inc = sum(r["status"] == "inconclusive" for r in rows)
        lines.append(f"| {backend} | `{threshold}` | {worst:+.2f} {unit} | {reg} | {inc} |")
    return "\n".join(lines)


def write_doc(res: dict, command: str) -> None:
    runs = "\n".join(f"- {r['started_at']}: {r['n_records']} records, {r['errors']} errors, energy "
                     f"{'/'.join(r['quality'])}" for r in res["runs"])
    body = f"""{SECTION}

Measured by `bench/gate/noise_default.py`: the embedded default (`ipw run`: 24 queries through SmolLM2-135M
in a llama.cpp worker, role local, and Gemma-3-270M behind a managed llama.cpp server, role cloud; CPU-model
energy of each engine's process tree) {len(res['runs'])} times in a row with nothing else running, on {machine()}.

{runs}

Each metric's level per run and its spread:

{table(res)}

Every ordered pair of runs through `ipw check` (α = {res['alpha']:g}, paired bootstrap over the 24
queries). Same code, same machine: every regression or inconclusive verdict here would be a false alarm.

{pair_table(res)}

Reproduce (writes this section):

```bash
{command}
```
"""
    write_section(DOC, SECTION, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dirs", type=Path, nargs="+", help="analyse these run folders instead of running")
    parser.add_argument("--alpha", type=float, default=0.01)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.dirs:
        dirs = args.dirs
    else:
        dirs = run_default(args.runs, Path(tempfile.mkdtemp(prefix="ipw-noise-")))
    res = analyse(dirs, args.alpha)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1), encoding="utf-8")
    print(table(res))
    print(pair_table(res))
    if not args.no_write:
        write_doc(res, f".venv/bin/python bench/gate/noise_default.py --runs {len(dirs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
