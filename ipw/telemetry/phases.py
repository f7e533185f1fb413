"""Prefill and decode energy per query (docs/ARCHITECTURE.md, 'Energy readings and the metric contract'; docs/ARCHITECTURE.md, 'Energy method'): each sensor's split of a window at the first
token, and the record's phase fields.

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
- RAPL reads its counters at the window's edges and a :class:`Snapshots` thread reads them every
  ``SNAPSHOT_PERIOD_S`` (20 ms; longer when a read costs more than 1% of a core) while a window is open;
  the CPU model reads its CPU time only on its own thread (:class:`Counters`: just after each edge and
  every ``SNAPSHOT_PERIOD_S`` inside a window; the edges interpolated).  The counter is interpolated
  linearly at the first token.  For this process the CPU model reads its CPU clock (ns), else /proc times.
  Uncertainty: the counter's increase over the snapshot interval around the cut (the true value lies
  inside it: the counter only grows), plus, for /proc times, one CPU-time tick (10 ms) per process.  A prefill with no snapshot inside it is flagged
  unresolved.  The split of the CPU model is ``estimated``; of RAPL ``measured_interpolated``.

A record without a first token (an error, zero tokens), from concurrent requests, or with a part of
its total that no sensor can split (an API estimate, NVML counter edges only) has no phases (None).

The reading threads are ``ipw.telemetry.snapshots``; J per token and the fitted energy model per backend
are analysis (``ipw.analysis.fit``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ipw.telemetry.base import EnergyReading, SensorBase, energy_basis, joules, worst_quality
from ipw.telemetry.snapshots import Trace


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


# --- cutting a counter series at the first token --------------------------------------------------

def split_series(t_s: Sequence[float], values: Sequence[float] | np.ndarray, at_s: float,
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
    return split_sampled_many(sensor, [(part, at_s)])[0]


def split_sampled_many(sensor: Any, windows: Sequence[tuple[Any, float]]) -> list[list[PhaseSplit]]:
    """``split_sampled`` of many (part, first token) at once: one ``energy_windows`` call (one
    calibration) for all their sub-windows, as a run's record writer makes a batch of records final."""
    cuts = []
    for part, at_s in windows:
        start, end = float(part.start_s), float(part.end_s)
        cuts.append((start, min(max(float(at_s), start), end), end))
    estimates = sensor.energy_windows([w for start, at, end in cuts for w in ((start, at), (at, end))])
    outs: list[list[PhaseSplit]] = []
    for k, (start, at, end) in enumerate(cuts):
        out = []
        for component, ests in estimates.items():
            pre, dec = ests[2 * k], ests[2 * k + 1]
            if pre.energy_j is None or dec.energy_j is None or "unavailable" in (pre.quality, dec.quality):
                continue
            a, b = max(0.0, float(pre.energy_j)), max(0.0, float(dec.energy_j))
            whole = a + b
            fraction = a / whole if whole > 0 else ((at - start) / (end - start) if end > start else 0.0)
            # the cut's own error (the prefill window's end edge) where the estimator states it; a whole
            # window's interval also holds its calibration, which moves both phases alike
            cut_j = pre.edges_j[1] if pre.edges_j is not None else 0.5 * (pre.uncertainty_j or 0.0)
            bound = min(1.0, cut_j / whole) if whole > 0 else 0.0
            note = f"{pre.source} integrated over both phases (prefill {1000 * (at - start):.0f} ms, ±{bound:.1%})"
            if pre.short_window:
                note += "; prefill shorter than the 0.15 s NVML signals resolve"
            out.append(PhaseSplit(component, fraction, bound, bool(pre.short_window),
                                  worst_quality([pre.quality, dec.quality]), note))
        outs.append(out)
    return outs


def first_token_s(completion: Any) -> float | None:
    """Where a completion's window is cut: its first token; None without one (no phases)."""
    if completion is None or not completion.completion_tokens:
        return None
    first: float | None = completion.first_token_s
    return first


def sensor_splits(sensors: Sequence[SensorBase], tokens: Sequence[Any], parts: Sequence[Any],
                  at_s: float | None) -> dict[str, PhaseSplit]:
    """Each component's split at ``at_s`` (the first token), from sensors that declare they can split:
    ``supports_split`` (their ``split(token, at_s)``), else ``supports_energy_windows`` (sample-based:
    both sub-windows of ``part``, what ``end`` returned, integrated).  Never raises."""
    return sensor_splits_many(sensors, [(tokens, parts, at_s)])[0]


def sensor_splits_many(sensors: Sequence[SensorBase],
                       windows: Sequence[tuple[Sequence[Any], Sequence[Any], float | None]]) -> list[dict[str, PhaseSplit]]:
    """``sensor_splits`` of many windows (each: its tokens, its closed parts, its first token), with one
    ``energy_windows`` call per sample-based sensor for all of them.  Never raises."""
    outs: list[dict[str, PhaseSplit]] = [{} for _ in windows]
    todo = [(i, at_s) for i, (_, _, at_s) in enumerate(windows) if at_s is not None]
    for k, sensor in enumerate(sensors):
        if sensor.supports_split:
            for i, at_s in todo:
                tokens = windows[i][0]
                try:
                    outs[i].update({s.component: s for s in sensor.split(tokens[k], at_s)})
                except Exception:  # a failed split leaves the record without phases, never without its record
                    continue
        elif sensor.supports_energy_windows and todo:
            try:
                many = split_sampled_many(sensor, [(windows[i][1][k], at_s) for i, at_s in todo])
            except Exception:
                continue
            for (i, _), splits in zip(todo, many):
                outs[i].update({s.component: s for s in splits})
    return outs


def record_phases(readings: list[EnergyReading], splits: dict[str, PhaseSplit]) -> dict[str, Any]:
    """The record's phase fields: the split of exactly the readings its ``energy_j`` sums."""
    basis = energy_basis(readings)
    if not basis or not splits:
        return dict(NO_PHASES)
    missing = [r.component for r in basis if r.component not in splits]
    if missing:
        return {**NO_PHASES, "phase_note": f"no phase split for {', '.join(missing)}"}
    energies = joules(basis)  # every reading of the basis has its energy
    total = sum(energies)  # the same sum as total_energy
    used = [splits[r.component] for r in basis]
    prefill = sum(s.prefill_fraction * e for s, e in zip(used, energies))
    prefill = min(max(prefill, 0.0), total)
    return {
        "prefill_energy_j": prefill,
        "decode_energy_j": total - prefill,
        "prefill_uncertainty_j": sum(s.uncertainty_fraction * e for s, e in zip(used, energies)),
        "phase_quality": worst_quality([s.quality for s in used]),
        "prefill_unresolved": any(s.unresolved for s in used),
        "phase_note": "; ".join(f"{s.component}: {s.note}" for s in used),
    }
