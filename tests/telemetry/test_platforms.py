"""Sensors of other platforms (docs/PLATFORMS.md) and sensor traces (``ipw doctor --record-trace``),
each against a fake of its library that replays a trace (tests/platform_fakes.py)."""

from __future__ import annotations

import io
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from nvml_fakes import RealClock, drive, finish, make_fake, real_offset_ns, synthetic, window
from platform_fakes import (
    AMDSMI_STATUS_NO_PERM,
    AMDSMI_STATUS_NOT_SUPPORTED,
    FakeHwmon,
    PollClock,
    answer_at,
    drive_hwmon,
    drive_polled,
    fake_amdsmi,
    fake_zeus_apple_silicon,
    nvml_clock,
    nvml_signals,
    polled_window,
    scoped_fields,
    trace_events,
)

from ipw.commands.doctor import STEP_TOLERANCE, doctor
from ipw.errors import IpwError
from ipw.telemetry.estimator import CALIBRATION_BOUNDS
from ipw.telemetry.nvml import NvmlSensor
from ipw.telemetry.polled import counter_checks
from ipw.telemetry.recording import NvmlRecorder, read_trace, record, write_trace
from ipw.telemetry.nvml_estimate import COUNTER_STEP_S


# --------------------------------------------------------------------------------------------------
# NVML traces: recorded through the (autospec'd) library, replayed through the NVML fake


def _record_synthetic_nvml(monkeypatch, tmp_path, seconds=4.0):
    """A trace recorded by NvmlRecorder on the real clock from a synthetic GPU: 100 W idle, 400 W
    from 0.6 s to 1.4 s after t0, 1 s after now (20 ms samples, 100 ms counter steps, as the H200
    recordings show); the recording goes on 1.5 s past the windows the test reads."""
    gpus = [synthetic(1.0)[0]]  # replaced below, once the (slow) autospec is made
    fake = make_fake(monkeypatch, gpus, RealClock())
    scoped_fields(fake)
    fake.nvmlSystemGetDriverVersion.return_value = "580.159.04"
    t0 = time.monotonic() + 1.0
    gpus[0] = synthetic(seconds + 2, load=(0.6, 1.4), t0_s=t0, offset_ns=real_offset_ns())[0]
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
        assert 0.2 < rel < 4.0 - 1.55 - 1.0  # the windows below lie inside the recording
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
# bench/evidence/telemetry/platforms/h200-record-trace.log), replayed through the NVML fake


H200_TRACE = Path(__file__).parents[1] / "data" / "h200-nvml-trace.json.gz"


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
        assert "counter distrusted" not in r.note and "counter check" not in r.note  # the real counter passes
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


# --------------------------------------------------------------------------------------------------
# AMD GPUs through amdsmi: a trace entry in the record-trace format, replayed by tests/platform_fakes.py
#
# Values: counter_resolution 15.3 µJ and fields in W/µJ as ROCm/amdsmi py-interface/README.md documents
# them ("Energy accumulated with a 15.3 uJ resolution"; energy_accumulator x counter_resolution = µJ);
# power synthetic: 140 W idle, 600 W for 10 s, inside an MI300X's 750 W board power.  The device is
# sampled every 10 ms: the replay answers the last value at or before the clock, as the library would.

T0 = 10**12  # the fake monotonic clock at the trace's start (ns)
RES_UJ = 15.3


def _power(t, idle_w=140.0, load_w=600.0, load=(10.0, 20.0)):
    return np.where((t >= load[0]) & (t < load[1]), load_w, idle_w)


def amd_entry(duration_s=30.0, counter=None, *, power_status=None, energy_status=None):
    """One GPU's trace entry.  ``counter(t_s, acc)`` rewrites the accumulator (stalls, wraps, resets)."""
    t = np.arange(0.0, duration_s, 0.01)
    p = _power(t)
    e_j = np.concatenate(([0.0], np.cumsum(p[:-1] * 0.01)))
    acc = np.floor(e_j * 1e6 / RES_UJ).astype(np.int64) + 1_000_000
    if counter is not None:
        acc = counter(t, acc)
    t_ns = [T0 + int(x * 1e9) for x in t]
    energy = [{"status": energy_status} if energy_status else
              {"energy_accumulator": int(a), "counter_resolution": RES_UJ, "timestamp": int(x)} for a, x in zip(acc, t_ns)]
    power = [{"status": power_status} if power_status else
             {"current_socket_power": int(w), "average_socket_power": int(w), "power_limit": 750} for w in p]
    return {"available": True, "library": "amdsmi", "devices": [{
        "index": 0, "market_name": "AMD Instinct MI300X",
        "energy_count": {"t_ns": t_ns, "v": energy}, "power_info": {"t_ns": t_ns, "v": power}, "errors": []}]}


def _amd_sensor(monkeypatch, entry, **kw):
    from ipw.telemetry import amd

    clock = PollClock(T0)
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi(entry, clock, **kw))
    return amd.probe(threaded=False, clock_ns=clock), clock


def _ns(t_s):
    return T0 + int(t_s * 1e9)


