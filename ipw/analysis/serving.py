"""Serving under load: the levels of a concurrency sweep side by side, and the energy-optimal level
under a latency deadline. Pure functions over ``ipw.analysis.load``'s backends (one per level, see
``load.level_label``) and the metric table's estimates; the numbers themselves are metrics of
``ipw.analysis.metrics`` (J/query, J/output token, output tokens/s, latency and TTFT quantiles,
accuracy), never computed again here.

A level's **steady window** (``steady_windows``) is the one figure computed here from the records
themselves: the interval in which the level's concurrency was in flight, from the first instant it was
reached to the last instant the count fell below it (docs/SERVING.md, "Steady state"). Its J/output token,
J/query and output tokens/s count each record by the share of its time inside the window.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ipw.analysis.load import BackendInfo, RunInfo, _floats, concurrency_of
from ipw.analysis.stats import NAN, Estimate, bootstrap_draws, interval
from ipw.errors import ParameterError

# the serving table's metrics (keys of ipw.analysis.metrics), in its column order
SERVING_METRICS = ("energy_per_query_j", "j_per_output_token", "output_tokens_per_s", "latency_p50_s",
                   "latency_p95_s", "ttft_p50_s", "ttft_p95_s", "accuracy")
# --deadline METRIC -> the metric it bounds
DEADLINE_METRICS = {"p50_latency": "latency_p50_s", "p95_latency": "latency_p95_s", "p50_ttft": "ttft_p50_s",
                    "p95_ttft": "ttft_p95_s"}
DEADLINE_FORMS = (f"METRIC=VALUE with METRIC one of {', '.join(DEADLINE_METRICS)} and VALUE a time like 2s or 500ms, "
                  "e.g. --deadline p95_latency=2s")
_SECONDS = {"s": 1.0, "ms": 1e-3}


@dataclass(frozen=True)
class Deadline:
    metric: str  # as given: p50_latency | p95_latency | p50_ttft | p95_ttft
    limit_s: float

    @property
    def key(self) -> str:
        """The metric table's key of the bounded metric."""
        return DEADLINE_METRICS[self.metric]

    @property
    def text(self) -> str:
        return f"{self.metric.replace('_', ' ')} ≤ {self.limit_s:g} s"


def parse_deadline(text: str) -> Deadline:
    """``METRIC=VALUE`` (``p95_latency=2s``, ``p50_ttft=500ms``); a ParameterError names the accepted forms."""
    m = re.fullmatch(r"\s*([a-z0-9_]+)\s*=\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(ms|s)\s*", text)
    if not m or m.group(1) not in DEADLINE_METRICS:
        raise ParameterError(("deadline",), f" {text!r}: expected {DEADLINE_FORMS}")
    limit = float(m.group(2)) * _SECONDS[m.group(3)]
    if not (math.isfinite(limit) and limit > 0):
        raise ParameterError(("deadline",), f" {text!r}: the time must be above 0 ({DEADLINE_FORMS})")
    return Deadline(m.group(1), limit)


def shown(backends: Sequence[BackendInfo]) -> bool:
    """Whether the serving table says anything: some backend ran above one request at a time (a backend
    at several levels has one above 1)."""
    return any(b.concurrency > 1 for b in backends)


def by_backend(backends: Sequence[BackendInfo]) -> dict[tuple[str, str], list[BackendInfo]]:
    """Each backend (run_id, name) with its levels, in ascending concurrency."""
    out: dict[tuple[str, str], list[BackendInfo]] = {}
    for b in backends:
        out.setdefault((b.run_id, b.backend), []).append(b)
    return {k: sorted(v, key=lambda b: b.concurrency) for k, v in out.items()}


def serving_level(levels: Sequence[BackendInfo]) -> BackendInfo:
    """The level a server would run at: the highest concurrency measured."""
    return max(levels, key=lambda b: b.concurrency)


@dataclass(frozen=True)
class LevelPick:
    """One backend's energy-optimal level under a deadline."""

    run_id: str
    backend: str
    levels: tuple[str, ...]  # its levels' labels, ascending concurrency
    meeting: tuple[str, ...]  # the levels whose deadline metric is within the limit
    chosen: str | None  # the meeting level with the lowest J/query (None: no level meets the deadline)
    concurrency: int | None
    energy_per_query_j: float | None  # the chosen level's J/query: its steady window's where it has one
    value_s: float | None  # the chosen level's deadline metric
    steady: bool = False  # energy_per_query_j (and the ranking of that level) is its steady window's


