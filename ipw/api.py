"""The Python API: ``ipw.measure`` (the energy of any block of code) and ``ipw.load_run``.

``measure`` opens one window on the sensors ``ipw run`` would use (the same probe: NVML, then RAPL,
else the CPU model of a process tree) and closes it when the block ends; ``result`` is then a
:class:`Measurement` whose total follows the same rule as a run's records (docs/ARCHITECTURE.md, 'Energy readings and the metric contract'): measured
parts if any exist, else estimated ones, never both.  Imported lazily by ``ipw/__init__.py``; the
sensors (numpy, pynvml) are imported only when a block starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from ipw.telemetry.base import EnergyReading, SensorInfo

if TYPE_CHECKING:
    from ipw.metering.call import OpenCall


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


class measure:
    """Measure the energy of a block of code with ipw's sensors::

        with ipw.measure() as m:
            run_my_harness()
        print(m.result.energy_j, m.result.quality)

    ``gpus``: CUDA ordinals of the GPUs to measure (default: every visible GPU; ``[]``: none);
    ``CUDA_VISIBLE_DEVICES`` is honoured.  ``pids``: the processes whose CPU time the CPU model
    charges, with their descendants (default: this process); it applies only where no RAPL exists,
    since RAPL measures the whole package.  ``rapl=False`` uses the CPU model even where RAPL exists
    (the package is shared with other work you do not want charged).

    ``result`` is None until the block ends; it is set also when the block raises (the exception
    propagates).  A sensor that exists but cannot be read raises ``ipw.errors.IpwError`` on entry.
    """

    def __init__(self, *, gpus: Sequence[int] | None = None, pids: Sequence[int] | None = None,
                 rapl: bool = True) -> None:
        self.gpus = None if gpus is None else list(gpus)
        self.pids = [os.getpid()] if pids is None else list(pids)
        self.rapl = rapl
        self.result: Measurement | None = None
        self._open: OpenCall | None = None

    def __enter__(self) -> "measure":
        from ipw.telemetry.probe import probe_sensors
        from ipw.metering.call import open_call
        from ipw.metering.window import Window

        if self._open is not None:
            raise RuntimeError("ipw.measure: this block is already being measured")
        pids = self.pids
        window = Window(probe_sensors(lambda: pids, gpu_indices=self.gpus, rapl=self.rapl))
        self.result = None
        self._open = open_call(window)  # the window's edge: its sensors' and the measurement's start alike
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._open is not None
        call, self._open = self._open, None
        try:
            measured = call.close()
            energy = measured.energy()
            sensors = tuple(s.info() for s in call.window.sensors)
        finally:
            for sensor in call.window.sensors:
                sensor.close()
        total = energy.total
        self.result = Measurement(
            energy_j=total.energy_j, quality=total.quality, source=total.source, scope=total.scope,
            best_effort_energy_j=total.best_effort_j, duration_s=measured.duration_s, parts=tuple(energy.readings),
            sensors=sensors,
        )


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
