"""The cascade (issue 44, item 3) as pure functions over per-query arrays: answer every query with a local
backend, keep the answer when its confidence (the mean log-probability of its output tokens, which
llama.cpp reports: the records' ``mean_logprob``) is at least a threshold ``t``, else escalate the query to
the cloud reference.

What a cascade costs is measured per query from the run: every query pays the local attempt, and an
escalated one also the cloud's answer.  So, over the queries,

- energy = Σ local energy + Σ_escalated cloud energy; latency and cost likewise (the cloud is asked after the
  local answer is in), each saved against sending every query to the cloud alone;
- accuracy = the local answer's correctness where it was kept, the cloud's where escalated; the loss is the
  cloud-only accuracy minus that.

A local answer with no log-probability (an error, an empty answer) is always escalated.

Scored out of sample: the threshold for a target (at most ``x`` accuracy lost against cloud-only) is chosen
on the training folds of a k-fold split by query (the threshold saving the most energy within the target on
those queries, or no cascade at all, every query straight to the cloud, when none saves any) and applied to
the held-out fold; the numbers are those of the held-out decisions, with 95% bootstrap CIs over queries
(``ipw.analysis.stats``).  The curve over fixed thresholds (quantiles of the observed confidences, chosen
without looking at correctness) is descriptive: reading the best point off it would be choosing in sample.
The AUC says how well the confidence alone separates the local backend's right answers from its wrong ones
(0.5: no better than chance).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ipw.analysis.stats import (LEVEL, EnergyErrors, Estimate, MeasurementError, bootstrap_draws, interval,
                                n_resamples, resample_weights)

if TYPE_CHECKING:
    from ipw.analysis.load import PerQuery

K_FOLDS = 5
MIN_QUERIES = 20  # fewer scored queries: no out-of-sample pick (the curve and the AUC are still shown)
LOSS_TARGETS = (0.0, 0.01, 0.05)  # the accuracy losses against cloud-only the out-of-sample picks stay within
QUANTILES = tuple(round(i / 10, 1) for i in range(10))  # the curve: escalate below these quantiles of confidence
SOLVED_AT = 0.5  # a local answer is right (for the AUC) when its correctness is at least this
_EPS = 1e-12


@dataclass(frozen=True)
class Queries:
    """One local backend and the cloud reference over the same queries (arrays of shape (n,); NaN: unknown;
    ``logprob`` NaN or -inf: no confidence, always escalated)."""

    local: str
    cloud: str
    logprob: np.ndarray
    local_correct: np.ndarray
    cloud_correct: np.ndarray
    local_energy_j: np.ndarray
    cloud_energy_j: np.ndarray
    local_latency_s: np.ndarray
    cloud_latency_s: np.ndarray
    local_cost_usd: np.ndarray | None = None
    cloud_cost_usd: np.ndarray | None = None
    energy_errors: EnergyErrors | None = None  # measurement errors of energy, rows: local, cloud (None: none)

    @property
    def n(self) -> int:
        return len(self.logprob)

    def rows(self, keep: np.ndarray) -> "Queries":
        def sub(x: np.ndarray | None) -> np.ndarray | None:
            return None if x is None else x[keep]

        return Queries(self.local, self.cloud, self.logprob[keep], self.local_correct[keep], self.cloud_correct[keep],
                       self.local_energy_j[keep], self.cloud_energy_j[keep], self.local_latency_s[keep],
                       self.cloud_latency_s[keep], sub(self.local_cost_usd), sub(self.cloud_cost_usd),
                       None if self.energy_errors is None else self.energy_errors.items(keep))


@dataclass(frozen=True)
class Outcome:
    """A cascade's decisions over the queries, measured: shares and savings with their 95% CIs (None: a value
    needed is unknown, e.g. no prices for cost)."""

    local_share: Estimate  # queries answered locally (kept)
    escalated_share: Estimate  # queries sent to the cloud after the local attempt
    accuracy: Estimate
    accuracy_loss: Estimate  # cloud-only accuracy minus the cascade's, over the same queries
    energy_saved_fraction: Estimate | None  # 1 - cascade energy / cloud-only energy
    latency_saved_fraction: Estimate | None
    cost_saved_fraction: Estimate | None


@dataclass(frozen=True)
class CurvePoint:
    quantile: float  # escalate below this quantile of the observed confidences (0: none but those without
    # one; 1.0: every query)
    threshold: float  # escalate when mean_logprob < threshold
    outcome: Outcome


@dataclass(frozen=True)
class Pick:
    """The out-of-sample operating point for one accuracy-loss target."""

    max_accuracy_loss: float
    thresholds: tuple[float | None, ...]  # the threshold chosen on each fold's training queries (None: no cascade)
    outcome: Outcome


@dataclass(frozen=True)
class Cascade:
    local: str
    cloud: str
    n_queries: int  # queries both backends have a score for (the ones evaluated)
    n_without_logprob: int  # of those, local answers without a confidence (always escalated)
    local_accuracy: float  # every query answered locally
    cloud_accuracy: float  # every query to the cloud
    auc: Estimate  # mean_logprob as a predictor of the local answer being right (NaN: one class only)
    curve: tuple[CurvePoint, ...]
    picks: tuple[Pick, ...]  # () when fewer than MIN_QUERIES
    k: int  # folds of the out-of-sample picks
    energy_quality: str = ""  # the worst of the two backends' (estimated energy is labeled so)
    notes: tuple[str, ...] = field(default=())


# --- choosing a threshold -----------------------------------------------------------------------------

def _confidence(logprob: np.ndarray) -> np.ndarray:
    """-inf where there is none (escalated whatever the threshold)."""
    return np.where(np.isfinite(logprob), logprob, -np.inf)


def choose_threshold(q: Queries, max_accuracy_loss: float) -> float | None:
    """The threshold (escalate when mean_logprob < t) that saves the most energy over ``q`` while losing at
    most ``max_accuracy_loss`` of accuracy against cloud-only; None (no cascade: every query straight to the
    cloud) when no threshold saves energy within the loss.  Without known energy for every query, the most
    local answers within the loss are the aim instead.  Ties go to the higher threshold (more escalation)."""
    s = _confidence(q.logprob)
    order = np.argsort(s, kind="stable")
    s = s[order]
    scored = ~np.isnan(q.local_correct) & ~np.isnan(q.cloud_correct)
    cl = np.where(scored, q.local_correct, 0.0)[order]
    cc = np.where(scored, q.cloud_correct, 0.0)[order]
    n_scored = max(int(scored.sum()), 1)
    n = len(s)
    # escalating the k least confident queries (k = 0..n): accuracy and energy by cumulative sums
    cut_cc = np.concatenate([[0.0], np.cumsum(cc)])
    cut_cl = np.concatenate([[0.0], np.cumsum(cl)])
    accuracy = (cut_cc + (cut_cl[-1] - cut_cl)) / n_scored
    loss = cut_cc[-1] / n_scored - accuracy
    energy_known = not (np.isnan(q.local_energy_j).any() or np.isnan(q.cloud_energy_j).any())
    if energy_known:
        ec = q.cloud_energy_j[order]
        gain = ec.sum() - (q.local_energy_j.sum() + np.concatenate([[0.0], np.cumsum(ec)]))
    else:
        gain = (n - np.arange(n + 1)).astype(float)  # local answers kept
    # a cut only between different confidences (equal ones go the same way), and after the answers without
    # one (always escalated)
    k = np.arange(n + 1)
    valid = ((k == 0) | (k == n) | np.concatenate([[True], s[1:] > s[:-1], [True]])) & (k >= np.isneginf(s).sum())
    ok = valid & (loss <= max_accuracy_loss + _EPS)
    if energy_known:
        ok &= gain > 0
    if not ok.any():
        return None
    best = np.flatnonzero(ok & (gain >= gain[ok].max() - _EPS)).max()
    if best == n:
        return float("inf")
    if best == 0 or not np.isfinite(s[best - 1]):
        return float(s[best])
    return float((s[best - 1] + s[best]) / 2)


def kfold(n: int, k: int, seed: int = 0) -> list[np.ndarray]:
    """k folds of the query rows, shuffled with ``seed``."""
    order = np.random.default_rng(seed).permutation(n)
    return [np.sort(f) for f in np.array_split(order, k)]


def out_of_sample(q: Queries, max_accuracy_loss: float, k: int = K_FOLDS,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray, tuple[float | None, ...]]:
    """Each query's decision made by the threshold chosen without it (k-fold by query): whether the local
    backend is asked and whether the query goes to the cloud, and each fold's threshold."""
    attempted, escalated = np.ones(q.n, bool), np.ones(q.n, bool)
    chosen = []
    for test in kfold(q.n, k, seed):
        train = np.setdiff1d(np.arange(q.n), test)
        t = choose_threshold(q.rows(train), max_accuracy_loss)
        chosen.append(t)
        if t is None:
            attempted[test] = False
        else:
            escalated[test] = _confidence(q.logprob[test]) < t
    return attempted, escalated, tuple(chosen)