def pick_levels(backends: Sequence[BackendInfo], point: Mapping[str, Mapping[str, float]],
                deadline: Deadline, steady: Mapping[str, "SteadyLevel | None"] | None = None) -> tuple[LevelPick, ...]:
    """Per backend: among its levels whose ``deadline`` metric (point value) is within the limit, the one
    with the lowest J/query (a level without energy ranks last). ``point``: label -> metric -> value.
    ``steady``: label -> its steady window (``steady_windows``); a level that has one is ranked by the
    window's J/query, one without (a level of 1, too few records) by its whole-level J/query."""
    steady = steady or {}

    def energy(label: str) -> tuple[float, bool]:
        window = steady.get(label)
        if window is not None and math.isfinite(window.energy_per_query_j.value):
            return window.energy_per_query_j.value, True
        return point[label]["energy_per_query_j"], False

    out = []
    for (run_id, name), levels in by_backend(backends).items():
        meeting = [b for b in levels if point[b.label][deadline.key] <= deadline.limit_s]  # NaN never meets
        best = min(meeting, key=lambda b: _energy_rank(energy(b.label)[0]), default=None)
        e, from_window = (math.nan, False) if best is None else energy(best.label)
        out.append(LevelPick(
            run_id, name, tuple(b.label for b in levels), tuple(b.label for b in meeting),
            None if best is None else best.label, None if best is None else best.concurrency,
            _finite(e), None if best is None else _finite(point[best.label][deadline.key]), from_window))
    return tuple(out)


def _energy_rank(x: float) -> float:
    return x if math.isfinite(x) else math.inf


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


# --- the steady window of a level ----------------------------------------------------------------------

# the steady window's figures (fields of SteadyLevel, named as the metrics they restate), in the table's order
STEADY_METRICS = ("energy_per_query_j", "j_per_output_token", "output_tokens_per_s")

@dataclass(frozen=True)
class SteadyLevel:
    """One level's figures over its steady window: the interval in which ``concurrency`` requests were in
    flight, from the first instant the count reached it to the last instant it fell below it (the dips to
    one fewer between a request's end and the next one's start are inside). Each record counts by the share
    of its time inside the window (its energy and tokens are taken as spread evenly over its time). CIs:
    a bootstrap over the level's repeats (``--repeats``), NaN with one repeat."""

    window_s: float  # the window's length
    span_s: float  # the level's wall span (its first start to its last end)
    records_in_window: float  # Σ over records of the share of each one's time inside the window
    repeats: int
    j_per_output_token: Estimate
    energy_per_query_j: Estimate  # Σ energy share / Σ record share: a record half inside counts half
    output_tokens_per_s: Estimate  # output tokens inside over the window's length

    @property
    def share(self) -> float:
        """The window's share of the level's wall span."""
        return self.window_s / self.span_s if self.span_s > 0 else math.nan


def steady_window(start_s: np.ndarray, end_s: np.ndarray, concurrency: int) -> tuple[float, float] | None:
    """The level's steady window ``(from_s, to_s)``, or None: a level of 1 (no ramp-up nor drain to leave
    out), a count that never reached ``concurrency``, or no request started while it was held (at most
    ``concurrency`` records: the window would be the first wave alone)."""
    if concurrency <= 1 or len(start_s) <= concurrency:
        return None
    times = np.concatenate([start_s, end_s])
    steps = np.concatenate([np.ones(len(start_s), np.int64), -np.ones(len(end_s), np.int64)])
    order = np.lexsort((steps, times))  # at one instant ends before starts: a slot freed, then refilled
    times, steps = times[order], steps[order]
    flight = np.cumsum(steps)
    reached = np.flatnonzero(flight >= concurrency)
    if len(reached) == 0:
        return None
    left = np.flatnonzero((flight < concurrency) & (np.concatenate([[0], flight[:-1]]) >= concurrency))
    from_s, to_s = float(times[reached[0]]), float(times[left[-1]])
    return (from_s, to_s) if to_s > from_s else None


