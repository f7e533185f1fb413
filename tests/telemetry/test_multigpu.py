"""Two GPUs through an autospec'd pynvml (tests/nvml_fakes.py): each sensor measures only the GPUs it
selects, reports the others' activity as foreign, and per-GPU parts sum to the total with nothing
counted twice.  What bench/scale/multigpu.py checks on a real two-GPU machine (docs/MULTIGPU.md)."""

from __future__ import annotations

import pytest
from nvml_fakes import drive, finish, make_fake, synthetic, window

from ipw.telemetry.base import total_energy
from ipw.telemetry.estimator import counter_energy_between
from ipw.telemetry.nvml import NvmlSensor

IDLE = (80.0, 90.0)
T0 = 1000.0


def two_gpus(monkeypatch, load0=(2000.0, 2001.0), load1=(2000.0, 2001.0), w0=500.0, w1=600.0, idle=IDLE):
    s0, clock = synthetic(idle_w=idle[0], load_w=w0, load=load0)
    s1, _ = synthetic(idle_w=idle[1], load_w=w1, load=load1)
    fake = make_fake(monkeypatch, [s0, s1], clock)
    return fake, clock, (s0, s1)


def open_sensor(clock, indices=None, **kw) -> NvmlSensor:
    return NvmlSensor(indices, threaded=False, clock_ns=clock.mono, wall_ns=clock.wall, **kw)


def counter_ref(sig, a_s: float, b_s: float) -> float:
    """The fake GPU's own counter over ``[a, b]`` (seconds after T0): the reference."""
    return counter_energy_between(sig.ctr_t_ns / 1e9, sig.ctr_mj / 1e3, T0 + a_s, T0 + b_s).energy_j


def test_load_on_gpu1_is_attributed_to_gpu1_only(monkeypatch):
    fake, clock, sigs = two_gpus(monkeypatch, load1=(20.0, 30.0))
    s1, s0, both = open_sensor(clock, [1]), open_sensor(clock, [0]), open_sensor(clock)
    assert [g.component for g in s1.others] == ["nvml0"] and [g.component for g in s0.others] == ["nvml1"]
    assert both.others == [] and both.info().params["watched_gpus"] == []

    p1, p0, pb = window(s1, clock, 20.0, 30.0, T0, s0, both)
    (r1,) = finish(s1, clock, p1, s0, both)
    (r0,) = p0.result()
    rb = pb.result()
    # GPU 1's sensor has all of it, GPU 0's none of it (its idle only)
    assert r1.component == "gpu1" and r1.energy_j == pytest.approx(6000.0, rel=0.01)
    assert r1.energy_j == pytest.approx(counter_ref(sigs[1], 20.0, 30.0), rel=0.01)
    assert r0.component == "gpu0" and r0.energy_j == pytest.approx(10 * IDLE[0], rel=0.01)
    assert [r.energy_j for r in rb] == [pytest.approx(800.0, rel=0.01), pytest.approx(6000.0, rel=0.01)]
    # ... and says GPU 1 was busy: its energy is in none of GPU 0's readings
    assert p0.foreign_activity and p0.foreign_activity[0]["component"] == "nvml1"
    fa = p0.foreign_activity[0]
    assert fa["mean_w"] == pytest.approx(600.0, rel=0.05) and fa["idle_w"] == pytest.approx(90.0)
    assert fa["busy_fraction"] > 0.9 and fa["excess_j"] == pytest.approx(5100.0, rel=0.06)
    assert "foreign activity" in r0.note and "nvml1" in r0.note
    assert p1.foreign_activity == [] and "foreign" not in r1.note  # GPU 0 idled
    assert pb.foreign_activity == []

    # an idle window after the load: nothing foreign
    p1, p0, pb = window(s1, clock, 34.0, 38.0, T0, s0, both)
    finish(s1, clock, p1, s0, both)
    assert p0.result() and p0.foreign_activity == [] and p1.result() and p1.foreign_activity == []
    for s in (s1, s0, both):
        s.close()


def test_short_foreign_burst_and_nearest_read(monkeypatch):
    """A window shorter than the watch period (0.25 s) is judged by its nearest read."""
    fake, clock, sigs = two_gpus(monkeypatch, load1=(20.0, 22.0))
    s0 = open_sensor(clock, [0])
    (r,) = finish(s0, clock, pend := window(s0, clock, 21.0, 21.1, T0))
    assert r.energy_j == pytest.approx(8.0, rel=0.05)
    assert [a["component"] for a in pend.foreign_activity] == ["nvml1"] and pend.foreign_activity[0]["reads"] <= 1
    s0.close()


