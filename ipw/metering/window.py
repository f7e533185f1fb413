"""One measurement window over a set of sensors: ``begin`` on every sensor, then ``end``.

Shared by ``ipw run`` (a window per query) and ``ipw.measure`` (a window around any block of code).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from ipw.telemetry.base import Deferred, EnergyReading, Sensor, SensorBase


class Closed:
    """A closed window: each sensor's readings, or a deferred result that becomes final later."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def ready(self) -> bool:
        return all(isinstance(p, list) or p.ready() for p in self.parts)

    def wait(self, timeout_s: float) -> bool:
        """Wait until ``ready`` (at most ``timeout_s``, each deferred part in turn); whether it is."""
        deadline = time.monotonic() + timeout_s
        return all(isinstance(p, list) or p.wait(max(0.0, deadline - time.monotonic())) for p in self.parts)

    def readings(self, timeout_s: float = 10.0) -> list[EnergyReading]:
        """All readings; waits (sleeping, not spinning) for deferred parts, at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        out: list[EnergyReading] = []
        for part in self.parts:
            out.extend(part if isinstance(part, list) else part.result())
        return out


def resolve(closed: list[Closed]) -> None:
    """Make the deferred parts of many windows final at once, a class at a time (``Deferred.resolve_all``:
    NVML's one estimate for many windows; by default nothing happens and each part becomes final alone)."""
    groups: dict[type[Deferred], list[Any]] = {}
    for c in closed:
        for part in c.parts:
            if isinstance(part, Deferred):
                groups.setdefault(type(part), []).append(part)
    for cls, parts in groups.items():
        cls.resolve_all(parts)


class Window:
    """Opens a measurement window on every sensor and closes it."""

    def __init__(self, sensors: list[Sensor]) -> None:
        for sensor in sensors:  # where every sensor enters a measurement: the contract is checked here
            if not isinstance(sensor, SensorBase):
                raise TypeError(f"{type(sensor).__name__} is not a sensor: subclass ipw.telemetry.base.SensorBase "
                                "(docs/ARCHITECTURE.md, the contract of a sensor)")
        self.sensors = sensors

    def begin(self, t_s: float | None = None) -> list[Any]:
        """Begin every sensor at one edge: ``t_s`` (monotonic s; None: now).  The edge is a timestamp, the
        same for every sensor, so a caller that takes it (the runner: a record's ``start_s``) has exactly the
        sensors' window.  NVML and the CPU model read nothing here (their reads are on their own threads);
        RAPL still reads its counters at the edge."""
        t = time.monotonic() if t_s is None else t_s
        return [s.begin(t) for s in self.sensors]

    def end(self, tokens: list[Any], t_s: float | None = None) -> Closed:
        """End every sensor's window at one edge, ``t_s`` (as in ``begin``)."""
        t = time.monotonic() if t_s is None else t_s
        return Closed([sensor.end(token, t) for sensor, token in zip(self.sensors, tokens)])

    def power_w(self) -> dict[str, float]:
        """The latest power per component that the sensors hold (those with a recent value)."""
        return {c: w for sensor in self.sensors for c, w in sensor.current_power_w().items() if w is not None}

    def cut(self, tokens: list[Any], t_s: float | None = None) -> tuple[Closed, list[Any]]:
        """Close the window and open the next where it ended (at ``t_s``, as in ``begin``), so that consecutive
        windows tile time and their energies add up to the whole span's.  A sensor without ``supports_cut``
        ends and begins again (``SensorBase.cut``; the moment between is then not measured)."""
        t = time.monotonic() if t_s is None else t_s
        parts, following = [], []
        for sensor, token in zip(self.sensors, tokens):
            part, nxt = sensor.cut(token, t)
            parts.append(part)
            following.append(nxt)
        return Closed(parts), following


@dataclass(frozen=True)
class IdleBaseline:
    """Idle power per component, measured with the model loaded and no request in flight."""

    power_w: dict[str, float]
    spread_w: dict[str, float]  # standard deviation over 1 s slices
    duration_s: float


def measure_idle(window: Window, seconds: float) -> IdleBaseline:
    slices: dict[str, list[float]] = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tokens = window.begin()
        time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        for r in window.end(tokens).readings():
            if r.energy_j is not None and r.duration_s > 0:
                slices.setdefault(r.component, []).append(r.energy_j / r.duration_s)
    return IdleBaseline(
        power_w={k: statistics.fmean(v) for k, v in slices.items()},
        spread_w={k: statistics.pstdev(v) if len(v) > 1 else 0.0 for k, v in slices.items()},
        duration_s=seconds,
    )

