"""Estimated CPU energy of the inference process tree: CPU seconds × active power per core.

Used where no CPU energy counter (RAPL) exists, as in most VMs.  Like CodeCarbon's TDP × load
fallback, but per process tree rather than per machine: only the CPU time of the inference
process(es) and their descendants is charged, so other work on the machine is not.

The estimate is ``(user + system CPU seconds of the tree during the window) × watts_per_core``.
CPU time of children that exited and were reaped by a process in the tree is included through
that parent's ``children_user``/``children_system``.  A process that leaves the tree without being
reaped by it (re-parented to init) loses its time; if the tree's total goes down, the reading is
``unavailable`` rather than negative.

Per-core power (``CORE_POWER_TABLE``): a CPU's TDP divided by its physical cores, i.e. the power of
one fully busy core including its share of the uncore, at the sustained all-core clock.  It charges
one CPU-second of one logical CPU as one core-second, so with SMT and both siblings busy it
overstates; idle and memory power are not included.  Override with ``watts_per_core``.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import psutil

from ipw.errors import IpwError
from ipw.telemetry.phases import PhaseSplit, split_trace
from ipw.telemetry.snapshots import CPU_TICK_S, SNAPSHOT_PERIOD_S, CounterWindow, Counters
from ipw.telemetry.base import Z90, Deferred, EnergyReading, PowerEstimate, SensorBase, SensorInfo


#: The per-core model's ±90% band, relative (docs/ENERGY.md, "Estimated energy"): what one busy core
#: really draws, over TDP / cores, spans about 0.4-1.6x -- below with few cores busy at a low clock or
#: light integer work, above at turbo with wide vector units or when one core carries the uncore alone
#: (the model charges a core-second the same in every case; no RAPL was available to fit it on the
#: machines of this project).  Plus what the CPU time at each edge may be off (``model_uncertainty_j``).
MODEL_UNCERTAINTY_REL = 0.6


def model_uncertainty_j(cpu_s: float, watts_per_core: float, edges_cpu_s: float = 2 * CPU_TICK_S) -> float:
    """±90% half-width (J) of ``cpu_s x watts_per_core``: ``MODEL_UNCERTAINTY_REL`` of it, plus
    ``edges_cpu_s`` of one core: how far the CPU time at the two edges may be off.  The CPU time is read on
    the sensor's thread just after each edge and interpolated at the edge (``Counters``): each edge's bound
    is the CPU time between the reads around it (it lies between them) plus one read's resolution (a clock
    tick per process read from /proc), at least one clock tick (as when the edges were read directly)."""
    return MODEL_UNCERTAINTY_REL * cpu_s * watts_per_core + edges_cpu_s * watts_per_core


@dataclass(frozen=True)
class CorePower:
    match: str  # case-insensitive substring of the CPU model name
    watts_per_core: float
    basis: str


#: First match wins.
CORE_POWER_TABLE: tuple[CorePower, ...] = (
    CorePower("EPYC", 3.75, "AMD EPYC 9654 (Genoa, 9004 series): 360 W TDP / 96 cores"),
    CorePower("Xeon", 6.25, "Intel Xeon Platinum 8480+ (Sapphire Rapids): 350 W TDP / 56 cores"),
    CorePower("Apple", 3.0, "Apple M1 Max: ~30 W CPU power at full load / 10 cores"),
)
GENERIC_CORE_POWER = CorePower(
    "", 10.0, "generic desktop CPU: ~65-125 W TDP over 8-12 cores (no table entry matched)"
)


def cpu_model_name() -> str:
    """The CPU model as the OS reports it (``/proc/cpuinfo`` model name, macOS brand string)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True, text=True, timeout=5, check=True,
            )
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or "unknown"


def core_power_for(model_name: str) -> CorePower:
    """The table entry for a CPU model name, or the generic fallback."""
    for entry in CORE_POWER_TABLE:
        if entry.match.lower() in model_name.lower():
            return entry
    return GENERIC_CORE_POWER


#: Linux: a process's CPU times (and parent) are read from /proc/PID/stat directly
PROC_STAT = sys.platform.startswith("linux") and os.path.isdir("/proc/self")

