"""The tables of docs/PEERS.md from the raw files of bench/peers/peers.py and bench/peers/peers_h200.sh (issue 59).

    python3 bench/peers/tables.py windows overhead queries DIR...   # the tables named, from DIR's files

The reference is the NVML counter read back to back by bench/telemetry/gpu_counter.py: its steps (each one's
moment known to a few ms), interpolated linearly, give the cumulative energy (as bench/telemetry/gpu_figures.py).

Output: markdown on stdout (the tables of docs/PEERS.md; evidence in bench/evidence/peers/).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ORDER = ["ipw", "zeus", "zeus-approx", "codecarbon", "bare"]


def reference(counter_csv: Path) -> tuple[np.ndarray, np.ndarray]:
    """(step time, cumulative J) of GPU 0's counter: the middle of the two reads around each step."""
    with gzip.open(counter_csv, "rt") as f:
        c = pd.read_csv(f)
    c = c[c["gpu"] == 0]
    after, before, j = c["t_after_s"].to_numpy(), c["t_before_s"].to_numpy(), c["energy_mj"].to_numpy() / 1000.0
    step = np.flatnonzero(np.diff(j) != 0) + 1
    return (after[step - 1] + before[step]) / 2, j[step]


def with_reference(frame: pd.DataFrame, d: Path, part: str) -> pd.DataFrame:
    """Each window's reference: the full counter trace, else its step rows alone (what the tree keeps)."""
    full = d / f"counter-{part}.csv.gz"
    t, j = reference(full if full.exists() else d / f"counter-steps-{part}.csv.gz")
    out = frame.copy()
    out["ref_j"] = np.interp(out["end_s"], t, j) - np.interp(out["start_s"], t, j)
    out["err"] = out["energy_j"] / out["ref_j"] - 1.0
    return out


def pct(x: float) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{100 * x:+.2f}%" if abs(x) < 0.1 else f"{100 * x:+.1f}%"


def apct(x: float) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{100 * x:.2f}%" if abs(x) < 0.1 else f"{100 * x:.1f}%"


def windows(d: Path) -> str:
    f = with_reference(pd.read_csv(d / "windows.csv"), d, "windows")
    # a tool's own window runs from its begin's return to its end's call: an outer tool's holds the inner
    # tools' begin and end calls too, so its real length is shown beside the nominal one
    lines = ["| tool | window (its real median length) | n | median abs error | p90 abs error | bias (median signed) "
             "| 0 J read |", "|---|---|---|---|---|---|---|"]
    summary = {}
    for tool in [t for t in ORDER if t in set(f["tool"])]:
        for length, g in f[f["tool"] == tool].groupby("length_s"):
            e = g["err"].dropna()
            zero = float((g["energy_j"].fillna(0) == 0).mean())
            row = {"n": len(g), "median_abs": float(e.abs().median()), "p90_abs": float(e.abs().quantile(0.9)),
                   "bias": float(e.median()), "zero": zero}
            summary[f"{tool}@{length}"] = row
            real = float((g["end_s"] - g["start_s"]).median())
            lines.append(f"| {tool} | {length:g} s ({real:.3f} s) | {len(g)} | {apct(row['median_abs'])} | {apct(row['p90_abs'])} | "
                         f"{pct(row['bias'])} | {zero:.0%} |")
    per_load = f.groupby(["tool", "load", "length_s"])["err"].apply(lambda e: float(e.abs().quantile(0.9)))
    (d / "windows-summary.json").write_text(json.dumps({"pooled": summary, "p90_by_load": {
        f"{k[0]}@{k[1]}@{k[2]}": v for k, v in per_load.items()}}, indent=1))
    return "\n".join(lines) + "\n"


def overhead(d: Path) -> str:
    f = pd.read_csv(d / "overhead.csv")
    bare = f[f["side"] == "bare"].groupby("round")[["tok_s_inside", "tok_s_wall"]].mean()
    lines = ["| tool | tok/s inside the windows | ratio to bare (rounds) | tok/s over the loop | ratio to bare |",
             "|---|---|---|---|---|"]
    for side in ["bare", "ipw", "zeus", "codecarbon"]:
        g = f[f["side"] == side].groupby("round")[["tok_s_inside", "tok_s_wall"]].mean()
        if g.empty:
            continue
        ri = g["tok_s_inside"] / bare["tok_s_inside"]
        rw = g["tok_s_wall"] / bare["tok_s_wall"]
        lines.append(f"| {side} | {g['tok_s_inside'].median():.1f} | {ri.median():.3f} "
                     f"({', '.join(f'{x:.3f}' for x in ri)}) | {g['tok_s_wall'].median():.1f} | {rw.median():.3f} |")
    return "\n".join(lines) + "\n"


def queries(d: Path) -> str:
    f = with_reference(pd.read_csv(d / "queries.csv"), d, "queries")
    lines = ["| tool | queries | Σ tool / Σ reference | per-query p90 abs error | median abs error | 0 J read |",
             "|---|---|---|---|---|---|"]
    for kind in ["short", "long", "all"]:
        g0 = f if kind == "all" else f[f["kind"] == kind]
        for tool in [t for t in ORDER if t in set(g0["tool"])]:
            g = g0[g0["tool"] == tool]
            e = g["err"].dropna()
            s = g["energy_j"].sum() / g["ref_j"].sum() - 1.0
            lines.append(f"| {tool} | {kind} ({g['query'].nunique()}) | {pct(s)} | {apct(e.abs().quantile(0.9))} | "
                         f"{apct(e.abs().median())} | {(g['energy_j'].fillna(0) == 0).mean():.0%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    names = [a for a in argv if a in ("windows", "overhead", "queries")]
    dirs = [Path(a) for a in argv if a not in names]
    for d in dirs:
        m = json.loads((d / "meta.json").read_text()) if (d / "meta.json").exists() else {}
        print(f"{d}: {m.get('gpu')}, versions {m.get('versions')}, failed {m.get('failed')}\n")
        for n in names:
            try:
                print(f"### {n}\n\n" + globals()[n](d))
            except FileNotFoundError as e:
                print(f"### {n}: no file {e.filename}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
