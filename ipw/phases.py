"""Prefill and decode energy per query, and a fitted energy model per backend (DESIGN.md §2-3).

A query's window is cut at its first token: **prefill** is window start -> first token (reading the
prompt), **decode** is first token -> window end (writing the answer).  Each sensor says which
fraction of each component's window energy falls before the cut (a :class:`PhaseSplit`); the record's
``prefill_energy_j`` is that fraction of the very readings that make its ``energy_j``, and
``decode_energy_j`` is the rest, so the two always sum to the total.

How each sensor splits a window:

- NVML samples (``NvmlSensor``): the sampler integrates the two sub-windows after the fact
  (``energy_windows``); the parts are scaled to the window's reading.  Uncertainty: half a sample
  period times the peak power (the cut is one interpolated edge).  A prefill shorter than the
  estimator's ``SHORT_WINDOW_S`` (0.15 s) is flagged unresolved, as any window that short is.
- RAPL and the CPU model read counters only at the window's edges, so a :class:`Snapshots` thread
  also reads them every ``SNAPSHOT_PERIOD_S`` (20 ms; longer when a read costs more than 1% of a core)
  while a window is open, and the counter is interpolated linearly at the first token.  For an
  in-process engine the CPU model's snapshots read the process CPU clock (ns), else /proc times.
  Uncertainty: the counter's increase over the snapshot interval around the cut (the true value lies
  inside it: the counter only grows), plus, for /proc times, one CPU-time tick (10 ms) per process.  A prefill with no snapshot inside it is flagged
  unresolved.  The split of the CPU model is ``estimated``; of RAPL ``measured_interpolated``.

A record without a first token (an error, zero tokens), from concurrent requests, or with a part of
its total that no sensor can split (an API estimate, NVML counter edges only) has no phases (None).

Per backend: J per prefill token (sum of prefill J / sum of prompt tokens), J per decode token (sum of
decode J / sum of completion tokens), and an OLS fit ``y ~ a + b*prompt_tokens + c*completion_tokens``
for energy and latency, with classical standard errors (t quantiles) and R^2 (:func:`fit_linear`).
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ipw.analysis.stats import Estimate
from ipw.telemetry.base import EnergyReading, SensorBase, energy_basis, worst_quality

#: How often RAPL and the CPU model are read while a window is open (at most: see SNAPSHOT_CPU_BUDGET).
SNAPSHOT_PERIOD_S = 0.02
#: The snapshot thread's share of one core: reads that cost more (a large process tree) are spaced out.
SNAPSHOT_CPU_BUDGET = 0.01
#: Linux reports process CPU time in clock ticks.
CPU_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


@dataclass(frozen=True)
class PhaseSplit:
    """Which share of one component's window energy is prefill (before the first token)."""

    component: str
    prefill_fraction: float
    uncertainty_fraction: float  # ± bound on prefill_fraction (energy that may belong to the other phase)
    unresolved: bool  # the prefill window is shorter than the sensor can resolve
    quality: str
    note: str = ""


NO_PHASES: dict[str, Any] = {"prefill_energy_j": None, "decode_energy_j": None, "prefill_uncertainty_j": None,
                             "phase_quality": "", "prefill_unresolved": None, "phase_note": ""}


# --- snapshots of counters while a window is open ---------------------------------------------------

class Trace:
    """One window's snapshots: times (monotonic s) and counter values (a tuple per snapshot)."""

    def __init__(self, read: Callable[[], Sequence[float]], t_s: float, values: Sequence[float],
                 step: float = 0.0) -> None:
        self.read = read
        self.step = step  # the resolution of one read of a value (e.g. CPU-time ticks)
        self.t_s = [t_s]
        self.values = [tuple(values)]
        self.error = ""


