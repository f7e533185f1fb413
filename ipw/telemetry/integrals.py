"""The two NVML power signals as integrals over time: sampled power (piecewise linear) and the stepping
energy counter, plus the conversion of driver timestamps to the monotonic clock.  Pure numpy, no NVML
calls; the window estimator (:mod:`ipw.telemetry.estimator`), the counter's grid and checks
(:mod:`ipw.telemetry.energy_counter`) and the error model (:mod:`ipw.telemetry.error_model`) evaluate them.

The counter is read as a step function whose value changes at discrete times.  Each change is placed
halfway between the last read that still showed the old value and the first read showing the new one
(a "knot"); energy between knots is interpolated linearly.  A value lower than the previous one
(the counter went backwards: driver reset, VM migration) is a gap: the energy across it is unknown,
never negative, and shows up as coverage < 1.
"""

from __future__ import annotations

import math
from typing import TypeGuard

import numpy as np

#: Consecutive driver samples further apart than this are a gap (the samples are ~20 ms apart and
#: the driver buffer holds ~2.4 s; a gap means the sampler polled too late and lost samples).
MAX_SAMPLE_GAP_S = 0.25
#: Instant-power points update about every 100 ms; further apart than this is a gap.
MAX_INSTANT_GAP_S = 0.5


def given(x: np.ndarray | None) -> TypeGuard[np.ndarray]:
    """Whether a signal was given and holds at least one value."""
    return x is not None and np.asarray(x).size > 0


# --------------------------------------------------------------------------------------------------
# clocks


def wall_us_to_mono_s(
    wall_us: np.ndarray, pair_mono_ns: np.ndarray, pair_wall_us: np.ndarray, *, smooth_pairs: int = 9
) -> np.ndarray:
    """Convert driver wall-clock timestamps (µs) to monotonic seconds.

    ``pair_mono_ns``/``pair_wall_us`` are (``time.monotonic_ns()``, wall-clock µs) observations taken
    back to back by the sampler, ideally near the timestamps being converted.  The offset
    ``mono - wall`` drifts slowly (NTP slew) and a pair is occasionally torn by preemption between the
    two clock reads (hundreds of µs off), so each pair's offset is replaced by the median of its
    ``smooth_pairs`` neighbours and the offset is interpolated linearly in time (held constant
    outside the pairs).  Integer arithmetic keeps nanosecond precision (offsets are ~1.8e18 ns).
    """
    wall_us = np.asarray(wall_us, dtype=np.int64)
    pm = np.asarray(pair_mono_ns, dtype=np.int64)
    pw = np.asarray(pair_wall_us, dtype=np.int64)
    if pm.size == 0 or pm.shape != pw.shape:
        raise ValueError("need at least one (monotonic ns, wall µs) pair, in arrays of equal length")
    order = np.argsort(pw, kind="stable")  # the offset is interpolated as a function of wall time
    pm, pw = pm[order], pw[order]
    offset_ns = pm - pw * 1000
    base_ns = int(np.median(offset_ns))
    resid = (offset_ns - base_ns).astype(np.float64)  # small: safe as float
    k = max(1, min(int(smooth_pairs), resid.size))
    if k > 1:
        half = k // 2
        padded = np.pad(resid, (half, k - 1 - half), mode="edge")
        resid = np.median(np.lib.stride_tricks.sliding_window_view(padded, k), axis=1)
    pair_wall_ns_rel = ((pw - pw[0]) * 1000).astype(np.float64)
    x_rel = ((wall_us - pw[0]) * 1000).astype(np.float64)
    resid_at = np.rint(np.interp(x_rel, pair_wall_ns_rel, resid)).astype(np.int64)
    mono_ns = wall_us * 1000 + base_ns + resid_at
    return np.asarray(mono_ns / 1e9)  # (an array already: asarray only types it)


# --------------------------------------------------------------------------------------------------
# sampled power: cumulative trapezoid with linear interpolation inside intervals