# --- measuring decisions -----------------------------------------------------------------------------

_COLUMNS = ("one", "kept", "escalated", "scored", "correct", "cloud_correct", "energy", "cloud_energy", "latency",
            "cloud_latency", "cost", "cloud_cost")


def _columns(q: Queries, attempted: np.ndarray, escalated: np.ndarray) -> list[np.ndarray]:
    """The summed columns (``_COLUMNS``) of one policy's decisions; unknown values are 0 here (the outcome
    says None for a saving whose values are not all known)."""
    scored = ~np.isnan(q.local_correct) & ~np.isnan(q.cloud_correct)
    kept = attempted & ~escalated
    to_cloud = ~kept  # escalated, or never attempted

    def spent(local: np.ndarray | None, cloud: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        if local is None or cloud is None:
            return np.zeros(q.n), np.zeros(q.n)
        lx, cx = np.nan_to_num(local), np.nan_to_num(cloud)
        return np.where(attempted, lx, 0.0) + np.where(to_cloud, cx, 0.0), cx

    correct = np.where(kept, q.local_correct, q.cloud_correct)
    cols = [np.ones(q.n), kept.astype(float), (attempted & escalated).astype(float), scored.astype(float),
            np.where(scored, np.nan_to_num(correct), 0.0), np.where(scored, np.nan_to_num(q.cloud_correct), 0.0)]
    for local, cloud in ((q.local_energy_j, q.cloud_energy_j), (q.local_latency_s, q.cloud_latency_s),
                         (q.local_cost_usd, q.cloud_cost_usd)):
        cols += list(spent(local, cloud))
    return cols


def _errors(q: Queries, policies: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[MeasurementError]:
    """The energy columns' measurement errors (compare's rule, ``ipw.analysis.stats``): the spent energy has the
    local backend's where it was asked and the cloud's where the query went there; a shared error of one
    source is one draw for both, and cancels in the saving."""
    if q.energy_errors is None:
        return []
    width, energy, cloud = len(_COLUMNS), _COLUMNS.index("energy"), _COLUMNS.index("cloud_energy")
    out = []
    for p, (attempted, escalated) in enumerate(policies):
        to_cloud = ~(attempted & ~escalated)
        out += q.energy_errors.of(p * width + energy, 0, attempted) + q.energy_errors.of(p * width + energy, 1, to_cloud)
        out += q.energy_errors.of(p * width + cloud, 1)
    return out


def _known(local: np.ndarray | None, cloud: np.ndarray | None) -> bool:
    return local is not None and cloud is not None and not (np.isnan(local).any() or np.isnan(cloud).any())


def measure(q: Queries, policies: Sequence[tuple[np.ndarray, np.ndarray]], *, n_boot: int | None = None,
            seed: int = 0) -> list[Outcome]:
    """Each policy's (attempted, escalated) decisions measured over ``q``, with paired bootstrap CIs (one
    set of resamples of the queries for all of them)."""
    width = len(_COLUMNS)
    cols = [c for attempted, escalated in policies for c in _columns(q, attempted, escalated)]
    draws = bootstrap_draws(cols, n_boot=n_boot or n_resamples(q.n), seed=seed, measurement=_errors(q, policies))
    known = {"energy": _known(q.local_energy_j, q.cloud_energy_j),
             "latency": _known(q.local_latency_s, q.cloud_latency_s),
             "cost": _known(q.local_cost_usd, q.cloud_cost_usd)}
    out = []
    for p in range(len(policies)):
        def col(name: str, at: int = p) -> tuple[float, np.ndarray]:
            i = at * width + _COLUMNS.index(name)
            return float(draws.point_sums[i]), draws.sums[:, i]

        def ratio(num: str, den: str, minus: str | None = None) -> Estimate:
            (a, da), (b, db) = col(num), col(den)
            if minus is not None:
                (c, dc) = col(minus)
                a, da = c - a, dc - da
            with np.errstate(invalid="ignore", divide="ignore"):
                return interval(a / b if b else float("nan"), da / db, LEVEL)

        def saved(what: str) -> Estimate | None:
            if not known[what]:
                return None
            (a, da), (b, db) = col(what), col(f"cloud_{what}")
            with np.errstate(invalid="ignore", divide="ignore"):
                return interval(1 - a / b if b > 0 else float("nan"), 1 - da / db, LEVEL)

        out.append(Outcome(local_share=ratio("kept", "one"), escalated_share=ratio("escalated", "one"),
                           accuracy=ratio("correct", "scored"),
                           accuracy_loss=ratio("correct", "scored", minus="cloud_correct"),
                           energy_saved_fraction=saved("energy"), latency_saved_fraction=saved("latency"),
                           cost_saved_fraction=saved("cost")))
    return out


def auc(score: np.ndarray, right: np.ndarray, *, n_boot: int | None = None, seed: int = 0) -> Estimate:
    """The area under the ROC curve of ``score`` as a predictor of ``right`` (bool), ties counted half
    (Mann-Whitney), with a bootstrap CI over the items (the same resamples as ``measure`` with one seed);
    NaN when one class is missing."""
    score, right = np.asarray(score, float), np.asarray(right, bool)
    n = len(score)
    if n == 0 or right.all() or not right.any():
        return Estimate(float("nan"), float("nan"), float("nan"))
    order = np.argsort(score, kind="stable")
    s, pos = score[order], right[order]
    starts = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]]))

    def area(w: np.ndarray) -> np.ndarray:
        """AUC per row of weights (rows, n) in the sorted order."""
        p = np.add.reduceat(np.where(pos, w, 0.0), starts, axis=1)
        q = np.add.reduceat(np.where(pos, 0.0, w), starts, axis=1)
        below = np.cumsum(q, axis=1) - q
        with np.errstate(invalid="ignore", divide="ignore"):
            out: np.ndarray = (p * (below + q / 2)).sum(axis=1) / (p.sum(axis=1) * q.sum(axis=1))
        return out

    value = float(area(np.ones((1, n)))[0])
    draws = np.concatenate([area(w[:, order].astype(float)) for w in resample_weights(n, n_boot or n_resamples(n),
                                                                                       seed=seed)])
    return interval(value, draws, LEVEL)


