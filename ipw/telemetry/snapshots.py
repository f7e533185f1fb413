"""Counters read while a window is open: a :class:`Trace` per window and the :class:`Snapshots` thread
that fills it (docs/ARCHITECTURE.md, 'Energy readings and the metric contract'; the phase split of ``ipw.telemetry.phases`` interpolates these reads).

RAPL and the CPU model read their counters only at a window's edges, so a :class:`Snapshots` thread also
reads them every ``SNAPSHOT_PERIOD_S`` (20 ms; longer when a read costs more than 1% of a core) while a
window is open.  For an in-process engine the CPU model's snapshots read the process CPU clock (ns), else
/proc times.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Callable, Sequence

#: How often RAPL and the CPU model are read while a window is open (at most: see SNAPSHOT_CPU_BUDGET).
SNAPSHOT_PERIOD_S = 0.02
#: The snapshot thread's share of one core: reads that cost more (a large process tree) are spaced out.
SNAPSHOT_CPU_BUDGET = 0.01
#: Linux reports process CPU time in clock ticks.
CPU_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


class Trace:
    """One window's snapshots: times (monotonic s) and counter values (a tuple per snapshot)."""

    def __init__(self, read: Callable[[], Sequence[float]], t_s: float, values: Sequence[float],
                 step: float = 0.0) -> None:
        self.read = read
        self.step = step  # the resolution of one read of a value (e.g. CPU-time ticks)
        self.t_s = [t_s]
        self.values = [tuple(values)]
        self.error = ""


class Snapshots:
    """Reads the counters of every open :class:`Trace` every ``period_s`` from one daemon thread, which
    sleeps on an event while no window is open (never busy-waits) and counts its own CPU time.  When a
    round of reads costs more than ``SNAPSHOT_CPU_BUDGET`` of the period, the period grows to fit it."""

    def __init__(self, period_s: float = SNAPSHOT_PERIOD_S, *, threaded: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s = period_s
        self.threaded = threaded
        self._clock = clock
        self._lock = threading.Lock()
        self._open: list[Trace] = []
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._thread_cpu_s = 0.0
        self._cost_s: float | None = None  # CPU seconds of one round of reads (moving average)
        self.interval_s = period_s  # the period in use
        self._active_s = 0.0
        self._active_since: float | None = None
        self.n_snapshots = 0

    def open(self, read: Callable[[], Sequence[float]], t_s: float, values: Sequence[float],
             step: float = 0.0) -> Trace:
        """Start a trace whose first snapshot (``t_s``, ``values``) the caller took at window begin."""
        trace = Trace(read, t_s, values, step)
        with self._lock:
            if not self._open:
                self._active_since = self._clock()
            self._open.append(trace)
            self._wake.set()
        if self.threaded and self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name="ipw-snapshots", daemon=True)
            self._thread.start()
        return trace

    def close(self, trace: Trace, t_s: float | None = None, values: Sequence[float] | None = None) -> None:
        """End a trace with a last snapshot: the caller's (``t_s``, ``values``), else one read now."""
        with self._lock:
            if trace in self._open:
                self._open.remove(trace)
                if not self._open and self._active_since is not None:
                    self._active_s += self._clock() - self._active_since
                    self._active_since = None
            if values is None or t_s is None:  # (the caller gives both or neither)
                self._snap(trace)
            else:
                trace.t_s.append(t_s)
                trace.values.append(tuple(values))

    def _snap(self, trace: Trace) -> None:
        if trace.error:
            return
        t0 = self._clock()
        try:
            values = tuple(trace.read())
        except Exception as exc:  # a vanished process, a counter gone: this window is not split
            trace.error = f"{type(exc).__name__}: {exc}"
            return
        trace.t_s.append((t0 + self._clock()) / 2)
        trace.values.append(values)
        self.n_snapshots += 1

    def snap(self) -> None:
        """One snapshot of every open trace (what the thread does every period)."""
        with self._lock:
            for trace in self._open:
                self._snap(trace)
            if not self._open:
                self._wake.clear()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()  # no window open: sleep
            due = self._clock() + self.period_s
            while not self._stopped:
                time.sleep(max(0.0, due - self._clock()))
                if self._stopped:
                    break
                before = self._thread_cpu_s
                self.snap()
                self._thread_cpu_s = time.thread_time()  # this thread's CPU time so far
                cost = self._thread_cpu_s - before  # the reads, and sleeping and waking up
                self._cost_s = cost if self._cost_s is None else 0.8 * self._cost_s + 0.2 * cost
                self.interval_s = max(self.period_s, self._cost_s / SNAPSHOT_CPU_BUDGET)
                if not self._wake.is_set():
                    break  # the last window closed
                due = max(due + self.interval_s, self._clock())  # a late tick is not repeated

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def overhead(self) -> dict[str, Any]:
        """CPU seconds of the snapshot thread, and as a fraction of one core over the time windows were open: the
        NVML sampler's keys (``ipw.results.SamplerOverhead``), ``wall_s`` being that open time."""
        active = self._active_s + (self._clock() - self._active_since if self._active_since is not None else 0.0)
        return {"thread": "ipw-snapshots", "period_s": self.period_s, "interval_s": round(self.interval_s, 4),
                "budget_fraction_of_core": SNAPSHOT_CPU_BUDGET, "snapshots": self.n_snapshots,
                "cpu_s": round(self._thread_cpu_s, 4), "wall_s": round(active, 3),
                "cpu_fraction_of_one_core": round(self._thread_cpu_s / active, 5) if active > 0 else None}


