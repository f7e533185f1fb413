"""``ipw check``: a regression gate that needs an effect beyond a threshold *and* significance.

For every backend present in both runs, each metric's change (candidate vs baseline) is computed on
the queries both share, and a paired bootstrap over queries gives its distribution. A change is a
**regression** only when it exceeds its threshold in the bad direction, exceeds the metric's noise
**floor** (what identical runs on this machine moved: ``calibrate``, or half the drift an interleaved
job saw), and the one-sided bootstrap p-value is below α; beyond the threshold but within the floor or
not significant it is **inconclusive** (a failure only with ``--strict``).

Beside the energy gate, the **work gate** compares each query's prompt tokens, output tokens and
errors exactly (greedy decoding makes them deterministic): more output tokens on the same queries is a
regression with no noise at all, whatever the energy could resolve.

``check_interleaved`` judges one job of short blocks in pairs, A B then B A, over shards of the queries
(``ipw.running.interleave``): energy and time over the pairs (Student's t; a block's shift is shared by all of its
queries), answers and tokens over the queries of each side's pooled blocks; the A blocks of the first and
last rounds give the drift the job saw. Exit codes: 0 pass, 1 regression, 2 not comparable or usage error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ipw.errors import IpwError, ParameterError
from ipw.results import RunManifest
from ipw.telemetry.hardware import HARDWARE_KEYS, hardware_key, machines
from ipw.analysis import fmt
from ipw.analysis.basis import BASIS_TEXT, check_basis, values_under
from ipw.analysis.metrics import METRICS, gated_metric, quantile_inputs, quantile_keys, query_columns, values
from ipw.sanitize import github_escape, github_property, md_text
from ipw.analysis.stats import LEVEL, MeasurementError, bootstrap_draws, bounds, n_resamples

# the metrics and their aliases come from ipw.analysis.metrics (the one table); failed candidate queries count
# as incorrect, and their share is itself gated
DEFAULT_THRESHOLDS = ("energy_per_query:+5%", "accuracy:-2pp", "error_rate:+2pp")


@dataclass(frozen=True)
class Threshold:
    metric: str
    limit: float  # signed: +5 means an increase of more than 5 (% or pp) is bad; -2 a decrease of more than 2
    unit: str  # % (relative) or pp (percentage points): the metric's change unit

    @property
    def text(self) -> str:
        return f"{self.metric}:{self.limit:+g}{self.unit}"


def parse_threshold(text: str) -> Threshold:
    m = re.fullmatch(r"\s*([a-z_0-9]+)\s*:\s*([+-])\s*([0-9]*\.?[0-9]+)\s*(%|pp)\s*", text)
    if not m:
        raise ParameterError(("fail_if",), f" {text!r}: expected METRIC:+N% or METRIC:-Npp, e.g. energy_per_query:+5%")
    metric, sign, number, unit = m.groups()
    found = gated_metric(metric)
    if found is None:
        known = [name for x in METRICS if x.better for name in (x.name, *x.aliases)]
        raise ParameterError(("fail_if",), f" {text!r}: unknown metric {metric!r} (known: {', '.join(known)})")
    if unit != found.change_unit:
        raise ParameterError(("fail_if",), f" {text!r}: {metric} takes a threshold in {found.change_unit}")
    return Threshold(metric, float(number) * (1 if sign == "+" else -1), unit)


@dataclass(frozen=True)
class Verdict:
    backend: str
    metric: str
    threshold: str
    baseline: float
    candidate: float
    change: float  # in the threshold's unit
    ci_lo: float
    ci_hi: float
    p_value: float  # one-sided, for a change in the bad direction
    status: str  # regression | inconclusive | improvement | pass | changed (work gate: counts differ, none more)
    n_queries: int
    floor: float = float("nan")  # noise floor in the threshold's unit (NaN: none known); a change within it is noise
    floor_source: str = ""  # where the floor comes from: calibration, drift, ...
    detail: str = ""  # work gate: how many queries changed
    unit: str = "%"  # of change, ci_lo, ci_hi and floor: the threshold's (% or pp; the work gate: %)


@dataclass(frozen=True)
class Drift:
    """What an interleaved job's baseline did over time: a metric's change from its first A block to its last."""

    backend: str
    metric: str
    change: float  # in the threshold's unit
    unit: str


@dataclass(frozen=True)
class CheckResult:
    verdicts: tuple[Verdict, ...]
    alpha: float
    strict: bool
    notes: tuple[str, ...]
    drift: tuple[Drift, ...] = ()  # interleaved jobs only
    blocks: tuple[str, ...] = ()  # interleaved jobs only: the block order, e.g. ("A", "B", "B", "A")

    @property
    def exit_code(self) -> int:
        bad = {"regression", "inconclusive", "changed"} if self.strict else {"regression"}
        return 1 if any(v.status in bad for v in self.verdicts) else 0


WORK = (("prompt_tokens", "prompt_tokens"), ("output_tokens", "completion_tokens"), ("errors", "errors"))


def _greedy(manifest: RunManifest) -> bool | None:
    """True when the run decoded greedily (temperature 0), False when it sampled, None when the run does not say."""
    temperature = ((manifest.config or {}).get("generation") or {}).get("temperature")
    return None if temperature is None else float(temperature) == 0.0


def work_verdicts(name: str, vb: dict[str, Any], vc: dict[str, Any], n: int) -> list[Verdict]:
    """The work gate: each query's prompt tokens, output tokens and errors compared exactly. Any query whose
    count differs is reported; more in total is a regression, fewer (or as many, moved) is ``changed``."""
    out = []
    for metric, key in WORK:
        b, c = vb.get(key), vc.get(key)
        if b is None or c is None:
            continue
        b, c = np.asarray(b, float), np.asarray(c, float)
        differs = ~((b == c) | (np.isnan(b) & np.isnan(c)))
        tb, tc = float(np.nansum(b)), float(np.nansum(c))
        k = int(differs.sum())
        status = "pass" if k == 0 else "regression" if tc > tb else "improvement" if metric == "errors" else "changed"
        change = (100 * (tc / tb - 1) if tb else (0.0 if tc == 0 else float("inf")))
        out.append(Verdict(name, metric, "exact", tb, tc, change, float("nan"), float("nan"), float("nan"), status, n,
                           detail=f"{k} of {n} queries differ"))
    return out


def comparability(base_manifest: RunManifest, cand_manifest: RunManifest, allow_hardware_mismatch: bool) -> list[str]:
    """Reasons the two runs cannot be compared (empty when they can)."""
    reasons = []
    for role, m in (("baseline", base_manifest), ("candidate", cand_manifest)):
        if m.status != "complete":  # an interrupted run covers only some queries of some backends
            reasons.append(f"the {role} run is {m.status or 'of unknown status'}, not complete "
                           f"(finish it with: ipw run --resume RUN_DIR)")
    assert base_manifest.dataset is not None and cand_manifest.dataset is not None  # load_run(require=...)
    fb, fc = base_manifest.dataset["fingerprint"], cand_manifest.dataset["fingerprint"]
    if fb != fc:
        reasons.append(f"dataset fingerprints differ ({fb} vs {fc})")
    if not allow_hardware_mismatch:
        mb, mc = machines(base_manifest), machines(cand_manifest)
        if len(mb) == 1 and len(mc) == 1:
            hb, hc = mb[0], mc[0]
            diff = [k for k in HARDWARE_KEYS if hb.get(k) != hc.get(k)]
            if diff:
                shown = "; ".join(f"{k}: {hb.get(k)!r} vs {hc.get(k)!r}" for k in diff)
                reasons.append(f"hardware differs ({shown}); pass --allow-hardware-mismatch to compare anyway")
        elif {hardware_key(h) for h in mb} != {hardware_key(h) for h in mc}:
            reasons.append(f"hardware differs (the baseline ran on {len(mb)} kind(s) of machine, the candidate on "
                           f"{len(mc)}, not the same ones); pass --allow-hardware-mismatch to compare anyway")
    return reasons


def _per_query(manifest: RunManifest, frame: Any) -> dict[str, Any]:
    from ipw.analysis.load import parts_of

    return {p.info.label: p for p in parts_of(Path(manifest.run_id or "run"), manifest, frame)}  # NAME or NAME@cN


def _sums(names: list[str], cols: dict[str, Any], s: np.ndarray, q: np.ndarray, offset: int, q_offset: int,
          ) -> dict[str, Any]:
    """One run's metric inputs (ipw.analysis.metrics.values) from the draws' sums and quantiles."""
    g = {}
    for k, make in cols.items():
        g[k] = s[..., offset + names.index(make if isinstance(make, str) else k)]
    g.update((k, q[..., q_offset + i]) for i, k in enumerate(quantile_keys()))
    return g


def check_runs(base_manifest: RunManifest, base: Any, cand_manifest: RunManifest, cand: Any,
               thresholds: list[Threshold], *,
               alpha: float = 0.01, strict: bool = False, allow_hardware_mismatch: bool = False,
               n_boot: int | None = None, seed: int = 0, floors: dict[tuple[str, str], tuple[float, str]] | None = None,
               work_gate: bool = True, unsteady: dict[str, str] | None = None, energy_basis: str = "chip",
               ) -> CheckResult:
    """Every metric is computed with ipw.analysis.metrics over the queries both runs have: a query the candidate
    failed counts as incorrect (and as an error); a query without energy is missing from the energy
    metrics (and noted), never a reason to drop it from the others.

    ``floors``: {(backend, metric): (floor in the threshold's unit, source)}; a change within its floor is noise.
    ``work_gate``: compare token counts and errors per query exactly, when both runs decoded greedily.
    ``unsteady``: {backend: why its token counts are not deterministic}; its work rows report, never fail. A
    backend served several requests at once (batched decoding) is unsteady without being named."""
    from ipw.analysis.load import take

    reasons = comparability(base_manifest, cand_manifest, allow_hardware_mismatch)
    if reasons:
        raise IpwError("not comparable: " + "; ".join(reasons))
    verdicts, notes = [], [] if check_basis(energy_basis) == "chip" else [f"energy basis: {BASIS_TEXT[energy_basis]}"]
    floors = floors or {}
    greedy = (_greedy(base_manifest), _greedy(cand_manifest))
    if work_gate and False in greedy:
        notes.append("work gate not applied: a run samples (temperature > 0), so its token counts are not "
                     "deterministic")
    work_gate = work_gate and greedy == (True, True)
    bparts, cparts = _per_query(base_manifest, base), _per_query(cand_manifest, cand)
    missing = [b for b in bparts if b not in cparts]
    if missing:
        raise IpwError(f"not comparable: backend(s) {', '.join(missing)} missing from the candidate run")
    measured = {"measured", "measured_interpolated"}
    for name, pb in bparts.items():
        pc = cparts[name]
        qb, qc = set(pb.info.energy_qualities), set(pc.info.energy_qualities)
        if bool(qb & measured) != bool(qc & measured) or bool(qb - measured) != bool(qc - measured):
            raise IpwError(f"not comparable: backend {name}: energy bases differ ({sorted(qb)} vs {sorted(qc)})")
        common = pb.query_id[pb.present].intersection(pc.query_id[pc.present], sort=False)
        vb: dict[str, Any] = take(pb.values, pb.query_id.get_indexer(common))
        vc: dict[str, Any] = take(pc.values, pc.query_id.get_indexer(common))
        n = len(common)
        if n == 0:
            raise IpwError(f"not comparable: backend {name}: the runs share no query")
        # the joules compared (--energy-basis) and each run's carbon intensity (ipw.analysis.basis)
        vb, basis_notes = values_under(vb, pb.info, energy_basis, base_manifest.carbon)
        vc, cand_notes = values_under(vc, pc.info, energy_basis, cand_manifest.carbon)
        notes += list(dict.fromkeys(basis_notes + cand_notes))
        if n < max(int(pb.present.sum()), int(pc.present.sum())):
            notes.append(f"{name}: compared on the {n} queries both runs have")
        for role, v in (("baseline", vb), ("candidate", vc)):
            failed, no_energy = int((v["error_share"] > 0).sum()), int(np.isnan(v["energy_j"]).sum())
            if failed:
                notes.append(f"{name}: {failed} of {n} {role} queries failed (counted incorrect)")
            if no_energy:
                notes.append(f"{name}: {no_energy} of {n} {role} queries have no energy (missing from the "
                             "energy metrics)")
        cb, cc = query_columns(vb), query_columns(vc)
        make_b = {k: m for k, m in cb.items() if not isinstance(m, str)}  # the columns to make (others: equal to one)
        make_c = {k: m for k, m in cc.items() if not isinstance(m, str)}
        nb_, nc_ = list(make_b), list(make_c)
        columns = [m() for m in make_b.values()] + [m() for m in make_c.values()]
        quantiles = [(x, ps) for v in (vb, vc) for _, x, ps in quantile_inputs(v)]
        errors = _measurement(name, vb, vc, nb_.index("energy_j"), len(nb_) + nc_.index("energy_j"), notes)
        # paired: one set of resample weights; each query's independent energy error drawn on every resample
        d = bootstrap_draws(columns, quantiles, n_boot=n_boot or n_resamples(n), seed=seed, measurement=errors)
        nq = len(quantile_keys())
        point_b = values(_sums(nb_, cb, d.point_sums, np.asarray(d.point_quantiles), 0, 0))
        point_c = values(_sums(nc_, cc, d.point_sums, np.asarray(d.point_quantiles), len(nb_), nq))
        boot_b = values(_sums(nb_, cb, d.sums, d.quantiles, 0, 0))
        boot_c = values(_sums(nc_, cc, d.sums, d.quantiles, len(nb_), nq))
        if d.measurement:  # the same resamples without measurement error: what the stated uncertainty alone moves
            d0 = bootstrap_draws(columns, quantiles, n_boot=d.n_boot, seed=seed)
            exact_b = values(_sums(nb_, cb, d0.sums, d0.quantiles, 0, 0))
            exact_c = values(_sums(nc_, cc, d0.sums, d0.quantiles, len(nb_), nq))
        for t in thresholds:
            metric = gated_metric(t.metric)
            assert metric is not None  # parse_threshold checked the name
            bv, cv = float(point_b[metric.name]), float(point_c[metric.name])
            if metric.needs and not (np.isfinite(bv) or np.isfinite(cv)) and _none_known(vb, metric.needs) \
                    and _none_known(vc, metric.needs):  # e.g. a chat run without a judge, against itself
                notes.append(f"{name}: {t.metric} not checked: no query has {NEEDS_TEXT[metric.needs]} in either run")
                continue
            if metric.energy and _all_zero(vb["energy_j"]):  # a change from 0 J is undefined (and IPJ infinite)
                raise IpwError(f"not comparable: backend {name}: the baseline has 0 J on every query, no energy to "
                               f"compare {t.metric} against")
            if t.unit == "%" and bv == 0:
                raise IpwError(f"not comparable: backend {name}: the baseline's {t.metric} is 0, a change relative "
                               "to it is undefined")
            if not (np.isfinite(bv) and np.isfinite(cv)):  # nothing to test: a gate that passes on no data would lie
                empty = [k for k in ("energy_j", "ttft_s", "completion_tokens")
                         if np.isnan(vb[k]).all() or np.isnan(vc[k]).all()]
                raise IpwError(f"not comparable: backend {name}: {t.metric} is unknown (no query has "
                               f"{empty[0] if empty else 'every value'} in both runs; records without energy cannot "
                               "be checked)")
            with np.errstate(divide="ignore", invalid="ignore"):
                if t.unit == "%":
                    change, stats = 100 * (cv / bv - 1.0), 100 * (boot_c[metric.name] / boot_b[metric.name] - 1.0)
                else:
                    change, stats = 100 * (cv - bv), 100 * (boot_c[metric.name] - boot_b[metric.name])
            stats = stats[np.isfinite(stats)]
            bad_up = t.limit > 0
            worse = stats > 0 if bad_up else stats < 0
            p_value = float((np.sum(~worse) + 1) / (len(stats) + 1)) if len(stats) else 1.0
            p_better = float((np.sum(worse) + 1) / (len(stats) + 1)) if len(stats) else 1.0
            floor, source = floors.get((name, t.metric), (float("nan"), ""))
            if d.measurement:  # a floor at least as wide as the stated uncertainty of the change (95%)
                with np.errstate(divide="ignore", invalid="ignore"):
                    if t.unit == "%":
                        exact = 100 * (exact_c[metric.name] / exact_b[metric.name] - 1.0)
                    else:
                        exact = 100 * (exact_c[metric.name] - exact_b[metric.name])
                    moved = np.abs(100 * (boot_c[metric.name] / boot_b[metric.name] - 1.0) - exact if t.unit == "%"
                                   else 100 * (boot_c[metric.name] - boot_b[metric.name]) - exact)
                moved = moved[np.isfinite(moved)]
                stated = float(np.quantile(moved, 0.95)) if len(moved) else float("nan")
                if stated > 1e-9 and not stated <= floor:
                    floor, source = stated, "the stated measurement uncertainty (95%)"
            status = _status(t, float(change), p_value, p_better, alpha, floor)
            if floor > abs(t.limit):
                shown = fmt.change(floor, t.unit, sign=False)
                notes.append(f"{name}: {t.metric}'s noise floor ({shown}, {source}) is above the threshold "
                             f"{t.text}: a change between them is inconclusive, not a regression")
            lo, hi = bounds(stats)
            verdicts.append(Verdict(name, t.metric, t.text, bv, cv, float(change), lo, hi, p_value,
                                    status, n, float(floor), source, unit=t.unit))
        if work_gate:
            rows = work_verdicts(name, vb, vc, n)
            level = max(pb.info.concurrency, pc.info.concurrency)
            why = (unsteady or {}).get(name) or (f"served {level} requests at once: batched decoding need not be "
                                                  "deterministic" if level > 1 else "")
            if why and any(v.status == "regression" for v in rows):
                notes.append(f"{name}: token counts or errors changed, reported and not failed: {why}")
                rows = [replace(v, status="changed") if v.status == "regression" else v for v in rows]
            verdicts += rows
    return CheckResult(tuple(verdicts), alpha, strict, tuple(notes))


def _status(t: Threshold, change: float, p_worse: float, p_better: float, alpha: float, floor: float) -> str:
    """A change beyond its threshold in the bad direction is a regression when it is significant (one-sided
    p below α) and beyond its noise floor, else inconclusive; one as far in the good direction, with the same
    evidence, is an improvement; anything else passes."""
    bad_up = t.limit > 0
    noise = abs(change) <= floor  # False when no floor is known (NaN)
    if change > t.limit if bad_up else change < t.limit:
        return "regression" if p_worse < alpha and not noise else "inconclusive"
    if (change < -abs(t.limit) if bad_up else change > abs(t.limit)) and p_better < alpha and not noise:
        return "improvement"
    return "pass"


def _measurement(name: str, vb: dict[str, Any], vc: dict[str, Any], col_b: int, col_c: int, notes: list[str],
                 ) -> list[MeasurementError]:
    """The energy columns' measurement errors (ipw.analysis.stats): each query's independent error, drawn for
    each run apart, and each shared error (one calibration, or the estimated model's error, the same for every
    query) with the key of its source (``ipw.analysis.load``): a source both runs share (this machine's CPU
    model, a device's own bias: ``comparability`` holds them to one kind of machine) is one draw for both, so
    it scales both alike and cancels in the change; a sensor session's calibration is each run's own."""
    out = []
    shared: dict[str, list[float]] = {}
    for col, v in ((col_b, vb), (col_c, vc)):
        e, sd = v["energy_j"], v.get("energy_sd_j")
        has = ~np.isnan(e)
        total = float(np.nansum(np.where(has, e, 0.0)))
        if sd is not None:
            out.append(MeasurementError(col, np.where(has, np.nan_to_num(sd), 0.0)))
        for key, sh in (v.get("shared_sd_j") or {}).items():
            part = np.where(has, np.nan_to_num(sh), 0.0)
            out.append(MeasurementError(col, np.zeros(len(e)), part, key))
            if total > 0:  # of 0 J no share can be stated (nor divided by)
                shared.setdefault(key, []).append(100 * float(part.sum()) / total)
    both = [max(x) for x in shared.values() if len(x) == 2]
    apart = [max(x) for x in shared.values() if len(x) == 1]
    if both:
        notes.append(f"{name}: the energy's shared error (±{1.645 * max(both):.0f}% at 90%, one for every query: the "
                     "estimate's model or a device's bias on this machine) is common to both runs and cancels in "
                     "the change; each query's independent error is drawn on every resample")
    if apart:
        notes.append(f"{name}: a shared error that each run has of its own (±{1.645 * max(apart):.1f}% at 90%: a "
                     "sensor session's calibration, or a record that does not say its machine) is drawn for each "
                     "run apart")
    return out


def _shard_of(manifest: RunManifest) -> tuple[int, int]:
    """(index, count) of a ``--shard`` run; (1, 1) for a run of the whole query set."""
    return (int(manifest.shard["index"]), int(manifest.shard["count"])) if manifest.shard else (1, 1)


def pool_blocks(blocks: list[tuple[RunManifest, Any]]) -> tuple[RunManifest, Any]:
    """Blocks as one run whose blocks are repeats: each query's value is the mean over the blocks that ran it.
    Blocks of shards pool into one run of the whole query set (every shard must be there).

    ``check_interleaved`` pools each side's blocks with it; bench/gate/gate_blocks.py pools a round of blocks
    into the committed baseline (and candidate) that ``check_runs`` compares, as a job's own blocks are."""
    import pandas as pd

    manifests = [m for m, _ in blocks]
    for m in manifests:
        if m.status != "complete":
            raise IpwError(f"not comparable: block {m.run_id} is {m.status}, not complete")
    full = {((m.shard or {}).get("dataset") or m.dataset or {}).get("fingerprint") for m in manifests}
    if len(full) != 1:
        raise IpwError(f"not comparable: the blocks ran different query sets ({sorted(map(str, full))})")
    shards = {_shard_of(m) for m in manifests}
    counts = {count for _, count in shards}
    if len(counts) != 1 or {index for index, _ in shards} != set(range(1, max(counts) + 1)):
        raise IpwError(f"not comparable: the blocks do not cover every shard of the query set once ({sorted(shards)})")
    first = manifests[0]
    if first.shard:
        first = replace(first, dataset=first.shard["dataset"], shard=None)
    frame = pd.concat([f.assign(repeat=i) for i, (_, f) in enumerate(blocks)], ignore_index=True)
    return first, frame


def _over_pairs(changes: list[float], t: Threshold) -> tuple[float, float, float, float, float]:
    """A change, its CI (``LEVEL``) and its one-sided p-values (worse, better) from each block pair's change:
    Student's t over the pairs, on log ratios for a relative (%) change."""
    from ipw.analysis.fit import t_cdf, t_quantile

    x = np.asarray(changes, dtype=float)
    x = x[np.isfinite(x)]
    relative = t.unit == "%"
    if relative:
        x = np.log1p(x / 100)

    def back(y: float) -> float:
        return float(100 * np.expm1(y)) if relative else float(y)

    n = len(x)
    if n < 2:
        return (back(x.mean()) if n else float("nan")), float("nan"), float("nan"), 1.0, 1.0
    mean, se = float(x.mean()), float(x.std(ddof=1) / np.sqrt(n))
    if se == 0:  # every pair moved alike: no spread to weigh the change against
        up, down, lo, hi = float(mean <= 0), float(mean >= 0), mean, mean
    else:
        up, down = 1.0 - t_cdf(mean / se, n - 1), t_cdf(mean / se, n - 1)
        half = t_quantile((1 + LEVEL) / 2, n - 1) * se
        lo, hi = mean - half, mean + half
    worse, better = (up, down) if t.limit > 0 else (down, up)
    return back(mean), back(lo), back(hi), worse, better


def check_interleaved(blocks: list[tuple[str, RunManifest, Any]], thresholds: list[Threshold], *, alpha: float = 0.01,
                      strict: bool = False, floors: dict[tuple[str, str], tuple[float, str]] | None = None,
                      work_gate: bool = True, n_boot: int | None = None,
                      seed: int = 0) -> CheckResult:
    """One interleaved job (``ipw.running.interleave.job_plan``): ``blocks`` are (side "A" or "B", manifest, frame) in the
    order they ran; each two consecutive blocks are a pair, one A and one B over the same shard of the queries.

    Energy, power and time (``Metric.follows_machine``) are judged over the pairs: each pair's change, then Student's
    t over the pairs. Another tenant's burst or a slower minute shifts a whole block, every query of it alike:
    a bootstrap over queries reads that as a change, while the pairs see it as the noise it is, and the two
    blocks of a pair ran back to back. Answers, errors and tokens are each query's own, so they are judged over
    the queries of each side's pooled blocks (``check_runs``; the work gate). The drift is each metric's change
    from the A blocks of the first round to those of the last (the same queries, ``job_plan``'s rounds); half
    of it is a floor below which the job does not call a change; the larger of it and a given (calibrated)
    floor is used."""
    order = tuple(side for side, _, _ in blocks)
    pairs = [blocks[i:i + 2] for i in range(0, len(blocks), 2)]
    if len(pairs) < 2 or any(sorted(side for side, _, _ in pair) != ["A", "B"] for pair in pairs):
        raise IpwError(f"an interleaved job is pairs of blocks, one A and one B each, at least 2 pairs "
                       f"(got {' '.join(order)})")
    pairs = [sorted(pair, key=lambda block: block[0]) for pair in pairs]  # (A, B)
    for a, b in pairs:
        if _shard_of(a[1]) != _shard_of(b[1]):
            raise IpwError(f"not comparable: a pair of blocks ran different shards ({a[1].run_id}, {b[1].run_id})")
    # (side, shard) -> its blocks in time order
    runs: dict[tuple[str, tuple[int, int]], list[tuple[RunManifest, Any]]] = {}
    for side, m, f in blocks:
        runs.setdefault((side, _shard_of(m)), []).append((m, f))
    # whether the blocks of one side agree exactly on every query's tokens and errors (a batching server need not)
    unsteady: dict[str, str] = {}
    for (side, _), same in runs.items():
        for k in range(1, len(same)):
            for v in check_runs(*same[0], *same[k], [], n_boot=1, seed=seed).verdicts:
                if v.threshold == "exact" and v.status != "pass" and v.backend not in unsteady:
                    unsteady[v.backend] = (f"its {side} blocks differ among themselves ({v.metric}: {v.detail}), so "
                                           "it is not deterministic here")
    notes = []
    a_runs = [same for (side, _), same in runs.items() if side == "A"]
    drift: tuple[Drift, ...] = ()
    if all(len(same) > 1 for same in a_runs):  # the first round's A blocks against the last round's
        seen = check_runs(*pool_blocks([same[0] for same in a_runs]), *pool_blocks([same[-1] for same in a_runs]),
                          thresholds, n_boot=1, seed=seed, work_gate=False)
        drift = tuple(Drift(v.backend, v.metric, v.change, v.unit)
                      for v in seen.verdicts)
    else:
        notes.append("no drift measured: each shard ran once a side (one round); give --blocks a multiple of "
                     "4 x --shards for two rounds")
    merged = dict(floors or {})
    for d in drift:
        half = abs(d.change) / 2
        if np.isfinite(half) and half > merged.get((d.backend, d.metric), (float("-inf"), ""))[0]:
            merged[(d.backend, d.metric)] = (half, f"half the drift of the A blocks ({fmt.change(d.change, d.unit)})")
    pooled = check_runs(*pool_blocks([(m, f) for side, m, f in blocks if side == "A"]),
                        *pool_blocks([(m, f) for side, m, f in blocks if side == "B"]), thresholds, alpha=alpha,
                        strict=strict, floors=merged, work_gate=work_gate, n_boot=n_boot, seed=seed, unsteady=unsteady)
    gated = {t.text: (t, gated_metric(t.metric)) for t in thresholds}  # parse_threshold made sure each is gated
    by_pairs = {text: t for text, (t, metric) in gated.items() if metric is not None and metric.follows_machine}
    changes: dict[tuple[str, str], list[float]] = {}
    for a, b in pairs:
        for v in check_runs(*a[1:], *b[1:], list(by_pairs.values()), n_boot=1, seed=seed, work_gate=False).verdicts:
            changes.setdefault((v.backend, v.threshold), []).append(v.change)
    verdicts = []
    for v in pooled.verdicts:
        t = by_pairs.get(v.threshold)
        if t is not None and v.metric == t.metric:
            change, lo, hi, worse, better = _over_pairs(changes[(v.backend, v.threshold)], t)
            v = replace(v, change=change, ci_lo=lo, ci_hi=hi, p_value=worse,
                        status=_status(t, change, worse, better, alpha, v.floor))
        verdicts.append(v)
    if by_pairs:
        notes.append(f"{', '.join(t.metric for t in by_pairs.values())}: the change is the mean of the {len(pairs)} "
                     f"block pairs' changes, judged by Student's t over the pairs ({len(pairs) - 1} degrees of "
                     "freedom): a block's shift is shared by all of its queries, so queries cannot judge it")
    return CheckResult(tuple(verdicts), alpha, strict, pooled.notes + tuple(notes), drift, order)


def calibrate(runs: list[tuple[RunManifest, object]], thresholds: list[Threshold], *, n_boot: int = 1000,
              ) -> dict[str, Any]:
    """The noise floor of identical runs: per backend and gated metric, the largest change between any two of
    them (the earlier one as baseline). Returns the JSON object ``ipw check --floor`` reads."""
    if len(runs) < 2:
        raise ParameterError(("calibration_runs",), ": give at least 2 run folders of the same configuration")
    changes: dict[str, dict[str, list[float]]] = {}
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            res = check_runs(*runs[i], *runs[j], thresholds, n_boot=n_boot, work_gate=False)
            for v in res.verdicts:
                changes.setdefault(v.backend, {}).setdefault(v.metric, []).append(round(v.change, 4))
    floors = {backend: {metric: max(abs(x) for x in xs) for metric, xs in by.items()} for backend, by in changes.items()}
    return {"method": f"largest change between any two of {len(runs)} identical runs", "n_runs": len(runs),
            "floors": floors, "changes": changes}


def read_floors(path: str | Path) -> dict[tuple[str, str], tuple[float, str]]:
    """{(backend, metric): (floor, source)} from a file written by ``ipw check --calibrate``."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        floors = data["floors"]
        return {(str(b), str(m)): (float(x), f"calibration: {data.get('method', path)}")
                for b, by in floors.items() for m, x in by.items()}
    except OSError as exc:
        raise ParameterError(("floor",), f" {path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ParameterError(("floor",), f" {path}: not a floor file written by ipw check --calibrate") from None


NEEDS_TEXT = {"correct": "a score (judge-only items are unscored without a judge)", "win_tie": "a judge's verdict"}


def _none_known(v: dict[str, Any], key: str) -> bool:
    return v.get(key) is None or bool(np.isnan(v[key]).all())


def _all_zero(x: Any) -> bool:
    """Some value is known and every known one is 0 (e.g. 0 J on every query with energy)."""
    known = np.asarray(x, float)[~np.isnan(np.asarray(x, float))]
    return len(known) > 0 and not known.any()


COLUMNS = ("backend", "metric", "threshold", "baseline", "candidate", f"change [{LEVEL:.0%} CI]", "noise floor", "p",
           "verdict")


def cells(v: Verdict) -> tuple[str, ...]:
    """One verdict as the table's text cells (the terminal table and the Markdown one): the baseline and the
    candidate as the metric table shows the metric (``ipw.analysis.fmt``), the change in its unit."""
    if v.threshold == "exact":  # the work gate: counts, compared query by query
        return (v.backend, v.metric, v.threshold, fmt.value(v.baseline, fmt.COUNT), fmt.value(v.candidate, fmt.COUNT),
                f"{fmt.change(v.change, v.unit)} ({v.detail})", "0", "-", v.status)
    metric = gated_metric(v.metric)
    assert metric is not None  # a threshold's metric (parse_threshold checked it)
    f = metric.format
    floor = "±" + fmt.change(v.floor, v.unit, sign=False) if np.isfinite(v.floor) else "-"
    return (v.backend, v.metric, v.threshold, fmt.value(v.baseline, f), fmt.value(v.candidate, f),
            fmt.change_interval(v.change, v.ci_lo, v.ci_hi, v.unit), floor, fmt.value(v.p_value), v.status)


def drift_lines(result: CheckResult) -> list[str]:
    """What an interleaved job's A blocks did over time, per backend."""
    if not result.blocks:
        return []
    by: dict[str, list[str]] = {}
    for d in result.drift:
        by.setdefault(d.backend, []).append(f"{d.metric} {fmt.change(d.change, d.unit)}")
    return [f"interleaved blocks {' '.join(result.blocks)}: drift of the A blocks from the first round to the "
            f"last: {backend}: {', '.join(parts)} (pairs alternate A B, B A, which cancels a linear drift; half of "
            "it is the floor)" for backend, parts in by.items()]


def markdown(result: CheckResult) -> str:
    icon = {"regression": "❌ regression", "inconclusive": "⚠️ inconclusive", "improvement": "✅ improvement",
            "pass": "✅ pass", "changed": "⚠️ changed"}
    lines = [f"### ipw check: {'FAIL' if result.exit_code else 'PASS'} (α = {result.alpha:g}"
             f"{', strict' if result.strict else ''})", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for v in result.verdicts:
        c = cells(v)
        lines.append("| " + " | ".join((md_text(c[0]), *c[1:-1], icon[v.status])) + " |")
    lines += [""] + [f"- {md_text(n)}" for n in (*drift_lines(result), *result.notes)]
    return "\n".join(lines) + "\n"


def github_annotations(result: CheckResult) -> str:
    out = []
    for v in result.verdicts:
        if v.status in ("regression", "inconclusive", "changed"):
            level = "error" if v.status == "regression" or result.strict else "warning"
            # a backend name is the user's text: escaped, it can neither end the command nor start another
            title = github_property(f"ipw check {v.status}: {v.backend} {v.metric}")
            _, _, _, base, cand, *_ = cells(v)
            what = (f"{base} -> {cand}, {v.detail}" if v.threshold == "exact" else
                    f"changed {fmt.change(v.change, v.unit)} (threshold {v.threshold}, p={fmt.value(v.p_value)}, "
                    f"n={v.n_queries})")
            out.append(f"::{level} title={title}::" + github_escape(f"{v.backend}: {v.metric} {what}"))
    return "\n".join(out)


def junit_xml(result: CheckResult) -> str:
    from xml.sax.saxutils import quoteattr

    failures = [v for v in result.verdicts
                if v.status == "regression" or (result.strict and v.status in ("inconclusive", "changed"))]
    cases = []
    for v in result.verdicts:
        name = quoteattr(f"{v.backend}.{v.metric}")
        body = ""
        if v in failures:
            text = f"{v.status}: change {fmt.change(v.change, v.unit)} beyond {v.threshold}, p={fmt.value(v.p_value)}"
            body = f"<failure message={quoteattr(text)}/>"
        cases.append(f'  <testcase classname="ipw.check" name={name}>{body}</testcase>')
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<testsuite name="ipw check" tests="{len(result.verdicts)}" '
            f'failures="{len(failures)}">\n' + "\n".join(cases) + "\n</testsuite>\n")
