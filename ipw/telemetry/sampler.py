"""One background thread that owns every NVML handle and records what the GPU driver reports.

Per GPU it records three signals, all on the monotonic clock (``time.monotonic_ns``):

- the cumulative energy counter (``nvmlDeviceGetTotalEnergyConsumption``, mJ, ~100 ms steps), read
  every ``counter_period_s`` and once more at the end of a long window (see :meth:`NvmlSampler.mark`).
  By default the period adapts to what a read costs: 0.25 s where a read is cheap, slower where it is
  not (a read costs ~3-5 ms of CPU on an H200 in a VM), so that counter reads use at most
  ``COUNTER_CPU_BUDGET`` of one core, and never slower than ``MAX_COUNTER_PERIOD_S``;
- the driver's power-sample buffer (``nvmlDeviceGetSamples(NVML_TOTAL_POWER_SAMPLES, last_seen)``,
  ~20 ms samples, ~2.4 s deep, ~0.3 ms a call), polled every ``samples_period_s`` (1 s), and sooner
  when a window closes so that its energy is final about 60 ms after its end;
- the instant-power field (``NVML_FI_DEV_POWER_INSTANT``, ~100 ms updates, a few µs), read every
  ``instant_period_s`` (0.25 s): the last fallback and the live display.

It also *watches* other GPUs (``watch``: the machine's GPUs that are not measured), reading only their
instant power every ``watch_period_s`` (0.25 s, a few µs a read), so that a window can report
*foreign activity*: a GPU outside the measurement that was busy during it (:meth:`NvmlSampler.foreign_activity`).

The 1 s averaged power (``nvmlDeviceGetPowerUsage``, ``NVML_FI_DEV_POWER_AVERAGE``) is never read:
integrated over a window it is off by up to +84% (docs/ARCHITECTURE.md, 'Energy method').

Driver sample timestamps are wall-clock µs; each buffer poll also records a (monotonic, wall) clock
pair, and the samples are converted to monotonic time with
:func:`ipw.telemetry.integrals.wall_us_to_mono_s` over the most recent pairs.

The thread sleeps on an ``Event`` until the next read is due (never a busy loop) and measures its
own CPU time with ``time.thread_time()``: :meth:`NvmlSampler.overhead`.  Energy per window comes from
:func:`ipw.telemetry.estimator.estimate_windows` (samples integrated with edge interpolation, scaled by
the counter over a long enclosing span): :meth:`NvmlSampler.energy_windows`.

Tests drive the sampler without the thread: ``start(threaded=False)``, then ``run_due()`` at the
times ``next_due_ns()`` asks for, against a fake clock (tests/telemetry/test_nvml_sampler.py).
"""

from __future__ import annotations

import bisect
import math
import statistics
import threading
import time
from types import ModuleType
from typing import Any, Callable, Sequence

import numpy as np

from ipw.telemetry.estimator import WindowEstimate
from ipw.telemetry.foreign import FOREIGN_IDLE_READS, foreign_verdict
from ipw.telemetry.integrals import wall_us_to_mono_s
from ipw.telemetry.nvml_estimate import estimate_recorded
from ipw.telemetry.nvml_reads import KINDS, Columns, GpuState, call_nvml, decode_samples, value_attr

