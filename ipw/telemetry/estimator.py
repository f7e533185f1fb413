"""Pure, replayable GPU energy estimator (docs/ARCHITECTURE.md, 'Energy method').  No NVML calls: it works on arrays.

Inputs are what a sampler records (or what a recorded trace replays), all on one monotonic clock in
seconds:

- driver power samples (``nvmlDeviceGetSamples(NVML_TOTAL_POWER_SAMPLES)``): ``samples_t_s`` and
  ``samples_w``, ~20 ms apart.  Their driver timestamps are wall-clock µs; convert them with
  :func:`wall_us_to_mono_s`.
- reads of the cumulative energy counter (``nvmlDeviceGetTotalEnergyConsumption``): ``counter_t_s``
  (when each read was taken) and ``counter_j``.  The counter moves in ~100 ms steps.
- optionally, instant-power points (``NVML_FI_DEV_POWER_INSTANT``), the last fallback.

Method, per window ``[start_s, end_s]``:

1. integrate the samples by trapezoid, interpolating linearly at the window edges;
2. scale by the calibration ratio ``counter energy / integrated samples`` over a long enclosing span
   (reported; flagged outside 0.97–1.03);
3. windows >= 2 s also carry the direct counter delta; windows < 0.15 s are flagged and carry an
   uncertainty (they are not resolvable by any NVML signal alone).

Fallbacks, each labeled: uncalibrated samples, then the counter alone, then instant power, then
``unavailable``.  The 1 s averaged power is never used.

The counter is read as a step function whose value changes at discrete times.  Each change is placed
halfway between the last read that still showed the old value and the first read showing the new one
(a "knot"); energy between knots is interpolated linearly.  A value lower than the previous one
(the counter went backwards: driver reset, VM migration) is a gap: the energy across it is unknown,
never negative, and shows up as coverage < 1.

Everything here is plain numpy; results are frozen dataclasses with units in field names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, TypeGuard

import numpy as np

from ipw.telemetry.base import Quality

#: A calibration ratio outside these bounds is flagged (docs/ARCHITECTURE.md, 'Energy method').
CALIBRATION_BOUNDS = (0.97, 1.03)
#: Windows shorter than this are flagged: the counter's ~100 ms step and the samples' ~20 ms spacing
#: cannot resolve them alone.
SHORT_WINDOW_S = 0.15
#: Windows at least this long also report the direct counter delta (within ~1% by itself).
COUNTER_DELTA_MIN_S = 2.0
#: Consecutive driver samples further apart than this are a gap (the samples are ~20 ms apart and
#: the driver buffer holds ~2.4 s; a gap means the sampler polled too late and lost samples).
MAX_SAMPLE_GAP_S = 0.25
#: Instant-power points update about every 100 ms; further apart than this is a gap.
MAX_INSTANT_GAP_S = 0.5
#: Below this coverage a window's estimate carries a note, and calibration is refused.
MIN_COVERAGE = 0.99
#: A calibration span shorter than this is noted: one counter step then weighs more than ~1%.
MIN_CALIBRATION_SPAN_S = 10.0


# --------------------------------------------------------------------------------------------------
# result types


@dataclass(frozen=True)
class WindowEstimate:
    """Energy of one window, with where it came from and how far to trust it.

    ``energy_j`` covers only the part of the window that the signal covers (``coverage`` is that
    fraction); it is ``None`` when nothing is available.  ``uncertainty_j`` is a ±90% half-width: for
    sampled power, from :class:`ErrorModel` (fitted and checked on H200 recordings, docs/ENERGY.md);
    for the counter and instant power, one signal period at the mean / peak power (a bound, not fitted).
    """

    start_s: float
    end_s: float
    energy_j: float | None
    coverage: float
    quality: Quality
    source: str  # nvml.samples | nvml.counter | nvml.instant | ""
    note: str = ""
    uncalibrated_j: float | None = None  # the sample integral before scaling by the calibration
    calibration_ratio: float | None = None
    counter_delta_j: float | None = None  # windows >= COUNTER_DELTA_MIN_S only
    uncertainty_j: float | None = None  # ±90% half-width (J): ErrorModel for samples; one step for the counter
    short_window: bool = False
    aliasing: bool = False  # a periodic load near a multiple of the sample period (interval widened)
    #: ±90% of each edge's own error (J, start and end): where a cut between two windows falls (the phase split)
    edges_j: tuple[float, float] | None = None
    #: 1 sd (J) of ``energy_j``'s error from its calibration ratio (sampled power): part of ``uncertainty_j``,
    #: but shared by every window the same ratio scales, so a sum over windows adds it linearly
    calibration_sd_j: float | None = None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Calibration:
    """``ratio = counter_j / samples_j`` over ``[start_s, end_s]``; ``None`` when it cannot be formed."""

    ratio: float | None
    counter_j: float | None
    samples_j: float | None
    start_s: float
    end_s: float
    flagged: bool
    note: str = ""


@dataclass(frozen=True)
class ErrorModel:
    """The error model behind a sampled window's ``uncertainty_j``: a ±90% half-width built from the
    error's sources (docs/ENERGY.md, "How far to trust a reading"), with constants fitted on H200
    recordings by ``bench/telemetry/uncertainty_fit.py`` and checked on recordings the fit did not use.

    One standard deviation, in joules, is the root sum of squares of

    - each edge: ``edge x period x (range of the samples within 1.5 periods of the edge)`` -- where the
      edge falls on the ~20 ms sample grid, and how far the sample shift may be off, matter only when
      the power moves there;
    - the power's variation inside the sample periods: ``within x period x spread x sqrt(periods in
      the window)``, the spread being the sample-to-sample standard deviation around the window (large
      for loads that switch faster than the samples; a periodic load that beats against the sample grid
      is the extreme case, and is also labeled);
    - how the samples represent a load whose power varies fast, for the whole window:
      ``load x spread x duration`` (on the H200, 10 s blocks of 50 ms windows read 1.4-1.8% low
      against the counter, and of 0.5 s windows 0.2-0.4% high, while steady loads agree within 0.1%);
    - the samples' own error, relative to the window's energy: ``sample_noise x sqrt(period / duration)``
      (each ~20 ms sample is off by about ``sample_noise`` of the power it reports, independently of its
      neighbours, whatever the load's spread: on the H200's memory and decoding loads, 139-563 W, 50 ms
      windows erred by 0.43-0.56% (1 sd) where their samples spread by 0.3-0.5%, and the error fell as
      1/sqrt(duration); docs/ENERGY.md, "Coverage per load shape"), ``capped_noise`` instead where the GPU
      draws its power limit (the window's mean power at least ``CAP_SHARE`` of the enforced limit): the
      power controller moves clocks and voltage within the samples' periods there, and the H200's
      compute loads at the 700 W cap erred 1.5-3x more than any load below it;
    - the calibration ratio's own error, relative: ``sqrt(2) x counter_time_sd_s x P / counter energy of
      the calibration span`` (how well the counter's values are placed in time at its two ends) plus
      ``calibration_floor`` (the ratio's drift over the span);

    times ``z`` (1.645: two-sided 90% of a normal), plus, one-sided, the uncovered part of the window
    at the peak power nearby (coverage gaps).
    """

    edge: float = 0.2
    within: float = 0.0
    calibration_floor: float = 0.0022
    load: float = 0.3
    sample_noise: float = 0.005
    capped_noise: float = 0.01
    z: float = 1.645


DEFAULT_ERROR_MODEL = ErrorModel()
#: The load term grows with a window's length up to this (s): beyond it, how the samples represent a
#: fast-varying load is a share of its energy that no longer grows.
LOAD_TERM_MAX_S = 0.5
#: How well a counter value is placed in time (1 sd, s): on the update grid (grid_counter_reads: the
#: H200 grid's jitter, +-2 ms), or held half a step before a sparse read (uniform over 100 ms: 29 ms).
COUNTER_TIME_SD_GRID_S = 0.002
COUNTER_TIME_SD_HELD_S = 0.029
#: A window whose samples' power spectrum peaks near a multiple of the sample period is labeled
#: ``aliasing``; its interval is already wide through the load term (the samples of a square wave
#: spread widely), and is multiplied by this on top (1: the label only; on the H200's periodic load the
#: load term alone covered 44 of 44 held-out windows).
ALIASING_WIDEN = 1.0
#: ... and strongly periodic means: one frequency carries at least this share of the samples' variance.
#: On the H200 recordings 0.4 labeled 61 of the 66 periodic windows and none of the 1,135 others; 0.3
#: labeled all 66, and also 19 of the 400 windows of 50 ms (identical windows back to back are a periodic
#: load too, at ~2.5 sample periods) and 2 of 0.15 s.
ALIASING_MIN_SHARE = 0.4
#: A window draws the GPU's power limit when its mean power is at least this share of the enforced limit
#: (the H200's compute loads held 664-694 W under its 700 W cap, 95-99%: fp32 products sat at the threshold on two
#: leases, so 44-72% of their windows count; its memory loads 563-623 W: 80-89%).
CAP_SHARE = 0.95


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


def _clean_series(t_s: np.ndarray, v: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
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


class _PowerIntegral:
    """Cumulative energy and covered time of a piecewise-linear power signal, evaluated anywhere.

    Intervals between consecutive points longer than ``max_gap_s`` are gaps: they contribute neither
    energy nor covered time.  Outside the first/last point nothing is covered.
    """

    def __init__(self, t_s: np.ndarray, p_w: np.ndarray, max_gap_s: float):
        self.t, self.p = _clean_series(t_s, p_w, "power")
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

    @property
    def empty(self) -> bool:
        return self.t.size < 2

    def at(self, x_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(energy J, covered s) accumulated from the first point up to each time in ``x_s``."""
        x = np.atleast_1d(np.asarray(x_s, dtype=np.float64))
        if self.empty:
            return np.zeros_like(x), np.zeros_like(x)
        t, p = self.t, self.p
        xc = np.clip(x, t[0], t[-1])
        i = np.clip(np.searchsorted(t, xc, side="right") - 1, 0, t.size - 2)
        dx = xc - t[i]
        slope = (p[i + 1] - p[i]) / (t[i + 1] - t[i])
        p_x = p[i] + slope * dx
        ok = self.valid[i]
        e = self.cum_e[i] + np.where(ok, dx * (p[i] + p_x) / 2.0, 0.0)
        c = self.cum_c[i] + np.where(ok, dx, 0.0)
        return e, c

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
    return _PowerIntegral(t_s, p_w, max_gap_s).window(start_s, end_s)[0]


def sample_coverage(
    t_s: np.ndarray, start_s: float, end_s: float, *, max_gap_s: float = MAX_SAMPLE_GAP_S
) -> float:
    """Fraction of ``[start_s, end_s]`` covered by samples (between the first and last sample, and
    not inside a gap longer than ``max_gap_s``)."""
    t = np.asarray(t_s, dtype=np.float64)
    return _PowerIntegral(t, np.zeros_like(t), max_gap_s).window(start_s, end_s)[1]


def slice_energies(
    t_s: np.ndarray, p_w: np.ndarray, edges_s: np.ndarray, *, ratio: float = 1.0, max_gap_s: float = MAX_SAMPLE_GAP_S
) -> np.ndarray:
    """Energy (J) of each slice ``[edges_s[k], edges_s[k+1]]`` from samples, times ``ratio``
    (a calibration ratio).  Slices tile the span, so they sum to the integral over it."""
    edges = np.asarray(edges_s, dtype=np.float64)
    if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) < 0):
        raise ValueError("edges_s must be a non-decreasing 1-D array of at least two times")
    e, _ = _PowerIntegral(t_s, p_w, max_gap_s).at(edges)
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
    t, e = _clean_series(t_s, e_j, "counter")
    if t.size < 2:
        return np.zeros(0), np.zeros(0)
    changed = np.flatnonzero(np.diff(e) != 0) + 1
    return (t[changed - 1] + t[changed]) / 2.0, e[changed]


class _CounterIntegral:
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

    @property
    def empty(self) -> bool:
        return self.t.size < 2

    def at(self, x_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.atleast_1d(np.asarray(x_s, dtype=np.float64))
        if self.empty:
            return np.zeros_like(x), np.zeros_like(x)
        xc = np.clip(x, self.t[0], self.t[-1])
        i = np.clip(np.searchsorted(self.t, xc, side="right") - 1, 0, self.t.size - 2)
        dx = xc - self.t[i]
        frac = dx / (self.t[i + 1] - self.t[i])
        ok = self.valid[i]
        e = self.cum_e[i] + np.where(ok, frac * (self.e[i + 1] - self.e[i]), 0.0)
        c = self.cum_c[i] + np.where(ok, dx, 0.0)
        return e, c

    def window(self, start_s: float, end_s: float) -> tuple[float, float]:
        if end_s < start_s:
            raise ValueError(f"window ends before it starts: [{start_s}, {end_s}]")
        e, c = self.at(np.array([start_s, end_s]))
        dur = end_s - start_s
        if dur == 0:
            inside = not self.empty and self.t[0] <= start_s <= self.t[-1]
            return 0.0, 1.0 if inside else 0.0
        return float(e[1] - e[0]), min(1.0, max(0.0, float((c[1] - c[0]) / dur)))

    def gaps_in(self, start_s: float, end_s: float) -> list[float]:
        return [x for x in self.backwards_at_s if start_s <= x <= end_s]


@dataclass(frozen=True)
class CounterGrid:
    """Where the counter's updates fell: ``phase_s + k * step_s`` on the monotonic clock, found by
    :func:`grid_counter_reads`.  ``t_s``/``j`` are counter "reads" that put each change exactly on its
    update (the old value just before it, the new value on it), for :func:`estimate_windows`.
    ``rss_ratio``: the misfit at the chosen phase over the median misfit of all phases (small: sharp)."""

    phase_s: float
    step_s: float
    t_s: np.ndarray
    j: np.ndarray
    reads: int
    rss_ratio: float


#: The energy counter's update period on the GPUs measured so far (H200: 100.00 ms, +-2 ms jitter, from a
#: back-to-back recording of 839 updates; docs/ENERGY.md "Short windows read high").
COUNTER_GRID_STEP_S = 0.1
#: A phase is used only when its misfit is below this share of the median misfit over all phases
#: (0.1-0.3% on the H200 recordings) and below the misfit of the reads at their own times.
COUNTER_GRID_MAX_RSS_RATIO = 0.05
#: At least this many changes of value are needed to find the phase.
COUNTER_GRID_MIN_READS = 6
#: ... and sharp: the reads that saw a change fall on the grid at phases no further apart than this share
#: of a step (the H200 sampler's reads, 0.45-0.6 s apart with their jitter, cover it within a few ms; reads
#: every 0.25 s on the dot see it at two phases only, and any phase between them fits as well) ...
COUNTER_GRID_MAX_PHASE_GAP = 0.25
#: ... or, where some are further apart, the phases whose misfit is near the least (``COUNTER_GRID_NEAR``)
#: form one band, and the reads' phases next to the chosen one, below and above it, are no further apart
#: than this share of a step: the placement is then uncertain by at most that, uniformly (2 ms sd, as
#: ``COUNTER_TIME_SD_GRID_S`` says).  Between two reads' phases the misfit is flat on the H200 recordings
#: (within 1%: the samples do not pin the phase there), so the fit is only as sharp as the reads around it;
#: the vLLM run of bench/evidence/serving/vllm-h200-2026-12-04 (15 changes, a 31 ms gap between their
#: phases) had reads 4 ms apart around the phase, where the back-to-back counter saw the updates; a
#: fake-engine run of bench/evidence/telemetry/gpu/h200-2026-12-02-s8 (12 changes) had 20 ms, and placed
#: there its span's counter was 1.5% off.
COUNTER_GRID_MAX_BAND = 0.07
#: ... "near the least misfit": within this factor of it, or this share of the median misfit when the
#: least is smaller (a noise-free recording's misfit of zero would make any band one phase wide).
COUNTER_GRID_NEAR = 2.0
COUNTER_GRID_NEAR_FLOOR = 1e-3


def _sharp_phase(rss: np.ndarray, k: int, med: float, phases: np.ndarray, seen: np.ndarray, step_s: float) -> bool:
    """Whether the least misfit ``rss[k]`` (over ``phases``, one step's phases on an even grid) pins the
    phase, given the phases ``seen`` of the reads that saw a change: ``COUNTER_GRID_MAX_PHASE_GAP`` and
    ``COUNTER_GRID_MAX_BAND``."""
    if seen.size == 0:
        return False
    ordered = np.sort(seen)
    widest = max(float(np.max(np.diff(ordered))) if ordered.size > 1 else step_s,
                 float(ordered[0] + step_s - ordered[-1]))
    if widest <= COUNTER_GRID_MAX_PHASE_GAP * step_s:
        return True
    limit = COUNTER_GRID_MAX_BAND * step_s + 1e-9
    near = rss <= max(COUNTER_GRID_NEAR * float(rss[k]), COUNTER_GRID_NEAR_FLOOR * med)
    # one band (around the step's end if need be): "near" turns on once, and the band is narrow
    if near.all() or int(np.count_nonzero(near & ~np.roll(near, 1))) != 1:
        return False
    res = float(phases[1] - phases[0]) if phases.size > 1 else step_s
    if np.count_nonzero(near) * res > limit:
        return False
    # the reads' phases next to the chosen one: at or above it, and below it (a read exactly on the phase
    # is placed on its update, one just below it on the update a step earlier)
    above = float(np.mod(seen - phases[k], step_s).min())
    b = np.mod(phases[k] - seen, step_s)
    below = float(np.where(b > 0, b, step_s).min())
    return above + below <= limit


def grid_counter_reads(
    counter_t_s: np.ndarray, counter_j: np.ndarray, samples_t_s: np.ndarray, samples_w: np.ndarray, *,
    sample_shift_s: float = 0.0, step_s: float = COUNTER_GRID_STEP_S, max_gap_s: float = MAX_SAMPLE_GAP_S,
) -> CounterGrid | None:
    """Place each sparse counter read's value on the counter update that produced it.

    The counter updates on a fixed grid (every 100 ms on the H200).  A read at ``t`` shows the value of
    the latest update at or before ``t``; with reads 0.25-1 s apart that update is anywhere in the
    100 ms before the read, so the value's time is unknown by +-50 ms, and a calibration ratio over a
    10-20 s span is off by +-0.3-0.5% (the ratio over a run's first minute swung 0.994-1.006 around the
    0.998 that a back-to-back counter gave; docs/ENERGY.md).  The grid's phase is found from the reads
    and the samples together: for every phase on a 1 ms grid, each read's value is put on its update and
    regressed on the integrated samples at those times; the right phase fits (on the H200 recordings its
    misfit was 0.1% of the median phase's).  Returns None when no phase fits clearly (fewer than
    ``COUNTER_GRID_MIN_READS`` changes, a counter that is not on a grid, reads whose own times fit as
    well, or a fit that is not sharp: reads at few phases of the grid, and around the chosen phase no
    reads close on both sides, ``COUNTER_GRID_MAX_BAND``): the caller keeps its own placement then.
    """
    if _empty(counter_t_s) or _empty(samples_t_s):
        return None
    si = _PowerIntegral(np.asarray(samples_t_s, dtype=np.float64) - sample_shift_s, samples_w, max_gap_s)
    t, e = _clean_series(counter_t_s, counter_j, "counter")
    if si.empty or t.size < 2:
        return None
    changed = np.concatenate(([False], np.diff(e) != 0))
    inside = changed & (t > si.t[0] + step_s) & (t < si.t[-1])
    tc, ec = t[inside], e[inside]
    if tc.size < COUNTER_GRID_MIN_READS or np.any(np.diff(e) < 0):  # a counter that went back: no grid fit
        return None
    phases = np.arange(0.0, step_s, 0.001)
    tau = phases[:, None] + step_s * np.floor((tc[None, :] - phases[:, None]) / step_s)

    def misfit(times: np.ndarray) -> np.ndarray:
        s = si.at(times.ravel())[0].reshape(times.shape)
        s = s - s.mean(axis=-1, keepdims=True)
        ee = ec - ec.mean()
        den = (s * s).sum(axis=-1)
        r = np.where(den > 0, (s * ee).sum(axis=-1) / np.where(den > 0, den, 1.0), 0.0)
        return np.asarray(((ee - r[..., None] * s) ** 2).sum(axis=-1))

    rss = misfit(tau)
    k = int(np.argmin(rss))
    med = float(np.median(rss))
    own = float(misfit(tc[None, :])[0])
    if not (med > 0 and rss[k] < COUNTER_GRID_MAX_RSS_RATIO * med and rss[k] < own):
        return None
    phase = float(phases[k])
    if not _sharp_phase(rss, k, med, phases, np.mod(tc, step_s), step_s):
        return None
    # every read (not only the changes) moves to its update; the old value sits just before it
    tau_all = phase + step_s * np.floor((t - phase) / step_s)
    first_new = np.concatenate(([True], np.diff(e) != 0))
    knot_t = tau_all[first_new]
    knot_j = e[first_new]
    if np.any(np.diff(knot_t) <= 0):  # two values on one update: not this grid
        return None
    prev_j = np.concatenate(([knot_j[0]], knot_j[:-1]))
    eps = 1e-6
    tt = np.concatenate([knot_t[1:] - eps, knot_t])
    jj = np.concatenate([prev_j[1:], knot_j])
    order = np.argsort(tt, kind="stable")
    return CounterGrid(phase, step_s, tt[order], jj[order], int(tc.size), float(rss[k] / med))


def counter_energy_between(t_s: np.ndarray, e_j: np.ndarray, start_s: float, end_s: float) -> WindowEstimate:
    """Counter energy over ``[start_s, end_s]``, interpolated linearly through the counter's change
    points.  A counter that went backwards inside the window is a gap: the window's energy excludes
    it (never negative) and ``coverage`` drops below 1.  Quality is ``measured`` for windows of at
    least ``COUNTER_DELTA_MIN_S``, ``measured_interpolated`` below."""
    ci = _CounterIntegral(t_s, e_j)
    energy, coverage = ci.window(start_s, end_s)
    return _counter_estimate(ci, start_s, end_s, energy, coverage)


def _counter_estimate(ci: _CounterIntegral, start_s: float, end_s: float, energy: float, coverage: float) -> WindowEstimate:
    notes = []
    gaps = ci.gaps_in(start_s, end_s)
    if gaps:
        notes.append(f"counter went backwards at {', '.join(f'{g:.3f}' for g in gaps)} s: treated as a gap")
    if coverage < MIN_COVERAGE:
        notes.append(f"counter covers {coverage:.1%} of the window")
    if coverage == 0:
        return WindowEstimate(start_s, end_s, None, 0.0, "unavailable", "nvml.counter", "; ".join(notes))
    dur = end_s - start_s
    quality: Quality = "measured" if dur >= COUNTER_DELTA_MIN_S else "measured_interpolated"
    unc = ci.period_s * energy / dur if dur > 0 else None  # one step of the counter at the mean power
    return WindowEstimate(start_s, end_s, energy, coverage, quality, "nvml.counter", "; ".join(notes), uncertainty_j=unc)


# --------------------------------------------------------------------------------------------------
# counter cross-checks: is a counter fit to calibrate (or stand for) the power readings?

#: A channel is busy when its power is above this share of the highest power seen (and above
#: ``BUSY_MIN_W``): a counter that does not move then is stalled.
BUSY_FRACTION = 0.2
BUSY_MIN_W = 1.0


@dataclass(frozen=True)
class CounterCheck:
    ok: bool
    problems: tuple[str, ...] = ()
    ratio: float | None = None  # counter energy / power x time over the checked span


def unwrap_counter(t_s: np.ndarray, j: np.ndarray, range_j: float | None, max_power_w: float | None) -> tuple[np.ndarray, int, list[float]]:
    """Counter values with wraps of a known range undone: ``(values, wraps, backwards_at_s)``.

    A drop is a wrap when ``range_j`` is known and the energy it implies (``new + range - old``) is
    plausible: at most 3x ``max_power_w`` over the time between the reads (any amount when the power is
    unknown).  Any other drop is left as is: the estimator treats it as a gap, and it is reported."""
    t = np.asarray(t_s, dtype=np.float64)
    x = np.asarray(j, dtype=np.float64).copy()
    if not np.any(np.diff(x) < 0):
        return x, 0, []
    offset, wraps, backwards = 0.0, 0, []
    out = x.copy()
    for i in range(1, x.size):
        if x[i] < x[i - 1]:
            implied = x[i] + (range_j or 0.0) - x[i - 1]
            plausible = max_power_w is None or implied <= 3.0 * max_power_w * max(t[i] - t[i - 1], 1e-3) + 1.0
            if range_j and implied >= 0 and plausible:
                offset += range_j
                wraps += 1
            else:
                backwards.append(float(t[i]))
        out[i] = x[i] + offset
    return out, wraps, backwards


def counter_checks(counter_t_s: np.ndarray, counter_j: np.ndarray, power_t_s: np.ndarray | None,
                   power_w: np.ndarray | None, *, step_s: float, tolerance: float,
                   backwards_at_s: list[float] | None = None, min_span_s: float | None = None) -> CounterCheck:
    """Whether a counter can be trusted over the span it was read (``counter_j`` already unwrapped):

    - it went backwards (``backwards_at_s``, other than a wrap);
    - it did not move over a span of at least 3 update periods while the power readings say the
      device was busy (above ``BUSY_FRACTION`` of the highest power seen and ``BUSY_MIN_W``);
    - its energy over the span disagrees with power x time (the power readings integrated) by more
      than ``tolerance`` plus one counter update at each end (``2 step_s / span``); checked over spans of
      at least ``min_span_s`` (default 10 update periods).
    """
    problems: list[str] = []
    ct, cj = np.asarray(counter_t_s, dtype=np.float64), np.asarray(counter_j, dtype=np.float64)
    if backwards_at_s:
        problems.append(f"went backwards {len(backwards_at_s)}x (first at {backwards_at_s[0]:.3f} s)")
    ratio = None
    if power_t_s is not None and power_w is not None and len(power_t_s) >= 2 and ct.size >= 2:
        pt, pw = np.asarray(power_t_s, dtype=np.float64), np.asarray(power_w, dtype=np.float64)
        peak = float(np.max(pw))
        busy_w = max(BUSY_MIN_W, BUSY_FRACTION * peak)
        # stalled: consecutive reads with the same value spanning >= 3 steps while busy (the first such run)
        changes = np.flatnonzero(np.diff(cj) != 0)
        run_first = np.concatenate(([0], changes + 1))
        run_last = np.concatenate((changes, [ct.size - 1]))
        long_runs = np.flatnonzero(ct[run_last] - ct[run_first] >= 3 * step_s)
        for a, b in zip(run_first[long_runs], run_last[long_runs]):
            span = ct[b] - ct[a]
            sel = (pt >= ct[a]) & (pt <= ct[b])
            if sel.sum() >= 2 and float(np.mean(pw[sel])) >= busy_w:
                problems.append(f"did not move for {span:.1f} s while the power read {float(np.mean(pw[sel])):.0f} W")
                break
        lo, hi = max(ct[0], pt[0]), min(ct[-1], pt[-1])
        if hi - lo >= (10 * step_s if min_span_s is None else min_span_s):
            grid = np.linspace(lo, hi, 2001)
            y = np.interp(grid, pt, pw)
            power_j = float(np.sum((y[1:] + y[:-1]) / 2.0 * np.diff(grid)))
            counter = float(np.interp(hi, ct, cj) - np.interp(lo, ct, cj))
            if power_j > BUSY_MIN_W * (hi - lo):
                ratio = counter / power_j
                # the tolerance, plus one update of the counter at each end of the span
                allowed = tolerance + 2.0 * step_s / (hi - lo)
                if abs(ratio - 1.0) > allowed:
                    problems.append(f"counter {counter:.1f} J vs power x time {power_j:.1f} J over {hi - lo:.1f} s "
                                    f"(ratio {ratio:.3f}, allowed ±{allowed:.1%})")
    return CounterCheck(not problems, tuple(problems), ratio)


# --------------------------------------------------------------------------------------------------
# calibration


def _common_span(si: _PowerIntegral, ci: _CounterIntegral) -> tuple[float, float] | None:
    if si.empty or ci.empty:
        return None
    lo, hi = max(si.t[0], ci.t[0]), min(si.t[-1], ci.t[-1])
    return (float(lo), float(hi)) if hi > lo else None


def _calibrate(si: _PowerIntegral, ci: _CounterIntegral, start_s: float | None, end_s: float | None) -> Calibration:
    if start_s is None or end_s is None:
        span = _common_span(si, ci)
        if span is None:
            return Calibration(None, None, None, float("nan"), float("nan"), False, "no span covered by both samples and counter")
        start_s, end_s = span
    s_j, s_cov = si.window(start_s, end_s)
    c_j, c_cov = ci.window(start_s, end_s)
    if min(s_cov, c_cov) < MIN_COVERAGE or s_j <= 0:
        note = f"calibration span not covered (samples {s_cov:.1%}, counter {c_cov:.1%})"
        return Calibration(None, c_j, s_j, start_s, end_s, False, note)
    ratio = c_j / s_j
    lo, hi = CALIBRATION_BOUNDS
    flagged = not (lo <= ratio <= hi)
    note = f"calibration ratio {ratio:.4f} outside {lo}-{hi}" if flagged else ""
    if end_s - start_s < MIN_CALIBRATION_SPAN_S:
        note = "; ".join(filter(None, [note, f"short calibration span ({end_s - start_s:.1f} s)"]))
    return Calibration(ratio, c_j, s_j, start_s, end_s, flagged, note)


def calibration_ratio(
    samples_t_s: np.ndarray,
    samples_w: np.ndarray,
    counter_t_s: np.ndarray,
    counter_j: np.ndarray,
    start_s: float | None = None,
    end_s: float | None = None,
    *,
    max_gap_s: float = MAX_SAMPLE_GAP_S,
) -> Calibration:
    """``counter energy / integrated samples`` over ``[start_s, end_s]`` (default: the whole span
    covered by both signals).  Flagged outside ``CALIBRATION_BOUNDS``; ``ratio`` is ``None`` when
    either signal covers less than ``MIN_COVERAGE`` of the span.  Spans under
    ``MIN_CALIBRATION_SPAN_S`` are noted: the counter's step then weighs more."""
    return _calibrate(_PowerIntegral(samples_t_s, samples_w, max_gap_s), _CounterIntegral(counter_t_s, counter_j), start_s, end_s)


# --------------------------------------------------------------------------------------------------
# how far to trust a sampled window


@dataclass(frozen=True)
class ErrorTerms:
    """A sampled window's error sources in joules, each at a multiplier of 1 (``ErrorModel`` weighs them):
    the two edges (period x power range), the within-period variation (period x spread x sqrt(n)), the
    calibration (1 sd, already relative x energy), the uncovered energy, the samples' own noise
    (energy x sqrt(period / duration)), and whether the samples
    around it look like a periodic load that beats against the sample grid."""

    edge_start_j: float
    edge_end_j: float
    within_j: float
    load_j: float
    calibration_j: float
    uncovered_j: float
    aliasing_period_s: float | None = None
    noise_j: float = 0.0  # |energy| x sqrt(period / duration): the samples' own error at a relative 1
    capped: bool = False  # the window draws the GPU's power limit: ``capped_noise`` weighs ``noise_j``

    def half_width_j(self, model: ErrorModel = DEFAULT_ERROR_MODEL) -> float:
        """The ±90% half-width (J) under ``model``."""
        sd = math.sqrt((model.edge * self.edge_start_j) ** 2 + (model.edge * self.edge_end_j) ** 2
                       + (model.within * self.within_j) ** 2 + (model.load * self.load_j) ** 2
                       + (self.noise(model) * self.noise_j) ** 2 + self.calibration_j ** 2)
        h = model.z * sd
        if self.aliasing_period_s is not None:
            h *= ALIASING_WIDEN
        return h + self.uncovered_j

    def noise(self, model: ErrorModel = DEFAULT_ERROR_MODEL) -> float:
        """The samples' own relative error (1 sd, per sample) that ``model`` gives this window."""
        return model.capped_noise if self.capped else model.sample_noise


def aliasing_period_s(t_s: np.ndarray, p_w: np.ndarray, period_s: float) -> float | None:
    """The period of a strongly periodic load in ``(t_s, p_w)`` (samples ~``period_s`` apart) when it
    sits near a multiple of the sample period, else None.  Strongly periodic: one frequency of the
    samples' periodogram (detrended, resampled on a regular grid) carries at least ``ALIASING_MIN_SHARE`` of their
    variance and the variance is more than (5 W)^2; near: within a quarter period of k x period_s,
    k = 2..10 (longer periods are resolved by the samples)."""
    if t_s.size < 16 or not np.isfinite(period_s) or period_s <= 0:
        return None
    grid = np.arange(t_s[0], t_s[-1], period_s)
    if grid.size < 16:
        return None
    x = np.interp(grid, t_s, p_w)
    x = x - np.polyval(np.polyfit(np.arange(x.size), x, 1), np.arange(x.size))
    var = float(np.var(x))
    if var < 25.0:
        return None
    spec = np.abs(np.fft.rfft(x)) ** 2
    spec[0] = 0.0
    k = int(np.argmax(spec))
    share = spec[k] / max(spec.sum(), 1e-12)
    if k == 0 or share < ALIASING_MIN_SHARE:
        return None
    per = grid.size * period_s / k
    m = round(per / period_s)
    if 2 <= m <= 10 and abs(per - m * period_s) < 0.25 * period_s:
        return float(per)
    return None


def error_terms(si: _PowerIntegral, start_s: float, end_s: float, energy_j: float, coverage: float,
                calibration_rel_sd: float, alias_cache: dict[int, float | None] | None = None,
                power_limit_w: float | None = None) -> ErrorTerms:
    """The error sources of one window of sampled power (see ``ErrorModel``); ``power_limit_w``, the GPU's
    enforced power limit where known, tells a window that draws it (``capped``).  The aliasing check looks
    at the samples from 1 s before the window to 1 s after it; with ``alias_cache`` (one per batch of
    windows) windows that start in the same half second share one check over the 2 s around it (a batch
    of 1,000 windows of 50 ms costs 120 checks, not 1,000)."""
    per = si.period_s
    dur = end_s - start_s
    n = max(1.0, dur / per) if per > 0 else 1.0
    if alias_cache is None:
        lo, hi = start_s - 1.0, end_s + 1.0
        alias = _aliasing_between(si, lo, hi)
    else:
        key = math.floor(start_s * 2.0)  # half seconds
        if key not in alias_cache:
            alias_cache[key] = _aliasing_between(si, key / 2.0 - 0.75, max(key / 2.0 + 1.25, end_s + 0.75))
        alias = alias_cache[key]
    uncovered = (1.0 - coverage) * dur * si.peak_w(start_s, end_s) if coverage < 1 else 0.0
    spread = si.spread_w(start_s, end_s)
    return ErrorTerms(
        edge_start_j=per * si.edge_step_w(start_s), edge_end_j=per * si.edge_step_w(end_s),
        within_j=per * spread * math.sqrt(n), load_j=spread * min(dur, LOAD_TERM_MAX_S),
        calibration_j=abs(energy_j) * calibration_rel_sd, uncovered_j=max(0.0, uncovered),
        aliasing_period_s=alias, noise_j=abs(energy_j) * math.sqrt(per / max(dur, per)) if per > 0 else 0.0,
        capped=at_power_limit(energy_j, dur * coverage, power_limit_w),
    )


def at_power_limit(energy_j: float, covered_s: float, power_limit_w: float | None) -> bool:
    """Whether ``energy_j`` over ``covered_s`` is a mean power of at least ``CAP_SHARE`` of the limit."""
    if not power_limit_w or covered_s <= 0:
        return False
    return energy_j / covered_s >= CAP_SHARE * power_limit_w


def _aliasing_between(si: _PowerIntegral, lo_s: float, hi_s: float) -> float | None:
    lo = np.searchsorted(si.t, lo_s, side="left")
    hi = np.searchsorted(si.t, hi_s, side="right")
    return aliasing_period_s(si.t[lo:hi], si.p[lo:hi], si.period_s)


#: 1-sd relative error of power readings that no counter calibrated: the bounds within which NVML's
#: calibration ratios fall (docs/ARCHITECTURE.md, 'Energy method').  Every window of such a channel shares it.
UNCALIBRATED_REL_SD = 0.03


def calibration_rel_sd(si: _PowerIntegral, cal: Calibration | None, counter_time_sd_s: float,
                       model: ErrorModel = DEFAULT_ERROR_MODEL) -> float:
    """1-sd relative error of a calibration ratio: its two ends' placement in time, at the power there,
    over the span's counter energy, plus the model's floor.  Uncalibrated samples: 3% (the bounds
    within which H200 and other ratios fall, docs/ARCHITECTURE.md, 'Energy method')."""
    if cal is None or cal.ratio is None or not cal.counter_j:
        return UNCALIBRATED_REL_SD
    p_lo, p_hi = np.interp([cal.start_s, cal.end_s], si.t, si.p) * cal.ratio
    placement = counter_time_sd_s * math.hypot(p_lo, p_hi) / cal.counter_j
    return math.hypot(placement, model.calibration_floor)


# --------------------------------------------------------------------------------------------------
# per-window estimates


def _empty(x: np.ndarray | None) -> bool:
    return x is None or np.asarray(x).size == 0


def _given(x: np.ndarray | None) -> TypeGuard[np.ndarray]:
    return not _empty(x)


def estimate_windows(
    samples_t_s: np.ndarray | None,
    samples_w: np.ndarray | None,
    counter_t_s: np.ndarray | None,
    counter_j: np.ndarray | None,
    windows: Sequence[tuple[float, float]],
    *,
    calibration_window: tuple[float, float] | None = None,
    instant_t_s: np.ndarray | None = None,
    instant_w: np.ndarray | None = None,
    sample_shift_s: float = 0.0,
    short_window_s: float = SHORT_WINDOW_S,
    counter_delta_min_s: float = COUNTER_DELTA_MIN_S,
    max_gap_s: float = MAX_SAMPLE_GAP_S,
    counter_time_sd_s: float = COUNTER_TIME_SD_HELD_S,
    error_model: ErrorModel = DEFAULT_ERROR_MODEL,
    reading_period_s: float = 0.0,
    power_limit_w: float | None = None,
) -> list[WindowEstimate]:
    """Estimate the energy of each ``(start_s, end_s)`` window.

    Order of preference, each labeled:

    1. samples, integrated and scaled by the calibration ratio over ``calibration_window`` (default:
       the whole span covered by samples and counter): ``measured_interpolated``, ``nvml.samples``;
    2. samples without a usable counter: same labels, note "uncalibrated";
    3. the counter alone, interpolated through its change points: ``nvml.counter``;
    4. instant-power points integrated: ``nvml.instant`` (note: may alias periodic loads);
    5. nothing: ``unavailable``.

    ``sample_shift_s`` is subtracted from sample times before integrating (the driver stamps a
    sample after the power it reports; 0 keeps the driver's timestamps).  Windows of at least
    ``counter_delta_min_s`` also carry ``counter_delta_j``; windows shorter than ``short_window_s``
    are flagged ``short_window``.  A sampled window's ``uncertainty_j`` is its ±90% half-width under
    ``error_model`` (``ErrorTerms``); ``counter_time_sd_s`` says how well the counter's values were
    placed in time (``COUNTER_TIME_SD_GRID_S`` after :func:`grid_counter_reads`, else held).
    ``reading_period_s``: how long one power reading stands for, where that is longer than their spacing
    (a reading averaged over a second, polled every 0.1 s): the error terms use the longer period.
    ``power_limit_w``: the GPU's enforced power limit, where known; a window that draws it gets the
    wider noise of ``ErrorModel.capped_noise`` and says so in its note.
    """
    si = None
    if _given(samples_t_s) and _given(samples_w):
        si = _PowerIntegral(np.asarray(samples_t_s, dtype=np.float64) - sample_shift_s, samples_w, max_gap_s)
        si = None if si.empty else si
        if si is not None and reading_period_s > si.period_s:
            si.period_s = reading_period_s
    ci = None
    if _given(counter_t_s) and _given(counter_j):
        ci = _CounterIntegral(counter_t_s, counter_j)
        ci = None if ci.empty else ci
    ii = None
    if _given(instant_t_s) and _given(instant_w):
        ii = _PowerIntegral(instant_t_s, instant_w, MAX_INSTANT_GAP_S)
        ii = None if ii.empty else ii

    cal = None
    if si is not None and ci is not None:
        lo, hi = calibration_window if calibration_window is not None else (None, None)
        cal = _calibrate(si, ci, lo, hi)
    cal_sd = calibration_rel_sd(si, cal, counter_time_sd_s, error_model) if si is not None else 0.0
    alias_cache: dict[int, float | None] = {}

    out = []
    for start_s, end_s in windows:
        start_s, end_s = float(start_s), float(end_s)
        if end_s < start_s:
            raise ValueError(f"window ends before it starts: [{start_s}, {end_s}]")
        dur = end_s - start_s
        short = dur < short_window_s
        notes: list[str] = []
        est: WindowEstimate | None = None

        if si is not None:
            raw, cov = si.window(start_s, end_s)
            if cov > 0:
                if cal is not None and cal.ratio is not None:
                    energy, ratio = raw * cal.ratio, cal.ratio
                    if cal.note:
                        notes.append(cal.note)
                else:
                    energy, ratio = raw, None
                    notes.append("uncalibrated" + (f" ({cal.note})" if cal is not None and cal.note else ""))
                if cov < MIN_COVERAGE:
                    notes.append(f"samples cover {cov:.1%} of the window")
                terms = error_terms(si, start_s, end_s, energy, cov, cal_sd, alias_cache, power_limit_w)
                unc = terms.half_width_j(error_model) * (ratio or 1.0)
                if terms.aliasing_period_s is not None:
                    notes.append(f"aliasing: periodic load ({terms.aliasing_period_s * 1000:.0f} ms) near a multiple "
                                 f"of the {si.period_s * 1000:.0f} ms sample period, interval widened")
                if terms.capped and error_model.capped_noise > error_model.sample_noise:
                    notes.append(f"at the GPU's power limit ({power_limit_w:.0f} W): the clocks move within the "
                                 "samples' periods, interval widened")
                r = ratio or 1.0
                edges = (error_model.z * error_model.edge * terms.edge_start_j * r,
                         error_model.z * error_model.edge * terms.edge_end_j * r)
                est = WindowEstimate(start_s, end_s, energy, cov, "measured_interpolated", "nvml.samples",
                                     uncalibrated_j=raw, calibration_ratio=ratio, uncertainty_j=unc,
                                     aliasing=terms.aliasing_period_s is not None, edges_j=edges,
                                     calibration_sd_j=terms.calibration_j * r)

        if est is None and ci is not None:
            energy, cov = ci.window(start_s, end_s)
            if cov > 0:
                c = _counter_estimate(ci, start_s, end_s, energy, cov)
                notes.append(c.note)
                est = c

        if est is None and ii is not None:
            energy, cov = ii.window(start_s, end_s)
            if cov > 0:
                notes.append("instant power points (~100 ms apart): may alias periodic loads")
                if cov < MIN_COVERAGE:
                    notes.append(f"instant power covers {cov:.1%} of the window")
                unc = ii.period_s * ii.peak_w(start_s, end_s)
                est = WindowEstimate(start_s, end_s, energy, cov, "measured_interpolated", "nvml.instant", uncertainty_j=unc)

        if est is None:
            notes.append("no power signal covers this window")
            est = WindowEstimate(start_s, end_s, None, 0.0, "unavailable", "")

        counter_delta = None
        if ci is not None and dur >= counter_delta_min_s:
            c_j, c_cov = ci.window(start_s, end_s)
            if c_cov >= MIN_COVERAGE and not ci.gaps_in(start_s, end_s):
                counter_delta = c_j
        if short:
            notes.append(f"window shorter than {short_window_s} s: not resolvable alone, see uncertainty_j")

        out.append(WindowEstimate(
            start_s=start_s, end_s=end_s, energy_j=est.energy_j, coverage=est.coverage, quality=est.quality,
            source=est.source, note="; ".join(n for n in notes if n), uncalibrated_j=est.uncalibrated_j,
            calibration_ratio=est.calibration_ratio, counter_delta_j=counter_delta,
            uncertainty_j=est.uncertainty_j, short_window=short, aliasing=est.aliasing, edges_j=est.edges_j,
            calibration_sd_j=est.calibration_sd_j,
        ))
    return out


# --------------------------------------------------------------------------------------------------
# idle baseline


def idle_baseline(
    t_s: np.ndarray, p_w: np.ndarray, start_s: float, end_s: float, *, max_gap_s: float = MAX_SAMPLE_GAP_S
) -> tuple[float, float]:
    """``(mean_w, std_w)`` of idle power over ``[start_s, end_s]``: the mean is the integral over the
    covered time; the spread is the standard deviation of the samples inside the window.  Raises
    ``ValueError`` when no sample covers the window."""
    pi = _PowerIntegral(t_s, p_w, max_gap_s)
    energy, cov = pi.window(start_s, end_s)
    covered_s = cov * (end_s - start_s)
    if covered_s <= 0:
        raise ValueError(f"no power samples cover the idle window [{start_s}, {end_s}]")
    inside = pi.p[(pi.t >= start_s) & (pi.t <= end_s)]
    std = float(np.std(inside)) if inside.size >= 2 else 0.0
    return energy / covered_s, std


def net_energy_j(gross_j: float, idle_w: float, duration_s: float) -> float:
    """Dynamic energy ``gross - P_idle * duration`` (may be negative when the window idled below the
    baseline; reported beside gross, never instead of it)."""
    return gross_j - idle_w * duration_s
