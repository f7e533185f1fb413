"""The H200 validation of per-request energy under concurrent load (docs/SERVING.md, issue 40), against a
reference ipw does not produce: the NVML energy counter polled back to back by a process of its own
(bench/telemetry/gpu_counter.py).

    python bench/serving/serving_validate.py datasets DIR     # symmetric.jsonl (128 copies), mixed, long, short .jsonl
    python bench/serving/serving_validate.py analyze [--counter counter.csv[.gz]] [--conservation RUN ...]
        [--symmetric [LABEL=]RUN ...] [--mixed [LABEL=]MIXED,LONG,SHORT ...] [--provisional RUN ...]
        [--json OUT.json] [--component gpu0] [--strict]

What it states (markdown on stdout, everything in --json):
- conservation, per level of every run named (an ``ipw serve`` folder: per session): the requests' parts plus
  the unattributed energy (ipw's numbers, one component) against the counter over the level's span;
  J per output token and output tokens/s per level (the curve); the level's split methods and pricing; each
  level outside ±0.3% (``CONSERVATION_TARGET_PCT``) is marked ✗ and counted in the table's first line
  (``--strict``: then the exit status is 1);
- symmetry, per level: records grouped by (prompt_tokens, completion_tokens), so that only identical work is
  compared; the pooled CV (square root of the count-weighted mean of each group's variance / mean², over the
  groups of two or more, variance with ddof 0), the p90 and max relative deviation from the group's mean,
  the group count and the biggest group's min..max;
- mixed load: each class's attributed energy in the mixed run against its marginal energy, the mixed run's
  counter energy minus the counter energy of the run of the other class alone;
- provisional (``ipw serve`` runs): among the records that carry ``provisional_energy_j``, the share whose
  settled ``energy_j`` lies within provisional ± ``provisional_uncertainty_j`` (the ±90%: target 85-95%),
  and sum(provisional) / sum(settled) - 1 (target within ±1%); by kind, and by load (the most requests in flight
  while a request ran) with the sum's error in each quarter of a round;
Without --counter, conservation and the marginal energies are left out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: this file is bench/<question>/<script>.py

COMPONENT = "gpu0"  # --component: another reading's component (e.g. cpu-process, to try the script on a CPU run)
SYMMETRIC_ROWS = 128
QUESTION = "Name the largest planet of the solar system in one word."


def write_datasets(out: Path) -> None:
    """Identical prompts (symmetry), and long- and short-prompt requests (mixed load)."""
    out.mkdir(parents=True, exist_ok=True)

    def write(name: str, rows: list[dict]) -> None:
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    write("symmetric.jsonl", [{"id": f"sym-{i:03d}", "prompt": QUESTION, "answer": "Jupiter", "scorer": "contains",
                               "category": "symmetric"} for i in range(SYMMETRIC_ROWS)])
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
        return self.estimate(start_s, end_s)[0]

    def estimate(self, start_s: float, end_s: float) -> tuple[float, float | None]:
        """The counter's energy over the span and its own ± (one step of the counter at the span's mean power:
        each edge is interpolated inside a step)."""
        from ipw.telemetry.estimator import counter_energy_between

        est = counter_energy_between(self.t_s, self.e_j, start_s, end_s)
        if est.energy_j is None or est.coverage < 0.999:
            raise SystemExit(f"the counter does not cover [{start_s}, {end_s}] (coverage {est.coverage})")
        return float(est.energy_j), est.uncertainty_j


def _records(path: Path) -> pd.DataFrame:
    if (path / "records.parquet").exists():
        return pd.read_parquet(path / "records.parquet")
    return pd.read_json(path / "records.jsonl", lines=True)  # a run that did not complete (or is still serving)


_RUNS: dict[Path, tuple[dict, pd.DataFrame]] = {}


def _run(path: Path) -> tuple[dict, pd.DataFrame]:
    path = Path(path)
    if path not in _RUNS:
        manifest = json.loads((path / "manifest.json").read_text())
        frame = _records(path)
        frame["gpu_j"] = [next((p["energy_j"] for p in (json.loads(parts) if isinstance(parts, str) else parts or [])
                                if p.get("component") == COMPONENT), np.nan) for parts in frame["energy_parts"]]
        frame["gpu_j"] = frame["gpu_j"].astype(float)
        _RUNS[path] = manifest, frame
    return _RUNS[path]


def _levels(manifest: dict) -> list[dict]:
    """A run's levels, each with its ``backend``; an ``ipw serve`` folder's sessions count as levels
    (``session`` = its index)."""
    return [{**level, "backend": b["name"]} for b in manifest["backends"] for level in b.get("levels", [])] + [
        {**s, "concurrency": None, "session": i, "backend": b["name"]} for b in manifest["backends"]
        for i, s in enumerate(b.get("sessions", [])) if "start_s" in s]


def _level_records(frame: pd.DataFrame, level: dict) -> pd.DataFrame:
    if "backend" in frame and level.get("backend") is not None:  # a run of several backends (the same levels)
        frame = frame[frame["backend"] == level["backend"]]
    if level.get("concurrency") is not None:
        return frame[frame["concurrency"] == level["concurrency"]]
    eps = 1e-6  # a session: the records that ran inside its span
    return frame[(frame["start_s"] >= level["start_s"] - eps) & (frame["end_s"] <= level["end_s"] + eps)]


def _split_of(manifest: dict, level: dict) -> str:
    return level.get("energy_split") or manifest.get("config", {}).get("energy_split") \
        or manifest.get("config", {}).get("split_energy") or ""


def _pricing(level: dict) -> dict | None:
    pricing = level.get("pricing")
    if not isinstance(pricing, dict):
        return None
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in pricing.items()
            if isinstance(v, (int, float, str, type(None)))}


def _weight(pricing: dict | None) -> str:
    """The prefill weight of a level's pricing, as the tables show it ('-' without pricing)."""
    if not pricing or pricing.get("prefill_weight") is None:
        return "-"
    return f"{pricing['prefill_weight']}" + ("" if pricing.get("fitted", True) else " (not fitted)")


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), nd)