#: How often the measured processes' descendants are looked for again (a scan of every process in
#: /proc: ~1 ms per 70 processes, ~11 ms per begin/end pair with 470; it ran twice per window, which
#: took 2-3% of a core at 10 queries a second, docs/PERFORMANCE.md).  In between, the processes found
#: last time are read again (cheap); a process born into the tree is found within this time.
TREE_RESCAN_S = 1.0


#: ... and every so often by a full scan again (a process missed between two looks: a pid reused within
#: the interval, a parent gone before its new child was asked), whose finds join those kept.
FULL_SCAN_S = 60.0


class ProcessTree:
    """The measured processes (``roots``) and their live descendants, kept up to date cheaply.

    Made with one scan of every process (``process_tree``: psutil reads every /proc/PID/stat, ~2 ms with
    73 processes, ~16 ms with 572).  ``refresh`` then lists /proc (~0.2-0.7 ms) and asks only the
    processes born since the last look for their parent, so its cost follows the machine's new
    processes, not all of them; every ``FULL_SCAN_S`` it scans in full again.  A member whose process
    ended (or whose pid now names another process) leaves.  A member whose parent ended after a look had
    found it stays (it was born into the tree); one born and orphaned between two looks is found by
    neither way.  Elsewhere than Linux ``refresh`` always scans.  One thread at a time (the sensor's)."""

    def __init__(self, roots: list[int]) -> None:
        self.roots = list(roots)
        self.looked_s = self._scanned_s = time.monotonic()
        self._seen = _proc_pids()  # before the scan: a process born during it is looked at next time
        self.procs = process_tree(self.roots)

    def refresh(self) -> None:
        self.looked_s = time.monotonic()
        members = {p.pid: p for p in self.procs if p.is_running()}  # psutil: the same process (its start time)
        now = _proc_pids()
        if now is None or self._seen is None or self.looked_s - self._scanned_s >= FULL_SCAN_S:
            self._seen, self._scanned_s = now, self.looked_s
            members.update((p.pid, p) for p in process_tree(self.roots))
            self.procs = list(members.values())
            return
        born, self._seen = now - self._seen, now
        parents = {pid: _parent_pid(pid) for pid in born}
        joined = True
        while joined:  # a child born after its parent in the same interval joins after it
            joined = False
            for pid, parent in list(parents.items()):
                if parent in members:
                    del parents[pid]
                    try:
                        members[pid] = psutil.Process(pid)
                        joined = True
                    except psutil.NoSuchProcess:
                        pass
        self.procs = list(members.values())


def _proc_pids() -> set[int] | None:
    """The pids in /proc now (Linux), else None."""
    if not PROC_STAT:
        return None
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def _parent_pid(pid: int) -> int | None:
    """The parent pid of ``pid`` from /proc/PID/stat; None when it has ended."""
    try:
        return int(stat_fields(pid)[1])  # state, ppid
    except (OSError, ValueError, IndexError):
        return None


def process_tree_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of the given processes, their live descendants, and their reaped
    children.  Processes that vanish are skipped."""
    return tree_cpu_s(process_tree(pids))


def process_tree(pids: list[int]) -> list[psutil.Process]:
    """The given processes and their live descendants (finding descendants scans every process)."""
    procs: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in tree:
            procs.setdefault(proc.pid, proc)
    return list(procs.values())




def stat_fields(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces): state, ppid, ..."""
    fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    try:
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    return data[data.rindex(b")") + 2:].split()