#: Counter reads: every 0.25 s where a read is cheap ...
DEFAULT_COUNTER_PERIOD_S = 0.25
#: ... but slower where it is not, so that counter reads use at most this share of one core (a read
#: costs ~4 ms of CPU on an H200 in a VM: every ~0.7 s there).  The sampler's budget is 2%.
COUNTER_CPU_BUDGET = 0.006
#: The adaptive counter period never exceeds this.
MAX_COUNTER_PERIOD_S = 2.0
#: Instant-power reads (a few µs each): 4 a second, inside the estimator's 0.5 s gap limit.
DEFAULT_INSTANT_PERIOD_S = 0.25
#: Driver sample-buffer polls: about once a second (the buffer holds ~2.4 s of 20 ms samples).
DEFAULT_SAMPLES_PERIOD_S = 1.0
#: A window is final once the sample buffer has been polled this long after its end: the driver
#: stamps a sample ~10-20 ms after the power it reports and posts it a little later.
SETTLE_MARGIN_S = 0.06
#: Polls asked for by closing windows are at least this far apart (many short queries share a poll).
MIN_SAMPLES_POLL_INTERVAL_S = 0.2
#: Counter reads asked for at the end of long windows are at least this far apart (its step is ~0.1 s).
MIN_COUNTER_INTERVAL_S = 0.1
#: Driver sample timestamps trail the power they report.  On the H200 the samples cross half way
#: between two power levels a median 11.9 ms after the host starts or stops a load (43 edges in two
#: runs of bench/telemetry/attribution.py and the doctor's self-test: rises 9.8 ms, falls 13.3 ms, range
#: 6-19 ms; the recordings in tests/data gave 12-16 ms by correlation): docs/ENERGY.md.  Integration
#: moves samples this much earlier.  It matters for isolated short windows (without it a 50 ms burst
#: after idle loses ~11 ms of its power); over back-to-back or long windows it mostly cancels (the
#: bench's medians move by < 0.7 percentage point between 0 and 20 ms).
DEFAULT_SAMPLE_SHIFT_S = 0.011
#: Calibration uses at most this much history before the oldest window and the newest data.
CALIBRATION_LOOKBACK_S = 600.0
#: Clock pairs whose two monotonic reads are further apart than this were preempted: dropped.
MAX_PAIR_SPREAD_NS = 200_000
#: Clock pairs kept around the samples being converted (median-smoothed by the estimator).
_PAIRS_FOR_CONVERSION = 9
#: Watched (not measured) GPUs: their instant power is read this often.
DEFAULT_WATCH_PERIOD_S = 0.25


def _request(requests: list[int], t_ns: int) -> bool:
    """Ask for a read at ``t_ns`` (``requests``: sorted, monotonic ns); whether it is now the earliest asked for.
    Only then need the thread be woken: it sleeps until the earliest, and after that read it looks again (a
    window every millisecond would otherwise wake it every millisecond)."""
    bisect.insort(requests, t_ns)
    return requests[0] == t_ns


