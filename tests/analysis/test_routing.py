"""Routing and coverage (ipw.routing): hand-computed cases and seeded property checks."""

import math

import numpy as np
import pytest

from ipw.errors import IpwError
from ipw.analysis.routing import (QueryMatrix, coverage, energy_budget, oracle, oracle_queries, power_envelope,
                         resolve_roles, route, router)

# 3 backends x 10 queries: local A (small), local B (medium), cloud C. Categories: q0-q4 math, q5-q9 text.
CORRECT = np.array([
    # A  B  C
    [1, 1, 1],  # q0  both locals: A is cheaper
    [1, 0, 1],  # q1  A
    [0, 1, 1],  # q2  B
    [0, 0, 1],  # q3  cloud
    [0, 0, 0],  # q4  cloud (wrong)
    [1, 1, 1],  # q5  both: B is cheaper here
    [0, 1, 0],  # q6  B (the cloud is wrong)
    [1, 0, 0],  # q7  A
    [0, 0, 1],  # q8  cloud
    [1, 1, 1],  # q9  both: B is cheaper
], dtype=float)
ENERGY = np.column_stack([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2], [3, 3, 3, 3, 3, 1, 3, 3, 3, 1], [10] * 10]).astype(float)
LATENCY = np.column_stack([[0.5] * 10, [1.0] * 10, [2.0] * 10])
COST = np.column_stack([[0.001] * 10, [0.002] * 10, [0.01] * 10])
CATEGORY = np.array([0] * 5 + [1] * 5)
POWER = [5.0, 20.0, 300.0]


def matrix(cost=None, energy=ENERGY, quality=("measured", "measured", "estimated")):
    return QueryMatrix(("A", "B", "C"), quality, CORRECT, energy, LATENCY, cost, category=CATEGORY,
                       categories=("math", "text"))


def test_coverage_by_hand():
    m = matrix()
    assert coverage(m.correct, [0]) == 0.5  # q0 q1 q5 q7 q9
    assert coverage(m.correct, [1]) == 0.5  # q0 q2 q5 q6 q9
    assert coverage(m.correct, [0, 1]) == 0.7  # q3 q4 q8 uncovered
    assert coverage(m.correct, []) == 0.0


def test_oracle_choice_by_hand():
    q = oracle_queries(matrix(), [0, 1], 2)
    assert q.choice.tolist() == [0, 0, 1, 2, 2, 1, 1, 0, 2, 1]
    assert q.covered.tolist() == [True, True, True, False, False, True, True, True, False, True]


def test_routing_numbers_by_hand():
    r = route(matrix(cost=COST), local=["A", "B"], cloud="C", mean_power_w=POWER, router_accuracy=0.8)
    o = r.oracle
    assert r.local_coverage == 0.7
    assert r.coverage_by_backend == {"A": 0.5, "B": 0.5}
    assert o.routed_to == {"A": 3, "B": 4, "C": 3}
    assert o.accuracy == pytest.approx(0.9)  # only q4 is wrong
    assert o.cloud_accuracy == pytest.approx(0.7)
    # energy: 1+1+3+10+10+1+3+2+10+1 = 42 J routed against 100 J cloud-only
    assert (o.energy_j.cloud_only, o.energy_j.routed, o.energy_j.saved) == (100.0, 42.0, 58.0)
    assert o.energy_j.saved_fraction == pytest.approx(0.58)
    # latency: 3 x 0.5 + 4 x 1.0 + 3 x 2.0 = 11.5 s against 20 s
    assert (o.latency_s.cloud_only, o.latency_s.routed) == (20.0, 11.5)
    assert o.latency_s.saved_fraction == pytest.approx(0.425)
    # cost: 3 x 0.001 + 4 x 0.002 + 3 x 0.01 = 0.041 USD against 0.1
    assert o.cost_usd.routed == pytest.approx(0.041)
    assert o.cost_usd.saved_fraction == pytest.approx(0.59)
    # energy of different qualities is kept apart and the total is labeled with the worst
    assert o.energy_quality == "estimated"
    assert o.routed_energy_by_quality_j == {"measured": 12.0, "estimated": 30.0}
    # the 80% router: savings x 0.8, accuracy 0.8 x 0.9 + 0.2 x 0.7
    assert r.router.alpha == 0.8
    assert r.router.energy_saved_fraction == pytest.approx(0.464)
    assert r.router.latency_saved_fraction == pytest.approx(0.34)
    assert r.router.cost_saved_fraction == pytest.approx(0.472)
    assert r.router.accuracy == pytest.approx(0.86)
    curve = {p.alpha: p for p in r.router_curve}
    assert sorted(curve) == [round(a / 10, 1) for a in range(11)]
    assert curve[0.0].energy_saved_fraction == 0.0 and curve[0.0].accuracy == pytest.approx(0.7)
    assert curve[1.0].energy_saved_fraction == pytest.approx(0.58) and curve[1.0].accuracy == pytest.approx(0.9)
    assert curve[0.5].energy_saved_fraction == pytest.approx(0.29)