#: conservation's target: a level's parts plus unattributed energy within this much of the counter over its span
CONSERVATION_TARGET_PCT = 0.3


def conservation(counter: Counter | None, run: Path) -> list[dict]:
    manifest, frame = _run(run)
    rows = []
    for level in _levels(manifest):
        recs = _level_records(frame, level)
        gpu = level["energy"][COMPONENT]
        parts = float(recs["gpu_j"].sum())
        ipw_total = parts + gpu["unattributed_j"]
        reference, reference_unc = counter.estimate(level["start_s"], level["end_s"]) if counter else (None, None)
        tokens = int(recs["completion_tokens"].sum())
        span = level["end_s"] - level["start_s"]
        unc = recs["split_uncertainty_j"] if "split_uncertainty_j" in recs else pd.Series(dtype=float)
        rows.append({
            "run": manifest["run_id"], "folder": Path(run).parent.name, "backend": level["backend"],
            "concurrency": level["concurrency"],
            "session": level.get("session"), "split": _split_of(manifest, level),
            "requests": len(recs), "span_s": round(span, 3),
            "parts_j": round(parts, 3), "unattributed_j": round(gpu["unattributed_j"], 3),
            "ipw_span_j": round(gpu["span_j"], 3), "ipw_parts_j": round(gpu.get("parts_j", float("nan")), 3),
            "counter_j": _r(reference),
            "error_pct": _r(100 * (ipw_total / reference - 1)) if reference else None,
            "within_target": abs(100 * (ipw_total / reference - 1)) <= CONSERVATION_TARGET_PCT if reference else None,
            "counter_step_pct": _r(100 * reference_unc / reference) if reference and reference_unc else None,
            "j_per_output_token": round(parts / tokens, 5) if tokens else None,
            "span_j_per_output_token": round(reference / tokens, 5) if tokens and reference else None,
            "output_tokens_per_s": round(tokens / span, 1) if span > 0 else None, "output_tokens": tokens,
            "p50_latency_s": _r(recs["latency_s"].median(), 4), "p95_latency_s": _r(recs["latency_s"].quantile(0.95), 4),
            "split_methods": level.get("split_methods"), "pricing": _pricing(level),
            "errors": int(recs["error"].notna().sum()),
            "idle_w": (level.get("idle_baseline") or {}).get("power_w", {}).get(COMPONENT),
            "median_split_uncertainty_pct": round(float(np.nanmedian(unc / recs["gpu_j"])) * 100, 2)
            if unc.notna().any() else None,
        })
    return rows