def stat_cpu_s(pid: int) -> float:
    """utime + stime + cutime + cstime of ``pid`` (/proc/PID/stat, in clock ticks), in seconds."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) * CPU_TICK_S


def tree_cpu_s(procs: list[psutil.Process]) -> float:
    """User + system CPU seconds of ``procs`` and their reaped children (cheap: no process scan)."""
    return tree_cpu_read(procs)[0]


def tree_cpu_read(procs: list[psutil.Process]) -> tuple[float, float]:
    """``tree_cpu_s`` and the resolution of that read: this process by its own CPU clock (ns; its reaped
    children in clock ticks, which change only when one is reaped), others from /proc in clock ticks
    (one tick each)."""
    total_s = step = 0.0
    me = os.getpid()
    for proc in procs:
        if proc.pid == me:
            own = os.times()
            total_s += time.process_time() + own.children_user + own.children_system
            continue
        step += CPU_TICK_S
        if PROC_STAT:  # a quarter of psutil's cost (it runs 50 times a second while a window is open)
            try:
                total_s += stat_cpu_s(proc.pid)
                continue
            except (FileNotFoundError, ProcessLookupError):
                continue
            except OSError:
                pass  # psutil says why
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        except psutil.AccessDenied as exc:
            raise IpwError(
                f"cannot read the CPU time of pid {proc.pid} (another user's process); "
                "run ipw as the user that runs the inference server"
            ) from exc
        total_s += t.user + t.system + t.children_user + t.children_system
    return total_s, step


class PendingCpu(Deferred):
    """A CPU model window once its end is stamped: final when the sensor's thread has read the CPU time
    after the end (``CounterWindow``), at most a read interval later."""

    def __init__(self, sensor: "CpuModelSensor", window: CounterWindow) -> None:
        self._sensor, self.window = sensor, window
        self._result: list[EnergyReading] | None = None

    def ready(self) -> bool:
        return self.window.done.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self.window.done.wait(timeout_s)  # set by the sensor's thread as it reads past the end

    def result(self) -> list[EnergyReading]:
        if self._result is None:
            self.window.done.wait(RESULT_WAIT_S)
            self._result = self._sensor.reading(self.window)
        return self._result


#: How long a window's result waits for the read after its end (the thread reads at once when woken).
RESULT_WAIT_S = 5.0


class CpuModelSensor(SensorBase):
    """Estimated CPU energy of the inference process tree (source ``model.cpu``).

    A window's edges are timestamps: the tree's CPU time is read on the sensor's own thread
    (``Counters``), woken at each edge and every ``snapshot_period_s`` while a window is open, and
    interpolated at the edges once the window has closed (``PendingCpu``).  Those reads also split a
    window at its first token (``split``)."""

    name = "cpu_model"
    supports_cut = True
    supports_split = True  # from the reads inside the window

    def __init__(self, pids_fn: Callable[[], list[int]], watts_per_core: float | None = None,
                 snapshot_period_s: float | None = SNAPSHOT_PERIOD_S) -> None:
        """``snapshot_period_s``: how often the tree's CPU time is read while a window is open, besides
        the reads at its edges (the phase split interpolates them); None: at the edges only."""
        self.pids_fn = pids_fn
        self._tree: ProcessTree | None = None
        self.period_s = snapshot_period_s
        self.counters: Counters | None = None  # its thread starts with the first window
        self.max_rate = float(os.cpu_count() or 1)  # CPU seconds per second the tree can use at most
        self.cpu_model = cpu_model_name()
        if watts_per_core is None:
            entry = core_power_for(self.cpu_model)
            self.watts_per_core, self.basis = entry.watts_per_core, entry.basis
        else:
            if watts_per_core <= 0:
                raise IpwError(f"watts_per_core must be > 0, got {watts_per_core}")
            self.watts_per_core, self.basis = float(watts_per_core), "set by the user"
        self.processes()  # the scan for descendants (ms): now, not at the first window's begin

    def info(self) -> SensorInfo:
        return SensorInfo(
            name=self.name,
            available=True,
            source="model.cpu",
            quality="estimated",
            scope="cpu_package",
            components=("cpu-process",),
            detail=f"CPU seconds of the inference process tree × {self.watts_per_core} W/core "
            f"({self.basis})",
            params={
                "watts_per_core": self.watts_per_core,
                "basis": self.basis,
                "cpu_model": self.cpu_model,
                "logical_cpus": os.cpu_count(),
                "snapshot_period_s": self.period_s,
                "edges": "timestamps; CPU time read on the sensor's thread just after each edge, interpolated",
            },
        )

    def processes(self, rescan: bool = True) -> list[psutil.Process]:
        """The measured processes and their descendants (``ProcessTree``): scanned when the measured
        processes change, looked at again at most every ``TREE_RESCAN_S`` (``rescan``: when due)."""
        pids = list(self.pids_fn())
        if self._tree is None or self._tree.roots != pids:
            self._tree = ProcessTree(pids)
        elif rescan and time.monotonic() - self._tree.looked_s >= TREE_RESCAN_S:
            self._tree.refresh()
        return self._tree.procs

    def _read(self) -> tuple[tuple[float], float]:
        """The tree's CPU seconds and the read's resolution (on the sensor's thread; the first read, made
        while ``counters`` is being made at the first begin, reads the processes found when the sensor
        was made, without a scan)."""
        cpu_s, step = tree_cpu_read(self.processes(rescan=self.counters is not None))
        return (cpu_s,), step

    def begin(self, t_s: float | None = None) -> CounterWindow:
        if self.counters is None:
            self.counters = Counters(self._read, self.period_s or 3600.0, name="ipw-cpu-model")
        return self.counters.begin(time.monotonic() if t_s is None else t_s)

    def end(self, token: CounterWindow, t_s: float | None = None) -> PendingCpu:
        """Close the window (no next one: a window left open would take every later read, for ever)."""
        assert self.counters is not None, "end before begin"
        self.counters.end(token, time.monotonic() if t_s is None else t_s)
        return PendingCpu(self, token)

    def cut(self, token: CounterWindow, t_s: float | None = None) -> tuple[PendingCpu, CounterWindow]:
        """Close the window and open the next at the same instant (windows that tile time: the CPU time
        at the shared edge is the same interpolation for both)."""
        t = time.monotonic() if t_s is None else t_s
        pending = self.end(token, t)
        assert self.counters is not None
        return pending, self.counters.begin(t)

    def reading(self, window: CounterWindow) -> list[EnergyReading]:
        """The window's reading from the reads around its edges (after the window, on whichever thread)."""
        end_s = window.end_s
        assert end_s is not None, "a reading of a window that has not ended"
        duration_s = end_s - window.start_s
        try:
            if window.error:
                raise ValueError(window.error)
            (start,), (start_bound,) = window.edge(window.start_s, self.max_rate)
            (end,), (end_bound,) = window.edge(end_s, self.max_rate)
        except ValueError as exc:
            return [EnergyReading("cpu-process", None, "model.cpu", "unavailable", "cpu_package", duration_s,
                                  note=f"CPU time not read: {exc}")]
        cpu_s = end - start
        if cpu_s < 0:
            return [
                EnergyReading(
                    "cpu-process", None, "model.cpu", "unavailable", "cpu_package", duration_s,
                    note="process tree lost CPU time (a process left it unreaped)",
                )
            ]
        edges_s = max(start_bound, CPU_TICK_S) + max(end_bound, CPU_TICK_S)
        return [
            EnergyReading(
                component="cpu-process",
                energy_j=cpu_s * self.watts_per_core,
                source="model.cpu",
                quality="estimated",
                scope="cpu_package",
                duration_s=duration_s,
                note=f"{cpu_s:.3f} CPU s × {self.watts_per_core} W/core ({self.cpu_model}); edges interpolated "
                     f"(±{1000 * start_bound:.1f}, ±{1000 * end_bound:.1f} CPU ms)",
                uncertainty_j=model_uncertainty_j(cpu_s, self.watts_per_core, edges_s),
                # the coefficient's part: one W/core for every window, so every slice of a split shares it
                calibration_sd_j=MODEL_UNCERTAINTY_REL * cpu_s * self.watts_per_core / Z90,
            )
        ]

    def window_power_w(self, token: CounterWindow | None) -> dict[str, PowerEstimate] | None:
        """The tree's mean power over the open window ``token`` so far: CPU seconds per second of the reads the
        sensor's thread already made (``Counters.rate``; none is made here) x W/core, with the model's band
        (``MODEL_UNCERTAINTY_REL``); None before any window, or when the tree lost CPU time."""
        if self.counters is None or token is None:
            return None
        rate = self.counters.rate(token)
        if rate is None or rate[0] < 0:
            return None
        return {"cpu-process": PowerEstimate(rate[0] * self.watts_per_core, MODEL_UNCERTAINTY_REL)}

    def split(self, token: CounterWindow, at_s: float) -> list[PhaseSplit]:
        """The share of the window's CPU time before ``at_s`` (the first token), from the reads inside it."""
        # (the record writer splits a run's last windows before their reading has waited for its read)
        if token.end_s is None or not token.done.wait(RESULT_WAIT_S) or token.error:
            return []
        return split_trace(token.trace(self.max_rate), at_s, ["cpu-process"], "estimated", "CPU time of the process tree")

    def overhead(self) -> dict[str, Any]:
        """The reading thread's CPU time (manifest ``sampler_overhead``)."""
        return self.counters.overhead() if self.counters is not None else {}

    def close(self) -> None:
        if self.counters is not None:
            self.counters.stop()