# --- the whole evaluation ----------------------------------------------------------------------------

def evaluate(q: Queries, *, k: int = K_FOLDS, targets: Sequence[float] = LOSS_TARGETS, n_boot: int | None = None,
             seed: int = 0, energy_quality: str = "") -> Cascade:
    """The cascade of ``q.local`` in front of ``q.cloud``: the curve over fixed thresholds, the out-of-sample
    picks for each accuracy-loss target, and the AUC of the confidence (module docstring)."""
    notes = []
    scored = ~np.isnan(q.local_correct) & ~np.isnan(q.cloud_correct)
    if not scored.all():
        notes.append(f"cascade {q.local}: {int((~scored).sum())} queries without a score from both backends left out")
        q = q.rows(scored)
    s = _confidence(q.logprob)
    finite = s[np.isfinite(s)]
    missing = int(q.n - len(finite))
    if missing:
        notes.append(f"cascade {q.local}: {missing} local answers without a mean_logprob (errors, or an engine "
                     "not asked) are always escalated")
    # the curve: escalate below quantiles of the confidences; the last point escalates every query
    grid = [(p, float(np.quantile(finite, p, method="inverted_cdf")) if len(finite) else -np.inf) for p in QUANTILES]
    grid = [(p, t) for i, (p, t) in enumerate(grid) if i == 0 or t != grid[i - 1][1]]  # few queries: ties
    grid.append((1.0, np.inf))
    policies = [(np.ones(q.n, bool), s < t) for _, t in grid]
    picks_raw = []
    k_used = min(k, q.n)
    if q.n >= MIN_QUERIES:
        for target in targets:
            attempted, escalated, chosen = out_of_sample(q, target, k_used, seed)
            picks_raw.append((target, chosen))
            policies.append((attempted, escalated))
    else:
        notes.append(f"cascade {q.local}: {q.n} scored queries, fewer than the {MIN_QUERIES} an out-of-sample "
                     "threshold needs: the curve and the AUC only")
    outcomes = measure(q, policies, n_boot=n_boot, seed=seed) if q.n else []
    curve = tuple(CurvePoint(p, t, o) for (p, t), o in zip(grid, outcomes))
    picks = tuple(Pick(target, chosen, o) for (target, chosen), o in zip(picks_raw, outcomes[len(grid):]))
    right = q.local_correct >= SOLVED_AT
    has = np.isfinite(s)
    return Cascade(local=q.local, cloud=q.cloud, n_queries=q.n, n_without_logprob=missing,
                   local_accuracy=_mean(q.local_correct), cloud_accuracy=_mean(q.cloud_correct),
                   auc=auc(s[has], right[has], n_boot=n_boot, seed=seed), curve=curve, picks=picks, k=k_used,
                   energy_quality=energy_quality, notes=tuple(notes))


