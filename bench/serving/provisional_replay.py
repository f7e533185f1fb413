"""Replay a recorded ``ipw serve`` session through today's meter: how well would its provisional energy have
covered the settled one?

A run folder of ``ipw serve`` on a real GPU holds every request (its start, end, first token and token
counts) and the raw NVML trace (``power.parquet``: the driver's 20 ms power samples).  This script feeds
them to ``ipw.metering.meter.Meter`` on a simulated clock:

- each request starts and ends when it did; a streamed one (first token before its end) gets its output
  tokens evenly from its first token to its end, and its prefill at the first token (as llama-server's
  ``timings_per_token`` reports it); a plain one gets them with its end;
- each slice's energy is the recorded power samples integrated over it (linear between samples); the
  sensor's latest power (``current_power_w``, which provisional values integrate) is the trace's
  ``--power-lag-s`` before the clock (NVML's instant field is read 4x a second);
- a plain answer's server timings put its decode in the second half of its latency (the records do not keep
  llama-server's timings; a streamed one's are its token times);
- a period is split once the clock is ``--sensor-delay-s`` past its end (NVML's sample buffer covers a window
  ~0.1-0.15 s after it ends);
- at each request's end the meter's provisional energy is taken, as ``ipw serve`` answers with it.

Then: the share of requests whose settled energy (the replay's own split, on the same trace) lies within
the provisional value's ±90% band, and sum(provisional) / sum(settled) - 1, overall and per stretch of the
session.  The replay's settled values are not the recorded ones (another estimator integrates the trace
live); the comparison is between the replay's own provisional and settled values.

    .venv/bin/python bench/serving/provisional_replay.py RUN_FOLDER [--period-s S] [--json OUT.json]

Output: printed, and ``--json``; the figures are in docs/SERVING.md, "`ipw serve`: a measuring proxy", and
    bench/evidence/serving/*/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: this file is bench/<question>/<script>.py

from ipw.backends.base import Completion, ServerTimings
from ipw.metering import meter as meter_module
from ipw.metering.meter import Meter
from ipw.metering.window import Window
from ipw.telemetry.base import EnergyReading, SensorBase, SensorInfo
from serving_validate import by_load  # a sibling (its folder is on the path when it runs): the live records' table


class Clock:
    def __init__(self, t_s: float) -> None:
        self.t_s = t_s

    def monotonic(self) -> float:
        return self.t_s


class Trace(SensorBase):
    """A GPU whose power is the recorded samples: a window's energy is their integral over it (final at once)."""

    name = "trace"
    supports_cut = True

    def __init__(self, t_s: np.ndarray, power_w: np.ndarray, component: str, clock: "Clock", lag_s: float) -> None:
        self.t_s, self.power_w, self.component, self.clock, self.lag_s = t_s, power_w, component, clock, lag_s
        self.cum_j = np.concatenate([[0.0], np.cumsum(np.diff(t_s) * (power_w[1:] + power_w[:-1]) / 2)])

    def info(self) -> SensorInfo:
        return SensorInfo("trace", True, "nvml.samples", "measured_interpolated", "gpu", (self.component,))

    def current_power_w(self) -> dict[str, float | None]:
        """The power ``lag_s`` ago (NVML's instant field is read 4x a second, its samples in batches)."""
        return {self.component: float(np.interp(self.clock.t_s - self.lag_s, self.t_s, self.power_w))}

    def energy_at(self, t: float) -> float:
        return float(np.interp(t, self.t_s, self.cum_j))

    def begin(self, t_s: float | None = None) -> float:
        assert t_s is not None
        return t_s

    def end(self, token: float, t_s: float | None = None) -> list[EnergyReading]:
        assert t_s is not None
        return [EnergyReading(self.component, self.energy_at(t_s) - self.energy_at(token), "nvml.samples",
                              "measured_interpolated", "gpu", t_s - token)]

    def cut(self, token: float, t_s: float | None = None) -> tuple[list[EnergyReading], float]:
        return self.end(token, t_s), float(t_s if t_s is not None else token)


