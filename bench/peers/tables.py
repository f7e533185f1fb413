"""The tables of docs/PEERS.md from the raw files of bench/peers/peers.py and bench/peers/peers_h200.sh (issue 59).

    python3 bench/peers/tables.py windows overhead queries DIR...   # the tables named, from DIR's files
    python3 bench/peers/tables.py aiperf DIR                         # table 3 (bench/peers/aiperf_serving.py's DIR)

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


def counter_file(d: Path, part: str) -> Path:
    """The reference's file in ``d``: the full counter trace (``counter-PART``, or ``counter`` as the aiperf stage
    names it), else its step rows alone (what the tree keeps)."""
    names = [f"counter-{part}.csv.gz", "counter.csv.gz", f"counter-steps-{part}.csv.gz"]
    return next((d / n for n in names if (d / n).exists()), d / names[-1])


def with_reference(frame: pd.DataFrame, d: Path, part: str) -> pd.DataFrame:
    """Each window's reference (``counter_file``)."""
    t, j = reference(counter_file(d, part))
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
    return "\n".join(lines) + "\n\n" + bounds(d)


def idle_closure(d: Path) -> pd.DataFrame:
    """A second reference for table 2, from the same counter: each query's steps (from the last step before any
    tool's window opened to the first after the last one closed) less the idle power over the part of them no
    query held, the idle power being the mean of the nearest steps before and after that hold no query. The
    interpolated counter gives a query its steps' mean power, which is low where the GPU idles around it; this one
    gives the idle time around it the idle power, which is low where power falls slowly after a query (so it reads
    the query high). Where both hold, a query's energy lies between the two. Queries that share a step with
    another, or have no query-free step within 3 steps on both sides, are left out."""
    t, j = reference(counter_file(d, "queries"))
    f = pd.read_csv(d / "queries.csv")
    span = f.groupby("query").agg(a=("start_s", "min"), b=("end_s", "max"))
    a, b = span["a"].to_numpy(), span["b"].to_numpy()
    power = np.diff(j) / np.diff(t)  # step k runs from t[k] to t[k + 1]
    held = np.array([np.any((a < t[k + 1]) & (b > t[k])) for k in range(len(power))])
    rows = []
    for q, qa, qb in zip(span.index, a, b):
        k0, k1 = int(np.searchsorted(t, qa)) - 1, int(np.searchsorted(t, qb))
        if k0 < 1 or k1 >= len(power) or np.sum((a < t[k1]) & (b > t[k0])) > 1:
            continue
        before = [k for k in range(k0 - 1, max(k0 - 4, -1), -1) if not held[k]]
        after = [k for k in range(k1, min(k1 + 3, len(power))) if not held[k]]
        if before and after:
            rows.append((q, j[k1] - j[k0], (power[before[0]] + power[after[0]]) / 2, t[k1] - t[k0]))
    bracket = pd.DataFrame(rows, columns=["query", "bracket_j", "idle_w", "bracket_s"])
    out = f.merge(bracket, on="query")
    out["closure_j"] = out["bracket_j"] - out["idle_w"] * (out["bracket_s"] - (out["end_s"] - out["start_s"]))
    return out


def bounds(d: Path) -> str:
    """Each tool's Σ over the queries against both references (``idle_closure``)."""
    f = with_reference(idle_closure(d), d, "queries")
    lines = ["| tool | queries | Σ tool / Σ interpolated counter | Σ tool / Σ counter less idle around |",
             "|---|---|---|---|"]
    for tool in [t for t in ORDER if t in set(f["tool"])]:
        g = f[f["tool"] == tool]
        lines.append(f"| {tool} | {len(g)} | {pct(g['energy_j'].sum() / g['ref_j'].sum() - 1)} | "
                     f"{pct(g['energy_j'].sum() / g['closure_j'].sum() - 1)} |")
    return "\n".join(lines) + "\n"


AIPERF_TOTAL = "nvidia_total_gpu_energy"  # AIPerf's J over its profiling phase (--gpu-telemetry pynvml or DCGM)


def aiperf_energy(summary: dict) -> str:
    """AIPerf's energy figures as it reports them (every summary metric named *energy*: J, J/request, mJ/token,
    ...), else why it has none (its telemetry summary)."""
    got = [f"{k.removeprefix('nvidia_')} {v['avg']:.4g} {v.get('unit', '')}" for k, v in summary.items()
           if "energy" in k and isinstance(v, dict) and v.get("avg") is not None]
    if got:
        return ", ".join(got)
    t = (summary.get("telemetry_data") or {}).get("summary", {})
    errors = (summary.get("telemetry_data") or {}).get("error_summary") or []
    return (f"none: telemetry {', '.join(t.get('endpoints_configured', [])) or 'off'} collected nothing"
            + (f" ({'; '.join(str(e) for e in errors)[:120]})" if errors else ""))