def _mean(x: np.ndarray) -> float:
    known = x[~np.isnan(x)]
    return float(known.mean()) if len(known) else float("nan")


def cascades(pq: PerQuery, labels: Sequence[str], qualities: Sequence[str], local: Sequence[int], cloud: int,
             cost: np.ndarray | None = None, *, n_boot: int | None = None, seed: int = 0) -> tuple[Cascade, ...]:
    """The cascade of each local backend (rows ``local`` of ``ipw.analysis.load``'s per-query matrix) whose
    records carry a ``mean_logprob``, in front of the cloud reference (row ``cloud``); ``cost`` (backends x
    queries, USD) as ``ipw compare`` prices them."""
    from ipw.telemetry.base import QUALITY_ORDER, worst_quality

    from ipw.analysis.load import energy_errors

    if pq.mean_logprob is None:
        return ()
    errors = energy_errors(pq)
    out = []
    for j in local:
        if np.isnan(pq.mean_logprob[j]).all():
            continue
        q = Queries(labels[j], labels[cloud], pq.mean_logprob[j], pq.correct[j], pq.correct[cloud], pq.energy_j[j],
                    pq.energy_j[cloud], pq.latency_s[j], pq.latency_s[cloud],
                    None if cost is None else cost[j], None if cost is None else cost[cloud],
                    None if errors is None else errors.rows([j, cloud]))
        quality = worst_quality([x for x in (qualities[j], qualities[cloud]) if x in QUALITY_ORDER])
        out.append(evaluate(q, n_boot=n_boot, seed=seed, energy_quality=quality))
    return tuple(out)
