"""Sensor interface and the energy reading every sensor returns.

A sensor measures one or more components (a GPU, a CPU package, DRAM, the inference process's CPU
time).  The runner opens a window around each query with ``begin()`` and closes it with
``end(token)``; ``end`` returns one :class:`EnergyReading` per component.  Every reading names its
source, quality and scope (DESIGN.md §2), so a measured number is never confused with an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Quality = Literal["measured", "measured_interpolated", "estimated", "unavailable"]
Scope = Literal["gpu", "cpu_package", "dram", "system_estimate", "datacenter_estimate"]

#: Quality ranks, best first; a total takes the worst quality of its parts.
QUALITY_ORDER: tuple[str, ...] = ("measured", "measured_interpolated", "estimated", "unavailable")


@dataclass(frozen=True)
class EnergyReading:
    """Energy of one component over one window."""

    component: str  # e.g. "gpu0", "package-0", "dram-0", "cpu-process"
    energy_j: float | None  # None when unavailable
    source: str  # nvml.counter, nvml.samples, rapl.package, rapl.dram, model.cpu, estimate.api
    quality: Quality
    scope: Scope
    duration_s: float
    note: str = ""


@dataclass(frozen=True)
class SensorInfo:
    """What a sensor will measure on this machine (for ``ipw list``, ``ipw doctor`` and the manifest)."""

    name: str
    available: bool
    source: str
    quality: Quality
    scope: Scope
    components: tuple[str, ...] = ()
    detail: str = ""
    params: dict[str, Any] = field(default_factory=dict)


class Deferred(Protocol):
    """Readings that become final later (e.g. once the driver's sample buffer covers the window and
    its edges).  The runner appends the query's record only when every sensor's result is ready."""

    def ready(self) -> bool: ...

    def result(self) -> list[EnergyReading]: ...


class Sensor(Protocol):
    name: str

    def info(self) -> SensorInfo: ...

    def begin(self) -> Any:
        """Start a window; returns an opaque token for ``end``."""

    def end(self, token: Any) -> "list[EnergyReading] | Deferred":
        """Close the window opened by ``begin``: one reading per component, now or deferred."""

    def close(self) -> None: ...


def worst_quality(qualities: list[str]) -> str:
    if not qualities:
        return "unavailable"
    return max(qualities, key=QUALITY_ORDER.index)


@dataclass(frozen=True)
class EnergyTotal:
    """The energy of one window summed over components of one basis.

    ``energy_j`` sums only readings of the same kind: measured parts, or (if there are none) estimated
    parts.  A measured total never silently includes an estimate; ``best_effort_j`` adds every
    available part and is labeled as such.
    """

    energy_j: float | None
    quality: str
    source: str
    scope: str
    best_effort_j: float | None


def energy_basis(readings: list[EnergyReading]) -> list[EnergyReading]:
    """The readings a total sums: the measured ones, or (if there are none) every available one."""
    available = [r for r in readings if r.energy_j is not None and r.quality != "unavailable"]
    measured = [r for r in available if r.quality in ("measured", "measured_interpolated")]
    return measured or available


def total_energy(readings: list[EnergyReading]) -> EnergyTotal:
    available = [r for r in readings if r.energy_j is not None and r.quality != "unavailable"]
    basis = energy_basis(readings)
    if not basis:
        return EnergyTotal(None, "unavailable", "", "", None)
    return EnergyTotal(
        energy_j=sum(r.energy_j for r in basis),  # type: ignore[misc]
        quality=worst_quality([r.quality for r in basis]),
        source="+".join(sorted({r.source for r in basis})),
        scope="+".join(sorted({r.scope for r in basis})),
        best_effort_j=sum(r.energy_j for r in available),  # type: ignore[misc]
    )
