"""``ipw doctor`` on machines without a GPU (CI), and with a mocked one; the self-test's helpers."""

from __future__ import annotations

import io
import sys
from unittest import mock

import numpy as np
import pynvml as real_pynvml
import pytest

from ipw.commands import doctor as doctor_mod
from ipw.commands.doctor import doctor
from ipw.telemetry.selftest import gpu_self_test, step_lag_s


def test_doctor_without_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no nvidia-ml-py: NVML is simply absent
    buf = io.StringIO()
    assert doctor(False, file=buf) == 0
    text = buf.getvalue()
    assert "nvml" in text and "no NVIDIA library, driver or visible GPU" in text
    assert "cpu_model" in text and "rapl" in text

    buf = io.StringIO()
    assert doctor(True, seconds=5, file=buf) == 0  # nothing to self-test: says so, does not fail
    assert "self-test: skipped" in buf.getvalue()


def _fake_nvml(monkeypatch, init_error: str | None = None):
    m = mock.create_autospec(real_pynvml)
    m.NVMLError = real_pynvml.NVMLError
    for name in dir(real_pynvml):
        if name.startswith("NVML_"):
            setattr(m, name, getattr(real_pynvml, name))
    if init_error:
        m.nvmlInit.side_effect = real_pynvml.NVMLError(getattr(real_pynvml, init_error))
    m.nvmlDeviceGetCount.return_value = 1
    m.nvmlDeviceGetHandleByIndex.side_effect = lambda i: ("handle", i)
    m.nvmlDeviceGetUUID.return_value = "GPU-1234"
    m.nvmlDeviceGetName.return_value = "NVIDIA H200"
    m.nvmlDeviceGetMigMode.side_effect = real_pynvml.NVMLError(real_pynvml.NVML_ERROR_NOT_SUPPORTED)
    m.nvmlDeviceGetTotalEnergyConsumption.return_value = 1000
    m.nvmlDeviceGetSamples.side_effect = real_pynvml.NVMLError(real_pynvml.NVML_ERROR_NOT_FOUND)
    fv = (real_pynvml.c_nvmlFieldValue_t * 1)()
    fv[0].valueType = real_pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    fv[0].value.uiVal = 123_000
    m.nvmlDeviceGetFieldValues.return_value = fv
    monkeypatch.setitem(sys.modules, "pynvml", m)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return m


def test_doctor_rows_with_a_gpu_and_with_a_broken_one(monkeypatch):
    fake = _fake_nvml(monkeypatch)
    rows = doctor_mod.sensor_rows()
    nvml = rows[0]
    assert nvml[:5] == ["nvml", "yes", "nvml.samples", "measured_interpolated", "gpu"]
    assert "20 ms" in nvml[5] and "NVIDIA H200" in nvml[6]
    assert fake.nvmlShutdown.call_count == fake.nvmlInit.call_count  # the probe sensor was closed
    fake.nvmlDeviceGetPowerUsage.assert_not_called()

    _fake_nvml(monkeypatch, init_error="NVML_ERROR_NO_PERMISSION")
    buf = io.StringIO()
    assert doctor(True, seconds=5, file=buf) == 0
    text = buf.getvalue()
    assert "video" in text and "self-test: skipped" in text  # the fix, and no self-test


def test_plain_text_output_without_rich(monkeypatch):
    monkeypatch.setitem(sys.modules, "rich.console", None)
    out = doctor_mod._Out(io.StringIO())
    assert out._console is None
    out.table("t", ["a", "bb"], [["1", "2"], ["333", "4"]])
    out.line("done")
    assert out.file.getvalue().splitlines() == ["t", "a    bb", "1    2 ", "333  4 ", "", "done"]


def test_step_lag():
    t = np.arange(0.0, 10.0, 0.02)
    on, off = 4.0, 7.0
    lag = 0.013
    p = np.where((t - lag >= on) & (t - lag < off), 500.0, 100.0)
    got = step_lag_s(t, p, on, off)
    assert got["rise_s"] == pytest.approx(lag, abs=0.011) and got["fall_s"] == pytest.approx(lag, abs=0.011)
    assert step_lag_s(t, p, 0.2, 0.4) == {"rise_s": None, "fall_s": None}


def test_gpu_self_test_with_a_fake_gpu_and_no_torch(monkeypatch):
    """The self-test's code path on a synthetic GPU (real clock, shortened phases): call costs,
    update periods, the idle phase against the densely read counter, overhead; no torch: no load."""
    import time

    from test_nvml_sampler import make_fake, synthetic  # the same autospec'd fake NVML

    class RealClock:
        def mono(self):
            return time.monotonic_ns()

        def wall(self):
            return time.time_ns()

    offset = time.monotonic_ns() - time.time_ns()
    sig, _ = synthetic(duration_s=60.0, t0_s=time.monotonic(), load=(100.0, 101.0), offset_ns=offset)
    fake = make_fake(monkeypatch, [sig], RealClock())
    fake.nvmlSystemGetDriverVersion.return_value = "580.fake"
    fake.nvmlDeviceGetPowerUsage.side_effect = None
    fake.nvmlDeviceGetPowerUsage.return_value = 100_000
    monkeypatch.setitem(sys.modules, "torch", None)
    lines = []
    r = gpu_self_test(seconds=0, log=lines.append, probe_s=0.3, phase_s=1.5)
    assert r["gpu"]["name"] == "NVIDIA H200" and r["driver"] == "580.fake"
    assert set(r["call_costs"]) >= {"counter (nvmlDeviceGetTotalEnergyConsumption)", "samples (nvmlDeviceGetSamples)"}
    assert r["update_periods"]["sample"]["median_period_s"] == pytest.approx(0.02, abs=1e-3)
    assert "torch is not importable" in r["load"] and "load" not in r["step"]
    idle = r["step"]["idle"]
    assert idle["reference_reads"] > 10 and abs(idle["error"]) < 0.05 and idle["mean_w"] == pytest.approx(100, rel=0.05)
    assert r["sampler_overhead"]["threaded"] and "passed" in r
    assert fake.nvmlShutdown.call_count == fake.nvmlInit.call_count
    buf = io.StringIO()
    doctor_mod._print_self_test(doctor_mod._Out(buf), r)
    assert "idle/load step" in buf.getvalue() and "torch is not importable" in buf.getvalue()
    # the run-level audit over its one window (idle: nothing between), shown like ipw run's (issue 27)
    (audit,) = r["energy_audit"]
    assert audit["component"] == "gpu0" and audit["queries"] == 1 and audit["idle_between_j"] == 0.0
    assert audit["agrees"] and audit["line"] in buf.getvalue()
