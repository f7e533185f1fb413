"""Jetson board energy (Orin, Thor) from the INA3221 / INA238 power monitors through sysfs hwmon:
:func:`probe`.  No library is needed: the kernel drivers expose the readings as files.

Layout read (``/sys/class/hwmon/hwmonN``), as jetson-stats finds it (rbonghi/jetson_stats,
jtop/core/power.py: ``in{N}_label``, ``in{N}_input`` mV, ``curr{N}_input`` mA; channel 7 is the
"sum of shunt voltages" and labels containing ``NC`` are unconnected, both skipped) and as the kernel
documents the ina238 driver (Documentation/hwmon/ina238.rst: ``power1_input`` µW, ``energy1_input``
µJ on the INA228/INA780 variants)::

    hwmonN/name = ina3221   in1_label = VDD_IN   in1_input (mV)   curr1_input (mA)   update_interval (ms)
    hwmonM/name = ina238    power1_input (µW)    [label]

Components: ``jetson-board``, the board's input (``VDD_IN`` on Orin, ``POM_5V_IN`` on older boards;
an ``ina238`` without a label, which on Thor measures the module's VIN input per NVIDIA's Thor design
answers), scope ``board``.  The rails (``VDD_CPU_GPU_CV``, ``VDD_SOC``, ...) are inside it: their
energies are given in its reading's note, never added.  Without an input channel the rails are
readings of their own (noted: the board's other consumers are not measured).  Power is polled every
0.1 s and integrated by the estimator (no counter: the readings say ``uncalibrated``), the monitor's
own averaging period (``update_interval``) bounding the windows it resolves.  With no counter to check
the power against, a frozen monitor is told by its readings: bit-identical for ``FROZEN_AFTER_S`` (and
``FROZEN_UPDATES`` updates) while the board is busy, the windows there are ``unavailable``, said so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ipw.errors import IpwError
from ipw.telemetry.polled import Absent, Channel, Platform, Poll, PolledSensor

DEFAULT_ROOT = Path("/sys/class/hwmon")
#: labels of the board's input rail (jetson-stats' total_power uses the first two)
INPUT_LABELS = ("VDD_IN", "POM_5V_IN", "VIN")
INA3221 = "ina3221"
INA2XX = ("ina238", "ina237", "ina228", "ina780", "ina700")
#: A monitor whose readings stay bit-identical this long (s), and over at least this many of its updates,
#: while the board draws a busy power has frozen (polled.frozen_spans): its readings are not used.
FROZEN_AFTER_S = 2.0
FROZEN_UPDATES = 10


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except PermissionError as exc:
        raise IpwError(f"{path}: permission denied; run ipw as a user who can read the hwmon files, or as root") from exc


class _Rail:
    def __init__(self, label: str, files: dict[str, Path]) -> None:
        self.label, self.files = label, files

    def watts(self) -> float:
        f = self.files
        if "power_uw" in f:
            return int(_read(f["power_uw"])) / 1e6
        return int(_read(f["mv"])) * int(_read(f["ma"])) / 1e6

    def joules(self) -> float | None:
        return int(_read(self.files["energy_uj"])) / 1e6 if "energy_uj" in self.files else None


def discover_rails(root: Path = DEFAULT_ROOT) -> tuple[list[_Rail], float | None]:
    """Every INA3221 channel and INA2xx monitor under ``root``, and the shortest ``update_interval`` (s)."""
    rails: list[_Rail] = []
    interval = None
    if not root.is_dir():
        return rails, None
    for d in sorted(root.iterdir()):
        name_file = d / "name"
        if not name_file.is_file():
            continue
        chip = _read(name_file)
        ui = d / "update_interval"
        if chip == INA3221 or chip in INA2XX:
            if ui.is_file():
                ms = int(_read(ui))
                interval = ms / 1000 if interval is None else min(interval, ms / 1000)
        if chip == INA3221:
            for n in range(1, 8):
                label_f = d / f"in{n}_label"
                if n == 7 or not label_f.is_file():
                    continue
                label = _read(label_f)
                if "NC" in label.split("_") or label == "NC":
                    continue
                mv, ma = d / f"in{n}_input", d / f"curr{n}_input"
                if mv.is_file() and ma.is_file():
                    rails.append(_Rail(label, {"mv": mv, "ma": ma}))
        elif chip in INA2XX and (d / "power1_input").is_file():
            label_f = d / "label"
            label = _read(label_f) if label_f.is_file() else "VIN"
            files = {"power_uw": d / "power1_input"}
            if (d / "energy1_input").is_file():
                files["energy_uj"] = d / "energy1_input"
            rails.append(_Rail(label, files))
    return rails, interval


def _component(label: str) -> str:
    return "jetson-" + label.lower().replace(" ", "_")


class JetsonPlatform(Platform):
    name = "jetson"
    period_s = 0.1

    def __init__(self, root: Path = DEFAULT_ROOT) -> None:
        self.root = Path(root)
        rails, interval = discover_rails(self.root)
        if not rails:
            raise Absent(f"{self.root}: no INA3221/INA238 power monitor (not a Jetson board)")
        for r in rails:
            r.watts()  # fail now, with the fix, where the files are not readable
        self.update_interval_s = interval
        self.counter_step_s = max(self.period_s, interval or 0.0)
        self.frozen_after_s = max(FROZEN_AFTER_S, FROZEN_UPDATES * self.counter_step_s)
        inputs = [r for r in rails if r.label in INPUT_LABELS]
        self.input = inputs[0] if inputs else None
        self.rails = ([self.input] if self.input else []) + [r for r in rails if r is not self.input]
        self.channels = []
        for r in self.rails:
            is_input = r is self.input
            comp = "jetson-board" if is_input else _component(r.label)
            note = f"board input {r.label}" if is_input else \
                (r.label if self.input else f"rail {r.label}; no board input channel: the board's other consumers are not measured")
            self.channels.append(Channel(comp, "board", "jetson", has_counter=r.joules() is not None, has_power=True,
                                         note=note, part_of=None if is_input or not self.input else "jetson-board",
                                         power_average_s=interval or 0.0, counter_resolution_j=1e-6))  # energy1_input: µJ

    def read(self) -> Poll:
        p = Poll()
        for r, c in zip(self.rails, self.channels):
            try:
                p.power_w[c.component] = r.watts()
                if c.has_counter:
                    p.counter_j[c.component] = r.joules()  # type: ignore[assignment]  # not None: has_counter
            except (OSError, ValueError, IpwError) as exc:
                p.errors[c.component] = f"{type(exc).__name__}: {exc}"
        return p

    def describe(self) -> str:
        inside = [r.label for r in self.rails if r is not self.input]
        head = f"board input {self.input.label}" if self.input else "no board input channel"
        return (f"{head} (scope board); rails {', '.join(inside) or '-'}"
                + (" (inside the input: in its note, never added)" if self.input and inside else "")
                + f"; INA power read every {self.period_s:g} s under {self.root}"
                + (f", monitor update interval {self.update_interval_s:g} s" if self.update_interval_s else ""))

    def params(self) -> dict[str, Any]:
        return {"root": str(self.root), "input": self.input.label if self.input else None,
                "rails": [r.label for r in self.rails], "update_interval_s": self.update_interval_s}


def probe(root: Path | None = None, **kwargs: Any) -> PolledSensor:
    """The Jetson sensor (hwmon under ``root``, default ``DEFAULT_ROOT``); IpwError with the reason when
    there is no INA power monitor."""
    return PolledSensor(JetsonPlatform(DEFAULT_ROOT if root is None else root), **kwargs)
