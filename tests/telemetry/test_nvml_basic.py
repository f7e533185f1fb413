"""NvmlSensor basics against an autospec'd pynvml of three GPUs (tests/nvml_fakes.py): which GPUs
are read (indices, UUIDs, CUDA_VISIBLE_DEVICES), MIG, NVML errors with their fix, ``probe`` and the
sensor order of ``probe_sensors`` / ``describe_sensors``."""

from __future__ import annotations

import sys
import time

import numpy as np
import pynvml as real_pynvml
import pytest
from nvml_fakes import RealClock, err, finish, make_fake, real_offset_ns, synthetic, window

from ipw.errors import IpwError
from ipw.telemetry import nvml as nvml_mod
from ipw.telemetry.nvml import NvmlSensor

UUIDS = ["GPU-aaaa1111-0000", "GPU-bbbb2222-0000", "GPU-cccc3333-0000"]
IDLE_W = [100.0, 200.0, 300.0]  # GPU i idles at IDLE_W[i]: a window's energy says which GPU was read


@pytest.fixture
def gpus():
    """Three synthetic GPUs on one fake clock (no load: constant power)."""
    sigs = []
    for w in IDLE_W:
        sig, clock = synthetic(idle_w=w, load=(1000.0, 1001.0))
        sigs.append(sig)
    return sigs, clock


@pytest.fixture
def fake(monkeypatch, gpus):
    sigs, clock = gpus
    return make_fake(monkeypatch, sigs, clock, uuids=UUIDS)


def sensor_at(clock, indices=None, **kw) -> NvmlSensor:
    return NvmlSensor(indices, threaded=False, clock_ns=clock.mono, wall_ns=clock.wall, **kw)


def test_every_gpu_by_default(fake, gpus):
    _, clock = gpus
    sensor = sensor_at(clock)
    assert sensor.info().components == ("gpu0", "gpu1", "gpu2")
    readings = finish(sensor, clock, window(sensor, clock, 10.0, 12.0))
    assert [r.component for r in readings] == ["gpu0", "gpu1", "gpu2"]
    assert [r.energy_j for r in readings] == [pytest.approx(2 * w, rel=0.01) for w in IDLE_W]
    r = readings[0]
    assert (r.source, r.scope, r.quality) == ("nvml.samples", "gpu", "measured_interpolated")
    assert "calibration ratio" in r.note
    sensor.close()
    sensor.close()
    fake.nvmlShutdown.assert_called_once_with()


def test_backwards_counter_is_unavailable_never_negative(fake, gpus):
    sigs, clock = gpus
    sigs[1].samples_ok = sigs[1].instant_ok = False  # the counter is all there is
    sigs[1].ctr_mj = sigs[1].ctr_mj.copy()
    drop = int(np.searchsorted(sigs[1].ctr_t_ns, clock.mono_ns + 11_000_000_000))
    sigs[1].ctr_mj[drop:] -= 3_000_000
    sensor = sensor_at(clock, [1])
    (r,) = finish(sensor, clock, window(sensor, clock, 10.5, 11.5))
    assert r.source == "nvml.counter" and "backwards" in r.note
    assert r.energy_j is None or 0 <= r.energy_j < 200.0
    sensor.close()


def test_cuda_visible_devices_uuids_and_indices(fake, gpus, monkeypatch):
    _, clock = gpus
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-cccc3333-0000,GPU-aaaa")  # full UUID, prefix
    sensor = sensor_at(clock)
    params = sensor.info().params
    assert [(g["component"], g["nvml_index"], g["uuid"]) for g in params["gpus"]] == [
        ("gpu0", 2, UUIDS[2]), ("gpu1", 0, UUIDS[0]),
    ]
    assert params["cuda_visible_devices"] == "GPU-cccc3333-0000,GPU-aaaa"
    readings = finish(sensor, clock, window(sensor, clock, 10.0, 11.0))
    assert [r.energy_j for r in readings] == [pytest.approx(300.0, rel=0.01), pytest.approx(100.0, rel=0.01)]
    sensor.close()
    read = {c.args[0][1] for c in fake.nvmlDeviceGetTotalEnergyConsumption.call_args_list}
    assert read == {0, 2}  # GPU 1 is not measured

    only = sensor_at(clock, [1])  # CUDA ordinal 1 = physical GPU 0
    assert only.info().params["gpus"][0]["nvml_index"] == 0
    (r,) = finish(only, clock, window(only, clock, 20.0, 21.0))
    assert r.component == "gpu1" and r.energy_j == pytest.approx(100.0, rel=0.01)
    only.close()

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,GPU-nonexistent,0")  # CUDA stops at a bad entry
    s = sensor_at(clock)
    assert [g["nvml_index"] for g in s.info().params["gpus"]] == [1]
    s.close()
    with pytest.raises(IpwError, match="GPU 1 is not visible"):
        sensor_at(clock, [1])

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1234")
    with pytest.raises(IpwError, match="MIG slice"):
        sensor_at(clock)

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert NvmlSensor.probe() is None
    assert fake.nvmlShutdown.call_count == fake.nvmlInit.call_count  # failures leave nothing open