def symmetry(run: Path, label: str = "") -> list[dict]:
    """Per level: how far the shares of identical work are apart (identical = same prompt and output tokens)."""
    manifest, frame = _run(run)
    frame = frame[frame["error"].isna() & frame["gpu_j"].notna()]
    levels = {lv["concurrency"]: lv for lv in manifest["backends"][0].get("levels", [])}
    out = []
    for c, recs in frame.groupby("concurrency"):
        groups = [g for _, g in recs.groupby(["prompt_tokens", "completion_tokens"])]
        multi = [g for g in groups if len(g) >= 2]
        n = sum(len(g) for g in multi)
        row = {"label": label, "run": manifest["run_id"], "concurrency": int(c), "requests": len(recs),
               "split": _split_of(manifest, levels.get(c, {})), "groups": len(groups), "groups_of_2_plus": len(multi),
               "records_in_groups": n, "split_methods": recs["split_method"].replace("", "none").value_counts().to_dict(),
               "pricing": _pricing(levels.get(c, {})),
               "start_spread_s": round(float(recs["start_s"].max() - recs["start_s"].min()), 4)}
        if multi:
            rel_var = sum(len(g) * float(g["gpu_j"].var(ddof=0)) / float(g["gpu_j"].mean()) ** 2 for g in multi)
            dev = np.concatenate([np.abs(g["gpu_j"].to_numpy() / g["gpu_j"].mean() - 1) for g in multi])
            big = max(multi, key=len)
            row.update({
                "pooled_cv_pct": round(100 * math.sqrt(rel_var / n), 2),
                "p90_dev_pct": round(100 * float(np.quantile(dev, 0.9)), 2),
                "max_dev_pct": round(100 * float(dev.max()), 2),
                "biggest_group": {"requests": len(big), "prompt_tokens": int(big["prompt_tokens"].iloc[0]),
                                  "completion_tokens": int(big["completion_tokens"].iloc[0]),
                                  "mean_j": round(float(big["gpu_j"].mean()), 4),
                                  "min_j": round(float(big["gpu_j"].min()), 4), "max_j": round(float(big["gpu_j"].max()), 4),
                                  "cv_pct": round(100 * float(big["gpu_j"].std(ddof=0) / big["gpu_j"].mean()), 2)},
            })
        out.append(row)
    return out


def mixed(counter: Counter | None, mixed_run: Path, long_run: Path | None, short_run: Path | None,
          label: str = "") -> dict:
    def span_energy(run: Path) -> float:
        (level,) = _levels(_run(run)[0])
        return counter.between(level["start_s"], level["end_s"])

    manifest, frame = _run(mixed_run)
    total = span_energy(mixed_run) if counter else None
    (level,) = _levels(manifest)
    out = {"label": label, "run": manifest["run_id"], "split": _split_of(manifest, level), "pricing": _pricing(level),
           "mixed_counter_j": _r(total, 2), "classes": {}}
    for cls, own, other in (("long", long_run, short_run), ("short", short_run, long_run)):
        recs = frame[frame["query_id"].str.startswith(cls)]
        attributed = float(recs["gpu_j"].sum())
        marginal = total - span_energy(other) if counter and other else None
        # the two-class Shapley value: the mean of what the class costs alone and its marginal energy
        shapley = (span_energy(own) + marginal) / 2 if marginal is not None and own else None
        out["classes"][cls] = {
            "requests": len(recs), "prompt_tokens": int(recs["prompt_tokens"].sum()),
            "output_tokens": int(recs["completion_tokens"].sum()), "attributed_j": round(attributed, 2),
            "marginal_j": _r(marginal, 2), "attributed_over_marginal": round(attributed / marginal, 3) if marginal else None,
            "shapley_j": _r(shapley, 2), "attributed_over_shapley": round(attributed / shapley, 3) if shapley else None,
            "split_methods": recs["split_method"].replace("", "none").value_counts().to_dict()}
    return out


