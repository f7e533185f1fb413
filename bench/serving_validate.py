"""The H200 validation of per-request energy under concurrent load (docs/SERVING.md), against a
reference ipw does not produce: the NVML energy counter polled back to back by a process of its own
(bench/gpu_counter.py).

    python bench/serving_validate.py datasets DIR     # symmetric.jsonl, mixed.jsonl, long.jsonl, short.jsonl
    python bench/serving_validate.py analyze --counter counter.csv --sweep RUN [--symmetric RUN]
        [--mixed RUN --long RUN --short RUN] [--json OUT.json]

What it states:
- conservation, per level of each run: the requests' parts plus the level's unattributed energy (ipw's
  numbers, GPU component) against the counter over the level's span [start_s, end_s];
- J per output token and output tokens/s per level (the curve);
- symmetry: N identical requests sent together, how far each share is from their mean;
- mixed load: each class's attributed energy in the mixed run against its marginal energy, the mixed
  run's counter energy minus the counter energy of a run of the other class alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ipw.telemetry.estimator import counter_energy_between

COMPONENT = "gpu0"  # --component: another reading's component (e.g. cpu-process, to try the script on a CPU run)


def write_datasets(out: Path) -> None:
    """Identical prompts (symmetry), and long- and short-prompt requests (mixed load)."""
    out.mkdir(parents=True, exist_ok=True)

    def write(name: str, rows: list[dict]) -> None:
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    question = "Name the largest planet of the solar system in one word."
    write("symmetric.jsonl", [{"id": f"sym-{i:02d}", "prompt": question, "answer": "Jupiter", "scorer": "contains",
                               "category": "symmetric"} for i in range(64)])
    words = ("energy", "batch", "token", "server", "request", "power", "sample", "counter", "window", "model")

    def long_prompt(i: int) -> str:  # ~1,450 tokens, a different start each (no shared prompt cache)
        lines = [f"Log {i}:"] + [f"entry {i}-{k}: the {words[(i + k) % 10]} of step {k} was {(i * 31 + k * 17) % 97}."
                                 for k in range(70)]
        return "\n".join(lines) + f"\nQuestion: what was the value of entry {i}-5? Answer with the number."

    def short_prompt(i: int) -> str:
        return f"What is {i} plus {i + 1}? Answer with the number."

    long_rows = [{"id": f"long-{i:02d}", "prompt": long_prompt(i), "answer": str((i * 31 + 85) % 97),
                  "scorer": "contains", "category": "long"} for i in range(32)]
    short_rows = [{"id": f"short-{i:02d}", "prompt": short_prompt(i), "answer": str(2 * i + 1),
                   "scorer": "contains", "category": "short"} for i in range(32)]
    write("long.jsonl", long_rows)
    write("short.jsonl", short_rows)
    write("mixed.jsonl", [row for pair in zip(long_rows, short_rows) for row in pair])


class Counter:
    """The reference: reads of the cumulative counter (mJ), each placed at the middle of its read."""

    def __init__(self, path: Path, gpu: int = 0) -> None:
        frame = pd.read_csv(path)
        frame = frame[frame["gpu"] == gpu]
        self.t_s = ((frame["t_before_s"] + frame["t_after_s"]) / 2).to_numpy()
        self.e_j = frame["energy_mj"].to_numpy(dtype=float) / 1000.0
        self.read_s = float(np.median(frame["t_after_s"] - frame["t_before_s"]))

    def between(self, start_s: float, end_s: float) -> float:
        est = counter_energy_between(self.t_s, self.e_j, start_s, end_s)
        if est.energy_j is None or est.coverage < 0.999:
            raise SystemExit(f"the counter does not cover [{start_s}, {end_s}] (coverage {est.coverage})")
        return float(est.energy_j)


def _run(path: Path) -> tuple[dict, pd.DataFrame]:
    path = Path(path)
    manifest = json.loads((path / "manifest.json").read_text())
    frame = pd.read_parquet(path / "records.parquet")
    frame["gpu_j"] = [next((p["energy_j"] for p in json.loads(parts) if p["component"] == COMPONENT), np.nan)
                      for parts in frame["energy_parts"]]
    return manifest, frame


def _levels(manifest: dict) -> list[dict]:
    """A run's levels; an ``ipw serve`` folder's sessions count as levels whose records carry concurrency 1."""
    return [level for b in manifest["backends"] for level in b.get("levels", [])] + [
        {**s, "concurrency": 1} for b in manifest["backends"] for s in b.get("sessions", []) if "start_s" in s]


def conservation(counter: Counter, run: Path) -> list[dict]:
    manifest, frame = _run(run)
    rows = []
    for level in _levels(manifest):
        c = level["concurrency"]
        recs = frame[frame["concurrency"] == c]
        gpu = level["energy"][COMPONENT]
        reference = counter.between(level["start_s"], level["end_s"])
        parts = float(recs["gpu_j"].sum())
        ipw_total = parts + gpu["unattributed_j"]
        tokens = int(recs["completion_tokens"].sum())
        span = level["end_s"] - level["start_s"]
        rows.append({
            "run": manifest["run_id"], "concurrency": c, "requests": len(recs), "span_s": round(span, 3),
            "parts_j": round(parts, 3), "unattributed_j": round(gpu["unattributed_j"], 3),
            "ipw_span_j": round(gpu["span_j"], 3), "counter_j": round(reference, 3),
            "error_pct": round(100 * (ipw_total / reference - 1), 3),
            "j_per_output_token": round(parts / tokens, 5) if tokens else None,
            "span_j_per_output_token": round(reference / tokens, 5) if tokens else None,
            "output_tokens_per_s": round(tokens / span, 1), "output_tokens": tokens,
            "p50_latency_s": round(float(recs["latency_s"].median()), 4),
            "p95_latency_s": round(float(recs["latency_s"].quantile(0.95)), 4),
            "split_methods": level["split_methods"], "errors": int(recs["error"].notna().sum()),
            "idle_w": level["idle_baseline"]["power_w"].get(COMPONENT),
            "median_split_uncertainty_pct": round(float(np.nanmedian(recs["split_uncertainty_j"] / recs["gpu_j"])) * 100, 2)
            if recs["split_uncertainty_j"].notna().any() else None,
        })
    return rows


def symmetry(run: Path) -> dict:
    _, frame = _run(run)
    e = frame["gpu_j"].to_numpy()
    tokens = frame["completion_tokens"].to_numpy()
    mean = float(e.mean())
    return {"requests": len(e), "concurrency": int(frame["concurrency"].iloc[0]), "mean_j": round(mean, 4),
            "max_dev_pct": round(float(np.abs(e / mean - 1).max()) * 100, 2),
            "p90_dev_pct": round(float(np.quantile(np.abs(e / mean - 1), 0.9)) * 100, 2),
            "cv_pct": round(float(e.std() / mean) * 100, 2),
            "output_tokens": sorted(set(int(t) for t in tokens)),
            "start_spread_s": round(float(frame["start_s"].max() - frame["start_s"].min()), 4)}


def mixed(counter: Counter, mixed_run: Path, long_run: Path, short_run: Path) -> dict:
    def span_energy(run: Path) -> float:
        (level,) = _levels(_run(run)[0])
        return counter.between(level["start_s"], level["end_s"])

    _, frame = _run(mixed_run)
    total = span_energy(mixed_run)
    out = {"mixed_counter_j": round(total, 2), "classes": {}}
    for cls, other in (("long", short_run), ("short", long_run)):
        recs = frame[frame["query_id"].str.startswith(cls)]
        attributed = float(recs["gpu_j"].sum())
        marginal = total - span_energy(other)
        out["classes"][cls] = {
            "requests": len(recs), "prompt_tokens": int(recs["prompt_tokens"].sum()),
            "output_tokens": int(recs["completion_tokens"].sum()), "attributed_j": round(attributed, 2),
            "marginal_j": round(marginal, 2), "attributed_over_marginal": round(attributed / marginal, 3) if marginal else None,
            "split_methods": recs["split_method"].value_counts().to_dict()}
    return out


def _markdown(result: dict) -> str:
    lines = ["| run | c | requests | span s | parts J | unattributed J | counter J | error % | J/out tok | out tok/s | p95 s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["conservation"]:
        lines.append(f"| {r['run']} | {r['concurrency']} | {r['requests']} | {r['span_s']} | {r['parts_j']} | "
                     f"{r['unattributed_j']} | {r['counter_j']} | {r['error_pct']:+.2f} | {r['j_per_output_token']} | "
                     f"{r['output_tokens_per_s']} | {r['p95_latency_s']} |")
    if "symmetry" in result:
        lines.append(f"\nsymmetry: {json.dumps(result['symmetry'])}")
    if "mixed" in result:
        lines.append(f"\nmixed load: {json.dumps(result['mixed'])}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    global COMPONENT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("datasets")
    d.add_argument("out", type=Path)
    a = sub.add_parser("analyze")
    a.add_argument("--counter", type=Path, required=True)
    a.add_argument("--sweep", type=Path, nargs="+", required=True)
    a.add_argument("--symmetric", type=Path, nargs="*", default=[])
    a.add_argument("--mixed", type=Path)
    a.add_argument("--long", type=Path)
    a.add_argument("--short", type=Path)
    a.add_argument("--json", type=Path)
    a.add_argument("--component", default="gpu0")
    args = parser.parse_args(argv)
    if args.cmd == "datasets":
        write_datasets(args.out)
        return 0
    COMPONENT = args.component
    counter = Counter(args.counter)
    runs = list(args.sweep) + list(args.symmetric) + [p for p in (args.mixed, args.long, args.short) if p]
    result: dict = {"counter_read_s": counter.read_s, "conservation": [r for run in runs for r in conservation(counter, run)]}
    if args.symmetric:
        result["symmetry"] = [symmetry(run) for run in args.symmetric]
    if args.mixed:
        result["mixed"] = mixed(counter, args.mixed, args.long, args.short)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
