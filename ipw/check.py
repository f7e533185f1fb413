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
from ipw.sanitize import github_escape, github_property, md_text
from ipw.stats import bootstrap_draws

# metric -> (unit of the threshold, statistic of the change over paired per-query columns)
# columns: base correct, cand correct, base energy, cand energy, base tokens, cand tokens, base ttft, cand ttft


def _rel(b: np.ndarray, c: np.ndarray) -> np.ndarray:
    return c / b - 1.0


METRICS = {
    "energy_per_query": ("%", lambda cb, cc, eb, ec, kb, kc, tb, tc: _rel(eb.mean(-1), ec.mean(-1))),
    "accuracy": ("pp", lambda cb, cc, eb, ec, kb, kc, tb, tc: 100 * (cc.mean(-1) - cb.mean(-1))),
    "j_per_token": ("%", lambda cb, cc, eb, ec, kb, kc, tb, tc: _rel(eb.sum(-1) / kb.sum(-1), ec.sum(-1) / kc.sum(-1))),
    "ipj": ("%", lambda cb, cc, eb, ec, kb, kc, tb, tc: _rel(cb.mean(-1) / eb.mean(-1), cc.mean(-1) / ec.mean(-1))),
    "ttft_p50": ("%", lambda cb, cc, eb, ec, kb, kc, tb, tc: _rel(np.median(tb, -1), np.median(tc, -1))),
}
# the same statistics from a resample's weighted column sums (w: the weights' total) and TTFT medians,
# so that a resample is one row of weights, never a copy of the columns (see _draws)
_FROM_DRAWS = {
    "energy_per_query": lambda d: d["ec"] / d["eb"] - 1.0,
    "accuracy": lambda d: 100 * (d["cc"] - d["cb"]) / d["w"],
    "j_per_token": lambda d: (d["ec"] / d["kc"]) / (d["eb"] / d["kb"]) - 1.0,
    "ipj": lambda d: (d["cc"] / d["ec"]) / (d["cb"] / d["eb"]) - 1.0,
    "ttft_p50": lambda d: d["tc"] / d["tb"] - 1.0,
}
DEFAULT_THRESHOLDS = ("energy_per_query:+5%", "accuracy:-2pp")
HARDWARE_KEYS = ("cpu_model", "cpu_logical_cores", "machine", "gpus")


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
    if metric not in METRICS:
        raise IpwError(f"--fail-if {text!r}: unknown metric {metric!r} (known: {', '.join(METRICS)})")
    if unit != METRICS[metric][0]:
        raise IpwError(f"--fail-if {text!r}: {metric} takes a threshold in {METRICS[metric][0]}")
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


def comparability(base_manifest: dict, cand_manifest: dict, allow_hardware_mismatch: bool) -> list[str]:
    """Reasons the two runs cannot be compared (empty when they can)."""
    reasons = []
    for role, m in (("baseline", base_manifest), ("candidate", cand_manifest)):
        if m.get("status") != "complete":  # an interrupted run covers only some queries of some backends
            reasons.append(f"the {role} run is {m.get('status', 'of unknown status')}, not complete "
                           f"(finish it with: ipw run --resume RUN_DIR)")
    fb, fc = base_manifest["dataset"]["fingerprint"], cand_manifest["dataset"]["fingerprint"]
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
        elif {_hardware_key(h) for h in mb} != {_hardware_key(h) for h in mc}:
            reasons.append(f"hardware differs (the baseline ran on {len(mb)} kind(s) of machine, the candidate on "
                           f"{len(mc)}, not the same ones); pass --allow-hardware-mismatch to compare anyway")
    return reasons


def _hardware_key(hardware: dict) -> str:
    return json.dumps([hardware.get(k) for k in HARDWARE_KEYS], sort_keys=True, default=str)


def machines(manifest: dict) -> list[dict]:
    """The kinds of machine (HARDWARE_KEYS) that measured a run's records: a sharded run (Ray, or merged
    from ``--shard`` runs) lists every node in ``hardware_by_id``; a run made in one place has its
    ``hardware`` (and, if resumed elsewhere, that machine too)."""
    by_id = list((manifest.get("hardware_by_id") or {}).values())
    found = by_id if by_id and ("ray" in manifest or "merged_from" in manifest) else [manifest.get("hardware", {}), *by_id]
    unique: dict[str, dict] = {}
    for hardware in found:
        unique.setdefault(_hardware_key(hardware), hardware)
    return list(unique.values())


def _paired(base, cand):
    from ipw.metrics import per_query

    b, c = per_query(base), per_query(cand)
    ttft_b = base.groupby("query_id")["ttft_s"].mean()
    ttft_c = cand.groupby("query_id")["ttft_s"].mean()
    joined = b.merge(c, left_index=True, right_index=True, suffixes=("_b", "_c"))
    joined = joined.join(ttft_b.rename("ttft_b")).join(ttft_c.rename("ttft_c"))
    return joined


