"""Load: thousands of queries against a local server at concurrency 8, with ipw's memory watched.

``ipw run`` (the real CLI) of the bundled ipw-core set (485 queries) x ``--repeats`` against a managed
llama.cpp server (``python -m llama_cpp.server``, SmolLM2-135M-Instruct, chat API, 2 threads) with 8
requests in flight. While it runs, every ``--every-s`` seconds this script samples the resident memory
of the ipw process and of the server (psutil) and counts the records written so far. Afterwards: the
run's status, records and errors, throughput, ipw's peak RSS, and how its RSS moved from the first
tenth of the records to the last (flat memory: no growth with the number of queries).

    .venv/bin/python bench/serving/load_server.py                 # 485 x 11 = 5,335 queries; writes docs/RELIABILITY.md
    .venv/bin/python bench/serving/load_server.py --repeats 1 --no-write

Output: docs/RELIABILITY.md, section "Load: 5,000+ queries against a local server at concurrency 8", and the
    memory trace bench/evidence/serving/load/trace.csv (``--no-write``: printed only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py
sys.path.insert(0, str(ROOT / "bench"))
from _shared import machine, write_section  # noqa: E402

DOC = ROOT / "docs" / "RELIABILITY.md"
TRACE = ROOT / "bench" / "evidence" / "serving" / "load" / "trace.csv"
SECTION = "## Load: 5,000+ queries against a local server at concurrency 8"
IPW = str(Path(sys.executable).with_name("ipw"))
CATEGORIES = ["arithmetic", "science", "general_knowledge", "dates", "strings", "logic", "unit_conversion", "long_context"]

CONFIG = """
dataset = "ipw-core"
categories = {categories}
repeats = {repeats}
warmup = 2
idle_s = 2.0

[generation]
max_tokens = {max_tokens}
temperature = 0.0
top_p = 1.0
top_k = 40
repeat_penalty = 1.0

[[backends]]
name = "smollm2-server"
kind = "openai"
model = "smollm2-135m"
role = "cloud"
server = "llama-cpp"
api = "chat"
n_threads = 2
n_ctx = 4096
concurrency = {concurrency}
timeout_s = 300.0
max_retries = 2
"""


def count_lines(path: Path) -> int:
    try:
        with path.open("rb") as fh:
            return sum(1 for _ in fh)
    except FileNotFoundError:
        return 0


def measure(args) -> dict:
    import psutil

    tmp = Path(tempfile.mkdtemp(prefix="ipw-load-"))
    config = tmp / "load.toml"
    config.write_text(CONFIG.format(repeats=args.repeats, max_tokens=args.max_tokens, concurrency=args.concurrency,
                                    categories=json.dumps(args.categories)), encoding="utf-8")
    out = tmp / "runs"
    start = time.monotonic()
    proc = subprocess.Popen([IPW, "run", str(config), "--out", str(out)], stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "ipw.log", "w"))
    me = psutil.Process(proc.pid)
    samples = []
    while proc.poll() is None:
        try:
            rss_ipw = me.memory_info().rss / 2**20
            rss_server = sum(c.memory_info().rss for c in me.children(recursive=True)) / 2**20
        except psutil.NoSuchProcess:
            break
        folders = list(out.glob("*/records.jsonl"))
        n = count_lines(folders[0]) if folders else 0
        samples.append((round(time.monotonic() - start, 2), round(rss_ipw, 1), round(rss_server, 1), n))
        time.sleep(args.every_s)
    wall = time.monotonic() - start
    run_dir = next(out.iterdir())
    manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    import pandas as pd

    records = pd.read_parquet(run_dir / "records.parquet")
    keys = records[["backend", "query_id", "repeat"]]
    return {"samples": samples, "wall_s": wall, "rc": proc.returncode, "status": manifest["status"],
            "n_records": len(records), "n_unique": len(keys.drop_duplicates()),
            "n_expected": manifest["dataset"]["n_queries"] * args.repeats, "n_queries": manifest["dataset"]["n_queries"], "errors": int(records["error"].notna().sum()),
            "error_categories": records["error_category"].value_counts().to_dict(),
            "accuracy": float(records["correct"].mean()),
            "first_start_s": float(records["start_s"].min()), "last_end_s": float(records["end_s"].max()),
            "energy_quality": sorted(set(records["energy_quality"])),
            "args": vars(args) | {"json": None}, "run_dir": str(run_dir)}


def summarize(res: dict) -> dict:
    samples = [s for s in res["samples"] if s[3] > 0]
    n_total = res["n_records"]

    def rss_between(lo: float, hi: float) -> list[float]:
        return [s[1] for s in samples if lo * n_total <= s[3] <= hi * n_total]

    first, last = rss_between(0.05, 0.15), rss_between(0.85, 0.98)
    # least-squares slope of ipw's RSS against records written, over the whole query loop
    xs, ys = [s[3] for s in samples], [s[1] for s in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    loop_s = res["last_end_s"] - res["first_start_s"]
    return {"peak_rss_mb": max(s[1] for s in res["samples"]), "peak_server_mb": max(s[2] for s in res["samples"]),
            "rss_first_mb": statistics.median(first), "rss_last_mb": statistics.median(last),
            "slope_mb_per_1000": slope * 1000, "throughput_qps": n_total / loop_s, "loop_s": loop_s}


def write_doc(res: dict, s: dict, command: str) -> None:
    TRACE.parent.mkdir(parents=True, exist_ok=True)
    TRACE.write_text("t_s,ipw_rss_mb,server_rss_mb,records\n"
                     + "".join(f"{a},{b},{c},{d}\n" for a, b, c, d in res["samples"]), encoding="utf-8")
    a = res["args"]
    body = f"""{SECTION}

