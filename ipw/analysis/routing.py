"""Routing and coverage (docs/ARCHITECTURE.md, 'Energy readings and the metric contract') as pure functions over a per-query matrix.

The matrix holds, for n queries (rows) and m backends (columns), each backend's correctness (0..1,
repeats averaged; NaN: unscored), energy (J), latency (s) and, where known, cost (USD) and win/tie
against a reference backend's answer (NaN: not judged). A backend *solves* a query when its
correctness is at least ``SOLVED_AT`` (with one repeat: when it answered correctly).

- coverage of a set of backends: share of the scored queries (a score from one of them) at least one
  of them solves; beside it, win/tie coverage: share of the judged queries on which at least one of
  them wins or ties against the reference backend's answer (a query is judged when one of them is);
- oracle routing: each query goes to the lowest-energy local backend that solves it, else to the cloud
  reference; energy, latency and cost saved are reported against sending every query to the cloud;
- the α-router makes the oracle's choice with probability α and otherwise sends the query to the
  cloud, so its expected savings are exactly α × the oracle's;
- per-watt coverage: coverage using only local backends whose mean power fits a power envelope, and
  coverage within a per-query energy budget.

Energy of different qualities is never summed silently: routed totals carry the worst quality of the
backends they include, and the routed energy is also broken down by quality.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, cast

import numpy as np

from ipw.errors import ParameterError
from ipw.telemetry.base import QUALITY_ORDER, worst_quality

ROUTER_ACCURACY = 0.8  # α of the realistic router, when none is given (compare --router-accuracy)
SOLVED_AT = 0.5
ROLES = ("local", "cloud")
ALPHAS = tuple(round(a / 10, 1) for a in range(11))


@dataclass(frozen=True)
class QueryMatrix:
    """Per-query results: arrays of shape (n_queries, n_backends), NaN where a value is unknown."""

    backends: tuple[str, ...]
    energy_quality: tuple[str, ...]  # per backend: the worst quality among its records
    correct: np.ndarray
    energy_j: np.ndarray
    latency_s: np.ndarray
    cost_usd: np.ndarray | None = None  # None: no cost data at all
    category: np.ndarray | None = None  # (n_queries,) int code of each query's category; None: one category
    categories: tuple[str, ...] = ("",)  # the names of the codes
    win_tie: np.ndarray | None = None  # None: no query judged against a reference backend

    @property
    def n_queries(self) -> int:
        return int(self.correct.shape[0])

    def index(self, name: str) -> int:
        return self.backends.index(name)


@dataclass(frozen=True)
class Saving:
    """A total over the queries for cloud-only and for routed, in one unit (J, s or USD)."""

    cloud_only: float
    routed: float
    saved: float
    saved_fraction: float  # saved / cloud_only


@dataclass(frozen=True)
class OracleQueries:
    """The oracle's choice per query and what it yields (arrays of shape (n_queries,))."""

    cloud: int  # column of the cloud reference
    choice: np.ndarray  # column index of the backend each query goes to
    scored: np.ndarray  # bool: a local backend or the cloud has a score for the query
    covered: np.ndarray  # bool: a local backend solves the query
    judged: np.ndarray  # bool: a local backend's answer was judged against the reference's
    win_covered: np.ndarray  # bool: a local backend wins or ties against the reference's answer
    correct: np.ndarray
    energy_j: np.ndarray
    latency_s: np.ndarray
    cost_usd: np.ndarray | None
    cloud_correct: np.ndarray
    cloud_energy_j: np.ndarray
    cloud_latency_s: np.ndarray
    cloud_cost_usd: np.ndarray | None


@dataclass(frozen=True)
class Oracle:
    routed_to: dict[str, int]  # queries per backend
    accuracy: float  # routed accuracy (scored queries)
    cloud_accuracy: float
    energy_j: Saving | None  # None when some needed energy is unknown
    latency_s: Saving | None
    cost_usd: Saving | None  # None when cost is not known for every backend involved
    energy_quality: str  # worst quality among the cloud and the backends queries are routed to
    routed_energy_by_quality_j: dict[str, float]


@dataclass(frozen=True)
class RouterPoint:
    """Expected results of a router that makes the oracle's choice with probability ``alpha``."""

    alpha: float
    accuracy: float
    energy_saved_fraction: float | None
    latency_saved_fraction: float | None
    cost_saved_fraction: float | None


@dataclass(frozen=True)
class EnvelopePoint:
    power_w: float
    backends: tuple[str, ...]  # local backends whose mean power is <= power_w
    coverage: float


