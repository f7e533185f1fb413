"""Sensors of libraries that answer "what now" (a cumulative energy counter, a power reading), read by
one background thread: AMD GPUs (``amdsmi``), Apple Silicon (IOReport through ``zeus-apple-silicon``),
Jetson boards (INA3221/INA238 through sysfs hwmon), NVIDIA module power (superchips).

:class:`PolledSensor` is the shared part; a :class:`Platform` is the thin layer over one library (its
channels, one ``read()``, its counter's update period).  Windows are attributed by the same estimator
as NVML (:func:`ipw.telemetry.estimator.estimate_windows`): power readings integrated and scaled by
the counter over a long span where a channel has both (``<platform>.power``), the counter alone
(``<platform>.counter``), or the power readings alone (noted ``uncalibrated``).  Windows shorter than
the counter's update period are flagged short, with an uncertainty, as on NVML.

Counters are checked (:func:`counter_checks`) at start-up (as Zeus does for amdsmi,
ml-energy/zeus zeus/device/gpu/amd.py) and over the data of every estimate: a counter that does not
move while the power says the device is busy, that goes backwards (other than a wrap of its known
range), or whose energy disagrees with power x time by more than the platform's stated tolerance is
*distrusted*: not used, and every reading says why.  ``ipw doctor`` reports the same checks.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from ipw.errors import IpwError
from ipw.telemetry.base import Deferred, EnergyReading, Quality, Scope, SensorBase, SensorInfo
from ipw.telemetry.energy_counter import BUSY_FRACTION, BUSY_MIN_W, CounterCheck, counter_checks, unwrap_counter
from ipw.telemetry.error_model import DEFAULT_ERROR_MODEL
from ipw.telemetry.estimator import WindowEstimate, estimate_windows
from ipw.telemetry.integrals import MAX_INSTANT_GAP_S, counter_change_points

#: Poll every 0.1 s by default: inside the estimator's 0.25 s gap limit for power readings.
DEFAULT_PERIOD_S = 0.1
#: Calibration and checks use at most this much history before the newest data.
LOOKBACK_S = 600.0
#: The error model of polled power readings: NVML's (estimator.ErrorModel, fitted on 20 ms averaged
#: samples), with the terms of readings of the power *at* the poll, every T s, interpolated linearly
#: (docs/PLATFORMS.md, "How far to trust a reading"):
#: - a window edge at a step of dP, u*T before the next poll (u uniform): the energy beyond the edge is
#:   off by dP*T*u^2/2, whose 90th percentile is 0.405 dP*T: edge = 0.405 / 1.645;
#: - a step inside the window: off by dP*T*(u - 1/2), 1 sd dP*T/sqrt(12); the within term of one step is
#:   within * T * dP / sqrt(2) (its spread is the step over sqrt(2n), times sqrt(n)): within = sqrt(2/12);
#: - no ``sample_noise``: NVML's is the H200 driver samples' own error, measured there; these platforms'
#:   readings were never recorded against a reference, so nothing says what theirs is.
POLLED_ERROR_MODEL = replace(DEFAULT_ERROR_MODEL, edge=0.25, within=0.41, sample_noise=0.0)
#: The note of a counter-only channel whose counter did not move around a window.
UNMOVED = "counter did not move"


class Absent(IpwError):
    """The platform is not on this machine (not a Mac, no AMD GPU, no INA monitor, no superchip): the
    sensor is left out without a word in a run; ``ipw doctor`` shows the reason.  Any other IpwError of
    a platform sensor (its library missing where the platform is, no permission) is one line on stderr,
    and the run goes on with the other sensors."""


@dataclass(frozen=True)
class Channel:
    """One component a platform measures."""

    component: str  # "amd0", "apple-gpu", "jetson-board"
    scope: Scope
    prefix: str  # source prefix: "amdsmi", "apple", "jetson", "nvml.module"
    has_counter: bool
    has_power: bool
    #: the counter restarts at 0 past this (J); None when it never wraps in practice
    counter_range_j: float | None = None
    #: the largest relative disagreement between counter and power x time that is not a fault
    tolerance: float = 0.10
    #: how long one power reading stands for (s) where longer than the poll: its own averaging (AMD's
    #: average_socket_power ~1 s, an INA monitor's update_interval); the error terms use it
    power_average_s: float = 0.0
    #: one count of the counter (J): the uncertainty of "did not move" (0 J)
    counter_resolution_j: float | None = None
    note: str = ""
    #: a rail inside another channel's measurement (a Jetson rail inside the board input): its energy is
    #: given in that channel's reading's note, never as a reading of its own (it would be counted twice)
    part_of: str | None = None


@dataclass(frozen=True)
class Poll:
    """One read of every channel: cumulative energy (J) and power (W), and why a value is missing."""

    counter_j: dict[str, float] = field(default_factory=dict)
    power_w: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class Platform:
    """The library-specific part of a :class:`PolledSensor`."""

    name = ""
    #: how often the counter updates (s): windows shorter than this are flagged short
    counter_step_s = DEFAULT_PERIOD_S
    #: how often to poll (s)
    period_s = DEFAULT_PERIOD_S
    #: power readings bit-identical for this long (s) while the device is busy: the monitor froze (None: not
    #: checked; a platform whose power comes with a counter has the counter checks instead)
    frozen_after_s: float | None = None
    channels: list[Channel]

    def read(self) -> Poll:
        raise NotImplementedError

    def describe(self) -> str:
        """One line: the device(s) and what the library reads."""
        return ""

    def params(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Release the library."""


