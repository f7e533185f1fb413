"""From one GPU's recorded NVML signals (:meth:`ipw.telemetry.sampler.NvmlSampler.arrays`) to window
estimates: the counter's sparse reads placed in time (on its update grid when found, else held), the
counter cross-checked against the power readings, then :func:`ipw.telemetry.estimator.estimate_windows`.
Pure numpy, no NVML calls.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from ipw.telemetry.energy_counter import (
    COUNTER_TIME_SD_GRID_S,
    COUNTER_TIME_SD_HELD_S,
    CounterCheck,
    counter_checks,
    grid_counter_reads,
    unwrap_counter,
)
from ipw.telemetry.estimator import CALIBRATION_BOUNDS, WindowEstimate, estimate_windows

#: The energy counter updates about every 100 ms (measured: the doctor's self-test, docs/ARCHITECTURE.md, 'Energy method').
COUNTER_STEP_S = 0.1


def hold_counter_reads(t_s: np.ndarray, e_j: np.ndarray, step_s: float = COUNTER_STEP_S) -> tuple[np.ndarray, np.ndarray]:
    """Counter reads as the estimator should see them when reads are sparser than the counter's step.

    The estimator places a change of value halfway between the last read showing the old value and
    the first showing the new one: right when reads are dense (the recordings poll at 100-200 Hz), but
    reads here are 0.25-1 s apart, and the value a read shows was reached within the one step
    (~100 ms) before it.  So before every read that follows a longer gap, a read of the previous
    value is added one step earlier: each change then sits half a step before the read that saw it.
    On the H200 run this took the counter delta of 2 s windows from 7% median error (up to 18%) to
    1.8% (docs/ENERGY.md).  A counter that went backwards stays a gap.
    """
    t = np.asarray(t_s, dtype=np.float64)
    e = np.asarray(e_j, dtype=np.float64)
    if t.size < 2:
        return t, e
    idx = np.flatnonzero(np.diff(t) > step_s) + 1
    tt = np.concatenate([t, t[idx] - step_s])
    ee = np.concatenate([e, e[idx - 1]])
    order = np.argsort(tt, kind="stable")
    return tt[order], ee[order]


def counter_check(a: dict[str, np.ndarray]) -> CounterCheck | None:
    """The counter cross-checks of ``ipw doctor`` and of every estimate (:func:`ipw.telemetry.energy_counter.counter_checks`)
    on one GPU's recorded signals (:meth:`ipw.telemetry.sampler.NvmlSampler.arrays`): the counter's reads against the driver
    samples (the instant power where there are none), within NVML's calibration bounds.  The counter is
    read every 0.25-2 s, so one "update" here is the spacing of its reads (at least its 0.1 s step): a
    value held over three reads' spacing under load is a stall, and each end of the span may be off by
    one read's energy (over any span of at least ten 0.1 s steps).  None with fewer than two counter reads."""
    ct, cj = a["counter_t_s"], a["counter_j"]
    if ct.size < 2:
        return None
    pt, pw = (a["samples_t_s"], a["samples_w"]) if a["samples_t_s"].size >= 2 else (a["instant_t_s"], a["instant_w"])
    _, _, backwards = unwrap_counter(ct, cj, None, None)  # NVML's counter is 64-bit mJ: any drop is a fault
    lo, hi = CALIBRATION_BOUNDS
    return counter_checks(ct, cj, pt if pt.size >= 2 else None, pw if pt.size >= 2 else None,
                          step_s=max(COUNTER_STEP_S, float(np.median(np.diff(ct)))),
                          tolerance=max(1 - lo, hi - 1), backwards_at_s=backwards, min_span_s=10 * COUNTER_STEP_S)


def estimate_recorded(
    a: dict[str, np.ndarray],
    windows: Sequence[tuple[float, float]],
    *,
    calibration_window: tuple[float, float] | None,
    sample_shift_s: float,
    power_limit_w: float | None,
) -> list[WindowEstimate]:
    """One estimate per ``(start_s, end_s)`` window from one GPU's recorded signals ``a`` (monotonic seconds),
    calibrated over ``calibration_window`` (None: everything in ``a``); ``power_limit_w``: the GPU's enforced
    power limit, where known."""
    # a counter that fails the cross-checks (stalled under load, backwards, off power x time) is not
    # used where a power signal can stand in: the samples are then uncalibrated (a wider interval)
    check = counter_check(a)
    bad = check is not None and not check.ok
    drop = bad and (a["samples_t_s"].size >= 2 or a["instant_t_s"].size >= 2)
    grid = None
    if drop:
        counter_t, counter_j = None, None
    else:  # each read on the counter update that produced it when the update grid is found, else held
        grid = grid_counter_reads(a["counter_t_s"], a["counter_j"], a["samples_t_s"], a["samples_w"],
                                  sample_shift_s=sample_shift_s)
        counter_t, counter_j = (grid.t_s, grid.j) if grid is not None else hold_counter_reads(
            a["counter_t_s"], a["counter_j"])
    ests = estimate_windows(
        a["samples_t_s"], a["samples_w"], counter_t, counter_j, windows,
        calibration_window=calibration_window, instant_t_s=a["instant_t_s"],
        instant_w=a["instant_w"], sample_shift_s=sample_shift_s,
        counter_time_sd_s=COUNTER_TIME_SD_GRID_S if grid is not None else COUNTER_TIME_SD_HELD_S,
        power_limit_w=power_limit_w,
    )
    if bad:
        why = ("counter distrusted, not used: " if drop else "counter check: ") + "; ".join(check.problems if check is not None else ())
        ests = [replace(e, note="; ".join(filter(None, [why, e.note]))) for e in ests]
    return ests