class Snapshots:
    """Reads the counters of every open :class:`Trace` every ``period_s`` from one daemon thread, which
    sleeps on an event while no window is open (never busy-waits) and counts its own CPU time.  When a
    round of reads costs more than ``SNAPSHOT_CPU_BUDGET`` of the period, the period grows to fit it."""

    def __init__(self, period_s: float = SNAPSHOT_PERIOD_S, *, threaded: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s = period_s
        self.threaded = threaded
        self._clock = clock
        self._lock = threading.Lock()
        self._open: list[Trace] = []
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._thread_cpu_s = 0.0
        self._cost_s: float | None = None  # CPU seconds of one round of reads (moving average)
        self.interval_s = period_s  # the period in use
        self._active_s = 0.0
        self._active_since: float | None = None
        self.n_snapshots = 0

    def open(self, read: Callable[[], Sequence[float]], t_s: float, values: Sequence[float],
             step: float = 0.0) -> Trace:
        """Start a trace whose first snapshot (``t_s``, ``values``) the caller took at window begin."""
        trace = Trace(read, t_s, values, step)
        with self._lock:
            if not self._open:
                self._active_since = self._clock()
            self._open.append(trace)
            self._wake.set()
        if self.threaded and self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name="ipw-snapshots", daemon=True)
            self._thread.start()
        return trace

    def close(self, trace: Trace, t_s: float | None = None, values: Sequence[float] | None = None) -> None:
        """End a trace with a last snapshot: the caller's (``t_s``, ``values``), else one read now."""
        with self._lock:
            if trace in self._open:
                self._open.remove(trace)
                if not self._open and self._active_since is not None:
                    self._active_s += self._clock() - self._active_since
                    self._active_since = None
            if values is None:
                self._snap(trace)
            else:
                trace.t_s.append(t_s)
                trace.values.append(tuple(values))

    def _snap(self, trace: Trace) -> None:
        if trace.error:
            return
        t0 = self._clock()
        try:
            values = tuple(trace.read())
        except Exception as exc:  # a vanished process, a counter gone: this window is not split
            trace.error = f"{type(exc).__name__}: {exc}"
            return
        trace.t_s.append((t0 + self._clock()) / 2)
        trace.values.append(values)
        self.n_snapshots += 1

    def snap(self) -> None:
        """One snapshot of every open trace (what the thread does every period)."""
        with self._lock:
            for trace in self._open:
                self._snap(trace)
            if not self._open:
                self._wake.clear()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()  # no window open: sleep
            due = self._clock() + self.period_s
            while not self._stopped:
                time.sleep(max(0.0, due - self._clock()))
                if self._stopped:
                    break
                before = self._thread_cpu_s
                self.snap()
                self._thread_cpu_s = time.thread_time()  # this thread's CPU time so far
                cost = self._thread_cpu_s - before  # the reads, and sleeping and waking up
                self._cost_s = cost if self._cost_s is None else 0.8 * self._cost_s + 0.2 * cost
                self.interval_s = max(self.period_s, self._cost_s / SNAPSHOT_CPU_BUDGET)
                if not self._wake.is_set():
                    break  # the last window closed
                due = max(due + self.interval_s, self._clock())  # a late tick is not repeated

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def overhead(self) -> dict[str, Any]:
        """CPU seconds of the snapshot thread, and as a fraction of one core over the time windows were open."""
        active = self._active_s + (self._clock() - self._active_since if self._active_since is not None else 0.0)
        return {"thread": "ipw-snapshots", "period_s": self.period_s, "interval_s": round(self.interval_s, 4),
                "budget_fraction_of_core": SNAPSHOT_CPU_BUDGET, "snapshots": self.n_snapshots,
                "cpu_s": round(self._thread_cpu_s, 4), "active_s": round(active, 3),
                "fraction_of_core": round(self._thread_cpu_s / active, 5) if active > 0 else None}


def split_series(t_s: Sequence[float], values: Sequence[float], at_s: float,
                 step: float = 0.0) -> tuple[float, float, bool] | None:
    """Cut a cumulative counter series at ``at_s``: (prefill fraction, ± bound on it, unresolved).

    The counter is interpolated linearly between the snapshots around ``at_s``; the bound is its
    increase from the snapshot before to ``at_s`` or from ``at_s`` to the snapshot after, whichever is
    larger, plus ``step`` (the counter's own resolution).  Unresolved: no snapshot inside the prefill.
    None when the series goes down (a process left the tree) or has fewer than two points."""
    t = np.asarray(t_s, dtype=float)
    v = np.asarray(values, dtype=float)
    if t.size < 2 or np.any(np.diff(v) < 0) or np.any(np.diff(t) < 0):
        return None
    at = min(max(float(at_s), t[0]), t[-1])
    unresolved = not bool(np.any((t > t[0]) & (t < at)))
    total = v[-1] - v[0]
    if total <= 0:
        span = t[-1] - t[0]
        return ((at - t[0]) / span if span > 0 else 0.0), 0.0, unresolved
    i = int(np.clip(np.searchsorted(t, at, side="right") - 1, 0, t.size - 2))
    dt = t[i + 1] - t[i]
    x = v[i] + (v[i + 1] - v[i]) * ((at - t[i]) / dt if dt > 0 else 0.0)
    bound = max(x - v[i], v[i + 1] - x) + step
    return float((x - v[0]) / total), float(min(bound / total, 1.0)), unresolved


