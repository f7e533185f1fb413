"""Issue 58: a shared measurement error (one power model, one device's bias) is drawn once per resample for
every reading of its source, so it cancels in savings and paired changes between backends that share it;
errors of different sources keep their own draws (ipw.analysis.stats, ipw.analysis.load)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from ipw.analysis.stats import MeasurementError, bootstrap_draws, interval

sys.path.insert(0, str(Path(__file__).parents[1]))
from runfolders import create, record


def _ratio_ci(a, b, measurement=()):
    d = bootstrap_draws([a, b], n_boot=2000, seed=0, measurement=measurement)
    return interval(1 - d.point_sums[0] / d.point_sums[1], 1 - d.sums[:, 0] / d.sums[:, 1])


@pytest.mark.parametrize("rel", [0.05, 0.5, 5.0])
def test_a_shared_source_cancels_in_a_saving_whatever_its_size(rel):
    rng = np.random.default_rng(5)
    a, b = rng.normal(3.0, 0.5, 60), rng.normal(4.0, 0.5, 60)
    plain = _ratio_ci(a, b)
    same = _ratio_ci(a, b, [MeasurementError(0, np.zeros(60), rel * a, "node-1 model.cpu"),
                            MeasurementError(1, np.zeros(60), rel * b, "node-1 model.cpu")])
    assert (same.lo, same.hi) == pytest.approx((plain.lo, plain.hi), abs=1e-9)


def test_different_sources_keep_their_own_draws():
    rng = np.random.default_rng(5)
    a, b = rng.normal(3.0, 0.5, 60), rng.normal(4.0, 0.5, 60)
    plain = _ratio_ci(a, b)
    apart = _ratio_ci(a, b, [MeasurementError(0, np.zeros(60), 0.3 * a, "node-1 nvml.samples:gpu0"),
                             MeasurementError(1, np.zeros(60), 0.3 * b, "node-1 nvml.samples:gpu1")])
    unkeyed = _ratio_ci(a, b, [MeasurementError(0, np.zeros(60), 0.3 * a), MeasurementError(1, np.zeros(60), 0.3 * b)])
    assert apart.hi - apart.lo > 3 * (plain.hi - plain.lo)
    assert unkeyed.hi - unkeyed.lo == pytest.approx(apart.hi - apart.lo, rel=0.2)


def _two_backend_run(tmp, run_id, *, nodes=("node-a", "node-a"), stated=True, energies=None):
    """Two backends (local, cloud) of 40 queries measured through the CPU model, each on ``nodes[i]``."""
    rng = np.random.default_rng(7)
    energies = energies or {"small": rng.normal(3.0, 0.6, 40), "big": rng.normal(4.0, 0.6, 40)}
    manifest = {"command": ["test"], "config": {},
                "dataset": {"name": "fixture", "n_queries": 40, "fingerprint": "sha256:x"},
                "backends": [{"name": name, "sensors": [{"name": "cpu_model", "source": "model.cpu",
                                                          "params": {"watts_per_core": 6.25, "basis": "test"}}]}
                             for name in energies]}
    folder = create(tmp, run_id, manifest)
    for (name, e), node, role in zip(energies.items(), nodes, ("local", "cloud")):
        for i, x in enumerate(e):
            part = {"component": "cpu-process", "energy_j": float(x), "source": "model.cpu", "quality": "estimated",
                    "scope": "cpu_package", "duration_s": 0.5, "note": ""}
            if stated:
                part["uncertainty_j"] = 0.6 * float(x) + 0.01
            folder.append(record(run_id=run_id, backend=name, model=name, role=role, query_id=f"q{i}",
                                 correct=float((i + (role == "cloud")) % 3 == 0), energy_j=float(x),
                                 energy_quality="estimated", energy_source="model.cpu", energy_scope="cpu_package",
                                 energy_parts=json.dumps([part]), node=node,
                                 start_s=i * 1.0, end_s=i * 1.0 + 0.5, latency_s=0.5))
    folder.finish("complete")
    return folder.path


def test_compare_cancels_one_machines_cpu_model_and_not_two_machines(tmp_path):
    """The default's case: both backends through this CPU's power model. The oracle's energy saving is about
    as wide as with no measurement error at all; on two machines the models' errors are drawn apart."""
    from ipw.analysis.compare import compare

    plain = compare([_two_backend_run(tmp_path / "p", "plain", stated=False)])
    one = compare([_two_backend_run(tmp_path / "o", "one")])
    two = compare([_two_backend_run(tmp_path / "t", "two", nodes=("node-a", "node-b"))])
    key = "oracle_energy_saved_fraction"
    width = {name: c.routing_ci[key].hi - c.routing_ci[key].lo for name, c in
             (("plain", plain), ("one", one), ("two", two))}
    assert width["one"] < 1.5 * width["plain"]
    assert width["two"] > 3 * width["plain"]
    # the J/query of each backend still carries the model's whole error
    for c in (one, two):
        j = c.metrics["small"]["energy_per_query_j"]
        assert j.hi - j.lo > 0.8 * j.value
    assert "common to small, big" in one.measurement
    assert "common to" not in two.measurement


def test_check_draws_one_machines_model_once_for_both_runs(tmp_path):
    from ipw.analysis.check import check_runs, parse_threshold
    from ipw.results import load_run

    rng = np.random.default_rng(9)
    base_e = {"small": rng.normal(3.0, 0.3, 40), "big": rng.normal(4.0, 0.3, 40)}
    cand_e = {k: v * 1.02 for k, v in base_e.items()}
    base = load_run(_two_backend_run(tmp_path / "b", "base", energies=base_e))
    cand = load_run(_two_backend_run(tmp_path / "c", "cand", energies=cand_e))
    result = check_runs(*base, *cand, [parse_threshold("energy_per_query:+5%")], work_gate=False)
    small = next(v for v in result.verdicts if v.backend == "small")
    assert small.ci_hi - small.ci_lo < 10  # percent: the model's ±60% is not in the change
    assert any("common to both runs and cancels" in n for n in result.notes)
