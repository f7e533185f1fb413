"""CPU package and DRAM energy from the Linux powercap RAPL counters.

Layout read (``/sys/class/powercap``)::

    intel-rapl:0/        name = package-0, energy_uj, max_energy_range_uj
    intel-rapl:0:0/      name = core      (inside package-0: never added)
    intel-rapl:0:1/      name = dram      (outside the package: read as dram-0)
    intel-rapl:1/        name = package-1 ...

Only top-level zones named ``package-N`` and their ``dram`` subzones are read; ``core``/``uncore``
are already counted in their package, and a top-level ``psys`` zone (platform, laptops) contains the
packages, so neither is ever added.  AMD processors expose the same ``intel-rapl`` zones (rapl
driver), so they are read the same way.  ``intel-rapl-mmio:*`` duplicates the package and is ignored.

Wraparound: ``energy_uj`` counts up to ``max_energy_range_uj`` and restarts at 0.  A smaller end value
is corrected by adding the range once, so a window may contain at most one wrap.  The range is
typically ~262 kJ, i.e. about 15 minutes at 300 W per package: per-query windows are far shorter.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ipw.errors import IpwError
from ipw.telemetry.phases import PhaseSplit, split_trace
from ipw.telemetry.snapshots import SNAPSHOT_PERIOD_S, Snapshots
from ipw.telemetry.base import EnergyReading, Scope, SensorBase, SensorInfo

DEFAULT_ROOT = Path("/sys/class/powercap")

_PACKAGE_DIR = re.compile(r"^intel-rapl:(\d+)$")
_SUBZONE_DIR = re.compile(r"^intel-rapl:(\d+):(\d+)$")

PERMISSION_FIX = (
    "RAPL energy counters are readable only by root since Linux 5.10 (CVE-2020-8694); "
    "fix: sudo chmod o+r /sys/class/powercap/intel-rapl:*/energy_uj "
    "/sys/class/powercap/intel-rapl:*:*/energy_uj (until reboot), or run ipw as root"
)


@dataclass(frozen=True)
class RaplZone:
    component: str  # "package-0" or "dram-0"
    source: str  # "rapl.package" or "rapl.dram"
    scope: Scope  # "cpu_package" or "dram"
    energy_path: Path
    max_energy_range_uj: int


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except PermissionError as exc:
        raise IpwError(f"{path}: permission denied. {PERMISSION_FIX}") from exc


def _read_uj(path: Path) -> int:
    return int(_read_text(path))


def _zone(zone_dir: Path, component: str, source: str, scope: Scope) -> RaplZone:
    energy_path = zone_dir / "energy_uj"
    _read_uj(energy_path)  # fail now, with the fix, if the counter is root-only
    return RaplZone(
        component=component,
        source=source,
        scope=scope,
        energy_path=energy_path,
        max_energy_range_uj=_read_uj(zone_dir / "max_energy_range_uj"),
    )


def _numbered_dirs(root: Path, pattern: re.Pattern[str]) -> list[tuple[tuple[int, ...], Path]]:
    found = []
    for path in root.iterdir():
        match = pattern.match(path.name)
        if match and path.is_dir():
            found.append((tuple(int(g) for g in match.groups()), path))
    return sorted(found)


def discover_zones(root: Path = DEFAULT_ROOT) -> list[RaplZone]:
    """Every package zone and its dram subzone under ``root``; [] when RAPL is absent.

    Raises :class:`IpwError` with the fix when a counter exists but is not readable.
    """
    if not root.is_dir():
        return []
    subzones = _numbered_dirs(root, _SUBZONE_DIR)
    zones: list[RaplZone] = []
    for (pkg_dir_n,), pkg_dir in _numbered_dirs(root, _PACKAGE_DIR):
        name_path = pkg_dir / "name"
        if not name_path.exists():
            continue
        name = _read_text(name_path)
        if not name.startswith("package-"):
            continue  # psys and others contain the packages: never add them
        n = name.removeprefix("package-")
        zones.append(_zone(pkg_dir, f"package-{n}", "rapl.package", "cpu_package"))
        for (parent_n, _), sub_dir in subzones:
            if parent_n == pkg_dir_n and (sub_dir / "name").exists():
                if _read_text(sub_dir / "name") == "dram":
                    zones.append(_zone(sub_dir, f"dram-{n}", "rapl.dram", "dram"))
    return zones


def energy_delta_uj(start_uj: int, end_uj: int, max_energy_range_uj: int) -> int:
    """Counter difference, corrected for at most one wraparound."""
    delta = end_uj - start_uj
    if delta < 0:
        delta += max_energy_range_uj
    return delta


class RaplSensor(SensorBase):
    """Measured CPU package (and DRAM, where exposed) energy from RAPL counters."""

    name = "rapl"
    supports_cut = True
    supports_split = True  # from the snapshot thread's reads (None without one: no split)

    def __init__(self, root: Path = DEFAULT_ROOT, snapshot_period_s: float | None = SNAPSHOT_PERIOD_S) -> None:
        """``snapshot_period_s``: also read the counters this often while a window is open, so that
        the window can be split at the first token (``split``); None: begin/end only."""
        self.root = Path(root)
        self.snapshots = Snapshots(snapshot_period_s) if snapshot_period_s else None
        self.zones = discover_zones(self.root)
        if not self.zones:
            raise IpwError(
                f"{self.root}: no RAPL package zones (intel-rapl:N with name package-N); "
                "RAPL is absent in most VMs: use the CPU model sensor instead"
            )

    @classmethod
    def probe(cls, root: Path = DEFAULT_ROOT) -> RaplSensor | None:
        """The sensor, or None when RAPL is absent. Raises IpwError when it is root-only."""
        return cls(root) if discover_zones(Path(root)) else None

    def info(self) -> SensorInfo:
        components = tuple(z.component for z in self.zones)
        return SensorInfo(
            name=self.name,
            available=True,
            source="rapl.package",
            quality="measured",
            scope="cpu_package",
            components=components,
            detail=f"RAPL zones {', '.join(components)} under {self.root} "
            "(dram-N readings have source rapl.dram, scope dram)",
            params={
                "root": str(self.root),
                "max_energy_range_uj": {z.component: z.max_energy_range_uj for z in self.zones},
                "snapshot_period_s": self.snapshots.period_s if self.snapshots else None,
            },
        )

    def _read_all(self) -> tuple[int, ...]:
        return tuple(_read_uj(z.energy_path) for z in self.zones)

    def begin(self, t_s: float | None = None) -> tuple[int, tuple[int, ...], Any]:
        start_ns = time.monotonic_ns() if t_s is None else int(round(t_s * 1e9))
        start_uj = self._read_all()
        trace = None if self.snapshots is None else self.snapshots.open(self._read_all, start_ns / 1e9, start_uj)
        return start_ns, start_uj, trace

    def end(self, token: tuple[int, tuple[int, ...], Any], t_s: float | None = None) -> list[EnergyReading]:
        return self.cut(token, t_s)[0]

    def cut(self, token: tuple[int, tuple[int, ...], Any],
            t_s: float | None = None) -> tuple[list[EnergyReading], tuple[int, tuple[int, ...], Any]]:
        """Close the window and open the next at the same read (windows that tile time: no energy is lost
        between them); the next window takes no snapshots."""
        start_ns, start_uj, trace = token
        end_ns = time.monotonic_ns() if t_s is None else int(round(t_s * 1e9))
        end_uj = self._read_all()
        if trace is not None:
            self.snapshots.close(trace, end_ns / 1e9, end_uj)  # type: ignore[union-attr]  # a trace only with snapshots
        duration_s = (end_ns - start_ns) / 1e9
        readings = []
        for zone, e0, e1 in zip(self.zones, start_uj, end_uj):
            note = "counter wrapped once (corrected with max_energy_range_uj)" if e1 < e0 else ""
            readings.append(
                EnergyReading(
                    component=zone.component,
                    energy_j=energy_delta_uj(e0, e1, zone.max_energy_range_uj) / 1e6,
                    source=zone.source,
                    quality="measured",
                    scope=zone.scope,
                    duration_s=duration_s,
                    note=note,
                )
            )
        return readings, (end_ns, end_uj, None)

    def split(self, token: tuple[int, tuple[int, ...], Any], at_s: float) -> list[PhaseSplit]:
        """Each zone's share of the window's energy before ``at_s`` (the first token), from the snapshots."""
        def cumulative(k: int, uj: np.ndarray) -> np.ndarray:  # unwrap each step (at most one wrap)
            steps = [energy_delta_uj(int(a), int(b), self.zones[k].max_energy_range_uj) for a, b in zip(uj, uj[1:])]
            return np.concatenate(([0.0], np.cumsum(steps, dtype=float)))

        return split_trace(token[2], at_s, [z.component for z in self.zones], "measured_interpolated",
                           "RAPL counter", cumulative)

    def overhead(self) -> dict[str, Any]:
        """The snapshot thread's CPU time (manifest ``sampler_overhead``)."""
        return self.snapshots.overhead() if self.snapshots is not None else {}

    def close(self) -> None:
        if self.snapshots is not None:
            self.snapshots.stop()
