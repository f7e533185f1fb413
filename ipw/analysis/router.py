"""A deployable router (issue 44; docs/ROUTING.md): trained on a run's own records, scored out of sample.

Per local backend, a logistic regression (scikit-learn) predicts from the prompt alone whether that backend
answers as well as the cloud reference: correct against the dataset's answer (``grading="answer"``), or a
win/tie against the reference's answer where a judge graded the records (``grading="vs-backend"``). The
features need nothing the user lacks offline: hashed word 1-2 grams of the prompt (``HashingVectorizer``:
no vocabulary to keep), the log of the prompt's length, and a one-hot of the query's category when the
training runs have categories. A query goes to the cheapest local backend (lowest mean J/query in the
training runs) whose predicted probability is at least the threshold, else to the cloud.

Scoring never uses a query a model was trained on: k-fold by query (the per-query matrix of
``ipw.analysis.load`` has one row per query, its repeats averaged and its concurrency levels aligned, so a
query's repeats never straddle folds), and held-out categories (each category predicted by a model trained
on the others: the out-of-distribution case). Over a grid of thresholds the out-of-fold predictions give
the share routed locally, the routed accuracy and the energy, latency and cost saved against cloud-only
(measured per query, as the oracle's in ``ipw.analysis.routing``), with 95% bootstrap CIs over queries;
APGR (RouteLLM), the local share that keeps 50% and 80% of the cloud's accuracy gap, and the AUC.

The router file is JSON (never pickle): ``FORMAT``, the ipw version, the date, the hashing parameters, each
classifier's intercept and non-zero coefficients, the default threshold, and what it was trained on.
sklearn is imported lazily (the ``route`` extra).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ipw.analysis.stats import EnergyErrors, Estimate
from ipw.errors import IpwError

FORMAT = "ipw-router"
FORMAT_VERSION = 1
N_FEATURES = 2 ** 18
NGRAM_RANGE = (1, 2)
FEATURES = ("ngrams", "log_length", "category")  # the features this version knows
DEFAULT_THRESHOLD = 0.5
MIN_QUERIES = 20
K_FOLDS = 5
C = 1.0  # inverse regularisation strength of the logistic regressions
THRESHOLDS = tuple(round(i * 0.05, 2) for i in range(21))
GRADINGS = ("answer", "vs-backend")
GAP_EPS = 0.01  # a cloud-over-local accuracy gap below this: APGR is not defined (stated)
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")  # what ipw serve keeps of a prompt without --log-prompts


def sklearn_modules() -> tuple[Any, Any, Any]:
    """(HashingVectorizer, LogisticRegression, roc_auc_score), or an IpwError naming the extra."""
    try:
        from sklearn.feature_extraction.text import HashingVectorizer
        from sklearn.linear_model import LogisticRegression
        from sklearn.metrics import roc_auc_score
    except ImportError:
        raise IpwError("scikit-learn is not installed (ipw route needs it); install it with: "
                       "pip install 'ipw[route]'") from None
    return HashingVectorizer, LogisticRegression, roc_auc_score


def check_threshold(value: float, option: str = "--router-threshold") -> float:
    if not (isinstance(value, (int, float)) and 0.0 <= float(value) <= 1.0):
        raise IpwError(f"{option} {value}: must be between 0 and 1")
    return float(value)


def parse_accuracy_loss(text: str | float, option: str = "--max-accuracy-loss") -> float:
    """``1%``, ``1pp`` or ``0.01``: an accuracy loss as a fraction (0..1)."""
    raw = str(text).strip()
    try:
        value = float(raw[:-2]) / 100 if raw.endswith("pp") else float(raw[:-1]) / 100 if raw.endswith("%") \
            else float(raw)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:
        raise IpwError(f"{option} {text!r}: expected a loss like 1% (or 0.01), between 0 and 100%")
    return value


# --- the data a router is trained and scored on -------------------------------------------------------

@dataclass(frozen=True)
class RouteData:
    """Per query (rows) and local backend (columns, cheapest first): what training and scoring need."""

    query_id: tuple[str, ...]
    prompts: tuple[str, ...]
    category: tuple[str, ...]  # "" where a query has none
    local: tuple[str, ...]  # local backends' labels, by mean J/query ascending
    cloud: str
    grading: str
    label: np.ndarray  # (n, L): 1 the backend answers as well as the cloud, 0 not, NaN unknown
    correct: np.ndarray  # (n, L) correctness against the dataset's answer (NaN: unscored)
    energy_j: np.ndarray  # (n, L)
    latency_s: np.ndarray  # (n, L)
    cloud_correct: np.ndarray  # (n,)
    cloud_energy_j: np.ndarray  # (n,)
    cloud_latency_s: np.ndarray  # (n,)
    cost_usd: np.ndarray | None = None  # (n, L); None: no prices
    cloud_cost_usd: np.ndarray | None = None
    trained_on: dict[str, Any] = field(default_factory=dict)  # runs, backends, hardware (the router file's)
    # the energies' measurement errors, rows: the local backends (as ``local``), then the cloud; None: none stated
    energy_errors: EnergyErrors | None = None

    @property
    def n(self) -> int:
        return len(self.prompts)

    @property
    def has_categories(self) -> bool:
        return any(self.category)


def _prompts_of(path: str) -> tuple[dict[str, str], list[str]]:
    """A run's prompt per query id, and the hardware ids / nodes its records name."""
    from ipw.results import load_run

    _, frame = load_run(path, columns=["query_id", "prompt", "hardware_id", "node"])
    first = frame.drop_duplicates("query_id")
    prompts = {str(q): (p if isinstance(p, str) else "") for q, p in zip(first["query_id"], first["prompt"])}  # null: NaN
    hardware = sorted({str(x) for col in ("hardware_id", "node") for x in frame[col].dropna() if str(x)})
    return prompts, hardware


