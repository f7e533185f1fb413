"""``ipw.Monitor``: sensors opened once for many blocks (issue 59, overhead).  An autospec'd NVML
(tests/nvml_fakes.py) on the real clock and RAPL zones in a fake sysfs under tmp_path; the power of the
fake GPU is switched by the blocks themselves (as in tests/commands/test_api.py), so no schedule fixed in
advance can be outlasted by a loaded machine."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import ipw
from ipw.telemetry.nvml import PendingWindow
from ipw.telemetry.rapl import RaplSensor

UJ = 1_000_000  # µJ per J
#: A block's GPU energy is off by at most half a 20 ms sample at each edge where the power steps by 300 W
EDGE_J = 2 * 0.01 * 300 + 0.5


@pytest.fixture
def gpu(monkeypatch):
    """A fake GPU at 100 W; ``gpu.load(a_s, b_s)`` puts it at 400 W over [a_s, b_s] (monotonic s) too (given
    again with the same start, the interval is set anew: its end is known only when it comes).  It has no
    energy counter: over the short spans of these tests the synthetic counter's 100 ms steps would move the
    samples' calibration by up to ±20% (tests/telemetry measure the estimator against them); here the subject
    is which block gets which energy, so each is the driver's samples' integral over the block."""
    from nvml_fakes import RealClock, make_fake, synthetic

    t0 = time.monotonic()
    offset = time.monotonic_ns() - time.time_ns()
    loads = [(1e6, 1e6 + 1)]  # seconds after t0 (synthetic needs one interval: this one never comes)
    sig, _ = synthetic(duration_s=60.0, t0_s=t0, load=loads, offset_ns=offset)
    sig.counter_ok = False
    nvml = make_fake(monkeypatch, [sig], RealClock())

    def load(a_s: float, b_s: float) -> None:  # rewrites only the fake's future: what was read stays
        if loads[-1][0] == a_s - t0:
            loads.pop()
        loads.append((a_s - t0, b_s - t0))
        new, _ = synthetic(duration_s=60.0, t0_s=t0, load=loads, offset_ns=offset)
        sig.samp_mw, sig.inst_mw = new.samp_mw, new.inst_mw

    nvml.load = load
    return nvml


@pytest.fixture
def rapl(tmp_path: Path, monkeypatch) -> dict[str, object]:
    """One RAPL package zone with DRAM in a fake sysfs, found by the probe (which counts its calls)."""
    root = tmp_path / "powercap"
    zones = {}
    for dirname, name in (("intel-rapl:0", "package-0"), ("intel-rapl:0:0", "dram")):
        zone = root / dirname
        zone.mkdir(parents=True)
        (zone / "name").write_text(name + "\n")
        (zone / "energy_uj").write_text(f"{5 * UJ}\n")
        (zone / "max_energy_range_uj").write_text("262143328850\n")
        zones[name] = zone
    probes = []

    def probe(cls, _root=None):
        probes.append(1)
        return cls(root)

    monkeypatch.setattr(RaplSensor, "probe", classmethod(probe))
    return {"zones": zones, "probes": probes}


def add_uj(zone: Path, uj: int) -> None:
    path = zone / "energy_uj"
    path.write_text(f"{int(path.read_text()) + uj}\n")


def held(nvml) -> int:
    """How many nvmlInit calls have no nvmlShutdown yet."""
    return nvml.nvmlInit.call_count - nvml.nvmlShutdown.call_count


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ipw-nvml-sampler"]


def test_blocks_back_to_back_reuse_the_sensors_and_each_has_its_own_energy(gpu, rapl):
    """Blocks one after another on one monitor: the sensors are probed and opened once; each block's GPU
    energy is the fake's power over its own span (400 W, then 100 W, alternating) and its package and DRAM
    energy the RAPL counters' exact steps inside it, each part labeled with where it came from."""
    zones = rapl["zones"]
    with ipw.Monitor(gpus=[0]) as monitor:
        inits = gpu.nvmlInit.call_count
        threads = sampler_threads()
        assert len(threads) == 1 and len(rapl["probes"]) == 1
        blocks = []
        for k in range(4):
            busy = k % 2 == 0
            with monitor.measure() as m:
                on = time.monotonic()
                if busy:
                    gpu.load(on, on + 1e6)  # 400 W from now on
                add_uj(zones["package-0"], (k + 1) * UJ)
                add_uj(zones["dram"], UJ // 4)
                time.sleep(0.3)
                if busy:
                    gpu.load(on, time.monotonic())  # until now
            blocks.append((busy, m))
        assert gpu.nvmlInit.call_count == inits and sampler_threads() == threads and len(rapl["probes"]) == 1
        assert held(gpu) == 1  # the sensor's NVML, held since the monitor opened
        for k, (busy, m) in enumerate(blocks):
            r = m.result
            parts = {p.component: p for p in r.parts}
            g = parts["gpu0"]
            assert (g.source, g.quality, g.scope) == ("nvml.samples", "measured_interpolated", "gpu")
            assert g.energy_j == pytest.approx((400 if busy else 100) * r.duration_s, abs=EDGE_J), (k, g.note)
            pkg, dram = parts["package-0"], parts["dram-0"]
            assert (pkg.source, pkg.quality, pkg.energy_j) == ("rapl.package", "measured", pytest.approx(k + 1))
            assert (dram.source, dram.quality, dram.energy_j) == ("rapl.dram", "measured", pytest.approx(0.25))
            assert r.energy_j == pytest.approx(g.energy_j + k + 1 + 0.25) and r.quality == "measured_interpolated"
            assert [s.name for s in r.sensors] == ["nvml", "rapl"]


def test_a_block_end_does_not_wait_and_one_read_makes_every_ready_result(gpu, monkeypatch):
    """A block's end makes no estimate (nor waits for one); the first result read makes the results of every
    block whose end the sampler covers in one estimate, so reading the rest makes none."""
    estimates = []
    resolve_all = PendingWindow.resolve_all.__func__

    def counting(cls, pending):
        estimates.append(len(pending))
        return resolve_all(cls, pending)

    monkeypatch.setattr(PendingWindow, "resolve_all", classmethod(counting))
    with ipw.Monitor(gpus=[0], rapl=False) as monitor:
        blocks = []
        for _ in range(5):
            with monitor.measure() as m:
                time.sleep(0.01)
            blocks.append(m)
        assert estimates == []
        assert blocks[-1].result is not None
        assert estimates == [5]
        assert all(m.result.parts[0].source == "nvml.samples" for m in blocks) and estimates == [5]


def test_an_exception_in_a_block_still_gives_a_result_and_the_monitor_goes_on(gpu):
    with ipw.Monitor(gpus=[0], rapl=False) as monitor:
        with pytest.raises(ZeroDivisionError):
            with monitor.measure() as failed:
                time.sleep(0.05)
                _ = 1 / 0
        with monitor.measure() as after:
            time.sleep(0.05)
        for m in (failed, after):
            assert m.result.parts[0].energy_j == pytest.approx(100 * m.result.duration_s, rel=0.05)
            assert m.result.quality == "measured_interpolated"


def test_trace_gives_the_points_the_blocks_were_made_from(gpu):
    """``Monitor.trace``: the NVML sensor's points as power.parquet's columns, covering the blocks measured."""
    with ipw.Monitor(gpus=[0], rapl=False) as monitor:
        a_s = time.monotonic()
        with monitor.measure() as m:
            time.sleep(0.1)
        b_s = time.monotonic()
        assert m.result is not None  # its samples are in
        trace = monitor.trace()
    assert list(trace) == ["t_s", "device", "power_w", "kind", "energy_j"]
    assert len({len(v) for v in trace.values()}) == 1 and set(trace["device"]) == {"gpu0"}
    samples = [t for t, k in zip(trace["t_s"], trace["kind"]) if k == "sample"]
    assert sum(a_s <= t <= b_s for t in samples) >= 3  # 20 ms samples over the 0.1 s block
    assert all(w == pytest.approx(100.0, abs=1.0) for w, k in zip(trace["power_w"], trace["kind"]) if k == "sample")


def test_blocks_may_overlap(gpu):
    """A block inside another: each has the energy of its own span (100 W throughout)."""
    with ipw.Monitor(gpus=[0], rapl=False) as monitor:
        with monitor.measure() as outer:
            time.sleep(0.2)
            with monitor.measure() as inner:
                time.sleep(0.3)
            time.sleep(0.2)
        assert inner.result.duration_s < outer.result.duration_s - 0.3
        for m in (outer, inner):
            part = m.result.parts[0]
            assert part.energy_j == pytest.approx(100 * m.result.duration_s, rel=0.05), part.note


def test_close_makes_unread_results_final_and_releases_the_sensors(gpu, rapl):
    monitor = ipw.Monitor(gpus=[0])
    sensors = list(monitor._window.sensors)
    with monitor.measure() as m:
        add_uj(rapl["zones"]["package-0"], 2 * UJ)
        time.sleep(0.05)
    assert held(gpu) == 1
    monitor.close()
    assert held(gpu) == 0 and sampler_threads() == [] and not sensors[0].sampler.alive
    assert sensors[1].name == "rapl" and sensors[1].snapshots._stopped
    assert not (sensors[1].snapshots._thread and sensors[1].snapshots._thread.is_alive())
    r = m.result  # made by close, from what the sensors held
    assert r.parts[0].source == "nvml.samples" and r.parts[0].energy_j == pytest.approx(100 * r.duration_s, rel=0.05)
    assert {p.component: p.energy_j for p in r.parts}["package-0"] == pytest.approx(2.0)
    with pytest.raises(RuntimeError, match="closed"):
        with monitor.measure():
            pass
    monitor.close()  # again: nothing
    assert held(gpu) == 0


def test_close_refuses_while_a_block_is_open(gpu):
    monitor = ipw.Monitor(gpus=[0], rapl=False)
    block = monitor.measure()
    block.__enter__()
    with pytest.raises(RuntimeError, match="still being measured"):
        monitor.close()
    block.__exit__(None, None, None)
    monitor.close()
    assert block.result is not None and sampler_threads() == []


def test_a_block_cannot_be_entered_twice_at_once(gpu):
    with ipw.Monitor(gpus=[0], rapl=False) as monitor:
        block = monitor.measure()
        with block:
            with pytest.raises(RuntimeError, match="already being measured"):
                block.__enter__()
        assert block.result is not None


def test_measure_opens_and_closes_its_own_sensors(gpu):
    """``ipw.measure`` is a block with a monitor of its own: opened at its start, closed at its end with its
    result final."""
    with ipw.measure(gpus=[0], rapl=False) as m:
        assert m.result is None and len(sampler_threads()) == 1 and held(gpu) == 1
        time.sleep(0.05)
    assert sampler_threads() == [] and held(gpu) == 0
    assert m.result.parts[0].source == "nvml.samples"