def clean_series(t_s: np.ndarray, v: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(t_s, dtype=np.float64).ravel()
    x = np.asarray(v, dtype=np.float64).ravel()
    if t.shape != x.shape:
        raise ValueError(f"{what}: times and values differ in length ({t.size} vs {x.size})")
    ok = np.isfinite(t) & np.isfinite(x)
    t, x = t[ok], x[ok]
    if t.size > 1 and np.any(np.diff(t) < 0):
        order = np.argsort(t, kind="stable")
        t, x = t[order], x[order]
    if t.size > 1:  # a repeated timestamp is the same sample seen twice (sample-buffer polls overlap)
        keep = np.concatenate(([True], np.diff(t) > 0))
        t, x = t[keep], x[keep]
    return t, x


class _Cumulative:
    """Cumulative energy and covered time of a series with knots ``t`` (``cum_e`` and ``cum_c`` at each knot,
    ``valid`` per segment: an invalid one is a gap, neither energy nor covered time), evaluated anywhere;
    a subclass says how the energy grows inside a segment (``_inside``)."""

    t: np.ndarray
    valid: np.ndarray
    cum_e: np.ndarray
    cum_c: np.ndarray

    @property
    def empty(self) -> bool:
        return self.t.size < 2

    def _inside(self, i: np.ndarray, dx: np.ndarray) -> np.ndarray:
        """The energy from knot ``i`` to ``dx`` seconds after it, within its segment."""
        raise NotImplementedError

    def at(self, x_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(energy J, covered s) accumulated from the first point up to each time in ``x_s``."""
        x = np.atleast_1d(np.asarray(x_s, dtype=np.float64))
        if self.empty:
            return np.zeros_like(x), np.zeros_like(x)
        xc = np.clip(x, self.t[0], self.t[-1])
        i = np.clip(np.searchsorted(self.t, xc, side="right") - 1, 0, self.t.size - 2)
        dx = xc - self.t[i]
        ok = self.valid[i]
        return self.cum_e[i] + np.where(ok, self._inside(i, dx), 0.0), self.cum_c[i] + np.where(ok, dx, 0.0)

    def window(self, start_s: float, end_s: float) -> tuple[float, float]:
        """(energy J, coverage fraction) over one window."""
        if end_s < start_s:
            raise ValueError(f"window ends before it starts: [{start_s}, {end_s}]")
        e, c = self.at(np.array([start_s, end_s]))
        dur = end_s - start_s
        if dur == 0:
            inside = not self.empty and self.t[0] <= start_s <= self.t[-1]
            return 0.0, 1.0 if inside else 0.0
        return float(e[1] - e[0]), min(1.0, max(0.0, float((c[1] - c[0]) / dur)))


class PowerIntegral(_Cumulative):
    """Cumulative energy and covered time of a piecewise-linear power signal, evaluated anywhere.

    Intervals between consecutive points longer than ``max_gap_s`` are gaps: they contribute neither
    energy nor covered time.  Outside the first/last point nothing is covered.
    """

    def __init__(self, t_s: np.ndarray, p_w: np.ndarray, max_gap_s: float):
        self.t, self.p = clean_series(t_s, p_w, "power")
        n = self.t.size
        if n >= 2:
            dt = np.diff(self.t)
            self.valid = dt <= max_gap_s
            seg_e = np.where(self.valid, dt * (self.p[1:] + self.p[:-1]) / 2.0, 0.0)
            seg_c = np.where(self.valid, dt, 0.0)
            self.cum_e = np.concatenate(([0.0], np.cumsum(seg_e)))
            self.cum_c = np.concatenate(([0.0], np.cumsum(seg_c)))
            self.period_s = float(np.median(dt))
        else:
            self.valid = np.zeros(0, dtype=bool)
            self.period_s = float("nan")

    def _inside(self, i: np.ndarray, dx: np.ndarray) -> np.ndarray:
        """Trapezoids: the power linear between knots."""
        p = self.p
        p_x = p[i] + (p[i + 1] - p[i]) / (self.t[i + 1] - self.t[i]) * dx
        return np.asarray(dx * (p[i] + p_x) / 2.0, dtype=np.float64)

    def edge_step_w(self, x_s: float) -> float:
        """How much the power moves across one window edge: the range of the samples within 1.5
        sample periods of ``x_s`` (0 with fewer than two)."""
        if self.empty:
            return 0.0
        lo = np.searchsorted(self.t, x_s - 1.5 * self.period_s, side="left")
        hi = np.searchsorted(self.t, x_s + 1.5 * self.period_s, side="right")
        near = self.p[lo:hi]
        return float(near.max() - near.min()) if near.size >= 2 else 0.0

    def spread_w(self, start_s: float, end_s: float) -> float:
        """Sample-to-sample power spread in and around a window: the standard deviation of the
        differences of consecutive samples within one period of it, divided by sqrt(2) (the spread of
        one sample about a smooth curve); 0 with fewer than three samples."""
        if self.empty:
            return 0.0
        lo = np.searchsorted(self.t, start_s - self.period_s, side="left")
        hi = np.searchsorted(self.t, end_s + self.period_s, side="right")
        d = np.diff(self.p[lo:hi])
        return float(np.std(d) / math.sqrt(2.0)) if d.size >= 2 else 0.0

    def peak_w(self, start_s: float, end_s: float) -> float:
        """Highest power within the window widened by one period each side (edge values included)."""
        if self.empty:
            return float("nan")
        lo = np.searchsorted(self.t, start_s - self.period_s, side="left")
        hi = np.searchsorted(self.t, end_s + self.period_s, side="right")
        inside = self.p[lo:hi]
        edges = np.interp([start_s, end_s], self.t, self.p)
        return float(max(np.max(inside) if inside.size else -np.inf, np.max(edges)))


def integrate_samples(
    t_s: np.ndarray, p_w: np.ndarray, start_s: float, end_s: float, *, max_gap_s: float = MAX_SAMPLE_GAP_S
) -> float:
    """Energy (J) over ``[start_s, end_s]`` from power samples: trapezoid between samples, linear
    interpolation at the window edges.  Parts of the window outside the samples, or inside a gap
    longer than ``max_gap_s``, contribute nothing; :func:`sample_coverage` says how much was covered.
    """
    return PowerIntegral(t_s, p_w, max_gap_s).window(start_s, end_s)[0]


def sample_coverage(
    t_s: np.ndarray, start_s: float, end_s: float, *, max_gap_s: float = MAX_SAMPLE_GAP_S
) -> float:
    """Fraction of ``[start_s, end_s]`` covered by samples (between the first and last sample, and
    not inside a gap longer than ``max_gap_s``)."""
    t = np.asarray(t_s, dtype=np.float64)
    return PowerIntegral(t, np.zeros_like(t), max_gap_s).window(start_s, end_s)[1]


def slice_energies(
    t_s: np.ndarray, p_w: np.ndarray, edges_s: np.ndarray, *, ratio: float = 1.0, max_gap_s: float = MAX_SAMPLE_GAP_S
) -> np.ndarray:
    """Energy (J) of each slice ``[edges_s[k], edges_s[k+1]]`` from samples, times ``ratio``
    (a calibration ratio).  Slices tile the span, so they sum to the integral over it."""
    edges = np.asarray(edges_s, dtype=np.float64)
    if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) < 0):
        raise ValueError("edges_s must be a non-decreasing 1-D array of at least two times")
    e, _ = PowerIntegral(t_s, p_w, max_gap_s).at(edges)
    return np.diff(e) * ratio


# --------------------------------------------------------------------------------------------------
# the cumulative energy counter


def counter_change_points(t_s: np.ndarray, e_j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Knots of a stepping counter: ``(t_knot_s, e_knot_j)``.

    A knot is a read whose value differs from the previous read, placed halfway between the two
    reads (the change happened somewhere between them).  Reads that repeat a value add nothing, so a
    series decimated to the reads on both sides of every change gives the same knots as the full one.
    A knot's time is known to within the spacing of the reads around it: poll the counter well inside
    its ~100 ms step (the recordings poll it at 100-200 Hz) when windows shorter than a few seconds
    are checked against it.
    """
    t, e = clean_series(t_s, e_j, "counter")
    if t.size < 2:
        return np.zeros(0), np.zeros(0)
    changed = np.flatnonzero(np.diff(e) != 0) + 1
    return (t[changed - 1] + t[changed]) / 2.0, e[changed]


class CounterIntegral(_Cumulative):
    """Cumulative energy of the counter, linear between knots; a step down is a gap (no energy,
    not covered)."""

    def __init__(self, t_s: np.ndarray, e_j: np.ndarray):
        self.t, self.e = counter_change_points(t_s, e_j)
        if self.t.size >= 2:
            de = np.diff(self.e)
            self.valid = de > 0
            self.cum_e = np.concatenate(([0.0], np.cumsum(np.where(self.valid, de, 0.0))))
            self.cum_c = np.concatenate(([0.0], np.cumsum(np.where(self.valid, np.diff(self.t), 0.0))))
            self.backwards_at_s = tuple(float(x) for x in self.t[1:][~self.valid])
            self.period_s = float(np.median(np.diff(self.t)))
        else:
            self.valid = np.zeros(0, dtype=bool)
            self.backwards_at_s = ()
            self.period_s = float("nan")

    def _inside(self, i: np.ndarray, dx: np.ndarray) -> np.ndarray:
        """The counter's energy linear between knots."""
        return np.asarray(dx / (self.t[i + 1] - self.t[i]) * (self.e[i + 1] - self.e[i]), dtype=np.float64)

    def gaps_in(self, start_s: float, end_s: float) -> list[float]:
        return [x for x in self.backwards_at_s if start_s <= x <= end_s]
