"""Issue 58: on a machine with no live power reading (the CPU model), an answer of ``ipw serve`` carries a
provisional energy from its first request on: the sensor's own reads tell the power of the slices the request
ran in (``SensorBase.window_power_w``), until a period is split; labelled estimated, with the model's band."""

from __future__ import annotations

import time

import pytest

from ipw.telemetry.base import EnergyReading, PowerEstimate, SensorBase, SensorInfo
from ipw.telemetry.cpu_model import MODEL_UNCERTAINTY_REL, CpuModelSensor
from ipw.telemetry.snapshots import Counters


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _scripted_counters(values: list[float]):
    """Counters on a clock the test moves, reading ``values`` one after another (no thread)."""
    clock, reads = _Clock(), iter(values)
    counters = Counters(lambda: ((next(reads),), 0.01), threaded=False, clock=clock)
    return counters, clock


def test_counters_rate_is_the_mean_over_the_window_so_far_from_the_reads_held():
    """From the last read at or before the window's start to the newest; the newest two while none came since
    its start; None with a single read."""
    counters, clock = _scripted_counters([10.0, 10.5, 11.0, 12.5, 14.0])  # read at 100 (made), then as snapped
    clock.t = 100.5
    counters.snap()  # 10.5 at 100.5
    lone = Counters(lambda: ((1.0,), 0.0), threaded=False, clock=clock)
    assert lone.rate(lone.begin(100.6)) is None
    window = counters.begin(100.6)
    assert counters.rate(window) == pytest.approx((1.0,))  # none since its start: the newest two (10 -> 10.5)
    for t in (101.0, 101.5, 102.0):
        clock.t = t
        counters.snap()
    assert counters.rate(window) == pytest.approx(((14.0 - 10.5) / (102.0 - 100.5),))


def test_cpu_model_tells_the_trees_power_over_an_open_window():
    """CPU seconds per second of the reads already held x W/core, the model's band; None before any window."""
    sensor = CpuModelSensor(lambda: [], watts_per_core=4.0)
    assert sensor.window_power_w(None) is None
    counters, clock = _scripted_counters([1.0, 1.0, 2.5])
    sensor.counters = counters
    window = sensor.begin(100.0)
    clock.t = 100.5
    counters.snap()
    clock.t = 101.0
    counters.snap()
    assert sensor.window_power_w(window) == {"cpu-process": PowerEstimate(1.5 * 4.0, MODEL_UNCERTAINTY_REL)}
    assert SensorBase().window_power_w(None) is None  # a sensor that cannot tell one


class _Estimating(SensorBase):
    """A sensor with no live power whose windows cost ``watts`` W, final at once; with ``estimates``, it tells
    the power of an open window (``window_power_w``) as the CPU model does, ``asked`` times so far."""

    name = "estimating"
    supports_cut = True

    def __init__(self, watts: float, estimates: bool = True) -> None:
        self.watts, self.estimates, self.asked = watts, estimates, 0

    def info(self):
        return SensorInfo("estimating", True, "model.test", "estimated", "cpu_package", ("cpu-process",))

    def begin(self, t_s=None):
        return time.monotonic() if t_s is None else t_s

    def end(self, token, t_s=None):
        now = time.monotonic() if t_s is None else t_s
        return [EnergyReading("cpu-process", self.watts * (now - token), "model.test", "estimated", "cpu_package",
                              now - token, uncertainty_j=0.6 * self.watts * (now - token))]

    def cut(self, token, t_s=None):
        now = time.monotonic() if t_s is None else t_s
        return self.end(token, now), now

    def window_power_w(self, token):
        if not self.estimates:
            return None
        self.asked += 1
        return {"cpu-process": PowerEstimate(self.watts, 0.6)}


def _one_request(meter, tokens: int = 3):
    job = meter.start()
    for _ in range(tokens):
        time.sleep(0.005)
        meter.token(job)
    start, end = meter.end(job, None)
    return job, start, end