def check_runs(base_manifest: dict, base, cand_manifest: dict, cand, thresholds: list[Threshold], *,
               alpha: float = 0.01, strict: bool = False, allow_hardware_mismatch: bool = False,
               n_boot: int = 4000, seed: int = 0) -> CheckResult:
    reasons = comparability(base_manifest, cand_manifest, allow_hardware_mismatch)
    if reasons:
        raise IpwError("not comparable: " + "; ".join(reasons))
    verdicts, notes = [], []
    backends = list(dict.fromkeys(base["backend"]))
    missing = [b for b in backends if b not in set(cand["backend"])]
    if missing:
        raise IpwError(f"not comparable: backend(s) {', '.join(missing)} missing from the candidate run")
    for name in backends:
        b, c = base[base["backend"] == name], cand[cand["backend"] == name]
        qb = set(b.loc[b["energy_j"].notna(), "energy_quality"])
        qc = set(c.loc[c["energy_j"].notna(), "energy_quality"])
        measured = {"measured", "measured_interpolated"}
        if bool(qb & measured) != bool(qc & measured) or bool(qb - measured) != bool(qc - measured):
            raise IpwError(f"not comparable: backend {name}: energy bases differ ({sorted(qb)} vs {sorted(qc)})")
        p = _paired(b, c)
        cols = [p[k].to_numpy(float) for k in ("correct_b", "correct_c", "energy_j_b", "energy_j_c",
                                                "completion_tokens_b", "completion_tokens_c", "ttft_b", "ttft_c")]
        usable = np.all([np.isfinite(x) for x in cols], axis=0)
        if len(usable) and not usable.any():  # nothing to test: a gate that passes on no data would lie
            missing = [k for k, x in zip(("energy_j", "energy_j", "completion_tokens", "completion_tokens", "ttft_s",
                                          "ttft_s"), cols[2:]) if not np.isfinite(x).any()]
            raise IpwError(f"not comparable: backend {name}: no query has {missing[0] if missing else 'every value'} "
                           "in both runs (records without energy cannot be checked)")
        if not usable.all():
            notes.append(f"{name}: {int((~usable).sum())} queries without energy or TTFT left out")
        cols = [x[usable] for x in cols]
        draws = _draws(cols, n_boot, seed)  # one paired bootstrap per backend, shared by every threshold
        for t in thresholds:
            with np.errstate(divide="ignore", invalid="ignore"):
                change = float(METRICS[t.metric][1](*cols)) if len(cols[0]) else float("nan")
                stats = _FROM_DRAWS[t.metric](draws) if draws is not None else np.empty(0)
            stats = stats[np.isfinite(stats)]
            unit = 100.0 if t.unit == "%" else 1.0
            change, stats = change * unit, stats * unit
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
            bv, cv = _levels(t.metric, cols)
            verdicts.append(Verdict(name, t.metric, t.text, bv, cv, change, float(lo), float(hi), p_value, status,
                                    len(cols[0])))
    return CheckResult(tuple(verdicts), alpha, strict, tuple(notes))


def _draws(cols: list[np.ndarray], n_boot: int, seed: int) -> dict[str, np.ndarray] | None:
    """Paired bootstrap of the queries: per resample, the weighted sums of every column (and of the
    weights) and the median TTFT of each run.  Memory is bounded and time linear in the queries
    (``ipw.stats.bootstrap_draws``: a resample is a row of weights); copying the columns per resample
    took n_boot x queries x 8 values (30 GB at 100,000 queries)."""
    if len(cols[0]) == 0:
        return None
    cb, cc, eb, ec, kb, kc, tb, tc = cols
    d = bootstrap_draws([cb, cc, eb, ec, kb, kc, np.ones(len(cb))], [(tb, (0.5,)), (tc, (0.5,))],
                        n_boot=n_boot, seed=seed)
    out = {k: d.sums[:, i] for i, k in enumerate(("cb", "cc", "eb", "ec", "kb", "kc", "w"))}
    out.update(tb=d.quantiles[:, 0], tc=d.quantiles[:, 1])
    return out


def _levels(metric: str, cols: list[np.ndarray]) -> tuple[float, float]:
    cb, cc, eb, ec, kb, kc, tb, tc = cols
    if metric == "energy_per_query":
        return float(eb.mean()), float(ec.mean())
    if metric == "accuracy":
        return float(cb.mean()), float(cc.mean())
    if metric == "j_per_token":
        return float(eb.sum() / kb.sum()), float(ec.sum() / kc.sum())
    if metric == "ipj":
        return float(cb.mean() / eb.mean()), float(cc.mean() / ec.mean())
    return float(np.median(tb)), float(np.median(tc))


def markdown(result: CheckResult) -> str:
    icon = {"regression": "❌ regression", "inconclusive": "⚠️ inconclusive", "improvement": "✅ improvement",
            "pass": "✅ pass"}
    lines = [f"### ipw check: {'FAIL' if result.exit_code else 'PASS'} (α = {result.alpha:g}"
             f"{', strict' if result.strict else ''})", "",
             "| backend | metric | threshold | baseline | candidate | change [95% CI] | p | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for v in result.verdicts:
        unit = "pp" if v.metric == "accuracy" else "%"
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