def steady_level(start_s: np.ndarray, end_s: np.ndarray, tokens: np.ndarray, energy_j: np.ndarray,
                 repeat: np.ndarray, concurrency: int, *, n_boot: int, seed: int = 0) -> SteadyLevel | None:
    """One level's ``SteadyLevel`` from its records (arrays, one item a record; NaN energy: a record without
    energy, left out of the energy figures; NaN tokens count 0), or None without a steady window."""
    ok = np.isfinite(start_s) & np.isfinite(end_s)
    start_s, end_s, tokens, energy_j, repeat = start_s[ok], end_s[ok], tokens[ok], energy_j[ok], repeat[ok]
    window = steady_window(start_s, end_s, concurrency)
    if window is None:
        return None
    from_s, to_s = window
    duration = end_s - start_s
    inside = np.clip(np.minimum(end_s, to_s) - np.maximum(start_s, from_s), 0.0, None)
    share = np.where(duration > 0, inside / np.where(duration > 0, duration, 1.0),
                     ((start_s >= from_s) & (start_s <= to_s)).astype(float))  # a zero-length record: in or out
    tokens = np.nan_to_num(tokens)
    has_e = np.isfinite(energy_j)
    # the figures are ratios of sums over records; per repeat, those sums are the bootstrap's items
    reps, code = np.unique(repeat, return_inverse=True)
    wall = np.zeros(len(share))  # each record's part of the window's length, by its time inside
    if inside.sum() > 0:
        wall = (to_s - from_s) * inside / inside.sum()
    columns = [np.bincount(code, x, len(reps)) for x in (
        np.where(has_e, np.nan_to_num(energy_j) * share, 0.0), np.where(has_e, tokens * share, 0.0),
        np.where(has_e, share, 0.0), tokens * share, wall)]
    point = [float(c.sum()) for c in columns]

    def ratio(num: Any, den: Any) -> Any:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(np.asarray(den) > 0, np.asarray(num, float) / np.where(np.asarray(den) > 0, den, 1), np.nan)

    pairs = ((0, 1), (0, 2), (3, 4))  # J/output token, J/query, output tokens/s
    values = [float(ratio(point[a], point[b])) for a, b in pairs]
    if len(reps) > 1:
        draws = bootstrap_draws(columns, n_boot=n_boot, seed=seed).sums
        estimates = [interval(v, ratio(draws[:, a], draws[:, b])) for v, (a, b) in zip(values, pairs)]
    else:
        estimates = [Estimate(v, math.nan, math.nan) if math.isfinite(v) else NAN for v in values]
    return SteadyLevel(to_s - from_s, float(end_s.max() - start_s.min()), float(share.sum()), len(reps), *estimates)


def steady_windows(runs: Sequence[RunInfo], backends: Sequence[BackendInfo], *, n_boot: int, seed: int = 0,
                   energy_basis: str = "chip") -> dict[str, SteadyLevel | None]:
    """Each level's steady window (label -> ``SteadyLevel``, None without one), from its run's records (read
    again here: the per-query matrix averages repeats and holds no times). Energy on ``energy_basis``: chip,
    or facility (× the backend's PUE); node: none (its readings are not split per record)."""
    from ipw.results import load_run

    out: dict[str, SteadyLevel | None] = {b.label: None for b in backends}
    wanted = [b for b in backends if b.concurrency > 1]
    if not wanted or energy_basis == "node":
        return out
    for run in runs:
        mine = [b for b in wanted if b.run_id == run.run_id]
        if not mine:
            continue
        _, frame = load_run(run.path, columns=["backend", "concurrency", "repeat", "start_s", "end_s",
                                               "completion_tokens", "energy_j", "node"])
        if frame["node"].astype(object).dropna().nunique() > 1:  # monotonic clocks of several machines
            continue
        levels = concurrency_of(frame["concurrency"])
        names = frame["backend"].astype(object).to_numpy()
        for b in mine:
            rows = (names == b.backend) & (levels == b.concurrency)
            level = frame[rows]
            pue = b.pue if energy_basis == "facility" else 1.0
            out[b.label] = steady_level(
                _floats(level["start_s"]), _floats(level["end_s"]), _floats(level["completion_tokens"]),
                _floats(level["energy_j"]) * pue, np.nan_to_num(_floats(level["repeat"])).astype(np.int64),
                b.concurrency, n_boot=n_boot, seed=seed)
    return out