# --------------------------------------------------------------------------------------------------
# the sensor


@dataclass(frozen=True)
class Frozen:
    """A span over which a power monitor's readings did not change while the device was busy."""

    start_s: float
    end_s: float
    power_w: float


def frozen_spans(t_s: np.ndarray, w: np.ndarray, min_s: float) -> list[Frozen]:
    """Runs of bit-identical power readings lasting at least ``min_s`` at a busy power (above
    ``BUSY_FRACTION`` of the highest reading and ``BUSY_MIN_W``, as for a stalled counter).  A power
    monitor on a working board jitters by at least its last bit from one conversion to the next; one
    whose value files stop changing under load has frozen (its driver or bus stalled)."""
    t, x = np.asarray(t_s, dtype=np.float64), np.asarray(w, dtype=np.float64)
    if t.size < 2:
        return []
    busy_w = max(BUSY_MIN_W, BUSY_FRACTION * float(np.max(x)))
    changes = np.flatnonzero(np.diff(x) != 0)
    first = np.concatenate(([0], changes + 1))
    last = np.concatenate((changes, [t.size - 1]))
    keep = (t[last] - t[first] >= min_s) & (x[first] >= busy_w)
    return [Frozen(float(t[a]), float(t[b]), float(x[a])) for a, b in zip(first[keep], last[keep])]


