"""Measured error rates of ``ipw check --rerun`` at its defaults (issue 28): 16 blocks over 4 shards, pairs A B then
B A, energy judged by Student's t over the 8 block pairs.

One stream of blocks of the embedded default's local backend (``ipw run --backend smollm2-135m --shard K/4``:
SmolLM2-135M in a llama.cpp worker, a quarter of the default's 24 queries, one thread, every other setting the
default's) is made with identical code and config, shard after shard as a job runs them (1 1 2 2 3 3 4 4 1 1 ...).

- **interleaved, false alarms**: every window of 16 consecutive blocks that starts at a pair (an even position) is
  one job: its blocks get the sides of ``job_plan(16, 4)`` (A B B A A B B A ...), and since every block ran the
  same code, any verdict other than a pass is a false alarm. Windows overlap (they share blocks: not
  independent); the disjoint ones (every 16th start) are counted apart.
- **committed baseline, false alarms**: one round (8 blocks, every shard twice) pooled as one run of the whole
  query set, against a round at least ``--lag`` rounds later (a baseline recorded minutes before the candidate).
- **smallest energy increase caught in 95% of jobs**: each identical job again with the candidate's (B) energy of
  every query multiplied by 1 + d, the smallest d that the energy row calls a regression (bisection), and its
  95th percentile over the jobs (a synthetic regression on the real noise of this machine).

The stream is resumable (a complete block is kept). Each block's wall time and the load average around it are
logged, since the machine is shared.

    .venv/bin/python bench/gate/gate_blocks.py --blocks 160 --work /tmp/gate-blocks     # blocks (resumable), analysis
    .venv/bin/python bench/gate/gate_blocks.py --analyse-only --work /tmp/gate-blocks

Output: bench/evidence/gate/gate-blocks/ (summary.md, summary.json, every verdict and block as CSV); the
    figures are in docs/CHECK.md, "Measured error rates on this VM".
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gate_rates.py, beside it
from gate_rates import BACKEND, N_BOOT_SEARCH, ROOT, complete, loadavg, smallest_caught, verdict_row

SHARDS = 4
JOB = 16  # blocks of one job: ipw check --rerun's default --blocks
ROUND = 2 * SHARDS  # blocks of one round: every shard once a side


def make_blocks(work: Path, n_blocks: int) -> None:
    config = work / "A.toml"
    work.mkdir(parents=True, exist_ok=True)
    config.write_text((ROOT / "ipw" / "default.toml").read_text())
    for i in range(n_blocks):
        shard = (i // 2) % SHARDS + 1
        folder = work / "blocks" / f"{i:03d}-s{shard}"
        if complete(folder):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        before, t0 = loadavg(), time.time()
        cmd = [str(ROOT / ".venv" / "bin" / "ipw"), "run", str(config), "--backend", BACKEND,
               "--shard", f"{shard}/{SHARDS}", "--out", str(folder)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        entry = {"index": i, "shard": shard, "rc": proc.returncode,
                 "started": dt.datetime.fromtimestamp(t0, dt.timezone.utc).isoformat(timespec="seconds"),
                 "wall_s": round(time.time() - t0, 1), "loadavg_before": before, "loadavg_after": loadavg()}
        with (work / "blocks.jsonl").open("a") as f:
            f.write(json.dumps(entry) + "\n")
        print(json.dumps(entry), flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-2000:], file=sys.stderr)


def load_stream(work: Path) -> dict[int, dict]:
    from ipw.results import load_run

    log = {}
    for line in (work / "blocks.jsonl").read_text().splitlines():
        entry = json.loads(line)
        log[entry["index"]] = entry
    out = {}
    for folder in sorted((work / "blocks").iterdir()):
        run_dir = complete(folder)
        if run_dir is not None:
            index = int(folder.name[:3])
            manifest, frame = load_run(run_dir)
            out[index] = {"index": index, "dir": run_dir, "manifest": manifest, "frame": frame,
                          "log": log.get(index, {})}
    return out


def _scaled(block: dict, factor: float):
    frame = block["frame"]
    return block["manifest"], frame.assign(energy_j=frame["energy_j"] * factor) if factor != 1.0 else frame


def analyse(work: Path, results: Path, lag: int) -> dict:
    import numpy as np

    from ipw.analysis.check import DEFAULT_THRESHOLDS, check_interleaved, check_runs, parse_threshold, pool_blocks
    from ipw.running.interleave import job_plan

    thresholds = [parse_threshold(t) for t in DEFAULT_THRESHOLDS]
    stream = load_stream(work)
    sides = [side for side, _ in job_plan(JOB, SHARDS)]
    rows = []

    def energy_status(result) -> str:
        return next(v.status for v in result.verdicts if v.metric == "energy_per_query")

    def job(start: int, factor: float = 1.0, n_boot: int = 4000):
        blocks = [(side, *_scaled(stream[start + k], factor if side == "B" else 1.0)) for k, side in enumerate(sides)]
        return check_interleaved(blocks, thresholds, n_boot=n_boot)

    last = max(stream) if stream else -1
    for start in range(0, last - JOB + 2, 2):
        if not all(start + k in stream for k in range(JOB)):
            continue  # a block is missing (failed or not made yet)
        result = job(start)
        row = {"mode": "interleaved", "start": start, "disjoint": start % JOB == 0, **verdict_row(result)}
        row["smallest_caught_pct"] = smallest_caught(lambda f: energy_status(job(start, 1 + f, N_BOOT_SEARCH)))
        rows.append(row)

    def round_run(r: int, second: bool, factor: float = 1.0):
        """Round r's blocks (the first or second of each pair) pooled as one run of the whole query set."""
        picks = [stream.get(r * ROUND + 2 * s + int(second)) for s in range(SHARDS)]
        return None if None in picks else pool_blocks([_scaled(p, factor) for p in picks])

    n_rounds = (last + 1) // ROUND
    for r in range(n_rounds):
        for r2 in range(r + lag, n_rounds):
            base, cand = round_run(r, False), round_run(r2, True)
            if base is None or cand is None:
                continue
            row = {"mode": "committed", "start": f"{r}-{r2}", "disjoint": False,
                   **verdict_row(check_runs(*base, *cand, thresholds))}
            row["smallest_caught_pct"] = smallest_caught(lambda f: energy_status(
                check_runs(*base, *round_run(r2, True, 1 + f), thresholds, n_boot=N_BOOT_SEARCH)))
            rows.append(row)

    results.mkdir(parents=True, exist_ok=True)
    keys = ["mode", "start", "disjoint", "energy_change_pct", "energy_p", "energy_floor_pct", "energy_status",
            "failing", "exit", "output_tokens_status", "smallest_caught_pct"]
    with (results / "verdicts.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)
    with (results / "blocks.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["index", "shard", "started", "wall_s", "loadavg_before_1m", "loadavg_after_1m", "j_per_query",
                    "output_tokens"])
        for i, b in sorted(stream.items()):
            log = b["log"]
            w.writerow([i, (b["manifest"].shard or {}).get("index"), log.get("started"), log.get("wall_s"),
                        (log.get("loadavg_before") or [None])[0], (log.get("loadavg_after") or [None])[0],
                        round(float(b["frame"]["energy_j"].mean()), 4), int(b["frame"]["completion_tokens"].sum())])
    with (results / "per_query.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["index", "query_id", "energy_j", "completion_tokens", "latency_s"])
        for i, b in sorted(stream.items()):
            for q in b["frame"].itertuples():
                w.writerow([i, q.query_id, round(float(q.energy_j), 5), q.completion_tokens, round(float(q.latency_s), 4)])
    shutil.copy(work / "blocks.jsonl", results / "blocks-log.jsonl")
    shutil.copy(stream[min(stream)]["dir"] / "manifest.json", results / "manifest-first-block.json")

    summary: dict = {"blocks": len(stream), "shards": SHARDS, "job_blocks": JOB, "lag_rounds": lag,
                     "thresholds": list(DEFAULT_THRESHOLDS), "backend": BACKEND, "modes": {}}
    for label, keep in (("interleaved", lambda x: x["mode"] == "interleaved"),
                        ("interleaved_disjoint", lambda x: x["mode"] == "interleaved" and x["disjoint"]),
                        ("committed", lambda x: x["mode"] == "committed")):
        ident = [x for x in rows if keep(x)]
        caught = sorted(x["smallest_caught_pct"] for x in ident)
        summary["modes"][label] = {
            "n": len(ident), "false_alarms": sum(x["exit"] != 0 for x in ident),
            "energy_regressions": sum(x["energy_status"] == "regression" for x in ident),
            "energy_inconclusive": sum(x["energy_status"] == "inconclusive" for x in ident),
            "largest_change_pct": max((abs(x["energy_change_pct"]) for x in ident), default=None),
            "smallest_caught_95_pct": float(np.quantile(caught, 0.95, method="higher")) if caught else None,
            "smallest_caught_50_pct": float(np.quantile(caught, 0.5, method="higher")) if caught else None}
    walls = [b["log"]["wall_s"] for b in stream.values() if b["log"].get("wall_s")]
    loads = [x for b in stream.values() for x in ((b["log"].get("loadavg_before") or [None])[0],
                                                   (b["log"].get("loadavg_after") or [None])[0]) if x is not None]
    summary["block_wall_s"] = {"min": min(walls), "median": float(np.median(walls)), "max": max(walls)} if walls else None
    summary["loadavg_1m"] = {"min": min(loads), "median": float(np.median(loads)), "max": max(loads)} if loads else None
    starts = sorted(b["log"].get("started") for b in stream.values() if b["log"].get("started"))
    summary["first_started"], summary["last_started"] = (starts[0], starts[-1]) if starts else (None, None)
    (results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (results / "summary.md").write_text(markdown(summary))
    print(json.dumps(summary, indent=1))
    return summary


def markdown(summary: dict) -> str:
    names = {"interleaved": f"interleaved, {JOB} blocks over {SHARDS} shards (every window starting at a pair)",
             "interleaved_disjoint": "interleaved, the disjoint windows only",
             "committed": f"committed baseline (a round pooled, against a round >= {summary['lag_rounds']} later)"}
    lines = ["| mode | identical jobs | false alarms (exit 1) | energy regression | energy inconclusive | largest "
             "|change| | smallest energy increase caught in 95% (50%) of them |", "|---|---|---|---|---|---|---|"]
    for label, m in summary["modes"].items():
        if m["n"]:
            lines.append(f"| {names[label]} | {m['n']} | {m['false_alarms']} ({100 * m['false_alarms'] / m['n']:.1f}%) "
                         f"| {m['energy_regressions']} | {m['energy_inconclusive']} | {m['largest_change_pct']:.1f}% | "
                         f"+{m['smallest_caught_95_pct']:.1f}% (+{m['smallest_caught_50_pct']:.1f}%) |")
    walls, load = summary.get("block_wall_s") or {}, summary.get("loadavg_1m") or {}
    lines += ["", f"{summary['blocks']} blocks, {summary['first_started']} to {summary['last_started']} (UTC); a block "
              f"took {walls.get('min')}-{walls.get('max')} s (median {walls.get('median')}); load average (1 min) "
              f"around the blocks {load.get('min')}-{load.get('max')}, median {load.get('median')}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=160)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gate-blocks"))
    parser.add_argument("--analyse-only", action="store_true")
    parser.add_argument("--lag", type=int, default=2, help="committed mode: rounds between baseline and candidate "
                        "(at least)")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "evidence" / "gate" / "gate-blocks")
    args = parser.parse_args()
    if not args.analyse_only:
        make_blocks(args.work, args.blocks)
    analyse(args.work, args.results, args.lag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
