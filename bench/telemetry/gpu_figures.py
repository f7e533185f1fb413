"""The figures of docs/GPU.md, from ipw run folders and the counter recorded by bench/telemetry/gpu_counter.py.

    python bench/telemetry/gpu_figures.py COUNTER.csv RUN_DIR [RUN_DIR ...] [--json OUT.json]

Per run: GPU J/query and J/token (the NVML parts of every record), how many windows the estimator
flagged short, the sum of per-query GPU energy against the reference counter over the same windows
(read back to back by another process; its ~100 ms steps, located to a few ms, linearly interpolated
at each window's edges),
begin/end counter reads on the same windows (the last read before each edge, as a harness that reads
the counter at its anchors would get) with their zero count, the net energy against the idle baseline,
and the sampler's CPU share.  Prints a Markdown table.

Short windows (issue 27): the reference counter steps every 100 ms and is interpolated linearly between
its steps, so it spreads each step's energy evenly over the step, gaps between queries included.  When
the GPU draws less in those gaps (the 20 ms samples show dips of ~10% in the 6-15 ms gaps between
~50 ms queries), the reference gives the query windows too much of it and their sum reads low against
ipw's.  So each run also gets the comparison over the whole span from the first query's start to the
last one's end (Σ per-query energy + ipw's energy of the gaps between queries, replayed from
power.parquet, against the counter over the span: both ends located to a few ms), and the gaps'
share of time and ipw's mean power in them against the windows'.

Output: a Markdown table on stdout (and ``--json``); the figures are in docs/GPU.md, "Figures", and
    docs/ENERGY.md, "Short windows read high (issue 27)".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ipw.telemetry.energy_counter import grid_counter_reads  # noqa: E402
from ipw.telemetry.estimator import estimate_windows  # noqa: E402
from ipw.telemetry.nvml_estimate import hold_counter_reads  # noqa: E402
from ipw.telemetry.sampler import DEFAULT_SAMPLE_SHIFT_S  # noqa: E402


def gpu_parts(frame: pd.DataFrame) -> np.ndarray:
    """Each record's GPU energy (the sum of its NVML readings; NaN when one is missing)."""
    out = []
    for parts in frame["energy_parts"]:
        gpu = [p for p in json.loads(parts) if p["source"].startswith("nvml")]
        out.append(np.nan if not gpu or any(p["energy_j"] is None for p in gpu) else sum(p["energy_j"] for p in gpu))
    return np.array(out)


def short_windows(frame: pd.DataFrame) -> int:
    return sum(any("window shorter than" in (p.get("note") or "") for p in json.loads(parts)
                   if p["source"].startswith("nvml")) for parts in frame["energy_parts"])


