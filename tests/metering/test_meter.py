"""Unit tests of the meter (ipw/metering/meter.py) and of the one measuring verb for a call
(ipw/metering/call.py), on numbers worked out by hand here.

The meter runs without its thread (``open(thread=False)``: ``share`` and ``close`` split what is left) on a fake
clock; RAPL is the real sensor over a fake powercap tree whose counters each test sets between request events
(as tests/telemetry/test_rapl.py does), so every slice's energy is a counter difference chosen here.  Where a test needs
qualities that RAPL never reports (interpolated, estimated, unavailable), a scripted sensor reports constant
power with the quality it is given.
"""

from __future__ import annotations

import time
import types
from pathlib import Path
from typing import Any

import pytest

from ipw.metering import meter as meter_mod
from ipw.metering.call import call_energy, open_call
from ipw.metering.meter import Meter
from ipw.metering.window import Window
from ipw.telemetry.api_estimate import ApiEnergyEstimate, Range
from ipw.telemetry.base import Z90, EnergyReading, SensorBase, SensorInfo
from ipw.telemetry.rapl import RaplSensor

MAX_RANGE_UJ = 262_143_328_850


class Clock:
    """The meter's clock: moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(meter_mod, "time", types.SimpleNamespace(monotonic=c, perf_counter=time.perf_counter))
    return c


@pytest.fixture
def rapl(tmp_path: Path) -> tuple[RaplSensor, Path]:
    """A RAPL sensor over one package zone at 0 J, and the zone's counter file."""
    zone = tmp_path / "powercap" / "intel-rapl:0"
    zone.mkdir(parents=True)
    (zone / "name").write_text("package-0\n")
    (zone / "energy_uj").write_text("0\n")
    (zone / "max_energy_range_uj").write_text(f"{MAX_RANGE_UJ}\n")
    return RaplSensor(tmp_path / "powercap", snapshot_period_s=None), zone / "energy_uj"


def at(clock: Clock, counter: Path, t_s: float, energy_j: float) -> None:
    """Move to ``t_s``, the package counter then reading ``energy_j`` in all."""
    clock.now = t_s
    counter.write_text(f"{int(round(energy_j * 1e6))}\n")


def by_component(readings: list[EnergyReading]) -> dict[str, EnergyReading]:
    return {r.component: r for r in readings}


def two_overlapping(split: str, clock: Clock, rapl: tuple[RaplSensor, Path]) -> tuple[Meter, int, int]:
    """A span 0-5 s: A in flight 1-3 s, B 2-4 s; the counter gains 10, 20, 30, 40, 50 J over the five seconds
    (idle 10 J, A alone 20 J, both 30 J, B alone 40 J, idle 50 J).  One accounting period (1-4 s)."""
    sensor, counter = rapl
    meter = Meter(Window([sensor]), split=split, period_s=100.0)
    at(clock, counter, 0.0, 0.0)
    meter.open(thread=False)
    at(clock, counter, 1.0, 10.0)
    a = meter.start()
    at(clock, counter, 2.0, 30.0)
    b = meter.start()
    at(clock, counter, 3.0, 60.0)
    assert meter.end(a, None) == (1.0, 3.0)
    at(clock, counter, 4.0, 100.0)
    assert meter.end(b, None) == (2.0, 4.0)
    at(clock, counter, 5.0, 150.0)
    return meter, a, b


def test_local_split_conserves_the_periods_energy(clock, rapl):
    # local, by active time (no token times): the 1-2 s slice is A's (20 J), 2-3 s half each (15 J), 3-4 s B's (40 J)
    meter, a, b = two_overlapping("local", clock, rapl)
    share_a, share_b = meter.share(a), meter.share(b)
    tally = meter.close()
    ea = by_component(share_a.readings)["package-0"].energy_j
    eb = by_component(share_b.readings)["package-0"].energy_j
    assert ea == pytest.approx(35.0) and eb == pytest.approx(55.0)
    assert tally == {"package-0": {"span_j": 150.0, "unattributed_j": 60.0, "parts_j": 90.0}}
    assert ea + eb + tally["package-0"]["unattributed_j"] == pytest.approx(tally["package-0"]["span_j"])
    assert share_a.busy_s == pytest.approx(1.5) and share_b.busy_s == pytest.approx(1.5)  # 1 s + half of 1 s
    # the priced alternative gives each 45 J (equal active time over the period): 10 J away from the local split
    assert share_a.uncertainty_j == {"package-0": pytest.approx(10.0)}
    assert share_b.uncertainty_j == {"package-0": pytest.approx(10.0)}
    assert share_a.method == share_b.method == "time"