def test_amd_attribution_calibrated_by_the_counter(monkeypatch):
    sensor, clock = _amd_sensor(monkeypatch, amd_entry())
    (r,) = polled_window(sensor, clock, _ns(12), _ns(18))
    (idle,) = polled_window(sensor, clock, _ns(22), _ns(28))
    (short,) = polled_window(sensor, clock, _ns(28.5), _ns(28.55))
    sensor.close()
    assert (r.component, r.source, r.quality, r.scope) == ("amd0", "amdsmi.power", "measured_interpolated", "gpu")
    assert r.energy_j == pytest.approx(600 * 6, rel=0.01) and "calibration ratio" in r.note
    assert idle.energy_j == pytest.approx(140 * 6, rel=0.01)
    assert "short window" in short.note and short.energy_j == pytest.approx(140 * 0.05, rel=0.05)
    assert sensor.check()["amd0"].ok


def test_amd_stalled_counter_is_not_used(monkeypatch):
    def stall(t, acc):  # the counter stops from 11 s on (in the load), as ml-energy/zeus#252 guards against
        out = acc.copy()
        out[t >= 11.0] = acc[np.searchsorted(t, 11.0)]
        return out

    sensor, clock = _amd_sensor(monkeypatch, amd_entry(counter=stall))
    (r,) = polled_window(sensor, clock, _ns(12), _ns(18))
    check = sensor.check()["amd0"]
    sensor.close()
    assert not check.ok and any("did not move" in p for p in check.problems)
    assert "counter distrusted, not used" in r.note and "uncalibrated" in r.note
    assert r.energy_j == pytest.approx(600 * 6, rel=0.01)  # from the power readings alone


def test_amd_counter_wrap_is_undone(monkeypatch):
    def wrap(t, acc):  # a 32-bit accumulator that wraps during the load (at ~15 s)
        return (acc + (2**32 - acc[np.searchsorted(t, 15.0)])) % 2**32

    sensor, clock = _amd_sensor(monkeypatch, amd_entry(counter=wrap))
    (r,) = polled_window(sensor, clock, _ns(12), _ns(18))
    sensor.close()
    assert "counter wrapped 1x" in r.note and "distrusted" not in r.note
    assert r.energy_j == pytest.approx(600 * 6, rel=0.01)


def test_amd_counter_reset_and_disagreement_are_reported(monkeypatch):
    def reset(t, acc):  # the driver reloads at 15 s: the accumulator restarts near 0
        out = acc.copy()
        out[t >= 15.0] -= acc[np.searchsorted(t, 15.0)] - 5
        return out

    sensor, clock = _amd_sensor(monkeypatch, amd_entry(counter=reset))
    (r,) = polled_window(sensor, clock, _ns(12), _ns(18))
    sensor.close()
    assert "counter distrusted" in r.note and "went backwards" in r.note
    assert r.energy_j == pytest.approx(600 * 6, rel=0.01)

    sensor, clock = _amd_sensor(monkeypatch, amd_entry(counter=lambda t, acc: acc * 2))  # twice the energy
    (r,) = polled_window(sensor, clock, _ns(12), _ns(18))
    sensor.close()
    assert "counter distrusted" in r.note and "power x time" in r.note


def test_amd_counter_not_supported_uses_power(monkeypatch):
    # "It is not supported on virtual machine guest" (ROCm/amdsmi py-interface/README.md, amdsmi_get_energy_count)
    sensor, clock = _amd_sensor(monkeypatch, amd_entry(energy_status=AMDSMI_STATUS_NOT_SUPPORTED))
    (r,) = polled_window(sensor, clock, _ns(12), _ns(18))
    info = sensor.info()
    sensor.close()
    assert "no counter" in info.detail and "uncalibrated" in r.note
    assert r.energy_j == pytest.approx(600 * 6, rel=0.01)


def test_amd_no_permission_and_missing_library(monkeypatch, capsys):
    from ipw.telemetry import amd
    from ipw.telemetry.probe import PLATFORMS, platform_sensors

    amd_only = tuple(e for e in PLATFORMS if e.name == "amdsmi")
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi(amd_entry(), PollClock(T0), init_status=AMDSMI_STATUS_NO_PERM))
    with pytest.raises(IpwError, match="AMDSMI_STATUS_NO_PERM.*render"):
        amd.probe(threaded=False)
    opened, why = platform_sensors(entries=amd_only)  # through the registry: one line, the run goes on
    assert opened == [] and "AMDSMI_STATUS_NO_PERM" in why["amdsmi"]
    assert capsys.readouterr().err.count("\n") == 1

    monkeypatch.setitem(sys.modules, "amdsmi", None)  # not installed
    monkeypatch.setattr(amd, "amd_gpu_present", lambda: False)
    opened, why = platform_sensors(entries=amd_only)
    assert "pip install 'ipw[amd]'" in why["amdsmi"] and capsys.readouterr().err == ""  # absent: silent
    monkeypatch.setattr(amd, "amd_gpu_present", lambda: True)
    platform_sensors(entries=amd_only)
    assert "ipw[amd]" in capsys.readouterr().err  # an AMD GPU without the library: one line