def replay(folder: Path, sensor_delay_s: float, split: str, period_s: float | None = None,
           rows_csv: Path | None = None, power_lag_s: float = 0.25) -> dict:
    records = pd.read_parquet(folder / "records.parquet").sort_values("start_s").reset_index(drop=True)
    power = pd.read_parquet(folder / "power.parquet")
    samples = power[power["kind"] == "sample"].sort_values("t_s")
    device = str(samples["device"].iloc[0])
    samples = samples[samples["device"] == device]
    idle_w = json.loads((folder / "manifest.json").read_text())["backends"][0]["idle_baseline"]["power_w"]
    clock = Clock(float(records["start_s"].min()) - 1.0)
    real_time = meter_module.time
    meter_module.time = types.SimpleNamespace(monotonic=clock.monotonic, perf_counter=time.perf_counter)  # type: ignore
    try:
        sensor = Trace(samples["t_s"].to_numpy(float), samples["power_w"].to_numpy(float), device, clock, power_lag_s)
        meter = Meter(Window([sensor]), split=split, live_tokens=True, expect_prefill=True, period_s=period_s,
                      idle_w={device: float(idle_w.get(device, 0.0))})
        meter.open(thread=False)  # the span, at the clock's time, without the meter's thread: periods split below
        events: list[tuple[float, int, int, str]] = []  # (time, order, row, kind)
        for i, r in records.iterrows():
            streamed = r["ttft_s"] < r["latency_s"] - 1e-9
            events.append((r["start_s"], 0, i, "start"))
            if streamed:
                first = r["start_s"] + r["ttft_s"]
                n = max(1, int(r["completion_tokens"]))
                for k, t in enumerate(np.linspace(first, r["end_s"], n, endpoint=False)):
                    events.append((float(t), 1, i, "first" if k == 0 else "token"))
            events.append((r["end_s"], 2, i, "end"))
        events.sort()
        jobs: dict[int, int] = {}
        times: dict[int, list[float]] = {}
        provisional: dict[int, tuple[float | None, float, str]] = {}

        for t, _, i, kind in events:
            clock.t_s = t
            meter.split_due(clock.t_s, sensor_delay_s)
            r = records.iloc[i]
            if kind == "start":
                jobs[i] = meter.start()
                times[i] = []
            elif kind in ("first", "token"):
                meter.token(jobs[i])
                times[i].append(t)
                if kind == "first":
                    meter.prefill(jobs[i], 5.0, int(r["prompt_tokens"]))
            else:
                first = times[i][0] if times[i] else t
                # a plain answer: llama-server's timings place its decode (taken as the second half of its latency)
                decode_ms = 1000.0 * (t - first) if times[i] else 500.0 * r["latency_s"]
                completion = Completion("", int(r["prompt_tokens"]), int(r["completion_tokens"]), r["start_s"],
                                        first if times[i] else None, t, tuple(times[i]), "stop",
                                        ServerTimings(int(r["prompt_tokens"]), 5.0, int(r["completion_tokens"]), decode_ms))
                meter.end(jobs[i], completion)
                estimate = meter.provisional(jobs[i])
                value = sum(x.energy_j for x in estimate.readings if x.energy_j is not None) if estimate.readings else None
                provisional[i] = (value, estimate.rel_90, estimate.source)
        clock.t_s = float(records["end_s"].max()) + 10.0
        meter.close()  # no meter thread: close splits what is left, here
        settled = {i: sum(x.energy_j for x in meter.share(j).readings if x.energy_j is not None) for i, j in jobs.items()}
    finally:
        meter_module.time = real_time
    rows = [(records.loc[i, "end_s"], provisional[i][0], provisional[i][1], settled[i], provisional[i][2]) for i in sorted(jobs)
            if provisional[i][0] is not None]
    t, p, rel, s = (np.array(x, dtype=float) for x in list(zip(*rows))[:4])
    src = np.array([row[4] for row in rows])
    covered = np.abs(s - p) <= p * rel
    if rows_csv is not None:
        ids = [i for i in sorted(jobs) if provisional[i][0] is not None]
        pd.DataFrame({"end_s": t, "provisional_j": p, "rel_90": rel, "settled_j": s,
                      "streamed": [bool(records.loc[i, "ttft_s"] < records.loc[i, "latency_s"] - 1e-9) for i in ids],
                      "latency_s": records.loc[ids, "latency_s"].to_numpy(),
                      "completion_tokens": records.loc[ids, "completion_tokens"].to_numpy(),
                      "recorded_j": records.loc[ids, "energy_j"].to_numpy()}).to_csv(rows_csv, index=False)
    ids = [i for i in sorted(jobs) if provisional[i][0] is not None]
    loads = by_load(records.loc[ids, "start_s"].to_numpy(float), records.loc[ids, "end_s"].to_numpy(float),
                    (records.loc[ids, "ttft_s"] < records.loc[ids, "latency_s"] - 1e-9).to_numpy(), p, p * rel, s,
                    records["start_s"].to_numpy(float), records["end_s"].to_numpy(float))
    order = np.argsort(t)
    stretches = []
    for chunk in np.array_split(order, 8):
        stretches.append({"from_s": round(float(t[chunk].min() - t.min()), 1), "to_s": round(float(t[chunk].max() - t.min()), 1),
                          "requests": int(chunk.size), "coverage_pct": round(100 * float(covered[chunk].mean()), 1),
                          "sum_ratio_minus_1_pct": round(100 * (p[chunk].sum() / s[chunk].sum() - 1), 2),
                          "median_band_pct": round(100 * float(np.median(rel[chunk])), 1)})
    by_source = {k: {"requests": int(n), "coverage_pct": round(100 * float(covered[src == k].mean()), 1),
                     "sum_ratio_minus_1_pct": round(100 * (p[src == k].sum() / s[src == k].sum() - 1), 2)}
                 for k, n in zip(*np.unique(src, return_counts=True))}
    # fairness of the settled split: requests of one phase (10 s of the session), one kind (streamed or plain) and
    # equal output tokens, in flight beside others (latency > 0.2 s), as a pooled CV of their settled energy
    ids = [i for i in sorted(jobs) if provisional[i][0] is not None]
    frame = pd.DataFrame({"settled": s, "phase": ((t - t.min()) // 10).astype(int),
                          "streamed": (records.loc[ids, "ttft_s"] < records.loc[ids, "latency_s"] - 1e-9).to_numpy(),
                          "tokens": records.loc[ids, "completion_tokens"].to_numpy(),
                          "latency": records.loc[ids, "latency_s"].to_numpy()})
    groups = [g["settled"] / g["settled"].mean() - 1 for _, g in
              frame[frame["latency"] > 0.2].groupby(["phase", "streamed", "tokens"]) if len(g) >= 4]
    dof = sum(len(g) - 1 for g in groups)
    fairness = {"groups": len(groups), "pooled_cv_pct": round(100 * float(np.sqrt(sum((g ** 2).sum() for g in groups) / dof)), 1)
                if dof else None, "max_dev_pct": round(100 * float(max(g.abs().max() for g in groups)), 1) if groups else None}
    return {"folder": str(folder), "split": split, "sensor_delay_s": sensor_delay_s, "period_s": meter.period_s,
            "power_lag_s": power_lag_s, "by_source": by_source, "by_load": loads, "settled_fairness": fairness,
            "requests": len(jobs),
            "with_provisional": int(len(p)), "coverage_pct": round(100 * float(covered.mean()), 2),
            "sum_ratio_minus_1_pct": round(100 * (p.sum() / s.sum() - 1), 3),
            "median_abs_error_pct": round(100 * float(np.median(np.abs(s / p - 1))), 2),
            "median_band_pct": round(100 * float(np.median(rel)), 2), "stretches": stretches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a run folder of ipw serve with records.parquet and power.parquet")
    ap.add_argument("--sensor-delay-s", type=float, default=0.15)
    ap.add_argument("--split", default="priced", choices=("priced", "local"))
    ap.add_argument("--period-s", type=float, help="accounting periods of this length (default: ipw serve's)")
    ap.add_argument("--power-lag-s", type=float, default=0.25)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rows", type=Path, help="each request's provisional and settled energy, as CSV")
    args = ap.parse_args()
    result = replay(args.folder, args.sensor_delay_s, args.split, args.period_s, args.rows, args.power_lag_s)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
