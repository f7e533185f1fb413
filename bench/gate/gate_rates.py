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

- **interleaved, false alarms**: 4 A runs as blocks A B B A of one job, whenever the A blocks' mean position equals
  the B blocks' (linear drift cancels as in a real job) and they span at most SPAN positions; every 4 consecutive
  A runs are such a job (A runs sit at 4k and 4k+1), and more overlap them (they share runs: not independent);
- **interleaved, power**: the second A of a cycle, its two R runs, the first A of the next cycle (A R R A);
- **committed baseline, false alarms**: every pair of A runs at least ``--lag`` runs apart, the earlier one
  as the baseline (a baseline recorded minutes before the candidate, as a committed one is);
- **committed baseline, power**: every R run against the A runs made before it;
- **smallest regression caught 95% of the time**: the null pairs/jobs again, with the candidate's energy of
  every query multiplied by 1 + d, for a grid of d (a synthetic regression on real noise), the smallest d
  caught in >= 95% of them; the real regressions above check it.

The stream is resumable: a run whose folder is complete is kept, others are made (again).  Each run's wall
time and the load average before and after it are logged, since the machine is shared.

    .venv/bin/python bench/gate/gate_rates.py --cycles 17 --work /tmp/gate-rates     # runs (resumable), then analysis
    .venv/bin/python bench/gate/gate_rates.py --analyse-only --work /tmp/gate-rates

Output: bench/evidence/gate/gate-rates/ (summary.md, summary.json, verdicts.csv, runs.csv, per_query.csv); the
    figures are in docs/CHECK.md, "Measured error rates on this VM".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py
KINDS = ("max_tokens_x2", "no_prefix_cache", "threads_x2")
SPAN = 9  # the longest interleaved identical job, in stream positions (a real job's 4 blocks span 3)
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