def test_amd_through_the_registry(monkeypatch):
    from ipw.telemetry.probe import probe_sensors

    clock = PollClock(T0)
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi(amd_entry(), clock))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr("ipw.telemetry.polled.time.sleep", lambda s: None)  # the start-up check's wait
    sensors = probe_sensors(lambda: [], rapl_root=Path("/nonexistent"))
    try:
        names = [s.name for s in sensors]
        assert names == ["amdsmi", "cpu_model"]  # an AMD GPU, and the CPU still estimated
    finally:
        for s in sensors:
            s.close()


def test_amd_gpus_measured_are_those_hip_sees(monkeypatch):
    """ROCR_VISIBLE_DEVICES picks among amdsmi's processors, HIP_VISIBLE_DEVICES (or CUDA_VISIBLE_DEVICES)
    among those, ipw's gpu_indices among those; components are named by HIP ordinal."""
    from ipw.telemetry import amd
    from ipw.telemetry.probe import PLATFORMS, platform_sensors

    entry = amd_entry()
    one = entry["devices"][0]
    entry["devices"] = [{**one, "index": i, "market_name": f"MI300X #{i}"} for i in range(4)]
    for var in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)

    def measured(indices=None):
        monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi(entry, PollClock(T0)))
        sensor = amd.probe(indices, threaded=False, clock_ns=PollClock(T0))
        gpus = sensor.info().params["gpus"]
        sensor.close()
        return [(g["component"], g["amdsmi_index"], g["name"]) for g in gpus]

    assert [g[1] for g in measured()] == [0, 1, 2, 3]
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "3,1,2")
    assert measured() == [("amd0", 3, "MI300X #3"), ("amd1", 1, "MI300X #1"), ("amd2", 2, "MI300X #2")]
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "2,0")  # among ROCR's: its 3rd and 1st
    assert measured() == [("amd0", 2, "MI300X #2"), ("amd1", 3, "MI300X #3")]
    assert measured([1]) == [("amd1", 3, "MI300X #3")]  # ipw's own selection: HIP ordinal 1
    monkeypatch.delenv("HIP_VISIBLE_DEVICES")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # HIP reads it too
    assert measured() == [("amd0", 1, "MI300X #1")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,7,0")  # parsing stops at an entry naming no device
    assert [g[1] for g in measured()] == [1]
    monkeypatch.delenv("ROCR_VISIBLE_DEVICES")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-4b2c1a9f")
    with pytest.raises(IpwError, match="UUID"):
        measured()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    with pytest.raises(IpwError, match="AMD GPU 1 is not visible: 1 visible of 4 .*CUDA_VISIBLE_DEVICES=2"):
        measured([1])
    # through the registry: ipw's GPU selection reaches the AMD sensor
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi(entry, PollClock(T0)))
    monkeypatch.setattr("ipw.telemetry.polled.time.sleep", lambda s: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    opened, _ = platform_sensors([2], quiet=True, entries=tuple(e for e in PLATFORMS if e.name == "amdsmi"))
    ((_, sensor),) = opened
    assert sensor.info().components == ("amd2",)
    sensor.close()


# --------------------------------------------------------------------------------------------------
# Apple Silicon through zeus-apple-silicon (a faithful fake: the library builds on macOS only).
# Fields and units from ml-energy/zeus-apple-silicon README.md (AppleEnergyMetrics, mJ, None where the
# chip has no such channel); the counters move in ~2 s batches (lablup/all-smi#415).  Powers are
# synthetic: CPU 5 W -> 20 W, GPU 1 W -> 30 W, ANE 0 W, DRAM 0.5 W -> 3 W, the load from 5 s to 25 s.

APPLE_W = {"cpu_total_mj": (5.0, 20.0), "gpu_mj": (1.0, 30.0), "ane_mj": (0.0, 0.0), "dram_mj": (0.5, 3.0)}


def apple_entry(duration_s=30.0, batch_s=2.0, backwards_at_s=None):
    t = np.arange(0.0, duration_s, 0.05)
    seen = np.floor(t / batch_s) * batch_s  # what the counters show: the energy up to the last batch
    v = []
    for x in seen:
        row = {}
        for f, (idle, load) in APPLE_W.items():
            on = min(max(x - 5.0, 0.0), 20.0)
            row[f] = int(1_000 * (idle * x + (load - idle) * on)) + 10_000_000
        if backwards_at_s is not None and x >= backwards_at_s:
            row["gpu_mj"] -= 5_000_000
        row["gpu_sram_mj"] = None  # M5 chips have no GPU SRAM channel (the README's table)
        v.append(row)
    return {"available": True, "library": "zeus-apple-silicon",
            "cumulative": {"t_ns": [T0 + int(x * 1e9) for x in t], "v": v}}


def _apple_sensor(monkeypatch, entry, **kw):
    from ipw.telemetry import apple

    clock = PollClock(T0)
    monkeypatch.setattr(apple.sys, "platform", "darwin")
    monkeypatch.setitem(sys.modules, "zeus_apple_silicon", fake_zeus_apple_silicon(entry, clock, **kw))
    return apple.probe(threaded=False, clock_ns=clock), clock


def test_apple_attribution_and_short_windows(monkeypatch):
    sensor, clock = _apple_sensor(monkeypatch, apple_entry())
    long = {r.component: r for r in polled_window(sensor, clock, _ns(9), _ns(21))}
    short = {r.component: r for r in polled_window(sensor, clock, _ns(24.0), _ns(25.0))}
    info = sensor.info()
    sensor.close()
    assert set(long) == {"apple-cpu", "apple-gpu", "apple-ane", "apple-dram"}
    assert info.params["observed_counter_step_s"]["apple-gpu"] == pytest.approx(2.0, abs=0.01)  # the batches
    gpu = long["apple-gpu"]
    assert (gpu.source, gpu.quality, gpu.scope) == ("apple.counter", "measured", "chip_rails")
    assert "not the whole system" in gpu.note and "not the whole system" in info.detail
    for comp, field in (("apple-cpu", "cpu_total_mj"), ("apple-gpu", "gpu_mj"), ("apple-dram", "dram_mj")):
        assert long[comp].energy_j == pytest.approx(APPLE_W[field][1] * 12, rel=0.02)
    assert long["apple-ane"].energy_j == 0.0
    s = short["apple-gpu"]  # 1 s: half a batch, flagged, with one batch at its power as the bound
    assert "short window (counter updates every 2 s)" in s.note
    assert s.quality == "measured_interpolated" and abs(s.energy_j - 30.0) <= float(re.search(r"±([0-9.]+) J", s.note).group(1))


def test_apple_backwards_counter_is_reported(monkeypatch):
    sensor, clock = _apple_sensor(monkeypatch, apple_entry(backwards_at_s=15.0))
    gpu = {r.component: r for r in polled_window(sensor, clock, _ns(9), _ns(21))}["apple-gpu"]
    sensor.close()
    assert "went backwards" in gpu.note and gpu.energy_j < APPLE_W["gpu_mj"][1] * 12  # the gap is not counted


def test_apple_missing_library_not_a_mac_and_ioreport_failure(monkeypatch):
    from ipw.telemetry import apple
    from ipw.telemetry.polled import Absent

    monkeypatch.setattr(apple.sys, "platform", "linux")
    with pytest.raises(Absent, match="not macOS"):
        apple.probe()
    monkeypatch.setattr(apple.sys, "platform", "darwin")
    monkeypatch.setitem(sys.modules, "zeus_apple_silicon", None)
    with pytest.raises(IpwError, match=r"pip install 'ipw\[apple\]'") as exc:
        apple.probe()
    assert not isinstance(exc.value, Absent)  # on a Mac, the missing library is said in a run
    monkeypatch.setitem(sys.modules, "zeus_apple_silicon",
                        fake_zeus_apple_silicon(apple_entry(), PollClock(T0), fail="IOReport subscription failed"))
    with pytest.raises(IpwError, match="IOReport subscription failed"):
        apple.probe(threaded=False)


# --------------------------------------------------------------------------------------------------
# Jetson: a fake sysfs hwmon tree (file names from rbonghi/jetson_stats jtop/core/power.py and the
# kernel's Documentation/hwmon/ina238.rst).  Values synthetic: an Orin's VDD_IN at 5 V, 1.4 A idle
# and 5 A under load; its rails inside it; a Thor's INA238 reporting µW.


def _jitter(n, lsb):
    """A working monitor's last-bit jitter from one conversion to the next (mean 0 over each 5)."""
    return np.resize(np.array([0, 2, -1, 1, -2]) * lsb, n)


def orin_entry(duration_s=20.0, load=(5.0, 15.0), frozen_from_s=None):
    """``frozen_from_s``: the value files stop changing from then on (the monitor froze)."""
    t = np.arange(0.0, duration_s, 0.05)
    on = (t >= load[0]) & (t < load[1])
    j = _jitter(t.size, 1)
    series = {"hwmon1/in1_input": [5000] * t.size, "hwmon1/curr1_input": np.where(on, 5000, 1400) + j,
              "hwmon1/in2_input": [5000] * t.size, "hwmon1/curr2_input": np.where(on, 3000, 400) + j,
              "hwmon1/in3_input": [5000] * t.size, "hwmon1/curr3_input": np.where(on, 800, 500) + j}
    if frozen_from_s is not None:
        k = int(np.searchsorted(t, frozen_from_s))
        series = {f: np.concatenate((np.asarray(v)[:k], np.full(t.size - k, np.asarray(v)[k]))) for f, v in series.items()}
    files = {"hwmon1/name": "ina3221", "hwmon1/update_interval": "20", "hwmon1/in1_label": "VDD_IN",
             "hwmon1/in2_label": "VDD_CPU_GPU_CV", "hwmon1/in3_label": "VDD_SOC", "hwmon0/name": "pwmfan"}
    t_ns = [T0 + int(x * 1e9) for x in t]
    return {"available": True, "files": files,
            "series": {k: {"t_ns": t_ns, "v": [int(x) for x in v]} for k, v in series.items()}}


def _jetson_sensor(entry, tmp_path):
    from ipw.telemetry import jetson

    clock = PollClock(T0)
    hw = FakeHwmon(entry, tmp_path / "hwmon", clock)
    return jetson.probe(tmp_path / "hwmon", threaded=False, clock_ns=clock), hw


def _jetson_window(sensor, hw, a_s, b_s):
    drive_hwmon(sensor, hw, _ns(a_s))
    token = sensor.begin()
    drive_hwmon(sensor, hw, _ns(b_s))
    pending = sensor.end(token)
    drive_hwmon(sensor, hw, _ns(b_s + sensor.settle_s + 0.1))
    assert pending.ready()
    return pending.result()


def test_jetson_orin_board_input_with_rails_inside(tmp_path):
    sensor, hw = _jetson_sensor(orin_entry(), tmp_path)
    readings = _jetson_window(sensor, hw, 6.0, 14.0)
    short = _jetson_window(sensor, hw, 16.0, 16.01)
    info = sensor.info()
    sensor.close()
    (board,) = readings  # the rails are inside VDD_IN: never readings of their own
    assert (board.component, board.source, board.scope) == ("jetson-board", "jetson.power", "board")
    assert board.energy_j == pytest.approx(5.0 * 5.0 * 8, rel=0.01)  # 5 V x 5 A for 8 s
    assert "inside it: VDD_CPU_GPU_CV 120 J, VDD_SOC 32 J" in board.note  # 5 V x 3 A and 0.8 A for 8 s
    assert "short window" in short[0].note
    assert info.components == ("jetson-board",) and "never added" in info.detail


def test_jetson_thor_ina238(tmp_path):
    t = np.arange(0.0, 10.0, 0.05)
    entry = {"files": {"hwmon3/name": "ina238"},
             "series": {"hwmon3/power1_input": {"t_ns": [T0 + int(x * 1e9) for x in t],
                                                "v": (np.where(t >= 5.0, 90_000_000, 30_000_000)
                                                      + _jitter(t.size, 1000)).tolist()}}}
    sensor, hw = _jetson_sensor(entry, tmp_path)
    (board,) = _jetson_window(sensor, hw, 6.0, 9.0)
    sensor.close()
    assert board.component == "jetson-board" and "VIN" in board.note
    assert board.energy_j == pytest.approx(90.0 * 3, rel=0.01)


def test_jetson_frozen_monitor_is_not_used(tmp_path):
    """The value files stop changing at 8 s, while the board draws 25 W (the load runs 5-15 s): windows
    the frozen span reaches are unavailable and say why; a window before it is measured."""
    sensor, hw = _jetson_sensor(orin_entry(frozen_from_s=8.0), tmp_path)
    (before,) = _jetson_window(sensor, hw, 5.5, 7.5)
    (during,) = _jetson_window(sensor, hw, 11.0, 13.0)
    (after,) = _jetson_window(sensor, hw, 16.0, 18.0)  # still the load's value: the monitor never came back
    sensor.close()
    assert before.energy_j == pytest.approx(25.0 * 2, rel=0.01) and "frozen" not in before.note
    for r in (during, after):
        assert r.energy_j is None and r.quality == "unavailable" and r.uncertainty_j is None
        assert "power monitor frozen: 25 W unchanged for" in r.note and "not used" in r.note


def test_jetson_absent_and_no_permission(tmp_path, monkeypatch):
    from ipw.telemetry import jetson
    from ipw.telemetry.polled import Absent

    with pytest.raises(Absent, match="no INA3221/INA238"):
        jetson.probe(tmp_path / "nothing")
    clock = PollClock(T0)
    FakeHwmon(orin_entry(), tmp_path / "hwmon", clock)
    real = Path.read_text

    def denied(self, *a, **k):  # this runs as root, where chmod does not deny a read: deny it here
        if self.name == "curr1_input":
            raise PermissionError(13, "Permission denied")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(IpwError, match="curr1_input: permission denied"):
        jetson.probe(tmp_path / "hwmon", threaded=False, clock_ns=clock)


# --------------------------------------------------------------------------------------------------
# NVIDIA superchips: module power scope (probe as ml-energy/zeus zeus/device/gpu/nvidia.py
# _resolve_power_field_scope); the module's power beyond the GPU is module0


def test_superchip_module_minus_gpu(monkeypatch):
    from ipw.telemetry import superchip

    sig, _clock = synthetic(30.0, idle_w=100.0, load_w=400.0, load=(10.0, 20.0))
    fake = make_fake(monkeypatch, [sig], _clock)
    clock = PollClock(_clock.mono())
    _clock.mono = clock  # the fake's GPU answers follow the polled sensor's clock
    inst = {"t_ns": sig.inst_t_ns.tolist(), "v": sig.inst_mw.tolist()}

    def module_mw():  # the GPU plus a Grace CPU and memory drawing 150 W
        return int(answer_at(inst, clock())) + 150_000

    scoped_fields(fake, module_mw=module_mw)
    sensor = superchip.probe(threaded=False, clock_ns=clock)
    (r,) = polled_window(sensor, clock, clock.t_ns + int(12e9), clock.t_ns + int(18e9))
    sensor.close()
    assert (r.component, r.scope, r.source) == ("module0", "module", "nvml.module.power")
    assert r.energy_j == pytest.approx(150.0 * 6, rel=0.01)

    scoped_fields(fake, gpu_scope=False, module_mw=module_mw)  # GPU scope not offered (GH200 per Zeus)
    with pytest.raises(IpwError, match="cannot be separated"):
        superchip.probe(threaded=False)


def test_discrete_gpu_has_gpu_scope_and_a_note(monkeypatch):
    from ipw.telemetry import superchip
    from ipw.telemetry.polled import Absent

    sig, clock = synthetic(10.0)
    fake = make_fake(monkeypatch, [sig], clock)
    scoped_fields(fake)
    with pytest.raises(Absent, match="not a superchip"):
        superchip.probe(threaded=False)
    sensor = NvmlSensor(threaded=False, clock_ns=clock.mono, wall_ns=clock.wall)
    info = sensor.info()
    sensor.close()
    assert info.params["power_scopes"] == {"gpu0": {"gpu": "ok", "module": "NVML_ERROR_NOT_SUPPORTED"}}
    assert "power scope: GPU (NVML offers no module scope here)" in info.detail


# --------------------------------------------------------------------------------------------------
# uncertainty_j of the polled sensors (docs/PLATFORMS.md, "How far to trust a reading")

Z90 = 1.645


def test_polled_readings_state_their_uncertainty(monkeypatch, tmp_path):
    """Every polled reading states a ±90% uncertainty_j that holds the true (synthetic) energy: power
    calibrated by a counter (AMD) narrow, power alone (Jetson, or a distrusted counter) at least the
    missing calibration's 3% (1 sd), a counter alone (Apple) one batch at the window's power, an idle
    counter one count; a ~1 s averaged power (AMD average_socket_power) wider at a step than an instant one."""
    sensor, clock = _amd_sensor(monkeypatch, amd_entry())
    (amd,) = polled_window(sensor, clock, _ns(12), _ns(18))
    # the load ends at 20 s, on a poll: the worst place for a step (linear interpolation off by dP*T/2)
    (amd_edge,) = polled_window(sensor, clock, _ns(19.5), _ns(21.5))
    sensor.close()
    assert 0 < amd.uncertainty_j < Z90 * 0.03 * amd.energy_j and abs(amd.energy_j - 600 * 6) <= amd.uncertainty_j
    assert abs(amd_edge.energy_j - (600 * 0.5 + 140 * 1.5)) <= amd_edge.uncertainty_j

    averaged = amd_entry()
    for v in averaged["devices"][0]["power_info"]["v"]:
        v["current_socket_power"] = "N/A"  # only the ~1 s average
    sensor, clock = _amd_sensor(monkeypatch, averaged)
    (avg_edge,) = polled_window(sensor, clock, _ns(19.5), _ns(21.5))
    sensor.close()
    assert "average_socket_power" in avg_edge.note and avg_edge.uncertainty_j > amd_edge.uncertainty_j

    def stall(t, acc):
        out = acc.copy()
        out[t >= 11.0] = acc[np.searchsorted(t, 11.0)]
        return out

    sensor, clock = _amd_sensor(monkeypatch, amd_entry(counter=stall))
    (distrusted,) = polled_window(sensor, clock, _ns(12), _ns(18))
    sensor.close()
    assert "counter distrusted" in distrusted.note and distrusted.uncertainty_j >= Z90 * 0.03 * distrusted.energy_j

    sensor, hw = _jetson_sensor(orin_entry(), tmp_path)
    (board,) = _jetson_window(sensor, hw, 6.0, 14.0)
    sensor.close()
    assert "uncalibrated" in board.note and board.uncertainty_j >= Z90 * 0.03 * board.energy_j
    assert abs(board.energy_j - 25.0 * 8) <= board.uncertainty_j

    sensor, clock = _apple_sensor(monkeypatch, apple_entry())
    long = {r.component: r for r in polled_window(sensor, clock, _ns(9), _ns(21))}
    sensor.close()
    gpu = long["apple-gpu"]
    assert gpu.uncertainty_j == pytest.approx(2.0 * gpu.energy_j / 12, rel=0.01)  # one 2 s batch at its power
    assert abs(gpu.energy_j - 30.0 * 12) <= gpu.uncertainty_j
    assert long["apple-ane"].energy_j == 0.0 and long["apple-ane"].uncertainty_j == 1e-3  # one mJ count


# --------------------------------------------------------------------------------------------------
# ipw doctor on this CPU VM: every platform listed, with why it is unavailable


def test_doctor_lists_every_platform_with_why(monkeypatch):
    from ipw.commands import doctor as doctor_mod
    from ipw.telemetry.probe import PLATFORMS

    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    rows = {r[0]: r for r in doctor_mod.sensor_rows()}
    assert set(rows) >= {"nvml", "rapl", "cpu_model", *(e.name for e in PLATFORMS)}
    for e in PLATFORMS:
        assert rows[e.name][1] == "no" and rows[e.name][4] == e.scope and rows[e.name][6] not in ("", "-")
    assert "not macOS" in rows["apple"][6] and "INA3221" in rows["jetson"][6]
    assert "ipw[amd]" in rows["amdsmi"][6]
    buf = io.StringIO()
    assert doctor(False, file=buf) == 0
    assert "ipw[amd]" in buf.getvalue()  # printed as text, not eaten as rich markup


# --------------------------------------------------------------------------------------------------
# --record-trace on the other platforms: what the recorders write is what the fakes replay


def test_amd_and_jetson_recorders_write_what_the_fakes_replay(monkeypatch, tmp_path):
    from ipw.telemetry import jetson
    from ipw.telemetry.recording import AmdRecorder, AppleRecorder, JetsonRecorder

    live = amd_entry()  # answered on the real clock, from now on
    start = time.monotonic_ns()
    for key in ("energy_count", "power_info"):
        live["devices"][0][key]["t_ns"] = [start + t - T0 for t in live["devices"][0][key]["t_ns"]]
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi(live, time.monotonic_ns))
    monkeypatch.setattr(jetson, "DEFAULT_ROOT", tmp_path / "hwmon")
    FakeHwmon(orin_entry(), tmp_path / "hwmon", PollClock(T0 + int(6e9)))  # the load's values, held
    monkeypatch.setattr("ipw.telemetry.apple.sys.platform", "darwin")
    monkeypatch.setitem(sys.modules, "zeus_apple_silicon", fake_zeus_apple_silicon(apple_entry(), PollClock(T0)))
    trace = record(0.5, recs=[AmdRecorder(), AppleRecorder(), JetsonRecorder()])
    path = write_trace(trace, tmp_path / "t.json.gz")
    got = read_trace(path)["platforms"]
    assert got["amdsmi"]["devices"][0]["market_name"] == "AMD Instinct MI300X"
    assert got["amdsmi"]["devices"][0]["energy_count"]["v"][0]["counter_resolution"] == RES_UJ
    assert got["jetson"]["files"]["hwmon1/in1_label"] == "VDD_IN" and "hwmon0/name" not in got["jetson"]["files"]
    assert set(got["apple"]["cumulative"]["v"][0]) == {"cpu_total_mj", "gpu_mj", "ane_mj", "dram_mj"}

    # replay the recorded entries through the same fakes
    clock = PollClock(got["amdsmi"]["devices"][0]["power_info"]["t_ns"][0])
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi(got["amdsmi"], clock))
    from ipw.telemetry import amd

    sensor = amd.probe(threaded=False, clock_ns=clock)
    a_ns, b_ns = clock.t_ns + int(0.1e9), clock.t_ns + int(0.3e9)
    (r,) = polled_window(sensor, clock, a_ns, b_ns)
    (est,) = sensor.energy_windows([(a_ns / 1e9, b_ns / 1e9)])["amd0"]
    sensor.close()
    # the idle power the recorder saw (before the calibration, which a 0.5 s recording cannot pin down)
    assert est.uncalibrated_j == pytest.approx(140 * 0.2, rel=0.02) and "calibration ratio" in r.note
    hw_clock = PollClock(got["jetson"]["series"]["hwmon1/curr1_input"]["t_ns"][0])
    FakeHwmon(got["jetson"], tmp_path / "replay", hw_clock)
    sensor = jetson.probe(tmp_path / "replay", threaded=False, clock_ns=hw_clock)
    (board,) = polled_window(sensor, hw_clock, hw_clock.t_ns + int(0.1e9), hw_clock.t_ns + int(0.3e9))
    sensor.close()
    assert board.energy_j == pytest.approx(25.0 * 0.2, rel=0.02)  # 5 V x 5 A