def counter_series(counter: pd.DataFrame, gpu: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The reference curve and the raw reads.  The counter steps about every 100 ms; read a few hundred
    times a second, each step's moment is known to a few ms: (time of the step, value) points, linearly
    interpolated, are the cumulative energy (exact at every step, average power within one).  Linear
    interpolation between the raw reads instead would keep the steps (a begin/end read in disguise)."""
    rows = counter[counter["gpu"] == gpu]
    after, joules = rows["t_after_s"].to_numpy(), rows["energy_mj"].to_numpy() / 1000.0
    step = np.flatnonzero(np.diff(joules) != 0) + 1
    return (after[step - 1] + after[step]) / 2, joules[step], after, joules


def gap_energies(run_dir: Path, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """ipw's energy of each query window and of each gap between consecutive queries (sorted by start),
    replayed from the run's power.parquet (gpu0) with one calibration over the whole recording; None
    without a trace."""
    path = run_dir / "power.parquet"
    if not path.exists():
        return None
    p = pd.read_parquet(path)
    p = p[p["device"] == "gpu0"]
    s, c = p[p["kind"] == "sample"], p[p["kind"] == "counter"]
    st, sw = s["t_s"].to_numpy(), s["power_w"].to_numpy()
    ct, cj = c["t_s"].to_numpy(), c["energy_j"].to_numpy()
    if st.size < 2 or ct.size < 2:
        return None
    grid = grid_counter_reads(ct, cj, st, sw, sample_shift_s=DEFAULT_SAMPLE_SHIFT_S)
    ct, cj = (grid.t_s, grid.j) if grid is not None else hold_counter_reads(ct, cj)
    order = np.argsort(start)
    lo, hi = start[order], end[order]
    gaps = [(a, max(a, b)) for a, b in zip(hi[:-1], lo[1:])]
    est = estimate_windows(st, sw, ct, cj, [*zip(lo, hi), *gaps], sample_shift_s=DEFAULT_SAMPLE_SHIFT_S)
    e = np.array([np.nan if x.energy_j is None else x.energy_j for x in est])
    return e[: len(lo)], e[len(lo):]


def figures(run_dir: Path, counter: pd.DataFrame) -> dict:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    frame = pd.read_parquet(run_dir / "records.parquet")
    gpu_j = gpu_parts(frame)
    start, end = frame["start_s"].to_numpy(), frame["end_s"].to_numpy()
    step_t, step_j, after, joules = counter_series(counter, 0)
    interp = np.interp(end, step_t, step_j) - np.interp(start, step_t, step_j)
    # begin/end reads: the last read completed before each edge (a step function)
    idx_s = np.searchsorted(after, start, side="right") - 1
    idx_e = np.searchsorted(after, end, side="right") - 1
    begin_end = joules[idx_e] - joules[idx_s]
    span = float(np.interp(end.max(), step_t, step_j) - np.interp(start.min(), step_t, step_j))
    backend = manifest["backends"][0]
    idle = backend.get("idle_baseline", {})
    overhead = backend.get("sampler_overhead", {})
    ok = ~np.isnan(gpu_j)
    order = np.argsort(start)
    gap_s = np.clip(start[order][1:] - end[order][:-1], 0.0, None)
    replay = gap_energies(run_dir, start, end)
    span_j = float(np.interp(end.max(), step_t, step_j) - np.interp(start.min(), step_t, step_j))
    windows_s = float((end - start).sum())
    short = {}
    if replay is not None:
        win_e, gap_e = replay
        ipw_span = float(np.nansum(gpu_j) + np.nansum(gap_e))
        short = {
            "sum_ipw_gaps_j": float(np.nansum(gap_e)), "span_counter_j": span_j,
            "span_vs_counter": ipw_span / span_j - 1,
            "replay_windows_vs_counter": float(np.nansum(win_e) / interp[ok].sum() - 1),
            "gap_share_of_span": float(gap_s.sum() / (end.max() - start.min())),
            "gap_power_vs_window_power": float((np.nansum(gap_e) / gap_s.sum()) / (np.nansum(win_e) / windows_s) - 1)
            if gap_s.sum() > 0 else float("nan"),
        }
    tokens = frame["completion_tokens"].to_numpy()
    return {
        "run": run_dir.name, "dataset": manifest["dataset"]["name"], "status": manifest["status"],
        "queries": int(len(frame)), "errors": int(frame["error"].notna().sum()),
        "median_latency_s": float(frame["latency_s"].median()), "median_tokens": float(np.median(tokens)),
        "gpu_j_per_query": float(np.nanmean(gpu_j)), "gpu_j_per_token": float(np.nansum(gpu_j) / tokens[ok].sum()),
        "short_windows": int(short_windows(frame)), "records_with_gpu_energy": int(ok.sum()),
        "sum_ipw_gpu_j": float(np.nansum(gpu_j)), "sum_counter_interpolated_j": float(interp[ok].sum()),
        "ipw_vs_counter": float(np.nansum(gpu_j) / interp[ok].sum() - 1),
        "sum_begin_end_j": float(begin_end[ok].sum()), "begin_end_zero_windows": int((begin_end[ok] == 0).sum()),
        "begin_end_vs_counter": float(begin_end[ok].sum() / interp[ok].sum() - 1),
        "counter_span_j": span, "windows_share_of_span": float((end - start).sum() / (end.max() - start.min())),
        "idle_power_w": idle.get("power_w", {}), "idle_spread_w": idle.get("spread_w", {}),
        "net_j_per_query": float(frame["net_energy_j"].mean()), "gross_j_per_query": float(frame["energy_j"].mean()),
        "energy_basis": sorted(set(frame["energy_source"])), "sampler_overhead": overhead,
        "engine": {k: backend.get(k) for k in ("engine_version", "cpu_variant", "gpu_offload", "system_info")},
        "energy_audit": backend.get("energy_audit"),
        **short,
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| figure | " + " | ".join(r["dataset"] + " " + r["run"] for r in rows) + " |",
             "|---|" + "---|" * len(rows)]

    def add(name, fn):
        lines.append(f"| {name} | " + " | ".join(fn(r) for r in rows) + " |")

    add("queries (errors), status", lambda r: f"{r['queries']} ({r['errors']}), {r['status']}")
    add("median latency, tokens", lambda r: f"{r['median_latency_s'] * 1000:.0f} ms, {r['median_tokens']:.0f}")
    add("GPU J/query", lambda r: f"{r['gpu_j_per_query']:.3f}")
    add("GPU J/token", lambda r: f"{r['gpu_j_per_token']:.4f}")
    add("windows flagged short (< 0.15 s)", lambda r: f"{r['short_windows']} of {r['queries']}")
    add("Σ ipw GPU energy", lambda r: f"{r['sum_ipw_gpu_j']:.1f} J")
    add("Σ reference counter, same windows", lambda r: f"{r['sum_counter_interpolated_j']:.1f} J")
    add("ipw vs reference", lambda r: f"{r['ipw_vs_counter']:+.2%}")
    add("Σ per-query + gaps (span) vs counter over the span", lambda r: f"{r['span_vs_counter']:+.2%}" if "span_vs_counter" in r else "n/a")
    add("gaps: share of span, ipw power vs windows'", lambda r: f"{r['gap_share_of_span']:.1%}, {r['gap_power_vs_window_power']:+.1%}"
        if "gap_share_of_span" in r else "n/a")
    add("run's own energy audit (manifest): difference, ±90%", lambda r: "; ".join(
        f"{a['difference_j']:+.1f} J ({a['difference_j'] / a['counter_j']:+.2%}) ±{a['uncertainty_j']:.1f} J, "
        f"{'agrees' if a['agrees'] else 'DISAGREES'}" for a in (r.get("energy_audit") or [])
        if a.get("difference_j") is not None and a.get("counter_j")) or "n/a")
    add("Σ begin/end counter reads", lambda r: f"{r['sum_begin_end_j']:.1f} J ({r['begin_end_vs_counter']:+.1%})")
    add("begin/end windows reading 0 J", lambda r: f"{r['begin_end_zero_windows']} of {r['records_with_gpu_energy']}")
    add("idle GPU power (spread)", lambda r: ", ".join(f"{k} {v:.1f} W (±{r['idle_spread_w'].get(k, 0):.1f})"
                                                       for k, v in r["idle_power_w"].items() if k.startswith("gpu")))
    add("gross / net J/query", lambda r: f"{r['gross_j_per_query']:.3f} / {r['net_j_per_query']:.3f}")
    add("sampler CPU share", lambda r: ", ".join(
        f"{k} {v.get('cpu_fraction_of_one_core', float('nan')):.2%}" for k, v in r["sampler_overhead"].items()
        if isinstance(v, dict) and "cpu_fraction_of_one_core" in v) or "n/a")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("counter", type=Path)
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    counter = pd.read_csv(args.counter)
    rows = [figures(run, counter) for run in args.runs]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
