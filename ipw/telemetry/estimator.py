"""Pure, replayable GPU energy estimator (docs/ARCHITECTURE.md, 'Energy method').  No NVML calls: it works on arrays.

Inputs are what a sampler records (or what a recorded trace replays), all on one monotonic clock in
seconds:

- driver power samples (``nvmlDeviceGetSamples(NVML_TOTAL_POWER_SAMPLES)``): ``samples_t_s`` and
  ``samples_w``, ~20 ms apart.  Their driver timestamps are wall-clock µs; convert them with
  :func:`ipw.telemetry.integrals.wall_us_to_mono_s`.
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

The signals as integrals over time (and the driver clock's conversion): :mod:`ipw.telemetry.integrals`;
the counter's update grid and its cross-checks: :mod:`ipw.telemetry.energy_counter`; a sampled window's error
model: :mod:`ipw.telemetry.error_model`.

Everything here is plain numpy; results are frozen dataclasses with units in field names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ipw.telemetry.base import Quality
from ipw.telemetry.energy_counter import COUNTER_TIME_SD_HELD_S
from ipw.telemetry.error_model import DEFAULT_ERROR_MODEL, ErrorModel, error_terms
from ipw.telemetry.integrals import MAX_INSTANT_GAP_S, MAX_SAMPLE_GAP_S, CounterIntegral, PowerIntegral, given

#: A calibration ratio outside these bounds is flagged (docs/ARCHITECTURE.md, 'Energy method').
CALIBRATION_BOUNDS = (0.97, 1.03)
#: Windows shorter than this are flagged: the counter's ~100 ms step and the samples' ~20 ms spacing
#: cannot resolve them alone.
SHORT_WINDOW_S = 0.15
#: Windows at least this long also report the direct counter delta (within ~1% by itself).
COUNTER_DELTA_MIN_S = 2.0
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


def counter_energy_between(t_s: np.ndarray, e_j: np.ndarray, start_s: float, end_s: float) -> WindowEstimate:
    """Counter energy over ``[start_s, end_s]``, interpolated linearly through the counter's change
    points.  A counter that went backwards inside the window is a gap: the window's energy excludes
    it (never negative) and ``coverage`` drops below 1.  Quality is ``measured`` for windows of at
    least ``COUNTER_DELTA_MIN_S``, ``measured_interpolated`` below."""
    ci = CounterIntegral(t_s, e_j)
    energy, coverage = ci.window(start_s, end_s)
    return _counter_estimate(ci, start_s, end_s, energy, coverage)


def _counter_estimate(ci: CounterIntegral, start_s: float, end_s: float, energy: float, coverage: float) -> WindowEstimate:
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
# calibration


def _common_span(si: PowerIntegral, ci: CounterIntegral) -> tuple[float, float] | None:
    if si.empty or ci.empty:
        return None
    lo, hi = max(si.t[0], ci.t[0]), min(si.t[-1], ci.t[-1])
    return (float(lo), float(hi)) if hi > lo else None


def _calibrate(si: PowerIntegral, ci: CounterIntegral, start_s: float | None, end_s: float | None) -> Calibration:
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
    return _calibrate(PowerIntegral(samples_t_s, samples_w, max_gap_s), CounterIntegral(counter_t_s, counter_j), start_s, end_s)


#: 1-sd relative error of power readings that no counter calibrated: the bounds within which NVML's
#: calibration ratios fall (docs/ARCHITECTURE.md, 'Energy method').  Every window of such a channel shares it.
UNCALIBRATED_REL_SD = 0.03


def calibration_rel_sd(si: PowerIntegral, cal: Calibration | None, counter_time_sd_s: float,
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
    if given(samples_t_s) and given(samples_w):
        si = PowerIntegral(np.asarray(samples_t_s, dtype=np.float64) - sample_shift_s, samples_w, max_gap_s)
        si = None if si.empty else si
        if si is not None and reading_period_s > si.period_s:
            si.period_s = reading_period_s
    ci = None
    if given(counter_t_s) and given(counter_j):
        ci = CounterIntegral(counter_t_s, counter_j)
        ci = None if ci.empty else ci
    ii = None
    if given(instant_t_s) and given(instant_w):
        ii = PowerIntegral(instant_t_s, instant_w, MAX_INSTANT_GAP_S)
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
    pi = PowerIntegral(t_s, p_w, max_gap_s)
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