def route_data(paths: Sequence[str | Path], *, local: Sequence[str] = (), cloud: Sequence[str] = (),
               grading: str = "answer", common_queries: bool = False, usd_per_kwh: float | None = None,
               api_prices: Sequence[str] = (), energy_basis: str = "chip", pue: Sequence[str] = ()) -> RouteData:
    """Read run folders into a ``RouteData``: roles from the records, overridden by ``local``/``cloud``.
    ``usd_per_kwh`` and ``api_prices`` (``NAME=IN,OUT``) price the queries as ``ipw compare`` does;
    ``energy_basis`` and ``pue`` (``NAME=PUE``) put their energy on compare's basis (``ipw.analysis.basis``)."""
    from ipw.analysis.basis import parse_pue, under_basis, with_pue
    from ipw.analysis.compare import _reference, cost_matrix, parse_api_price, resolve_levels
    from ipw.analysis.load import BackendInfo, energy_errors, load
    from ipw.analysis.routing import SOLVED_AT, resolve_roles

    if grading not in GRADINGS:
        raise IpwError(f"--grading {grading!r}: must be one of {', '.join(GRADINGS)}")
    prices_raw = [parse_api_price(p) for p in api_prices]
    runs, infos, pq, _ = load(paths, common_queries=common_queries, prompt_tokens=bool(prices_raw))
    labels = tuple(i.label for i in infos)

    def names(xs: Sequence[str], opt: str) -> list[str]:
        return [x for n_ in xs for x in resolve_levels(n_, infos, opt)]

    roles = resolve_roles(labels, [i.role for i in infos], local=names(local, "--local"), cloud=names(cloud, "--cloud"))
    if "cloud" not in roles:
        raise IpwError("the runs have no cloud reference (no backend has role cloud): name one with --cloud NAME "
                       f"(backends: {', '.join(labels)})")
    infos = tuple(BackendInfo(**{**i.__dict__, "role": r}) for i, r in zip(infos, roles))
    infos = with_pue(infos, [parse_pue(x) for x in pue], lambda name: names([name], "--pue"))
    pq, _ = under_basis(pq, infos, energy_basis)
    ref, _ = _reference(None, infos, roles)
    ri = labels.index(ref)
    prices = {x: (pin, pout) for n_, pin, pout in prices_raw for x in names([n_], "--api-price")}
    cost = cost_matrix(pq, labels, roles, usd_per_kwh, prices)
    li = [j for j in range(len(infos)) if roles[j] == "local"
          and (infos[j].run_id, infos[j].backend) != (infos[ri].run_id, infos[ri].backend)]
    if not li:
        raise IpwError("the runs have no local backend besides the cloud reference: name them with --local NAME")
    mean_j = [float(np.nanmean(pq.energy_j[j])) if not np.isnan(pq.energy_j[j]).all() else math.inf for j in li]
    li = [j for _, j in sorted(zip(mean_j, li), key=lambda x: x[0])]  # cheapest first (stable)
    qids = [str(q) for q in pq.query_id]
    prompts: dict[str, str] = {}
    hardware: set[str] = set()
    for run in runs:
        p, h = _prompts_of(run.path)
        for k, v in p.items():
            prompts.setdefault(k, v)
        hardware.update(h)
    texts = tuple(prompts.get(q, "") for q in qids)
    unknown = sum(1 for p in texts if not p or DIGEST.fullmatch(p))
    if unknown:  # a router learns from the prompt's words: a digest (or nothing) would train it on no text
        raise IpwError(f"the runs: {unknown} of {len(texts)} queries have no prompt text (none kept, or only its "
                       "sha256 digest, as ipw serve keeps it without --log-prompts): a router learns from the "
                       "prompts' words; record them with the prompts kept (ipw serve --log-prompts)")
    cat = tuple(pq.categories[c] if c < len(pq.categories) else "" for c in pq.category)
    if grading == "vs-backend":
        if pq.win_tie is None or np.isnan(pq.win_tie[li]).all():
            raise IpwError("--grading vs-backend: no record of the local backends was judged against a reference "
                           "backend's answer (ipw run --judge ... --grading vs-backend)")
        raw = pq.win_tie[li].T
    else:
        raw = pq.correct[li].T
    label = np.where(np.isnan(raw), np.nan, (raw >= SOLVED_AT).astype(float))
    trained_on = {
        "runs": [{"run_id": r.run_id, "path": r.path, "dataset": r.dataset, "fingerprint": r.fingerprint,
                  "status": r.status} for r in runs],
        "backends": [{"label": infos[j].label, "backend": infos[j].backend, "model": infos[j].model,
                      "role": "cloud" if j == ri else "local", "run_id": infos[j].run_id,
                      "energy_per_query_j": None if not np.isfinite(np.nanmean(pq.energy_j[j]))
                      else float(np.nanmean(pq.energy_j[j]))}
                     for j in [*li, ri]],
        "hardware": sorted(hardware),
        "machines": [m for r in runs for m in r.machines],
        "n_queries": len(qids),
        "grading": grading,
    }
    errors = energy_errors(pq)
    return RouteData(
        energy_errors=None if errors is None else errors.rows([*li, ri]),
        query_id=tuple(qids), prompts=texts, category=cat,
        local=tuple(labels[j] for j in li), cloud=ref, grading=grading, label=label,
        correct=pq.correct[li].T, energy_j=pq.energy_j[li].T, latency_s=pq.latency_s[li].T,
        cloud_correct=pq.correct[ri], cloud_energy_j=pq.energy_j[ri], cloud_latency_s=pq.latency_s[ri],
        cost_usd=None if cost is None else cost[li].T, cloud_cost_usd=None if cost is None else cost[ri],
        trained_on=trained_on)


# --- features and the classifiers -------------------------------------------------------------------

@dataclass(frozen=True)
class Featurizer:
    """Hashed word n-grams + log prompt length + a category one-hot (``categories``: () none)."""

    categories: tuple[str, ...] = ()
    n_features: int = N_FEATURES
    ngram_range: tuple[int, int] = NGRAM_RANGE

    @property
    def width(self) -> int:
        return self.n_features + 1 + len(self.categories)

    def vectorizer(self) -> Any:
        hashing, _, _ = sklearn_modules()
        return hashing(n_features=self.n_features, ngram_range=self.ngram_range, lowercase=True,
                       alternate_sign=False, norm="l2", analyzer="word")

    def transform(self, prompts: Sequence[str], categories: Sequence[str | None] | None = None,
                  vectorizer: Any = None) -> Any:
        import scipy.sparse as sp

        text = (vectorizer or self.vectorizer()).transform(list(prompts))
        length = np.log1p(np.array([len(p) for p in prompts], float))[:, None] / 10.0
        parts = [text, sp.csr_matrix(length)]
        if self.categories:
            onehot = np.zeros((len(prompts), len(self.categories)))
            for i, c in enumerate(categories or [None] * len(prompts)):
                if c in self.categories:
                    onehot[i, self.categories.index(c)] = 1.0
            parts.append(sp.csr_matrix(onehot))
        return sp.hstack(parts, format="csr")

    def to_json(self) -> dict[str, Any]:
        return {"kind": "sklearn.HashingVectorizer", "n_features": self.n_features,
                "ngram_range": list(self.ngram_range), "analyzer": "word", "lowercase": True,
                "alternate_sign": False, "norm": "l2", "extra": ["log_length"],
                "log_length": "log1p(len(prompt in characters)) / 10",
                "categories": list(self.categories), "features": [f for f in FEATURES
                                                                   if f != "category" or self.categories]}


@dataclass(frozen=True)
class Linear:
    """One backend's classifier: P(answers as well as the cloud) = sigmoid(intercept + x . coef)."""

    intercept: float
    coef: np.ndarray  # dense, length Featurizer.width

    def proba(self, x: Any) -> np.ndarray:
        z = np.asarray(x @ self.coef).reshape(-1) + self.intercept
        out: np.ndarray = 1.0 / (1.0 + np.exp(-np.clip(z, -500, 500)))
        return out


def fit(x: Any, y: np.ndarray, width: int, c: float = C) -> Linear:
    """A balanced logistic regression on rows with a known label; one class only: a constant at its rate."""
    _, logistic, _ = sklearn_modules()
    known = ~np.isnan(y)
    yk = y[known]
    if len(yk) == 0 or yk.min() == yk.max():
        rate = float(yk.mean()) if len(yk) else 0.0
        rate = min(max(rate, 1e-6), 1 - 1e-6)
        return Linear(math.log(rate / (1 - rate)), np.zeros(width))
    model = logistic(C=c, class_weight="balanced", max_iter=1000, solver="liblinear")
    model.fit(x[known], yk.astype(int))
    return Linear(float(model.intercept_[0]), np.asarray(model.coef_[0], float))


