"""Choose the sensors for a run, in a fixed order: NVML, then RAPL, else the CPU model.

The CPU model estimate is used only when RAPL is absent, so a measured CPU number is never
replaced by (or added to) an estimate of the same thing.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ipw.errors import IpwError
from ipw.telemetry.base import Sensor, SensorInfo
from ipw.telemetry.cpu_model import CpuModelSensor
from ipw.telemetry.nvml import NvmlSensor
from ipw.telemetry.rapl import DEFAULT_ROOT, RaplSensor


def default_probe(backend: Any) -> list[Sensor]:
    """The sensors of a loaded backend's processes (none for a remote one: its API estimate instead).
    ``backend``: an ``ipw.backends.base.BackendBase`` (its ``pids`` and declared ``remote``)."""
    return probe_sensors(backend.pids, remote=backend.remote)


def probe_sensors(
    pids_fn: Callable[[], list[int]],
    gpu_indices: list[int] | None = None,
    rapl_root: Path = DEFAULT_ROOT,
    remote: bool = False,
    rapl: bool = True,
) -> list[Sensor]:
    """The sensors to open around each query.  ``gpu_indices=[]`` skips the GPU.

    ``rapl=False``: the CPU package is shared with other measured work (Ray tasks on one node), so
    the CPU part is the CPU model of this process tree, never the package-wide RAPL counters, which
    would charge each task the others' energy too (``ipw.ray_runner``).

    ``remote=True`` (the endpoint is on another machine): none.  This machine's sensors do not see
    that work; its energy is estimated per query instead (``ipw.telemetry.api_estimate``, labeled
    ``estimate.api``) and never mixed with a measurement.

    Raises IpwError (with the fix) when a sensor exists but cannot be read.
    """
    if remote:
        return []
    sensors: list[Sensor] = []
    if gpu_indices != []:
        nvml = NvmlSensor.probe(gpu_indices)
        if nvml is not None:
            sensors.append(nvml)
    try:
        package = RaplSensor.probe(rapl_root) if rapl else None
    except BaseException:
        for sensor in sensors:
            sensor.close()
        raise
    sensors.append(package if package is not None else CpuModelSensor(pids_fn))
    return sensors


def _unavailable(name: str, source: str, scope: str, detail: str) -> SensorInfo:
    return SensorInfo(name, False, source, "unavailable", scope, detail=detail)  # type: ignore[arg-type]


def describe_sensors(
    gpu_indices: list[int] | None = None, rapl_root: Path = DEFAULT_ROOT
) -> list[SensorInfo]:
    """All three sensors with their availability on this machine, for ``ipw list``; never raises."""
    infos: list[SensorInfo] = []
    try:
        nvml = NvmlSensor.probe(gpu_indices)
    except IpwError as exc:
        infos.append(_unavailable("nvml", "nvml.counter", "gpu", exc.message))
    else:
        if nvml is None:
            infos.append(
                _unavailable("nvml", "nvml.counter", "gpu", "no NVIDIA library, driver or visible GPU")
            )
        else:
            infos.append(nvml.info())
            nvml.close()

    rapl_present = False
    try:
        rapl = RaplSensor.probe(rapl_root)
    except IpwError as exc:
        infos.append(_unavailable("rapl", "rapl.package", "cpu_package", exc.message))
    else:
        if rapl is None:
            infos.append(
                _unavailable("rapl", "rapl.package", "cpu_package", f"no RAPL zones under {rapl_root}")
            )
        else:
            rapl_present = True
            infos.append(rapl.info())
            rapl.close()

    cpu = CpuModelSensor(lambda: []).info()
    if rapl_present:
        cpu = replace(cpu, detail="not used: RAPL measures the CPU. " + cpu.detail)
    infos.append(cpu)
    return infos
