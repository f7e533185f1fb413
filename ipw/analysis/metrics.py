"""The metric contract (docs/ARCHITECTURE.md, 'Energy readings and the metric contract'), defined once: ``ipw run``'s summary, ``compare``, ``report``,
``check`` and the routing analysis all compute their numbers from this table.

Per query (repeats averaged first): ``correct`` in [0, 1] over its scored records, where an errored
record counts 0 and an unscored one (``correct`` None: a ``judge`` item no judge graded) is left out; a
query with no scored record is *unscored* and counts in no accuracy, IPJ, IPW or coverage (never
wrong); ``win_tie`` (1/0 vs a reference backend's answer) over its judged records; its error share (errored records / records); its energy, window, tokens and cost
where they were measured (otherwise the query is *missing* from the energy sums, never counted 0).
Every metric is then a ratio of per-query column sums, or a lower quantile (the ceil(p·N)-th smallest
of the per-query values), so the same definition serves a point value and every bootstrap resample
(``ipw.analysis.stats.bootstrap_draws``) and paired differences between runs.

Columns (per backend, one value per query; ``query_columns``), each summed over the queries:
  queries: 1; correct: correct or 0; scored / unscored: 1 if it is; error_share: its errored records' share;
  error_records: its errored records; win_tie: win/tie or 0; judged: 1 if a judge compared it;
  with_energy: 1 if it has energy; energy_j: energy (J) or 0; window_s_with_energy, output_tokens_with_energy:
  its window (s) and output tokens where it has energy; prefill_j, decode_j: its phases' J where both are
  known, prompt_tokens_with_phases, output_tokens_with_phases: its tokens there; cost_usd, with_cost: USD and
  1 where a cost is known; carbon_g_per_kwh: the carbon intensity the backend's run carries (the same for
  every query; absent: no carbon metric); output_tokens_with_span, wall_share_s: output tokens and the query's share of its
  level's wall span (s) where the span is known.
Quantiles: ``ttft_p50``, ``ttft_p95``, ``latency_p50``, ``latency_p95`` of the per-query means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, cast

import numpy as np

from ipw.analysis.fmt import COUNT, NUMBER, PERCENT, Format

QUANTILES = (("ttft", "ttft_s", (0.5, 0.95)), ("latency", "latency_s", (0.5, 0.95)))  # key, per-query value, ps


def _ratio(a: Any, b: Any) -> Any:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray(a, dtype=float) / np.asarray(b, dtype=float)


J_PER_KWH = 3.6e6


def _carbon_per_query(g: Mapping[str, Any]) -> Any:
    """J per query x the carbon intensity (gCO2e/kWh; its column holds it for every query, so its sum over
    the queries is it times their count, in every resample)."""
    return _ratio(g["energy_j"], g["with_energy"]) * _ratio(g["carbon_g_per_kwh"], g["queries"]) / J_PER_KWH


@dataclass(frozen=True)
class Metric:
    name: str  # the key in compare's JSON and the name in ``ipw check --fail-if``
    label: str  # the row of the human tables
    unit: str
    better: str  # "higher" | "lower" | "" (shown, never gated)
    counts: str  # which queries count
    value: Callable[[Mapping[str, Any]], Any]  # from column sums (a point, or one per resample)
    format: Format = NUMBER  # how its values are shown (ipw.analysis.fmt), and so its changes' unit
    summary: bool = False  # a column of ``ipw run``'s summary table (``--full-table``: every metric)
    aliases: tuple[str, ...] = ()  # older ``--fail-if`` names
    energy: bool = False  # computed from energy (an estimated energy makes it estimated)
    needs: str = ""  # the per-query value it cannot do without: correct (a score) or win_tie (a judge's verdict)
    timed: bool = False  # computed from wall-clock time (latency, TTFT, throughput)

    @property
    def follows_machine(self) -> bool:
        """Energy and time follow the machine's speed and load, which drift during a job and shift a whole block
        of queries at once (``ipw check --rerun`` judges them over block pairs); answers, errors, tokens and
        costs are each query's own."""
        return self.energy or self.timed

    @property
    def change_unit(self) -> str:
        """A change is relative (%), or in percentage points (pp) for a share."""
        return self.format.change_unit