def test_priced_split_shares_a_period_by_active_time_without_tokens(clock, rapl):
    # priced, no work known: the period's 90 J by active time over it, 2 s each: 45 J each
    meter, a, b = two_overlapping("priced", clock, rapl)
    share_a, share_b = meter.share(a), meter.share(b)
    tally = meter.close()
    assert by_component(share_a.readings)["package-0"].energy_j == pytest.approx(45.0)
    assert by_component(share_b.readings)["package-0"].energy_j == pytest.approx(45.0)
    assert share_a.uncertainty_j == {"package-0": pytest.approx(10.0)}  # |45 - 35|: the local split's distance
    assert share_b.uncertainty_j == {"package-0": pytest.approx(10.0)}  # |45 - 55|
    assert tally["package-0"]["parts_j"] == pytest.approx(90.0)
    assert tally["package-0"]["span_j"] == pytest.approx(150.0)
    assert share_a.busy_s == pytest.approx(1.5)  # half of the period's 3 busy seconds


@pytest.mark.parametrize("split", ["priced", "local"])
def test_identical_requests_get_identical_shares(split, clock, rapl):
    # A and B start together at 1 s and end together at 3 s; the counter gains 24 J between: 12 J each
    sensor, counter = rapl
    meter = Meter(Window([sensor]), split=split, period_s=100.0)
    at(clock, counter, 0.0, 0.0)
    meter.open(thread=False)
    at(clock, counter, 1.0, 5.0)
    a, b = meter.start(), meter.start()
    at(clock, counter, 3.0, 29.0)
    meter.end(a, None)
    meter.end(b, None)
    at(clock, counter, 4.0, 30.0)
    share_a, share_b = meter.share(a), meter.share(b)
    tally = meter.close()
    ra, rb = by_component(share_a.readings)["package-0"], by_component(share_b.readings)["package-0"]
    assert ra.energy_j == rb.energy_j == pytest.approx(12.0)
    assert share_a.busy_s == share_b.busy_s == pytest.approx(1.0)
    assert share_a.uncertainty_j == share_b.uncertainty_j == {"package-0": 0.0}  # both splits agree
    assert tally == {"package-0": {"span_j": 30.0, "unattributed_j": 6.0, "parts_j": 24.0}}


class Scripted(SensorBase):
    """Constant power per component, each with the quality given (``None`` W: no energy, unavailable)."""

    name = "scripted"

    def __init__(self, power: dict[str, tuple[float | None, str]]) -> None:
        self.power = power

    def info(self) -> SensorInfo:
        return SensorInfo(name=self.name, available=True, source="scripted", quality="estimated",
                          scope="gpu", components=tuple(self.power))

    def begin(self, t_s: float | None = None) -> Any:
        return t_s

    def end(self, token: Any, t_s: float | None = None) -> list[EnergyReading]:
        assert t_s is not None and token is not None
        return [EnergyReading(component=c, energy_j=None if w is None else w * (t_s - token), source=f"scripted.{c}",
                              quality=quality, scope="gpu", duration_s=t_s - token)  # type: ignore[arg-type]
                for c, (w, quality) in self.power.items()]


def test_labels_are_carried_through_a_share(clock, rapl):
    # one request alone for 2 s: each component's share is its energy then, with its own quality, source, scope
    sensor, counter = rapl
    scripted = Scripted({"gpu0": (100.0, "measured_interpolated"), "model": (10.0, "estimated"),
                         "lost": (None, "unavailable")})
    meter = Meter(Window([sensor, scripted]), split="priced", period_s=100.0)
    at(clock, counter, 0.0, 0.0)
    meter.open(thread=False)
    at(clock, counter, 1.0, 3.0)
    job = meter.start()
    at(clock, counter, 3.0, 9.0)
    meter.end(job, None)
    share = meter.share(job)
    tally = meter.close()
    got = by_component(share.readings)
    assert (got["package-0"].energy_j, got["package-0"].quality, got["package-0"].source, got["package-0"].scope) == (
        pytest.approx(6.0), "measured", "rapl.package", "cpu_package")
    assert (got["gpu0"].energy_j, got["gpu0"].quality, got["gpu0"].source) == (
        pytest.approx(200.0), "measured_interpolated", "scripted.gpu0")
    assert (got["model"].energy_j, got["model"].quality) == (pytest.approx(20.0), "estimated")
    assert (got["lost"].energy_j, got["lost"].quality) == (None, "unavailable")
    assert all(r.duration_s == pytest.approx(2.0) for r in share.readings)
    assert share.method == "" and "(alone)" in got["gpu0"].note  # it shared its period with no one
    assert tally["gpu0"] == {"span_j": 300.0, "unattributed_j": 100.0, "parts_j": 200.0}
    assert tally["lost"] == {"span_j": None, "unattributed_j": None, "parts_j": None}