class NvmlSampler:
    """Background recorder of every NVML power signal of ``gpus`` (see the module docstring).

    ``nvml`` is the (initialised) pynvml module; ``gpus`` have ``component`` and ``handle``.  Nothing
    but this object's thread calls NVML once :meth:`start` has run.  All public times are monotonic
    seconds (``time.monotonic_ns() / 1e9``).
    """

    def __init__(
        self,
        nvml: ModuleType,
        gpus: Sequence[Any],
        *,
        counter_period_s: float | None = None,
        samples_period_s: float = DEFAULT_SAMPLES_PERIOD_S,
        instant_period_s: float | None = DEFAULT_INSTANT_PERIOD_S,
        sample_shift_s: float = DEFAULT_SAMPLE_SHIFT_S,
        settle_margin_s: float = SETTLE_MARGIN_S,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        wall_ns: Callable[[], int] = time.time_ns,
        watch: Sequence[Any] = (),
        watch_period_s: float = DEFAULT_WATCH_PERIOD_S,
    ) -> None:
        if (counter_period_s is not None and counter_period_s <= 0) or samples_period_s <= 0 or (
            instant_period_s is not None and instant_period_s <= 0
        ) or watch_period_s <= 0:
            raise ValueError("sampler periods must be positive")
        self._nvml = nvml
        self._gpus = [GpuState(g) for g in gpus]
        self._watch = [GpuState(g) for g in watch]  # instant power only, for foreign activity
        self._power_limit_w: dict[str, float | None] = {}
        self.watch_period_s = float(watch_period_s)
        self._next_watch_ns = 0
        self.counter_adaptive = counter_period_s is None
        self.counter_period_s = DEFAULT_COUNTER_PERIOD_S if counter_period_s is None else float(counter_period_s)
        self.samples_period_s = float(samples_period_s)
        self.instant_enabled = instant_period_s is not None
        self.instant_period_s = float(instant_period_s) if instant_period_s is not None else None
        self._counter_cpu_s: float | None = None  # smoothed CPU seconds of one round of counter reads
        self.sample_shift_s = float(sample_shift_s)
        self.settle_margin_s = float(settle_margin_s)
        self._clock = clock_ns
        self._wall = wall_ns
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._alive = False
        self._fatal = ""
        self._started_ns: int | None = None
        self._stopped_ns: int | None = None
        self._next_counter_ns = 0
        self._next_instant_ns = 0
        self._next_samples_ns = 0
        self._last_counter_ns: int | None = None
        self._last_samples_poll_ns: int | None = None
        self._last_instant_ns: int | None = None
        self._sample_requests: list[int] = []  # sorted monotonic ns at which a poll was asked for
        self._counter_requests: list[int] = []
        self._pairs = Columns(2)  # (monotonic ns, wall µs) as floats: exact below 2**53
        self._calls = {k: 0 for k in (*KINDS, "watch")}
        self._call_s = {k: 0.0 for k in (*KINDS, "watch")}
        self._iterations = 0
        self._cpu_s = 0.0

    # ------------------------------------------------------------------------------------------
    # lifecycle

    def start(self, threaded: bool = True) -> dict[str, dict[str, str]]:
        """Probe each signal of each GPU once, then (``threaded``) start the thread.

        Returns ``{component: {kind: status}}``, status ``ok``, ``unsupported`` or ``failed: ...``.
        Without the thread, the caller drives :meth:`run_due` (tests, replays).
        """
        if self._started_ns is not None:
            raise RuntimeError("sampler already started")
        self._started_ns = self._clock()
        if threaded:
            probed = threading.Event()
            self._alive = True
            self._thread = threading.Thread(
                target=self._run, args=(probed,), name="ipw-nvml-sampler", daemon=True
            )
            self._thread.start()
            probed.wait(30.0)
        else:
            self._probe()
        return self.signals()

    def stop(self) -> None:
        """Stop the thread (idempotent).  Recorded data stays readable."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        if self._stopped_ns is None:
            self._stopped_ns = self._clock()
        self._alive = False

    @property
    def alive(self) -> bool:
        """True while the thread runs (always True for an unthreaded, started sampler)."""
        if self._started_ns is None or self._stop.is_set():
            return False
        return self._alive if self._thread is not None else True

    def signals(self) -> dict[str, dict[str, str]]:
        out = {}
        for g in self._gpus:
            out[g.gpu.component] = {
                k: (s.status if not s.error or s.status == "ok" else f"{s.status}: {s.error}")
                for k, s in g.kinds.items()
            }
        return out

    def _run(self, probed: threading.Event) -> None:
        cpu0 = time.thread_time()
        try:
            self._probe()
            probed.set()
            while not self._stop.is_set():
                self._wake.clear()
                self.run_due()
                self._cpu_s = time.thread_time() - cpu0
                delay_s = (self.next_due_ns() - self._clock()) / 1e9
                if delay_s > 0:
                    self._wake.wait(min(delay_s, 5.0))
        except BaseException as exc:  # never dies silently: windows become final and say why
            self._fatal = f"{type(exc).__name__}: {exc}"
        finally:
            probed.set()
            self._cpu_s = time.thread_time() - cpu0
            self._alive = False

    # ------------------------------------------------------------------------------------------
    # scheduling

    def _probe(self) -> None:
        now = self._clock()
        self._poll_samples(now)
        self._read_counter(now, adapt=False)  # a first call costs more than the rest
        self._read_instant(now)
        self._probe_limits()
        self._read_watch(now)
        self._next_watch_ns = now + int(self.watch_period_s * 1e9)
        self._next_samples_ns = now + int(self.samples_period_s * 1e9)
        self._next_counter_ns = now + int(self.counter_period_s * 1e9)
        if self.instant_period_s is not None:
            self._next_instant_ns = now + int(self.instant_period_s * 1e9)

    def _active(self, kind: str) -> bool:
        if kind == "watch":
            return any(g.kinds["instant"].status in ("ok", "unknown") for g in self._watch)
        if kind == "instant" and not self.instant_enabled:
            return False
        return any(g.kinds[kind].status in ("ok", "unknown") for g in self._gpus)

    def _requested_samples_ns(self) -> int | None:
        with self._lock:
            if not self._sample_requests:
                return None
            first = self._sample_requests[0]
        floor = (self._last_samples_poll_ns or 0) + int(MIN_SAMPLES_POLL_INTERVAL_S * 1e9)
        return max(first, floor)

    def _requested_counter_ns(self) -> int | None:
        with self._lock:
            if not self._counter_requests:
                return None
            first = self._counter_requests[0]
        floor = (self._last_counter_ns or 0) + int(MIN_COUNTER_INTERVAL_S * 1e9)
        return max(first, floor)

    def next_due_ns(self) -> int:
        """When the next read is due (monotonic ns); far in the future when nothing is active."""
        due = [self._next_samples_ns if self._active("samples") else None,
               self._next_counter_ns if self._active("counter") else None,
               self._next_instant_ns if self._active("instant") else None,
               self._next_watch_ns if self._active("watch") else None,
               self._requested_samples_ns() if self._active("samples") else None,
               self._requested_counter_ns() if self._active("counter") else None]
        known = [d for d in due if d is not None]
        return min(known) if known else self._clock() + int(3600e9)

    def run_due(self, now_ns: int | None = None) -> None:
        """Do every read that is due at ``now_ns`` (default: the clock's now)."""
        now = self._clock() if now_ns is None else now_ns
        self._iterations += 1
        req_s = self._requested_samples_ns()
        if now >= self._next_samples_ns or (req_s is not None and now >= req_s):
            self._poll_samples(now)
            self._next_samples_ns = now + int(self.samples_period_s * 1e9)
            with self._lock:
                self._sample_requests = [r for r in self._sample_requests if r > now]
        req_c = self._requested_counter_ns()
        if now >= self._next_counter_ns or (req_c is not None and now >= req_c):
            self._read_counter(now)
            self._next_counter_ns = now + int(self.counter_period_s * 1e9)
            with self._lock:
                self._counter_requests = [r for r in self._counter_requests if r > now]
        if self.instant_period_s is not None and now >= self._next_instant_ns:
            self._read_instant(now)
            self._next_instant_ns = now + int(self.instant_period_s * 1e9)
        if self._watch and now >= self._next_watch_ns:
            self._read_watch(now)
            self._next_watch_ns = now + int(self.watch_period_s * 1e9)

    def mark(self, t_s: float, *, counter: bool = False) -> float:
        """A window ended at ``t_s``: poll the sample buffer at ``t_s + settle margin`` (rather than at
        the next regular poll) and, with ``counter``, read the counter once more at ``t_s``.

        Returns the time after which :meth:`settled_until` will pass ``t_s``.
        """
        due_ns = int(round((t_s + self.settle_margin_s) * 1e9))
        with self._lock:
            wake = _request(self._sample_requests, due_ns)
            if counter:
                wake = _request(self._counter_requests, int(round(t_s * 1e9))) or wake
        if wake:
            self._wake.set()
        return due_ns / 1e9

    def mark_begin(self, t_s: float) -> None:
        """A window begins at ``t_s``: move the next counter read here when it is due soon anyway
        (at least 3/4 of the counter period since the last read), so long windows have a read at
        each edge for their counter delta, at no more than 4/3 of the periodic read rate."""
        last = self._last_counter_ns
        if last is not None and t_s * 1e9 - last < 0.75 * self.counter_period_s * 1e9:
            return
        with self._lock:
            wake = _request(self._counter_requests, int(round(t_s * 1e9)))
        if wake:
            self._wake.set()

    def settled_until(self) -> float:
        """Monotonic seconds up to which windows are final: every active signal of every GPU has
        been read far enough past it.  ``inf`` once the sampler has stopped or died (nothing more
        will come) and for GPUs on which every signal failed."""
        if not self.alive:
            return math.inf
        until = math.inf
        margin = self.settle_margin_s
        for g in self._gpus:
            if g.kinds["samples"].status == "ok" and self._last_samples_poll_ns is not None:
                until = min(until, self._last_samples_poll_ns / 1e9 - margin)
            elif g.kinds["samples"].status == "unknown":
                until = min(until, -math.inf)
            else:
                for kind, last in (("counter", self._last_counter_ns), ("instant", self._last_instant_ns)):
                    if g.kinds[kind].status in ("ok", "unknown"):
                        until = min(until, -math.inf if last is None else last / 1e9 - max(margin, 0.11))
        return until

    # ------------------------------------------------------------------------------------------
    # reads (sampler thread only)

    def _call(self, g: GpuState, kind: str, fn: Callable[[], Any], count_as: str | None = None) -> Any:
        """Run one NVML call (:func:`ipw.telemetry.nvml_reads.call_nvml`); None when it failed."""
        out, took_s = call_nvml(self._nvml, g.kinds[kind], kind, fn)
        if took_s is not None:
            counted = count_as or kind
            self._calls[counted] += 1
            self._call_s[counted] += took_s
        return out

    def _clock_pair(self) -> None:
        m1 = self._clock()
        w = self._wall()
        m2 = self._clock()
        if m2 - m1 <= MAX_PAIR_SPREAD_NS:
            self._pairs.append(float((m1 + m2) // 2), float(w // 1000))

    def _poll_samples(self, now_ns: int) -> None:
        if not self._active("samples"):
            return
        nvml = self._nvml
        kind_total = getattr(nvml, "NVML_TOTAL_POWER_SAMPLES", 0)
        self._clock_pair()
        for g in self._gpus:
            out = self._call(g, "samples", lambda: nvml.nvmlDeviceGetSamples(g.gpu.handle, kind_total, g.last_sample_ts_us))
            if not out:
                continue
            ts, mw = decode_samples(nvml, out, g.last_sample_ts_us)
            if ts.size == 0:
                continue
            if g.last_sample_ts_us and ts[0] - g.last_sample_ts_us > 250_000:
                g.sample_gaps += 1  # the buffer wrapped before this poll: samples were lost
            pm = np.array(self._pairs.cols[0][-_PAIRS_FOR_CONVERSION:], dtype=np.float64)
            pw = np.array(self._pairs.cols[1][-_PAIRS_FOR_CONVERSION:], dtype=np.float64)
            if pm.size:
                t_s = wall_us_to_mono_s(ts, pm.astype(np.int64), pw.astype(np.int64))
            else:  # no clean pair yet: the clocks read now
                t_s = (ts * 1000 + (self._clock() - self._wall())) / 1e9
            with self._lock:
                g.samples.extend(t_s.tolist(), (mw / 1000.0).tolist())
            g.last_sample_ts_us = int(ts[-1])
        self._last_samples_poll_ns = now_ns

    def _read_counter(self, now_ns: int, adapt: bool = True) -> None:
        nvml = self._nvml
        if not self._active("counter"):
            return
        cpu0 = time.thread_time()
        for g in self._gpus:
            t0 = self._clock()
            mj = self._call(g, "counter", lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(g.gpu.handle))
            t1 = self._clock()
            if mj is not None:
                with self._lock:
                    g.counter.append((t0 + t1) / 2e9, int(mj) / 1000.0)
        cost = time.thread_time() - cpu0
        if adapt:
            cpu_s = cost if self._counter_cpu_s is None else 0.8 * self._counter_cpu_s + 0.2 * cost
            self._counter_cpu_s = cpu_s
            if self.counter_adaptive:
                period = cpu_s / COUNTER_CPU_BUDGET
                self.counter_period_s = min(MAX_COUNTER_PERIOD_S, max(DEFAULT_COUNTER_PERIOD_S, period))
        self._last_counter_ns = now_ns

    def _instant_of(self, g: GpuState, count_as: str | None = None) -> None:
        """Read one GPU's instant-power field into ``g.instant``."""
        nvml = self._nvml
        fid = getattr(nvml, "NVML_FI_DEV_POWER_INSTANT", 186)
        t0 = self._clock()
        fv = self._call(g, "instant", lambda: nvml.nvmlDeviceGetFieldValues(g.gpu.handle, [fid]), count_as)
        t1 = self._clock()
        if fv is None:
            return
        v = fv[0]
        ret = getattr(v, "nvmlReturn", 0)
        if ret != getattr(nvml, "NVML_SUCCESS", 0):
            g.kinds["instant"].field_error(nvml, ret)
            return
        with self._lock:
            g.instant.append((t0 + t1) / 2e9, float(getattr(v.value, value_attr(nvml, v.valueType))) / 1000.0)
            if count_as == "watch" and len(g.instant) >= FOREIGN_IDLE_READS:
                g.idle_w = min(g.idle_w, statistics.median(g.instant.cols[1][-FOREIGN_IDLE_READS:]))

    def _read_instant(self, now_ns: int) -> None:
        if not self._active("instant"):
            return
        for g in self._gpus:
            self._instant_of(g)
        self._last_instant_ns = now_ns

    def _probe_limits(self) -> None:
        """The enforced power limit of each GPU, measured (a window that draws it has a wider interval) or
        watched (its busy threshold); None where unknown."""
        for g in self._gpus + self._watch:
            limit = None
            try:
                mw = self._nvml.nvmlDeviceGetEnforcedPowerLimit(g.gpu.handle)
                if isinstance(mw, (int, float)) and 1_000 <= mw <= 10_000_000:
                    limit = float(mw) / 1000.0
            except Exception:  # best effort: a threshold without the limit is used instead
                pass
            self._power_limit_w[g.gpu.component] = limit

    def _read_watch(self, now_ns: int) -> None:
        if not self._active("watch"):
            return
        for g in self._watch:
            self._instant_of(g, count_as="watch")

    # ------------------------------------------------------------------------------------------
    # results

    def kind_state(self, component: str, kind: str) -> tuple[str, int | None]:
        """(status, last NVML error code) of one signal of one GPU."""
        st = next(g for g in self._gpus if g.gpu.component == component).kinds[kind]
        return st.status, st.error_value

    def components(self) -> list[str]:
        return [g.gpu.component for g in self._gpus]

    def arrays(self, component: str, lo_s: float | None = None) -> dict[str, np.ndarray]:
        """Copies of one GPU's recorded signals from ``lo_s`` on (monotonic seconds)."""
        g = next(g for g in self._gpus if g.gpu.component == component)
        with self._lock:
            st, sw = g.samples.numpy(lo_s)
            ct, cj = g.counter.numpy(lo_s)
            it, iw = g.instant.numpy(lo_s)
        return {"samples_t_s": st, "samples_w": sw, "counter_t_s": ct, "counter_j": cj,
                "instant_t_s": it, "instant_w": iw}

    def energy_windows(
        self,
        windows: Sequence[tuple[float, float]],
        *,
        calibration_window: tuple[float, float] | None = None,
        sample_shift_s: float | None = None,
    ) -> dict[str, list[WindowEstimate]]:
        """Per GPU, one estimate per ``(start_s, end_s)`` window (monotonic seconds).

        Calibration (counter / integrated samples) is over ``calibration_window`` when given, else
        over everything recorded from ``CALIBRATION_LOOKBACK_S`` before the newest data (or the
        oldest window, whichever is earlier; at most since the sampler started) to the newest data.
        """
        shift = self.sample_shift_s if sample_shift_s is None else sample_shift_s
        out: dict[str, list[WindowEstimate]] = {}
        for g in self._gpus:
            with self._lock:
                newest = max([x[0] for x in (g.samples.last(), g.counter.last()) if x is not None], default=0.0)
            lo = newest - CALIBRATION_LOOKBACK_S
            if windows:
                lo = min(lo, min(w[0] for w in windows) - 2.0)
            if calibration_window is not None:
                lo = min(lo, calibration_window[0] - 2.0)
            a = self.arrays(g.gpu.component, lo)
            ests = estimate_recorded(a, windows, calibration_window=calibration_window, sample_shift_s=shift,
                                     power_limit_w=self._power_limit_w.get(g.gpu.component))
            out[g.gpu.component] = ests
        return out

    def power_limits_w(self) -> dict[str, float | None]:
        """The enforced power limit of each measured GPU (W; None where NVML did not give it)."""
        return {g.gpu.component: self._power_limit_w.get(g.gpu.component) for g in self._gpus}

    def watched(self) -> list[dict[str, Any]]:
        """The watched (not measured) GPUs: component, status of their instant power, power limit."""
        out = []
        for g in self._watch:
            st = g.kinds["instant"]
            out.append({
                "component": g.gpu.component,
                "instant": st.status if not st.error or st.status == "ok" else f"{st.status}: {st.error}",
                "power_limit_w": self._power_limit_w.get(g.gpu.component),
            })
        return out

    def foreign_activity(self, start_s: float, end_s: float) -> list[dict[str, Any]]:
        """The watched GPUs that were busy during ``[start_s, end_s]`` (monotonic s), by
        :func:`foreign_verdict` on their instant power: above their idle (the lowest 1 s median of
        their power since the sampler started) by more than 15% of their power limit (60 W when it
        is unknown), or above 45% of the limit.  One dict per busy GPU (see there)."""
        out: list[dict[str, Any]] = []
        for g in self._watch:
            with self._lock:
                t, w = g.instant.numpy(end_s - CALIBRATION_LOOKBACK_S)
            if t.size == 0:
                continue
            idle = g.idle_w if math.isfinite(g.idle_w) else float(w.min())
            v = foreign_verdict(g.gpu.component, t, w, idle, self._power_limit_w.get(g.gpu.component), start_s, end_s)
            if v is not None:
                out.append(v)
        return out

    def current_power_w(self) -> dict[str, float | None]:
        """Latest power per GPU for a live display: the instant field (read 4x a second) when it
        is recent, else the newest driver sample; None when neither is younger than 3 s."""
        now = self._clock() / 1e9
        out: dict[str, float | None] = {}
        for g in self._gpus:
            with self._lock:
                inst, samp = g.instant.last(), g.samples.last()
            best = None
            for point in (inst, samp):
                if point is not None and now - point[0] < 3.0:
                    best = point[1]
                    break
            out[g.gpu.component] = best
        return out

    def trace(self, since_s: float | None = None) -> dict[str, np.ndarray]:
        """Every recorded point as columns for ``power.parquet``: ``t_s`` (monotonic s), ``device``,
        ``power_w`` (NaN for counter rows), ``kind`` (``sample`` | ``counter`` | ``instant``),
        ``energy_j`` (the cumulative counter, counter rows only).  Sorted by time within a device."""
        cols: dict[str, list[np.ndarray]] = {k: [] for k in ("t_s", "device", "power_w", "kind", "energy_j")}
        for g in self._gpus:
            a = self.arrays(g.gpu.component, since_s)
            parts = [
                (a["samples_t_s"], a["samples_w"], np.full(a["samples_t_s"].size, np.nan), "sample"),
                (a["counter_t_s"], np.full(a["counter_t_s"].size, np.nan), a["counter_j"], "counter"),
                (a["instant_t_s"], a["instant_w"], np.full(a["instant_t_s"].size, np.nan), "instant"),
            ]
            t = np.concatenate([p[0] for p in parts])
            order = np.argsort(t, kind="stable")
            cols["t_s"].append(t[order])
            cols["device"].append(np.full(t.size, g.gpu.component, dtype=object))
            cols["power_w"].append(np.concatenate([p[1] for p in parts])[order])
            cols["energy_j"].append(np.concatenate([p[2] for p in parts])[order])
            cols["kind"].append(np.concatenate([np.full(p[0].size, p[3], dtype=object) for p in parts])[order])
        return {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in cols.items()}

    def overhead(self) -> dict[str, Any]:
        """The sampler's own cost: CPU seconds of its thread, wall seconds it ran, the fraction of
        one core, and calls / mean call time per kind of read."""
        cpu = self._cpu_s  # updated by the thread after every iteration
        start = self._started_ns
        end = self._stopped_ns if self._stopped_ns is not None else self._clock()
        wall = 0.0 if start is None else max(0.0, (end - start) / 1e9)
        return {
            "cpu_s": round(cpu, 6),
            "wall_s": round(wall, 3),
            "cpu_fraction_of_one_core": round(cpu / wall, 6) if wall > 0 else 0.0,
            "calls": dict(self._calls),
            "mean_call_s": {k: (self._call_s[k] / n if n else None) for k, n in self._calls.items()},
            "iterations": self._iterations,
            "errors": {g.gpu.component: {k: s.errors for k, s in g.kinds.items()} for g in self._gpus},
            "watched": {g.gpu.component: g.kinds["instant"].status for g in self._watch},
            "sample_buffer_gaps": {g.gpu.component: g.sample_gaps for g in self._gpus},
            "periods_s": {"counter": self.counter_period_s, "samples": self.samples_period_s,
                          "instant": self.instant_period_s,
                          "watch": self.watch_period_s if self._watch else None},
            "counter_adaptive": self.counter_adaptive,
            "counter_round_cpu_s": self._counter_cpu_s,
            "threaded": self._thread is not None,
            "fatal": self._fatal or None,
        }


__all__ = [
    "DEFAULT_COUNTER_PERIOD_S",
    "DEFAULT_SAMPLES_PERIOD_S",
    "DEFAULT_SAMPLE_SHIFT_S",
    "DEFAULT_WATCH_PERIOD_S",
    "NvmlSampler",
    "SETTLE_MARGIN_S",
]