def test_before_any_period_is_split_the_provisional_energy_is_the_sensors_estimate():
    """The first request's provisional energy: the sensor's power over its window, labelled estimated, with the
    wider of the default band and the sensor's own; once a period is split the sensor is asked no more and the
    provisional value is the one of the power of the last period split, as before."""
    from ipw.metering import meter as meter_module
    from ipw.metering.meter import Meter
    from ipw.metering.window import Window

    sensor = _Estimating(7.5)
    meter = Meter(Window([sensor]), live_tokens=True, idle_w={"cpu-process": 0.0})
    meter.open(thread=False)
    try:
        job, start, end = _one_request(meter)
        first = meter.provisional(job)
        meter.share(job)  # its period split (no meter thread: here)
        asked = sensor.asked
        job2, start2, end2 = _one_request(meter)
        second = meter.provisional(job2)
    finally:
        meter.close()
    (reading,) = first.readings
    assert first.source == "alone" and reading.energy_j == pytest.approx(7.5 * (end - start), rel=1e-6)
    assert reading.quality == "estimated" and reading.source == "provisional"
    assert first.rel_90 == max(0.6, meter_module.PROVISIONAL_REL_DEFAULT)
    assert reading.uncertainty_j == pytest.approx(reading.energy_j * first.rel_90)
    assert sensor.asked == asked, "the power of the period split, not the sensor's estimate"
    assert second.rel_90 == meter_module.PROVISIONAL_REL_DEFAULT
    # the trapezoid between the power at the previous request's end (estimated) and the last period's (7.5 W)
    assert second.readings[0].energy_j == pytest.approx(7.5 * (end2 - start2), rel=1e-6)


def test_a_sensor_that_tells_no_power_still_gives_none_before_a_split():
    from ipw.metering.meter import Meter
    from ipw.metering.window import Window

    meter = Meter(Window([_Estimating(7.5, estimates=False)]), live_tokens=True, idle_w={"cpu-process": 0.0})
    meter.open(thread=False)
    try:
        job, _, _ = _one_request(meter)
        assert meter.provisional(job).source == "none"
        meter.share(job)
    finally:
        meter.close()


def _binary() -> bool:
    from ipw.backends.servers import find_llama_server
    from ipw.errors import IpwError

    try:
        return bool(find_llama_server())
    except IpwError:
        return False


@pytest.mark.llama
@pytest.mark.skipif(not _binary(), reason="llama-server is not built: run `bash .ci/setup`")
def test_serve_in_front_of_llama_server_answers_its_first_request_with_a_number(tmp_path):
    """The acceptance of issue 58 (CPU): ``ipw serve`` in front of a real llama-server, metered by the CPU model
    (on any machine), answers its first request with a provisional energy, labelled estimated, with the model's
    band; the record keeps it beside the settled value."""
    import json

    openai = pytest.importorskip("openai")
    from ipw.backends.base import BackendSpec, create_backend
    from ipw.serve import ServeOptions, start

    backend = create_backend(BackendSpec("smol", "openai", "smollm2-135m", options={
        "server": "llama-server", "n_threads": 1, "n_ctx": 256, "concurrency": 2, "server_timeout_s": 300.0}))
    backend.attach(tmp_path / "llama")
    backend.load()
    try:
        proxy = start(ServeOptions(upstream=backend.base_url, name="smol", port=0, idle_s=0.5), tmp_path / "out",
                      upstream_pids=backend.pids(), command=["test"],
                      probe=lambda pids_fn, remote: [CpuModelSensor(pids_fn)])
        try:
            client = openai.OpenAI(base_url=proxy.url, api_key="unused")
            answer = client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
        finally:
            proxy.stop()
    finally:
        backend.close()
    energy = (answer.usage.model_extra or {})["energy"]
    assert energy["provisional"] is True
    assert isinstance(energy["energy_j"], float) and energy["energy_j"] > 0, energy
    assert energy["quality"] == "estimated"
    assert energy["uncertainty_j"] == pytest.approx(energy["energy_j"] * MODEL_UNCERTAINTY_REL, rel=1e-3)
    (record,) = [json.loads(line) for line in (proxy.session.folder.path / "records.jsonl").read_text().splitlines()]
    assert record["provisional_energy_j"] == energy["energy_j"] and record["energy_j"] > 0
    assert record["energy_quality"] == "estimated"