def test_both_gpus_breakdown_and_total_without_double_counting(monkeypatch):
    fake, clock, sigs = two_gpus(monkeypatch, load0=(20.0, 30.0), load1=(22.0, 26.0), w0=500.0, w1=700.0)
    s0, s1, both = open_sensor(clock, [0]), open_sensor(clock, [1]), open_sensor(clock)
    pb, p0, p1 = window(both, clock, 18.0, 32.0, T0, s0, s1)
    rb = finish(both, clock, pb, s0, s1)
    (r0,), (r1,) = p0.result(), p1.result()
    expect = {"gpu0": 10 * 500.0 + 4 * IDLE[0], "gpu1": 4 * 700.0 + 10 * IDLE[1]}
    refs = {"gpu0": counter_ref(sigs[0], 18.0, 32.0), "gpu1": counter_ref(sigs[1], 18.0, 32.0)}
    assert refs == {k: pytest.approx(v, rel=0.005) for k, v in expect.items()}
    for r in rb:
        assert r.energy_j == pytest.approx(refs[r.component], rel=0.01), r
    total = total_energy(rb)
    assert total.energy_j == pytest.approx(sum(refs.values()), rel=0.01)
    assert total.energy_j == pytest.approx(sum(r.energy_j for r in rb))
    # one sensor per GPU: the same parts, nothing counted twice
    assert r0.energy_j + r1.energy_j == pytest.approx(total.energy_j, rel=0.005)
    assert r0.energy_j == pytest.approx(rb[0].energy_j, rel=0.005) and r1.energy_j == pytest.approx(rb[1].energy_j, rel=0.005)
    # each single-GPU sensor sees the other GPU as foreign; the two-GPU sensor sees nothing foreign
    assert [a["component"] for a in p0.foreign_activity] == ["nvml1"]
    assert [a["component"] for a in p1.foreign_activity] == ["nvml0"]
    assert pb.foreign_activity == [] and not any("foreign" in r.note for r in rb)
    for s in (s0, s1, both):
        s.close()


def test_a_gpu_hidden_by_cuda_visible_devices_is_watched(monkeypatch):
    fake, clock, sigs = two_gpus(monkeypatch, load0=(20.0, 30.0))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    sensor = open_sensor(clock)
    info = sensor.info()
    assert [(g["component"], g["nvml_index"]) for g in info.params["gpus"]] == [("gpu0", 1)]
    assert [(w["component"], w["nvml_index"], w["power_limit_w"]) for w in info.params["watched_gpus"]] == [
        ("nvml0", 0, 700.0)]
    assert "watched for foreign activity: nvml0" in info.detail
    pend = window(sensor, clock, 21.0, 29.0, T0)
    (r,) = finish(sensor, clock, pend)
    assert r.energy_j == pytest.approx(8 * IDLE[1], rel=0.01)  # GPU 1's idle, not GPU 0's load
    assert [a["component"] for a in pend.foreign_activity] == ["nvml0"] and "nvml0" in r.note
    # only the instant field of the watched GPU is read; never its counter or sample buffer
    assert {c.args[0][1] for c in fake.nvmlDeviceGetTotalEnergyConsumption.call_args_list} == {1}
    assert {c.args[0][1] for c in fake.nvmlDeviceGetSamples.call_args_list} == {1}
    assert 0 in {c.args[0][1] for c in fake.nvmlDeviceGetFieldValues.call_args_list}
    sensor.close()


def test_busy_since_before_the_sampler_is_foreign_and_warm_idle_is_not(monkeypatch):
    # GPU 1 at 600 W all along: no idle to rise from, but above 45% of its 700 W limit
    fake, clock, sigs = two_gpus(monkeypatch, load1=(-10.0, 100.0))
    s0 = open_sensor(clock, [0])
    pend = window(s0, clock, 10.0, 12.0, T0)
    finish(s0, clock, pend)
    assert [a["component"] for a in pend.foreign_activity] == ["nvml1"]
    assert pend.foreign_activity[0]["idle_w"] == pytest.approx(600.0)
    s0.close()

    # GPU 1 at 150 W after idling at 75 W (an H200 idles at 75-155 W depending on what ran before):
    # below the 105 W rise, not reported
    fake, clock, sigs = two_gpus(monkeypatch, load1=(15.0, 40.0), w1=150.0, idle=(80.0, 75.0))
    s0 = open_sensor(clock, [0])
    pend = window(s0, clock, 20.0, 30.0, T0)
    finish(s0, clock, pend)
    assert pend.foreign_activity == []
    s0.close()


