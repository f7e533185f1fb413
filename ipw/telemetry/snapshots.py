"""Counters read while a window is open: a :class:`Trace` per window and the :class:`Snapshots` thread
that fills it (DESIGN.md §2; the phase split of ``ipw.telemetry.phases`` interpolates these reads).

RAPL and the CPU model read their counters only at a window's edges, so a :class:`Snapshots` thread also
reads them every ``SNAPSHOT_PERIOD_S`` (20 ms; longer when a read costs more than 1% of a core) while a
window is open.  For an in-process engine the CPU model's snapshots read the process CPU clock (ns), else
/proc times.
"""

from __future__ import annotations

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