def split_trace(trace: Trace | None, at_s: float, components: Sequence[str], quality: str, what: str,
                cumulative: Callable[[int, np.ndarray], np.ndarray] | None = None) -> list[PhaseSplit]:
    """One :class:`PhaseSplit` per component (column k of the trace's values; ``cumulative(k, column)``
    turns a wrapping counter into a cumulative one)."""
    if trace is None or trace.error or len(trace.t_s) < 2:
        return []
    columns = np.asarray(trace.values, dtype=float)
    out = []
    for k, component in enumerate(components):
        series = columns[:, k] if cumulative is None else cumulative(k, columns[:, k])
        cut = split_series(trace.t_s, series, at_s, trace.step)
        if cut is None:
            continue
        fraction, bound, unresolved = cut
        periods = np.diff(trace.t_s)
        note = (f"{what} read every {np.median(periods) * 1000:.0f} ms, interpolated at the first token "
                f"(±{bound:.1%} of the window)")
        if unresolved:
            note += "; no snapshot inside the prefill: unresolved"
        out.append(PhaseSplit(component, fraction, bound, unresolved, quality, note))
    return out


# --- sensors -> splits -> record fields -------------------------------------------------------------

def split_sampled(sensor: Any, part: Any, at_s: float) -> list[PhaseSplit]:
    """Split of a sample-based sensor (``NvmlSensor``): integrate both sub-windows with its
    ``energy_windows``; ``part`` is its deferred result (``start_s``/``end_s``), ready by now."""
    start, end = float(part.start_s), float(part.end_s)
    at = min(max(float(at_s), start), end)
    out = []
    for component, (pre, dec) in sensor.energy_windows([(start, at), (at, end)]).items():
        if pre.energy_j is None or dec.energy_j is None or "unavailable" in (pre.quality, dec.quality):
            continue
        a, b = max(0.0, float(pre.energy_j)), max(0.0, float(dec.energy_j))
        whole = a + b
        fraction = a / whole if whole > 0 else ((at - start) / (end - start) if end > start else 0.0)
        bound = min(1.0, 0.5 * (pre.uncertainty_j or 0.0) / whole) if whole > 0 else 0.0
        note = f"{pre.source} integrated over both phases (prefill {1000 * (at - start):.0f} ms, ±{bound:.1%})"
        if pre.short_window:
            note += "; prefill shorter than the 0.15 s NVML signals resolve"
        out.append(PhaseSplit(component, fraction, bound, bool(pre.short_window),
                              worst_quality([pre.quality, dec.quality]), note))
    return out


def first_token_s(completion: Any) -> float | None:
    """Where a completion's window is cut: its first token; None without one (no phases)."""
    if completion is None or not completion.completion_tokens:
        return None
    return completion.first_token_s


def sensor_splits(sensors: Sequence[SensorBase], tokens: Sequence[Any], parts: Sequence[Any],
                  at_s: float | None) -> dict[str, PhaseSplit]:
    """Each component's split at ``at_s`` (the first token), from sensors that declare they can split:
    ``supports_split`` (their ``split(token, at_s)``), else ``supports_energy_windows`` (sample-based:
    both sub-windows of ``part``, what ``end`` returned, integrated).  Never raises."""
    if at_s is None:
        return {}
    out: dict[str, PhaseSplit] = {}
    for sensor, token, part in zip(sensors, tokens, parts):
        try:
            if sensor.supports_split:
                splits = sensor.split(token, at_s)
            elif sensor.supports_energy_windows:
                splits = split_sampled(sensor, part, at_s)
            else:
                continue
        except Exception:  # a failed split leaves the record without phases, never without its record
            continue
        out.update({s.component: s for s in splits})
    return out