def test_mig_mode_is_reported(fake, gpus):
    _, clock = gpus
    fake.nvmlDeviceGetMigMode.side_effect = lambda h: [
        real_pynvml.NVML_DEVICE_MIG_ENABLE if h[1] == 0 else real_pynvml.NVML_DEVICE_MIG_DISABLE, 0
    ]
    sensor = sensor_at(clock)
    info = sensor.info()
    assert "MIG enabled on gpu0" in info.detail and "not attributable" in info.detail
    assert [g["mig_enabled"] for g in info.params["gpus"]] == [True, False, False]
    assert "not attributable" in info.params["mig"]
    readings = finish(sensor, clock, window(sensor, clock, 10.0, 11.0))
    assert "MIG" in readings[0].note and "MIG" not in readings[1].note
    sensor.close()


@pytest.mark.parametrize(
    "where, code, expected",
    [
        ("init", "NVML_ERROR_NO_PERMISSION", "video"),
        ("power", "NVML_ERROR_NOT_SUPPORTED", "Volta"),
        ("power", "NVML_ERROR_NO_PERMISSION", "video"),
        ("power", "NVML_ERROR_GPU_IS_LOST", "dmesg"),
        ("query", "NVML_ERROR_LIB_RM_VERSION_MISMATCH", "reboot"),
        ("init", "NVML_ERROR_UNKNOWN", "nvidia-smi"),
    ],
)
def test_nvml_errors_become_ipw_errors_with_a_fix(fake, gpus, where, code, expected):
    sigs, clock = gpus
    if where == "init":
        fake.nvmlInit.side_effect = err(code)
    elif where == "query":
        fake.nvmlDeviceGetCount.side_effect = err(code)
    else:  # every power signal of GPU 1 fails
        sigs[1].fail_with = code
    with pytest.raises(IpwError) as e:
        sensor_at(clock)
    assert expected in e.value.message
    if code in nvml_mod._FIXES:
        assert code in e.value.message
    if where == "power":
        assert "gpu1" in e.value.message
    with pytest.raises(IpwError):
        NvmlSensor.probe(threaded=False, clock_ns=clock.mono, wall_ns=clock.wall)  # not silently skipped
    # every successful nvmlInit is matched by a shutdown, also when the sensor is refused
    assert fake.nvmlShutdown.call_count == (0 if where == "init" else fake.nvmlInit.call_count)


def test_one_missing_signal_is_not_an_error(fake, gpus):
    sigs, clock = gpus
    sigs[0].counter_ok = False
    sensor = sensor_at(clock)
    assert "counter on gpu0" in sensor.info().detail  # says what is missing
    assert sensor.info().params["signals"]["gpu0"]["counter"].startswith("unsupported")
    sensor.close()


@pytest.mark.parametrize("code", ["NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED"])
def test_probe_none_without_library_or_driver(fake, code):
    fake.nvmlInit.side_effect = err(code)
    assert NvmlSensor.probe() is None
    fake.nvmlShutdown.assert_not_called()


def test_probe_none_without_devices_or_pynvml(fake, monkeypatch):
    fake.nvmlDeviceGetCount.return_value = 0
    assert NvmlSensor.probe() is None
    fake.nvmlShutdown.assert_called_once_with()
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert NvmlSensor.probe() is None
    with pytest.raises(IpwError, match="pip install nvidia-ml-py"):
        nvml_mod.import_pynvml()