# --- counters read off the window's edges -------------------------------------------------------------

#: Reads kept for a window that begins: the last one before its start is where its start is interpolated.
RECENT_READS = 4


class CounterWindow:
    """One window of a :class:`Counters` thread: its edges (monotonic s, the caller's timestamps) and the
    reads around them: the last read before its start, every read inside, and the first read at or after
    its end.  Complete once that last read exists (``done`` is set); the counters' values at the edges are
    then interpolated between the reads around each edge (``edge``)."""

    def __init__(self, start_s: float, reads: list[tuple[float, tuple[float, ...], float]]) -> None:
        self.start_s = start_s
        self.end_s: float | None = None
        self.t_s = [t for t, _, _ in reads]
        self.values = [v for _, v, _ in reads]
        self.step = max((s for _, _, s in reads), default=0.0)  # the resolution of one read of a value
        self.error = ""
        self.done = threading.Event()

    def add(self, t_s: float, values: tuple[float, ...], step: float) -> None:
        self.t_s.append(t_s)
        self.values.append(values)
        self.step = max(self.step, step)
        if self.end_s is not None and t_s >= self.end_s:
            self.done.set()

    def edge(self, t_s: float, max_rate: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Each counter's value at ``t_s`` and a bound on its error: interpolated linearly between the reads
        just before and just after ``t_s``; a counter that only grows lies between those two reads, so the
        bound is the larger of the two distances, plus one read's resolution (``step``).  With a read on
        one side only, the value is that read's and the bound ``max_rate`` x the time to it."""
        before = max((i for i, t in enumerate(self.t_s) if t <= t_s), default=None)
        after = min((i for i, t in enumerate(self.t_s) if t >= t_s), default=None)
        if before is None and after is None:
            raise ValueError("no read of the counters")
        if before is None or after is None or self.t_s[after] == self.t_s[before]:
            k = after if before is None else before
            assert k is not None  # (one of them is not None)
            lag = abs(self.t_s[k] - t_s)
            return self.values[k], tuple(lag * max_rate + self.step for _ in self.values[k])
        ta, tb = self.t_s[before], self.t_s[after]
        f = (t_s - ta) / (tb - ta)
        xs, bounds = [], []
        for a, b in zip(self.values[before], self.values[after]):
            x = a + (b - a) * f
            xs.append(x)
            bounds.append(max(x - a, b - x, 0.0) + self.step)
        return tuple(xs), tuple(bounds)

    def trace(self, max_rate: float) -> Trace:
        """The window's counters from its start to its end (the edges interpolated, the reads inside), for
        the phase split (``ipw.telemetry.phases.split_trace``)."""
        assert self.end_s is not None
        (first, _), (last, _) = self.edge(self.start_s, max_rate), self.edge(self.end_s, max_rate)
        trace = Trace(lambda: (), self.start_s, first, self.step)
        for t, v in zip(self.t_s, self.values):
            if self.start_s < t < self.end_s:
                trace.t_s.append(t)
                trace.values.append(v)
        trace.t_s.append(self.end_s)
        trace.values.append(last)
        trace.error = self.error
        return trace


class Counters:
    """Counters (CPU time, energy) read on a thread of their own, so that a window's edge is a timestamp
    and nothing else: ``begin`` and ``end`` note the caller's time and wake the thread, which reads the
    counters at once (just after the edge), and also every ``period_s`` while a window is open (longer when
    a read costs more than ``SNAPSHOT_CPU_BUDGET`` of a core).  A window's values at its edges are
    interpolated from the reads around each edge once the read after its end exists
    (:class:`CounterWindow`).  The counters are read once when this is made (on the caller's thread: a
    sensor makes it at its first window's begin, so that window has a read right after its start); the
    thread sleeps on an event while no window is open.

    ``read()`` returns the counters' values (cumulative, in one unit) and the resolution of that read."""

    def __init__(self, read: Callable[[], tuple[Sequence[float], float]], period_s: float = SNAPSHOT_PERIOD_S, *,
                 threaded: bool = True, clock: Callable[[], float] = time.monotonic,
                 name: str = "ipw-counters") -> None:
        self.read = read
        self.period_s = self.interval_s = period_s
        self._clock = clock
        self._lock = threading.Lock()
        self._recent: collections.deque[tuple[float, tuple[float, ...], float]] = collections.deque(maxlen=RECENT_READS)
        self._open: list[CounterWindow] = []  # windows whose read after the end has not come yet
        self._wake = threading.Event()
        self._stopped = False
        self._error = ""
        self._thread_cpu_s = 0.0
        self._active_s = 0.0
        self._active_since: float | None = None
        self.n_snapshots = 0
        self._thread: threading.Thread | None = None
        self.snap()
        if threaded:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def begin(self, t_s: float) -> CounterWindow:
        with self._lock:
            window = CounterWindow(t_s, list(self._recent))
            if self._error:
                window.error = self._error
            if not self._open and self._active_since is None:
                self._active_since = self._clock()
            self._open.append(window)
        self._wake.set()
        return window

    def end(self, window: CounterWindow, t_s: float) -> None:
        with self._lock:
            window.end_s = t_s
            if window.error or self._stopped or (window.t_s and window.t_s[-1] >= t_s):
                window.done.set()
        self._wake.set()

    def rate(self, window: CounterWindow) -> tuple[float, ...] | None:
        """Each counter's mean rate (per second) over ``window`` so far, from the reads already held (none is made
        here): from the last read at or before its start to the newest, or the newest two while none came since
        its start; None with fewer than two reads, or after a failed read."""
        with self._lock:
            t_s, values = list(window.t_s), list(window.values)
            if window.error or len(t_s) < 2:
                return None
        first = max((i for i, t in enumerate(t_s) if t <= window.start_s), default=0)
        first = min(first, len(t_s) - 2)
        span_s = t_s[-1] - t_s[first]
        if span_s <= 0:
            return None
        return tuple((b - a) / span_s for a, b in zip(values[first], values[-1]))

    def snap(self) -> None:
        """One read of the counters, added to every open window (what the thread does on every wake-up)."""
        t0 = self._clock()
        error = ""
        values: tuple[float, ...] = ()
        step = 0.0
        try:
            read, step = self.read()
            values = tuple(read)
        except Exception as exc:  # a vanished process, a counter gone: the open windows say so
            error = f"{type(exc).__name__}: {exc}"
        t_s = (t0 + self._clock()) / 2
        with self._lock:
            if error:
                self._error = error
                for window in self._open:
                    window.error = window.error or error
                    window.done.set()
                self._open = [w for w in self._open if w.end_s is None]
                return
            self._error = ""
            self._recent.append((t_s, values, step))
            self.n_snapshots += 1
            for window in self._open:
                window.add(t_s, values, step)
            self._open = [w for w in self._open if not w.done.is_set()]
            if not self._open and self._active_since is not None:
                self._active_s += self._clock() - self._active_since
                self._active_since = None

    def _run(self) -> None:
        first_s = self._thread_cpu_s = time.thread_time()
        reads = 0
        while not self._stopped:
            if self._open:
                self._wake.wait(self.interval_s)
            else:
                self._wake.wait()
            self._wake.clear()
            if self._stopped:
                break
            self.snap()
            reads += 1
            self._thread_cpu_s = time.thread_time()
            # the period grows when the average read (waking up included) costs more than the budget
            self.interval_s = max(self.period_s, (self._thread_cpu_s - first_s) / reads / SNAPSHOT_CPU_BUDGET)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        with self._lock:
            for window in self._open:
                if window.end_s is not None:
                    window.done.set()  # no read will come: its end is held at the last read

    def overhead(self) -> dict[str, Any]:
        """CPU seconds of the thread, and as a fraction of one core over the time windows were open: the NVML
        sampler's keys (``ipw.results.SamplerOverhead``), ``wall_s`` being that open time."""
        active = self._active_s + (self._clock() - self._active_since if self._active_since is not None else 0.0)
        return {"thread": "ipw-counters", "period_s": self.period_s, "interval_s": round(self.interval_s, 4),
                "budget_fraction_of_core": SNAPSHOT_CPU_BUDGET, "snapshots": self.n_snapshots,
                "cpu_s": round(self._thread_cpu_s, 4), "wall_s": round(active, 3),
                "cpu_fraction_of_one_core": round(self._thread_cpu_s / active, 5) if active > 0 else None}
