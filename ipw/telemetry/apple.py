"""Apple Silicon energy without sudo, through ``zeus-apple-silicon`` (IOReport's "Energy Model"
channels; the ``apple`` extra, macOS on Apple Silicon only): :func:`probe`.

Chosen over ``macmon-lib`` because it exposes cumulative energy counters per subsystem (mJ) that any
number of windows can read (``AppleEnergyMonitor.get_cumulative_energy()``), which the estimator uses
as it uses NVML's counter; its README (ml-energy/zeus-apple-silicon, README.md) documents the fields.

Components, each a counter polled every 0.25 s: ``apple-cpu`` (``cpu_total_mj``), ``apple-gpu``
(``gpu_mj``), ``apple-ane`` (``ane_mj``), ``apple-dram`` (``dram_mj``); a field the chip does not have
is ``None`` and its component is left out.  Scope ``chip_rails``: the SoC's rails, **not the whole
system** (users report the rail sum far below the wall: 30 W vs 80 W, context-labs/mactop#43;
46 W vs 62 W, exelban/stats#1703).  The system total (SMC) is not read: this library has no SMC
channel.  IOReport's energies are believed to be model-based (the library's README, "Accuracy").

The counters update in batches, reported as ~2 s on recent chips (lablup/all-smi#415): windows
shorter than ``COUNTER_STEP_S`` are flagged short, with an uncertainty of one step at the window's
mean power, as NVML's windows under 0.15 s are.  Not verified on a Mac here (docs/PLATFORMS.md).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from ipw.errors import IpwError
from ipw.telemetry.polled import Absent, Channel, Platform, Poll, PolledSensor

#: reported update period of the IOReport energy counters on recent chips (lablup/all-smi#415)
COUNTER_STEP_S = 2.0
#: component -> AppleEnergyMetrics field (mJ)
FIELDS = {"apple-cpu": "cpu_total_mj", "apple-gpu": "gpu_mj", "apple-ane": "ane_mj", "apple-dram": "dram_mj"}
SCOPE_NOTE = "chip rails (IOReport), not the whole system"


def import_zeus_apple_silicon() -> ModuleType:
    if sys.platform != "darwin":
        raise Absent(f"not macOS (sys.platform {sys.platform}): Apple Silicon energy needs a Mac")
    try:
        import zeus_apple_silicon
    except ImportError as exc:
        raise IpwError("zeus-apple-silicon is not installed; install it with: pip install 'ipw[apple]'") from exc
    return zeus_apple_silicon


def _metric(metrics: Any, field: str) -> int | None:
    """One field of an ``AppleEnergyMetrics`` (None where the chip has no such channel)."""
    value: int | None = {"cpu_total_mj": lambda m: m.cpu_total_mj, "gpu_mj": lambda m: m.gpu_mj,
            "ane_mj": lambda m: m.ane_mj, "dram_mj": lambda m: m.dram_mj}[field](metrics)
    return value


class ApplePlatform(Platform):
    name = "apple"
    period_s = 0.25
    counter_step_s = COUNTER_STEP_S

    def __init__(self, lib: ModuleType) -> None:
        try:
            self.monitor = lib.AppleEnergyMonitor()
            first = self.monitor.get_cumulative_energy()
        except RuntimeError as exc:  # the library raises RuntimeError when IOReport cannot be subscribed
            raise IpwError(f"zeus-apple-silicon: {exc}") from exc
        self.channels = [Channel(comp, "chip_rails", "apple", has_counter=True, has_power=False, note=SCOPE_NOTE,
                                 counter_resolution_j=1e-3)  # integer mJ
                         for comp, f in FIELDS.items() if _metric(first, f) is not None]
        if not self.channels:
            raise IpwError("zeus-apple-silicon: IOReport reports none of CPU, GPU, ANE, DRAM energy on this chip")

    def read(self) -> Poll:
        m = self.monitor.get_cumulative_energy()
        p = Poll()
        for c in self.channels:
            v = _metric(m, FIELDS[c.component])
            if v is None:
                p.errors[c.component] = f"{FIELDS[c.component]} is None"
            else:
                p.counter_j[c.component] = v / 1000.0
        return p

    def describe(self) -> str:
        return (f"IOReport energy counters ({', '.join(c.component for c in self.channels)}) via zeus-apple-silicon, "
                f"read every {self.period_s:g} s; scope: {SCOPE_NOTE}; the system total (SMC) is not read; "
                f"counters update in ~{self.counter_step_s:g} s batches (reported): shorter windows flagged short")

    def params(self) -> dict[str, Any]:
        return {"fields": {c.component: FIELDS[c.component] for c in self.channels}, "system_total": None}


def probe(**kwargs: Any) -> PolledSensor:
    """The Apple Silicon sensor; IpwError with the reason when not on a Mac or the library is missing."""
    return PolledSensor(ApplePlatform(import_zeus_apple_silicon()), **kwargs)
