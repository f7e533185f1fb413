"""Scale benchmark for ``ipw compare``: 1,000,000 queries x 5 backends (5,000,000 query records).

Generates synthetic run folders (records.parquet written directly with pandas, in the real column
layout), then runs ``ipw compare --format json`` in a subprocess and records its wall time and peak
RSS (``ru_maxrss`` of that child, from ``os.wait4``), and writes the result into docs/PERFORMANCE.md.

    .venv/bin/python bench/scale/compare_scale.py                     # 1M queries, writes docs/PERFORMANCE.md
    .venv/bin/python bench/scale/compare_scale.py --queries 100000 --no-write

Output: docs/PERFORMANCE.md, section "ipw compare at scale" (``--no-write``: printed only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py
sys.path.insert(0, str(ROOT / "bench"))
from _shared import machine, write_section  # noqa: E402

BUDGET_S = 10.0
BUDGET_RSS_MB = 2048.0
CATEGORIES = ["arithmetic", "dates", "general_knowledge", "logic", "science", "strings", "unit_conversion"]
# name, role, skill, J/query scale, seconds/query scale, energy quality, energy source
BACKENDS = [
    ("small-1b", "local", 0.55, 40.0, 0.6, "measured", "nvml.samples"),
    ("mid-3b", "local", 0.70, 90.0, 1.1, "measured", "nvml.samples"),
    ("mid-8b", "local", 0.80, 200.0, 2.0, "measured", "nvml.samples"),
    ("large-20b", "local", 0.86, 450.0, 3.5, "measured", "nvml.samples"),
    ("cloud-xl", "cloud", 0.93, 1100.0, 2.5, "estimated", "estimate.api"),
]
RUNS = [("run-a", BACKENDS[:3]), ("run-b", BACKENDS[3:])]  # two runs: 3 + 2 backends


def synthetic_frame(run_id: str, backends, n_queries: int, seed: int):
    """Records of ``backends`` over ``n_queries`` queries, one repeat, in the QueryRecord layout."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    ids = np.char.add("q", np.char.zfill(np.arange(n_queries).astype(str), 7))
    difficulty = np.random.default_rng(1).random(n_queries)  # shared by every run: same queries
    category = np.asarray(CATEGORIES)[np.random.default_rng(2).integers(0, len(CATEGORIES), n_queries)]
    frames = []
    for name, role, skill, joules, seconds, quality, source in backends:
        error = rng.random(n_queries) < 0.001
        correct = ((rng.random(n_queries) * 0.3 + difficulty * 0.7) < skill) & ~error
        latency = seconds * rng.lognormal(0.0, 0.4, n_queries)
        energy = joules * latency / seconds * rng.lognormal(0.0, 0.1, n_queries)
        tokens = rng.integers(8, 200, n_queries)
        start = np.cumsum(latency + 0.01) - latency
        frames.append(pd.DataFrame({
            "run_id": run_id, "backend": name, "model": name, "role": role, "query_id": ids,
            "category": category, "repeat": 0, "scorer": "exact", "prompt": "synthetic prompt",
            "answer": "42", "output": np.where(correct, "42", "41"), "correct": correct.astype(float),
            "error": np.where(error, "timeout", None), "error_category": np.where(error, "timeout", None),
            "prompt_tokens": 40, "completion_tokens": tokens, "ttft_s": np.where(error, np.nan, latency * 0.1),
            "latency_s": latency, "start_s": start, "end_s": start + latency, "energy_j": energy,
            "energy_quality": quality, "energy_source": source,
            "energy_scope": "gpu" if quality == "measured" else "datacenter_estimate",
            "best_effort_energy_j": energy, "net_energy_j": energy * 0.4, "energy_parts": "[]",
        }))
    return pd.concat(frames, ignore_index=True)


