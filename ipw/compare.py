"""``ipw compare``: runs side by side with paired bootstrap CIs, and routing coverage (DESIGN.md §2).

Run folders are read with only the needed columns; repeats of a query are averaged per (backend,
query) with ``np.bincount`` over integer codes. The result is a per-query matrix (queries x backends)
from which every metric is a ratio of column sums or a quantile, bootstrapped with one set of resample
weights for all backends (``ipw.stats.bootstrap_draws``), so differences against the reference are
paired. Routing numbers come from ``ipw.routing`` (pure functions over the same matrix).

Energy of different qualities is never added together: each backend's quality stays beside its
numbers, differences between backends of different quality are flagged, and routed totals carry the
worst quality of their parts.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ipw import metrics as metric_table
from ipw.errors import IpwError
from ipw.results import RunManifest
from ipw.phases import LinearFit, fit_dict, fit_linear
from ipw.routing import SOLVED_AT, QueryMatrix, Routing, oracle_queries, resolve_roles, route
from ipw.stats import Draws, Estimate, bootstrap_draws, interval, n_resamples

SCHEMA_VERSION = 1
LEVEL = 0.95
FORMATS = ("table", "json", "csv", "markdown")
J_PER_KWH = 3.6e6

LOAD_COLUMNS = ["backend", "model", "role", "query_id", "category", "correct", "error", "completion_tokens",
                "ttft_s", "latency_s", "start_s", "end_s", "energy_j", "energy_quality", "energy_source",
                "prefill_energy_j", "decode_energy_j"]

# key, label (from the one metric table, ipw.metrics); every key is in each backend's "metrics" and
# "vs_reference" (JSON)
METRICS: tuple[tuple[str, str], ...] = tuple((m.name, m.label) for m in metric_table.METRICS)


@dataclass(frozen=True)
class RunInfo:
    path: str
    run_id: str
    status: str
    dataset: str | None
    fingerprint: str | None
    n_queries: int
    n_records: int


@dataclass(frozen=True)
class BackendInfo:
    label: str  # unique across the comparison: the backend name, or run_id/backend when names collide
    run_id: str
    backend: str
    model: str
    role: str
    n_records: int
    energy_quality: str  # worst quality among the records with energy
    energy_qualities: dict[str, int]  # records per quality
    energy_sources: tuple[str, ...]


@dataclass(frozen=True)
class PerQuery:
    """Per-query values, repeats averaged: arrays (n_backends, n_queries), one row per backend (the
    transpose of routing's queries x backends matrix); errors are record counts."""

    query_id: Any  # pandas Index
    category: np.ndarray  # int code per query
    categories: tuple[str, ...]  # names of the codes
    correct: np.ndarray
    energy_j: np.ndarray
    duration_s: np.ndarray
    latency_s: np.ndarray
    ttft_s: np.ndarray
    completion_tokens: np.ndarray
    prompt_tokens: np.ndarray | None
    errors: np.ndarray  # error records per query
    error_share: np.ndarray  # errored records / records
    prefill_energy_j: np.ndarray | None = None  # None when no record of any run has phases
    decode_energy_j: np.ndarray | None = None


FIELDS = ("correct", "energy_j", "duration_s", "latency_s", "ttft_s", "completion_tokens", "prompt_tokens", "errors",
          "error_share",
          "prefill_energy_j", "decode_energy_j")


@dataclass(frozen=True)
class Comparison:
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
    routing_ci: dict[str, Estimate]  # local_coverage, oracle_accuracy, oracle_<energy|latency|cost>_saved_fraction
    notes: tuple[str, ...] = field(default=())
    models: dict[str, dict[str, LinearFit]] = field(default_factory=dict)  # label -> energy|latency -> OLS fit


# --- loading ------------------------------------------------------------------------------------------

@dataclass
class _Part:
    """One backend of one run, over that run's query ids."""

    run: RunInfo
    info: BackendInfo
    query_id: Any  # pandas Index of the run's query ids (order of first appearance)
    present: np.ndarray  # bool per run query
    category: np.ndarray  # int code per run query
    categories: list[str]
    values: dict[str, np.ndarray | None]


CATEGORICAL = ["backend", "model", "role", "category", "error", "energy_quality", "energy_source"]


def _floats(series) -> np.ndarray:
    return series.to_numpy(dtype=float, na_value=np.nan)


def _codes(series, missing: str) -> tuple[np.ndarray, list[str]]:
    """Integer codes and names of a (categorical) column; a missing value gets the name ``missing``."""
    import pandas as pd

    if isinstance(series.dtype, pd.CategoricalDtype):
        codes = series.cat.codes.to_numpy().astype(np.int64)
        names = [str(x) for x in series.cat.categories]
    else:
        codes, uniq = pd.factorize(series)
        names = [str(x) for x in uniq]
    if (codes < 0).any():
        codes = np.where(codes < 0, len(names), codes)
        names.append(missing)
    return codes, names


def _release_arrow_memory() -> None:
    """Hand the memory of freed Arrow buffers back to the system (its pool keeps it otherwise)."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


def _read_run(path: Path, prompt_tokens: bool) -> list[_Part]:
    from ipw.results import load_run

    manifest, frame = load_run(path, columns=LOAD_COLUMNS + (["prompt_tokens"] if prompt_tokens else []),
                               categorical=CATEGORICAL)
    _release_arrow_memory()  # the Arrow table behind the frame is gone: keep the peak low
    return parts_of(path, manifest, frame, prompt_tokens)


def as_manifest(manifest: RunManifest | dict) -> RunManifest:
    """The typed manifest (``load_run`` returns the checked JSON object)."""
    return manifest if isinstance(manifest, RunManifest) else RunManifest.from_dict(manifest)


def parts_of(path: Path, manifest: RunManifest | dict, frame, prompt_tokens: bool = True) -> list[_Part]:
    """A run's backends with their per-query values (repeats averaged: the one place this is done)."""
    import pandas as pd

    from ipw.telemetry.base import QUALITY_ORDER

    path = Path(path)
    if prompt_tokens and "prompt_tokens" not in frame:
        prompt_tokens = False
    missing = [c for c in LOAD_COLUMNS if c not in frame]  # e.g. phases, in runs made before them: all null
    if missing:
        frame = frame.assign(**{c: None for c in missing})
    manifest = as_manifest(manifest)
    dataset = manifest.dataset or {}
    run_id = str(manifest.run_id or path.name)
    if len(frame) == 0:
        raise IpwError(f"{path}: the run has no records")
    qcode, qids = pd.factorize(frame["query_id"])
    bcode, bnames = _codes(frame["backend"], "")
    run = RunInfo(str(path), run_id, str(manifest.status or "unknown"), dataset.get("name"),
                  dataset.get("fingerprint"), len(qids), len(frame))
    nq, nb = len(qids), len(bnames)
    key = bcode * nq + qcode
    size = nb * nq
    count = np.bincount(key, minlength=size)

    def mean(x: np.ndarray) -> np.ndarray:
        """Per (backend, query): the mean over repeats of the known values (NaN when none is known)."""
        ok = ~np.isnan(x)
        if ok.all():
            return (np.bincount(key, x, size) / count).reshape(nb, nq)
        with np.errstate(invalid="ignore", divide="ignore"):
            return (np.bincount(key, np.where(ok, x, 0.0), size) / np.bincount(key, ok, size)).reshape(nb, nq)

    values = {
        # an errored query, or one without a score, counts incorrect (ipw.metrics)
        "correct": mean(np.where(frame["error"].notna().to_numpy(), 0.0, np.nan_to_num(_floats(frame["correct"])))),
        "energy_j": mean(_floats(frame["energy_j"])),
        "duration_s": mean(_floats(frame["end_s"]) - _floats(frame["start_s"])),
        "latency_s": mean(_floats(frame["latency_s"])),
        "ttft_s": mean(_floats(frame["ttft_s"])),
        "completion_tokens": mean(_floats(frame["completion_tokens"])),
        "prompt_tokens": mean(_floats(frame["prompt_tokens"])) if prompt_tokens else None,
        "errors": np.bincount(key, frame["error"].notna().to_numpy(), size).reshape(nb, nq),
        "error_share": mean(frame["error"].notna().to_numpy(float)),
    }
    for name in ("prefill_energy_j", "decode_energy_j"):  # None in runs made before phases
        x = _floats(frame[name])
        values[name] = None if np.isnan(x).all() else mean(x)
    ccode, cnames = _codes(frame["category"], "")
    category = np.zeros(nq, np.int64)
    category[qcode] = ccode
    has_e = frame["energy_j"].notna().to_numpy()
    first = [int(np.argmax(bcode == b)) for b in range(nb)]  # the backend's first record
    models = [str(frame["model"].iloc[i]) for i in first]
    roles = [str(frame["role"].iloc[i]) for i in first]
    qual_code, qual_names = _codes(frame["energy_quality"], "unavailable")
    src_code, src_names = _codes(frame["energy_source"], "")
    per_b = np.bincount(bcode, minlength=nb)
    qual_counts = np.bincount(bcode[has_e] * len(qual_names) + qual_code[has_e],
                              minlength=nb * len(qual_names)).reshape(nb, len(qual_names))
    src_counts = np.bincount(bcode[has_e] * len(src_names) + src_code[has_e],
                             minlength=nb * len(src_names)).reshape(nb, len(src_names))
    del frame
    parts = []
    for b, name in enumerate(bnames):
        if not per_b[b]:
            continue  # a name in the file's dictionary without records
        quals = {qual_names[i]: int(qual_counts[b, i]) for i in range(len(qual_names)) if qual_counts[b, i]}
        known = [q for q in quals if q in QUALITY_ORDER]
        info = BackendInfo(
            label=name, run_id=run_id, backend=name, model=models[b], role=roles[b],
            n_records=int(per_b[b]),
            energy_quality=max(known, key=QUALITY_ORDER.index) if known else "unavailable",
            energy_qualities=quals,
            energy_sources=tuple(src_names[i] for i in range(len(src_names)) if src_counts[b, i] and src_names[i]),
        )
        parts.append(_Part(run, info, qids, count.reshape(nb, nq)[b] > 0, category, cnames,
                           {k: (None if v is None else v[b]) for k, v in values.items()}))
    return parts


def _query_set_error(parts: list[_Part]) -> str | None:
    runs = {p.run.run_id: p.run for p in parts}
    prints = {r.fingerprint for r in runs.values() if r.fingerprint}
    if len(prints) > 1:
        desc = "; ".join(f"{r.run_id}: {r.dataset or '?'}, {r.n_queries} queries, {r.fingerprint}"
                         for r in runs.values())
        return f"the runs measure different query sets (dataset fingerprints differ: {desc})"
    full = max(len(p.query_id) for p in parts)
    for p in parts:
        have = int(p.present.sum())
        if have < full:
            return (f"backend {p.info.label!r} of run {p.run.run_id} ({p.run.status}) has {have} of the {full} "
                    "queries")
    if len({id(p.query_id) for p in parts}) > 1:
        first = parts[0].query_id
        for p in parts[1:]:
            if not (p.query_id.equals(first) or (len(p.query_id) == len(first) and
                                                 len(first.intersection(p.query_id)) == len(first))):
                return f"run {p.run.run_id} has other query ids than run {parts[0].run.run_id}"
    return None


def load(paths: Sequence[str | Path], *, common_queries: bool = False,
         prompt_tokens: bool = False) -> tuple[tuple[RunInfo, ...], tuple[BackendInfo, ...], PerQuery, list[str]]:
    """Read run folders into one per-query matrix; refuse different query sets unless ``common_queries``."""
    if not paths:
        raise IpwError("give at least one run folder")
    parts: list[_Part] = []
    seen: dict[str, str] = {}
    for path in map(Path, paths):
        new = _read_run(path, prompt_tokens)
        rid = new[0].run.run_id
        if rid in seen:
            raise IpwError(f"{path}: run {rid} is given twice (also {seen[rid]})")
        seen[rid] = str(path)
        parts += new
    notes: list[str] = []
    problem = _query_set_error(parts)
    if problem and not common_queries:
        raise IpwError(f"{problem}; compare them on the queries they share with --common-queries")
    # labels: the backend name, or run_id/backend where a name occurs in several runs
    names = [p.info.backend for p in parts]
    for p in parts:
        if names.count(p.info.backend) > 1:
            p.info = BackendInfo(**{**p.info.__dict__, "label": f"{p.info.run_id}/{p.info.backend}"})
    # the queries every backend has, in the first run's order
    universe = parts[0].query_id
    for p in parts:
        if not (p.present.all() and (p.query_id is universe or p.query_id.equals(universe))):
            universe = universe.intersection(p.query_id[p.present], sort=False)
    if len(universe) == 0:
        raise IpwError("the runs share no query: nothing to compare")
    if problem:
        sizes = ", ".join(f"{p.info.label}: {int(p.present.sum())}" for p in parts)
        notes.append(f"--common-queries: compared on the {len(universe)} queries all backends share "
                     f"({problem}; queries per backend: {sizes})")
    positions: dict[int, np.ndarray | None] = {}
    for p in parts:
        if id(p.query_id) not in positions:
            positions[id(p.query_id)] = None if p.query_id.equals(universe) else p.query_id.get_indexer(universe)

    def aligned(p: _Part, v: np.ndarray) -> np.ndarray:
        pos = positions[id(p.query_id)]
        return v if pos is None else v[pos]

    categories = sorted({c for p in parts for c in p.categories})
    first = parts[0]
    category = np.searchsorted(categories, np.asarray(first.categories, dtype=object))[aligned(first, first.category)]
    n, m = len(universe), len(parts)
    out: dict[str, np.ndarray | None] = {}
    for name in FIELDS:
        if all(p.values[name] is None for p in parts):
            out[name] = None
            continue
        mat = np.empty((m, n))
        for j, p in enumerate(parts):
            v = p.values.pop(name)
            mat[j] = np.nan if v is None else aligned(p, v)
        out[name] = mat
    pq = PerQuery(query_id=universe, category=category, categories=tuple(categories), **out)
    runs = tuple({p.run.run_id: p.run for p in parts}.values())
    return runs, tuple(p.info for p in parts), pq, notes


# --- names and prices ---------------------------------------------------------------------------------

def resolve_name(name: str, labels: Sequence[str], backends: Sequence[str], option: str) -> str:
    """A label from a label or an unambiguous backend name."""
    if name in labels:
        return name
    hits = [label for label, b in zip(labels, backends) if b == name]
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise IpwError(f"{option} {name!r} is in several runs; name one of: {', '.join(hits)}")
    raise IpwError(f"{option} {name!r}: no such backend (backends: {', '.join(labels)})")


def parse_api_price(text: str) -> tuple[str, float, float]:
    """``NAME=IN,OUT``: USD per million input and output tokens."""
    name, eq, prices = text.partition("=")
    try:
        pin, pout = (float(x) for x in prices.split(","))
    except ValueError:
        pin = pout = float("nan")
    if not eq or not name or not (math.isfinite(pin) and math.isfinite(pout)) or pin < 0 or pout < 0:
        raise IpwError(f"--api-price {text!r}: expected NAME=IN,OUT (USD per million input and output tokens)")
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
            cost[j] = (pq.prompt_tokens[j] * pin + pq.completion_tokens[j] * pout) / 1e6
        elif usd_per_kwh is not None and role == "local":
            cost[j] = pq.energy_j[j] / J_PER_KWH * usd_per_kwh
    return cost


# --- the comparison -----------------------------------------------------------------------------------

def _ratio(a, b):
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray(a, dtype=float) / np.asarray(b, dtype=float)


def _metric_values(s: np.ndarray, q: np.ndarray, col: dict, j: int) -> dict[str, np.ndarray]:
    """Backend j's metrics (ipw.metrics) from sums ``s`` (shape (..., n_columns)) and quantiles ``q``
    (shape (..., n_quantiles))."""
    g = {key[1]: s[..., i] for key, i in col.items() if isinstance(key, tuple) and key[0] == j}
    keys = metric_table.quantile_keys()
    g.update((k, q[..., j * len(keys) + i]) for i, k in enumerate(keys))
    return metric_table.values(g)


def backend_values(pq: PerQuery, j: int, cost: np.ndarray | None = None) -> dict[str, np.ndarray | None]:
    """Backend j's per-query values, as ipw.metrics takes them."""
    v = {k: (None if getattr(pq, k) is None else getattr(pq, k)[j]) for k in FIELDS}
    v["cost_usd"] = None if cost is None else cost[j]
    return v


class _Columns:
    """The bootstrap's columns by name, each made only when the bootstrap copies it in; a column known
    to equal another one (e.g. "has energy" when every query has energy) is stored once."""

    def __init__(self) -> None:
        self.index: dict[Any, int] = {}
        self.makers: list[Any] = []

    def add(self, name, make=None, same_as=None) -> None:
        if same_as is not None:
            self.index[name] = self.index[same_as]
        else:
            self.index[name] = len(self.makers)
            self.makers.append(make)

    def add_backend(self, j: int, v: dict) -> None:
        """Backend j's columns (ipw.metrics.query_columns), keyed (j, name)."""
        for name, make in metric_table.query_columns(v).items():
            if name == "n" and "one" in self.index:
                self.add((j, name), same_as="one")
            elif isinstance(make, str):
                self.add((j, name), same_as=(j, make))
            else:
                self.add((j, name), make)

    def made(self):
        for make in self.makers:
            yield make()


def _columns(pq: PerQuery, cost: np.ndarray | None, oq, ri: int) -> _Columns:
    """Per backend j: its metric columns (ipw.metrics.query_columns); ("route", ...) the oracle's
    per-query values."""
    cols = _Columns()
    cols.add("one", lambda: np.ones(pq.correct.shape[1]))
    for j in range(pq.correct.shape[0]):
        cols.add_backend(j, backend_values(pq, j, cost))
    if oq is not None:
        same = {"cloud_energy": (ri, "e"), "cloud_cost": (ri, "cost")}
        for key, x in (("covered", oq.covered), ("correct", oq.correct), ("energy", oq.energy_j),
                       ("cloud_energy", oq.cloud_energy_j), ("latency", oq.latency_s),
                       ("cloud_latency", oq.cloud_latency_s), ("cost", oq.cost_usd), ("cloud_cost", oq.cloud_cost_usd)):
            if x is None or np.isnan(x).any():
                continue  # unknown somewhere: no interval (the point value says so too)
            cols.add(("route", key), lambda x=x: x.astype(float), same_as=same.get(key))
    return cols


def quantiles_of(pq: PerQuery) -> list:
    """The quantile inputs of every backend, in ``_metric_values``' order."""
    return [(x, ps) for j in range(pq.correct.shape[0])
            for _, x, ps in metric_table.quantile_inputs(backend_values(pq, j))]


def compare(paths: Sequence[str | Path], *, reference: str | None = None, common_queries: bool = False,
            local: Sequence[str] = (), cloud: Sequence[str] = (), router_accuracy: float = 0.8,
            n_boot: int | None = None, seed: int = 0, usd_per_kwh: float | None = None,
            api_prices: Sequence[str] = ()) -> Comparison:
    """Compare the backends of ``paths`` (run folders) on their queries; see the module docstring."""
    if not 0.0 <= router_accuracy <= 1.0:
        raise IpwError(f"--router-accuracy {router_accuracy}: must be between 0 and 1")
    if n_boot is not None and n_boot < 1:
        raise IpwError(f"--n-boot {n_boot}: must be at least 1")
    if usd_per_kwh is not None and not usd_per_kwh >= 0:
        raise IpwError(f"--usd-per-kwh {usd_per_kwh}: must be a price >= 0")
    prices_raw = [parse_api_price(p) for p in api_prices]
    runs, infos, pq, notes = load(paths, common_queries=common_queries, prompt_tokens=True)
    labels = tuple(i.label for i in infos)
    plain = tuple(i.backend for i in infos)
    name = lambda x, opt: resolve_name(x, labels, plain, opt)  # noqa: E731
    roles = resolve_roles(labels, [i.role for i in infos], local=[name(x, "--local") for x in local],
                          cloud=[name(x, "--cloud") for x in cloud])
    infos = tuple(BackendInfo(**{**i.__dict__, "role": r}) for i, r in zip(infos, roles))
    if reference is not None:
        ref = name(reference, "--reference")
    else:
        ref = next((label for label, r in zip(labels, roles) if r == "cloud"), labels[0])
    prices = {name(n_, "--api-price"): (pin, pout) for n_, pin, pout in prices_raw}
    cost = cost_matrix(pq, labels, roles, usd_per_kwh, prices)
    m, n = pq.correct.shape
    n_boot = n_boot or n_resamples(n)
    ri = labels.index(ref)

    # routing: the reference is the cloud; locals are the local-role backends other than it
    local_idx = [j for j in range(m) if roles[j] == "local" and j != ri]
    routing = None
    oq = None
    mean_power = [metric_table.point_values(backend_values(pq, j))["mean_power_w"] for j in range(m)]
    matrix = QueryMatrix(labels, tuple(i.energy_quality for i in infos), pq.correct.T, pq.energy_j.T,
                         pq.latency_s.T, None if cost is None else cost.T, category=pq.category,
                         categories=pq.categories)
    if local_idx:
        routing = route(matrix, local=[labels[j] for j in local_idx], cloud=ref, mean_power_w=mean_power,
                        router_accuracy=router_accuracy, cloud_is_stand_in=roles[ri] != "cloud")
        oq = oracle_queries(matrix, local_idx, ri)
    else:
        notes.append("routing: needs a cloud reference and at least one other local backend "
                     "(set roles with --local/--cloud)")

    cols = _columns(pq, cost, oq, ri)
    col = cols.index
    draws = bootstrap_draws(cols.made(), quantiles_of(pq), n_columns=len(cols.makers), n_items=n, n_boot=n_boot, seed=seed)
    metrics, vs_ref = _estimates(draws, col, labels, ri)
    routing_ci = _routing_estimates(draws, col, routing) if routing else {}
    if routing:
        notes += routing.notes
    for i in infos:
        if len(i.energy_qualities) > 1:
            mix = ", ".join(f"{q}: {k}" for q, k in i.energy_qualities.items())
            notes.append(f"energy of {i.label} mixes qualities ({mix} records): its energy numbers are "
                         f"labeled {i.energy_quality}")
        if i.label != ref and i.energy_quality != infos[ri].energy_quality:
            notes.append(f"energy of {i.label} is {i.energy_quality}, of the reference {ref} "
                         f"{infos[ri].energy_quality}: their energy differences compare different bases")
    models = {labels[j]: fitted_models(pq, j) for j in range(m)}
    return Comparison(runs=runs, backends=infos, reference=ref, n_queries=n, common_queries=common_queries,
                      n_boot=n_boot, seed=seed, method=draws.method, metrics=metrics, vs_reference=vs_ref,
                      routing=routing, routing_ci=routing_ci, notes=tuple(notes), models=models)


def fitted_models(pq: PerQuery, j: int) -> dict[str, LinearFit]:
    """Backend j's OLS fits over its queries without errors: energy (J) and latency (s) against prompt
    and completion tokens (repeats averaged)."""
    ok = pq.errors[j] == 0
    p, k = pq.prompt_tokens[j][ok], pq.completion_tokens[j][ok]
    return {"energy": fit_linear(p, k, pq.energy_j[j][ok]), "latency": fit_linear(p, k, pq.latency_s[j][ok])}


def _estimates(draws: Draws, col: dict, labels: Sequence[str], ri: int):
    m = len(labels)
    point = [_metric_values(draws.point_sums, np.asarray(draws.point_quantiles), col, j) for j in range(m)]
    boot = [_metric_values(draws.sums, draws.quantiles, col, j) for j in range(m)]
    keys = [k for k, _ in METRICS]
    metrics = {labels[j]: {k: interval(float(point[j][k]), boot[j][k], LEVEL) for k in keys} for j in range(m)}
    vs_ref = {}
    with np.errstate(invalid="ignore"):
        for j in range(m):
            if j != ri:
                vs_ref[labels[j]] = {k: interval(float(point[j][k] - point[ri][k]), boot[j][k] - boot[ri][k], LEVEL)
                                     for k in keys}
    return metrics, vs_ref


def _routing_estimates(draws: Draws, col: dict, routing: Routing) -> dict[str, Estimate]:
    def sums(key):
        i = col.get(("route", key))
        return None if i is None else (draws.point_sums[i], draws.sums[:, i])

    one = (draws.point_sums[col["one"]], draws.sums[:, col["one"]])
    out = {}
    for name, key in (("local_coverage", "covered"), ("oracle_accuracy", "correct")):
        s = sums(key)
        out[name] = interval(float(_ratio(s[0], one[0])), _ratio(s[1], one[1]), LEVEL)
    o = routing.oracle
    for key, total in (("energy", o.energy_j), ("latency", o.latency_s), ("cost", o.cost_usd)):
        r, c = sums(key), sums("cloud_" + key)
        if total is None or r is None or c is None:
            continue
        out[f"oracle_{key}_saved_fraction"] = interval(float(1 - _ratio(r[0], c[0])), 1 - _ratio(r[1], c[1]), LEVEL)
    return out


# --- output -------------------------------------------------------------------------------------------

def _num(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _est(e: Estimate | None) -> dict | None:
    return None if e is None else {"value": _num(e.value), "lo": _num(e.lo), "hi": _num(e.hi)}


def _scaled(e: Estimate | None, a: float) -> Estimate | None:
    return None if e is None else Estimate(a * e.value, a * e.lo, a * e.hi)


def _saving(s, unit: str, est: Estimate | None) -> dict | None:
    if s is None:
        return None
    return {f"cloud_only_{unit}": _num(s.cloud_only), f"routed_{unit}": _num(s.routed), f"saved_{unit}": _num(s.saved),
            "saved_fraction": _est(est or Estimate(s.saved_fraction, float("nan"), float("nan")))}


def _routing_dict(c: Comparison) -> dict | None:
    r = c.routing
    if r is None:
        return None
    ci = c.routing_ci
    o = r.oracle
    energy = _saving(o.energy_j, "j", ci.get("oracle_energy_saved_fraction"))
    if energy is not None:
        energy.update(energy_quality=o.energy_quality,
                      routed_by_quality_j={k: _num(v) for k, v in o.routed_energy_by_quality_j.items()})
    a = r.router.alpha

    def frac(key: str, value: float | None) -> dict | None:
        if value is None:
            return None
        return _est(_scaled(ci.get(key), a) or Estimate(value, float("nan"), float("nan")))

    return {
        "cloud": r.cloud, "cloud_is_stand_in": r.cloud_is_stand_in, "local": list(r.local), "n_queries": r.n_queries,
        "solved_at": SOLVED_AT,
        "local_coverage": _est(ci.get("local_coverage")),
        "coverage_by_backend": {k: _num(v) for k, v in r.coverage_by_backend.items()},
        "oracle": {
            "routed_to": r.oracle.routed_to,
            "accuracy": _est(ci.get("oracle_accuracy")),
            "cloud_accuracy": _num(o.cloud_accuracy),
            "energy": energy,
            "latency": _saving(o.latency_s, "s", ci.get("oracle_latency_saved_fraction")),
            "cost": _saving(o.cost_usd, "usd", ci.get("oracle_cost_saved_fraction")),
        },
        "router": {
            "alpha": a,
            "accuracy": _num(r.router.accuracy),
            "energy_saved_fraction": frac("oracle_energy_saved_fraction", r.router.energy_saved_fraction),
            "latency_saved_fraction": frac("oracle_latency_saved_fraction", r.router.latency_saved_fraction),
            "cost_saved_fraction": frac("oracle_cost_saved_fraction", r.router.cost_saved_fraction),
        },
        "router_curve": [{"alpha": p.alpha, "accuracy": _num(p.accuracy),
                          "energy_saved_fraction": _num(p.energy_saved_fraction),
                          "latency_saved_fraction": _num(p.latency_saved_fraction),
                          "cost_saved_fraction": _num(p.cost_saved_fraction)} for p in r.router_curve],
        "power_envelope": [{"power_w": p.power_w, "backends": list(p.backends), "coverage": _num(p.coverage)}
                           for p in r.power_envelope],
        "energy_budget": [{"energy_j": p.energy_j, "coverage": _num(p.coverage)} for p in r.energy_budget],
        "by_category": [{"category": k.category, "n_queries": k.n_queries, "local_coverage": _num(k.local_coverage),
                         "cloud_accuracy": _num(k.cloud_accuracy), "oracle_accuracy": _num(k.oracle_accuracy),
                         "energy_saved_fraction": _num(k.energy_saved_fraction),
                         "latency_saved_fraction": _num(k.latency_saved_fraction),
                         "cost_saved_fraction": _num(k.cost_saved_fraction)} for k in r.by_category],
    }


def to_dict(c: Comparison) -> dict:
    """The JSON layout (``schema_version`` 1, documented in README.md)."""
    from ipw import __version__

    return {
        "schema_version": SCHEMA_VERSION,
        "ipw_version": __version__,
        "runs": [r.__dict__ for r in c.runs],
        "queries": {"n_queries": c.n_queries, "common_queries": c.common_queries},
        "bootstrap": {"n_boot": c.n_boot, "seed": c.seed, "level": LEVEL, "method": c.method, "paired": True},
        "reference": c.reference,
        "backends": [{
            "label": b.label, "run_id": b.run_id, "backend": b.backend, "model": b.model, "role": b.role,
            "n_records": b.n_records, "energy_quality": b.energy_quality, "energy_qualities": b.energy_qualities,
            "energy_sources": list(b.energy_sources),
            "metrics": {k: _est(e) for k, e in c.metrics[b.label].items()},
            "vs_reference": (None if b.label == c.reference
                             else {k: _est(e) for k, e in c.vs_reference[b.label].items()}),
            **{f"{what}_model": (fit_dict(f) if f is not None else None)
               for what, f in ((w, c.models.get(b.label, {}).get(w)) for w in ("energy", "latency"))},
        } for b in c.backends],
        "routing": _routing_dict(c),
        "notes": list(c.notes),
    }


def to_json(c: Comparison) -> str:
    return json.dumps(to_dict(c), indent=2, ensure_ascii=False) + "\n"


CSV_HEADER = ("section", "backend", "key", "metric", "value", "lo", "hi")


def csv_rows(c: Comparison) -> list[tuple]:
    """Long format: one row per number (section, backend, key, metric, value, lo, hi)."""
    rows: list[tuple] = []

    def add(section, backend, key, metric, v):
        if isinstance(v, dict) or v is None:
            v = v or {"value": None, "lo": None, "hi": None}
            rows.append((section, backend, key, metric, v["value"], v["lo"], v["hi"]))
        else:
            rows.append((section, backend, key, metric, v, None, None))

    d = to_dict(c)
    for b in d["backends"]:
        for k, v in b["metrics"].items():
            add("metric", b["label"], "", k, v)
        for k, v in (b["vs_reference"] or {}).items():
            add("vs_reference", b["label"], d["reference"], k, v)
        for what in ("energy", "latency"):
            f = b.get(f"{what}_model")
            for k in ("intercept", "per_prompt_token", "per_completion_token", "r2") if f else ():
                add("model", b["label"], what, k, f[k])
    r = d["routing"]
    if r:
        add("routing", "", "", "local_coverage", r["local_coverage"])
        for label, v in r["coverage_by_backend"].items():
            add("routing", label, "", "coverage", v)
        add("routing", "", "", "oracle_accuracy", r["oracle"]["accuracy"])
        add("routing", r["cloud"], "", "cloud_accuracy", r["oracle"]["cloud_accuracy"])
        for what in ("energy", "latency", "cost"):
            s = r["oracle"][what]
            add("routing", "", "", f"oracle_{what}_saved_fraction", s and s["saved_fraction"])
        add("routing", "", str(r["router"]["alpha"]), "router_accuracy", r["router"]["accuracy"])
        for what in ("energy", "latency", "cost"):
            add("routing", "", str(r["router"]["alpha"]), f"router_{what}_saved_fraction",
                r["router"][f"{what}_saved_fraction"])
        for p in r["router_curve"]:
            for k in ("accuracy", "energy_saved_fraction", "latency_saved_fraction", "cost_saved_fraction"):
                add("router_curve", "", str(p["alpha"]), k, p[k])
        for p in r["power_envelope"]:
            add("power_envelope", "+".join(p["backends"]), repr(p["power_w"]), "coverage", p["coverage"])
        for p in r["energy_budget"]:
            add("energy_budget", "", repr(p["energy_j"]), "coverage", p["coverage"])
        for k in r["by_category"]:
            for m in ("n_queries", "local_coverage", "cloud_accuracy", "oracle_accuracy", "energy_saved_fraction",
                      "latency_saved_fraction", "cost_saved_fraction"):
                add("category", "", k["category"], m, k[m])
    return rows


def to_csv(c: Comparison) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    writer.writerows(["" if x is None else x for x in row] for row in csv_rows(c))
    return buf.getvalue()


def _f(x: float | None, spec: str = ".3g") -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:{spec}}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.1%}"


