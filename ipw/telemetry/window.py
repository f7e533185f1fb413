"""One measurement window over a set of sensors: ``begin`` on every sensor, then ``end``.

Shared by ``ipw run`` (a window per query) and ``ipw.measure`` (a window around any block of code).
"""

from __future__ import annotations

import time
from typing import Any

from ipw.telemetry.base import EnergyReading, Sensor


class Closed:
    """A closed window: each sensor's readings, or a deferred result that becomes final later."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def ready(self) -> bool:
        return all(isinstance(p, list) or p.ready() for p in self.parts)

    def readings(self, timeout_s: float = 10.0) -> list[EnergyReading]:
        """All readings; waits (sleeping, not spinning) for deferred parts, at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        out: list[EnergyReading] = []
        for part in self.parts:
            out.extend(part if isinstance(part, list) else part.result())
        return out


class Window:
    """Opens a measurement window on every sensor and closes it."""

    def __init__(self, sensors: list[Sensor]) -> None:
        self.sensors = sensors

    def begin(self) -> list[Any]:
        return [s.begin() for s in self.sensors]

    def end(self, tokens: list[Any]) -> Closed:
        return Closed([sensor.end(token) for sensor, token in zip(self.sensors, tokens)])