def kind_of(cycle: int) -> str:
    """The regression of a cycle: rotating over KINDS, except that threads_x2 runs in cycle 2 only (on the shared,
    loaded machine of 2026-12-01 each of its runs took ~6 min, three times an A run: its barrier spins); its later
    turns alternate the other two kinds."""
    kind = KINDS[cycle % len(KINDS)]
    return KINDS[(cycle // 3) % 2] if kind == "threads_x2" and cycle > 2 else kind


R_CYCLES = 4  # cycles with regressed runs; the later ones are A A A A (more identical jobs in the time there was)


def plan(cycles: int) -> list[tuple[int, str]]:
    out = []
    for c in range(cycles):
        kind = kind_of(c) if c < R_CYCLES else "A"
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


def load_stream(work: Path) -> list[dict]:
    """The complete runs of the stream, in order, with their log entries (a run made again: its last entry)."""
    from ipw.results import load_run

    log = {}
    if (work / "runs.jsonl").is_file():
        for line in (work / "runs.jsonl").read_text().splitlines():
            entry = json.loads(line)
            log[entry["index"]] = entry
    out = []
    for folder in sorted((work / "runs").iterdir()):
        run_dir = complete(folder)
        if run_dir is None:
            continue  # a run stopped on purpose (011: threads_x2, ~9 min per run under the load) or still running
        index, kind = int(folder.name[:3]), folder.name[4:]
        manifest, frame = load_run(run_dir)  # the manifest typed (RunManifest)
        entry = log.get(index)
        if entry is None:  # the bench was restarted while this run went on (its parent, which logs, had stopped)
            import datetime as dt_

            t0, t1 = (dt_.datetime.fromisoformat(x) for x in (manifest.started_at, manifest.finished_at))
            entry = {"started": manifest.started_at, "wall_s": round((t1 - t0).total_seconds(), 1),
                     "note": "from the manifest; no load average"}
        out.append({"index": index, "kind": kind, "dir": run_dir, "manifest": manifest, "frame": frame,
                    "log": entry})
    return out


def scaled(run: dict, factor: float):
    return run["manifest"], run["frame"].assign(energy_j=run["frame"]["energy_j"] * factor)


def verdict_row(result) -> dict:
    energy = next(v for v in result.verdicts if v.metric == "energy_per_query")
    failing = sorted({v.metric for v in result.verdicts if v.status == "regression"})
    return {"energy_change_pct": round(energy.change, 3), "energy_p": round(energy.p_value, 5),
            "energy_floor_pct": None if energy.floor != energy.floor else round(energy.floor, 3),
            "energy_status": energy.status, "failing": "+".join(failing), "exit": result.exit_code,
            "output_tokens_status": next((v.status for v in result.verdicts if v.metric == "output_tokens"), "")}


N_BOOT_SEARCH = 1000  # resamples per step of the search (the verdicts themselves use ipw check's 4000)


def smallest_caught(judge, hi: float = 60.0, step: float = 0.25) -> float:
    """The smallest energy increase (%, of every candidate query) that the energy row calls a regression: found by
    bisection (the change, the p-value and the floor move monotonically with the factor)."""
    lo_pct, hi_pct = 0.0, hi
    if judge(hi_pct / 100) != "regression":
        return float("inf")
    while hi_pct - lo_pct > step:
        mid = (lo_pct + hi_pct) / 2
        if judge(mid / 100) == "regression":
            hi_pct = mid
        else:
            lo_pct = mid
    return round(hi_pct, 2)


def analyse(work: Path, results: Path, lag: int) -> dict:
    import csv

    import numpy as np

    from ipw.analysis.check import DEFAULT_THRESHOLDS, check_interleaved, check_runs, parse_threshold

    thresholds = [parse_threshold(t) for t in DEFAULT_THRESHOLDS]
    stream = load_stream(work)
    a_runs = [r for r in stream if r["kind"] == "A"]
    rows = []

    def interleaved(a1, b1, b2, a2, factor=1.0, n_boot=4000):
        return check_interleaved([("A", a1["manifest"], a1["frame"]), ("B", *scaled(b1, factor)),
                                  ("B", *scaled(b2, factor)), ("A", a2["manifest"], a2["frame"])], thresholds,
                                 n_boot=n_boot)

    def committed(base, cand, factor=1.0, n_boot=4000):
        return check_runs(base["manifest"], base["frame"], *scaled(cand, factor), thresholds, n_boot=n_boot)

    # interleaved, identical: 4 A runs as A B B A whose A and B mean times are equal (t1 + t4 = t2 + t3), within
    # SPAN stream positions; 4 consecutive A runs are such a job in this stream (A runs sit at 4k and 4k + 1)
    from itertools import combinations

    quads = [q for q in combinations(a_runs, 4) if q[0]["index"] + q[3]["index"] == q[1]["index"] + q[2]["index"]
             and q[3]["index"] - q[0]["index"] <= SPAN]
    consecutive = {tuple(r["index"] for r in a_runs[i:i + 4]) for i in range(len(a_runs) - 3)}
    for q in quads:
        key = tuple(r["index"] for r in q)
        row = {"mode": "interleaved", "kind": "identical", "runs": "-".join(map(str, key)),
               "consecutive": key in consecutive, **verdict_row(interleaved(*q))}
        row["smallest_caught_pct"] = smallest_caught(lambda f: next(
            v.status for v in interleaved(*q, factor=1 + f, n_boot=N_BOOT_SEARCH).verdicts if v.metric == "energy_per_query"))
        rows.append(row)
    # interleaved with --blocks 8, identical: 8 consecutive A runs as A B B A A B B A (symmetric in this stream)
    for i in range(len(a_runs) - 7):
        o = a_runs[i:i + 8]
        blocks = [(side, r["manifest"], r["frame"]) for side, r in zip("ABBAABBA", o)]

        def judge8(f, o=o):
            scaled_blocks = [(side, *(scaled(r, 1 + f) if side == "B" else (r["manifest"], r["frame"])))
                             for side, r in zip("ABBAABBA", o)]
            return next(v.status for v in check_interleaved(scaled_blocks, thresholds, n_boot=N_BOOT_SEARCH).verdicts
                        if v.metric == "energy_per_query")
        row = {"mode": "interleaved8", "kind": "identical", "runs": "-".join(str(r["index"]) for r in o),
               "consecutive": True, **verdict_row(check_interleaved(blocks, thresholds))}
        row["smallest_caught_pct"] = smallest_caught(judge8)
        rows.append(row)
    # committed baseline, identical: every pair of A runs >= lag apart, the earlier as baseline
    for i, base in enumerate(a_runs):
        for cand in a_runs[i + 1:]:
            if cand["index"] - base["index"] < lag:
                continue
            row = {"mode": "committed", "kind": "identical", "runs": f"{base['index']}-{cand['index']}",
                   **verdict_row(committed(base, cand))}
            row["smallest_caught_pct"] = smallest_caught(lambda f: next(
                v.status for v in committed(base, cand, factor=1 + f, n_boot=N_BOOT_SEARCH).verdicts
                if v.metric == "energy_per_query"))
            rows.append(row)
    # real regressions: A R R A around each pair of R runs; and each R run against the earlier A runs
    by_index = {r["index"]: r for r in stream}
    for r in stream:
        if r["kind"] == "A" or r["index"] % 4 != 2 or r["index"] + 2 not in by_index:
            continue
        a1, r1, r2, a2 = (by_index[r["index"] + k] for k in (-1, 0, 1, 2))
        rows.append({"mode": "interleaved", "kind": r["kind"], "runs": f"{a1['index']}-{r1['index']}-{r2['index']}-"
                     f"{a2['index']}", **verdict_row(interleaved(a1, r1, r2, a2))})
    for cand in (r for r in stream if r["kind"] != "A"):
        for base in a_runs:
            if cand["index"] - base["index"] >= lag:
                rows.append({"mode": "committed", "kind": cand["kind"], "runs": f"{base['index']}-{cand['index']}",
                             **verdict_row(committed(base, cand))})

    results.mkdir(parents=True, exist_ok=True)
    with (results / "verdicts.csv").open("w", newline="") as f:
        keys = ["mode", "kind", "runs", "consecutive", "energy_change_pct", "energy_p", "energy_floor_pct", "energy_status", "failing",
                "exit", "output_tokens_status", "smallest_caught_pct"]
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)
    with (results / "runs.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["index", "kind", "started", "wall_s", "loadavg_before_1m", "loadavg_after_1m", "j_per_query",
                    "output_tokens", "cpu"])
        for r in stream:
            e = r["frame"]["energy_j"]
            w.writerow([r["index"], r["kind"], r["log"].get("started"), r["log"].get("wall_s"),
                        (r["log"].get("loadavg_before") or [None])[0], (r["log"].get("loadavg_after") or [None])[0],
                        round(float(e.mean()), 4), int(r["frame"]["completion_tokens"].sum()),
                        (r["manifest"].hardware or {}).get("cpu_model")])
    with (results / "per_query.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["index", "kind", "query_id", "energy_j", "prompt_tokens", "completion_tokens", "latency_s"])
        for r in stream:
            for _, q in r["frame"].iterrows():
                w.writerow([r["index"], r["kind"], q["query_id"], round(float(q["energy_j"]), 5), q["prompt_tokens"],
                            q["completion_tokens"], round(float(q["latency_s"]), 4)])
    shutil.copy(stream[0]["dir"] / "manifest.json", results / "manifest-first-run.json")
    shutil.copy(work / "runs.jsonl", results / "runs-log.jsonl")

    summary = {"runs": len(stream), "a_runs": len(a_runs), "lag": lag, "thresholds": list(DEFAULT_THRESHOLDS),
               "backend": BACKEND, "modes": {}}
    subsets = [("committed", lambda x: True), ("interleaved", lambda x: True),
               ("interleaved_consecutive", lambda x: x.get("consecutive")), ("interleaved8", lambda x: True)]
    for label, keep in subsets:
        mode = label.split("_")[0]  # interleaved8: --blocks 8
        ident = [x for x in rows if x["mode"] == mode and x["kind"] == "identical" and keep(x)]
        caught = sorted(x["smallest_caught_pct"] for x in ident)
        m = {"identical": {"n": len(ident), "false_alarms": sum(x["exit"] != 0 for x in ident),
                           "energy_regressions": sum(x["energy_status"] == "regression" for x in ident),
                           "energy_inconclusive": sum(x["energy_status"] == "inconclusive" for x in ident),
                           "largest_change_pct": max((abs(x["energy_change_pct"]) for x in ident), default=None),
                           "smallest_caught_95_pct": float(np.quantile(caught, 0.95, method="higher")) if caught else None,
                           "smallest_caught_50_pct": float(np.quantile(caught, 0.5, method="higher")) if caught else None}}
        for kind in KINDS if label == mode else ():
            reg = [x for x in rows if x["mode"] == mode and x["kind"] == kind]
            if reg:
                m[kind] = {"n": len(reg), "caught": sum(x["exit"] == 1 for x in reg),
                           "caught_by_energy": sum(x["energy_status"] == "regression" for x in reg),
                           "caught_by_work_gate": sum(x["output_tokens_status"] == "regression" for x in reg),
                           "energy_change_pct": [min(x["energy_change_pct"] for x in reg),
                                                 float(np.median([x["energy_change_pct"] for x in reg])),
                                                 max(x["energy_change_pct"] for x in reg)]}
        summary["modes"][label] = m
    loads = [x for r in stream for x in ((r["log"].get("loadavg_before") or [None])[0],
                                          (r["log"].get("loadavg_after") or [None])[0]) if x is not None]
    summary["loadavg_1m"] = {"min": min(loads), "median": float(np.median(loads)), "max": max(loads)} if loads else None
    summary["first_started"] = stream[0]["log"].get("started")
    summary["last_started"] = stream[-1]["log"].get("started")
    (results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (results / "summary.md").write_text(markdown(summary, rows, stream))
    print(json.dumps(summary, indent=1))
    return summary


def markdown(summary: dict, rows: list[dict], stream: list[dict]) -> str:
    """The tables of docs/CHECK.md's error-rate section."""
    names = {"committed": "committed baseline (a pair of runs >= %d positions apart)" % summary["lag"],
             "interleaved": "interleaved, 4 blocks A B B A (every time-symmetric quad of runs)",
             "interleaved_consecutive": "interleaved, 4 blocks, consecutive runs only",
             "interleaved8": "interleaved, 8 blocks A B B A A B B A (consecutive runs)"}
    lines = ["| mode | identical jobs | false alarms (exit 1) | of them energy | energy inconclusive | largest |change| "
             "| smallest energy increase caught in 95% (50%) of them |", "|---|---|---|---|---|---|---|"]
    for label, m in summary["modes"].items():
        i = m["identical"]
        if not i["n"]:
            continue
        lines.append(f"| {names[label]} | {i['n']} | {i['false_alarms']} ({100 * i['false_alarms'] / i['n']:.0f}%) | "
                     f"{i['energy_regressions']} | {i['energy_inconclusive']} | {i['largest_change_pct']:.1f}% | "
                     f"+{i['smallest_caught_95_pct']:.1f}% (+{i['smallest_caught_50_pct']:.1f}%) |")
    lines += ["", "| mode | real regression | jobs or pairs | caught (exit 1) | by energy | by the work gate | "
              "energy change min / median / max |", "|---|---|---|---|---|---|---|"]
    for label, m in summary["modes"].items():
        for kind in KINDS:
            if kind in m:
                k = m[kind]
                lo, med, hi = k["energy_change_pct"]
                lines.append(f"| {label} | {kind} | {k['n']} | {k['caught']} | {k['caught_by_energy']} | "
                             f"{k['caught_by_work_gate']} | {lo:+.1f}% / {med:+.1f}% / {hi:+.1f}% |")
    walls = [r["log"].get("wall_s") for r in stream if r["kind"] == "A" and r["log"].get("wall_s")]
    load = summary.get("loadavg_1m") or {}
    lines += ["", f"{summary['runs']} runs ({summary['a_runs']} of the default), {summary['first_started']} to "
              f"{summary['last_started']} (UTC); an A run took {min(walls):.0f}-{max(walls):.0f} s; load average "
              f"(1 min) around the runs {load.get('min')}-{load.get('max')}, median {load.get('median')}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=17)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gate-rates"))
    parser.add_argument("--analyse-only", action="store_true")
    parser.add_argument("--lag", type=int, default=8, help="committed mode: stream positions between baseline and "
                        "candidate (at least)")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "evidence" / "gate" / "gate-rates")
    args = parser.parse_args()
    if not args.analyse_only:
        make_runs(args.work, args.cycles)
    analyse(args.work, args.results, args.lag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
