"""Issue 27: bootstrap CIs carry each query's measurement error (ipw.analysis.stats), in one place that
compare, report, the routing analysis and ipw check share."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ipw.analysis.stats import MeasurementError, Z90, bootstrap_draws, interval, measurement_sd


def _mean_ci(energy, measurement=(), seed=0):
    n = len(energy)
    d = bootstrap_draws([energy, np.ones(n)], n_boot=2000, seed=seed, measurement=measurement)
    return interval(d.point_sums[0] / n, d.sums[:, 0] / d.sums[:, 1]), d


def test_negligible_measurement_error_leaves_the_ci_as_it_was():
    e = np.random.default_rng(1).normal(10.0, 1.0, 150)
    plain, d0 = _mean_ci(e)
    zero, d1 = _mean_ci(e, [MeasurementError(0, np.zeros(150), np.zeros(150))])
    tiny, _ = _mean_ci(e, [MeasurementError(0, np.full(150, 1e-9), None)])
    assert (zero.lo, zero.hi) == (plain.lo, plain.hi) and d1.measurement == ()
    assert tiny.lo == pytest.approx(plain.lo, abs=1e-6) and tiny.hi == pytest.approx(plain.hi, abs=1e-6)


def test_short_windows_widen_the_ci():
    """150 queries of ~7.7 J (the H200's 50 ms SmolLM2 queries): the queries' own spread and a ±7% (90%)
    independent error per window, as the error model states for 50 ms windows: the CI widens, and by
    about the root sum of squares of both (the errors are independent, so they shrink with n too)."""
    rng = np.random.default_rng(2)
    e = rng.normal(7.7, 0.3, 150)
    plain, _ = _mean_ci(e)
    sd = 0.07 * e / Z90
    short, d = _mean_ci(e, [MeasurementError(0, sd, None)])
    assert d.measurement == (0,)
    w0, w1 = plain.hi - plain.lo, short.hi - short.lo
    assert w1 > 1.1 * w0
    expect = np.sqrt(w0 ** 2 + (2 * 1.96 * np.sqrt((sd ** 2).sum()) / 150) ** 2)
    assert w1 == pytest.approx(expect, rel=0.1)
    assert short.value == plain.value  # the point is the measured one


def test_estimated_energy_widens_the_ci_by_its_shared_error():
    """An estimated energy's error (the CPU model's ±60%) is the same for every query: it does not average
    out, so the CI of the mean is at least the model's own band."""
    e = np.random.default_rng(3).normal(2.0, 0.2, 400)
    plain, _ = _mean_ci(e)
    est, _ = _mean_ci(e, [MeasurementError(0, np.zeros(400), 0.6 * e / Z90)])
    assert plain.hi - plain.lo < 0.05
    # 95% of a normal whose 90% half-width is 60% of the mean: about +-71%
    assert est.hi - est.lo == pytest.approx(2 * 1.96 / Z90 * 0.6 * e.mean(), rel=0.1)


def test_measurement_sd_of_a_records_parts():
    parts = [
        {"component": "gpu0", "energy_j": 10.0, "source": "nvml.samples", "quality": "measured_interpolated",
         "scope": "gpu", "duration_s": 0.05, "note": "", "uncertainty_j": 0.7},
        {"component": "cpu-process", "energy_j": 0.5, "source": "model.cpu", "quality": "estimated",
         "scope": "cpu_package", "duration_s": 0.05, "note": "", "uncertainty_j": 0.425},
    ]
    indep, shared = measurement_sd(json.dumps(parts))
    sd_gpu = 0.7 / Z90
    assert shared == pytest.approx(0.0022 * 10.0 + 0.425 / Z90)
    assert indep == pytest.approx(np.sqrt(sd_gpu ** 2 - (0.0022 * 10.0) ** 2))
    # a share of a period that states less than the CPU model's coefficient carries at least its 60%
    split = [{**parts[1], "uncertainty_j": 0.1 * 0.5}]
    assert measurement_sd(split) == (0.0, pytest.approx(0.6 * 0.5 / Z90))
    old = [{k: v for k, v in p.items() if k != "uncertainty_j"} for p in parts]  # a record made before it
    assert measurement_sd(json.dumps(old)) == (0.0, 0.0) and measurement_sd(None) == (0.0, 0.0)
    # power no counter calibrated (a Jetson board, a distrusted NVML counter): its 3% is every window's
    for source in ("jetson.power", "nvml.samples"):
        alone = [{**parts[0], "source": source, "note": "counter distrusted, not used: ...; uncalibrated",
                  "uncertainty_j": 0.9}]
        indep, shared = measurement_sd(alone)
        assert shared == pytest.approx(0.03 * 10.0) and indep == pytest.approx(np.sqrt((0.9 / Z90) ** 2 - 0.3 ** 2))


def _run(tmp_path, run_id, energies, uncertainty_rel, source="nvml.samples", quality="measured_interpolated"):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from runfolders import create, record

    folder = create(tmp_path, run_id, {"command": ["test"], "config": {},
                                       "dataset": {"name": "fixture", "n_queries": len(energies), "fingerprint": "sha256:x"}})
    for i, e in enumerate(energies):
        part = {"component": "gpu0", "energy_j": e, "source": source, "quality": quality, "scope": "gpu",
                "duration_s": 0.05, "note": ""}
        if uncertainty_rel is not None:
            part["uncertainty_j"] = uncertainty_rel * e
        folder.append(record(run_id=run_id, query_id=f"q{i}", correct=float(i % 3 == 0), energy_j=e,
                             energy_quality=quality, energy_source=source, energy_scope="gpu",
                             energy_parts=json.dumps([part]), start_s=i * 0.06, end_s=i * 0.06 + 0.05))
    folder.finish("complete")
    return folder.path


@pytest.mark.parametrize("rel, source, quality", [(0.3, "nvml.samples", "measured_interpolated"),
                                                  (0.6, "model.cpu", "estimated")])
def test_compare_carries_each_querys_interval(tmp_path, rel, source, quality):
    """ipw compare on run folders whose readings state uncertainty_j: the J/query CI is wider than the same
    energies' without it, the point value is the same, and the table and JSON say what the CIs carry."""
    from ipw.analysis.compare import compare
    from ipw.analysis.render import to_dict

    e = list(np.random.default_rng(4).normal(7.7, 0.5, 120))
    plain = compare([_run(tmp_path / "a", "plain", e, None, source, quality)])
    carried = compare([_run(tmp_path / "b", "carried", e, rel, source, quality)])
    (p,), (c,) = plain.metrics.values(), carried.metrics.values()
    key = "energy_per_query_j"
    assert c[key].value == pytest.approx(p[key].value)
    assert c[key].hi - c[key].lo > 1.2 * (p[key].hi - p[key].lo)
    assert "resample queries only" in plain.measurement and "include measurement error" in carried.measurement
    assert to_dict(carried)["bootstrap"]["measurement_error"] == carried.measurement
    assert any("measurement error" in n for n in carried.notes)
