"""Choose the sensors for a run, in a fixed order: NVML, the other platforms (AMD GPUs, NVIDIA module
power, Apple Silicon, Jetson boards: :data:`PLATFORMS`, docs/PLATFORMS.md), the node's BMC where
``IPW_NODE_POWER`` names one (:mod:`ipw.telemetry.node_power`, scope ``node``: never added to the chip
total), then RAPL, else the CPU model.

The CPU model estimate is used only when nothing measures the CPU (RAPL, Apple's chip rails, a
Jetson board's input), so a measured CPU number is never replaced by (or added to) an estimate of
the same thing.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
import sys
from dataclasses import dataclass
from typing import Any, Callable

from ipw.errors import IpwError
from ipw.telemetry.base import Scope, Sensor, SensorInfo
from ipw.telemetry.cpu_model import CpuModelSensor
from ipw.telemetry.nvml import NvmlSensor
from ipw.telemetry.polled import Absent
from ipw.telemetry.rapl import DEFAULT_ROOT, RaplSensor


@dataclass(frozen=True)
class PlatformEntry:
    """One platform sensor of the registry: how to open it, and what it measures."""

    name: str
    source: str
    scope: Scope
    gpu: bool  # a GPU sensor: skipped with gpu_indices=[]
    measures_cpu: bool  # its readings include the CPU: the CPU model estimate is then not added
    open: Callable[..., Sensor]


def _open_amd(gpu_indices: list[int] | None) -> Sensor:
    from ipw.telemetry import amd

    return amd.probe(gpu_indices)


def _open_module(gpu_indices: list[int] | None) -> Sensor:
    from ipw.telemetry import superchip

    return superchip.probe(gpu_indices)


def _open_apple(gpu_indices: list[int] | None) -> Sensor:
    from ipw.telemetry import apple

    return apple.probe()


def _open_jetson(gpu_indices: list[int] | None) -> Sensor:
    from ipw.telemetry import jetson

    return jetson.probe()


#: The platform sensors beside NVML and RAPL, probed in this order.
PLATFORMS: tuple[PlatformEntry, ...] = (
    PlatformEntry("amdsmi", "amdsmi.power", "gpu", True, False, _open_amd),
    PlatformEntry("nvml_module", "nvml.module.power", "module", True, False, _open_module),
    PlatformEntry("apple", "apple.counter", "chip_rails", False, True, _open_apple),
    PlatformEntry("jetson", "jetson.power", "board", False, True, _open_jetson),
)


def platform_sensors(gpu_indices: list[int] | None = None, *, quiet: bool = False,
                     entries: tuple[PlatformEntry, ...] | None = None) -> tuple[list[tuple[PlatformEntry, Sensor]], dict[str, str]]:
    """The platform sensors that open here, and why each other one did not (one line each).

    A platform that is absent (:class:`~ipw.telemetry.polled.Absent`) is left out silently; one whose
    library is missing or that fails (no permission) is one line on stderr (unless ``quiet``); the
    others go on.  Never raises for a platform's failure."""
    opened: list[tuple[PlatformEntry, Sensor]] = []
    why: dict[str, str] = {}
    for entry in PLATFORMS if entries is None else entries:
        if entry.gpu and gpu_indices == []:
            why[entry.name] = "GPUs not measured (gpu_indices=[])"
            continue
        try:
            opened.append((entry, entry.open(gpu_indices)))
        except Absent as exc:
            why[entry.name] = exc.message
        except IpwError as exc:
            why[entry.name] = exc.message
            if not quiet:
                print(f"ipw: {entry.name} sensor not used: {exc.message}", file=sys.stderr)
        except Exception as exc:  # a vendor library's own failure never stops the run
            why[entry.name] = f"{type(exc).__name__}: {exc}"
            if not quiet:
                print(f"ipw: {entry.name} sensor not used: {why[entry.name]}", file=sys.stderr)
    return opened, why


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
    would charge each task the others' energy too (``ipw.running.ray_runner``).

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
        platforms, _ = platform_sensors(gpu_indices)
        sensors.extend(sensor for _, sensor in platforms)
        from ipw.telemetry import node_power  # IPW_NODE_POWER: the node's BMC (raises when it is set and fails)

        node = node_power.probe()
        if node is not None:
            sensors.append(node)
        package = RaplSensor.probe(rapl_root) if rapl else None
    except BaseException:
        for sensor in sensors:
            sensor.close()
        raise
    if package is not None:
        sensors.append(package)
    elif not any(entry.measures_cpu for entry, _ in platforms):
        sensors.append(CpuModelSensor(pids_fn))
    return sensors


def _unavailable(name: str, source: str, scope: Scope, detail: str) -> SensorInfo:
    return SensorInfo(name, False, source, "unavailable", scope, detail=detail)


def describe_sensors(
    gpu_indices: list[int] | None = None, rapl_root: Path = DEFAULT_ROOT
) -> list[SensorInfo]:
    """Every sensor with its availability on this machine (and why not), for ``ipw list`` and
    ``ipw doctor``; never raises."""
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

    platforms, why = platform_sensors(gpu_indices, quiet=True)
    by_name = {entry.name: sensor for entry, sensor in platforms}
    for entry in PLATFORMS:
        sensor = by_name.get(entry.name)
        if sensor is None:
            infos.append(_unavailable(entry.name, entry.source, entry.scope, why.get(entry.name, "-")))
        else:
            infos.append(sensor.info())
            sensor.close()

    try:
        from ipw.telemetry import node_power

        node = node_power.probe(threaded=False)
    except IpwError as exc:
        infos.append(_unavailable("node_power", "redfish.power", "node", exc.message))
    else:
        if node is None:
            infos.append(_unavailable("node_power", "redfish.power", "node", f"not configured: set {node_power.USAGE}"))
        else:
            infos.append(node.info())
            node.close()

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
    cpu_measured = [entry.name for entry, _ in platforms if entry.measures_cpu]
    if rapl_present:
        cpu = replace(cpu, detail="not used: RAPL measures the CPU. " + cpu.detail)
    elif cpu_measured:
        cpu = replace(cpu, detail=f"not used: {cpu_measured[0]} measures the CPU. " + cpu.detail)
    infos.append(cpu)
    return infos