`ipw run` (the real CLI) of ipw-core ({res['n_queries']} queries of the categories {', '.join(a['categories'])})
x {a['repeats']} repeats = **{res['n_expected']:,} queries**
against a managed llama.cpp server (`python -m llama_cpp.server`, SmolLM2-135M-Instruct, chat API,
2 threads, max_tokens {a['max_tokens']}) with **{a['concurrency']} requests in flight**, on {machine()}. The
resident memory of the ipw process and of the server was sampled every {a['every_s']:g} s with the
record count (trace: `bench/evidence/serving/load/trace.csv`).

| measure | result |
|---|---|
| run status | {res['status']} (exit code {res['rc']}) |
| records | {res['n_records']:,} ({res['n_unique']:,} distinct backend/query/repeat keys, {res['n_expected']:,} expected) |
| errors | {res['errors']} {res['error_categories'] or ''} |
| wall time (with server start, warm-up, idle baseline) | {res['wall_s']:.0f} s |
| throughput over the query loop | **{s['throughput_qps']:.2f} queries/s** ({s['loop_s']:.0f} s) |
| ipw peak RSS | **{s['peak_rss_mb']:.0f} MB** |
| ipw RSS, median over records 5–15% / 85–98% | {s['rss_first_mb']:.1f} MB / {s['rss_last_mb']:.1f} MB |
| ipw RSS slope against records (least squares) | {s['slope_mb_per_1000']:+.2f} MB per 1,000 queries |
| server peak RSS | {s['peak_server_mb']:.0f} MB |
| energy basis | {', '.join(res['energy_quality'])} (CPU model of the server's process tree on this machine) |

ipw holds no per-query state in memory during a run: each record is appended to records.jsonl and
fsynced, the progress line keeps running sums, and records.parquet is built from the log at the end.

Reproduce (writes this section and the trace):

```bash
{command}
```
"""
    if not DOC.exists():
        DOC.write_text("# Reliability\n", encoding="utf-8")
    write_section(DOC, SECTION, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--categories", nargs="+", default=[c for c in CATEGORIES if c != "long_context"],
                        help="ipw-core categories (default: all but long_context, whose 1,000-1,900-token prompts "
                             "take 5-20 s each on a 2-core CPU)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--every-s", type=float, default=2.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    res = measure(args)
    s = summarize(res)
    if args.json:
        args.json.write_text(json.dumps(res | {"summary": s}, indent=1), encoding="utf-8")
    print(json.dumps(s, indent=1))
    if not args.no_write:
        write_doc(res, s, f".venv/bin/python bench/serving/load_server.py --repeats {args.repeats}"
                  + ("" if args.categories == parser.get_default("categories") else
                     f" --categories {' '.join(args.categories)}"))
    return 0 if res["status"] == "complete" and res["n_unique"] == res["n_expected"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