def predict_folds(data: RouteData, folds: Sequence[np.ndarray], featurizer: Featurizer, c: float = C) -> np.ndarray:
    """Out-of-fold probabilities (n, L): each fold's rows predicted by models trained on the other rows."""
    x = featurizer.transform(data.prompts, data.category)
    p = np.full(data.label.shape, np.nan)
    rows = np.arange(data.n)
    for test in folds:
        train = np.setdiff1d(rows, test)
        for b in range(len(data.local)):
            p[test, b] = fit(x[train], data.label[train, b], featurizer.width, c).proba(x[test])
    return p


def kfold(n: int, k: int = K_FOLDS, seed: int = 0) -> list[np.ndarray]:
    """k folds of the query rows (shuffled with ``seed``)."""
    if k < 2:
        raise IpwError(f"--folds {k}: must be at least 2")
    if n < k:
        raise IpwError(f"{n} queries cannot be split into {k} folds (--folds)")
    order = np.random.default_rng(seed).permutation(n)
    return [np.sort(f) for f in np.array_split(order, k)]


# --- routing and its curve ----------------------------------------------------------------------------

def choose(p: np.ndarray, threshold: float) -> np.ndarray:
    """Per query: the column of the first (cheapest) local backend with p >= threshold, else -1 (cloud)."""
    ok = p >= threshold
    return np.where(ok.any(axis=1), ok.argmax(axis=1), -1)


@dataclass(frozen=True)
class CurvePoint:
    threshold: float
    local_share: Estimate
    accuracy: Estimate
    accuracy_loss: Estimate  # cloud-only accuracy - routed accuracy
    energy_saved_fraction: Estimate | None
    latency_saved_fraction: Estimate | None
    cost_saved_fraction: Estimate | None
    pgr: float  # (accuracy - local-only accuracy) / (cloud accuracy - local-only accuracy); NaN: no gap


@dataclass(frozen=True)
class PolicyScore:
    """A deployable policy scored out of sample (the trained router; the cascade of issue 44 item 3 is meant
    to fill the same shape so that compare shows both side by side)."""

    name: str  # "trained router", "cascade", ...
    protocol: str  # e.g. "5-fold by query" or "held-out category"
    n_queries: int
    local: tuple[str, ...]
    cloud: str
    cloud_accuracy: float
    local_only_accuracy: float  # every query to the cheapest local backend
    curve: tuple[CurvePoint, ...]
    auc: dict[str, float]  # per local backend (NaN: one class only)
    apgr: float  # NaN when the gap is ~0 (see notes)
    local_share_at_50: float | None  # the largest local share whose PGR >= 0.5 (None: never)
    local_share_at_80: float | None
    operating_point: CurvePoint
    operating_reason: str
    by_category: tuple[dict[str, Any], ...] = ()
    notes: tuple[str, ...] = ()


def _mean(x: np.ndarray) -> float:
    k = x[~np.isnan(x)]
    return float(k.mean()) if len(k) else float("nan")


def _ci_of(value: float, draws: np.ndarray) -> Estimate:
    from ipw.analysis.stats import LEVEL, bounds

    if not np.isfinite(value):
        return Estimate(value, float("nan"), float("nan"))
    d = draws[np.isfinite(draws)]
    if not len(d):
        return Estimate(value, float("nan"), float("nan"))
    lo, hi = bounds(d, LEVEL)
    return Estimate(value, lo, hi)


def curve(data: RouteData, p: np.ndarray, thresholds: Sequence[float] = THRESHOLDS, n_boot: int = 1000,
          seed: int = 0) -> tuple[CurvePoint, ...]:
    """Each threshold's routing of the predictions ``p`` (n, L), measured per query, with bootstrap CIs."""
    from ipw.analysis.stats import resample_weights

    n = data.n
    rows = np.arange(n)
    cloud_acc = _mean(data.cloud_correct)
    local_acc = _mean(data.correct[:, 0])
    gap = cloud_acc - local_acc
    weights = np.concatenate(list(w.copy() for w in resample_weights(n, n_boot, seed=seed)), axis=0).astype(float)
    one = np.ones(n)

    def routed(x: np.ndarray, cloud_x: np.ndarray, ch: np.ndarray) -> np.ndarray:
        return np.where(ch >= 0, x[rows, np.maximum(ch, 0)], cloud_x)

    out = []
    for t in thresholds:
        ch = choose(p, t)
        local = (ch >= 0).astype(float)
        corr = routed(data.correct, data.cloud_correct, ch)
        has = ~np.isnan(corr) & ~np.isnan(data.cloud_correct)
        c0, cc = np.where(has, corr, 0.0), np.where(has, data.cloud_correct, 0.0)
        nh = has.astype(float)
        share = _ci_of(float(local.mean()), weights @ local / (weights @ one))
        with np.errstate(invalid="ignore", divide="ignore"):
            acc_v = float(c0.sum() / nh.sum()) if nh.sum() else float("nan")
            acc_d = (weights @ c0) / (weights @ nh)
            loss_v = float((cc.sum() - c0.sum()) / nh.sum()) if nh.sum() else float("nan")
            loss_d = (weights @ cc - weights @ c0) / (weights @ nh)

        def saved(x: np.ndarray | None, cloud_x: np.ndarray | None) -> Estimate | None:
            if x is None or cloud_x is None:
                return None
            r = routed(x, cloud_x, ch)
            if np.isnan(r).any() or np.isnan(cloud_x).any() or cloud_x.sum() <= 0:
                return None
            with np.errstate(invalid="ignore", divide="ignore"):
                return _ci_of(float(1 - r.sum() / cloud_x.sum()), 1 - (weights @ r) / (weights @ cloud_x))

        energy_saved = saved(data.energy_j, data.cloud_energy_j)
        if energy_saved is not None and data.energy_errors is not None:
            energy_saved = _energy_saved(data, ch, data.energy_errors, n_boot, seed)
        out.append(CurvePoint(
            threshold=float(t), local_share=share, accuracy=_ci_of(acc_v, acc_d), accuracy_loss=_ci_of(loss_v, loss_d),
            energy_saved_fraction=energy_saved,
            latency_saved_fraction=saved(data.latency_s, data.cloud_latency_s),
            cost_saved_fraction=saved(data.cost_usd, data.cloud_cost_usd),
            pgr=(acc_v - local_acc) / gap if gap >= GAP_EPS else float("nan")))
    return tuple(out)


def _energy_saved(data: RouteData, ch: np.ndarray, errors: EnergyErrors, n_boot: int, seed: int) -> Estimate:
    """The energy saved by the routing ``ch`` with each query's measurement error drawn on the same resamples
    as ``curve``'s (one seed): a shared error is one draw for both sums where its source is the same (compare's
    rule, ``ipw.analysis.stats``), so it cancels in the saving."""
    from ipw.analysis.stats import bootstrap_draws

    rows = np.arange(data.n)
    cloud = len(data.local)
    routed = np.where(ch >= 0, data.energy_j[rows, np.maximum(ch, 0)], data.cloud_energy_j)
    measurement = [e for b in range(cloud + 1) for e in errors.of(0, b, np.where(ch >= 0, ch, cloud) == b)]
    measurement += errors.of(1, cloud)
    d = bootstrap_draws([routed, data.cloud_energy_j], n_boot=n_boot, seed=seed, measurement=measurement)
    with np.errstate(invalid="ignore", divide="ignore"):
        return _ci_of(float(1 - d.point_sums[0] / d.point_sums[1]), 1 - d.sums[:, 0] / d.sums[:, 1])


