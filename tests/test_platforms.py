"""Sensors of other platforms (docs/PLATFORMS.md) and sensor traces (``ipw doctor --record-trace``),
each against a fake of its library that replays a trace (tests/platform_fakes.py)."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

import numpy as np
import pytest
from nvml_fakes import RealClock, drive, finish, make_fake, real_offset_ns, synthetic, window
from platform_fakes import nvml_clock, nvml_signals, scoped_fields, trace_events

from ipw.commands.doctor import STEP_TOLERANCE, doctor
from ipw.errors import IpwError
from ipw.telemetry.estimator import CALIBRATION_BOUNDS
from ipw.telemetry.nvml import NvmlSensor
from ipw.telemetry.polled import counter_checks
from ipw.telemetry.recording import NvmlRecorder, read_trace, record, write_trace
from ipw.telemetry.sampler import COUNTER_STEP_S


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


# --------------------------------------------------------------------------------------------------
# the real H200 trace (tests/data/h200-nvml-trace.json.gz: `ipw doctor --record-trace ... --seconds 24`
# on one H200, driver 580.159.04; 8 s idle, 8 s of bf16 matmuls, 8 s idle; its log is
# docs/platforms/h200-record-trace.log), replayed through the NVML fake


H200_TRACE = Path(__file__).parent / "data" / "h200-nvml-trace.json.gz"


@pytest.fixture(scope="module")
def h200_trace():
    return read_trace(H200_TRACE)


def test_h200_trace_replays_through_the_nvml_fake(monkeypatch, h200_trace):
    trace = h200_trace
    dev = trace["platforms"]["nvml"]["devices"][0]
    assert dev["name"] == "NVIDIA H200" and dev["power_scope_probe"]["gpu"] == "ok"
    sigs, offset = nvml_signals(trace)
    clock = nvml_clock(trace, offset)
    fake = make_fake(monkeypatch, sigs, clock)
    scoped_fields(fake)  # the H200 answered module scope with NOT_SUPPORTED: so does the fake
    sensor = NvmlSensor(threaded=False, clock_ns=clock.mono, wall_ns=clock.wall)
    base = trace["start_ns"] / 1e9
    ev = trace_events(trace)
    on, off = (ev["load_start"] / 1e9 - base, ev["load_end"] / 1e9 - base)
    spans = {"idle": (1.0, on - 1.0), "load": (on + 0.5, off - 0.5), "after": (off + 2.0, 23.0)}
    try:
        pend = {k: window(sensor, clock, a, b, base) for k, (a, b) in spans.items()}
        got = {k: finish(sensor, clock, p)[0] for k, p in pend.items()}
        # windows that tile the load phase (cut at every 0.25 s, some 50 ms)
        drive(sensor, clock, int((base + on) * 1e9))
        token, tiles = sensor.begin(), []
        edges = np.concatenate((np.arange(on, off, 0.25), [off]))
        for b in edges[1:]:
            drive(sensor, clock, int((base + b) * 1e9))
            p, token = sensor.cut(token)
            tiles.append(p)
        whole = window(sensor, clock, on, off, base)
        short = window(sensor, clock, on + 3.0, on + 3.05, base)
        tiles_j = sum(finish(sensor, clock, p)[0].energy_j for p in tiles)
        (r_whole,), (r_short,) = finish(sensor, clock, whole), finish(sensor, clock, short)
        est = sensor.energy_windows([(base + a, base + b) for a, b in (spans["load"], spans["idle"])])["gpu0"]
    finally:
        sensor.close()
    fake.nvmlDeviceGetPowerUsage.assert_not_called()
    for r in got.values():
        assert r.source == "nvml.samples" and r.quality == "measured_interpolated"
    # the load moved the counter: the load phase draws several times the idle power
    assert got["load"].energy_j / (spans["load"][1] - spans["load"][0]) > 3 * got["idle"].energy_j / (spans["idle"][1] - spans["idle"][0])
    # long windows agree with the counter's own delta within the doctor's step tolerance
    for e in est:
        assert e.counter_delta_j is not None and abs(e.energy_j / e.counter_delta_j - 1) <= STEP_TOLERANCE
    assert tiles_j == pytest.approx(r_whole.energy_j, rel=1e-3)  # windows that tile time lose nothing
    assert "short window" in r_short.note


def test_h200_trace_counter_cross_checks(h200_trace):
    """The recorded counter against the recorded driver samples (power x time): it moves under load,
    never goes backwards, and agrees within NVML's calibration bounds over the 24 s."""
    dev = h200_trace["platforms"]["nvml"]["devices"][0]
    sigs, offset = nvml_signals(h200_trace)
    s = sigs[0]
    samples_t = (s.samp_ts_us * 1000 + offset) / 1e9
    lo, hi = CALIBRATION_BOUNDS
    check = counter_checks(s.ctr_t_ns / 1e9, s.ctr_mj / 1e3, samples_t, s.samp_mw / 1e3,
                           step_s=COUNTER_STEP_S, tolerance=max(1 - lo, hi - 1))
    assert check.ok, check.problems
    assert lo <= check.ratio <= hi
    assert not dev["errors"]