class Banded(SensorBase):
    """10 W on two components, each reading stating a ±60% band: ``model``'s band is all its coefficient's (the
    CPU model's: ``calibration_sd_j``, the same error in every window), ``noise``'s states no shared part."""

    name = "banded"

    def info(self) -> SensorInfo:
        return SensorInfo(name=self.name, available=True, source="model.cpu", quality="estimated",
                          scope="cpu_package", components=("model", "noise"))

    def begin(self, t_s: float | None = None) -> Any:
        return t_s

    def end(self, token: Any, t_s: float | None = None) -> list[EnergyReading]:
        assert t_s is not None and token is not None
        e = 10.0 * (t_s - token)
        return [EnergyReading(component=c, energy_j=e, source="model.cpu", quality="estimated", scope="cpu_package",
                              duration_s=t_s - token, uncertainty_j=0.6 * e,
                              calibration_sd_j=0.6 * e / Z90 if c == "model" else None)
                for c in ("model", "noise")]


def test_a_shared_error_adds_linearly_across_slices(clock):
    # A runs 1-5 s; B 2-3 s, C 3-4 s, D 4-5 s: four slices, A's local parts 10 + 5 + 5 + 5 = 25 J.  The model's
    # error is one coefficient's: A's band stays 60% of its share (15 J), however many slices it was cut into;
    # an error stated as independent adds in quadrature: sqrt(6^2 + 3^2 + 3^2 + 3^2) J
    meter = Meter(Window([Banded()]), split="local", period_s=100.0)
    meter.open(thread=False)
    clock.now = 1.0
    a = meter.start()
    clock.now = 2.0
    other = meter.start()
    for t in (3.0, 4.0):
        clock.now = t
        meter.end(other, None)
        other = meter.start()
    clock.now = 5.0
    meter.end(a, None)
    meter.end(other, None)
    got = by_component(meter.share(a).readings)
    meter.close()
    assert got["model"].energy_j == pytest.approx(25.0) and got["noise"].energy_j == pytest.approx(25.0)
    assert got["model"].uncertainty_j == pytest.approx(15.0)
    assert got["model"].calibration_sd_j == pytest.approx(15.0 / Z90)
    assert got["noise"].uncertainty_j == pytest.approx((6.0 ** 2 + 3 * 3.0 ** 2) ** 0.5)
    assert got["noise"].calibration_sd_j is None


def test_the_verb_measures_one_call(rapl):
    # open_call / close / energy: the window's edges are the call's, the energy the counter's difference
    sensor, counter = rapl
    counter.write_text("1000000\n")
    call = open_call(Window([sensor]))
    counter.write_text("13500000\n")  # 12.5 J during the call
    measured = call.close()
    assert measured.start_s == call.start_s <= measured.end_s
    assert measured.duration_s == measured.end_s - measured.start_s
    energy = measured.energy()
    assert [r.component for r in energy.readings] == ["package-0"]
    assert energy.total.energy_j == pytest.approx(12.5)
    assert (energy.total.quality, energy.total.source, energy.total.scope) == ("measured", "rapl.package", "cpu_package")


def test_call_energy_adds_the_api_estimate_beside_the_measured_basis():
    # 0.2 Wh per query = 720 J, estimated; measured parts win the total, the estimate alone is the total without them
    estimate = ApiEnergyEstimate(method="per_query", per_query_wh=Range(0.1, 0.2, 0.4),
                                 per_output_token_wh=Range(0.0, 0.0, 0.0), sources=(), table="test")
    measured = EnergyReading(component="package-0", energy_j=12.5, source="rapl.package", quality="measured",
                             scope="cpu_package", duration_s=2.0)
    both = call_energy([measured], estimate, completion_tokens=7, ok=True, duration_s=2.0)
    assert [r.source for r in both.readings] == ["rapl.package", "estimate.api"]
    assert both.readings[1].energy_j == pytest.approx(720.0) and both.readings[1].quality == "estimated"
    assert both.total.energy_j == pytest.approx(12.5) and both.total.quality == "measured"
    assert both.total.best_effort_j == pytest.approx(732.5)
    alone = call_energy([], estimate, completion_tokens=7, ok=True, duration_s=2.0)
    assert alone.total.energy_j == pytest.approx(720.0) and alone.total.quality == "estimated"
    failed = call_energy([], estimate, completion_tokens=0, ok=False, duration_s=2.0)
    assert failed.total.energy_j == 0.0  # a failed query is not charged
    assert call_energy([measured], None, 0, True, 2.0).readings == [measured]
