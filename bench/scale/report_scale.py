"""Scale benchmark for ``ipw report``: 100,000 query records (20,000 queries x 5 backends in 2 runs).

The run folders are the compare benchmark's synthetic ones (bench/scale/compare_scale.py, the real
records.parquet layout), with prompts and outputs of a few hundred characters each, and a
power.parquet of 1,000,000 sampled points in the first run. ``ipw report --out ... --markdown ...``
runs in a child process; its wall time and peak RSS (``ru_maxrss`` from ``os.wait4``) are recorded in
docs/PERFORMANCE.md.

    .venv/bin/python bench/scale/report_scale.py                    # 20,000 queries, writes docs/PERFORMANCE.md
    .venv/bin/python bench/scale/report_scale.py --queries 100000 --no-write

Output: docs/PERFORMANCE.md, section "ipw report at scale" (``--no-write``: printed only).
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
import compare_scale  # noqa: E402
from _shared import machine, write_section  # noqa: E402

BUDGET_S = 30.0
SECTION = "## ipw report at scale"


def generate(out_dir: Path, n_queries: int, power_rows: int) -> list[Path]:
    import pandas as pd

    from ipw.results import RunFolder

    paths = compare_scale.generate(out_dir, n_queries)
    rng = np.random.default_rng(7)
    words = np.asarray("the of a to energy model answer query token watt joule cloud local router".split())
    for path in paths:
        frame = pd.read_parquet(path / "records.parquet")
        n = len(frame)
        body = " ".join(rng.choice(words, 60))
        frame["prompt"] = [f"Question {q}: {body}?" for q in frame["query_id"]]
        frame["output"] = np.char.add(frame["output"].to_numpy(str), f" because {body} {body}")
        frame.to_parquet(path / "records.parquet", index=False)
        print(f"{path.name}: {n:,} records", file=sys.stderr)
    if power_rows:
        first = pd.read_parquet(paths[0] / "records.parquet", columns=["start_s", "end_s"])
        t = np.linspace(first["start_s"].min(), first["end_s"].max(), power_rows)
        RunFolder(paths[0]).add_power("all", {"t_s": t, "device": np.full(t.size, "gpu0", dtype=object),
                                              "power_w": 300 + 200 * rng.random(t.size),
                                              "kind": np.full(t.size, "sample", dtype=object),
                                              "energy_j": np.full(t.size, np.nan)})
    return paths


def measure(paths: list[Path], out: Path, repeats: int) -> dict:
    cmd = [sys.executable, "-m", "ipw.cli", "report", *map(str, paths), "--out", str(out / "report.html"),
           "--markdown", str(out / "summary.md")]
    walls, cpus, peaks, loads = [], [], [], []
    for _ in range(repeats):
        loads.append(os.getloadavg()[0])
        with tempfile.TemporaryFile("w+") as stderr:
            start = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT)
            _, status, usage = os.wait4(proc.pid, 0)
            walls.append(time.perf_counter() - start)
            if os.waitstatus_to_exitcode(status) != 0:
                stderr.seek(0)
                raise SystemExit(f"ipw report failed:\n{stderr.read()}")
        cpus.append(usage.ru_utime + usage.ru_stime)
        peaks.append(usage.ru_maxrss / 1024.0)
    html = (out / "report.html").read_text(encoding="utf-8")
    return {"wall_s": statistics.median(walls), "wall_max_s": max(walls), "walls_s": [round(w, 2) for w in walls],
            "cpu_s": statistics.median(cpus), "peak_rss_mb": max(peaks), "load_avg_1min": [round(x, 1) for x in loads],
            "html_mb": len(html.encode()) / 2**20, "figures": html.count("<figure "),
            "markdown_kb": (out / "summary.md").stat().st_size / 1024}


def write_doc(row: dict, doc: Path) -> None:
    body = f"""{SECTION}

`ipw report` (HTML with every plot, plus the Markdown summary) over **{row['n_records']:,} query records**
({row['n_queries']:,} queries x {row['n_backends']} backends in {row['n_runs']} synthetic run folders, the
compare benchmark's data with prompts and outputs of ~{row['text_chars']} characters, and a power.parquet of
{row['power_rows']:,} sampled points), measured as a child process on {row['machine']}.

| measure | result | budget | ratio |
|---|---|---|---|
| wall time, median of {len(row['walls_s'])} runs (with imports) | {row['wall_s']:.2f} s | {BUDGET_S:.0f} s | \
{row['wall_s'] / BUDGET_S:.2f} |
| wall time, slowest | {row['wall_max_s']:.2f} s | {BUDGET_S:.0f} s | {row['wall_max_s'] / BUDGET_S:.2f} |
| CPU time (user + sys), median | {row['cpu_s']:.2f} s | | |
| peak RSS | {row['peak_rss_mb']:.0f} MB | | |
| report.html | {row['html_mb']:.2f} MB, {row['figures']} plots | | |
| summary.md | {row['markdown_kb']:.1f} KB | | |

Each run's wall time: {', '.join(f'{w:.2f} s' for w in row['walls_s'])}; the 1-minute load average before
each run: {', '.join(map(str, row['load_avg_1min']))} (a shared 2-core machine).

Reproduce (writes this section):

```bash
.venv/bin/python bench/scale/report_scale.py --queries {row['n_queries']} --repeats {len(row['walls_s'])}
```

How it stays within budget (`ipw/analysis/report.py`): the numbers are `ipw compare`'s (see above); scatter plots
draw a seeded sample of at most 2,000 records per backend, power over time from the records is binned to
at most 1,500 steps per backend and a power.parquet trace to 4,000 points per device, query boundaries
are drawn one by one only up to 200 queries (then one shaded span per backend), the per-category plot
shows at most 30 categories, and the answer tables show the 20 costliest rows with a note of how many
there are. Plots are PNGs, so the file size does not grow with the records.
"""
    write_section(doc, SECTION, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=20_000, help="queries per backend (5 backends)")
    parser.add_argument("--power-rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print the result, do not edit docs/")
    parser.add_argument("--keep", type=Path, default=None, help="write the run folders and report here")
    parser.add_argument("--generate-only", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.generate_only:
        generate(args.generate_only, args.queries, args.power_rows)
        return 0
    with tempfile.TemporaryDirectory(prefix="ipw-report-bench-") as tmp:
        out = args.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, __file__, "--generate-only", str(out), "--queries", str(args.queries),
                        "--power-rows", str(args.power_rows)], check=True, cwd=ROOT)
        paths = [out / run_id for run_id, _ in compare_scale.RUNS]
        row = measure(paths, out, args.repeats)
    n_backends = len(compare_scale.BACKENDS)
    row.update(n_queries=args.queries, n_backends=n_backends, n_runs=len(compare_scale.RUNS),
               n_records=args.queries * n_backends, power_rows=args.power_rows, text_chars=400,
               machine=machine())
    print(json.dumps(row, indent=2))
    if not args.no_write:
        write_doc(row, ROOT / "docs" / "PERFORMANCE.md")
    return 0 if row["wall_max_s"] <= BUDGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
