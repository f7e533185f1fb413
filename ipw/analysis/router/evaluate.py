"""A routing policy scored out of sample (``ipw.analysis.router``): its curve over the threshold with bootstrap CIs
(measured per query, as the oracle's in ``ipw.analysis.routing``), APGR, the operating point, and the k-fold and
held-out-category scores of a router design."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ipw.analysis.stats import EnergyErrors, Estimate
from ipw.errors import IpwError
from ipw.analysis.router.data import RouteData, subset
from ipw.analysis.router.model import C, K_FOLDS, Featurizer, fit, kfold, predict_folds, sklearn_modules

DEFAULT_THRESHOLD = 0.5
MIN_QUERIES = 20
THRESHOLDS = tuple(round(i * 0.05, 2) for i in range(21))
GAP_EPS = 0.01  # a cloud-over-local accuracy gap below this: APGR is not defined (stated)



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
        sub = subset(data, test)
        pts = curve(sub, ph[test], thresholds=[ho.operating_point.threshold], n_boot=200, seed=seed)
        pt = pts[0]
        per.append({"category": cats[i], "n_queries": len(test), "auc": auc(sub, ph[test]),
                    "threshold": pt.threshold, "local_share": pt.local_share.value, "accuracy": pt.accuracy.value,
                    "cloud_accuracy": _mean(sub.cloud_correct), "accuracy_loss": pt.accuracy_loss.value,
                    "energy_saved_fraction": None if pt.energy_saved_fraction is None
                    else pt.energy_saved_fraction.value})
    return RouterScores(kf, PolicyScore(**{**ho.__dict__, "by_category": tuple(per)}))
