"""Sensor interface and the energy reading every sensor returns.

A sensor measures one or more components (a GPU, a CPU package, DRAM, the inference process's CPU
time).  The runner opens a window around each query with ``begin()`` and closes it with
``end(token)``; ``end`` returns one :class:`EnergyReading` per component.  Every reading names its
source, quality and scope (docs/ARCHITECTURE.md, 'Energy readings and the metric contract'), so a measured number is never confused with an estimate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

Quality = Literal["measured", "measured_interpolated", "estimated", "unavailable"]
Scope = Literal["gpu", "cpu_package", "dram", "system_estimate", "datacenter_estimate",
                "module", "chip_rails", "board", "node"]  # module: a superchip's module; chip_rails: Apple's; board: Jetson's
#: node: the whole machine from its BMC (ipw.telemetry.node_power), which contains every other scope here

#: Scopes that contain the others: their readings are a basis of their own, never added to a chip total
#: (the node's wall power already includes its GPUs and CPU packages).
CONTAINING_SCOPES: tuple[str, ...] = ("node",)

#: Quality ranks, best first; a total takes the worst quality of its parts.
QUALITY_ORDER: tuple[str, ...] = ("measured", "measured_interpolated", "estimated", "unavailable")
#: A reading's ``uncertainty_j`` is a two-sided 90% half-width: one sd is it over this z.
Z90 = 1.6448536269514722


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
    #: ±90% half-width of ``energy_j`` (J): fitted for NVML samples, a stated band for estimates (docs/ENERGY.md,
    #: "How far to trust a reading"); None when the sensor states none.
    uncertainty_j: float | None = None
    #: the part of that error (1 sd, J) that comes from a calibration ratio, which every window it scales
    #: shares (``ipw.telemetry.uncertainty.measurement_sd``); None when the sensor states none.
    calibration_sd_j: float | None = None


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


@dataclass(frozen=True)
class PowerEstimate:
    """A sensor's own estimate of the mean power of a window still open (``SensorBase.window_power_w``), and the
    relative ±90% half-width it states for it."""

    power_w: float
    rel_90: float


#: how often ``Deferred.wait`` asks ``ready`` again by default
WAIT_POLL_S = 0.001


class Deferred:
    """Readings that become final later (e.g. once the driver's sample buffer covers the window and
    its edges).  The runner appends the query's record only when every sensor's result is ready."""

    def ready(self) -> bool:
        raise NotImplementedError

    def result(self) -> list[EnergyReading]:
        raise NotImplementedError

    def wait(self, timeout_s: float) -> bool:
        """Wait until ``ready`` (at most ``timeout_s``); whether it is.  By default ``ready`` is asked again
        every ``WAIT_POLL_S``; a class whose readiness is an event waits on that (the CPU model's)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(WAIT_POLL_S, left))
        return True

    @classmethod
    def resolve_all(cls, pending: list[Any]) -> None:
        """Make many ready results of this class final at once (NVML: one estimate for many windows);
        by default each becomes final on its own, in ``result()``."""


class SensorBase:
    """What every sensor is: the runner calls these members and nothing else, and never asks whether a
    sensor has one.  The contract is in docs/ARCHITECTURE.md ("The contract of a sensor").

    Required: ``name``, ``info``, ``begin`` and ``end``.  The rest have defaults, and what a sensor can do
    beyond a window is declared by its class (checked when the class is made):

    - ``supports_cut``: ``cut(token)`` closes a window and opens the next at the same instant, so that
      consecutive windows tile time; the default ends and begins again (the moment between is lost);
    - ``supports_split``: ``split(token, at_s)`` says which share of each component's window
      energy falls before ``at_s`` (the first token): one ``PhaseSplit`` per component;
    - ``supports_energy_windows``: ``energy_windows(windows)`` integrates arbitrary sub-windows after
      the fact (the sampled split uses it when the sensor has no ``split``);
    - ``supports_trace``: ``trace()`` returns power columns for ``power.parquet``;
    - ``overhead()``: what the sensor's own threads cost, for the manifest (``{}`` by default);
    - ``current_power_w()``: the latest power it holds, per component (``{}`` by default);
    - ``window_power_w(token)``: the mean power of a window still open, from what it holds (None by default);
    - ``close()``: release the device; does nothing by default.
    """

    name: str = ""
    supports_cut: ClassVar[bool] = False
    supports_split: ClassVar[bool] = False
    supports_energy_windows: ClassVar[bool] = False
    supports_trace: ClassVar[bool] = False

    #: each capability flag and the method a class that declares it must define itself
    CAPABILITIES: ClassVar[dict[str, str]] = {"supports_cut": "cut", "supports_split": "split",
                                              "supports_energy_windows": "energy_windows",
                                              "supports_trace": "trace"}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for flag, method in SensorBase.CAPABILITIES.items():
            declared = next(vars(k)[flag] for k in cls.__mro__ if flag in vars(k))
            defined = any(method in vars(k) for k in cls.__mro__ if k is not SensorBase)
            if declared and not defined:
                raise TypeError(f"sensor {cls.__qualname__} declares {flag} but does not define {method}()")

    def info(self) -> SensorInfo:
        raise NotImplementedError(f"{type(self).__name__}.info")

    def begin(self, t_s: float | None = None) -> Any:
        """Start a window at ``t_s`` (monotonic s: the window's edge, which ``Window`` takes once for every
        sensor; None: now, by the sensor's clock); returns an opaque token for ``end``.  An edge is a
        timestamp: a read of the device belongs on the sensor's own thread or after the window."""
        raise NotImplementedError(f"{type(self).__name__}.begin")

    def end(self, token: Any, t_s: float | None = None) -> "list[EnergyReading] | Deferred":
        """Close the window opened by ``begin`` at ``t_s`` (as in ``begin``): one reading per component,
        now or deferred."""
        raise NotImplementedError(f"{type(self).__name__}.end")

    def cut(self, token: Any, t_s: float | None = None) -> "tuple[list[EnergyReading] | Deferred, Any]":
        """Close the window and open the next at ``t_s`` (default: ``end`` then ``begin``)."""
        return self.end(token, t_s), self.begin(t_s)

    def split(self, token: Any, at_s: float) -> list[Any]:
        """The window's split at ``at_s`` (``ipw.telemetry.phases.PhaseSplit`` per component); none by
        default."""
        return []

    def energy_windows(self, windows: list[tuple[float, float]], **kwargs: Any) -> dict[str, list[Any]]:
        """Energy of arbitrary (start_s, end_s) windows per component; none by default."""
        return {}

    def trace(self, since_s: float | None = None) -> dict[str, Any]:
        """Power columns for ``power.parquet``; none by default."""
        return {}

    def overhead(self) -> dict[str, Any]:
        """The sensor's own cost, for the manifest's ``sampler_overhead``; none by default."""
        return {}

    def current_power_w(self) -> dict[str, float | None]:
        """The latest power per component that the sensor already holds (no read of the device: cheap
        enough for a request's path), None for a component with none recent; none by default.  ``ipw serve``'s
        provisional energy integrates it between request events (docs/SERVING.md)."""
        return {}

    def window_power_w(self, token: Any) -> dict[str, PowerEstimate] | None:
        """The mean power per component of the window ``token`` so far, from the reads the sensor already holds
        (no read of the device: cheap enough for a request's path); None by default: a sensor that cannot tell
        one.  For a sensor with no live power (``current_power_w``): ``ipw serve``'s provisional energy before
        any period is split (the CPU model's; docs/SERVING.md)."""
        return None

    def close(self) -> None:
        """Release what the sensor holds."""


#: The name the code and the docs used for the interface.
Sensor = SensorBase


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
    """The readings a total sums: the measured ones, or (if there are none) every available one; a node
    reading (``CONTAINING_SCOPES``) never: it contains the others."""
    available = [r for r in readings if r.energy_j is not None and r.quality != "unavailable"
                 and r.scope not in CONTAINING_SCOPES]
    measured = [r for r in available if r.quality in ("measured", "measured_interpolated")]
    return measured or available


def joules(readings: list[EnergyReading]) -> list[float]:
    """The energies of the readings that have one (every reading of ``energy_basis``)."""
    return [r.energy_j for r in readings if r.energy_j is not None]


def total_energy(readings: list[EnergyReading]) -> EnergyTotal:
    available = [r for r in readings if r.energy_j is not None and r.quality != "unavailable"
                 and r.scope not in CONTAINING_SCOPES]
    basis = energy_basis(readings)
    if not basis:
        return EnergyTotal(None, "unavailable", "", "", None)
    return EnergyTotal(
        energy_j=sum(joules(basis)),
        quality=worst_quality([r.quality for r in basis]),
        source="+".join(sorted({r.source for r in basis})),
        scope="+".join(sorted({r.scope for r in basis})),
        best_effort_j=sum(joules(available)),
    )
