"""``ipw check``: a regression gate that needs an effect beyond a threshold *and* significance.

For every backend present in both runs, each metric's change (candidate vs baseline) is computed on
the queries both share, and a paired bootstrap over queries gives its distribution. A change is a
**regression** only when it exceeds its threshold in the bad direction and the one-sided bootstrap
p-value is below α; beyond the threshold but not significant it is **inconclusive** (a failure only
with ``--strict``). Exit codes: 0 pass, 1 regression, 2 not comparable or usage error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from ipw.errors import IpwError
from ipw.results import RunManifest
from ipw.telemetry.hardware import HARDWARE_KEYS, hardware_key, machines
from ipw.analysis.metrics import METRICS, gated_metric, quantile_inputs, quantile_keys, query_columns, values
from ipw.sanitize import github_escape, github_property, md_text
from ipw.analysis.stats import bootstrap_draws

# the metrics and their aliases come from ipw.analysis.metrics (the one table); failed candidate queries count
# as incorrect, and their share is itself gated
DEFAULT_THRESHOLDS = ("energy_per_query:+5%", "accuracy:-2pp", "error_rate:+2pp")


@dataclass(frozen=True)
class Threshold:
    metric: str
    limit: float  # signed: +5 means an increase of more than 5 (% or pp) is bad; -2 a decrease of more than 2
    unit: str

    @property
    def text(self) -> str:
        return f"{self.metric}:{self.limit:+g}{self.unit}"


def parse_threshold(text: str) -> Threshold:
    m = re.fullmatch(r"\s*([a-z_0-9]+)\s*:\s*([+-])\s*([0-9]*\.?[0-9]+)\s*(%|pp)\s*", text)
    if not m:
        raise IpwError(f"--fail-if {text!r}: expected METRIC:+N% or METRIC:-Npp, e.g. energy_per_query:+5%")
    metric, sign, number, unit = m.groups()
    found = gated_metric(metric)
    if found is None:
        known = [name for x in METRICS if x.better for name in (x.name, *x.aliases)]
        raise IpwError(f"--fail-if {text!r}: unknown metric {metric!r} (known: {', '.join(known)})")
    if unit != found.change_unit:
        raise IpwError(f"--fail-if {text!r}: {metric} takes a threshold in {found.change_unit}")
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
    status: str  # regression | inconclusive | improvement | pass
    n_queries: int


@dataclass(frozen=True)
class CheckResult:
    verdicts: tuple[Verdict, ...]
    alpha: float
    strict: bool
    notes: tuple[str, ...]

    @property
    def exit_code(self) -> int:
        bad = {"regression", "inconclusive"} if self.strict else {"regression"}
        return 1 if any(v.status in bad for v in self.verdicts) else 0


def comparability(base_manifest: RunManifest, cand_manifest: RunManifest, allow_hardware_mismatch: bool) -> list[str]:
    """Reasons the two runs cannot be compared (empty when they can)."""
    reasons = []
    for role, m in (("baseline", base_manifest), ("candidate", cand_manifest)):
        if m.status != "complete":  # an interrupted run covers only some queries of some backends
            reasons.append(f"the {role} run is {m.status or 'of unknown status'}, not complete "
                           f"(finish it with: ipw run --resume RUN_DIR)")
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


def _per_query(manifest: RunManifest, frame) -> dict:
    from ipw.analysis.load import parts_of

    return {p.info.label: p for p in parts_of(manifest.run_id or "run", manifest, frame)}  # NAME or NAME@cN


def _sums(names: list[str], cols: dict, s: np.ndarray, q: np.ndarray, offset: int, q_offset: int) -> dict:
    """One run's metric inputs (ipw.analysis.metrics.values) from the draws' sums and quantiles."""
    g = {}
    for k, make in cols.items():
        g[k] = s[..., offset + names.index(make if isinstance(make, str) else k)]
    g.update((k, q[..., q_offset + i]) for i, k in enumerate(quantile_keys()))
    return g


def check_runs(base_manifest: RunManifest | dict, base, cand_manifest: RunManifest | dict, cand, thresholds: list[Threshold], *,
               alpha: float = 0.01, strict: bool = False, allow_hardware_mismatch: bool = False,
               n_boot: int = 4000, seed: int = 0) -> CheckResult:
    """Every metric is computed with ipw.analysis.metrics over the queries both runs have: a query the candidate
    failed counts as incorrect (and as an error); a query without energy is missing from the energy
    metrics (and noted), never a reason to drop it from the others."""
    from ipw.analysis.load import as_manifest

    base_manifest, cand_manifest = as_manifest(base_manifest), as_manifest(cand_manifest)
    reasons = comparability(base_manifest, cand_manifest, allow_hardware_mismatch)
    if reasons:
        raise IpwError("not comparable: " + "; ".join(reasons))
    verdicts, notes = [], []
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
        vb = {k: (None if x is None else x[pb.query_id.get_indexer(common)]) for k, x in pb.values.items()}
        vc = {k: (None if x is None else x[pc.query_id.get_indexer(common)]) for k, x in pc.values.items()}
        n = len(common)
        if n == 0:
            raise IpwError(f"not comparable: backend {name}: the runs share no query")
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
        nb_ = [k for k, m in cb.items() if not isinstance(m, str)]  # the columns to make (others: equal to one)
        nc_ = [k for k, m in cc.items() if not isinstance(m, str)]
        columns = [cb[k]() for k in nb_] + [cc[k]() for k in nc_]
        quantiles = [(x, ps) for v in (vb, vc) for _, x, ps in quantile_inputs(v)]
        d = bootstrap_draws(columns, quantiles, n_boot=n_boot, seed=seed)  # paired: one set of resample weights
        nq = len(quantile_keys())
        point_b = values(_sums(nb_, cb, d.point_sums, np.asarray(d.point_quantiles), 0, 0))
        point_c = values(_sums(nc_, cc, d.point_sums, np.asarray(d.point_quantiles), len(nb_), nq))
        boot_b = values(_sums(nb_, cb, d.sums, d.quantiles, 0, 0))
        boot_c = values(_sums(nc_, cc, d.sums, d.quantiles, len(nb_), nq))
        for t in thresholds:
            metric = gated_metric(t.metric)
            bv, cv = float(point_b[metric.name]), float(point_c[metric.name])
            if metric.needs and not (np.isfinite(bv) or np.isfinite(cv)) and _none_known(vb, metric.needs) \
                    and _none_known(vc, metric.needs):  # e.g. a chat run without a judge, against itself
                notes.append(f"{name}: {t.metric} not checked: no query has {NEEDS_TEXT[metric.needs]} in either run")
                continue
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
            beyond = change > t.limit if bad_up else change < t.limit
            if beyond and p_value < alpha:
                status = "regression"
            elif beyond:
                status = "inconclusive"
            elif (change < -abs(t.limit) if bad_up else change > abs(t.limit)) and p_better < alpha:
                status = "improvement"
            else:
                status = "pass"
            lo, hi = (np.quantile(stats, [0.025, 0.975]) if len(stats) else (np.nan, np.nan))
            verdicts.append(Verdict(name, t.metric, t.text, bv, cv, float(change), float(lo), float(hi), p_value,
                                    status, n))
    return CheckResult(tuple(verdicts), alpha, strict, tuple(notes))


NEEDS_TEXT = {"correct": "a score (judge-only items are unscored without a judge)", "win_tie": "a judge's verdict"}


def _none_known(v: dict, key: str) -> bool:
    return v.get(key) is None or bool(np.isnan(v[key]).all())


def markdown(result: CheckResult) -> str:
    icon = {"regression": "❌ regression", "inconclusive": "⚠️ inconclusive", "improvement": "✅ improvement",
            "pass": "✅ pass"}
    lines = [f"### ipw check: {'FAIL' if result.exit_code else 'PASS'} (α = {result.alpha:g}"
             f"{', strict' if result.strict else ''})", "",
             "| backend | metric | threshold | baseline | candidate | change [95% CI] | p | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for v in result.verdicts:
        unit = "pp" if v.threshold.endswith("pp") else "%"
        lines.append(f"| {md_text(v.backend)} | {v.metric} | {v.threshold} | {v.baseline:.4g} | {v.candidate:.4g} | "
                     f"{v.change:+.2f}{unit} [{v.ci_lo:+.2f}, {v.ci_hi:+.2f}] | {v.p_value:.3g} | {icon[v.status]} |")
    lines += [""] + [f"- {md_text(n)}" for n in result.notes]
    return "\n".join(lines) + "\n"


def github_annotations(result: CheckResult) -> str:
    out = []
    for v in result.verdicts:
        if v.status in ("regression", "inconclusive"):
            level = "error" if v.status == "regression" or result.strict else "warning"
            # a backend name is the user's text: escaped, it can neither end the command nor start another
            title = github_property(f"ipw check {v.status}: {v.backend} {v.metric}")
            out.append(f"::{level} title={title}::" + github_escape(
                f"{v.backend}: {v.metric} changed {v.change:+.2f} (threshold {v.threshold}, p={v.p_value:.3g}, "
                f"n={v.n_queries})"))
    return "\n".join(out)


def junit_xml(result: CheckResult) -> str:
    from xml.sax.saxutils import quoteattr

    failures = [v for v in result.verdicts if v.status == "regression" or (result.strict and v.status == "inconclusive")]
    cases = []
    for v in result.verdicts:
        name = quoteattr(f"{v.backend}.{v.metric}")
        body = ""
        if v in failures:
            body = f"<failure message={quoteattr(f'{v.status}: change {v.change:+.2f} beyond {v.threshold}, p={v.p_value:.3g}')}/>"
        cases.append(f'  <testcase classname="ipw.check" name={name}>{body}</testcase>')
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<testsuite name="ipw check" tests="{len(result.verdicts)}" '
            f'failures="{len(failures)}">\n' + "\n".join(cases) + "\n</testsuite>\n")