def test_per_category_by_hand():
    r = route(matrix(), local=["A", "B"], cloud="C", mean_power_w=POWER)
    math_, text = r.by_category
    assert (math_.category, math_.n_queries, text.category, text.n_queries) == ("math", 5, "text", 5)
    assert math_.local_coverage == pytest.approx(0.6) and text.local_coverage == pytest.approx(0.8)
    assert math_.cloud_accuracy == pytest.approx(0.8) and text.cloud_accuracy == pytest.approx(0.6)
    assert math_.oracle_accuracy == pytest.approx(0.8) and text.oracle_accuracy == pytest.approx(1.0)
    assert math_.energy_saved_fraction == pytest.approx(0.5)  # 25 of 50 J
    assert text.energy_saved_fraction == pytest.approx(0.66)  # 17 of 50 J
    assert math_.latency_saved_fraction == pytest.approx(0.4) and text.latency_saved_fraction == pytest.approx(0.45)
    assert math_.cost_saved_fraction is None  # no cost data


def test_power_envelope_and_energy_budget_by_hand():
    m = matrix()
    env = power_envelope(m, [0, 1], POWER)
    assert [(p.power_w, p.backends, p.coverage) for p in env] == [(5.0, ("A",), 0.5), (20.0, ("A", "B"), 0.7)]
    # least energy of a local backend that solves each query: q0 1, q1 1, q2 3, q5 1, q6 3, q7 2, q9 1
    pts = energy_budget(m, [0, 1], [0.5, 1.0, 2.0, 3.0, 100.0])
    assert [p.coverage for p in pts] == [0.0, 0.4, 0.5, 0.7, 0.7]
    default = energy_budget(m, [0, 1])
    assert default[0].energy_j == 1.0 and default[0].coverage == 0.4
    assert default[-1].energy_j == 3.0 and default[-1].coverage == 0.7
    assert len(default) == 12


def test_no_cost_data_says_so():
    r = route(matrix(), local=["A", "B"], cloud="C", mean_power_w=POWER)
    assert r.oracle.cost_usd is None and r.router.cost_saved_fraction is None
    assert any("no cost data" in n for n in r.notes)


def test_unknown_energy_is_not_guessed():
    energy = ENERGY.copy()
    energy[5, 1] = np.nan  # B solves q5 but its energy is unknown: A (2 J, known) is chosen instead
    q = oracle_queries(matrix(energy=energy), [0, 1], 2)
    assert q.choice[5] == 0
    energy[6, 1] = np.nan  # only B solves q6: it still goes to B, and the energy total becomes unknown
    r = route(matrix(energy=energy), local=["A", "B"], cloud="C", mean_power_w=POWER)
    assert r.oracle.routed_to["B"] == 3
    assert r.oracle.energy_j is None and r.router.energy_saved_fraction is None
    assert r.oracle.latency_s is not None


