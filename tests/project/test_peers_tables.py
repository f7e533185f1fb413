"""bench/peers/tables.py: table 2's check of its reference (the counter's 100 ms steps, interpolated)."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import numpy as np
import pandas as pd
from conftest import bench_module



def write_run(d: Path, bias: float, seed: int = 3) -> None:
    """A GPU that idles at 120 W between queries of 150 W (60-400 ms, 0.2 s apart), its counter stepping every
    100 ms at a random phase, and a tool that reads each query's true energy times ``1 + bias``."""
    rng = np.random.default_rng(seed)
    starts, ends, t = [], [], 1.0
    for _ in range(160):
        length = rng.uniform(0.06, 0.09) if rng.random() < 0.85 else rng.uniform(0.3, 0.4)
        starts.append(t)
        ends.append(t + length)
        t += length + 0.2
    starts_a, ends_a = np.array(starts), np.array(ends)

    def energy_j(x: np.ndarray) -> np.ndarray:  # the cumulative energy at times x
        busy = np.clip(x[:, None] - starts_a[None, :], 0, (ends_a - starts_a)[None, :]).sum(axis=1)
        return 120.0 * x + 30.0 * busy

    steps = np.arange(0.5 + rng.uniform(0, 0.1), t + 1.0, 0.1)
    mj = np.round(energy_j(steps) * 1000.0).astype(np.int64)
    rows = ["t_before_s,t_after_s,gpu,energy_mj"]
    for k in range(1, len(steps)):
        rows.append(f"{steps[k] - 0.002:.6f},{steps[k] - 0.001:.6f},0,{mj[k - 1]}")
        rows.append(f"{steps[k] + 0.001:.6f},{steps[k] + 0.002:.6f},0,{mj[k]}")
    with gzip.open(d / "counter-steps-queries.csv.gz", "wt") as f:
        f.write("\n".join(rows) + "\n")
    truth = energy_j(ends_a) - energy_j(starts_a)
    pd.DataFrame({"query": range(len(starts)), "kind": ["short" if e - s < 0.2 else "long" for s, e in zip(starts, ends)],
                  "max_tokens": 12, "completion_tokens": 12, "tool": "ipw", "start_s": starts_a, "end_s": ends_a,
                  "energy_j": truth * (1.0 + bias)}).to_csv(d / "queries.csv", index=False)


def sums(text: str, tool: str = "ipw") -> tuple[float, float]:
    m = re.search(rf"\| {tool} \| \d+ \| ([+-][\d.]+)% \| ([+-][\d.]+)% \|", text)
    assert m, text
    return float(m.group(1)), float(m.group(2))


def test_an_exact_tool_reads_high_against_the_interpolated_counter_and_exact_against_the_idle_closure(tmp_path):
    write_run(tmp_path, bias=0.0)
    with bench_module("peers/tables") as tables:
        text = tables.queries(tmp_path)
        closed = tables.idle_closure(tmp_path)
    interpolated, closure = sums(text)
    assert interpolated > 0.3  # the interpolated counter spreads each query's extra 30 W over its steps
    assert abs(closure) <= 0.02  # the idle is flat here: the steps less the idle around are the queries' energy
    assert len(closed) > 100  # most queries are alone in their steps, with idle ones around


def test_a_tool_that_reads_high_by_itself_is_high_against_both(tmp_path):
    write_run(tmp_path, bias=0.01)
    with bench_module("peers/tables") as tables:
        interpolated, closure = sums(tables.bounds(tmp_path))
    assert interpolated > 1.3 and 0.98 <= closure <= 1.02


def test_the_queries_stage_keeps_ipws_own_points_beside_the_counter(tmp_path):
    """bench/peers/peers.py writes the monitor's points (``ipw.Monitor.trace``) as gzipped CSV."""
    import types

    trace = {"t_s": [1.0, 1.02, 1.1], "device": ["gpu0"] * 3, "power_w": [120.0, 151.5, float("nan")],
             "kind": ["sample", "sample", "counter"], "energy_j": [float("nan"), float("nan"), 5000.25]}
    with bench_module("peers/peers") as peers:
        tool = peers.Ipw.__new__(peers.Ipw)
    tool.monitor = types.SimpleNamespace(trace=lambda: trace)  # ipw.Monitor.trace: tests/commands/test_api_monitor.py
    tool.write_samples(tmp_path / "ipw-samples-queries.csv.gz")
    back = pd.read_csv(tmp_path / "ipw-samples-queries.csv.gz")
    assert list(back.columns) == ["t_s", "device", "power_w", "kind", "energy_j"]
    assert back["power_w"].iloc[1] == 151.5 and back["energy_j"].iloc[2] == 5000.25 and list(back["kind"]) == [
        "sample", "sample", "counter"]
