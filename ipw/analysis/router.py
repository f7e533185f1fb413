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
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ipw.analysis.stats import Estimate
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
    prompts = {str(q): ("" if p is None else str(p)) for q, p in zip(first["query_id"], first["prompt"])}
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
    from ipw.analysis.load import BackendInfo, load
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
    return RouteData(
        query_id=tuple(qids), prompts=tuple(prompts.get(q, "") for q in qids), category=cat,
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

        out.append(CurvePoint(
            threshold=float(t), local_share=share, accuracy=_ci_of(acc_v, acc_d), accuracy_loss=_ci_of(loss_v, loss_d),
            energy_saved_fraction=saved(data.energy_j, data.cloud_energy_j),
            latency_saved_fraction=saved(data.latency_s, data.cloud_latency_s),
            cost_saved_fraction=saved(data.cost_usd, data.cloud_cost_usd),
            pgr=(acc_v - local_acc) / gap if gap >= GAP_EPS else float("nan")))
    return tuple(out)


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
                     s(data.cost_usd), s(data.cloud_cost_usd), data.trained_on)


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
    featurizer = Featurizer(tuple(sorted({x for x in data.category if x})) if data.has_categories else ())
    x = featurizer.transform(data.prompts, data.category)
    models = tuple(fit(x, data.label[:, b], featurizer.width, c) for b in range(len(data.local)))
    meta = {"trained_on": data.trained_on, "training": {"C": c, "class_weight": "balanced", "solver": "liblinear",
                                                       "label": data.grading, "min_queries": min_queries}}
    return Router(featurizer, data.local, data.cloud, models, threshold, meta)


def save(router: Router, path: str | Path) -> None:
    Path(path).write_text(json.dumps(router.to_json(), indent=1) + "\n", encoding="utf-8")


def load_router(path: str | Path) -> Router:
    """A router file, validated: an IpwError naming the file and what is wrong."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise IpwError(f"{path}: no such router file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise IpwError(f"{path}: cannot read the router file ({exc.__class__.__name__})") from None
    except json.JSONDecodeError as exc:
        raise IpwError(f"{path}: not a router file (invalid JSON at line {exc.lineno}: {exc.msg})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise IpwError(f"{path}: not an ipw router file (no \"format\": \"{FORMAT}\")")
    if doc.get("format_version") != FORMAT_VERSION:
        raise IpwError(f"{path}: router format version {doc.get('format_version')!r} (made by ipw "
                       f"{doc.get('ipw_version', '?')}); this ipw reads version {FORMAT_VERSION}: retrain it with "
                       "ipw route train")
    try:
        feats = doc["features"]
        unknown = [f for f in feats.get("features", []) if f not in FEATURES]
        if unknown:
            raise IpwError(f"{path}: the router uses features this ipw cannot supply: {', '.join(map(str, unknown))}")
        if feats.get("kind") != "sklearn.HashingVectorizer":
            raise IpwError(f"{path}: the router's features are {feats.get('kind')!r}, this ipw supplies "
                           "sklearn.HashingVectorizer")
        featurizer = Featurizer(tuple(str(c) for c in feats.get("categories", [])), int(feats["n_features"]),
                                (int(feats["ngram_range"][0]), int(feats["ngram_range"][1])))
        local = tuple(str(x) for x in doc["local"])
        models = []
        for name in local:
            m = doc["classifiers"][name]
            coef = np.zeros(featurizer.width)
            idx = np.asarray(m["index"], dtype=np.int64)
            if len(idx) and (idx.min() < 0 or idx.max() >= featurizer.width):
                raise IpwError(f"{path}: classifier {name!r} has a coefficient outside its {featurizer.width} features")
            coef[idx] = np.asarray(m["value"], float)
            models.append(Linear(float(m["intercept"]), coef))
        threshold = float(doc["threshold"])
        cloud = str(doc["cloud"])
    except IpwError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise IpwError(f"{path}: damaged router file ({exc.__class__.__name__}: {exc})") from None
    if not 0.0 <= threshold <= 1.0:
        raise IpwError(f"{path}: threshold {threshold} is outside [0, 1]")
    meta = {k: doc.get(k) for k in ("created", "trained_on", "training", "scores", "ipw_version")}
    return Router(featurizer, local, cloud, tuple(models), threshold, meta, featurizer.vectorizer())


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
