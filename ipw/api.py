"""The Python API: ``ipw.measure`` (the energy of any block of code), ``ipw.Monitor`` (sensors opened once
for many blocks) and ``ipw.load_run``.

A :class:`Monitor` opens the sensors ``ipw run`` would use (the same probe: NVML, then RAPL, else the CPU
model of a process tree); each of its blocks is one window on them (``ipw.metering.call``, as a query of
``ipw run``), and its ``result`` a :class:`Measurement` whose total follows the same rule as a run's records
(docs/ARCHITECTURE.md, 'Energy readings and the metric contract'): measured parts if any exist, else
estimated ones, never both.  ``measure`` is a block with a monitor of its own, opened when the block starts
and closed when it ends.  Imported lazily by ``ipw/__init__.py``; the sensors (numpy, pynvml) are imported
only when a monitor opens.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from ipw.telemetry.base import EnergyReading, SensorInfo

if TYPE_CHECKING:
    from ipw.metering.call import MeasuredCall, OpenCall


@dataclass(frozen=True)
class Measurement:
    """The energy of one measured block.

    ``energy_j`` sums one basis (measured parts if any, else estimated ones) and carries that basis's
    ``quality``, ``source`` and ``scope``; ``best_effort_energy_j`` adds every available part.
    ``parts`` has one reading per component (a GPU, a CPU package, DRAM, the process tree's CPU time),
    each with its own source, quality and scope.  ``sensors`` describes what was probed.
    """

    energy_j: float | None
    quality: str  # measured | measured_interpolated | estimated | unavailable
    source: str  # e.g. "nvml.samples", "rapl.dram+rapl.package", "model.cpu"
    scope: str  # e.g. "gpu", "cpu_package+dram"
    best_effort_energy_j: float | None
    duration_s: float
    parts: tuple[EnergyReading, ...]
    sensors: tuple[SensorInfo, ...]

    @property
    def mean_power_w(self) -> float | None:
        """``energy_j / duration_s`` (None without energy or duration)."""
        if self.energy_j is None or self.duration_s <= 0:
            return None
        return self.energy_j / self.duration_s


#: How long reading a result waits for the sensors to cover its block's end (then it is made from what they hold).
RESULT_WAIT_S = 10.0


class Block:
    """One block of code measured on a :class:`Monitor`'s sensors (``monitor.measure()``)::

        with monitor.measure() as m:
            run_one_query()
        m.result.energy_j

    ``result`` is None until the block ends (also when it raises; the exception propagates), then a
    :class:`Measurement`, made on first access (see :class:`Monitor`).  A block can be measured again once
    it has ended (its result is then the new one's).
    """

    def __init__(self, monitor: Monitor | None) -> None:
        self._monitor = monitor
        self._open: OpenCall | None = None
        self._ended: Ended | None = None

    def __enter__(self) -> Block:
        if self._open is not None:
            raise RuntimeError("ipw.measure: this block is already being measured")
        assert self._monitor is not None
        self._ended = None
        self._open = self._monitor._begin()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._open is not None and self._monitor is not None
        call, self._open = self._open, None
        self._ended = self._monitor._end(call)

    @property
    def result(self) -> Measurement | None:
        ended = self._ended
        if ended is None:
            return None
        if ended.result is None:
            assert self._monitor is not None
            self._monitor._finish([ended])
        return ended.result


@dataclass(eq=False)  # one per ended block, by identity: the monitor keeps the unread ones in a WeakSet
class Ended:
    """A block's closed window, and its result once made."""

    measured: MeasuredCall
    result: Measurement | None = None


class Monitor:
    """ipw's sensors opened once for many measured blocks, as a harness measures one query after another::

        with ipw.Monitor(gpus=[0]) as monitor:
            blocks = []
            for prompt in prompts:
                with monitor.measure() as m:
                    generate(prompt)
                blocks.append(m)
        joules = [m.result.energy_j for m in blocks]

    ``gpus``, ``pids`` and ``rapl`` are :class:`measure`'s; the sensors are probed and opened here (a sensor
    that exists but cannot be read raises ``ipw.errors.IpwError``) and closed by :meth:`close` (or at the end
    of the ``with`` block).  A block's begin and end only stamp the time on the open sensors, so its end
    does not wait: its ``result`` is made on first access, once the sensors cover the block's end (NVML:
    the driver's samples, ~0.1 s after it), together with every other block ended and not read yet whose
    end they cover (one estimate for them all).  Blocks may overlap, from several threads too: each gets the
    energy of its own span.  The NVML sampler runs as long as the monitor, so the samples of a block are
    scaled by the energy counter over up to the last 10 minutes.
    """

    def __init__(self, *, gpus: Sequence[int] | None = None, pids: Sequence[int] | None = None,
                 rapl: bool = True) -> None:
        from ipw.metering.window import Window
        from ipw.telemetry.probe import probe_sensors

        self.gpus = None if gpus is None else list(gpus)
        self.pids = [os.getpid()] if pids is None else list(pids)
        self.rapl = rapl
        measured_pids = self.pids
        self._window = Window(probe_sensors(lambda: measured_pids, gpu_indices=self.gpus, rapl=rapl))
        self._lock = threading.Lock()
        self._unread: weakref.WeakSet[Ended] = weakref.WeakSet()  # result not made yet (a dropped block's goes)
        self._in_flight = 0
        self._closed = False

    def measure(self) -> Block:
        """A block to measure on these sensors: ``with monitor.measure() as m: ...``."""
        return Block(self)

    def trace(self) -> dict[str, list[Any]]:
        """The points the monitor's sensors hold now, for checking its blocks against another reference: the
        columns of a run folder's ``power.parquet`` (``t_s`` monotonic s, ``device``, ``power_w``, ``kind``,
        ``energy_j``; NVML: the driver's samples, the counter and instant reads of up to the last 10 minutes).
        A sensor that keeps no points (RAPL, the CPU model) adds none."""
        import numpy as np

        columns = ("t_s", "device", "power_w", "kind", "energy_j")
        out: dict[str, list[Any]] = {c: [] for c in columns}
        for sensor in self._window.sensors:
            points = sensor.trace()  # as the runner's power.parquet takes it
            if len(points.get("t_s", ())):
                for c in columns:
                    out[c].extend(np.asarray(points[c]).tolist())
        return out

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Make the result of every block not read yet final, then close the sensors (again: nothing).
        Raises RuntimeError while a block is being measured."""
        with self._lock:
            if self._closed:
                return
            if self._in_flight:
                raise RuntimeError("ipw.Monitor.close: a block on this monitor is still being measured")
            self._closed = True
            unread = list(self._unread)
        try:
            self._finish(unread)
        finally:
            for sensor in self._window.sensors:
                sensor.close()

    def _begin(self) -> OpenCall:
        from ipw.metering.call import open_call

        with self._lock:
            if self._closed:
                raise RuntimeError("ipw.Monitor: this monitor is closed")
            self._in_flight += 1
        return open_call(self._window)  # the block's edge: its sensors' and the measurement's start alike

    def _end(self, call: OpenCall) -> Ended:
        try:
            ended = Ended(call.close())
        finally:
            with self._lock:
                self._in_flight -= 1
        with self._lock:
            self._unread.add(ended)
        return ended

    def _finish(self, blocks: list[Ended]) -> None:
        """Make ``blocks``' results (waiting for the sensors to cover their ends, at most ``RESULT_WAIT_S``), and
        those of the other unread blocks whose ends the sensors cover by then, in one estimate per sensor."""
        from ipw.metering.window import resolve

        deadline = time.monotonic() + RESULT_WAIT_S
        for ended in blocks:
            ended.measured.closed.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            ready = [e for e in self._unread if e.measured.closed.ready()]
            self._unread.difference_update([*ready, *blocks])
        todo = [e for e in {id(e): e for e in [*blocks, *ready]}.values() if e.result is None]
        resolve([e.measured.closed for e in todo])
        sensors = tuple(s.info() for s in self._window.sensors)
        for ended in todo:
            ended.result = _measurement(ended.measured, sensors)


def _measurement(measured: MeasuredCall, sensors: tuple[SensorInfo, ...]) -> Measurement:
    """A block's :class:`Measurement` from its closed window (waiting for parts not final yet)."""
    energy = measured.energy()
    total = energy.total
    return Measurement(
        energy_j=total.energy_j, quality=total.quality, source=total.source, scope=total.scope,
        best_effort_energy_j=total.best_effort_j, duration_s=measured.duration_s, parts=tuple(energy.readings),
        sensors=sensors,
    )


class measure(Block):
    """Measure the energy of a block of code with ipw's sensors::

        with ipw.measure() as m:
            run_my_harness()
        print(m.result.energy_j, m.result.quality)

    ``gpus``: CUDA ordinals of the GPUs to measure (default: every visible GPU; ``[]``: none);
    ``CUDA_VISIBLE_DEVICES`` is honoured.  ``pids``: the processes whose CPU time the CPU model
    charges, with their descendants (default: this process); it applies only where no RAPL exists,
    since RAPL measures the whole package.  ``rapl=False`` uses the CPU model even where RAPL exists
    (the package is shared with other work you do not want charged).

    The sensors are opened when the block starts and closed when it ends, after its result is made:
    ``result`` is None until the block ends; it is set also when the block raises (the exception
    propagates).  A sensor that exists but cannot be read raises ``ipw.errors.IpwError`` on entry.
    For many blocks (one per query), a :class:`Monitor` opens the sensors once and its blocks' ends
    do not wait for the driver's samples.
    """

    def __init__(self, *, gpus: Sequence[int] | None = None, pids: Sequence[int] | None = None,
                 rapl: bool = True) -> None:
        super().__init__(None)
        self.gpus = None if gpus is None else list(gpus)
        self.pids = [os.getpid()] if pids is None else list(pids)
        self.rapl = rapl

    def __enter__(self) -> measure:
        if self._open is None:  # (else Block.__enter__ says that it is already being measured)
            self._monitor = Monitor(gpus=self.gpus, pids=self.pids, rapl=self.rapl)
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._monitor is not None
        try:
            super().__exit__(*exc)
        finally:
            self._monitor.close()  # makes the result final, then closes the sensors


class Run(NamedTuple):
    """A run folder's ``manifest`` (the parsed manifest.json) and ``records`` (a pandas DataFrame, one
    row per query × repeat, the columns of records.parquet)."""

    manifest: dict[str, Any]
    records: Any  # pandas.DataFrame (pandas is imported only when a run is loaded)


def load_run(path: str | Path) -> Run:
    """Load a run folder written by ``ipw run`` (``records.parquet``, or the ``records.jsonl`` log of a
    run still going or interrupted).  Raises ``ipw.errors.IpwError`` when it is not a run folder."""
    from ipw.results import load_run as load

    manifest, records = load(path)
    return Run(manifest.to_dict(), records)  # the parsed manifest.json, as it always was