#: a request's load: the most requests in flight at once while it ran, in these bins (a session at 1, 32 and 64 in
#: flight lands in the first, third and fourth; the second holds the rounds' edges and other levels)
LOAD_BINS = ((1, 1), (2, 24), (25, 48), (49, 10**9))


def by_load(start_s: np.ndarray, end_s: np.ndarray, streamed: np.ndarray, prov: np.ndarray, band: np.ndarray,
            settled: np.ndarray, all_start_s: np.ndarray | None = None, all_end_s: np.ndarray | None = None) -> dict:
    """Provisional against settled energy by load (``LOAD_BINS``) and kind, and through each round's phases: the
    sum's error in each quarter of a round (requests in the order they ended; a round is a stretch with no gap
    of 0.5 s between requests), averaged over the rounds of a load.  ``all_*``: every request in flight (the
    load counts those without a provisional value too)."""
    a_s = start_s if all_start_s is None else all_start_s
    a_e = end_s if all_end_s is None else all_end_s
    events = np.sort(np.concatenate([a_s, a_e]))
    peak = np.array([max(int(((a_s <= t) & (a_e > t)).sum())
                         for t in np.concatenate([[a], events[(events > a) & (events < b)]]))
                     for a, b in zip(start_s, end_s)])
    inside = np.abs(settled - prov) <= band
    order = np.argsort(start_s)
    gap = np.r_[True, start_s[order][1:] - np.maximum.accumulate(end_s[order])[:-1] > 0.5]
    round_of = np.empty(len(start_s), dtype=int)
    round_of[order] = np.cumsum(gap)

    def row(mask: np.ndarray) -> dict:
        return {"records": int(mask.sum()), "coverage_pct": round(100 * float(inside[mask].mean()), 1),
                "sum_ratio_minus_1_pct": round(100 * (float(prov[mask].sum()) / float(settled[mask].sum()) - 1), 2)}

    out = {}
    for lo, hi in LOAD_BINS:
        at = (peak >= lo) & (peak <= hi)
        if not at.any():
            continue
        label = str(lo) if lo == hi else (f"{lo}-{hi}" if hi < 10**9 else f">={lo}")
        entry = {**row(at), **{kind: row(at & m) for kind, m in (("streamed", streamed), ("plain", ~streamed))
                              if (at & m).any()}}
        quarters = []
        for r in np.unique(round_of[at]):
            idx = np.flatnonzero(at & (round_of == r))
            if idx.size >= 8:
                idx = idx[np.argsort(end_s[idx])]
                quarters.append([100 * (prov[q].sum() / settled[q].sum() - 1) for q in np.array_split(idx, 4)])
        if quarters:
            entry["quarters_sum_ratio_minus_1_pct"] = [round(float(x), 1) for x in np.mean(quarters, axis=0)]
            entry["rounds"] = len(quarters)
        out[label] = entry
    return out


