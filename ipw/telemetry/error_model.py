"""How far to trust a window of sampled power: the error model behind its ``uncertainty_j``
(docs/ENERGY.md, "How far to trust a reading"), its error sources per window, and the aliasing check.
Pure numpy, no NVML calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ipw.telemetry.integrals import PowerIntegral


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


def error_terms(si: PowerIntegral, start_s: float, end_s: float, energy_j: float, coverage: float,
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


def _aliasing_between(si: PowerIntegral, lo_s: float, hi_s: float) -> float | None:
    lo = np.searchsorted(si.t, lo_s, side="left")
    hi = np.searchsorted(si.t, hi_s, side="right")
    return aliasing_period_s(si.t[lo:hi], si.p[lo:hi], si.period_s)