def apgr(points: Sequence[CurvePoint]) -> float:
    """RouteLLM's APGR: the area under PGR against the share of queries sent to the cloud, from 0 (all local:
    PGR 0) to 1 (all cloud: PGR 1), the curve's points between, trapezoids; NaN when PGR is undefined."""
    xs = [(0.0, 0.0), (1.0, 1.0)] + [(1 - pt.local_share.value, pt.pgr) for pt in points]
    if any(not np.isfinite(y) for _, y in xs):
        return float("nan")
    xs.sort()
    return float(sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(xs, xs[1:])))


def share_at(points: Sequence[CurvePoint], pgr: float) -> float | None:
    """The largest local share among the points that keep at least ``pgr`` of the cloud's accuracy gap."""
    ok = [pt.local_share.value for pt in points if np.isfinite(pt.pgr) and pt.pgr >= pgr]
    return max(ok) if ok else None


def operating_point(points: Sequence[CurvePoint], threshold: float | None = None,
                    max_accuracy_loss: float | None = None) -> tuple[CurvePoint, str]:
    """The point at ``threshold`` (nearest on the curve), or the most energy-saving (else latency-saving,
    else most-local) point whose out-of-fold accuracy loss is within ``max_accuracy_loss``."""
    if max_accuracy_loss is not None:
        ok = [pt for pt in points if np.isfinite(pt.accuracy_loss.value) and pt.accuracy_loss.value <= max_accuracy_loss]
        if not ok:
            return points[-1], f"no threshold keeps the accuracy loss within {max_accuracy_loss:.1%}: the strictest"

        def gain(pt: CurvePoint) -> tuple[float, float]:
            s = pt.energy_saved_fraction or pt.latency_saved_fraction
            return (s.value if s is not None else pt.local_share.value, -pt.threshold)

        best = max(ok, key=gain)
        return best, (f"the most energy-saving threshold whose out-of-fold accuracy loss is within "
                      f"{max_accuracy_loss:.1%} (--max-accuracy-loss)")
    t = DEFAULT_THRESHOLD if threshold is None else threshold
    best = min(points, key=lambda pt: abs(pt.threshold - t))
    return best, f"threshold {best.threshold:g}" + ("" if threshold is not None else " (default)")


def auc(data: RouteData, p: np.ndarray) -> dict[str, float]:
    _, _, roc_auc_score = sklearn_modules()
    out = {}
    for b, name in enumerate(data.local):
        y, s = data.label[:, b], p[:, b]
        k = ~np.isnan(y) & ~np.isnan(s)
        out[name] = float(roc_auc_score(y[k], s[k])) if k.any() and 0 < y[k].sum() < k.sum() else float("nan")
    return out


def _subset(data: RouteData, rows: np.ndarray) -> RouteData:
    def s(x: Any) -> Any:
        return None if x is None else x[rows]

    return RouteData(tuple(np.asarray(data.query_id, object)[rows]), tuple(np.asarray(data.prompts, object)[rows]),
                     tuple(np.asarray(data.category, object)[rows]), data.local, data.cloud, data.grading,
                     data.label[rows], data.correct[rows], data.energy_j[rows], data.latency_s[rows],
                     data.cloud_correct[rows], data.cloud_energy_j[rows], data.cloud_latency_s[rows],
                     s(data.cost_usd), s(data.cloud_cost_usd), data.trained_on,
                     None if data.energy_errors is None else data.energy_errors.items(rows))


def score(data: RouteData, p: np.ndarray, protocol: str, *, name: str = "trained router",
          threshold: float | None = None, max_accuracy_loss: float | None = None, n_boot: int = 1000,
          seed: int = 0) -> PolicyScore:
    """Every number of a policy from its out-of-sample probabilities ``p`` (n, L)."""
    points = curve(data, p, n_boot=n_boot, seed=seed)
    op, why = operating_point(points, threshold, max_accuracy_loss)
    cloud_acc, local_acc = _mean(data.cloud_correct), _mean(data.correct[:, 0])
    notes = []
    if not cloud_acc - local_acc >= GAP_EPS:
        notes.append(f"the cloud's accuracy ({cloud_acc:.1%}) is not above local-only ({local_acc:.1%}) by "
                     f"{GAP_EPS:.0%} or more: no gap to recover, APGR and the 50%/80% shares are not defined")
    if data.energy_errors is not None:
        notes.append("energy saved: each query's measurement error is drawn on every resample; a shared error of "
                     "one source (one machine's CPU model, a device's bias) is one draw for the routed and the "
                     "cloud-only energy and cancels in the saving; a sensor session's calibration, another "
                     "machine's or device's, are drawn apart (as in ipw compare)")
    return PolicyScore(name=name, protocol=protocol, n_queries=data.n, local=data.local, cloud=data.cloud,
                       cloud_accuracy=cloud_acc, local_only_accuracy=local_acc, curve=points, auc=auc(data, p),
                       apgr=apgr(points), local_share_at_50=share_at(points, 0.5),
                       local_share_at_80=share_at(points, 0.8), operating_point=op, operating_reason=why,
                       notes=tuple(notes))


@dataclass(frozen=True)
class RouterScores:
    kfold: PolicyScore
    held_out_category: PolicyScore | None  # None: fewer than two categories


def check_trainable(data: RouteData, min_queries: int = MIN_QUERIES, where: str = "the runs") -> None:
    scored = int((~np.isnan(data.label)).any(axis=1).sum())
    if scored < min_queries:
        raise IpwError(f"{where}: {scored} scored queries, fewer than the {min_queries} a router needs "
                       "(--min-queries)")
    for b, name in enumerate(data.local):
        y = data.label[:, b][~np.isnan(data.label[:, b])]
        if len(y) and y.min() == y.max():
            what = "answers every query as well as the cloud" if y[0] == 1 else "never answers as well as the cloud"
            raise IpwError(f"{where}: local backend {name!r} {what} ({len(y)} scored queries): one class only, "
                           "nothing to learn")


def score_router(data: RouteData, featurizer: Featurizer, *, k: int = K_FOLDS, seed: int = 0, c: float = C,
                 threshold: float | None = None, max_accuracy_loss: float | None = None,
                 n_boot: int = 1000) -> RouterScores:
    """The router design scored out of sample: k-fold by query, and each category held out in turn."""
    kw: dict[str, Any] = dict(threshold=threshold, max_accuracy_loss=max_accuracy_loss, n_boot=n_boot, seed=seed)
    p = predict_folds(data, kfold(data.n, k, seed), featurizer, c)
    kf = score(data, p, f"{k}-fold by query (out-of-fold)", **kw)
    cats = sorted({x for x in data.category})
    if len(cats) < 2:
        return RouterScores(kf, None)
    codes = np.array([cats.index(x) for x in data.category])
    folds = [np.flatnonzero(codes == i) for i in range(len(cats))]
    # a held-out category is unseen: its one-hot is all zeros in the features
    ph = np.full(data.label.shape, np.nan)
    x = featurizer.transform(data.prompts, data.category)
    for i, test in enumerate(folds):
        train = np.flatnonzero(codes != i)
        for b in range(len(data.local)):
            ph[test, b] = fit(x[train], data.label[train, b], featurizer.width, c).proba(x[test])
    ho = score(data, ph, "held-out category (each predicted by a model trained on the others)", **kw)
    per = []
    for i, test in enumerate(folds):
        sub = _subset(data, test)
        pts = curve(sub, ph[test], thresholds=[ho.operating_point.threshold], n_boot=200, seed=seed)
        pt = pts[0]
        per.append({"category": cats[i], "n_queries": len(test), "auc": auc(sub, ph[test]),
                    "threshold": pt.threshold, "local_share": pt.local_share.value, "accuracy": pt.accuracy.value,
                    "cloud_accuracy": _mean(sub.cloud_correct), "accuracy_loss": pt.accuracy_loss.value,
                    "energy_saved_fraction": None if pt.energy_saved_fraction is None
                    else pt.energy_saved_fraction.value})
    return RouterScores(kf, PolicyScore(**{**ho.__dict__, "by_category": tuple(per)}))