def provisional(run: Path) -> dict:
    """How the provisional energies the answers carried compare with the settled ones of the same records."""
    manifest, frame = _run(run)
    out = {"run": manifest["run_id"], "folder": Path(run).parent.name, "records": len(frame),
           "split": next((_split_of(manifest, s) for s in _levels(manifest)), "")}
    if "provisional_energy_j" not in frame:
        return {**out, "with_provisional": 0}
    recs = frame[frame["provisional_energy_j"].notna() & frame["energy_j"].notna() & frame["error"].isna()]
    out["with_provisional"] = len(recs)
    if recs.empty:
        return out
    prov, settled = recs["provisional_energy_j"].astype(float), recs["energy_j"].astype(float)
    band = recs["provisional_uncertainty_j"].astype(float)
    inside = (settled - prov).abs() <= band
    alone = recs["split_method"].fillna("").isin(["", "none"])
    out.update({
        "coverage_pct": round(100 * float(inside.mean()), 2),
        "coverage_alone_pct": round(100 * float(inside[alone].mean()), 2) if alone.any() else None,
        "coverage_overlapped_pct": round(100 * float(inside[~alone].mean()), 2) if (~alone).any() else None,
        "records_alone": int(alone.sum()),
        "sum_ratio_minus_1_pct": round(100 * (float(prov.sum()) / float(settled.sum()) - 1), 3),
        "median_abs_error_pct": _r(100 * float(((prov - settled).abs() / settled)[settled > 0].median()), 2),
        "median_band_pct": _r(100 * float((band / settled)[settled > 0].median()), 2),
        "band_missing": int(band.isna().sum()),
        "sum_provisional_j": round(float(prov.sum()), 3), "sum_settled_j": round(float(settled.sum()), 3),
    })
    # by what the proxy saw (the provisional value's source): alone or overlapped, streamed (a first token before
    # the end) or plain
    streamed = recs["ttft_s"].astype(float) < recs["latency_s"].astype(float) - 1e-9
    groups = {}
    for name, mask in (("alone, streamed", alone & streamed), ("alone, plain", alone & ~streamed),
                       ("overlapped, streamed", ~alone & streamed), ("overlapped, plain", ~alone & ~streamed)):
        if mask.any():
            groups[name] = {"records": int(mask.sum()), "coverage_pct": round(100 * float(inside[mask].mean()), 1),
                            "sum_ratio_minus_1_pct": round(100 * (float(prov[mask].sum()) / float(settled[mask].sum()) - 1), 2),
                            "median_abs_error_pct": _r(100 * float(((prov - settled).abs() / settled)[mask].median()), 1)}
    out["by_kind"] = groups
    out["by_load"] = by_load(recs["start_s"].to_numpy(float), recs["end_s"].to_numpy(float), streamed.to_numpy(),
                             prov.to_numpy(), band.to_numpy(), settled.to_numpy(),
                             frame["start_s"].to_numpy(float), frame["end_s"].to_numpy(float))
    return out