def test_doctor_reports_a_distrusted_counter(monkeypatch):
    """A counter that does not move while the power says 600 W: ipw doctor's cross-check row."""
    from ipw.commands import doctor as doctor_mod

    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr("ipw.telemetry.amd.amd_gpu_present", lambda: True)
    stalled = amd_entry(counter=lambda t, acc: np.full_like(acc, acc[0]))
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi(stalled, PollClock(_ns(15))))  # held in the load
    rows = doctor_mod.counter_check_rows(seconds=0.5)
    assert [r[:3] for r in rows] == [["amdsmi", "amd0", "DISTRUSTED"]]
    assert "did not move" in rows[0][4] and "600 W" in rows[0][4]
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    assert doctor_mod.counter_check_rows(seconds=0.5) == []  # nothing to check here: no wait, no row


def test_a_jetson_run_measures_the_board_and_no_cpu_estimate(monkeypatch, tmp_path):
    """Through the real registry: the board input includes the CPU, so the CPU model is not added."""
    from ipw.telemetry import jetson
    from ipw.telemetry.probe import describe_sensors, probe_sensors

    FakeHwmon(orin_entry(), tmp_path / "hwmon", PollClock(T0))
    monkeypatch.setattr(jetson, "DEFAULT_ROOT", tmp_path / "hwmon")
    monkeypatch.setitem(sys.modules, "pynvml", None)
    sensors = probe_sensors(lambda: [], rapl_root=tmp_path / "no-rapl")
    try:
        assert [s.name for s in sensors] == ["jetson"]
    finally:
        for s in sensors:
            s.close()
    cpu = next(i for i in describe_sensors(rapl_root=tmp_path / "no-rapl") if i.name == "cpu_model")
    assert cpu.detail.startswith("not used: jetson measures the CPU")


