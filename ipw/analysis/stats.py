"""Bootstrap confidence intervals (vectorized with numpy), carrying measurement error.

Measurement error (issue 27): a reading's ``uncertainty_j`` is a ±90% half-width of its energy.  The
bootstrap resamples queries *and* draws each query's measurement error on every resample, so a CI covers
both the queries' spread and how well each was measured.  This is the one place it happens:
:func:`measurement_sd` turns a record's ``energy_parts`` into 1-sd errors, split into an independent part
(edges, the load's variation: different for every window) and a shared part (one calibration ratio, one
per-core power model: the same error for every reading made through it, which averaging over queries does
not shrink); :class:`MeasurementError` attaches them to a summed column of :func:`bootstrap_draws`, which
adds to each resample's sum ``sqrt(sum_i w_i sd_i^2) * z1 + (sum_i w_i shared_i) * z_key`` (standard
normals per resample; ``w`` the resample's weights: each drawn copy of a query its own independent error,
so that the added variance of a mean is ``sum sd^2 / n^2``, the measured mean's own).  The normal draw of a
sum of many independent errors is the central limit; for a handful of queries it is an approximation.  The
independent part is conservative: the measured values' spread, which the resampling sees, already holds
it once (for 50 ms windows the error model's sd is ~4% of a query's energy, about a tenth of the queries'
own spread in the H200 runs, so the double count widens a CI by well under 1%).  The shared part is what
resampling alone can never see.  Resample weights come from their own generator, so draws without
measurement error are unchanged by it.

Shared errors cancel where they are shared (issue 58): each shared error carries the key of its source
(``MeasurementError.shared_key``: the machine and the sensor or model, ``ipw.analysis.load``), and one
``z_key`` per resample is drawn for every column and backend with that key.  Two backends whose joules are
CPU seconds x one machine's W/core scale together, so their ratio (a saving, a paired change) does not
move with that coefficient's error; errors of different sources (other devices, machines, models, or one
sensor session's own calibration) keep their own draws.  An empty key is a draw of its own.

    from ipw.analysis.stats import MeasurementError, bootstrap_draws, measurement_sd
    sd, shared = zip(*(measurement_sd(parts) for parts in records["energy_parts"]))
    draws = bootstrap_draws(columns, n_boot=2000, measurement=[MeasurementError(0, np.array(sd), np.array(shared))])

From run folders, ``ipw.analysis.load`` already holds them per backend and query (``PerQuery.energy_sd_j``,
``shared_sd_j`` by source; :func:`ipw.analysis.load.energy_errors` makes an :class:`EnergyErrors` of them),
and :meth:`EnergyErrors.of` gives the errors of any column made of backends' energies (a backend's own, the
oracle's routed energy, a cascade's spent energy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from ipw.telemetry.uncertainty import NVML_SHARED_REL, Z90  # noqa: F401 - part of this API
from ipw.telemetry.uncertainty import measurement_sd as measurement_sd  # part of this API (load.py)


@dataclass(frozen=True)
class MeasurementError:
    """1-sd measurement errors of the items of one summed column of :func:`bootstrap_draws`: ``sd``
    independent per item, ``shared_sd`` per item but fully correlated across the items (zeros: none), and
    across every column's items with the same ``shared_key`` (its source; "": this entry's alone).
    Arrays of the column's length, in the column's units; NaN counts as 0.  A column may have several."""

    column: int
    sd: np.ndarray
    shared_sd: np.ndarray | None = None
    shared_key: str = ""

    def negligible(self) -> bool:
        return not (np.nansum(self.sd) > 0 or (self.shared_sd is not None and np.nansum(self.shared_sd) > 0))


@dataclass(frozen=True)
class EnergyErrors:
    """Measurement errors of backends' energies per query (1 sd, J): ``sd`` independent, shape
    (backends, queries), and ``shared`` by source key, each (backends, queries), 0 where a backend has none
    of that source (``ipw.analysis.load.energy_errors``)."""

    sd: np.ndarray
    shared: Mapping[str, np.ndarray]

    def rows(self, rows: Sequence[int]) -> "EnergyErrors":
        """These backends only, in this order."""
        return EnergyErrors(self.sd[list(rows)], {k: v[list(rows)] for k, v in self.shared.items()})

    def items(self, items: np.ndarray) -> "EnergyErrors":
        """These queries only (indices or a mask)."""
        return EnergyErrors(self.sd[:, items], {k: v[:, items] for k, v in self.shared.items()})

    def of(self, column: int, row: int, where: np.ndarray | None = None) -> list[MeasurementError]:
        """The errors that backend ``row``'s energy brings to ``column``, on the queries ``where`` (all: None)
        that the column takes from that backend: its independent part, and each shared part with its key."""
        def pick(x: np.ndarray) -> np.ndarray:
            return np.nan_to_num(x[row]) if where is None else np.where(where, np.nan_to_num(x[row]), 0.0)

        zero = np.zeros(self.sd.shape[1])
        return [MeasurementError(column, pick(self.sd))] + [
            MeasurementError(column, zero, pick(x), key) for key, x in self.shared.items() if np.any(x[row])]

    @property
    def stated(self) -> np.ndarray:
        """Per backend: whether any of its queries states an error."""
        out: np.ndarray = (np.nan_to_num(self.sd) > 0).any(axis=1)
        for x in self.shared.values():
            out |= (np.nan_to_num(x) > 0).any(axis=1)
        return out


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its bootstrap confidence interval (``LEVEL``; shown by ``ipw.analysis.fmt.estimate``)."""

    value: float
    lo: float
    hi: float