ALL = "every query"
SCORED = "scored queries (an errored one counts incorrect; an unscored one is left out)"
WITH_ENERGY = "queries with energy (the others are listed as missing)"
METRICS: tuple[Metric, ...] = (
    Metric("accuracy", "accuracy", "", "higher", SCORED, lambda g: _ratio(g["correct"], g["scored"]), format=PERCENT,
           summary=True, needs="correct"),
    Metric("error_rate", "error rate", "", "lower", ALL, lambda g: _ratio(g["error_share"], g["queries"]),
           format=PERCENT, aliases=("errors",)),
    Metric("energy_per_query_j", "J/query", "J", "lower", WITH_ENERGY,
           lambda g: _ratio(g["energy_j"], g["with_energy"]), summary=True, aliases=("energy_per_query",), energy=True),
    Metric("ipj", "IPJ (1/J)", "1/J", "higher", "accuracy over the scored queries / J per query",
           lambda g: _ratio(_ratio(g["correct"], g["scored"]), _ratio(g["energy_j"], g["with_energy"])), summary=True,
           energy=True, needs="correct"),
    Metric("ipw", "IPW (1/W)", "1/W", "higher", "accuracy over the scored queries / mean power",
           lambda g: _ratio(_ratio(g["correct"], g["scored"]), _ratio(g["energy_j"], g["window_s_with_energy"])),
           energy=True, needs="correct"),
    Metric("mean_power_w", "mean W", "W", "lower", WITH_ENERGY,
           lambda g: _ratio(g["energy_j"], g["window_s_with_energy"]), energy=True),
    Metric("j_per_output_token", "J/out token", "J/token", "lower", WITH_ENERGY,
           lambda g: _ratio(g["energy_j"], g["output_tokens_with_energy"]), aliases=("j_per_token",), energy=True),
    Metric("j_per_prefill_token", "J/prefill token", "J/token", "lower", "queries with phases",
           lambda g: _ratio(g["prefill_j"], g["prompt_tokens_with_phases"]), energy=True),
    Metric("j_per_decode_token", "J/decode token", "J/token", "lower", "queries with phases",
           lambda g: _ratio(g["decode_j"], g["output_tokens_with_phases"]), energy=True),
    Metric("prefill_energy_share", "prefill share of J", "", "", "queries with phases",
           lambda g: _ratio(g["prefill_j"], g["prefill_j"] + g["decode_j"]), format=PERCENT, energy=True),
    Metric("output_tokens_per_s", "output tok/s", "tokens/s", "higher",
           "queries with a time window: output tokens over the wall span of the backend's (level's) records, "
           "first start to last end, on one machine's clock",
           lambda g: _ratio(g["output_tokens_with_span"], g["wall_share_s"]), timed=True),
    Metric("ttft_p50_s", "TTFT p50 (s)", "s", "lower", "queries with a TTFT", lambda g: g["ttft_p50"],
           aliases=("ttft_p50",), timed=True),
    Metric("ttft_p95_s", "TTFT p95 (s)", "s", "lower", "queries with a TTFT", lambda g: g["ttft_p95"], timed=True),
    Metric("latency_p50_s", "latency p50 (s)", "s", "lower", "queries with a latency", lambda g: g["latency_p50"], timed=True),
    Metric("latency_p95_s", "latency p95 (s)", "s", "lower", "queries with a latency", lambda g: g["latency_p95"], timed=True),
    Metric("errors", "errors", "records", "", "every record that ended in an error", lambda g: g["error_records"],
           format=COUNT, summary=True),
    Metric("unscored", "unscored", "queries", "", "queries without a score (a judge item no judge graded)",
           lambda g: g["unscored"], format=COUNT),
    Metric("win_tie_rate", "win/tie vs reference", "", "higher", "queries a judge compared with the reference "
           "backend's answer", lambda g: _ratio(g["win_tie"], g["judged"]), format=PERCENT,
           needs="win_tie"),
    Metric("cost_per_query_usd", "USD/query", "USD", "lower", "queries with a cost",
           lambda g: _ratio(g["cost_usd"], g["with_cost"])),
    Metric("gco2e_per_query", "gCO2e/query", "gCO2e", "lower", "queries with energy, at the carbon intensity the "
           "run carries (ipw.carbon; none: n/a)", lambda g: _carbon_per_query(g), energy=True),
    Metric("gco2e_per_correct", "gCO2e/correct", "gCO2e", "lower", "gCO2e per query / accuracy over the scored "
           "queries (per correct answer)", lambda g: _ratio(_carbon_per_query(g), _ratio(g["correct"], g["scored"])),
           energy=True, needs="correct"),
)
BY_NAME = {m.name: m for m in METRICS}


def gated_metric(name: str) -> Metric | None:
    """The metric a ``--fail-if`` name means (its own name or an older alias), or None."""
    for m in METRICS:
        if m.better and name in (m.name, *m.aliases):
            return m
    return None


def values(g: Mapping[str, Any]) -> dict[str, Any]:
    """Every metric from one backend's column sums and quantiles ``g``; a metric whose columns are
    absent (no phases, no cost) is NaN, shaped like the sums."""
    nan = np.full(np.shape(g["queries"]), np.nan)
    out = {}
    with np.errstate(invalid="ignore", divide="ignore"):
        for m in METRICS:
            try:
                out[m.name] = m.value(g)
            except KeyError:
                out[m.name] = nan
    return out