def ipw_records(d: Path) -> pd.DataFrame:
    """ipw serve's per-request records (every session of its run folder), with each one's energy of the GPU
    components (gpu*), or of all its components where none is a GPU's (a CPU try: its CPU model); the tree keeps
    only those columns (``ipw-records.csv.gz``, written by ``main``'s ``ipw-records DIR``)."""
    kept = d / "ipw-records.csv.gz"
    if kept.exists():
        return pd.read_csv(kept, keep_default_na=False)
    frames = []
    for run in sorted((d / "ipw-serve").glob("*/")):
        path = run / "records.parquet"
        frames.append(pd.read_parquet(path) if path.exists() else pd.read_json(run / "records.jsonl", lines=True))
    if not frames:
        return pd.DataFrame(columns=["start_s", "end_s", "energy_j", "completion_tokens", "component"])
    f = pd.concat(frames, ignore_index=True)
    parts = [json.loads(p) if isinstance(p, str) else list(p or []) for p in f["energy_parts"]]
    gpu = any(str(x.get("component", "")).startswith("gpu") for ps in parts for x in ps)
    f["ipw_j"] = [sum(x["energy_j"] or 0.0 for x in ps if str(x.get("component", "")).startswith("gpu") or not gpu)
                  for ps in parts]
    f["component"] = [",".join(sorted({str(x.get("component")) for x in ps})) for ps in parts]
    return f


def aiperf(d: Path) -> str:
    runs = json.loads((d / "runs.json").read_text())
    counter = counter_file(d, "aiperf")
    ref = reference(counter) if counter.exists() else None
    recs = ipw_records(d)
    meta = json.loads((d / "meta.json").read_text()) if (d / "meta.json").exists() else {}
    notes = [f"AIPerf's GPU telemetry: --gpu-telemetry {meta.get('gpu_telemetry')}; its default, a DCGM exporter: "
             f"{meta.get('dcgm_endpoints')}", "" if ref else "The reference: no counter file (no NVIDIA GPU), none "
             "of the rows has one.", ""]
    lines = ["| path | in flight | requests | req/s | output tok/s | latency p50 (ms) | AIPerf's energy | span (s) "
             "| reference J | AIPerf total / reference | ipw Σ per-request J (records) | ipw J/output token "
             "| ipw Σ / reference |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        head = f"| {r['path']} | {r['concurrency']} | {r.get('requests_done', 0)}/{r['requests_asked']}"
        summary_path = d / r["folder"] / "profile_export_aiperf.json"
        if not summary_path.exists():  # the tree keeps it gzipped
            summary_path = summary_path.with_name(summary_path.name + ".gz")
        if not summary_path.exists() or "start_s" not in r:
            lines.append(f"{head} | AIPerf failed (rc {r['rc']}): {' / '.join(r['log_tail'])[:160]} |" + " |" * 8)
            continue
        m = json.loads(gzip.decompress(summary_path.read_bytes()) if summary_path.suffix == ".gz"
                       else summary_path.read_text())
        span = r["end_s"] - r["start_s"]
        ref_j = float(np.interp(r["end_s"], *ref) - np.interp(r["start_s"], *ref)) if ref else None
        total = m.get(AIPERF_TOTAL, {}).get("avg")
        ipw_cells = "n/a (no ipw in front) | | "
        if r["path"] == "ipw":
            eps = 1e-3
            g = recs[(recs["start_s"] >= r["start_s"] - eps) & (recs["end_s"] <= r["end_s"] + eps)]
            j, tokens = float(g["ipw_j"].sum()), int(g["completion_tokens"].sum())
            comp = ",".join(sorted(set(",".join(g["component"]).split(",")) - {""}))
            ipw_cells = (f"{j:.3f} ({len(g)}, {comp}) | {j / tokens:.4g} | "
                         f"{pct(j / ref_j - 1) if ref_j else 'no reference'}" if tokens else "no records | | ")
        lines.append(f"{head} | {m['request_throughput']['avg']:.2f} | {m['output_token_throughput']['avg']:.1f} | "
                     f"{m['request_latency']['p50']:.0f} | {aiperf_energy(m)} | {span:.2f} | "
                     f"{f'{ref_j:.3f}' if ref_j else 'no counter'} | "
                     f"{pct(total / ref_j - 1) if total and ref_j else 'n/a'} | {ipw_cells} |")
    return "\n".join(notes + lines) + "\n"


def main(argv: list[str]) -> None:
    if argv[:1] == ["ipw-records"]:  # what the tree keeps of ipw serve's run folder: the columns table 3 reads
        for d in map(Path, argv[1:]):
            ipw_records(d)[["start_s", "end_s", "completion_tokens", "ipw_j", "component"]].to_csv(
                d / "ipw-records.csv.gz", index=False)
        return
    names = [a for a in argv if a in ("windows", "overhead", "queries", "aiperf")]
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
