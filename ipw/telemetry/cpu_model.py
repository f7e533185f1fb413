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
from ipw.telemetry.snapshots import CPU_TICK_S, SNAPSHOT_PERIOD_S, Snapshots
from ipw.telemetry.base import EnergyReading, SensorBase, SensorInfo


#: The per-core model's ±90% band, relative (docs/ENERGY.md, "Estimated energy"): what one busy core
#: really draws, over TDP / cores, spans about 0.4-1.6x -- below with few cores busy at a low clock or
#: light integer work, above at turbo with wide vector units or when one core carries the uncore alone
#: (the model charges a core-second the same in every case; no RAPL was available to fit it on the
#: machines of this project).  Plus one clock tick of CPU time at each edge.
MODEL_UNCERTAINTY_REL = 0.6


def model_uncertainty_j(cpu_s: float, watts_per_core: float) -> float:
    """±90% half-width (J) of ``cpu_s x watts_per_core``: ``MODEL_UNCERTAINTY_REL`` of it, plus two
    clock ticks of one core (the CPU time is read in ticks at each edge)."""
    return MODEL_UNCERTAINTY_REL * cpu_s * watts_per_core + 2 * CPU_TICK_S * watts_per_core


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


#: How often the measured processes' descendants are looked for again (a scan of every process in
#: /proc: ~1 ms per 70 processes, ~11 ms per begin/end pair with 470; it ran twice per window, which
#: took 2-3% of a core at 10 queries a second, docs/PERFORMANCE.md).  In between, the processes found
#: last time are read again (cheap); a process born into the tree is found within this time.
TREE_RESCAN_S = 1.0


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


def tree_cpu_s(procs: list[psutil.Process]) -> float:
    """User + system CPU seconds of ``procs`` and their reaped children (cheap: no process scan)."""
    total_s = 0.0
    for proc in procs:
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
    return total_s


class CpuModelSensor(SensorBase):
    """Estimated CPU energy of the inference process tree (source ``model.cpu``)."""

    name = "cpu_model"
    supports_cut = True
    supports_split = True  # from the snapshot thread's reads (None without one: no split)

    def __init__(self, pids_fn: Callable[[], list[int]], watts_per_core: float | None = None,
                 snapshot_period_s: float | None = SNAPSHOT_PERIOD_S) -> None:
        """``snapshot_period_s``: also read the tree's CPU time this often while a window is open, so
        that the window can be split at the first token (``split``); None: begin/end only."""
        self.pids_fn = pids_fn
        self._tree: tuple[float, list[int], list[psutil.Process]] | None = None  # (scanned at, roots, processes)
        self.snapshots = Snapshots(snapshot_period_s) if snapshot_period_s else None
        self.cpu_model = cpu_model_name()
        if watts_per_core is None:
            entry = core_power_for(self.cpu_model)
            self.watts_per_core, self.basis = entry.watts_per_core, entry.basis
        else:
            if watts_per_core <= 0:
                raise IpwError(f"watts_per_core must be > 0, got {watts_per_core}")
            self.watts_per_core, self.basis = float(watts_per_core), "set by the user"

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
                "snapshot_period_s": self.snapshots.period_s if self.snapshots else None,
            },
        )

    def processes(self) -> list[psutil.Process]:
        """The measured processes and their descendants, scanned again at most every ``TREE_RESCAN_S``."""
        now, pids = time.monotonic(), list(self.pids_fn())
        if self._tree is None or now - self._tree[0] >= TREE_RESCAN_S or self._tree[1] != pids:
            self._tree = (now, pids, process_tree(pids))
        return self._tree[2]

    def begin(self) -> tuple[int, float, Any]:
        start_ns = time.monotonic_ns()
        procs = self.processes()
        start_cpu_s = tree_cpu_s(procs)
        trace = None
        read: Callable[[], tuple[float, ...]]
        if self.snapshots is not None:  # for the phase split: the same processes, read cheaply, until end()
            if [p.pid for p in procs] == [os.getpid()]:  # an in-process engine: the process CPU clock (ns)
                read, step = (lambda: (time.process_time(),)), 0.0
                first = read()
            else:  # /proc times, in clock ticks per process: the first snapshot is the read above
                read, step = (lambda: (tree_cpu_s(procs),)), CPU_TICK_S * max(1, len(procs))
                first = (start_cpu_s,)
            trace = self.snapshots.open(read, time.monotonic(), first, step=step)
        return start_ns, start_cpu_s, trace

    def end(self, token: tuple[int, float, Any]) -> list[EnergyReading]:
        return self.cut(token)[0]

    def cut(self, token: tuple[int, float, Any]) -> tuple[list[EnergyReading], tuple[int, float, Any]]:
        """Close the window and open the next at the same read of the tree's CPU time (windows that tile
        time: no CPU time is lost between them); the next window takes no snapshots."""
        start_ns, start_cpu_s, trace = token
        procs = self.processes()
        end_cpu_s = tree_cpu_s(procs)
        end_ns = time.monotonic_ns()
        if trace is not None:  # its last snapshot: the read above where it read the same (one read per edge)
            same = trace.step > 0  # not an in-process engine's process clock
            self.snapshots.close(trace, *((end_ns / 1e9, (end_cpu_s,)) if same else ()))  # type: ignore[union-attr]  # a trace only with snapshots
        cpu_s = end_cpu_s - start_cpu_s
        duration_s = (end_ns - start_ns) / 1e9
        if cpu_s < 0:
            return [
                EnergyReading(
                    "cpu-process", None, "model.cpu", "unavailable", "cpu_package", duration_s,
                    note="process tree lost CPU time (a process left it unreaped)",
                )
            ], (end_ns, end_cpu_s, None)
        return [
            EnergyReading(
                component="cpu-process",
                energy_j=cpu_s * self.watts_per_core,
                source="model.cpu",
                quality="estimated",
                scope="cpu_package",
                duration_s=duration_s,
                note=f"{cpu_s:.3f} CPU s × {self.watts_per_core} W/core ({self.cpu_model})",
                uncertainty_j=model_uncertainty_j(cpu_s, self.watts_per_core),
            )
        ], (end_ns, end_cpu_s, None)

    def split(self, token: tuple[int, float, Any], at_s: float) -> list[PhaseSplit]:
        """The share of the window's CPU time before ``at_s`` (the first token), from the snapshots."""
        return split_trace(token[2], at_s, ["cpu-process"], "estimated", "CPU time of the process tree")

    def overhead(self) -> dict[str, Any]:
        """The snapshot thread's CPU time (manifest ``sampler_overhead``)."""
        return self.snapshots.overhead() if self.snapshots is not None else {}

    def close(self) -> None:
        if self.snapshots is not None:
            self.snapshots.stop()