@dataclass(frozen=True)
class BudgetPoint:
    energy_j: float
    coverage: float  # share of the scored queries some local backend solves within energy_j


@dataclass(frozen=True)
class Coverage:
    """Local coverage both ways: (a) correct against the dataset's answer, over the scored queries, and
    (b) a win or tie against the reference backend's answer, over the judged queries."""

    local_coverage: float
    n_scored: int
    win_tie_coverage: float
    n_judged: int


@dataclass(frozen=True)
class CategoryRouting:
    category: str
    n_queries: int
    coverage: Coverage
    cloud_accuracy: float
    oracle_accuracy: float
    energy_saved_fraction: float | None
    latency_saved_fraction: float | None
    cost_saved_fraction: float | None

    @property
    def local_coverage(self) -> float:
        return self.coverage.local_coverage


@dataclass(frozen=True)
class Routing:
    cloud: str
    local: tuple[str, ...]
    cloud_is_stand_in: bool  # no backend has role cloud: the reference stands in for it
    n_queries: int
    coverage: Coverage
    win_tie_vs: str  # the reference backend(s) of the win/tie judgments ("": none judged)
    coverage_by_backend: dict[str, float]
    oracle: Oracle
    router: RouterPoint
    router_curve: tuple[RouterPoint, ...]
    power_envelope: tuple[EnvelopePoint, ...]
    energy_budget: tuple[BudgetPoint, ...]
    by_category: tuple[CategoryRouting, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def local_coverage(self) -> float:
        return self.coverage.local_coverage


def resolve_roles(backends: Sequence[str], roles: Sequence[str], *, local: Sequence[str] = (),
                  cloud: Sequence[str] = ()) -> tuple[str, ...]:
    """Roles per backend: the recorded ones, overridden by the names in ``local`` / ``cloud``."""
    out = [r if r in ROLES else "local" for r in roles]
    both = set(local) & set(cloud)
    if both:
        raise ParameterError(("local", "cloud"), "", before=f"backend {sorted(both)[0]!r} is given both ")
    for names, role in ((local, "local"), (cloud, "cloud")):
        for name in names:
            if name not in backends:
                raise ParameterError((role,), f" {name!r}: no such backend (backends: {', '.join(backends)})")
            out[list(backends).index(name)] = role
    return tuple(out)


def solved(correct: np.ndarray) -> np.ndarray:
    return np.asarray(correct) >= SOLVED_AT


def coverage(correct: np.ndarray, columns: Sequence[int]) -> float:
    """Share of the scored queries (one of ``columns`` has a score) that at least one of ``columns`` solves."""
    if len(correct) == 0:
        return float("nan")
    if not len(columns):
        return 0.0
    sub = correct[:, list(columns)]
    return _share(cast(np.ndarray, solved(sub).any(axis=1)), scored_rows(correct, columns))


def scored_rows(correct: np.ndarray, columns: Sequence[int]) -> np.ndarray:
    """The queries one of ``columns`` has a score for (none: a judge-only item no judge graded)."""
    if not len(columns):
        return np.zeros(len(correct), bool)
    return cast(np.ndarray, ~np.isnan(correct[:, list(columns)]).all(axis=1))


def _share(hit: np.ndarray, among: np.ndarray) -> float:
    """Share of the ``among`` rows that ``hit`` (NaN when there are none)."""
    return float(hit[among].mean()) if among.any() else float("nan")


def coverage_of(q: "OracleQueries", rows: np.ndarray | slice = slice(None)) -> Coverage:
    """Both coverages of the oracle's local backends over ``rows``."""
    scored, judged = q.scored[rows], q.judged[rows]
    return Coverage(_share(q.covered[rows], scored), int(scored.sum()), _share(q.win_covered[rows], judged),
                    int(judged.sum()))


def oracle_queries(m: QueryMatrix, local: Sequence[int], cloud: int) -> OracleQueries:
    """Each query to the lowest-energy local backend that solves it, else to the cloud reference.

    A solving backend with unknown energy ranks after those with known energy; ties go to the backend
    listed first.
    """
    local = list(local)
    n = m.n_queries
    judged: np.ndarray
    win_covered: np.ndarray
    judged = win_covered = np.zeros(n, bool)
    if local:
        ok = solved(m.correct[:, local])
        energy = m.energy_j[:, local]
        rank = np.where(ok, np.where(np.isnan(energy), np.finfo(float).max, energy), np.inf)
        covered = cast(np.ndarray, ok.any(axis=1))
        choice = np.where(covered, np.asarray(local)[rank.argmin(axis=1)], cloud)
        if m.win_tie is not None:
            win = m.win_tie[:, local]
            judged, win_covered = ~np.isnan(win).all(axis=1), cast(np.ndarray, (win >= SOLVED_AT).any(axis=1))
    else:
        covered, choice = np.zeros(n, bool), np.full(n, cloud)
    scored = scored_rows(m.correct, local)
    rows = np.arange(n)

    def pick(x: Any) -> Any:
        return None if x is None else x[rows, choice]

    return OracleQueries(
        cloud=cloud, choice=choice, scored=scored, covered=covered, judged=judged, win_covered=win_covered,
        correct=pick(m.correct), energy_j=pick(m.energy_j),
        latency_s=pick(m.latency_s), cost_usd=pick(m.cost_usd), cloud_correct=m.correct[:, cloud],
        cloud_energy_j=m.energy_j[:, cloud], cloud_latency_s=m.latency_s[:, cloud],
        cloud_cost_usd=None if m.cost_usd is None else m.cost_usd[:, cloud],
    )


def saving(cloud_only: np.ndarray | None, routed: np.ndarray | None) -> Saving | None:
    """Totals and savings; None when a value needed is unknown (NaN) or there is no data."""
    if cloud_only is None or routed is None or np.isnan(cloud_only).any() or np.isnan(routed).any():
        return None
    c, r = float(cloud_only.sum()), float(routed.sum())
    return Saving(c, r, c - r, (c - r) / c if c else float("nan"))


def _fraction(s: Saving | None) -> float | None:
    return None if s is None else s.saved_fraction


def oracle(m: QueryMatrix, q: OracleQueries) -> Oracle:
    """Totals of the oracle's routing against cloud-only."""
    counts = np.bincount(q.choice, minlength=len(m.backends))
    used = [i for i in range(len(m.backends)) if counts[i]]
    by_quality: dict[str, float] = {}
    if not np.isnan(q.energy_j).any():
        for i in used:
            key = m.energy_quality[i]
            by_quality[key] = by_quality.get(key, 0.0) + float(q.energy_j[q.choice == i].sum())
    return Oracle(
        routed_to={m.backends[i]: int(counts[i]) for i in used},
        accuracy=_mean(q.correct),
        cloud_accuracy=_mean(q.cloud_correct),
        energy_j=saving(q.cloud_energy_j, q.energy_j),
        latency_s=saving(q.cloud_latency_s, q.latency_s),
        cost_usd=saving(q.cloud_cost_usd, q.cost_usd),
        energy_quality=worst_quality([m.energy_quality[i] for i in {q.cloud, *used}
                                      if m.energy_quality[i] in QUALITY_ORDER]),
        routed_energy_by_quality_j=by_quality,
    )


def _mean(x: np.ndarray) -> float:
    """Mean of the known (scored) values; NaN when none is known."""
    known = x[~np.isnan(x)]
    return float(known.mean()) if len(known) else float("nan")


def router(o: Oracle, alpha: float) -> RouterPoint:
    """The α-router: oracle's choice with probability α, else the cloud. Savings = α × oracle savings."""
    if not 0.0 <= alpha <= 1.0:
        raise ParameterError(("router_accuracy",), f" {alpha}: must be between 0 and 1")

    def scaled(s: Saving | None) -> float | None:
        return None if s is None else alpha * s.saved_fraction

    return RouterPoint(alpha, alpha * o.accuracy + (1 - alpha) * o.cloud_accuracy, scaled(o.energy_j),
                       scaled(o.latency_s), scaled(o.cost_usd))


def power_envelope(m: QueryMatrix, local: Sequence[int], mean_power_w: Sequence[float]) -> tuple[EnvelopePoint, ...]:
    """Coverage using only the local backends whose mean power is <= P, at each backend's mean power."""
    known = [i for i in local if np.isfinite(mean_power_w[i])]
    points = []
    for p in sorted({float(mean_power_w[i]) for i in known}):
        fits = [i for i in known if mean_power_w[i] <= p]
        points.append(EnvelopePoint(p, tuple(m.backends[i] for i in fits), coverage(m.correct, fits)))
    return tuple(points)


def best_local_energy(m: QueryMatrix, local: Sequence[int]) -> np.ndarray:
    """Per query, the least energy with which a local backend solves it (inf: none does, or unknown)."""
    if not len(local):
        return np.full(m.n_queries, np.inf)
    e = np.where(solved(m.correct[:, list(local)]), m.energy_j[:, list(local)], np.inf)
    best: np.ndarray = np.where(np.isnan(e), np.inf, e).min(axis=1)
    return best


def energy_budget(m: QueryMatrix, local: Sequence[int], budgets_j: Sequence[float] | np.ndarray | None = None,
                  n_points: int = 12) -> tuple[BudgetPoint, ...]:
    """Coverage within a per-query energy budget; by default at ``n_points`` log-spaced budgets from
    the least to the greatest energy any local backend needed for a query it solved."""
    best = best_local_energy(m, local)
    finite = np.sort(best[np.isfinite(best)])
    if budgets_j is None:
        if not len(finite):
            return ()
        lo, hi = float(finite[0]), float(finite[-1])
        grid = np.geomspace(lo, hi, n_points) if lo > 0 else np.linspace(lo, hi, n_points)
        grid[0], grid[-1] = lo, hi
        budgets_j = np.unique(np.clip(grid, lo, hi))
    n = max(int(scored_rows(m.correct, local).sum()), 1)
    return tuple(BudgetPoint(float(b), float(np.searchsorted(finite, b, side="right") / n)) for b in budgets_j)


def by_category(m: QueryMatrix, q: OracleQueries) -> tuple[CategoryRouting, ...]:
    codes = np.zeros(m.n_queries, int) if m.category is None else m.category
    out = []
    for code, name in sorted(enumerate(m.categories), key=lambda x: x[1]):
        rows = codes == code
        if not rows.any():
            continue
        def sub(x: np.ndarray | None) -> np.ndarray | None:
            return None if x is None else x[rows]

        out.append(CategoryRouting(
            category=name, n_queries=int(rows.sum()), coverage=coverage_of(q, rows),
            cloud_accuracy=_mean(q.cloud_correct[rows]),
            oracle_accuracy=_mean(q.correct[rows]),
            energy_saved_fraction=_fraction(saving(sub(q.cloud_energy_j), sub(q.energy_j))),
            latency_saved_fraction=_fraction(saving(sub(q.cloud_latency_s), sub(q.latency_s))),
            cost_saved_fraction=_fraction(saving(sub(q.cloud_cost_usd), sub(q.cost_usd))),
        ))
    return tuple(out)


def route(m: QueryMatrix, *, local: Sequence[str], cloud: str, mean_power_w: Sequence[float],
          router_accuracy: float = ROUTER_ACCURACY, cloud_is_stand_in: bool = False, win_tie_vs: str = "") -> Routing:
    """Every routing number for ``local`` backends against the ``cloud`` reference."""
    li = [m.index(name) for name in local]
    ci = m.index(cloud)
    q = oracle_queries(m, li, ci)
    o = oracle(m, q)
    notes = []
    if cloud_is_stand_in:
        notes.append(f"no backend has role cloud: routing uses the reference {cloud!r} as the cloud "
                     "(set roles with --cloud/--local)")
    if o.energy_j is None:
        notes.append("energy saved: unknown (some queries of the cloud or of a routed local backend have no energy)")
    if o.cost_usd is None:
        notes.append("cost: no cost data (give --usd-per-kwh for local energy and --api-price for cloud backends)"
                     if m.cost_usd is None else "cost saved: unknown (a backend involved has no price)")
    qualities = sorted({m.energy_quality[i] for i in {ci, *np.unique(q.choice).tolist()}})
    if len(qualities) > 1:
        notes.append(f"routing compares energy of qualities {', '.join(qualities)}: the energy saved is labeled "
                     f"{o.energy_quality!r} (the worst); routed_energy_by_quality_j keeps them apart")
    return Routing(
        cloud=cloud, local=tuple(local), cloud_is_stand_in=cloud_is_stand_in, n_queries=m.n_queries,
        coverage=coverage_of(q), win_tie_vs=win_tie_vs,
        coverage_by_backend={m.backends[i]: coverage(m.correct, [i]) for i in li},
        oracle=o, router=router(o, router_accuracy),
        router_curve=tuple(router(o, a) for a in sorted(set(ALPHAS) | {router_accuracy})),
        power_envelope=power_envelope(m, li, mean_power_w),
        energy_budget=energy_budget(m, li),
        by_category=by_category(m, q),
        notes=tuple(notes),
    )
