"""Sensors of other platforms (docs/PLATFORMS.md) and sensor traces (``ipw doctor --record-trace``),
each against a fake of its library that replays a trace (tests/platform_fakes.py)."""

from __future__ import annotations

import io
import re
import time

import numpy as np
import pytest
from nvml_fakes import RealClock, drive, finish, make_fake, real_offset_ns, synthetic, window
from platform_fakes import nvml_clock, nvml_signals, scoped_fields, trace_events

from ipw.commands.doctor import doctor
from ipw.errors import IpwError
from ipw.telemetry.estimator import SHORT_WINDOW_S, counter_energy_between
from ipw.telemetry.nvml import NvmlSensor
from ipw.telemetry.recording import NvmlRecorder, read_trace, record, write_trace


# --------------------------------------------------------------------------------------------------
# NVML traces: recorded through the (autospec'd) library, replayed through the NVML fake


def _record_synthetic_nvml(monkeypatch, tmp_path, seconds=3.0):
    """A trace recorded by NvmlRecorder on the real clock from a synthetic GPU: 100 W idle, 400 W
    from 0.6 s to 1.4 s after t0, 1.5 s after now (20 ms samples, 100 ms counter steps, as the H200
    recordings show)."""
    t0 = time.monotonic() + 1.5
    sig, _ = synthetic(seconds + 2, load=(0.6, 1.4), t0_s=t0, offset_ns=real_offset_ns())
    fake = make_fake(monkeypatch, [sig], RealClock())
    scoped_fields(fake)
    fake.nvmlSystemGetDriverVersion.return_value = "580.159.04"
    trace = record(seconds, recs=[NvmlRecorder()])
    path = write_trace(trace, tmp_path / "trace.json.gz")
    return path, t0


def test_nvml_trace_round_trip(monkeypatch, tmp_path):
    path, t0 = _record_synthetic_nvml(monkeypatch, tmp_path)
    trace = read_trace(path)
    dev = trace["platforms"]["nvml"]["devices"][0]
    assert dev["power_scope_probe"] == {"gpu": "ok", "module": "NVML_ERROR_NOT_SUPPORTED"}
    assert len(dev["counter_mj"]["v"]) >= 30 and len(dev["samples_mw"]["v"]) >= 80
    assert not dev["module_instant_mw"]["v"] and dev["errors"] == []

    # replay it through the NVML fake: the sensor sees what the recorder saw
    sigs, offset = nvml_signals(trace)
    clock = nvml_clock(trace, offset)
    make_fake(monkeypatch, sigs, clock)
    sensor = NvmlSensor(threaded=False, clock_ns=clock.mono, wall_ns=clock.wall)
    try:
        base = trace["start_ns"] / 1e9
        rel = t0 - base  # the synthetic load's origin, in seconds after the recording's start
        assert rel > 0.2  # the recorder opened before the load (else the windows below are cut)
        load = window(sensor, clock, rel + 0.7, rel + 1.3, base)
        idle = window(sensor, clock, rel + 1.5, rel + 1.55, base)
        (r_load,), (r_idle,) = finish(sensor, clock, load), finish(sensor, clock, idle)
        est_load, est_idle = sensor.energy_windows([(load.start_s, load.end_s), (idle.start_s, idle.end_s)])["gpu0"]
    finally:
        sensor.close()
    assert r_load.source == "nvml.samples" and r_load.quality == "measured_interpolated"
    # the driver samples the recorder saw, integrated: 400 W for 0.6 s (calibration by a 2 s recording's
    # counter, 100 ms steps, moves the calibrated value by more: it is reported in the note)
    assert est_load.uncalibrated_j == pytest.approx(400.0 * 0.6, rel=0.02)
    ratio = float(re.search(r"calibration ratio ([0-9.]+)", r_load.note).group(1))
    assert r_load.energy_j == pytest.approx(ratio * est_load.uncalibrated_j, rel=1e-3)
    assert "short window" in r_idle.note and est_idle.uncalibrated_j == pytest.approx(100.0 * 0.05, rel=0.1)


def test_record_trace_on_this_machine(tmp_path, monkeypatch):
    """``ipw doctor --record-trace`` on a machine without NVML or RAPL: a trace saying why."""
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)
    path = tmp_path / "t.json"
    buf = io.StringIO()
    assert doctor(False, seconds=0.3, file=buf, record_trace=str(path)) == 0
    trace = read_trace(path)
    assert trace["platforms"]["nvml"] == {"available": False,
                                          "why": "pynvml is not importable (pip install nvidia-ml-py)"}
    assert "record-trace" in buf.getvalue()


def test_record_trace_bad_path_and_bad_file(tmp_path):
    with pytest.raises(IpwError, match="--record-trace .*cannot write there"):
        doctor(False, seconds=0.3, file=io.StringIO(), record_trace=str(tmp_path / "no" / "t.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(IpwError, match="field 'format'"):
        read_trace(bad)