def test_a_polled_sensor_in_a_window_on_the_real_clock(tmp_path):
    """The runner's path (telemetry.window.Window) with the polling thread on the real clock: a board
    held at 25 W (the Orin trace's load values, 5 V x 5 A) for ~0.4 s."""
    from ipw.telemetry import jetson
    from ipw.metering.window import Window

    FakeHwmon(orin_entry(), tmp_path / "hwmon", PollClock(T0 + int(6e9)))
    sensor = jetson.probe(tmp_path / "hwmon")
    try:
        w = Window([sensor])
        tokens = w.begin()
        time.sleep(0.4)
        closed = w.end(tokens)
        (board,) = closed.readings()
    finally:
        sensor.close()
    assert board.energy_j == pytest.approx(25.0 * board.duration_s, rel=0.05)
    assert sensor.overhead()["threaded"] and sensor.overhead()["polls"] >= 4


def test_polled_trace_columns(monkeypatch):
    """power.parquet's columns from a polled sensor: every power reading and counter read, by device."""
    sensor, clock = _amd_sensor(monkeypatch, amd_entry())
    drive_polled(sensor, clock, _ns(1.0))
    cols = sensor.trace()
    sensor.close()
    kinds = list(cols["kind"])
    assert kinds.count("power") == kinds.count("counter") == 11  # the first read and ten polls
    assert set(cols["device"]) == {"amd0"}
    assert np.nanmax(cols["power_w"]) == 140.0 and np.all(np.isnan(cols["energy_j"][np.array(kinds) == "power"]))