def test_watching_is_cheap_optional_and_never_an_error(monkeypatch):
    fake, clock, sigs = two_gpus(monkeypatch, load1=(20.0, 30.0))
    s0 = open_sensor(clock, [0])
    drive(s0, clock, clock.mono_ns + 10_000_000_000)
    ov = s0.overhead()
    assert 38 <= ov["calls"]["watch"] <= 42  # 4 a second, instant field only
    assert ov["watched"] == {"nvml1": "ok"} and ov["periods_s"]["watch"] == 0.25
    s0.close()

    fake, clock, sigs = two_gpus(monkeypatch, load1=(20.0, 30.0))
    off = open_sensor(clock, [0], watch_others=False)
    pend = window(off, clock, 21.0, 29.0, T0)
    finish(off, clock, pend)
    assert off.overhead()["calls"]["watch"] == 0 and pend.foreign_activity == []
    off.close()

    # a watched GPU without the instant field (or one that fails outright) is skipped silently
    fake, clock, sigs = two_gpus(monkeypatch, load1=(20.0, 30.0))
    sigs[1].instant_ok = False
    fake.nvmlDeviceGetEnforcedPowerLimit.side_effect = lambda h: (_ for _ in ()).throw(RuntimeError("no"))
    s0 = open_sensor(clock, [0])
    pend = window(s0, clock, 21.0, 29.0, T0)
    (r,) = finish(s0, clock, pend)
    assert r.energy_j == pytest.approx(8 * IDLE[0], rel=0.01) and pend.foreign_activity == []
    w = s0.info().params["watched_gpus"][0]
    assert w["instant"].startswith("unsupported") and w["power_limit_w"] is None
    s0.close()
    fake, clock, sigs = two_gpus(monkeypatch, load1=(20.0, 30.0))
    sigs[1].fail_with = "NVML_ERROR_GPU_IS_LOST"
    s0 = open_sensor(clock, [0])
    (r,) = finish(s0, clock, window(s0, clock, 21.0, 29.0, T0))
    assert r.energy_j == pytest.approx(8 * IDLE[0], rel=0.01)
    s0.close()


def test_sampler_cost_scales_with_the_gpus_measured(monkeypatch):
    """Reads per second: counter and samples per measured GPU, the instant field for every GPU."""
    fake, clock, sigs = two_gpus(monkeypatch)
    one = open_sensor(clock, [0], counter_period_s=0.25)
    two = open_sensor(clock, counter_period_s=0.25)
    drive(one, clock, clock.mono_ns + 20_000_000_000, two)
    o1, o2 = one.overhead(), two.overhead()
    assert o1["iterations"] == pytest.approx(o2["iterations"], rel=0.1)  # one wake-up serves every GPU
    c1, c2 = o1["calls"], o2["calls"]
    assert c2["counter"] == pytest.approx(2 * c1["counter"], rel=0.05)
    assert c2["samples"] == pytest.approx(2 * c1["samples"], rel=0.05)
    assert c1["instant"] + c1["watch"] == pytest.approx(c2["instant"], rel=0.05)
    one.close()
    two.close()


def test_a_long_modest_foreign_load_stays_foreign(monkeypatch):
    """GPU 1 at 200 W for 95% of the run (below 45% of its 700 W limit): its idle stays the 75 W of
    its first seconds, so the load is still reported after minutes of it."""
    from ipw.telemetry.foreign import idle_from_reads

    fake, clock, sigs = two_gpus(monkeypatch, load1=(3.0, 60.0), w1=200.0, idle=(80.0, 75.0))
    s0 = open_sensor(clock, [0])
    pend = window(s0, clock, 50.0, 55.0, T0)
    finish(s0, clock, pend)
    assert [a["component"] for a in pend.foreign_activity] == ["nvml1"]
    assert pend.foreign_activity[0]["idle_w"] == pytest.approx(75.0)
    w = s0.sampler.arrays("gpu0")  # (the measured GPU's own reads: the watched one's are internal)
    assert idle_from_reads(w["instant_w"]) == pytest.approx(80.0)
    assert idle_from_reads([100.0, 50.0, 100.0, 100.0, 100.0]) == 100.0  # one low read is not an idle
    s0.close()