def query_columns(v: Mapping[str, np.ndarray | None]) -> dict[str, Callable[[], np.ndarray] | str]:
    """One backend's per-query columns (see the module docstring) from its per-query values ``v``
    (correct (NaN: unscored), error_share, errors, energy_j, duration_s, completion_tokens, and where
    known prompt_tokens, prefill_energy_j, decode_energy_j, cost_usd, win_tie (NaN: not judged),
    wall_share_s (NaN: no time window)): name ->
    a function that makes the column, or the name of a column known to be equal (made once)."""
    r = cast(Mapping[str, np.ndarray], v)  # the values read with [] below are never None (PerQuery's arrays)
    n = len(r["correct"])
    h = ~np.isnan(r["energy_j"])
    full = bool(h.all())
    scored = ~np.isnan(r["correct"])
    cols: dict[str, Callable[[], np.ndarray] | str] = {
        "queries": lambda: np.ones(n),
        "correct": lambda: np.nan_to_num(r["correct"]),
        "scored": "queries" if scored.all() else (lambda: scored.astype(float)),
        "unscored": lambda: (~scored).astype(float),
        "error_share": lambda: r["error_share"],
        "error_records": lambda: r["errors"],
        "with_energy": "queries" if full else (lambda: h.astype(float)),
        "energy_j": lambda: np.where(h, r["energy_j"], 0.0),
        "window_s_with_energy": lambda: np.where(h, np.nan_to_num(r["duration_s"]), 0.0),
        "output_tokens_with_energy": lambda: np.where(h, np.nan_to_num(r["completion_tokens"]), 0.0),
    }
    pre, dec = v.get("prefill_energy_j"), v.get("decode_energy_j")
    if pre is not None and dec is not None:
        hp = ~np.isnan(pre) & ~np.isnan(dec)
        if hp.any():  # phases: sums over the queries that have them
            cols["prefill_j"] = lambda: np.where(hp, pre, 0.0)
            cols["decode_j"] = lambda: np.where(hp, dec, 0.0)
            cols["prompt_tokens_with_phases"] = lambda: np.where(hp, np.nan_to_num(r["prompt_tokens"]), 0.0)
            cols["output_tokens_with_phases"] = lambda: np.where(hp, np.nan_to_num(r["completion_tokens"]), 0.0)
    wall = v.get("wall_share_s")
    if wall is not None:  # throughput: output tokens over the level's wall span, shared per record
        hs = ~np.isnan(wall)
        cols["output_tokens_with_span"] = lambda: np.where(hs, np.nan_to_num(r["completion_tokens"]), 0.0)
        cols["wall_share_s"] = lambda: np.where(hs, wall, 0.0)
    win = v.get("win_tie")
    if win is not None:
        cols["win_tie"] = lambda: np.nan_to_num(win)
        cols["judged"] = lambda: (~np.isnan(win)).astype(float)
    carbon = v.get("carbon_g_per_kwh")  # the backend's carbon intensity, one value for every query (None: none)
    if carbon is not None:
        cols["carbon_g_per_kwh"] = lambda: np.asarray(carbon, dtype=float)
    cost = v.get("cost_usd")
    if cost is not None:
        hc = ~np.isnan(cost)
        cols["cost_usd"] = lambda: np.nan_to_num(cost)
        cols["with_cost"] = "queries" if hc.all() else (lambda: hc.astype(float))
    return cols


def quantile_inputs(v: Mapping[str, np.ndarray]) -> list[tuple[str, np.ndarray, tuple[float, ...]]]:
    """The per-query values whose lower quantiles are metrics: (key prefix, values, ps)."""
    return [(key, v[column], ps) for key, column, ps in QUANTILES]


def quantile_keys() -> list[str]:
    """The names of the quantiles, in the order of ``quantile_inputs`` flattened."""
    return [f"{key}_p{round(p * 100)}" for key, _, ps in QUANTILES for p in ps]


def point_values(v: Mapping[str, np.ndarray | None]) -> dict[str, float]:
    """Every metric of one backend's per-query values ``v`` (see ``query_columns``), without intervals."""
    from ipw.analysis.stats import lower_quantile

    cols = query_columns(v)
    made = {k: make() for k, make in cols.items() if not isinstance(make, str)}
    g: dict[str, Any] = {k: float(made[make if isinstance(make, str) else k].sum()) for k, make in cols.items()}
    for key, x, ps in quantile_inputs(cast(Mapping[str, np.ndarray], v)):  # ttft_s, latency_s: never None
        g.update((f"{key}_p{round(p * 100)}", lower_quantile(x, p)) for p in ps)
    return {k: float(x) for k, x in values(g).items()}