def test_amd_startup_check_like_zeus(monkeypatch):
    """A counter reporting 20x the power x time is distrusted from its first half second, as Zeus
    disables amdsmi's counter at start-up (ml-energy/zeus zeus/device/gpu/amd.py)."""
    sensor, clock = _amd_sensor(monkeypatch, amd_entry(counter=lambda t, acc: acc * 20))
    drive_polled(sensor, clock, _ns(0.6))
    check = sensor.check(startup=True)["amd0"]
    sensor.close()
    assert not check.ok and check.ratio == pytest.approx(20, rel=0.1)
    sensor, clock = _amd_sensor(monkeypatch, amd_entry())
    drive_polled(sensor, clock, _ns(0.6))
    assert sensor.check(startup=True)["amd0"].ok
    sensor.close()


def test_apple_counters_that_all_stop_are_a_stall(monkeypatch):
    """IOReport counters that stop updating (all of them, from 10 s on): the windows after are
    unavailable, never 0 J; an ANE that never moves beside a moving CPU is 0 J."""
    entry = apple_entry()
    t = np.asarray(entry["cumulative"]["t_ns"])
    frozen = entry["cumulative"]["v"][int(np.searchsorted(t, _ns(10.0)))]
    entry["cumulative"]["v"] = [v if tn < _ns(10.0) else frozen for v, tn in zip(entry["cumulative"]["v"], t)]
    sensor, clock = _apple_sensor(monkeypatch, entry)
    early = {r.component: r for r in polled_window(sensor, clock, _ns(2.5), _ns(4.5))}
    late = {r.component: r for r in polled_window(sensor, clock, _ns(16.0), _ns(20.0))}
    (est,) = sensor.energy_windows([(_ns(2.5) / 1e9, _ns(4.5) / 1e9)])["apple-cpu"]
    sensor.close()
    assert early["apple-ane"].energy_j == 0.0 and "0 J (idle" in early["apple-ane"].note
    # the CPU at 5 W for 2 s, within the estimator's bound (one 2 s batch at the window's power)
    assert early["apple-cpu"].energy_j == pytest.approx(est.energy_j)
    assert abs(est.energy_j - 5.0 * 2) <= est.uncertainty_j
    for r in late.values():
        assert r.energy_j is None and r.quality == "unavailable" and "stalled, not used" in r.note


