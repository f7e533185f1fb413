"""J per token and the fitted energy model per backend (docs/ARCHITECTURE.md, 'Energy method'): an OLS fit
``y ~ a + b*prompt_tokens + c*completion_tokens`` for energy and latency, with classical standard errors
(t quantiles) and R^2 (:func:`fit_linear`), and its JSON form (:func:`fit_dict`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ipw.analysis.stats import Estimate


def t_cdf(x: float, df: int) -> float:
    """P(T <= x) for Student's t with ``df`` degrees of freedom (Simpson's rule on its density; no scipy)."""
    if df <= 0 or not math.isfinite(x):
        return float("nan") if df <= 0 or math.isnan(x) else float(x > 0)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    grid = np.linspace(0.0, abs(x), 4001)
    f = np.exp(log_c - (df + 1) / 2 * np.log1p(grid ** 2 / df))
    h = abs(x) / 4000
    half = h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())
    return float(0.5 + half if x >= 0 else 0.5 - half)


def t_quantile(p: float, df: int) -> float:
    """Quantile of Student's t (bisection on ``t_cdf``; no scipy)."""
    if df <= 0:
        return float("nan")
    if p == 0.5:
        return 0.0
    q = max(p, 1 - p)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    x = (lo + hi) / 2
    return x if p > 0.5 else -x


@dataclass(frozen=True)
class LinearFit:
    """``y ~ a + b*prompt_tokens + c*completion_tokens`` by ordinary least squares; CIs from the
    classical standard errors (t quantiles with n - 3 degrees of freedom)."""

    intercept: Estimate  # a, in y's unit
    per_prompt_token: Estimate  # b
    per_completion_token: Estimate  # c
    r2: float
    n: int
    residual_std: float
    note: str = ""


_NAN = Estimate(float("nan"), float("nan"), float("nan"))


def fit_linear(prompt_tokens: npt.ArrayLike, completion_tokens: npt.ArrayLike, y: npt.ArrayLike,
               level: float = 0.95) -> LinearFit:
    """Fit over the rows where all three are finite.  With fewer than 4 rows, or prompt and output
    lengths that do not vary independently (e.g. every prompt as long), no coefficient is reported."""
    p, k, ys = (np.asarray(x, dtype=float) for x in (prompt_tokens, completion_tokens, y))
    ok = np.isfinite(p) & np.isfinite(k) & np.isfinite(ys)
    p, k, ys = p[ok], k[ok], ys[ok]
    n = int(ys.size)
    x = np.column_stack([np.ones(n), p, k])
    if n < 4 or np.linalg.matrix_rank(x) < 3:
        why = (f"{n} rows: needs at least 4" if n < 4
               else "prompt and output lengths do not vary independently: a mix of prompt and answer lengths is needed")
        return LinearFit(_NAN, _NAN, _NAN, float("nan"), n, float("nan"), note=why)
    coef, *_ = np.linalg.lstsq(x, ys, rcond=None)
    resid = ys - x @ coef
    df = n - 3
    sigma2 = float(resid @ resid) / df
    se = np.sqrt(np.diag(np.linalg.inv(x.T @ x)) * sigma2)
    t = t_quantile(0.5 + level / 2, df)
    sst = float(((ys - ys.mean()) ** 2).sum())
    r2 = 1 - float(resid @ resid) / sst if sst > 0 else float("nan")
    est = [Estimate(float(c), float(c - t * s), float(c + t * s)) for c, s in zip(coef, se)]
    return LinearFit(est[0], est[1], est[2], r2, n, math.sqrt(sigma2))


def fit_dict(f: LinearFit) -> dict[str, Any]:
    """JSON form: each coefficient as {value, lo, hi} (None where not finite)."""
    def num(x: float) -> float | None:
        return float(x) if math.isfinite(x) else None

    def est(e: Estimate) -> dict[str, float | None]:
        return {"value": num(e.value), "lo": num(e.lo), "hi": num(e.hi)}

    return {"intercept": est(f.intercept), "per_prompt_token": est(f.per_prompt_token),
            "per_completion_token": est(f.per_completion_token), "r2": num(f.r2), "n": f.n,
            "residual_std": num(f.residual_std), "note": f.note}
