from __future__ import annotations

import sys
from unittest import mock

import pynvml as real_pynvml
import pytest

from ipw.errors import IpwError
from ipw.telemetry import nvml as nvml_mod
from ipw.telemetry.nvml import NvmlCounterSensor

UUIDS = ["GPU-aaaa1111-0000", "GPU-bbbb2222-0000", "GPU-cccc3333-0000"]


def err(name: str) -> real_pynvml.NVMLError:
    return real_pynvml.NVMLError(getattr(real_pynvml, name))


@pytest.fixture
def fake(monkeypatch):
    """An autospec of the real pynvml module with three GPUs; handles are their indices."""
    m = mock.create_autospec(real_pynvml)
    m.NVMLError = real_pynvml.NVMLError
    for name in dir(real_pynvml):
        if name.startswith("NVML_"):
            setattr(m, name, getattr(real_pynvml, name))
    m.nvmlDeviceGetCount.return_value = len(UUIDS)
    m.nvmlDeviceGetHandleByIndex.side_effect = lambda i: ("handle", i)
    m.nvmlDeviceGetUUID.side_effect = lambda h: UUIDS[h[1]]
    m.nvmlDeviceGetName.side_effect = lambda h: "NVIDIA H200"
    m.nvmlDeviceGetMigMode.side_effect = err("NVML_ERROR_NOT_SUPPORTED")
    m.energy_mj = {0: 1_000, 1: 50_000, 2: 900_000}
    m.nvmlDeviceGetTotalEnergyConsumption.side_effect = lambda h: m.energy_mj[h[1]]
    monkeypatch.setitem(sys.modules, "pynvml", m)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return m


def test_counter_deltas(fake):
    sensor = NvmlCounterSensor()
    assert sensor.info().components == ("gpu0", "gpu1", "gpu2")
    token = sensor.begin()
    fake.energy_mj[0] += 12_345
    fake.energy_mj[2] += 500
    readings = sensor.end(token)
    assert [(r.component, r.energy_j) for r in readings] == [
        ("gpu0", 12.345), ("gpu1", 0.0), ("gpu2", 0.5),
    ]
    r = readings[0]
    assert (r.source, r.scope, r.quality) == ("nvml.counter", "gpu", "measured")
    assert "100 ms" in r.note  # an instantaneous window is below the counter step
    sensor.close()
    sensor.close()
    fake.nvmlShutdown.assert_called_once_with()


def test_backwards_counter_is_unavailable_never_negative(fake):
    sensor = NvmlCounterSensor([1])
    token = sensor.begin()
    fake.energy_mj[1] -= 10
    (reading,) = sensor.end(token)
    assert reading.energy_j is None
    assert reading.quality == "unavailable"
    assert "counter went backwards (gap)" in reading.note


def test_cuda_visible_devices_uuids_and_indices(fake, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-cccc3333-0000,GPU-aaaa")  # full UUID, prefix
    sensor = NvmlCounterSensor()
    gpus = sensor.info().params["gpus"]
    assert [(g["component"], g["nvml_index"], g["uuid"]) for g in gpus] == [
        ("gpu0", 2, UUIDS[2]), ("gpu1", 0, UUIDS[0]),
    ]
    token = sensor.begin()
    fake.energy_mj[2] += 2_000
    assert sensor.end(token)[0].energy_j == 2.0

    only = NvmlCounterSensor([1])  # CUDA ordinal 1 = physical GPU 0
    assert only.info().params["gpus"][0]["nvml_index"] == 0

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,GPU-nonexistent,0")  # CUDA stops at a bad entry
    assert [g["nvml_index"] for g in NvmlCounterSensor().info().params["gpus"]] == [1]
    with pytest.raises(IpwError, match="GPU 1 is not visible"):
        NvmlCounterSensor([1])

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1234")
    with pytest.raises(IpwError, match="MIG slice"):
        NvmlCounterSensor()

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert NvmlCounterSensor.probe() is None


def test_mig_mode_is_reported(fake):
    fake.nvmlDeviceGetMigMode.side_effect = lambda h: [
        real_pynvml.NVML_DEVICE_MIG_ENABLE if h[1] == 0 else real_pynvml.NVML_DEVICE_MIG_DISABLE, 0
    ]
    sensor = NvmlCounterSensor()
    info = sensor.info()
    assert "MIG enabled on gpu0" in info.detail and "not attributable" in info.detail
    assert [g["mig_enabled"] for g in info.params["gpus"]] == [True, False, False]
    assert "MIG" in sensor.end(sensor.begin())[0].note


@pytest.mark.parametrize(
    "where, code, expected",
    [
        ("init", "NVML_ERROR_NO_PERMISSION", "video"),
        ("energy", "NVML_ERROR_NOT_SUPPORTED", "Volta"),
        ("energy", "NVML_ERROR_GPU_IS_LOST", "dmesg"),
        ("init", "NVML_ERROR_UNKNOWN", "nvidia-smi"),
    ],
)
def test_nvml_errors_become_ipw_errors_with_a_fix(fake, where, code, expected):
    if where == "init":
        fake.nvmlInit.side_effect = err(code)
    else:
        fake.nvmlDeviceGetTotalEnergyConsumption.side_effect = err(code)
    with pytest.raises(IpwError) as e:
        NvmlCounterSensor()
    assert expected in e.value.message
    if code in nvml_mod._FIXES:
        assert code in e.value.message
    with pytest.raises(IpwError):
        NvmlCounterSensor.probe()  # a GPU that exists but fails is not silently skipped
    if where == "energy":
        assert fake.nvmlShutdown.call_count == fake.nvmlInit.call_count


@pytest.mark.parametrize("code", ["NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED"])
def test_probe_none_without_library_or_driver(fake, code):
    fake.nvmlInit.side_effect = err(code)
    assert NvmlCounterSensor.probe() is None


def test_probe_none_without_devices_or_pynvml(fake, monkeypatch):
    fake.nvmlDeviceGetCount.return_value = 0
    assert NvmlCounterSensor.probe() is None
    fake.nvmlShutdown.assert_called_once_with()
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert NvmlCounterSensor.probe() is None
    with pytest.raises(IpwError, match="pip install nvidia-ml-py"):
        nvml_mod.import_pynvml()


def test_probe_sensors_order(fake, tmp_path):
    from ipw.telemetry.probe import describe_sensors, probe_sensors

    sensors = probe_sensors(lambda: [], rapl_root=tmp_path / "none")
    assert [s.name for s in sensors] == ["nvml", "cpu_model"]
    assert [s.name for s in probe_sensors(lambda: [], gpu_indices=[], rapl_root=tmp_path)] == ["cpu_model"]
    fake.nvmlInit.side_effect = err("NVML_ERROR_NO_PERMISSION")
    infos = describe_sensors(rapl_root=tmp_path / "none")
    assert [(i.name, i.available) for i in infos] == [
        ("nvml", False), ("rapl", False), ("cpu_model", True),
    ]
    assert "video" in infos[0].detail