NAN = Estimate(float("nan"), float("nan"), float("nan"))


# --- paired bootstrap of column sums and quantiles (ipw compare) ------------------------------------
#
# Every compare statistic is a ratio of column sums over queries, or a quantile. One bootstrap resample
# is one row of weights w (how often each query is drawn); the sums of all columns of all backends are
# then one matrix product, and every backend sees the same w, so differences are paired.

# the one set of defaults of compare's and check's paired bootstrap: the confidence level of every interval,
# and the number of resamples (``n_resamples``)
LEVEL = 0.95
MULTINOMIAL_MAX_N = 20_000  # above this, Poisson(1) weights (much cheaper, asymptotically equivalent)
MAX_BOOT = 2000
MIN_BOOT = 200
BOOT_WORK = 200_000_000  # resamples x items the default resample count aims at, above 100,000 items
CHUNK_BYTES = 128 * 2**20  # at most this much memory per chunk of weight rows


def n_resamples(n_items: int) -> int:
    """Default number of resamples: 2,000 up to 100,000 items, then ``max(200, 2e8 / n)``."""
    return int(min(MAX_BOOT, max(MIN_BOOT, BOOT_WORK // max(n_items, 1))))


def _poisson_table() -> np.ndarray:
    """Poisson(1) counts at the midpoints of 65,536 equal-probability bins (inverse CDF lookup)."""
    k = np.arange(20)
    pmf = np.exp(-1.0) / np.cumprod(np.maximum(k, 1))
    return np.searchsorted(np.cumsum(pmf), (np.arange(65536) + 0.5) / 65536, side="right").astype(np.float32)


_POISSON = _poisson_table()


def sum_dtype(n_items: int) -> type:
    """float64 sums up to ``MULTINOMIAL_MAX_N`` items; float32 above (half the memory and time)."""
    return np.float64 if n_items <= MULTINOMIAL_MAX_N else np.float32


def resample_weights(n_items: int, n_boot: int, *, seed: int = 0,
                     chunk_bytes: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
    """Yield bootstrap weight rows, shape (rows, n_items) of ``sum_dtype`` (small integers, exact), in
    chunks of at most ``chunk_bytes``. One buffer is reused: a chunk is overwritten by the next.

    Multinomial counts (``n_items`` draws with replacement: integer indices then ``bincount``) up to
    ``MULTINOMIAL_MAX_N`` items, Poisson(1) counts above (16 random bits each, looked up in a table).
    """
    rng = np.random.default_rng(seed)
    dtype = sum_dtype(n_items)
    rows = int(max(1, min(n_boot, chunk_bytes // (np.dtype(dtype).itemsize * max(n_items, 1)))))
    buf: np.ndarray = np.empty((rows, n_items), dtype=dtype)
    done = 0
    while done < n_boot:
        r = min(rows, n_boot - done)
        w = buf[:r]
        if n_items > MULTINOMIAL_MAX_N:
            flat = w.reshape(-1)
            for i in range(0, flat.size, 1 << 20):  # small blocks: no fresh memory per chunk
                bits = rng.integers(0, 65536, size=min(1 << 20, flat.size - i), dtype=np.uint16)
                np.take(_POISSON, bits, out=flat[i:i + len(bits)])
        else:
            group = max(1, (1 << 20) // max(n_items, 1))  # rows drawn at once: ~8 MB of indices
            for g in range(0, r, group):
                k = min(group, r - g)
                idx = rng.integers(0, n_items, size=(k, n_items)) + (np.arange(k) * n_items)[:, None]
                w[g:g + k] = np.bincount(idx.ravel(), minlength=k * n_items).reshape(k, n_items)
        yield w
        done += r


def bootstrap_method(n_items: int) -> str:
    return "poisson" if n_items > MULTINOMIAL_MAX_N else "multinomial"


def lower_quantile(values: np.ndarray, p: float) -> float:
    """The p-quantile of the finite values: the ceil(p·N)-th smallest (numpy's ``inverted_cdf``)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return float("nan")
    k = max(int(np.ceil(p * len(v))), 1) - 1
    return float(np.partition(v, k)[k])


TIE_ROW_MIN = 256  # a run of at least this many equal values in a window is summed as one indicator row


@dataclass(frozen=True)
class _Window:
    """The ranks around one quantile that a resample's quantile can reach: 4·sqrt(N) + 10 ranks either
    side (the rank's bootstrap standard deviation is at most sqrt(N)/2, so beyond 8 of them; clamped
    there). Everything below the window is counted through an indicator column of the sums.

    The window's values are its units, in ascending order: each distinct value's weight is the sum of its
    items' weights (a resample's quantile is the first unit whose cumulative weight reaches the rank, the
    same value as the first item that does).  Items of a value held by fewer than ``TIE_ROW_MIN`` items are
    gathered from the weights (``idx``, summed at ``starts``); a value held by more (0.0 TTFT of every query
    of a fake engine: a window of all N items) is one indicator row of a second product (``tie_rows``)."""

    p: float
    valid_row: int  # row of the finite-value indicator among the summed rows
    below_row: int  # row of the below-the-window indicator
    idx: np.ndarray  # items of the gathered values, sorted by value
    starts: np.ndarray  # where each gathered value's items begin in idx
    tie_rows: np.ndarray  # rows of the tied values' indicators, in the tie product
    order: np.ndarray  # units (gathered values, then tied values) in ascending order of value
    values: np.ndarray  # the units' values, ascending


def _windows(values: np.ndarray, ps: tuple[float, ...], valid_row: int, first_below_row: int, first_tie_row: int,
             ) -> tuple[list[_Window], list[np.ndarray], list[np.ndarray], list[float]]:
    """Windows of the quantiles ``ps`` of ``values`` (one partial sort for all of them), their
    below-the-window indicators, their tied values' indicators and the point quantiles."""
    valid = np.isfinite(values)
    finite = values[valid]
    n = len(finite)
    empty = np.zeros(0, int)
    if n == 0:
        return ([_Window(p, valid_row, first_below_row + i, empty, empty, empty, empty, np.zeros(0))
                 for i, p in enumerate(ps)], [np.zeros(len(values), bool)] * len(ps), [], [float("nan")] * len(ps))
    half = int(4 * np.sqrt(n)) + 10
    ranks = [max(int(np.ceil(p * n)), 1) - 1 for p in ps]  # the point quantiles' ranks (inverted_cdf)
    bounds = [(max(0, k - half), min(n - 1, k + half)) for k in ranks]
    part = np.partition(finite, sorted({r for b in bounds for r in b} | set(ranks)))
    windows: list[_Window] = []
    belows: list[np.ndarray] = []
    ties: list[np.ndarray] = []
    for i, (p, (lo, hi)) in enumerate(zip(ps, bounds)):
        if lo == 0 and hi == n - 1:
            inside, below = valid, np.zeros(len(values), bool)
        else:
            inside = valid & (values >= part[lo]) & (values <= part[hi])
            below = valid & (values < part[lo])
        belows.append(below)
        idx = np.flatnonzero(inside)
        idx = idx[np.argsort(values[idx], kind="stable")]
        v = values[idx]
        first = np.flatnonzero(np.r_[True, v[1:] != v[:-1]]) if len(v) else empty
        count = np.diff(np.r_[first, len(v)])
        tied = count >= TIE_ROW_MIN
        keep = np.repeat(~tied, count)
        kept_count = count[~tied]
        tie_rows = np.arange(first_tie_row + len(ties), first_tie_row + len(ties) + int(tied.sum()))
        ties += [values == v[f] for f in first[tied]]
        units = np.r_[v[first[~tied]], v[first[tied]]]
        windows.append(_Window(p, valid_row, first_below_row + i, idx[keep], np.r_[0, np.cumsum(kept_count)[:-1]].astype(int),
                               tie_rows, np.argsort(units, kind="stable"), np.sort(units)))
    return windows, belows, ties, [float(part[k]) for k in ranks]


@dataclass(frozen=True)
class Draws:
    """Bootstrap draws: weighted column sums and quantiles per resample, plus the point values."""

    sums: np.ndarray  # (n_boot, n_columns)
    quantiles: np.ndarray  # (n_boot, n_quantiles): one per (values, p), in the order given
    point_sums: np.ndarray  # (n_columns,), float64 sums of the original columns
    point_quantiles: np.ndarray  # (n_quantiles,)
    n_boot: int
    method: str  # multinomial | poisson
    measurement: tuple[int, ...] = ()  # the columns whose draws carry measurement error


def bootstrap_draws(columns: Any, quantiles: Any = (), *, n_boot: int, seed: int = 0, n_columns: int | None = None,
                    n_items: int | None = None, chunk_bytes: int = CHUNK_BYTES,
                    measurement: Sequence[MeasurementError] = ()) -> Draws:
    """Sums of ``columns`` (each shape (n,), finite) and quantiles (``quantiles``: pairs of values (n,),
    NaN where missing, and a sequence of p) over ``n_boot`` paired resamples of the n items.

    ``columns`` may be an iterator (then give ``n_columns`` and ``n_items``): each column is copied into
    one (rows x items) matrix as it comes, so the caller need not hold them all at once. Above
    ``MULTINOMIAL_MAX_N`` items that matrix and the resampled sums are float32 (0/1 and integer columns
    stay exact; value sums carry a relative error of ~1e-6, far inside any interval at that size); the
    point sums are always float64. A resample's quantile is the ceil(p·N)-th smallest of its drawn
    finite values, found exactly from the weights without sorting the resample.

    ``measurement``: columns whose items carry measurement error (:class:`MeasurementError`); each
    resample's sum of such a column gets its drawn error (module docstring).  The point sums do not.
    """
    if n_columns is None:
        columns = [np.asarray(c, dtype=float) for c in columns]
        n_columns = len(columns)
    if n_items is None:
        n_items = len(columns[0]) if n_columns else len(quantiles[0][0])
    k, n = n_columns, n_items
    quantiles = [(np.asarray(v, dtype=float), tuple(ps)) for v, ps in quantiles]
    with_nan = [bool(np.isnan(v).any()) for v, _ in quantiles]
    n_rows = k + 1 + sum(with_nan) + sum(len(ps) for _, ps in quantiles)
    xt: np.ndarray = np.empty((n_rows, n), dtype=sum_dtype(n))
    point_sums = np.empty(k)
    i = -1
    for i, c in enumerate(columns):
        c = np.asarray(c, dtype=float)
        point_sums[i] = c.sum()
        xt[i] = c
    if i != k - 1:
        raise ValueError(f"bootstrap_draws: got {i + 1} columns, expected {k}")
    ones_row, row = k, k + 1
    xt[ones_row] = 1.0
    windows: list[_Window] = []
    point_q: list[float] = []
    ties: list[np.ndarray] = []  # the tied values' indicators: a product of their own (xt is unchanged by them)
    for (values, ps), nan in zip(quantiles, with_nan):
        valid_row = ones_row
        if nan:
            valid_row, row = row, row + 1
            xt[valid_row] = np.isfinite(values)
        wins, belows, tied, points = _windows(values, ps, valid_row, row, len(ties))
        for below in belows:
            xt[row], row = below, row + 1
        windows += wins
        ties += tied
        point_q += points
    tx = np.array(ties, dtype=xt.dtype) if ties else None
    del ties
    sums = np.empty((n_boot, k))
    qs = np.full((n_boot, len(windows)), np.nan)
    errs = [(m.column, np.nan_to_num(np.asarray(m.sd, float)) ** 2,
             None if m.shared_sd is None else np.nan_to_num(np.asarray(m.shared_sd, float)), m.shared_key)
            for m in measurement if not m.negligible()]
    noise = np.random.default_rng([seed, 27])  # its own stream: the resample weights are unchanged by it
    start = 0
    for w in resample_weights(n, n_boot, seed=seed, chunk_bytes=chunk_bytes):
        rows = slice(start, start + len(w))
        s = (xt @ w.T).T.astype(np.float64)  # (rows, summed rows): one product for every sum of every backend
        t: Any = (tx @ w.T).T.astype(np.float64) if tx is not None else None  # the tied values' weights
        sums[rows] = s[:, :k]
        wf = w.astype(np.float64) if errs else w
        z: dict[str, np.ndarray] = {}  # one draw per shared source per resample, for every column it is in
        for column, var, shared, key in errs:
            add = np.zeros(len(w))
            if var.any():
                add += np.sqrt(wf @ var) * noise.standard_normal(len(w))  # each drawn copy its own error
            if shared is not None and shared.any():
                if not key:
                    draw = noise.standard_normal(len(w))
                elif key in z:
                    draw = z[key]
                else:
                    draw = z[key] = noise.standard_normal(len(w))
                add += (wf @ shared) * draw
            sums[rows, column] += add
        for j, win in enumerate(windows):
            if len(win.values) == 0:
                continue
            total = s[:, win.valid_row]
            need = np.maximum(np.ceil(win.p * total), 1.0)  # weights and their sums are exact integers
            gathered = np.add.reduceat(w[:, win.idx], win.starts, axis=1) if len(win.idx) else w[:, :0]
            units = np.concatenate([gathered, t[:, win.tie_rows]], axis=1)[:, win.order] if len(win.tie_rows) else gathered
            cum = s[:, win.below_row][:, None] + np.cumsum(units, axis=1)
            reached = cum >= need[:, None]
            pos = np.where(reached.any(axis=1), reached.argmax(axis=1), len(win.values) - 1)
            qs[rows, j] = np.where(total > 0, win.values[pos], np.nan)
        start += len(w)
    return Draws(sums, qs, point_sums, np.asarray(point_q, dtype=float), n_boot, bootstrap_method(n),
                 tuple(dict.fromkeys(c for c, _, _, _ in errs)))


def bounds(draws: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The percentile interval of bootstrap draws at ``level`` (NaN, NaN when no draw is finite)."""
    draws = np.asarray(draws, dtype=float)
    draws = draws[np.isfinite(draws)]
    if len(draws) == 0:
        return float("nan"), float("nan")
    alpha = (1 - level) / 2
    lo, hi = np.quantile(draws, [alpha, 1 - alpha])
    return float(lo), float(hi)


def interval(value: float, draws: np.ndarray, level: float = LEVEL) -> Estimate:
    """A percentile interval from bootstrap draws of a statistic whose point value is ``value``."""
    if not np.isfinite(value):
        return Estimate(float(value), float("nan"), float("nan"))
    return Estimate(float(value), *bounds(draws, level))