def record_phases(readings: list[EnergyReading], splits: dict[str, PhaseSplit]) -> dict[str, Any]:
    """The record's phase fields: the split of exactly the readings its ``energy_j`` sums."""
    basis = energy_basis(readings)
    if not basis or not splits:
        return dict(NO_PHASES)
    missing = [r.component for r in basis if r.component not in splits]
    if missing:
        return {**NO_PHASES, "phase_note": f"no phase split for {', '.join(missing)}"}
    total = sum(r.energy_j for r in basis)  # type: ignore[misc]  # the same sum as total_energy
    prefill = sum(splits[r.component].prefill_fraction * r.energy_j for r in basis)  # type: ignore[operator]
    prefill = min(max(prefill, 0.0), total)
    used = [splits[r.component] for r in basis]
    return {
        "prefill_energy_j": prefill,
        "decode_energy_j": total - prefill,
        "prefill_uncertainty_j": sum(s.uncertainty_fraction * r.energy_j for s, r in zip(used, basis)),
        "phase_quality": worst_quality([s.quality for s in used]),
        "prefill_unresolved": any(s.unresolved for s in used),
        "phase_note": "; ".join(f"{s.component}: {s.note}" for s in used),
    }


# --- per backend: J per token and the fitted model --------------------------------------------------

def t_quantile(p: float, df: int) -> float:
    """Quantile of Student's t (numeric integration of its density and bisection; no scipy)."""
    if df <= 0:
        return float("nan")
    if p == 0.5:
        return 0.0
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:  # for x > 0: 0.5 + integral of the density from 0 to x (Simpson)
        grid = np.linspace(0.0, x, 4001)
        f = np.exp(log_c - (df + 1) / 2 * np.log1p(grid ** 2 / df))
        h = x / 4000
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())

    q = max(p, 1 - p)
    lo, hi = 0.0, 1.0
    while cdf(hi) < q:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
    x = (lo + hi) / 2
    return x if p > 0.5 else -x


@dataclass(frozen=True)
class LinearFit:
    """``y ~ a + b*prompt_tokens + c*completion_tokens`` by ordinary least squares; CIs from the
    classical standard errors (t quantiles with n - 3 degrees of freedom)."""

    intercept: Estimate  # a, in y's unit
    per_prompt_token: Estimate  # b
    per_completion_token: Estimate  # c
    r2: float
    n: int
    residual_std: float
    note: str = ""


_NAN = Estimate(float("nan"), float("nan"), float("nan"))


def fit_linear(prompt_tokens, completion_tokens, y, level: float = 0.95) -> LinearFit:
    """Fit over the rows where all three are finite.  With fewer than 4 rows, or prompt and output
    lengths that do not vary independently (e.g. every prompt as long), no coefficient is reported."""
    p, k, y = (np.asarray(x, dtype=float) for x in (prompt_tokens, completion_tokens, y))
    ok = np.isfinite(p) & np.isfinite(k) & np.isfinite(y)
    p, k, y = p[ok], k[ok], y[ok]
    n = int(y.size)
    x = np.column_stack([np.ones(n), p, k])
    if n < 4 or np.linalg.matrix_rank(x) < 3:
        why = (f"{n} rows: needs at least 4" if n < 4
               else "prompt and output lengths do not vary independently: a mix of prompt and answer lengths is needed")
        return LinearFit(_NAN, _NAN, _NAN, float("nan"), n, float("nan"), note=why)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ coef
    df = n - 3
    sigma2 = float(resid @ resid) / df
    se = np.sqrt(np.diag(np.linalg.inv(x.T @ x)) * sigma2)
    t = t_quantile(0.5 + level / 2, df)
    sst = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float(resid @ resid) / sst if sst > 0 else float("nan")
    est = [Estimate(float(c), float(c - t * s), float(c + t * s)) for c, s in zip(coef, se)]
    return LinearFit(est[0], est[1], est[2], r2, n, math.sqrt(sigma2))


def fit_dict(f: LinearFit) -> dict[str, Any]:
    """JSON form: each coefficient as {value, lo, hi} (None where not finite)."""
    def num(x: float) -> float | None:
        return float(x) if math.isfinite(x) else None

    def est(e: Estimate) -> dict:
        return {"value": num(e.value), "lo": num(e.lo), "hi": num(e.hi)}

    return {"intercept": est(f.intercept), "per_prompt_token": est(f.per_prompt_token),
            "per_completion_token": est(f.per_completion_token), "r2": num(f.r2), "n": f.n,
            "residual_std": num(f.residual_std), "note": f.note}
