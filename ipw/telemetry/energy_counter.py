"""The cumulative energy counter's update grid and its cross-checks (pure numpy, no NVML calls):
where each sparse read's value was reached (:func:`grid_counter_reads`), and whether a counter is fit
to calibrate, or stand for, the power readings (:func:`counter_checks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ipw.telemetry.integrals import MAX_SAMPLE_GAP_S, PowerIntegral, clean_series, given

#: How well a counter value is placed in time (1 sd, s): on the update grid (grid_counter_reads: the
#: H200 grid's jitter, +-2 ms), or held half a step before a sparse read (uniform over 100 ms: 29 ms).
COUNTER_TIME_SD_GRID_S = 0.002
COUNTER_TIME_SD_HELD_S = 0.029


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
    if not given(counter_t_s) or not given(samples_t_s):
        return None
    si = PowerIntegral(np.asarray(samples_t_s, dtype=np.float64) - sample_shift_s, samples_w, max_gap_s)
    t, e = clean_series(counter_t_s, counter_j, "counter")
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