def _markdown(result: dict) -> str:
    lines: list[str] = []
    if result.get("conservation"):
        checked = [r for r in result["conservation"] if r.get("within_target") is not None]
        outside = [r for r in checked if not r["within_target"]]
        lines += ["## Conservation (parts + unattributed against the counter over each level's span)", "",
                  f"**{len(checked) - len(outside)} of {len(checked)} levels within ±{CONSERVATION_TARGET_PCT}%**"
                  + (": outside (✗): " + ", ".join(f"{r['folder']} c={r['concurrency']} {r['error_pct']:+.2f}% "
                                                  f"({r['span_s']} s)" for r in outside) if outside else "") + ".", "",
                  "The counter's own resolution over a span (one of its steps at the span's mean power: each edge is "
                  "interpolated inside a step) is in brackets after the error.", "",
                  "| folder | backend | c | split | requests | span s | parts J | unattributed J | counter J | error % | "
                  "J/out tok | out tok/s | p95 s | prefill weight | split methods |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["conservation"]:
            err = f"{r['error_pct']:+.2f}" if r["error_pct"] is not None else "-"
            err += {True: "", False: " ✗", None: ""}[r.get("within_target")]
            err += f" (±{r['counter_step_pct']:.2f})" if r.get("counter_step_pct") is not None else ""
            c = r["concurrency"] if r["concurrency"] is not None else f"session {r['session']}"
            weight = _weight(r["pricing"])
            lines.append(f"| {r['folder']} | {r['backend']} | {c} | {r['split'] or '-'} | {r['requests']} | {r['span_s']} | "
                         f"{r['parts_j']} | {r['unattributed_j']} | {r['counter_j']} | {err} | {r['j_per_output_token']} | "
                         f"{r['output_tokens_per_s']} | {r['p95_latency_s']} | {weight} | "
                         f"{json.dumps(r['split_methods'])} |")
    if result.get("symmetry"):
        lines += ["", "## Symmetry (identical work: records grouped by prompt and output tokens)", "",
                  "| label | c | split | requests | groups (≥2) | pooled CV | p90 dev | max dev | biggest group: n, tokens, "
                  "mean, min..max J | prefill weight |", "|---|---|---|---|---|---|---|---|---|---|"]
        for s in result["symmetry"]:
            b = s.get("biggest_group")
            big = (f"{b['requests']}, {b['prompt_tokens']}+{b['completion_tokens']}, {b['mean_j']}, "
                   f"{b['min_j']}..{b['max_j']}") if b else "-"
            lines.append(f"| {s['label']} | {s['concurrency']} | {s['split'] or '-'} | {s['requests']} | {s['groups']} "
                         f"({s['groups_of_2_plus']}) | {s.get('pooled_cv_pct', '-')}% | {s.get('p90_dev_pct', '-')}% | "
                         f"{s.get('max_dev_pct', '-')}% | {big} | {_weight(s['pricing'])} |")
    if result.get("mixed"):
        lines += ["", "## Mixed load (attributed against marginal energy)", "",
                  "| label | split | prefill weight | class | requests | prompt tokens | output tokens | attributed J | "
                  "marginal J | attributed / marginal | Shapley J | attributed / Shapley |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for m in result["mixed"]:
            for cls, v in m["classes"].items():
                lines.append(f"| {m['label']} | {m['split'] or '-'} | {_weight(m['pricing'])} | {cls} | {v['requests']} | "
                             f"{v['prompt_tokens']} | "
                             f"{v['output_tokens']} | {v['attributed_j']} | {v['marginal_j']} | "
                             f"{v['attributed_over_marginal']} | {v.get('shapley_j')} | {v.get('attributed_over_shapley')} |")
    if result.get("provisional"):
        lines += ["", "## Provisional energy (ipw serve): settled within provisional ± its 90% band (target 85-95%), "
                  "sum(provisional)/sum(settled) - 1 (target ±1%)", "",
                  "| folder | run | records | with provisional | coverage | alone / overlapped | sum ratio - 1 | "
                  "median abs error | median band |", "|---|---|---|---|---|---|---|---|---|"]
        for p in result["provisional"]:
            if not p.get("coverage_pct") and p.get("coverage_pct") != 0:
                lines.append(f"| {p['folder']} | {p['run']} | {p['records']} | {p['with_provisional']} | - | - | - | - | - |")
                continue
            lines.append(f"| {p['folder']} | {p['run']} | {p['records']} | {p['with_provisional']} | {p['coverage_pct']}% | "
                         f"{p['coverage_alone_pct']}% / {p['coverage_overlapped_pct']}% | {p['sum_ratio_minus_1_pct']:+.3f}% | "
                         f"{p['median_abs_error_pct']}% | {p['median_band_pct']}% |")
        lines += ["", "By load (the most requests in flight while a request ran) and kind; the sum's error in each quarter "
                  "of a round, averaged over the rounds:", "",
                  "| folder | load | records | coverage | sum ratio - 1 | streamed: coverage, sum | plain: coverage, sum | "
                  "quarters of a round (rounds) |", "|---|---|---|---|---|---|---|---|"]
        for p in result["provisional"]:
            for load, e in p.get("by_load", {}).items():
                kinds = [f"{e[k]['coverage_pct']}%, {e[k]['sum_ratio_minus_1_pct']:+.2f}%" if k in e else "-"
                         for k in ("streamed", "plain")]
                q = e.get("quarters_sum_ratio_minus_1_pct")
                quarters = " ".join(f"{x:+.0f}%" for x in q) + f" ({e['rounds']})" if q else "-"
                lines.append(f"| {p['folder']} | {load} | {e['records']} | {e['coverage_pct']}% | "
                             f"{e['sum_ratio_minus_1_pct']:+.2f}% | {kinds[0]} | {kinds[1]} | {quarters} |")
    return "\n".join(lines)


def _labelled(spec: str) -> tuple[str, str]:
    label, sep, rest = spec.partition("=")
    return (label, rest) if sep and "/" not in label else ("", spec)


def main(argv: list[str]) -> int:
    global COMPONENT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("datasets")
    d.add_argument("out", type=Path)
    a = sub.add_parser("analyze")
    a.add_argument("--counter", type=Path, help="bench/telemetry/gpu_counter.py's CSV (or .csv.gz)")
    a.add_argument("--conservation", "--sweep", type=Path, nargs="*", default=[],
                   help="runs checked for conservation only (every other run named is checked too)")
    a.add_argument("--symmetric", nargs="*", default=[], help="[LABEL=]RUN")
    a.add_argument("--mixed", nargs="*", default=[], help="[LABEL=]MIXED[,LONG,SHORT]")
    a.add_argument("--long", type=Path, help="the long class alone (for a --mixed given without it)")
    a.add_argument("--short", type=Path, help="the short class alone (for a --mixed given without it)")
    a.add_argument("--provisional", type=Path, nargs="*", default=[], help="ipw serve run folders")
    a.add_argument("--json", type=Path)
    a.add_argument("--component", default="gpu0")
    a.add_argument("--strict", action="store_true",
                   help=f"exit 1 when a level's conservation misses ±{CONSERVATION_TARGET_PCT}%% of the counter")
    args = parser.parse_args(argv)
    if args.cmd == "datasets":
        write_datasets(args.out)
        return 0
    COMPONENT = args.component
    counter = Counter(args.counter) if args.counter else None
    missing: list[str] = []

    def ok(p: Path | str | None) -> Path | None:  # a run folder, or None (noted) where a run failed or is absent
        if p and (Path(p) / "manifest.json").exists():
            return Path(p)
        if p is not None:
            missing.append(str(p))
        return None

    symmetric = [(label, ok(p)) for label, p in map(_labelled, args.symmetric)]
    symmetric = [(label, p) for label, p in symmetric if p]
    mixed_sets = []
    for label, spec in map(_labelled, args.mixed):
        paths = [ok(p) for p in spec.split(",")] + [None, None]
        if paths[0]:
            mixed_sets.append((label, paths[0], paths[1] or ok(args.long), paths[2] or ok(args.short)))
    provisional_runs = [p for p in map(ok, args.provisional) if p]
    runs: list[Path] = []
    for p in [*filter(None, map(ok, args.conservation)), *(p for _, p in symmetric),
              *(p for s in mixed_sets for p in s[1:] if p), *provisional_runs]:
        if p not in runs:
            runs.append(p)
    result: dict = {"component": COMPONENT, "counter_read_s": counter.read_s if counter else None,
                    "missing_runs": sorted(set(missing))}
    if missing:
        print(f"not found (no manifest.json), left out: {sorted(set(missing))}", file=sys.stderr)
    if counter:
        result["conservation"] = [r for run in runs for r in conservation(counter, run)]
    if symmetric:
        result["symmetry"] = [row for label, run in symmetric for row in symmetry(run, label)]
    if mixed_sets:
        result["mixed"] = [mixed(counter, m, lg, sh, label) for label, m, lg, sh in mixed_sets]
    if provisional_runs:
        result["provisional"] = [provisional(run) for run in provisional_runs]
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(_markdown(result))
    outside = [r for r in result.get("conservation", []) if r.get("within_target") is False]
    return 1 if args.strict and outside else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
