"""The data a router is trained and scored on (``ipw.analysis.router``): per query and local backend, read from run
folders as ``ipw compare`` reads them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ipw.analysis.stats import EnergyErrors
from ipw.errors import IpwError, ParameterError

GRADINGS = ("answer", "vs-backend")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")  # what ipw serve keeps of a prompt without --log-prompts


def check_threshold(value: float, option: str = "router_threshold") -> float:
    if not (isinstance(value, (int, float)) and 0.0 <= float(value) <= 1.0):
        raise ParameterError((option,), f" {value}: must be between 0 and 1")
    return float(value)


def parse_accuracy_loss(text: str | float, option: str = "max_accuracy_loss") -> float:
    """``1%``, ``1pp`` or ``0.01``: an accuracy loss as a fraction (0..1)."""
    raw = str(text).strip()
    try:
        value = float(raw[:-2]) / 100 if raw.endswith("pp") else float(raw[:-1]) / 100 if raw.endswith("%") \
            else float(raw)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:
        raise ParameterError((option,), f" {text!r}: expected a loss like 1% (or 0.01), between 0 and 100%")
    return value


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
        raise ParameterError(("grading",), f" {grading!r}: must be one of {', '.join(GRADINGS)}")
    prices_raw = [parse_api_price(p) for p in api_prices]
    runs, infos, pq, _ = load(paths, common_queries=common_queries, prompt_tokens=bool(prices_raw))
    labels = tuple(i.label for i in infos)

    def names(xs: Sequence[str], parameter: str) -> list[str]:
        return [x for n_ in xs for x in resolve_levels(n_, infos, parameter)]

    roles = resolve_roles(labels, [i.role for i in infos], local=names(local, "local"), cloud=names(cloud, "cloud"))
    if "cloud" not in roles:
        raise ParameterError(("cloud",), f" NAME (backends: {', '.join(labels)})",
                             before="the runs have no cloud reference (no backend has role cloud): name one with ")
    infos = tuple(BackendInfo(**{**i.__dict__, "role": r}) for i, r in zip(infos, roles))
    infos = with_pue(infos, [parse_pue(x) for x in pue], lambda name: names([name], "pue"))
    pq, _ = under_basis(pq, infos, energy_basis)
    ref, _ = _reference(None, infos, roles)
    ri = labels.index(ref)
    prices = {x: (pin, pout) for n_, pin, pout in prices_raw for x in names([n_], "api_prices")}
    cost = cost_matrix(pq, labels, roles, usd_per_kwh, prices)
    li = [j for j in range(len(infos)) if roles[j] == "local"
          and (infos[j].run_id, infos[j].backend) != (infos[ri].run_id, infos[ri].backend)]
    if not li:
        raise ParameterError(("local",), " NAME", before="the runs have no local backend besides the cloud reference: "
                                                         "name them with ")
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
            raise ParameterError(("grading",), " vs-backend: no record of the local backends was judged against a "
                                 "reference backend's answer (ipw run --judge ... --grading vs-backend)")
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


def subset(data: RouteData, rows: np.ndarray) -> RouteData:
    def s(x: Any) -> Any:
        return None if x is None else x[rows]

    return RouteData(tuple(np.asarray(data.query_id, object)[rows]), tuple(np.asarray(data.prompts, object)[rows]),
                     tuple(np.asarray(data.category, object)[rows]), data.local, data.cloud, data.grading,
                     data.label[rows], data.correct[rows], data.energy_j[rows], data.latency_s[rows],
                     data.cloud_correct[rows], data.cloud_energy_j[rows], data.cloud_latency_s[rows],
                     s(data.cost_usd), s(data.cloud_cost_usd), data.trained_on,
                     None if data.energy_errors is None else data.energy_errors.items(rows))