def _cell(e: Estimate, key: str, sign: bool = False) -> str:
    if not math.isfinite(e.value):
        return "n/a"
    if key in ("accuracy", "error_rate", "prefill_energy_share"):
        f = (lambda x: f"{x:+.1%}") if sign else _pct
    else:
        f = (lambda x: "n/a" if not math.isfinite(x) else f"{x:+.3g}") if sign else _f
    return f"{f(e.value)} [{f(e.lo)}, {f(e.hi)}]" if math.isfinite(e.lo) else f(e.value)


def tables(c: Comparison) -> list[tuple[str, list[str], list[list[str]]]]:
    """The human tables (title, headers, rows), shared by the rich and Markdown output."""
    labels = [b.label for b in c.backends]
    keys = [k for k, _ in METRICS if any(math.isfinite(c.metrics[x][k].value) for x in labels)]
    names = dict(METRICS)
    rows = [["role"] + [b.role + (" (reference)" if b.label == c.reference else "") for b in c.backends],
            ["energy quality"] + [b.energy_quality for b in c.backends],
            ["queries / records"] + [f"{c.n_queries} / {b.n_records}" for b in c.backends]]
    rows += [[names[k]] + [_cell(c.metrics[x][k], k) for x in labels] for k in keys]
    out = [(f"ipw compare: {c.n_queries} queries, {LEVEL:.0%} bootstrap CIs ({c.n_boot} {c.method} resamples)",
            ["metric"] + labels, rows)]
    others = [x for x in labels if x != c.reference]
    if others:
        out.append((f"difference vs {c.reference} (paired over the same queries)", ["metric"] + others,
                    [[names[k]] + [_cell(c.vs_reference[x][k], k, sign=True) for x in others] for k in keys]))
    fits = [c.models.get(x, {}) for x in labels]
    if any(math.isfinite(f[w].r2) for f in fits for w in f):
        rows = []
        for what, unit in (("energy", "J"), ("latency", "s")):
            for attr, name in (("intercept", f"a ({unit})"), ("per_prompt_token", f"b ({unit}/prompt token)"),
                               ("per_completion_token", f"c ({unit}/output token)")):
                rows.append([f"{what} {name}"] + [_cell(getattr(f[what], attr), attr) if what in f else "n/a"
                                                  for f in fits])
            rows.append([f"{what} R² (queries)"] + [f"{_f(f[what].r2, '.3f')} ({f[what].n})" if what in f else "n/a"
                                                    for f in fits])
        out.append((f"fitted per-query model y ≈ a + b·prompt tokens + c·output tokens (OLS, {LEVEL:.0%} CIs)",
                    ["coefficient"] + labels, rows))
    r = c.routing
    if r is not None:
        d = _routing_dict(c)
        o = d["oracle"]

        def est(v, pct=True):
            if v is None:
                return "n/a"
            f = _pct if pct else _f
            return f"{f(v['value'])} [{f(v['lo'])}, {f(v['hi'])}]" if v["lo"] is not None else f(v["value"])

        def saved(s, unit):
            shown = {"j": "J", "s": "s", "usd": "USD"}[unit]
            return "n/a" if s is None else (f"{est(s['saved_fraction'])} ({_f(s['saved_' + unit])} {shown} of "
                                            f"{_f(s['cloud_only_' + unit])})")

        rr = d["router"]
        summary = [
            ["cloud reference", r.cloud + (" (stand-in: no cloud role)" if r.cloud_is_stand_in else "")],
            ["local backends", ", ".join(r.local)],
            ["local coverage", est(d["local_coverage"])],
            ["oracle routed to", ", ".join(f"{k}: {v}" for k, v in o["routed_to"].items())],
            ["oracle accuracy (cloud only)", f"{est(o['accuracy'])} ({_pct(o['cloud_accuracy'])})"],
            ["oracle energy saved",
             saved(o["energy"], "j") + (f", {o['energy']['energy_quality']}" if o["energy"] else "")],
            ["oracle latency saved", saved(o["latency"], "s")],
            ["oracle cost saved", saved(o["cost"], "usd")],
            [f"router (α={rr['alpha']}) accuracy", _pct(rr["accuracy"])],
            [f"router (α={rr['alpha']}) energy saved", est(rr["energy_saved_fraction"])],
            [f"router (α={rr['alpha']}) latency saved", est(rr["latency_saved_fraction"])],
            [f"router (α={rr['alpha']}) cost saved", est(rr["cost_saved_fraction"])],
        ]
        out.append(("routing (oracle: each query to the lowest-energy local backend that answers it, else the cloud)",
                    ["", "value"], summary))
        out.append(("router curve (α: share of queries routed as the oracle would)",
                    ["α", "accuracy", "energy saved", "latency saved", "cost saved"],
                    [[f"{p['alpha']:g}", _pct(p["accuracy"]), _pct(p["energy_saved_fraction"]),
                      _pct(p["latency_saved_fraction"]), _pct(p["cost_saved_fraction"])] for p in d["router_curve"]]))
        if d["power_envelope"]:
            out.append(("coverage within a power envelope (local backends whose mean power fits)",
                        ["power ≤ W", "backends", "coverage"],
                        [[_f(p["power_w"]), ", ".join(p["backends"]), _pct(p["coverage"])]
                         for p in d["power_envelope"]]))
        if d["energy_budget"]:
            out.append(("coverage within a per-query energy budget", ["energy ≤ J", "coverage"],
                        [[_f(p["energy_j"]), _pct(p["coverage"])] for p in d["energy_budget"]]))
        out.append(("routing per category", ["category", "queries", "local coverage", "cloud accuracy",
                                             "oracle accuracy", "energy saved", "latency saved", "cost saved"],
                    [[k["category"] or "-", str(k["n_queries"]), _pct(k["local_coverage"]), _pct(k["cloud_accuracy"]),
                      _pct(k["oracle_accuracy"]), _pct(k["energy_saved_fraction"]), _pct(k["latency_saved_fraction"]),
                      _pct(k["cost_saved_fraction"])] for k in d["by_category"]]))
    return out


def to_markdown(c: Comparison) -> str:
    from ipw.sanitize import md_text  # backend names, categories and notes are the user's text

    lines = []
    for title, headers, rows in tables(c):
        lines += [f"### {md_text(title)}", "", "| " + " | ".join(map(md_text, headers)) + " |",
                  "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(md_text(cell) for cell in row) + " |" for row in rows]
        lines.append("")
    lines += [f"- {md_text(note)}" for note in c.notes]
    return "\n".join(lines).rstrip("\n") + "\n"


def rich_tables(c: Comparison) -> list:
    from rich.table import Table

    out = []
    for title, headers, rows in tables(c):
        t = Table(title=title, title_justify="left")
        for i, h in enumerate(headers):
            t.add_column(h, justify="left" if i == 0 else "right")
        for row in rows:
            t.add_row(*row)
        out.append(t)
    return out
