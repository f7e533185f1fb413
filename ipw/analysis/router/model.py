"""The router's features (hashed word n-grams of the prompt, its length, its category) and its classifiers (one
logistic regression per local backend), trained in folds by query (``ipw.analysis.router``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ipw.errors import IpwError, ParameterError
from ipw.analysis.router.data import RouteData

N_FEATURES = 2 ** 18
NGRAM_RANGE = (1, 2)
FEATURES = ("ngrams", "log_length", "category")  # the features this version knows
K_FOLDS = 5
C = 1.0  # inverse regularisation strength of the logistic regressions


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
        raise ParameterError(("folds",), f" {k}: must be at least 2")
    if n < k:
        raise ParameterError(("folds",), ")", before=f"{n} queries cannot be split into {k} folds (")
    order = np.random.default_rng(seed).permutation(n)
    return [np.sort(f) for f in np.array_split(order, k)]