def test_doctor_checks_the_nvml_counter(monkeypatch):
    """ipw doctor's cross-check on an NVIDIA GPU (the autospec'd pynvml on the real clock): the counter
    against the driver samples, ok for a counter that follows the power; a stuck one is DISTRUSTED."""
    from ipw.commands import doctor as doctor_mod

    monkeypatch.setitem(sys.modules, "amdsmi", None)
    sig = synthetic(60.0, t0_s=time.monotonic(), idle_w=100.0, load_w=400.0, load=(0.0, 60.0),
                    offset_ns=real_offset_ns())[0]
    fake = make_fake(monkeypatch, [sig], RealClock())
    scoped_fields(fake)
    (row,) = doctor_mod.counter_check_rows(seconds=2.5)
    assert row[:3] == ["nvml", "gpu0", "ok"] and float(row[3]) == pytest.approx(1.0, abs=0.1)
    sig.ctr_mj = np.full_like(sig.ctr_mj, sig.ctr_mj[0])  # the counter stops while the GPU draws 400 W
    (row,) = doctor_mod.counter_check_rows(seconds=2.5)
    assert row[2] == "DISTRUSTED" and "did not move" in row[4]


def test_amd_power_not_supported_uses_the_counter(monkeypatch):
    sensor, clock = _amd_sensor(monkeypatch, amd_entry(power_status=AMDSMI_STATUS_NOT_SUPPORTED))
    (r,) = polled_window(sensor, clock, _ns(12), _ns(18))
    sensor.close()
    assert r.source == "amdsmi.counter" and r.energy_j == pytest.approx(600 * 6, rel=0.01)
