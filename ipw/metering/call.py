"""Measuring one call: a window on every sensor from the call's start to its end, then its energy (the sensors'
readings, plus a remote endpoint's API estimate, summed by the metric contract: ``total_energy``).

The one sequence that a query of ``ipw run`` (``ipw.running.runner``; its energy is made final by the record writer,
``make_record``), a judge's call (``ipw.grading.judge``) and ``ipw.measure`` (``ipw.api``) measure with::

    call = open_call(window)          # the window opens at the call's start (monotonic s)
    ...                               # the call
    measured = call.close()           # ... and closes at its end: start_s, end_s, the sensors' tokens and parts
    energy = measured.energy(estimate=..., completion_tokens=..., ok=...)   # its readings and total
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ipw.metering.window import Closed, Window
from ipw.telemetry.base import EnergyReading, EnergyTotal, total_energy


@dataclass(frozen=True)
class CallEnergy:
    """A measured call's readings (the sensors', then an API estimate's where there is one) and their total."""

    readings: list[EnergyReading]
    total: EnergyTotal


def call_energy(readings: list[EnergyReading], estimate: Any, completion_tokens: int, ok: bool,
                duration_s: float) -> CallEnergy:
    """A call's energy from its window's final ``readings``: plus a remote endpoint's ``estimate.api`` reading
    (``estimate``: an ApiEnergyEstimate, or None for none) for ``completion_tokens`` over ``duration_s``
    (``ok``: the call answered), and the total of them all."""
    if estimate is not None:
        readings = [*readings, estimate.reading(completion_tokens, ok, duration_s)]
    return CallEnergy(readings, total_energy(readings))


@dataclass(frozen=True)
class MeasuredCall:
    """A call's closed window: its edges (monotonic s: the call's start and end, also its record's), the sensors'
    tokens from its start (the phase split at the first token reads them) and their parts (``Closed``: some may
    become final later, on a sampler's thread)."""

    start_s: float
    end_s: float
    tokens: list[Any]
    closed: Closed

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def energy(self, *, estimate: Any = None, completion_tokens: int = 0, ok: bool = True) -> CallEnergy:
        """The call's energy (``call_energy``), waiting for the sensors' parts to become final."""
        return call_energy(self.closed.readings(), estimate, completion_tokens, ok, self.duration_s)


class OpenCall:
    """A call being measured: its window, open since ``start_s`` (monotonic s)."""

    def __init__(self, window: Window, start_s: float) -> None:
        self.window = window
        self.start_s = start_s
        self.tokens = window.begin(start_s)

    def close(self) -> MeasuredCall:
        """Close the window now, at the call's end."""
        end_s = time.monotonic()
        return MeasuredCall(self.start_s, end_s, self.tokens, self.window.end(self.tokens, end_s))


def open_call(window: Window) -> OpenCall:
    """Open a window on ``window``'s sensors now, at the start of the call it measures (one timestamp for every
    sensor and the call alike)."""
    return OpenCall(window, time.monotonic())
