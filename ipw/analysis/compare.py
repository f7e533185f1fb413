"""``ipw compare``'s numbers: runs side by side with paired bootstrap CIs, and routing coverage
(docs/ARCHITECTURE.md, 'Energy readings and the metric contract'), computed from the per-query matrix of ``ipw.analysis.load``.

Every metric is a ratio of column sums or a quantile (``ipw.analysis.metrics``), bootstrapped with one
set of resample weights for all backends (``ipw.analysis.stats.bootstrap_draws``), so differences
against the reference are paired. Routing numbers come from ``ipw.analysis.routing`` (pure functions
over the same matrix). Rendering (JSON, CSV, tables) is ``ipw.analysis.render``.

Energy of different qualities is never added together: each backend's quality stays beside its
numbers, differences between backends of different quality are flagged, and routed totals carry the
worst quality of their parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence, cast

import numpy as np

from ipw.analysis import metrics as metric_table
from ipw.analysis.basis import available, carbon_rows, check_basis, intensities, parse_pue, under_basis, with_pue
from ipw.analysis.cascade import Cascade, cascades
from ipw.analysis.load import BackendInfo, PerQuery, RunInfo, FIELDS, energy_errors, judge_lines, level_label, load
from ipw.analysis.routing import (ROUTER_ACCURACY, OracleQueries, QueryMatrix, Routing, oracle_queries, resolve_roles,
                                  route, solved)
from ipw.analysis.serving import (Deadline, LevelPick, SteadyLevel, by_backend, parse_deadline, pick_levels,
                                  serving_level, shown, steady_windows)
from ipw.analysis.stats import LEVEL, Draws, Estimate, MeasurementError, bootstrap_draws, interval, n_resamples
from ipw.errors import ParameterError
from ipw.limits import out_of_range
from ipw.analysis.fit import LinearFit, fit_linear
from ipw.telemetry.hardware import hardware_note

J_PER_KWH = 3.6e6


@dataclass(frozen=True)
class JudgeRow:
    """What a run's judge said about one backend's answers, over one category ("" = all of them), and
    what the judge itself cost (its energy is in no backend's numbers)."""

    run_id: str
    judge: str  # the judge backend's name
    grading: str  # reference | pairwise | vs-backend:NAME
    prompt_version: str
    backend: str
    category: str
    records: int
    judged: int  # records the judge compared (errors and empty outputs are not judged); what it decided is
    # in the records (correct, or win_tie: the metrics win_tie_rate and the routing's coverage show it)
    orders_agree: float | None  # share of the two-order verdicts that parsed in which both orders say the same
    unparsed: int  # records with at least one unreadable reply
    calls: int
    energy_j: float | None  # the judge's own energy; None when a call's is unavailable
    energy_quality: str


def judge_rows(runs: Sequence[RunInfo], backends: Sequence[str]) -> tuple[JudgeRow, ...]:
    """Per judged run, per backend of ``backends``: the judge's verdicts overall (category "") and per
    category, from the run's judge.jsonl."""
    from ipw.grading.spec import orders_agree
    from ipw.telemetry.base import worst_quality

    out = []
    for run in runs:
        lines = judge_lines(run)
        for backend in dict.fromkeys(x.backend for x in lines):
            if backend not in backends:
                continue
            mine = [x for x in lines if x.backend == backend]
            cats = sorted({x.category for x in mine})
            for cat in [""] + ([] if cats == [""] else cats):  # all, then each category (when there are any)
                group = [x for x in mine if not cat or x.category == cat]
                judged = [x for x in group if x.judge_calls]
                agree = [a for a in (orders_agree(x.verdicts) for x in judged) if a is not None]
                energies = [x.judge_energy_j for x in judged]
                out.append(JudgeRow(
                    run.run_id, mine[0].judge, mine[0].grading, mine[0].prompt_version, backend, cat,
                    len(group), len(judged),
                    sum(agree) / len(agree) if agree else None,
                    sum("unparsed" in x.verdicts for x in group), sum(x.judge_calls for x in group),
                    None if not judged or None in energies else float(sum(e for e in energies if e is not None)),
                    worst_quality([q for x in judged for q in (x.judge_energy_quality or "").split(",") if q])))
    return tuple(out)


@dataclass(frozen=True)
class BasisView:
    """One energy basis (ipw.analysis.basis): each backend's J/query and gCO2e per correct answer, and the
    routing's energy saved (the oracle's, and the α-router's: α x the oracle's), with CIs."""

    basis: str
    energy_per_query_j: dict[str, Estimate]
    gco2e_per_correct: dict[str, Estimate]
    oracle_energy_saved_fraction: Estimate | None
    router_energy_saved_fraction: Estimate | None
    unavailable: tuple[str, ...] = ()  # backends without energy on this basis


@dataclass(frozen=True)
class Comparison:
    """Every number of ``ipw compare`` (rendered by ``ipw.analysis.render``)."""

    runs: tuple[RunInfo, ...]
    backends: tuple[BackendInfo, ...]  # roles resolved
    reference: str
    n_queries: int
    common_queries: bool
    n_boot: int
    seed: int
    method: str
    metrics: dict[str, dict[str, Estimate]]  # label -> metric key -> estimate
    vs_reference: dict[str, dict[str, Estimate]]  # non-reference label -> metric key -> backend - reference
    routing: Routing | None
    # local_coverage, win_tie_coverage, oracle_accuracy, oracle_<energy|latency|cost>_saved_fraction, power_envelope_<i>
    routing_ci: dict[str, Estimate]
    notes: tuple[str, ...] = field(default=())
    measurement: str = ""  # what the CIs carry besides resampling queries (measurement error, or why not)
    with_measurement_error: bool = False  # the energy CIs draw each query's stated measurement error
    models: dict[str, dict[str, LinearFit]] = field(default_factory=dict)  # label -> energy|latency -> OLS fit
    judge: tuple[JudgeRow, ...] = ()  # the judge's verdicts and cost, per judged run and backend (and category)
    hardware_note: str | None = None  # the runs were measured on different kinds of machine (the report's banner)
    deadline: Deadline | None = None  # --deadline: the latency bound of the energy-optimal level
    level_picks: tuple[LevelPick, ...] = ()  # per backend, its energy-optimal level under the deadline
    steady: dict[str, SteadyLevel | None] = field(default_factory=dict)  # label -> its level's steady window
    query_set_note: str = ""  # the note that the runs' query sets differ and the numbers cover the shared queries
    # per local backend whose records carry mean_logprob: the cascade in front of the reference, out of sample
    cascade: tuple[Cascade, ...] = ()
    energy_basis: str = "chip"  # which joules every energy number compares (ipw.analysis.basis)
    carbon: dict[str, Any] = field(default_factory=dict)  # label -> its ipw.carbon.CarbonIntensity, or None
    bases: tuple["BasisView", ...] = ()  # the energy on each available basis side by side (chip, facility, node)

    def quality(self, label: str) -> str:
        """Backend ``label``'s energy quality (the worst among its records with energy)."""
        return next(b.energy_quality for b in self.backends if b.label == label)

    def estimated(self, label: str) -> bool:
        """Backend ``label``'s energy numbers rest on estimated energy (a model, not a sensor)."""
        return self.quality(label) == "estimated"

    @property
    def routing_estimated(self) -> bool:
        """The routing's energy numbers involve a backend with estimated energy."""
        r = self.routing
        return r is not None and any(self.estimated(x) for x in (r.cloud, *r.local))



# --- names and prices ---------------------------------------------------------------------------------

def resolve_levels(name: str, backends: Sequence[BackendInfo], parameter: str) -> list[str]:
    """The labels ``name`` means: a label, or an unambiguous backend name (``NAME``: all its concurrency
    levels; ``NAME@cN``: that level) without the run_id/ that labels carry when names occur in several runs."""
    if any(b.label == name for b in backends):
        return [name]
    hits = [b for b in backends if name in (b.backend, level_label(b.backend, b.concurrency))]
    runs = sorted({b.run_id for b in hits})
    if len(runs) == 1:
        return [b.label for b in hits]
    if hits:
        raise ParameterError((parameter,), f" {name!r} is in several runs; name one of: "
                             f"{', '.join(b.label for b in hits)}")
    raise ParameterError((parameter,), f" {name!r}: no such backend (backends: {', '.join(b.label for b in backends)})")


def _reference(name: str | None, infos: Sequence[BackendInfo], roles: Sequence[str]) -> tuple[str, str | None]:
    """The reference's label, and a note when it is one of several levels of a backend: ``name``
    (--reference), else the first cloud-role backend, else the first backend; of a backend measured at
    several concurrency levels, the highest (what a server runs at under load)."""
    if name is not None:
        labels = resolve_levels(name, infos, "reference")
    else:
        first = next((b for b, r in zip(infos, roles) if r == "cloud"), infos[0])
        labels = [b.label for b in by_backend(infos)[(first.run_id, first.backend)]]
    if len(labels) == 1:
        return labels[0], None
    ref = serving_level([b for b in infos if b.label in labels]).label
    return ref, f"routing reference: {ref} (highest concurrency measured; --reference to choose)"


def parse_api_price(text: str) -> tuple[str, float, float]:
    """``NAME=IN,OUT``: USD per million input and output tokens."""
    name, eq, prices = text.partition("=")
    try:
        pin, pout = (float(x) for x in prices.split(","))
    except ValueError:
        pin = pout = float("nan")
    if not eq or not name or not (math.isfinite(pin) and math.isfinite(pout)) or pin < 0 or pout < 0:
        raise ParameterError(("api_prices",), f" {text!r}: expected NAME=IN,OUT (USD per million input and output "
                             "tokens)")
    return name, pin, pout


def cost_matrix(pq: PerQuery, labels: Sequence[str], roles: Sequence[str], usd_per_kwh: float | None,
                api_prices: dict[str, tuple[float, float]]) -> np.ndarray | None:
    """USD per query (backends x queries): API token prices where given, else energy x electricity price
    for local backends; NaN where neither applies; None when no price was given at all."""
    if usd_per_kwh is None and not api_prices:
        return None
    cost = np.full(pq.correct.shape, np.nan)
    for j, (label, role) in enumerate(zip(labels, roles)):
        if label in api_prices:
            pin, pout = api_prices[label]
            assert pq.prompt_tokens is not None  # load(prompt_tokens=True): a field of every record
            cost[j] = (pq.prompt_tokens[j] * pin + pq.completion_tokens[j] * pout) / 1e6
        elif usd_per_kwh is not None and role == "local":
            cost[j] = pq.energy_j[j] / J_PER_KWH * usd_per_kwh
    return cost


# --- the comparison -----------------------------------------------------------------------------------

def _ratio(a: Any, b: Any) -> Any:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray(a, dtype=float) / np.asarray(b, dtype=float)


def _metric_values(s: np.ndarray, q: np.ndarray, col: dict[Any, int], j: int) -> dict[str, np.ndarray]:
    """Backend j's metrics (ipw.analysis.metrics) from sums ``s`` (shape (..., n_columns)) and quantiles ``q``
    (shape (..., n_quantiles))."""
    g = {key[1]: s[..., i] for key, i in col.items() if isinstance(key, tuple) and key[0] == j}
    keys = metric_table.quantile_keys()
    g.update((k, q[..., j * len(keys) + i]) for i, k in enumerate(keys))
    return metric_table.values(g)


def backend_values(pq: PerQuery, j: int, cost: np.ndarray | None = None,
                   carbon: np.ndarray | None = None) -> dict[str, np.ndarray | None]:
    """Backend j's per-query values, as ipw.analysis.metrics takes them; ``carbon``: each backend's carbon
    intensity (gCO2e/kWh, NaN: none)."""
    v = {k: (None if getattr(pq, k) is None else getattr(pq, k)[j]) for k in FIELDS}
    v["cost_usd"] = None if cost is None else cost[j]
    v["carbon_g_per_kwh"] = (None if carbon is None or np.isnan(carbon[j]) else
                             np.full(pq.correct.shape[1], carbon[j]))
    return v


class _Columns:
    """The bootstrap's columns by name, each made only when the bootstrap copies it in; a column known
    to equal another one (e.g. "has energy" when every query has energy) is stored once."""

    def __init__(self) -> None:
        self.index: dict[Any, int] = {}
        self.makers: list[Any] = []

    def add(self, name: Any, make: Any = None, same_as: Any = None) -> None:
        if same_as is not None:
            self.index[name] = self.index[same_as]
        else:
            self.index[name] = len(self.makers)
            self.makers.append(make)

    def add_backend(self, j: int, v: dict[str, np.ndarray | None]) -> None:
        """Backend j's columns (ipw.analysis.metrics.query_columns), keyed (j, name)."""
        for name, make in metric_table.query_columns(v).items():
            if name == "queries" and "one" in self.index:
                self.add((j, name), same_as="one")
            elif isinstance(make, str):
                self.add((j, name), same_as=(j, make))
            else:
                self.add((j, name), make)

    def made(self) -> Iterator[np.ndarray]:
        for make in self.makers:
            yield make()


def _columns(pq: PerQuery, cost: np.ndarray | None, oq: OracleQueries | None, ri: int,
             envelope: Sequence[list[int]] = (), carbon: np.ndarray | None = None) -> _Columns:
    """Per backend j: its metric columns (ipw.analysis.metrics.query_columns); ("route", ...) the oracle's
    per-query values; ("envelope", i, ...) the coverage of the local backends ``envelope[i]``."""
    cols = _Columns()
    cols.add("one", lambda: np.ones(pq.correct.shape[1]))
    for j in range(pq.correct.shape[0]):
        cols.add_backend(j, backend_values(pq, j, cost, carbon))
    if oq is not None:
        same = {"cloud_energy": (ri, "energy_j"), "cloud_cost": (ri, "cost_usd")}
        for key, x in (("covered", oq.covered), ("scored", oq.scored), ("judged", oq.judged),
                       ("win_covered", oq.win_covered & oq.judged), ("correct", np.nan_to_num(oq.correct)),
                       ("has_correct", ~np.isnan(oq.correct)), ("energy", oq.energy_j),
                       ("cloud_energy", oq.cloud_energy_j), ("latency", oq.latency_s),
                       ("cloud_latency", oq.cloud_latency_s), ("cost", oq.cost_usd), ("cloud_cost", oq.cloud_cost_usd)):
            if x is None or np.isnan(x).any():
                continue  # unknown somewhere: no interval (the point value says so too)
            cols.add(("route", key), lambda x=x: x.astype(float), same_as=same.get(key))
    for i, fits in enumerate(envelope):
        sub = pq.correct[fits]  # backends x queries
        cols.add(("envelope", i, "hit"), lambda sub=sub: solved(sub).any(axis=0).astype(float))
        cols.add(("envelope", i, "among"), lambda sub=sub: (~np.isnan(sub).all(axis=0)).astype(float))
    return cols


def measurement_errors(pq: PerQuery, col: dict[Any, int], labels: Sequence[str], oq: OracleQueries | None = None,
                       ) -> tuple[list[MeasurementError], str]:
    """Each backend's energy column with its queries' measurement errors (``ipw.analysis.load.energy_errors``),
    and the routed energy with the errors of the backend each query goes to; and one line that says what the
    CIs carry.  A shared error is one draw for every column with its source's key (the same CPU model or
    device on one machine): it cancels in every saving and paired difference between backends that share it.
    Independent errors, and shared ones of different sources, are drawn apart; the routed and the cloud-only
    energy draw their independent errors apart (a query routed to the cloud is one measurement in both):
    conservative for the savings."""
    errors = energy_errors(pq)
    if errors is None:
        return [], "CIs resample queries only: these runs state no measurement uncertainty (made before it was recorded)"
    out = [e for j in range(pq.energy_j.shape[0]) if (j, "energy_j") in col for e in errors.of(col[(j, "energy_j")], j)]
    if oq is not None and ("route", "energy") in col:
        out += [e for j in np.unique(oq.choice) for e in errors.of(col[("route", "energy")], int(j), oq.choice == j)]
    stated = int(errors.stated.sum())
    return out, (f"energy CIs include measurement error (each query's ±90% energy interval drawn on every resample; "
                 f"{stated} of {pq.energy_j.shape[0]} backends state one; {shared_note(pq, labels)})")


def shared_note(pq: PerQuery, labels: Sequence[str]) -> str:
    """Which shared errors cancel: those one source brings to several backends (drawn once for all of them),
    and that the others are drawn per backend."""
    if not pq.shared_sd_j:
        return "no shared error stated"
    common = []
    for key, x in pq.shared_sd_j.items():
        rows = np.flatnonzero(np.nan_to_num(x).any(axis=1))
        if len(rows) > 1:
            what = "the CPU model's W/core" if " model.cpu" in key else f"the uncalibrated {key.split(' ', 1)[-1]}"
            common.append(f"{what} is common to {', '.join(labels[int(j)] for j in rows)} (one machine): drawn once, it "
                          "cancels in their savings and differences")
    return "; ".join(common + ["other shared errors (a sensor session's calibration, another machine's or "
                               "device's) are drawn per backend"])


def quantiles_of(pq: PerQuery) -> list[tuple[np.ndarray, tuple[float, ...]]]:
    """The quantile inputs of every backend, in ``_metric_values``' order."""
    # the quantiles' values (ttft_s, latency_s) are never None in a PerQuery
    return [(x, ps) for j in range(pq.correct.shape[0])
            for _, x, ps in metric_table.quantile_inputs(cast(Mapping[str, np.ndarray], backend_values(pq, j)))]


def compare(paths: Sequence[str | Path], *, reference: str | None = None, common_queries: bool = False,
            local: Sequence[str] = (), cloud: Sequence[str] = (), router_accuracy: float = ROUTER_ACCURACY,
            n_boot: int | None = None, seed: int = 0, usd_per_kwh: float | None = None,
            api_prices: Sequence[str] = (), deadline: str | None = None, energy_basis: str = "chip",
            carbon_intensity: float | None = None, grid_region: str | None = None,
            pue: Sequence[str] = ()) -> Comparison:
    """Compare the backends of ``paths`` (run folders) on their queries; see the module docstring.
    ``deadline`` (``METRIC=VALUE``, ``ipw.analysis.serving.parse_deadline``) picks each backend's
    energy-optimal concurrency level within it. ``energy_basis``: which joules (ipw.analysis.basis);
    ``carbon_intensity`` (gCO2e/kWh) or ``grid_region``: re-price every run's carbon at it. ``pue``:
    ``NAME=PUE`` (a backend, or a role: local, cloud) over the PUE the runs recorded. A bad argument is a
    ``ipw.errors.ParameterError`` naming the parameter (``n_boot 0: must be at least 1``); ``ipw compare`` and
    ``ipw report`` name the flag instead (``ipw.options.naming_flags``)."""
    check_basis(energy_basis)
    pue_given = [parse_pue(x) for x in pue]
    if carbon_intensity is not None or grid_region is not None:  # a bad value or zone (or '') fails before any run is read
        intensities((), (), carbon_intensity, grid_region)
    if problem := out_of_range(router_accuracy, low=0.0, high=1.0):  # a share of queries
        raise ParameterError(("router_accuracy",), f": {problem}")
    if n_boot is not None and n_boot < 1:
        raise ParameterError(("n_boot",), f" {n_boot}: must be at least 1")
    if usd_per_kwh is not None and not usd_per_kwh >= 0:
        raise ParameterError(("usd_per_kwh",), f" {usd_per_kwh}: must be a price >= 0")
    prices_raw = [parse_api_price(p) for p in api_prices]
    bound = None if deadline is None else parse_deadline(deadline)
    runs, infos, pq, notes = load(paths, common_queries=common_queries, prompt_tokens=True)
    labels = tuple(i.label for i in infos)
    plain = tuple(i.backend for i in infos)

    def names(xs: Sequence[str], parameter: str) -> list[str]:
        return [x for n_ in xs for x in resolve_levels(n_, infos, parameter)]

    roles = resolve_roles(labels, [i.role for i in infos], local=names(local, "local"), cloud=names(cloud, "cloud"))
    infos = tuple(BackendInfo(**{**i.__dict__, "role": r}) for i, r in zip(infos, roles))
    infos = with_pue(infos, pue_given, lambda name: names([name], "pue"))
    chip_pq = pq
    pq, basis_notes = under_basis(pq, infos, energy_basis)
    notes += basis_notes
    carbon, carbon_notes = intensities(runs, infos, carbon_intensity, grid_region)
    notes += carbon_notes
    carbon_g = carbon_rows(carbon)
    ref, ref_note = _reference(reference, infos, roles)
    if ref_note:
        notes.append(ref_note)
    prices = {x: (pin, pout) for n_, pin, pout in prices_raw for x in names([n_], "api_prices")}
    cost = cost_matrix(pq, labels, roles, usd_per_kwh, prices)
    m, n = pq.correct.shape
    n_boot = n_boot or n_resamples(n)
    ri = labels.index(ref)

    # routing: the reference is the cloud; locals are the local-role backends other than it (and other
    # than its other concurrency levels)
    local_idx = [j for j in range(m) if roles[j] == "local"
                 and (infos[j].run_id, infos[j].backend) != (infos[ri].run_id, infos[ri].backend)]
    routing = None
    oq = None
    mean_power = [metric_table.point_values(backend_values(pq, j))["mean_power_w"] for j in range(m)]
    matrix = QueryMatrix(labels, tuple(i.energy_quality for i in infos), pq.correct.T, pq.energy_j.T,
                         pq.latency_s.T, None if cost is None else cost.T, category=pq.category,
                         categories=pq.categories, win_tie=None if pq.win_tie is None else pq.win_tie.T)
    if local_idx:
        vs = ", ".join(sorted({x for j in local_idx for x in infos[j].vs_backend.split(", ") if x}))
        if vs and vs != infos[ri].backend:
            notes.append(f"routing: win/tie coverage was judged against the answers of {vs}, not of the cloud "
                         f"reference {ref}")
        routing = route(matrix, local=[labels[j] for j in local_idx], cloud=ref, mean_power_w=mean_power,
                        router_accuracy=router_accuracy, cloud_is_stand_in=roles[ri] != "cloud", win_tie_vs=vs)
        oq = oracle_queries(matrix, local_idx, ri)
    else:
        notes.append("routing: needs a cloud reference and at least one other local backend "
                     "(set roles with --local/--cloud)")

    envelope = [[labels.index(x) for x in p.backends] for p in routing.power_envelope] if routing else []
    cols = _columns(pq, cost, oq, ri, envelope, carbon=carbon_g)
    col = cols.index
    errors, measurement = measurement_errors(pq, col, labels, oq)
    notes.append(measurement)
    draws = bootstrap_draws(cols.made(), quantiles_of(pq), n_columns=len(cols.makers), n_items=n, n_boot=n_boot, seed=seed,
                            measurement=errors)
    metrics, vs_ref = _estimates(draws, col, labels, ri)
    routing_ci = _routing_estimates(draws, col, routing) if routing else {}
    if routing:
        notes += routing.notes
    cascade = cascades(pq, labels, [i.energy_quality for i in infos], local_idx, ri, cost, n_boot=n_boot, seed=seed)
    notes += [note for c in cascade for note in c.notes]
    for i in infos:
        if len(i.energy_qualities) > 1:
            mix = ", ".join(f"{q}: {k}" for q, k in i.energy_qualities.items())
            notes.append(f"energy of {i.label} mixes qualities ({mix} records): its energy numbers are "
                         f"labeled {i.energy_quality}")
        if i.label != ref and i.energy_quality != infos[ri].energy_quality:
            notes.append(f"energy of {i.label} is {i.energy_quality}, of the reference {ref} "
                         f"{infos[ri].energy_quality}: their energy differences compare different bases")
    hardware = hardware_note({r.run_id: list(r.machines) for r in runs})
    if hardware:
        notes.insert(0, hardware)
    models = {labels[j]: fitted_models(pq, j) for j in range(m)}
    steady = steady_windows(runs, infos, n_boot=n_boot, seed=seed, energy_basis=energy_basis) if shown(infos) else {}
    picks = () if bound is None else pick_levels(
        infos, {x: {k: e.value for k, e in metrics[x].items()} for x in labels}, bound, steady)
    return Comparison(runs=runs, backends=infos, reference=ref, n_queries=n, common_queries=common_queries,
                      n_boot=n_boot, seed=seed, method=draws.method, metrics=metrics, vs_reference=vs_ref,
                      routing=routing, routing_ci=routing_ci, notes=tuple(notes), models=models,
                      judge=judge_rows(runs, plain), hardware_note=hardware, deadline=bound, level_picks=picks,
                      steady=steady,
                      measurement=measurement, with_measurement_error=bool(errors),
                      query_set_note=pq.query_set_note, cascade=cascade, energy_basis=energy_basis, carbon=carbon,
                      bases=basis_views(chip_pq, infos, ri, local_idx, router_accuracy, n_boot, seed, carbon_g))


def basis_views(chip_pq: PerQuery, infos: Sequence[BackendInfo], ri: int, local_idx: Sequence[int],
                router_accuracy: float, n_boot: int, seed: int, carbon_g: np.ndarray | None) -> tuple[BasisView, ...]:
    """The energy on every available basis (chip, and facility where a PUE is set, node where records have node
    readings), each bootstrapped with the comparison's seed: J/query, gCO2e per correct answer and the
    routing's energy saved; () when chip is the only one."""
    bases = available(chip_pq, infos)
    if len(bases) < 2:
        return ()
    labels = tuple(i.label for i in infos)
    views = []
    for basis in bases:
        pq, _ = under_basis(chip_pq, infos, basis)
        oq = None
        if local_idx:
            matrix = QueryMatrix(labels, tuple(i.energy_quality for i in infos), pq.correct.T, pq.energy_j.T,
                                 pq.latency_s.T, None, category=pq.category, categories=pq.categories,
                                 win_tie=None if pq.win_tie is None else pq.win_tie.T)
            oq = oracle_queries(matrix, list(local_idx), ri)
        cols = _columns(pq, None, oq, ri, carbon=carbon_g)
        errors, _ = measurement_errors(pq, cols.index, labels, oq)
        draws = bootstrap_draws(cols.made(), quantiles_of(pq), n_columns=len(cols.makers), n_items=pq.correct.shape[1],
                                n_boot=n_boot, seed=seed, measurement=errors)
        metrics, _ = _estimates(draws, cols.index, labels, ri)
        saved = None
        if oq is not None and ("route", "energy") in cols.index:
            r, c = (cols.index[("route", k)] for k in ("energy", "cloud_energy"))
            saved = interval(float(1 - _ratio(draws.point_sums[r], draws.point_sums[c])),
                             1 - _ratio(draws.sums[:, r], draws.sums[:, c]), LEVEL)
        router = None if saved is None else Estimate(*(router_accuracy * x for x in (saved.value, saved.lo, saved.hi)))
        views.append(BasisView(basis, {x: metrics[x]["energy_per_query_j"] for x in labels},
                               {x: metrics[x]["gco2e_per_correct"] for x in labels}, saved, router,
                               tuple(x for j, x in enumerate(labels) if np.isnan(pq.energy_j[j]).all())))
    return tuple(views)


def fitted_models(pq: PerQuery, j: int) -> dict[str, LinearFit]:
    """Backend j's OLS fits over its queries without errors: energy (J) and latency (s) against prompt
    and completion tokens (repeats averaged)."""
    ok = pq.errors[j] == 0
    assert pq.prompt_tokens is not None  # load(prompt_tokens=True): a field of every record
    p, k = pq.prompt_tokens[j][ok], pq.completion_tokens[j][ok]
    return {"energy": fit_linear(p, k, pq.energy_j[j][ok]), "latency": fit_linear(p, k, pq.latency_s[j][ok])}


def _estimates(draws: Draws, col: dict[Any, int], labels: Sequence[str], ri: int,
               ) -> tuple[dict[str, dict[str, Estimate]], dict[str, dict[str, Estimate]]]:
    m = len(labels)
    point = [_metric_values(draws.point_sums, np.asarray(draws.point_quantiles), col, j) for j in range(m)]
    boot = [_metric_values(draws.sums, draws.quantiles, col, j) for j in range(m)]
    keys = [m.name for m in metric_table.METRICS]  # each in every backend's "metrics" and "vs_reference" (JSON)
    metrics = {labels[j]: {k: interval(float(point[j][k]), boot[j][k], LEVEL) for k in keys} for j in range(m)}
    vs_ref = {}
    with np.errstate(invalid="ignore"):
        for j in range(m):
            if j != ri:
                vs_ref[labels[j]] = {k: interval(float(point[j][k] - point[ri][k]), boot[j][k] - boot[ri][k], LEVEL)
                                     for k in keys}
    return metrics, vs_ref


def _routing_estimates(draws: Draws, col: dict[Any, int], routing: Routing) -> dict[str, Estimate]:
    def sums(key: str) -> Any:  # (point sum, resampled sums); None: no such column
        i = col.get(("route", key))
        return None if i is None else (draws.point_sums[i], draws.sums[:, i])

    out = {}
    for name, key, among in (("local_coverage", "covered", "scored"), ("oracle_accuracy", "correct", "has_correct"),
                             ("win_tie_coverage", "win_covered", "judged")):
        s, n = sums(key), sums(among)
        if n[0] > 0:  # scored (judged) queries only
            out[name] = interval(float(_ratio(s[0], n[0])), _ratio(s[1], n[1]), LEVEL)
    for i in range(len(routing.power_envelope)):  # coverage within each power envelope
        s, n = ((draws.point_sums[col[("envelope", i, k)]], draws.sums[:, col[("envelope", i, k)]])
                for k in ("hit", "among"))
        if n[0] > 0:
            out[f"power_envelope_{i}"] = interval(float(_ratio(s[0], n[0])), _ratio(s[1], n[1]), LEVEL)
    o = routing.oracle
    for key, total in (("energy", o.energy_j), ("latency", o.latency_s), ("cost", o.cost_usd)):
        r, c = sums(key), sums("cloud_" + key)
        if total is None or r is None or c is None:
            continue
        out[f"oracle_{key}_saved_fraction"] = interval(float(1 - _ratio(r[0], c[0])), 1 - _ratio(r[1], c[1]), LEVEL)
    return out