class _Series:
    def __init__(self) -> None:
        self.t: list[float] = []
        self.v: list[float] = []

    def arrays(self, lo_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        t, v = np.asarray(self.t, dtype=np.float64), np.asarray(self.v, dtype=np.float64)
        if lo_s is not None and t.size:
            keep = t >= lo_s
            t, v = t[keep], v[keep]
        return t, v


class PendingPolled(Deferred):
    """A window of a :class:`PolledSensor`: final once the thread has polled past its end."""

    def __init__(self, sensor: "PolledSensor", start_s: float, end_s: float) -> None:
        self.sensor, self.start_s, self.end_s = sensor, start_s, end_s
        self._result: list[EnergyReading] | None = None

    def ready(self) -> bool:
        return self._result is not None or self.sensor.polled_until() >= self.end_s + self.sensor.settle_s

    def result(self) -> list[EnergyReading]:
        if self._result is None:
            self._result = self.sensor.readings(self.start_s, self.end_s)
        return self._result


def _relabel(est: WindowEstimate, prefix: str) -> str:
    return {"nvml.samples": f"{prefix}.power", "nvml.counter": f"{prefix}.counter"}.get(est.source, est.source)


def _fmt_j(x: float) -> str:
    return f"{x:.3g} J" if abs(x) < 100 else f"{x:.0f} J"


class PolledSensor(SensorBase):
    """Energy per window of each channel of a :class:`Platform`, polled by one thread (see the module
    docstring).  ``threaded=False``: the caller polls with :meth:`poll` (tests, replays)."""

    supports_cut = True
    supports_energy_windows = True
    supports_trace = True

    def __init__(self, platform: Platform, *, threaded: bool = True,
                 clock_ns: Callable[[], int] = time.monotonic_ns, startup_check_s: float = 0.6) -> None:
        self.platform = platform
        self.name = platform.name
        self._clock = clock_ns
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._counter = {c.component: _Series() for c in platform.channels}
        self._power = {c.component: _Series() for c in platform.channels}
        self._errors: dict[str, str] = {}
        self._last_poll_s = -math.inf
        self._polls = 0
        self._cpu_s = 0.0
        self.startup: dict[str, CounterCheck] = {}
        self._thread: threading.Thread | None = None
        self.poll()
        if threaded:
            self._thread = threading.Thread(target=self._run, name=f"ipw-{self.name}-poller", daemon=True)
            self._thread.start()
            if startup_check_s > 0 and any(c.has_counter and c.has_power for c in platform.channels):
                time.sleep(startup_check_s)  # Zeus waits 0.5 s for the same check
                self.startup = self.check(self._clock() / 1e9 - startup_check_s - 1.0, startup=True)

    # -- polling -------------------------------------------------------------------------------

    def poll(self) -> None:
        """Read every channel once (the thread calls this every ``platform.period_s``)."""
        t0 = self._clock()
        try:
            p = self.platform.read()
        except Exception as exc:  # a broken read is recorded, never kills the thread
            p = Poll(errors={c.component: f"{type(exc).__name__}: {exc}" for c in self.platform.channels})
        t_s = (t0 + self._clock()) / 2e9
        with self._lock:
            for comp, j in p.counter_j.items():
                self._counter[comp].t.append(t_s)
                self._counter[comp].v.append(float(j))
            for comp, w in p.power_w.items():
                self._power[comp].t.append(t_s)
                self._power[comp].v.append(float(w))
            self._errors.update(p.errors)
            self._last_poll_s = t_s
            self._polls += 1

    def _run(self) -> None:
        cpu0 = time.thread_time()
        period = self.platform.period_s
        while not self._stop.wait(period):
            self.poll()
            self._cpu_s = time.thread_time() - cpu0

    @property
    def settle_s(self) -> float:
        """How long after a window's end its result is final: one poll, and for a channel with only a
        counter, one update of the counter too (its energy up to the end shows only then)."""
        counter_only = any(c.has_counter and not c.has_power for c in self.platform.channels)
        return self.platform.period_s + (self.platform.counter_step_s if counter_only else 0.0)

    def polled_until(self) -> float:
        """Monotonic seconds up to which windows are final (``inf`` once stopped)."""
        if self._stop.is_set() or (self._thread is not None and not self._thread.is_alive()):
            return math.inf
        return self._last_poll_s

    # -- estimates -------------------------------------------------------------------------------

    def _arrays(self, comp: str, lo_s: float | None) -> dict[str, Any]:
        channel = next(c for c in self.platform.channels if c.component == comp)
        with self._lock:
            ct, cj = self._counter[comp].arrays(lo_s)
            pt, pw = self._power[comp].arrays(lo_s)
        max_w = float(np.max(pw)) if pw.size else None
        cj, wraps, backwards = unwrap_counter(ct, cj, channel.counter_range_j, max_w)
        return {"ct": ct, "cj": cj, "pt": pt, "pw": pw, "wraps": wraps, "backwards": backwards, "channel": channel}

    def observed_step_s(self) -> dict[str, float]:
        """Per channel with a counter, the median time between changes of its value so far (the counter's
        update period as seen here, to compare with ``platform.counter_step_s``); left out before three
        changes."""
        out = {}
        for c in self.platform.channels:
            a = self._arrays(c.component, None)
            knots, _ = counter_change_points(a["ct"], a["cj"]) if a["ct"].size >= 2 else (np.zeros(0), None)
            if knots.size >= 3:
                out[c.component] = round(float(np.median(np.diff(knots))), 3)
        return out

    def check(self, lo_s: float | None = None, *, startup: bool = False) -> dict[str, CounterCheck]:
        """:func:`counter_checks` of each channel with a counter over what was recorded since ``lo_s``.
        ``startup``: Zeus's check over its first half second (ml-energy/zeus zeus/device/gpu/amd.py:
        energy vs power x 0.5 s), loose: a ratio within 0.1-1.9 over any span of 3 updates."""
        out = {}
        for c in self.platform.channels:
            if not c.has_counter:
                continue
            a = self._arrays(c.component, lo_s)
            out[c.component] = counter_checks(
                a["ct"], a["cj"], a["pt"] if c.has_power else None, a["pw"] if c.has_power else None,
                step_s=self.platform.counter_step_s, tolerance=max(c.tolerance, 0.9) if startup else c.tolerance,
                backwards_at_s=a["backwards"], min_span_s=3 * self.platform.counter_step_s if startup else None)
        return out

    def energy_windows(self, windows: list[tuple[float, float]], **kwargs: Any) -> dict[str, list[WindowEstimate]]:
        """Per component with readings (rails inside another channel left out), one estimate per
        (start_s, end_s) window; a distrusted counter is not used."""
        inside = {c.component for c in self.platform.channels if c.part_of is not None}
        return {comp: [e for e, _ in ests] for comp, ests in self._estimate(windows).items() if comp not in inside}

    def _estimate(self, windows: list[tuple[float, float]]) -> dict[str, list[tuple[WindowEstimate, list[str]]]]:
        newest = self._last_poll_s
        lo = min([newest - LOOKBACK_S] + [w[0] - 2.0 for w in windows])
        out = {}
        for c in self.platform.channels:
            a = self._arrays(c.component, lo)
            notes: list[str] = []
            use_counter = c.has_counter and a["ct"].size >= 2
            if use_counter:
                verdict = counter_checks(a["ct"], a["cj"], a["pt"] if c.has_power else None,
                                         a["pw"] if c.has_power else None, step_s=self.platform.counter_step_s,
                                         tolerance=c.tolerance, backwards_at_s=a["backwards"])
                bad = [*self.startup.get(c.component, CounterCheck(True)).problems, *verdict.problems]
                if bad and c.has_power and a["pt"].size >= 2:
                    notes.append("counter distrusted, not used: " + "; ".join(dict.fromkeys(bad)))
                    use_counter = False
                elif bad:
                    notes.append("counter check: " + "; ".join(dict.fromkeys(bad)))
                if a["wraps"]:
                    notes.append(f"counter wrapped {a['wraps']}x (range {c.counter_range_j:.6g} J, undone)")
            estimates = estimate_windows(
                a["pt"] if c.has_power else None, a["pw"] if c.has_power else None,
                a["ct"] if use_counter else None, a["cj"] if use_counter else None, windows,
                short_window_s=max(self.platform.counter_step_s, self.platform.period_s),
                max_gap_s=max(MAX_INSTANT_GAP_S, 5 * self.platform.period_s),  # as NVML's instant points
                reading_period_s=c.power_average_s, error_model=POLLED_ERROR_MODEL,
            )
            if c.has_counter and not c.has_power:
                estimates = [self._unmoved(e, a["ct"], a["cj"], c.counter_resolution_j) for e in estimates]
            if c.has_power and self.platform.frozen_after_s is not None:
                estimates = self._frozen(estimates, frozen_spans(a["pt"], a["pw"], self.platform.frozen_after_s))
            out[c.component] = [(replace(e, source=_relabel(e, c.prefix)), notes) for e in estimates]
        return self._all_unmoved(out, len(windows))

    def _frozen(self, estimates: list[WindowEstimate], spans: list[Frozen]) -> list[WindowEstimate]:
        """Windows that a frozen span of the power readings reaches (within one poll) are ``unavailable``,
        said so: the readings there are one value repeated, not a measurement."""
        if not spans:
            return estimates
        out = []
        reach = self.platform.period_s
        for e in estimates:
            hit = next((f for f in spans if f.start_s - reach <= e.end_s and e.start_s <= f.end_s + reach), None)
            if hit is not None:
                e = replace(e, energy_j=None, coverage=0.0, quality="unavailable", uncertainty_j=None,
                            note=f"power monitor frozen: {hit.power_w:.3g} W unchanged for {hit.end_s - hit.start_s:.1f} s "
                                 "while busy; not used")
            out.append(e)
        return out

    def _all_unmoved(self, out: dict[str, list[tuple[WindowEstimate, list[str]]]], n: int) -> dict[str, list[tuple[WindowEstimate, list[str]]]]:
        """Where every counter-only channel is unmoved around a window (:meth:`_unmoved`), the counters
        stalled: a running chip's CPU rail is never at 0 J.  Those windows are ``unavailable``, said so."""
        only = [c.component for c in self.platform.channels if c.has_counter and not c.has_power]
        if len(only) < 2:
            return out
        for k in range(n):
            if all(out[comp][k][0].note.startswith(UNMOVED) for comp in only):
                for comp in only:
                    est, notes = out[comp][k]
                    out[comp][k] = (replace(est, energy_j=None, coverage=0.0, quality="unavailable",
                                            note=f"no counter of {self.name} moved around the window: stalled, not used"),
                                    notes)
        return out

    def _unmoved(self, est: WindowEstimate, ct: np.ndarray, cj: np.ndarray, resolution_j: float | None) -> WindowEstimate:
        """A counter-only channel whose counter did not change from a read before the window to a read
        an update period after it: 0 J, said so (idle, e.g. an unused ANE; no power reading tells a
        stalled counter apart).  The estimator has no change points to interpolate there."""
        if est.energy_j is not None or ct.size < 2:
            return est
        step = self.platform.counter_step_s
        around = (ct >= est.start_s - step) & (ct <= est.end_s + step)
        if ct[0] > est.start_s or ct[-1] < est.end_s + step or around.sum() < 2 or np.ptp(cj[around]) != 0:
            return est
        return replace(est, energy_j=0.0, coverage=1.0, quality="measured_interpolated", source="nvml.counter",
                       uncertainty_j=resolution_j,  # less than one count moved
                       note=f"{UNMOVED} from {step:g} s before to {step:g} s after the window: 0 J (idle; the "
                            "sensor's other counters moved)")

    def readings(self, start_s: float, end_s: float) -> list[EnergyReading]:
        """One reading per channel for ``[start_s, end_s]``; never raises."""
        try:
            per = self._estimate([(start_s, end_s)])
        except Exception as exc:  # never an exception into the runner
            return [EnergyReading(c.component, None, f"{c.prefix}.power", "unavailable", c.scope, end_s - start_s,
                                  note=f"estimate failed: {type(exc).__name__}: {exc}")
                    for c in self.platform.channels if c.part_of is None]
        out = []
        for c in self.platform.channels:
            if c.part_of is not None:
                continue
            est, notes = per[c.component][0]
            parts = [n for n in (c.note, *notes, est.note) if n]
            rails = [(r.note or r.component, per[r.component][0][0]) for r in self.platform.channels
                     if r.part_of == c.component]
            if rails:
                parts.append("inside it: " + ", ".join(
                    f"{name} {'-' if e.energy_j is None else _fmt_j(e.energy_j)}" for name, e in rails))
            if est.calibration_ratio is not None:
                parts.append(f"calibration ratio {est.calibration_ratio:.4f}")
            if est.counter_delta_j is not None:
                parts.append(f"counter delta {_fmt_j(est.counter_delta_j)}")
            if est.short_window and est.uncertainty_j is not None:
                parts.append(f"short window (counter updates every {self.platform.counter_step_s:g} s): "
                             f"±{_fmt_j(est.uncertainty_j)}")
            if c.component in self._errors and est.coverage < 1.0:
                parts.append(f"last error: {self._errors[c.component]}")
            energy_j = est.energy_j if est.quality != "unavailable" else None
            ok = energy_j is not None
            out.append(EnergyReading(
                component=c.component, energy_j=max(0.0, float(energy_j)) if energy_j is not None else None,
                source=est.source or f"{c.prefix}.power", quality=est.quality if ok else "unavailable",
                scope=c.scope, duration_s=end_s - start_s, note="; ".join(parts),
                uncertainty_j=est.uncertainty_j if ok else None))
        return out

    # -- the sensor contract ---------------------------------------------------------------------

    def info(self) -> SensorInfo:
        first = self.platform.channels[0]
        source = f"{first.prefix}.power" if first.has_power else f"{first.prefix}.counter"
        quality: Quality = "measured_interpolated"
        startup = {k: list(v.problems) for k, v in self.startup.items() if not v.ok}
        detail = self.platform.describe()
        observed = self.observed_step_s()
        if observed:
            detail += "; counter updates seen every " + ", ".join(f"{k} {v:g} s" for k, v in observed.items())
        if startup:
            detail += "; counter distrusted at start-up: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in startup.items())
        return SensorInfo(
            name=self.name, available=True, source=source, quality=quality, scope=first.scope,
            components=tuple(c.component for c in self.platform.channels if c.part_of is None), detail=detail,
            params={"period_s": self.platform.period_s, "counter_step_s": self.platform.counter_step_s,
                    "channels": [{"component": c.component, "scope": c.scope, "counter": c.has_counter,
                                  "power": c.has_power, "counter_range_j": c.counter_range_j,
                                  "tolerance": c.tolerance, "part_of": c.part_of} for c in self.platform.channels],
                    "observed_counter_step_s": observed, "startup_check": startup, **self.platform.params()},
        )

    def begin(self, t_s: float | None = None) -> float:
        return self._clock() / 1e9 if t_s is None else t_s

    def end(self, token: float, t_s: float | None = None) -> PendingPolled:
        return PendingPolled(self, float(token), self._clock() / 1e9 if t_s is None else t_s)

    def cut(self, token: float, t_s: float | None = None) -> tuple[PendingPolled, float]:
        pending = self.end(token, t_s)
        return pending, pending.end_s

    def trace(self, since_s: float | None = None) -> dict[str, Any]:
        """Columns for ``power.parquet``: t_s, device, power_w, kind (``power`` | ``counter``), energy_j."""
        parts = []
        for c in self.platform.channels:
            a = self._arrays(c.component, since_s)
            n, m = a["pt"].size, a["ct"].size
            parts.append((np.concatenate((a["pt"], a["ct"])), np.full(n + m, c.component, dtype=object),
                          np.concatenate((a["pw"], np.full(m, np.nan))),
                          np.array(["power"] * n + ["counter"] * m, dtype=object),
                          np.concatenate((np.full(n, np.nan), a["cj"]))))
        keys = ("t_s", "device", "power_w", "kind", "energy_j")
        return {k: (np.concatenate([p[i] for p in parts]) if parts else np.zeros(0)) for i, k in enumerate(keys)}

    def overhead(self) -> dict[str, Any]:
        return {"cpu_s": round(self._cpu_s, 6), "polls": self._polls, "period_s": self.platform.period_s,
                "threaded": self._thread is not None}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self.platform.close()