def generate(out_dir: Path, n_queries: int) -> list[Path]:
    """Write the synthetic run folders under ``out_dir``; returns their paths."""
    from ipw.results import RunFolder, RunManifest

    paths = []
    for i, (run_id, backends) in enumerate(RUNS):
        folder = RunFolder.create(out_dir, run_id, RunManifest.from_dict({"run_id": run_id,
            "command": ["bench/scale/compare_scale.py"],
            "config": {"backends": [{"name": b[0], "role": b[1]} for b in backends]},
            "dataset": {"name": "synthetic", "n_queries": n_queries, "fingerprint": f"synthetic:{n_queries}"},
            "backends": [{"name": b[0], "role": b[1]} for b in backends],
        }))
        synthetic_frame(run_id, backends, n_queries, seed=10 + i).to_parquet(folder.path / "records.parquet",
                                                                             index=False)
        folder.write_manifest(status="complete")
        paths.append(folder.path)
    return paths


def measure(paths: list[Path], repeats: int) -> dict:
    """Run ``ipw compare --format json`` on ``paths`` in a child process ``repeats`` times: wall time,
    CPU time (user + sys) and peak RSS (``ru_maxrss``) of that child, from ``os.wait4``."""
    cmd = [sys.executable, "-m", "ipw.cli", "compare", *map(str, paths), "--format", "json"]
    walls, cpus, peaks, loads = [], [], [], []
    out = None
    for _ in range(repeats):
        loads.append(os.getloadavg()[0])
        with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
            start = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, cwd=ROOT)
            _, status, usage = os.wait4(proc.pid, 0)
            walls.append(time.perf_counter() - start)
            proc.returncode = os.waitstatus_to_exitcode(status)
            stdout.seek(0)
            stderr.seek(0)
            if proc.returncode != 0:
                raise SystemExit(f"ipw compare failed ({proc.returncode}):\n{stderr.read()}")
            out = json.loads(stdout.read())
        cpus.append(usage.ru_utime + usage.ru_stime)
        peaks.append(usage.ru_maxrss / 1024.0)  # KiB on Linux
    return {"wall_s": statistics.median(walls), "wall_max_s": max(walls), "walls_s": [round(w, 2) for w in walls],
            "cpu_s": statistics.median(cpus), "peak_rss_mb": max(peaks), "load_avg_1min": [round(x, 1) for x in loads],
            "result": out}


SECTION = "## ipw compare at scale"


