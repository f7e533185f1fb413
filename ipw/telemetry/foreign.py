"""Foreign activity: whether a GPU outside the measurement (watched by the NVML sampler, instant power
only) was busy during a window (:func:`foreign_verdict`, docs/MULTIGPU.md).  Pure numpy, no NVML calls.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: A watched GPU is busy when its instant power is above its idle by more than this share of its
#: enforced power limit (105 W on a 700 W H200: above the 75-155 W its idle spans after a load) ...
FOREIGN_RISE_FRACTION = 0.15
#: ... or, with no power limit known, by this much ...
FOREIGN_RISE_W = 60.0
#: ... and never by less than this.
FOREIGN_MIN_RISE_W = 20.0
#: A watched GPU above this share of its power limit is busy whatever its idle (one that was busy
#: since before the sampler started has no idle to rise from).
FOREIGN_BUSY_FRACTION = 0.45
#: A watched GPU's idle: the lowest median of this many consecutive instant reads (1 s at 0.25 s)
#: since the sampler started.  (A percentile over a lookback drifts up to the load's power when the
#: GPU is busy most of the time: 78 -> 121 W within 100 s on the two-H200 bench, docs/MULTIGPU.md.)
FOREIGN_IDLE_READS = 4


def idle_from_reads(w: np.ndarray, n: int = FOREIGN_IDLE_READS) -> float:
    """A watched GPU's idle from its instant-power reads: the lowest median of ``n`` consecutive
    reads (the sampler keeps the same minimum as reads arrive).  ``inf`` without reads."""
    w = np.asarray(w, dtype=np.float64)
    if w.size == 0:
        return math.inf
    if w.size < n:
        return float(w.min())
    return float(np.median(np.lib.stride_tricks.sliding_window_view(w, n), axis=1).min())


def foreign_verdict(component: str, t_s: np.ndarray, w: np.ndarray, idle_w: float, limit_w: float | None,
                    start_s: float, end_s: float) -> dict[str, Any] | None:
    """Whether a GPU outside the measurement was busy in ``[start_s, end_s]``, from its instant-power
    reads ``(t_s, w)``: None when not (or when no read lies within 0.3 s of the window).

    Busy: at least two of the window's reads (its one read, for a window shorter than the read
    period: the nearest) above ``idle_w`` + 15% of ``limit_w`` (+60 W without a limit, at least
    +20 W), or above 45% of ``limit_w`` (a GPU busy since before the sampler started has no idle to
    rise from).  The dict: ``component``, ``mean_w`` / ``max_w`` over those reads, ``idle_w``,
    ``threshold_w``, ``busy_fraction`` (of the reads), ``excess_j`` (rough: mean above idle times
    the duration: energy that no reading of the sensor contains) and ``reads``."""
    t = np.asarray(t_s, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    if t.size == 0:
        return None
    duration = max(0.0, end_s - start_s)
    inside = (t >= start_s) & (t <= end_s)
    if inside.any():
        vals = w[inside]
    else:
        mid = 0.5 * (start_s + end_s)
        k = int(np.argmin(np.abs(t - mid)))
        if abs(t[k] - mid) > 0.5 * duration + 0.3:
            return None
        vals = w[k: k + 1]
    rise = FOREIGN_RISE_W if limit_w is None else max(FOREIGN_MIN_RISE_W, FOREIGN_RISE_FRACTION * limit_w)
    threshold = idle_w + rise
    if limit_w is not None:  # busy since before the sampler started: its "idle" is a load
        threshold = min(threshold, FOREIGN_BUSY_FRACTION * limit_w)
    above = vals > threshold
    if int(above.sum()) < min(2, vals.size):
        return None
    mean_w = float(vals.mean())
    return {
        "component": component,
        "mean_w": round(mean_w, 1),
        "max_w": round(float(vals.max()), 1),
        "idle_w": round(idle_w, 1),
        "threshold_w": round(threshold, 1),
        "busy_fraction": round(float(above.mean()), 3),
        "excess_j": round(max(0.0, mean_w - idle_w) * duration, 1),
        "reads": int(vals.size),
    }