def test_probe_sensors_order(monkeypatch, tmp_path):
    """probe_sensors / describe_sensors open the real (threaded) NvmlSensor on the real clock."""
    from ipw.telemetry.probe import PLATFORMS, describe_sensors, probe_sensors

    sigs = [synthetic(duration_s=60.0, t0_s=time.monotonic(), idle_w=w, load=(100.0, 101.0),
                      offset_ns=real_offset_ns())[0] for w in IDLE_W[:2]]
    fake = make_fake(monkeypatch, sigs, RealClock())
    sensors = probe_sensors(lambda: [], rapl_root=tmp_path / "none")
    try:
        assert [s.name for s in sensors] == ["nvml", "cpu_model"]
        assert sensors[0].info().components == ("gpu0", "gpu1")
        assert sensors[0].sampler.overhead()["threaded"]
    finally:
        for s in sensors:
            s.close()
    assert [s.name for s in probe_sensors(lambda: [], gpu_indices=[], rapl_root=tmp_path)] == ["cpu_model"]
    sensors = probe_sensors(lambda: [], gpu_indices=[1], rapl_root=tmp_path / "none")
    assert sensors[0].info().params["gpus"][0]["nvml_index"] == 1
    for s in sensors:
        s.close()

    core = ("nvml", "rapl", "cpu_model")  # the other platforms' rows: tests/telemetry/test_platforms.py
    infos = describe_sensors(rapl_root=tmp_path / "none")
    # the documented order (docs/PLATFORMS.md, probe.py): NVML, the registry's platforms, RAPL, the CPU model
    assert [i.name for i in infos] == ["nvml", *(e.name for e in PLATFORMS), "node_power", "rapl", "cpu_model"]
    assert [(i.name, i.available) for i in infos if i.name in core] == [("nvml", True), ("rapl", False), ("cpu_model", True)]
    assert infos[0].source == "nvml.samples"

    # describe_sensors never raises: NVML errors and a missing driver become unavailable rows
    fake.nvmlInit.side_effect = err("NVML_ERROR_NO_PERMISSION")
    infos = describe_sensors(rapl_root=tmp_path / "none")
    assert [(i.name, i.available) for i in infos if i.name in core] == [("nvml", False), ("rapl", False), ("cpu_model", True)]
    assert "video" in infos[0].detail
    fake.nvmlInit.side_effect = err("NVML_ERROR_DRIVER_NOT_LOADED")
    infos = describe_sensors(rapl_root=tmp_path / "none")
    assert infos[0].available is False and "no NVIDIA" in infos[0].detail
    fake.nvmlInit.side_effect = None
    sigs[0].fail_with = "NVML_ERROR_NOT_SUPPORTED"
    infos = describe_sensors(rapl_root=tmp_path / "none")
    assert infos[0].available is False and "Volta" in infos[0].detail
    with pytest.raises(IpwError, match="Volta"):
        probe_sensors(lambda: [], rapl_root=tmp_path / "none")
    # the two failed inits, each tried by NvmlSensor and by the module sensor (ipw/telemetry/superchip.py)
    assert fake.nvmlShutdown.call_count == fake.nvmlInit.call_count - 4


def test_many_windows_resolved_at_once_read_as_one_at_a_time(monkeypatch):
    """``PendingWindow.resolve_all`` (ipw serve under load: one estimate for every ready window) gives
    each window the readings its own ``result()`` would, and leaves windows that are not ready alone."""
    from nvml_fakes import drive

    from ipw.telemetry.nvml import PendingWindow
    from ipw.metering.window import Closed, resolve

    sig, clock = synthetic(idle_w=100.0, load_w=400.0, load=(10.3, 11.1))
    make_fake(monkeypatch, [sig], clock)
    sensor = sensor_at(clock)
    drive(sensor, clock, int(1010.0 * 1e9))
    token = sensor.begin()
    tiled = []
    for t in (10.2, 10.5, 10.55, 11.0, 11.4):
        drive(sensor, clock, int((1000.0 + t) * 1e9))
        pending, token = sensor.cut(token)
        tiled.append(pending)
    late = sensor.end(token)  # ends now: not ready until the sampler reads past it
    drive(sensor, clock, int((tiled[-1].end_s + 1.2) * 1e9))
    late = PendingWindow(sensor, int(late.start_s * 1e9), int(clock.mono_ns + 5e8))
    resolve([Closed([p]) for p in tiled] + [Closed([late])])
    assert all(p._result is not None for p in tiled) and late._result is None
    for p in tiled:
        alone = PendingWindow(sensor, int(round(p.start_s * 1e9)), p.end_ns).result()
        assert [r.energy_j for r in p.result()] == pytest.approx([r.energy_j for r in alone], rel=1e-12)
        assert [(r.quality, r.source) for r in p.result()] == [(r.quality, r.source) for r in alone]
    assert sum(p.result()[0].energy_j for p in tiled) == pytest.approx(
        100.0 * 1.4 + 300.0 * 0.8, rel=0.02)  # 1.4 s of idle, 0.8 s at +300 W
    sensor.close()