def write_doc(row: dict, doc: Path) -> None:
    r = row["result"]
    routing = r["routing"]
    body = f"""{SECTION}

`ipw compare` plus routing over **{row['n_queries']:,} queries x {row['n_backends']} backends
({row['n_records']:,} query records)** in {row['n_runs']} synthetic run folders (3 + 2 backends, one
repeat, the real records.parquet layout), measured as a child process
(`ru_maxrss` of that child from `os.wait4` for the peak RSS), on {row['machine']}.

| measure | result | budget | ratio |
|---|---|---|---|
| wall time, median of {len(row['walls_s'])} runs (with imports) | {row['wall_s']:.2f} s | {BUDGET_S:.0f} s | \
{row['wall_s'] / BUDGET_S:.2f} |
| wall time, slowest | {row['wall_max_s']:.2f} s | {BUDGET_S:.0f} s | {row['wall_max_s'] / BUDGET_S:.2f} |
| CPU time (user + sys), median | {row['cpu_s']:.2f} s | | |
| peak RSS | {row['peak_rss_mb']:.0f} MB | {BUDGET_RSS_MB:.0f} MB | {row['peak_rss_mb'] / BUDGET_RSS_MB:.2f} |

Each run's wall time: {', '.join(f'{w:.2f} s' for w in row['walls_s'])}; the 1-minute load average
before each run: {', '.join(map(str, row['load_avg_1min']))} (this machine is shared: other sessions'
processes compete for its 2 cores, so wall times vary with the load; CPU time above wall time is
Arrow's and OpenBLAS's threads using both cores).

Bootstrap used: {r['bootstrap']['n_boot']} resamples, {r['bootstrap']['method']} (see below).
Sanity: local coverage {routing['local_coverage']['value']:.3f}, oracle energy saved
{routing['oracle']['energy']['saved_fraction']['value']:.3f}.

Reproduce (writes this section):

```bash
.venv/bin/python bench/scale/compare_scale.py --queries {row['n_queries']} --repeats {len(row['walls_s'])}
```

How it stays within budget (`ipw/analysis/compare.py`, `ipw/analysis/stats.py`):

- Only the needed columns are read from records.parquet (`load_run(..., columns=..., categorical=...)`,
  low-cardinality strings as dictionaries), and Arrow's pool hands freed memory back after each run.
  Repeats are averaged per (backend, query) with `np.bincount` over integer codes, not a groupby.
- Every bootstrap statistic is a ratio of weighted column sums, so one resample is one row of weights
  `w` (how often each query is drawn) and all sums of all backends come from one matrix product
  `X @ w.T` (X: columns x queries), float32 above 20,000 queries (weights and 0/1 columns are exact
  in float32, value sums carry a relative error of ~1e-6, far inside any interval at that size;
  point values are always float64) and float64 below. The same
  weights serve every backend, so differences against the reference are paired. Columns known to be
  equal (e.g. "has energy" when every query has energy) are stored once.
- Weights come from `np.random.default_rng(seed)` into one reused buffer of at most 128 MB:
  multinomial counts (`integers` + `bincount`, the textbook bootstrap) up to 20,000 queries, and
  Poisson(1) counts above (a table lookup on 16 random bits; the Poisson bootstrap is asymptotically
  equivalent and much cheaper at large n, since no resample needs all n indices at once).
- The number of resamples is 2,000 up to 100,000 queries and `max(200, 2e8 / n)` above (200 at 1M:
  the 2.5% tails rest on 5 resamples each, ample for intervals this narrow relative to the values;
  `--n-boot` asks for more at proportional cost).
- Percentiles (TTFT, latency) are bootstrapped exactly from the same weights without sorting any
  resample: one partial sort finds a window of ranks around each quantile (±(4·sqrt(N) + 10) ranks,
  more than 8 standard deviations of the resampled rank); the weight below the window is one
  indicator column of the matrix product, and only the window is accumulated per resample.
  `tests/analysis/test_compare.py` checks this against brute-force weighted quantiles.
- At this size the time splits roughly into: imports ~0.7 s, reading and averaging 5M records
  ~2 s, routing ~0.3 s, bootstrap ~2 s. The peak RSS comes from the per-query matrices (7 x 40 MB),
  the bootstrap matrix (57 rows x 1M float32) and its weight buffer, and the largest run's frame while
  it is read.

The budget is read as 1,000,000 queries x 5 backends, the stricter reading. 1,000,000 records in all
(200,000 queries x 5 backends, `--queries 200000`) reads a fifth of the data and needs about 0.5 GB,
but takes a similar time: the default then draws 1,000 resamples, the same 2e8 weights.
"""
    write_section(doc, SECTION, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3, help="times ipw compare runs (the median is reported)")
    parser.add_argument("--no-write", action="store_true", help="print the result, do not edit docs/")
    parser.add_argument("--keep", type=Path, default=None, help="write the run folders here and keep them")
    parser.add_argument("--generate-only", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.generate_only:
        generate(args.generate_only, args.queries)
        return 0
    with tempfile.TemporaryDirectory(prefix="ipw-bench-") as tmp:
        out = args.keep or Path(tmp)
        t0 = time.perf_counter()
        # generated in a child process: a child forked from a large parent would inherit its resident
        # size into ru_maxrss, so this process stays small
        subprocess.run([sys.executable, __file__, "--generate-only", str(out), "--queries", str(args.queries)],
                       check=True, cwd=ROOT)
        paths = [out / run_id for run_id, _ in RUNS]
        print(f"generated {len(paths)} runs in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        row = measure(paths, args.repeats)
    row.update(n_queries=args.queries, n_backends=len(BACKENDS), n_runs=len(RUNS),
               n_records=args.queries * len(BACKENDS), machine=machine())
    print(json.dumps({k: v for k, v in row.items() if k != "result"}, indent=2))
    ok = row["wall_s"] <= BUDGET_S and row["peak_rss_mb"] <= BUDGET_RSS_MB
    if not args.no_write:
        write_doc(row, ROOT / "docs" / "PERFORMANCE.md")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
