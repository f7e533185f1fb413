"""Bootstrap confidence intervals (vectorized with numpy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its 95% bootstrap confidence interval."""

    value: float
    lo: float
    hi: float

    def fmt(self, spec: str = ".3g") -> str:
        if not np.isfinite(self.value):
            return "n/a"
        return f"{self.value:{spec}} [{self.lo:{spec}}, {self.hi:{spec}}]"


NAN = Estimate(float("nan"), float("nan"), float("nan"))


def bootstrap(
    statistic: Callable[..., np.ndarray],
    *columns: np.ndarray,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> Estimate:
    """Percentile bootstrap over rows. ``statistic`` maps arrays of shape (..., n) to shape (...,).

    Columns are resampled together (the same row indices), so ratios such as accuracy / energy keep
    their pairing.
    """
    cols = [np.asarray(c, dtype=float) for c in columns]
    n = len(cols[0])
    if n == 0:
        return NAN
    with np.errstate(divide="ignore", invalid="ignore"):
        value = float(statistic(*cols))
        if n == 1:
            return Estimate(value, value, value)
        rng = np.random.default_rng(seed)
        idx = rng.integers(0, n, size=(n_boot, n))
        stats = statistic(*(c[idx] for c in cols))
    stats = stats[np.isfinite(stats)]
    if len(stats) == 0:
        return Estimate(value, float("nan"), float("nan"))
    alpha = (1 - level) / 2
    lo, hi = np.quantile(stats, [alpha, 1 - alpha])
    return Estimate(value, float(lo), float(hi))