# --- the trained router and its file ----------------------------------------------------------------------

@dataclass(frozen=True)
class Router:
    featurizer: Featurizer
    local: tuple[str, ...]  # cheapest first
    cloud: str
    models: tuple[Linear, ...]
    threshold: float = DEFAULT_THRESHOLD
    meta: dict[str, Any] = field(default_factory=dict)
    _vectorizer: Any = field(default=None, compare=False, repr=False)
    _analyzer: Any = field(default=None, compare=False, repr=False)

    def probabilities(self, prompt: str, category: str | None = None) -> dict[str, float]:
        """Each local backend's probability of answering as well as the cloud (the same numbers as
        ``Featurizer.transform`` and ``Linear.proba``, without building the stacked matrix: ~0.1 ms)."""
        f = self.featurizer
        idx, val = self._hashed(prompt)
        length = math.log1p(len(prompt)) / 10.0
        cat = f.categories.index(category) if category in f.categories else -1
        out = {}
        for name, m in zip(self.local, self.models):
            z = m.intercept + float(np.dot(m.coef[idx], val)) + m.coef[f.n_features] * length
            if cat >= 0:
                z += m.coef[f.n_features + 1 + cat]
            out[name] = 1.0 / (1.0 + math.exp(-min(max(z, -500.0), 500.0)))
        return out

    def _hashed(self, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        """The prompt's hashed n-gram columns and values, as ``HashingVectorizer.transform`` makes them (its
        analyzer, murmurhash3_32 with seed 0, counts, L2 norm), without its per-call validation (~10x faster)."""
        if self._vectorizer is None:
            object.__setattr__(self, "_vectorizer", self.featurizer.vectorizer())
        if self._analyzer is None:
            from sklearn.utils import murmurhash3_32

            object.__setattr__(self, "_analyzer", (self._vectorizer.build_analyzer(), murmurhash3_32))
        analyze, murmur = self._analyzer
        n = self.featurizer.n_features
        counts: dict[int, float] = {}
        for token in analyze(prompt):
            h = murmur(token, seed=0)
            j = (2147483647 if h == -2147483648 else abs(h)) % n
            counts[j] = counts.get(j, 0.0) + 1.0
        idx = np.fromiter(counts.keys(), np.int64, len(counts))
        val = np.fromiter(counts.values(), float, len(counts))
        norm = math.sqrt(float(val @ val))
        return idx, (val / norm if norm else val)

    def route(self, prompt: str, category: str | None = None, threshold: float | None = None) -> str:
        """The backend a prompt goes to: the cheapest local one predicted to answer as well, else the cloud."""
        t = self.threshold if threshold is None else threshold
        for name, p in self.probabilities(prompt, category).items():
            if p >= t:
                return name
        return self.cloud

    def to_json(self) -> dict[str, Any]:
        from ipw import __version__

        def sparse(m: Linear) -> dict[str, Any]:
            nz = np.flatnonzero(m.coef)
            return {"intercept": m.intercept, "index": nz.tolist(), "value": m.coef[nz].tolist()}

        return {"format": FORMAT, "format_version": FORMAT_VERSION, "ipw_version": __version__,
                "created": self.meta.get("created") or datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "features": self.featurizer.to_json(), "threshold": self.threshold, "local": list(self.local),
                "cloud": self.cloud, "classifiers": {n: sparse(m) for n, m in zip(self.local, self.models)},
                "trained_on": self.meta.get("trained_on", {}), "training": self.meta.get("training", {}),
                "scores": self.meta.get("scores", {})}


def train(data: RouteData, *, threshold: float = DEFAULT_THRESHOLD, c: float = C, min_queries: int = MIN_QUERIES,
          where: str = "the runs") -> Router:
    """The router trained on every query of ``data`` (score it with ``score_router``, never on these)."""
    check_threshold(threshold)
    check_trainable(data, min_queries, where)
    if len(data.local) > MAX_LOCAL:  # a file its loader would refuse
        raise IpwError(f"{where}: {len(data.local)} local backends; a router chooses among at most {MAX_LOCAL} (name "
                       "them with --local)")
    featurizer = Featurizer(tuple(sorted({x for x in data.category if x})) if data.has_categories else ())
    x = featurizer.transform(data.prompts, data.category)
    models = tuple(fit(x, data.label[:, b], featurizer.width, c) for b in range(len(data.local)))
    meta = {"trained_on": data.trained_on, "training": {"C": c, "class_weight": "balanced", "solver": "liblinear",
                                                       "label": data.grading, "min_queries": min_queries}}
    return Router(featurizer, data.local, data.cloud, models, threshold, meta)


def _temporary(path: Path) -> Path:
    """The temporary file a router is written to before it is renamed over ``path`` (the same folder: the rename
    stays on one file system, atomic)."""
    return path.with_name(f".{path.name}.tmp")


def check_out(path: Path, option: str = "--out") -> None:
    """``path`` can be replaced by a router file (before any training): not a folder, a symbolic link (the
    rename would replace the link, not its target), a FIFO or a device (/dev/full), and a file can be made
    beside it (not /proc, a read-only file system)."""
    if path.is_symlink():
        raise IpwError(f"{option} {path}: is a symbolic link; give the file itself")
    if path.is_dir():
        raise IpwError(f"{option} {path}: is a folder; give the router file to write (router.json)")
    if path.exists() and not path.is_file():
        raise IpwError(f"{option} {path}: not a regular file (a FIFO, a device); give the router file to write")
    if not path.parent.is_dir():
        raise IpwError(f"{option} {path}: its folder {path.parent} does not exist")
    tmp = _temporary(path)
    try:
        tmp.open("w").close()
        tmp.unlink()
    except OSError as exc:
        raise IpwError(f"{option} {path}: cannot make a file in {path.parent} "
                       f"({exc.strerror or type(exc).__name__})") from None


def save(router: Router, path: str | Path) -> None:
    """Write the router file atomically (``ipw.results``' temporary-file-and-rename, the file fsynced before
    the rename): a full disk or a file size limit leaves the old file as it was, and one line."""
    from ipw.results import atomic_write

    path = Path(path)
    text = json.dumps(router.to_json(), indent=1) + "\n"

    def write(tmp: Path) -> None:
        try:
            with tmp.open("w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:  # the run folders' message would say ipw run --resume: this one says what is left
            raise IpwError(f"{path}: cannot write the router file ({exc.strerror or type(exc).__name__}); the "
                           "file is as it was") from None

    atomic_write(path, _temporary(path), write)


# --- reading a router file: the whole file checked against what this ipw writes (issue 55) ----------------------
# a router file comes from outside: every field is checked before one is used, so that a damaged or hostile file
# is one line naming its field (exit 2), never a crash, a hang, a memory blow-up or a silent one-sided router
MAX_LOCAL = 16  # local backends: each one's dense coefficients take 2 MB (2^18 floats)
# a router of MAX_LOCAL backends, each with all its 2^18 coefficients (~10 MB as written), fits
MAX_ROUTER_BYTES = 256 * 2 ** 20
MAX_DEPTH = 32  # the file's own nesting is under 10 (scores.kfold.curve[i].accuracy.value)
MAX_CATEGORIES = 4096
MAX_COEF = 1e6  # |coefficient|, |intercept|: a logistic regression at C=1 gives ~10; any sum of these stays finite
TOP_FIELDS = ("format", "format_version", "ipw_version", "created", "features", "threshold", "local", "cloud",
              "classifiers", "trained_on", "training", "scores")


class _Doc:
    """Typed reads of a router document, each failure one line: ``PATH: field 'a.b': problem``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def bad(self, name: str, problem: str) -> IpwError:
        return IpwError(f"{self.path}: field '{name}': {problem}")

    def get(self, obj: dict[str, Any], key: str, name: str) -> Any:
        if key not in obj:
            raise self.bad(name, "required")
        return obj[key]

    def object(self, obj: dict[str, Any], key: str, name: str) -> dict[str, Any]:
        value = self.get(obj, key, name)
        if not isinstance(value, dict):
            raise self.bad(name, "must be an object")
        return value

    def strings(self, obj: dict[str, Any], key: str, name: str, most: int) -> list[str]:
        value = self.get(obj, key, name)
        if not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
            raise self.bad(name, "must be a list of strings")
        if len(value) > most or len(set(value)) < len(value):
            raise self.bad(name, f"must hold at most {most} names, each once")
        return value

    def integers(self, value: Any, name: str, low: int, high: int) -> list[int]:
        """A list of whole numbers from ``low`` to ``high`` (a JSON true is not 1)."""
        if not (isinstance(value, list) and all(type(x) is int for x in value)):
            raise self.bad(name, "must be a list of whole numbers")
        if not all(low <= x <= high for x in value):  # Python ints: 10**30 compares, nothing overflows
            raise self.bad(name, f"must be from {low} to {high}")
        return value

    def numbers(self, value: Any, name: str, low: float, high: float) -> np.ndarray:
        """A list of finite numbers from ``low`` to ``high`` (NaN and infinities fail the comparison)."""
        if not (isinstance(value, list) and all(type(x) in (int, float) for x in value)):
            raise self.bad(name, "must be a list of numbers")
        if not all(low <= x <= high for x in value):
            raise self.bad(name, f"must be finite, from {low:g} to {high:g}")
        return np.asarray(value, float)

    def integer(self, obj: dict[str, Any], key: str, name: str, low: int, high: int) -> int:
        return self.integers([self.get(obj, key, name)], name, low, high)[0]

    def number(self, obj: dict[str, Any], key: str, name: str, low: float, high: float) -> float:
        return float(self.numbers([self.get(obj, key, name)], name, low, high)[0])

    def name(self, value: Any, name: str) -> str:
        """A backend name, checked as ``--name`` and a config's backend names are (no CR LF for a header, no
        ``::error`` line, no bidi override)."""
        from ipw.config import check_name

        if not isinstance(value, str):
            raise self.bad(name, "must be a string")
        if check_name(value, f"{self.path}: field '{name}'") != value:
            raise self.bad(name, f"{ascii(value)} is not NFC-normalised, as ipw writes backend names")
        return value


def _depth(doc: Any) -> int:
    """The nesting depth of a parsed JSON value, counted up to MAX_DEPTH + 1 (iteratively: no recursion)."""
    deepest, todo = 0, [(doc, 1)]
    while todo:
        x, d = todo.pop()
        deepest = max(deepest, d)
        if d <= MAX_DEPTH:
            todo += [(v, d + 1) for v in (x.values() if isinstance(x, dict) else x if isinstance(x, list) else ())]
    return deepest


def _read_document(path: Path) -> dict[str, Any]:
    """The file's JSON object: read up to MAX_ROUTER_BYTES (/dev/zero ends), parsed, its depth bounded."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_ROUTER_BYTES + 1)
    except FileNotFoundError:
        raise IpwError(f"{path}: no such router file") from None
    except OSError as exc:
        raise IpwError(f"{path}: cannot read the router file ({exc.__class__.__name__})") from None
    if len(raw) > MAX_ROUTER_BYTES:
        raise IpwError(f"{path}: larger than {MAX_ROUTER_BYTES // 2 ** 20} MiB, the most a router file holds: not "
                       "a router file")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise IpwError(f"{path}: cannot read the router file (not UTF-8)") from None
    except json.JSONDecodeError as exc:
        raise IpwError(f"{path}: not a router file (invalid JSON at line {exc.lineno}: {exc.msg})") from None
    except (ValueError, RecursionError) as exc:  # an integer of 5,000 digits; nesting past the parser's stack
        raise IpwError(f"{path}: not a router file (invalid JSON: {str(exc).splitlines()[0][:80]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise IpwError(f"{path}: not an ipw router file (no \"format\": \"{FORMAT}\")")
    return doc


def load_router(path: str | Path) -> Router:
    """A router file, validated whole against what this ipw writes (``Router.to_json``): an IpwError naming the
    file and the field. ``ipw route score``, ``ipw compare --router`` and ``ipw serve --route`` all read it here."""
    from ipw.config import name_skeleton
    from ipw.sanitize import one_line

    path = Path(path)
    doc = _read_document(path)
    if doc.get("format_version") != FORMAT_VERSION or type(doc.get("format_version")) is not int:
        version = doc.get("format_version")
        made = doc.get("ipw_version")
        raise IpwError(f"{path}: router format version {version if type(version) is int else '?'} (made by ipw "
                       f"{one_line(made)[:40] if isinstance(made, str) else '?'}); this ipw reads version "
                       f"{FORMAT_VERSION}: retrain it with ipw route train")
    d = _Doc(path)
    for key, value in doc.items():
        if key not in TOP_FIELDS:
            raise d.bad(one_line(key)[:40], "unknown field")
        if _depth(value) > MAX_DEPTH:  # a value nested this deep could not be written (or shown) without recursion
            raise d.bad(key, f"nested deeper than {MAX_DEPTH} levels")
    for key in ("ipw_version", "created"):
        if not isinstance(d.get(doc, key, key), str):
            raise d.bad(key, "must be a string")
    meta = {k: d.object(doc, k, k) for k in ("trained_on", "training", "scores")}

    feats = d.object(doc, "features", "features")
    kinds = d.strings(feats, "features", "features.features", len(FEATURES))
    unknown = [f for f in kinds if f not in FEATURES]
    if unknown:
        raise IpwError(f"{path}: the router uses features this ipw cannot supply: {one_line(', '.join(unknown))[:80]}")
    if feats.get("kind") != "sklearn.HashingVectorizer":
        raise IpwError(f"{path}: the router's features are {one_line(repr(feats.get('kind')))[:40]}, this ipw "
                       "supplies sklearn.HashingVectorizer")
    categories = tuple(d.strings(feats, "categories", "features.categories", MAX_CATEGORIES))
    n_features = d.integer(feats, "n_features", "features.n_features", 1, N_FEATURES)
    ngrams = d.integers(d.get(feats, "ngram_range", "features.ngram_range"), "features.ngram_range", 1, NGRAM_RANGE[1])
    if len(ngrams) != 2 or ngrams[0] > ngrams[1]:
        raise d.bad("features.ngram_range", f"must be [low, high], 1 <= low <= high <= {NGRAM_RANGE[1]}")
    featurizer = Featurizer(categories, n_features, (ngrams[0], ngrams[1]))
    # the rest of the features' description is what this ipw computes: a file that says otherwise asks for
    # features it would not get
    for key, value in featurizer.to_json().items():
        if key not in ("n_features", "ngram_range", "categories") and \
                (d.get(feats, key, f"features.{key}") != value or type(feats[key]) is not type(value)):
            raise d.bad(f"features.{key}", f"must be {json.dumps(value)}, what this ipw computes")
    unknown = [k for k in feats if k not in featurizer.to_json()]
    if unknown:
        raise d.bad(f"features.{one_line(unknown[0])[:40]}", "unknown field")

    threshold = d.number(doc, "threshold", "threshold", 0.0, 1.0)
    local = d.get(doc, "local", "local")
    if not (isinstance(local, list) and 1 <= len(local) <= MAX_LOCAL):
        raise d.bad("local", f"must be a list of 1 to {MAX_LOCAL} backend names")
    local = [d.name(x, "local") for x in local]
    cloud = d.name(d.get(doc, "cloud", "cloud"), "cloud")
    names: set[str] = set()
    skeletons: dict[str, str] = {}
    for field_, name in [("local", x) for x in local] + [("cloud", cloud)]:  # as a config's names are
        if name in names:
            raise d.bad(field_, f"duplicate backend name {name!r}")
        alike = skeletons.setdefault(name_skeleton(name), name)
        if alike != name:
            raise d.bad(field_, f"{ascii(name)} prints like the backend name {ascii(alike)}; give names that can be "
                                "told apart")
        names.add(name)
    classifiers = d.object(doc, "classifiers", "classifiers")
    extra = [k for k in classifiers if k not in local]
    if extra:
        raise d.bad(f"classifiers.{one_line(extra[0])[:40]}", "no such local backend")
    models = []
    for name in local:
        where = f"classifiers.{name}"
        m = d.object(classifiers, name, where)
        unknown = [k for k in m if k not in ("intercept", "index", "value")]
        if unknown:
            raise d.bad(f"{where}.{one_line(unknown[0])[:40]}", "unknown field")
        index = d.integers(d.get(m, "index", f"{where}.index"), f"{where}.index", 0, featurizer.width - 1)
        value = d.numbers(d.get(m, "value", f"{where}.value"), f"{where}.value", -MAX_COEF, MAX_COEF)
        if any(b <= a for a, b in zip(index, index[1:])):
            raise d.bad(f"{where}.index", "must be increasing (each feature once)")
        if len(value) != len(index):
            raise d.bad(f"{where}.value", f"{len(value)} values for {len(index)} indices")
        coef = np.zeros(featurizer.width)
        coef[np.asarray(index, np.int64)] = value
        models.append(Linear(d.number(m, "intercept", f"{where}.intercept", -MAX_COEF, MAX_COEF), coef))

    training = meta["training"]  # what ``router_scores`` retrains with
    if "label" in training and training["label"] not in GRADINGS:
        raise d.bad("training.label", f"must be one of {', '.join(GRADINGS)}")
    if "C" in training:
        d.number(training, "C", "training.C", 1e-6, MAX_COEF)
    if "min_queries" in training:
        d.integer(training, "min_queries", "training.min_queries", 0, 10 ** 300)  # any count: it only refuses
    return Router(featurizer, tuple(local), cloud, tuple(models), threshold,
                  {**meta, "created": doc["created"], "ipw_version": doc["ipw_version"]}, featurizer.vectorizer())


def check_runs_supply(router: Router, data: RouteData, path: str | Path) -> None:
    """The runs can supply the router's features (its categories need runs with categories)."""
    if router.featurizer.categories and not data.has_categories:
        raise IpwError(f"{path}: the router uses the query category as a feature, and these runs' queries have "
                       "no category")


def scores_json(s: PolicyScore) -> dict[str, Any]:
    def ci(x: Estimate | None) -> dict[str, float] | None:
        return None if x is None else {"value": x.value, "lo": x.lo, "hi": x.hi}

    def pt(p: CurvePoint) -> dict[str, Any]:
        return {"threshold": p.threshold, "local_share": ci(p.local_share), "accuracy": ci(p.accuracy),
                "accuracy_loss": ci(p.accuracy_loss), "energy_saved_fraction": ci(p.energy_saved_fraction),
                "latency_saved_fraction": ci(p.latency_saved_fraction),
                "cost_saved_fraction": ci(p.cost_saved_fraction), "pgr": None if not np.isfinite(p.pgr) else p.pgr}

    def num(x: float | None) -> float | None:
        return None if x is None or not np.isfinite(x) else x

    return {"name": s.name, "protocol": s.protocol, "n_queries": s.n_queries, "local": list(s.local),
            "cloud": s.cloud, "cloud_accuracy": num(s.cloud_accuracy), "local_only_accuracy": num(s.local_only_accuracy),
            "auc": {k: num(v) for k, v in s.auc.items()}, "apgr": num(s.apgr),
            "local_share_at_50pct_gap": s.local_share_at_50, "local_share_at_80pct_gap": s.local_share_at_80,
            "operating_point": pt(s.operating_point), "operating_reason": s.operating_reason,
            "curve": [pt(p) for p in s.curve], "by_category": list(s.by_category), "notes": list(s.notes)}


# --- the router's scores as ``ipw compare --router``, ``ipw report --router`` and ``ipw route score`` show them

def _pct(x: Any) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


def _ci(c: Any) -> str:
    if c is None:
        return "n/a"
    if c.lo != c.lo:
        return _pct(c.value)
    return f"{_pct(c.value)} [{_pct(c.lo)}, {_pct(c.hi)}]"


def policy_rows(s: Any) -> list[tuple[str, str]]:
    """One scored policy (``ipw.analysis.router.PolicyScore``: the trained router; the cascade of issue 44 item 3
    fills the same shape) as label/value rows."""
    op = s.operating_point
    auc = ", ".join(f"{k}: {'n/a' if v != v else f'{v:.3f}'}" for k, v in s.auc.items())
    rows = [
        ("scored", f"{s.protocol}; {s.n_queries} queries, never on a training query"),
        ("AUC (answers as well as the cloud)", auc),
        ("operating point", f"{s.operating_reason}"),
        ("  routed locally", _ci(op.local_share)),
        ("  accuracy", f"{_ci(op.accuracy)} (cloud only {_pct(s.cloud_accuracy)}, local only "
                       f"{_pct(s.local_only_accuracy)})"),
        ("  accuracy loss vs cloud only", _ci(op.accuracy_loss)),
        ("  energy saved", _ci(op.energy_saved_fraction)),
        ("  latency saved", _ci(op.latency_saved_fraction)),
        ("  cost saved", _ci(op.cost_saved_fraction)),
        ("APGR", "n/a (no accuracy gap)" if s.apgr != s.apgr else f"{s.apgr:.3f}"),
        ("local share keeping 50% / 80% of the gap", f"{_pct(s.local_share_at_50)} / {_pct(s.local_share_at_80)}"),
    ]
    for c in s.by_category:
        rows.append((f"  held out: {c['category'] or '(none)'}",
                     f"{c['n_queries']} queries, local {_pct(c['local_share'])}, accuracy {_pct(c['accuracy'])} "
                     f"(cloud {_pct(c['cloud_accuracy'])}), energy saved {_pct(c['energy_saved_fraction'])}"))
    return rows


def curve_rows(s: Any) -> list[tuple[str, ...]]:
    return [(f"{p.threshold:.2f}", _ci(p.local_share), _ci(p.accuracy), _ci(p.accuracy_loss),
             _ci(p.energy_saved_fraction), _ci(p.latency_saved_fraction),
             "n/a" if p.pgr != p.pgr else f"{p.pgr:.2f}") for p in s.curve]


def print_scores(scores: Any, console: Any, *, curve: bool = True, beside: Sequence[tuple[str, str]] = ()) -> None:
    """The router's out-of-sample tables (``beside``: rows of the oracle and the α-router to show above it)."""
    from rich.table import Table

    for s in [scores.kfold] + ([scores.held_out_category] if scores.held_out_category else []):
        t = Table(title=f"{s.name}: {s.local and ', '.join(s.local)} vs cloud {s.cloud} ({s.protocol})")
        t.add_column("")
        t.add_column("value", justify="right")
        if beside and s is scores.kfold:
            for k, v in beside:
                t.add_row(k, v)
        for k, v in policy_rows(s):
            t.add_row(k, v)
        console.print(t)
        for n in s.notes:
            console.print(f"note: {n}", highlight=False, markup=False)
    if curve:
        s = scores.kfold
        t = Table(title=f"trained router, out-of-fold curve over the threshold ({s.protocol})")
        for h in ("threshold", "routed locally", "accuracy", "accuracy loss", "energy saved", "latency saved", "PGR"):
            t.add_column(h, justify="right")
        for r in curve_rows(s):
            t.add_row(*r)
        console.print(t)


def router_scores(runs: Sequence[Path], *, router_path: Path | None, local: Sequence[str] = (),
                  cloud: Sequence[str] = (), grading: str | None = None, threshold: float | None = None,
                  max_accuracy_loss: str | None = None, min_queries: int | None = None, folds: int = 5,
                  seed: int = 0, usd_per_kwh: float | None = None, api_prices: Sequence[str] = (),
                  energy_basis: str = "chip", pue: Sequence[str] = ()) -> RouterScores:
    """The router design (of ``router_path``, else the defaults) scored out of sample on ``runs``: retrained in
    folds with its settings, never scored on a query it was trained on."""
    if threshold is not None:
        check_threshold(threshold)
    loss = None if max_accuracy_loss is None else parse_accuracy_loss(max_accuracy_loss)
    sklearn_modules()
    featurizer, c = Featurizer(), C
    where = "the runs"
    if router_path is not None:
        router = load_router(router_path)
        training = router.meta.get("training") or {}
        grading = grading or training.get("label") or "answer"
        min_queries = min_queries if min_queries is not None else int(training.get("min_queries") or MIN_QUERIES)
        c = float(training.get("C") or C)
        threshold = router.threshold if threshold is None and loss is None else threshold
    data = route_data(runs, local=local, cloud=cloud, grading=grading or "answer", usd_per_kwh=usd_per_kwh,
                      api_prices=api_prices, energy_basis=energy_basis, pue=pue)
    if router_path is not None:
        check_runs_supply(router, data, router_path)
        featurizer = Featurizer(tuple(sorted({x for x in data.category if x})) if router.featurizer.categories
                              else (), router.featurizer.n_features, router.featurizer.ngram_range)
    elif data.has_categories:
        featurizer = Featurizer(tuple(sorted({x for x in data.category if x})))
    check_trainable(data, MIN_QUERIES if min_queries is None else min_queries, where)
    return score_router(data, featurizer, k=folds, seed=seed, c=c, threshold=threshold, max_accuracy_loss=loss)


def scores_doc(scores: Any) -> dict[str, Any]:
    return {"trained_router": {"kfold": scores_json(scores.kfold),
                               "held_out_category": None if scores.held_out_category is None
                               else scores_json(scores.held_out_category)}}


def beside_rows(result: Any) -> list[tuple[str, str]]:
    """The oracle's and the α-router's numbers of a ``Comparison``, to read the trained router against: both
    know each answer in advance (upper bounds, never deployable)."""
    r = result.routing
    if r is None:
        return []
    o, a = r.oracle, r.router
    local = sum(v for k, v in o.routed_to.items() if k != r.cloud) / max(r.n_queries, 1)

    def saved(s: Any) -> str:
        return "n/a" if s is None else _pct(s.saved_fraction)

    return [
        ("oracle (knows each answer: upper bound)", f"local {_pct(local)}, accuracy {_pct(o.accuracy)}, energy saved "
                                                    f"{saved(o.energy_j)}, latency saved {saved(o.latency_s)}"),
        (f"α-router (α={a.alpha:g}; upper bound: never sends a query the local model fails)",
         f"local {_pct(a.alpha * local)}, accuracy {_pct(a.accuracy)}, energy saved {_pct(a.energy_saved_fraction)}"),
        ("trained router (below: deployable, scored out of fold)", ""),
    ]


def scores_markdown(scores: Any, result: Any = None) -> str:
    from ipw.sanitize import md_text

    lines = []
    for s in [scores.kfold] + ([scores.held_out_category] if scores.held_out_category else []):
        lines += ["", f"**{s.name}** ({md_text(s.protocol)})", "", "| | value |", "|---|---:|"]
        rows = (beside_rows(result) if result is not None and s is scores.kfold else []) + policy_rows(s)
        lines += [f"| {md_text(k)} | {md_text(v)} |" for k, v in rows]
        lines += [f"- {md_text(n)}" for n in s.notes]
    return "\n".join(lines) + "\n"


def report_tables(scores: Any) -> list[dict[str, Any]]:
    """The router's tables in ``ipw report``'s form (cells ``{"text", "est"}``; ``build`` marks estimated energy)."""
    def cells(rows: Sequence[Sequence[str]]) -> list[list[dict[str, Any]]]:
        return [[{"text": x, "est": False} for x in row] for row in rows]

    out = []
    for s in [scores.kfold] + ([scores.held_out_category] if scores.held_out_category else []):
        out.append({"title": f"trained router, deployable, scored out of fold ({s.protocol}): "
                             f"{', '.join(s.local)} else {s.cloud}; the oracle and the α-router above are upper "
                             "bounds", "headers": ["", "value"], "rows": cells(policy_rows(s)),
                    "key": "trained_router", "section": "routing"})
    s = scores.kfold
    out.append({"title": f"trained router: out-of-fold curve over the threshold ({s.protocol})",
                "headers": ["threshold", "routed locally", "accuracy", "accuracy loss", "energy saved",
                            "latency saved", "PGR"], "rows": cells(curve_rows(s)), "key": "trained_router_curve",
                "section": "routing"})
    return out