def test_costlier_local_backend_shows_negative_savings():
    energy = ENERGY.copy()
    energy[:, 2] = 0.5  # the "cloud" is cheaper than every local backend
    o = route(matrix(energy=energy), local=["A", "B"], cloud="C", mean_power_w=POWER).oracle
    assert o.energy_j.saved_fraction < 0


def test_roles_from_records_and_options():
    assert resolve_roles(["a", "b", "c"], ["local", "local", "local"], cloud=["c"]) == ("local", "local", "cloud")
    assert resolve_roles(["a", "b"], ["cloud", "local"], local=["a"]) == ("local", "local")
    with pytest.raises(IpwError, match="no such backend"):
        resolve_roles(["a"], ["local"], cloud=["x"])
    with pytest.raises(IpwError, match="both"):
        resolve_roles(["a"], ["local"], cloud=["a"], local=["a"])


def test_router_accuracy_range():
    o = oracle(matrix(), oracle_queries(matrix(), [0, 1], 2))
    with pytest.raises(IpwError):
        router(o, 1.5)


def _random_matrix(rng, n, n_local):
    m = n_local + 1
    correct = (rng.random((n, m)) < rng.random(m)).astype(float)
    local_e = rng.uniform(0.1, 5.0, (n, n_local))
    cloud_e = local_e.max(axis=1) + rng.uniform(0.0, 20.0, n)  # the cloud costs at least as much as any local
    latency = rng.uniform(0.1, 3.0, (n, m))
    latency[:, -1] = latency[:, :-1].max(axis=1) + rng.uniform(0, 1, n)
    names = tuple(f"b{i}" for i in range(m))
    return QueryMatrix(names, ("estimated",) * m, correct, np.column_stack([local_e, cloud_e]), latency,
                       category=rng.integers(0, 3, n), categories=("x", "y", "z"))


def test_properties_seeded():
    """oracle savings >= router savings >= 0; coverage never falls as the envelope grows; the union
    covers at least as much as any single backend; routed accuracy is at least the cloud's."""
    rng = np.random.default_rng(20261129)
    for _ in range(300):
        n, n_local = int(rng.integers(1, 40)), int(rng.integers(1, 5))
        m = _random_matrix(rng, n, n_local)
        power = list(rng.uniform(1, 100, n_local + 1))
        r = route(m, local=list(m.backends[:-1]), cloud=m.backends[-1], mean_power_w=power,
                  router_accuracy=float(rng.random()))
        oracle_saved = r.oracle.energy_j.saved_fraction
        assert oracle_saved >= -1e-12
        for p in r.router_curve:
            assert oracle_saved + 1e-12 >= p.energy_saved_fraction >= -1e-12
            assert r.oracle.latency_s.saved_fraction + 1e-12 >= p.latency_saved_fraction >= -1e-12
        assert oracle_saved + 1e-12 >= r.router.energy_saved_fraction >= -1e-12
        covs = [p.coverage for p in r.power_envelope]
        assert covs == sorted(covs) and math.isclose(covs[-1], r.local_coverage)
        budget = [p.coverage for p in r.energy_budget]
        assert budget == sorted(budget)
        assert r.local_coverage >= max(r.coverage_by_backend.values())
        assert r.oracle.accuracy >= r.oracle.cloud_accuracy - 1e-12
        assert sum(r.oracle.routed_to.values()) == n
        assert sum(c.n_queries for c in r.by_category) == n


def test_envelope_monotone_for_arbitrary_powers():
    rng = np.random.default_rng(7)
    for _ in range(200):
        m = _random_matrix(rng, int(rng.integers(1, 30)), int(rng.integers(1, 6)))
        local = list(range(len(m.backends) - 1))
        power = rng.choice([1.0, 5.0, 5.0, 50.0, np.nan], size=len(m.backends))
        covs = [p.coverage for p in power_envelope(m, local, power)]
        assert covs == sorted(covs)
        grows = [coverage(m.correct, [i for i in local if power[i] <= p]) for p in np.linspace(0, 60, 13)]
        assert grows == sorted(grows)
