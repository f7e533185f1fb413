from __future__ import annotations

from pathlib import Path

import pytest

from ipw.errors import IpwError
from ipw.telemetry.probe import describe_sensors, probe_sensors
from ipw.telemetry.rapl import RaplSensor, discover_zones, energy_delta_uj

MAX_RANGE_UJ = 262_143_328_850


def zone(root: Path, dirname: str, name: str, energy_uj: int) -> Path:
    path = root / dirname
    path.mkdir()
    (path / "name").write_text(name + "\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{MAX_RANGE_UJ}\n")
    return path


def set_uj(path: Path, energy_uj: int) -> None:
    (path / "energy_uj").write_text(f"{energy_uj}\n")


@pytest.fixture
def sysfs(tmp_path: Path) -> dict[str, Path]:
    """Two packages, each with core and dram subzones, plus psys and the mmio duplicate."""
    root = tmp_path / "powercap"
    root.mkdir()
    (root / "intel-rapl").mkdir()  # the control type directory, not a zone
    return {
        "root": root,
        "pkg0": zone(root, "intel-rapl:0", "package-0", 1_000_000),
        "core0": zone(root, "intel-rapl:0:0", "core", 500_000),
        "dram0": zone(root, "intel-rapl:0:1", "dram", 2_000_000),
        "pkg1": zone(root, "intel-rapl:1", "package-1", 3_000_000),
        "dram1": zone(root, "intel-rapl:1:0", "dram", 4_000_000),
        "core1": zone(root, "intel-rapl:1:1", "core", 100),
        "psys": zone(root, "intel-rapl:2", "psys", 9_000_000),
        "mmio": zone(root, "intel-rapl-mmio:0", "package-0", 7),
    }


def test_discovers_packages_and_dram_only(sysfs):
    zones = discover_zones(sysfs["root"])
    assert [(z.component, z.source, z.scope) for z in zones] == [
        ("package-0", "rapl.package", "cpu_package"),
        ("dram-0", "rapl.dram", "dram"),
        ("package-1", "rapl.package", "cpu_package"),
        ("dram-1", "rapl.dram", "dram"),
    ]


def test_window_reads_each_zone_and_never_sums_core(sysfs):
    sensor = RaplSensor(sysfs["root"])
    token = sensor.begin()
    set_uj(sysfs["pkg0"], 1_000_000 + 12_500_000)  # 12.5 J
    set_uj(sysfs["core0"], 500_000 + 10_000_000)  # inside package-0: must not be added
    set_uj(sysfs["dram0"], 2_000_000 + 1_500_000)
    set_uj(sysfs["pkg1"], 3_000_000 + 4_000_000)
    set_uj(sysfs["dram1"], 4_000_000 + 250_000)
    set_uj(sysfs["psys"], 9_000_000 + 99_000_000)
    readings = {r.component: r for r in sensor.end(token)}
    assert set(readings) == {"package-0", "dram-0", "package-1", "dram-1"}
    assert readings["package-0"].energy_j == pytest.approx(12.5)
    assert readings["dram-0"].energy_j == pytest.approx(1.5)
    assert readings["package-1"].energy_j == pytest.approx(4.0)
    assert readings["dram-1"].energy_j == pytest.approx(0.25)
    assert all(r.quality == "measured" for r in readings.values())
    assert readings["dram-1"].source == "rapl.dram" and readings["dram-1"].scope == "dram"
    assert readings["package-1"].duration_s >= 0


def test_wraparound_is_corrected_once(sysfs):
    set_uj(sysfs["pkg0"], MAX_RANGE_UJ - 1_000_000)
    sensor = RaplSensor(sysfs["root"])
    token = sensor.begin()
    set_uj(sysfs["pkg0"], 2_000_000)  # wrapped: 1 J before the top + 2 J after
    reading = next(r for r in sensor.end(token) if r.component == "package-0")
    assert reading.energy_j == pytest.approx(3.0)
    assert "wrapped" in reading.note
    assert energy_delta_uj(10, 25, 100) == 15
    assert energy_delta_uj(90, 5, 100) == 15


def test_unreadable_energy_uj_gives_the_fix(sysfs, monkeypatch):
    real_read_text = Path.read_text

    def read_text(self, *args, **kwargs):
        if self.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    with pytest.raises(IpwError) as err:
        RaplSensor.probe(sysfs["root"])
    message = err.value.message
    assert "energy_uj: permission denied" in message
    assert "CVE-2020-8694" in message and "5.10" in message
    assert "sudo chmod o+r /sys/class/powercap/intel-rapl:*/energy_uj" in message
    assert "root" in message
    infos = {i.name: i for i in describe_sensors(gpu_indices=[], rapl_root=sysfs["root"])}
    assert not infos["rapl"].available and "CVE-2020-8694" in infos["rapl"].detail


def test_absent_rapl(tmp_path):
    assert RaplSensor.probe(tmp_path / "missing") is None
    empty = tmp_path / "powercap"
    empty.mkdir()
    assert RaplSensor.probe(empty) is None
    with pytest.raises(IpwError, match="no RAPL package zones"):
        RaplSensor(empty)


def test_probe_prefers_rapl_over_cpu_model(sysfs, tmp_path):
    sensors = probe_sensors(lambda: [], gpu_indices=[], rapl_root=sysfs["root"])
    assert [s.name for s in sensors] == ["rapl"]
    sensors = probe_sensors(lambda: [], gpu_indices=[], rapl_root=tmp_path / "missing")
    assert [s.name for s in sensors] == ["cpu_model"]
    infos = [i for i in describe_sensors(gpu_indices=[], rapl_root=sysfs["root"])
             if i.name in ("nvml", "rapl", "cpu_model")]  # the other platforms' rows: tests/telemetry/test_platforms.py
    assert [i.name for i in infos] == ["nvml", "rapl", "cpu_model"]
    assert infos[1].available and infos[1].components == ("package-0", "dram-0", "package-1", "dram-1")
    assert infos[2].detail.startswith("not used")
