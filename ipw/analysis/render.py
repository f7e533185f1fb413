"""Rendering ``ipw compare``'s numbers (a ``Comparison``): the JSON layout, long CSV, and the human tables
shared by the rich and Markdown output (``ipw run``'s end, ``compare``, ``report``). Nothing here reads
a run folder or computes a number; each table cell carries whether it rests on estimated energy, from
the comparison's qualities, so the report marks cells without reading titles.
"""

from __future__ import annotations

import csv
import io
import json
import math
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

from ipw.analysis import fmt
from ipw.analysis import metrics as metric_table
from ipw.analysis.basis import BASIS_TEXT
from ipw.analysis.compare import Comparison
from ipw.analysis.fmt import PERCENT
from ipw.analysis.metrics import BY_NAME
from ipw.analysis.routing import SOLVED_AT
from ipw.analysis.serving import SERVING_METRICS, STEADY_METRICS, SteadyLevel, shown
from ipw.analysis.stats import LEVEL, Estimate
from ipw.analysis.fit import fit_dict
from ipw.telemetry.base import worst_quality

if TYPE_CHECKING:
    from rich.table import Table as RichTable

    from ipw.analysis.cascade import Outcome
    from ipw.analysis.load import BackendInfo
    from ipw.analysis.routing import Saving

SCHEMA_VERSION = 1
FORMATS = ("table", "json", "csv", "markdown")


def _num(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _est(e: Estimate | None) -> dict[str, float | None] | None:
    return None if e is None else {"value": _num(e.value), "lo": _num(e.lo), "hi": _num(e.hi)}


def _scaled(e: Estimate | None, a: float) -> Estimate | None:
    return None if e is None else Estimate(a * e.value, a * e.lo, a * e.hi)


def _saving(s: Saving | None, unit: str, est: Estimate | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {f"cloud_only_{unit}": _num(s.cloud_only), f"routed_{unit}": _num(s.routed), f"saved_{unit}": _num(s.saved),
            "saved_fraction": _est(est or Estimate(s.saved_fraction, float("nan"), float("nan")))}


def _routing_dict(c: Comparison) -> dict[str, Any] | None:
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

    def frac(key: str, value: float | None) -> dict[str, float | None] | None:
        if value is None:
            return None
        return _est(_scaled(ci.get(key), a) or Estimate(value, float("nan"), float("nan")))

    return {
        "cloud": r.cloud, "cloud_is_stand_in": r.cloud_is_stand_in, "local": list(r.local), "n_queries": r.n_queries,
        "solved_at": SOLVED_AT,
        "local_coverage": _est(ci.get("local_coverage")),
        "coverage": {"correct": _est(ci.get("local_coverage")), "n_scored": r.coverage.n_scored,
                     "win_tie": _est(ci.get("win_tie_coverage")), "n_judged": r.coverage.n_judged,
                     "win_tie_vs": r.win_tie_vs},
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
        "power_envelope": [{"power_w": p.power_w, "backends": list(p.backends), "coverage": _num(p.coverage),
                            "coverage_ci": _est(ci.get(f"power_envelope_{i}")),
                            "energy_quality": worst_quality([c.quality(x) for x in p.backends])}
                           for i, p in enumerate(r.power_envelope)],
        "energy_budget": [{"energy_j": p.energy_j, "coverage": _num(p.coverage)} for p in r.energy_budget],
        "by_category": [{"category": k.category, "n_queries": k.n_queries, "local_coverage": _num(k.local_coverage),
                         "n_scored": k.coverage.n_scored, "win_tie_coverage": _num(k.coverage.win_tie_coverage),
                         "n_judged": k.coverage.n_judged,
                         "cloud_accuracy": _num(k.cloud_accuracy), "oracle_accuracy": _num(k.oracle_accuracy),
                         "energy_saved_fraction": _num(k.energy_saved_fraction),
                         "latency_saved_fraction": _num(k.latency_saved_fraction),
                         "cost_saved_fraction": _num(k.cost_saved_fraction)} for k in r.by_category],
    }


def _serving_list(c: Comparison) -> list[dict[str, Any]]:
    """Per backend and concurrency level: its level, records, split methods and the serving metrics."""
    return [{"label": b.label, "run_id": b.run_id, "backend": b.backend, "concurrency": b.concurrency,
             "n_records": b.n_records, "split_methods": list(b.split_methods),
             "metrics": {k: _est(c.metrics[b.label][k]) for k in SERVING_METRICS},
             "steady": _steady_dict(c.steady.get(b.label))} for b in c.backends]


def _steady_dict(s: SteadyLevel | None) -> dict[str, Any] | None:
    """A level's steady window (``ipw.analysis.serving.SteadyLevel``); None: it has none."""
    if s is None:
        return None
    return {"window_s": s.window_s, "span_s": s.span_s, "share": _num(s.share), "records_in_window": s.records_in_window,
            "repeats": s.repeats, "metrics": {k: _est(getattr(s, k)) for k in STEADY_METRICS}}


def _deadline_dict(c: Comparison) -> dict[str, Any] | None:
    if c.deadline is None:
        return None
    return {"metric": c.deadline.metric, "limit_s": c.deadline.limit_s,
            "picks": [{"run_id": x.run_id, "backend": x.backend, "levels": list(x.levels), "meeting": list(x.meeting),
                       "chosen": x.chosen, "concurrency": x.concurrency, "energy_per_query_j": x.energy_per_query_j,
                       "value_s": x.value_s, "steady": x.steady} for x in c.level_picks]}


def to_dict(c: Comparison) -> dict[str, Any]:
    """The JSON layout (``schema_version`` 1, documented in README.md)."""
    from ipw import __version__

    return {
        "schema_version": SCHEMA_VERSION,
        "ipw_version": __version__,
        "runs": [r.__dict__ for r in c.runs],
        "queries": {"n_queries": c.n_queries, "common_queries": c.common_queries},
        "bootstrap": {"n_boot": c.n_boot, "seed": c.seed, "level": LEVEL, "method": c.method, "paired": True,
                      "measurement_error": c.measurement},
        "reference": c.reference,
        "backends": [{
            "label": b.label, "run_id": b.run_id, "backend": b.backend, "model": b.model, "role": b.role,
            "concurrency": b.concurrency, "split_methods": list(b.split_methods), "n_records": b.n_records,
            "energy_quality": b.energy_quality, "energy_qualities": b.energy_qualities,
            "energy_sources": list(b.energy_sources),
            "metrics": {k: _est(e) for k, e in c.metrics[b.label].items()},
            "vs_reference": (None if b.label == c.reference
                             else {k: _est(e) for k, e in c.vs_reference[b.label].items()}),
            **{f"{what}_model": (fit_dict(f) if f is not None else None)
               for what, f in ((w, c.models.get(b.label, {}).get(w)) for w in ("energy", "latency"))},
        } for b in c.backends],
        "serving": _serving_list(c),
        "deadline": _deadline_dict(c),
        "routing": _routing_dict(c),
        "judge": [dict(row.__dict__) for row in c.judge],
        "cascade": _cascade_list(c),
        **energy_dict(c),
        "hardware_note": c.hardware_note,
        "notes": list(c.notes),
    }


def to_json(c: Comparison) -> str:
    from ipw.sanitize import json_bidi

    return json_bidi(json.dumps(to_dict(c), indent=2, ensure_ascii=False)) + "\n"


CSV_HEADER = ("section", "backend", "key", "metric", "value", "lo", "hi")


def csv_rows(c: Comparison) -> list[tuple[Any, ...]]:
    """Long format: one row per number (section, backend, key, metric, value, lo, hi)."""
    rows: list[tuple[Any, ...]] = []

    def add(section: str, backend: str, key: str, metric: str, v: Any) -> None:
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
    for b in d["serving"]:  # key: the concurrency level
        add("serving", b["label"], str(b["concurrency"]), "n_records", b["n_records"])
        for k, v in b["metrics"].items():
            add("serving", b["label"], str(b["concurrency"]), k, v)
        for k, v in (b["steady"] or {}).get("metrics", {}).items():  # the steady window's, where there is one
            add("serving", b["label"], str(b["concurrency"]), f"steady_{k}", v)
        if b["steady"]:
            add("serving", b["label"], str(b["concurrency"]), "steady_share", b["steady"]["share"])
    dl = d["deadline"]
    for x in dl["picks"] if dl else ():  # key: the deadline; an empty value: no level meets it
        bound = f"{dl['metric']}<={dl['limit_s']:g}s"
        add("deadline", f"{x['run_id']}/{x['backend']}", bound, "chosen_concurrency", x["concurrency"])
        add("deadline", f"{x['run_id']}/{x['backend']}", bound, "energy_per_query_j", x["energy_per_query_j"])
    r = d["routing"]
    if r:
        add("routing", "", "", "local_coverage", r["local_coverage"])
        add("routing", "", "", "n_scored", r["coverage"]["n_scored"])
        add("routing", "", r["coverage"]["win_tie_vs"], "win_tie_coverage", r["coverage"]["win_tie"])
        add("routing", "", r["coverage"]["win_tie_vs"], "n_judged", r["coverage"]["n_judged"])
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
            for m in ("n_queries", "local_coverage", "n_scored", "win_tie_coverage", "n_judged", "cloud_accuracy",
                      "oracle_accuracy", "energy_saved_fraction",
                      "latency_saved_fraction", "cost_saved_fraction"):
                add("category", "", k["category"], m, k[m])
    for x in d["cascade"]:  # key: the accuracy-loss target of an out-of-sample pick, or the curve's quantile
        add("cascade", x["local"], "", "auc", x["auc"])
        for p in x["picks"]:
            for k in ("local_share", "accuracy", "accuracy_loss", "energy_saved_fraction", "latency_saved_fraction",
                      "cost_saved_fraction"):
                add("cascade", x["local"], f"max_loss={p['max_accuracy_loss']:g}", k, p[k])
        for p in x["curve"]:
            for k in ("threshold", "local_share", "accuracy", "accuracy_loss", "energy_saved_fraction",
                      "latency_saved_fraction"):
                add("cascade_curve", x["local"], f"q={p['quantile']:g}", k, p[k])
    return rows


def to_csv(c: Comparison) -> str:
    from ipw.sanitize import csv_cell  # backend names are the user's text: no formula, no line of its own

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    writer.writerows(["" if x is None else csv_cell(x) for x in row] for row in csv_rows(c))
    return buf.getvalue()


class Table(NamedTuple):
    """One human table; ``est[i][j]``: cell (i, j) rests on estimated energy (a model, not a sensor)."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    est: list[list[bool]]
    key: str  # metrics | difference | fits | serving | deadline | routing | router_curve | power_envelope | cascade* |
    # energy_budget | by_category | judge
    section: str  # compare | serving | routing


def _table(key: str, title: str, headers: list[str], rows: list[list[str]],
           energy: Callable[[int, int], object] = lambda i, j: False) -> Table:
    """A table whose cell (i, j) is marked estimated when ``energy(i, j)`` says it rests on estimated energy."""
    est = [[j > 0 and cell != "n/a" and bool(energy(i, j)) for j, cell in enumerate(row)] for i, row in enumerate(rows)]
    section = ("compare" if key in ("metrics", "difference", "fits", "carbon", "bases") else
               "serving" if key in ("serving", "deadline") else "routing")
    return Table(title, headers, rows, est, key, section)


def _shown(c: Comparison) -> list[str]:
    """The metrics (keys of the metric table, in its order) that some backend has a value of."""
    return [m.name for m in metric_table.METRICS
            if any(math.isfinite(c.metrics[b.label][m.name].value) for b in c.backends)]


def _energy_cell(c: Comparison, row_keys: Sequence[str | None], columns: list[str],
                 diff: bool) -> Callable[[int, int], bool]:
    """An energy-based metric's cell of a backend (or a difference with a reference) with estimated energy."""
    def cell(i: int, j: int) -> bool:
        key = row_keys[i]
        return (key is not None and BY_NAME[key].energy
                and (c.estimated(columns[j - 1]) or diff and c.estimated(c.reference)))

    return cell


def metrics_table(c: Comparison) -> Table:
    """Every metric of the metric table that some backend has, one row each, a column per backend (with
    the backends' role, energy quality and records above): compare's first table, ``ipw run --full-table``."""
    labels = [b.label for b in c.backends]
    keys = _shown(c)
    head = [["role"] + [b.role + (" (reference)" if b.label == c.reference else "") for b in c.backends],
            ["energy quality"] + [b.energy_quality for b in c.backends],
            ["queries / records"] + [f"{c.n_queries} / {b.n_records}" for b in c.backends]]
    rows = head + [[BY_NAME[k].label] + [fmt.estimate(c.metrics[x][k], BY_NAME[k].format) for x in labels]
                   for k in keys]
    with_error = ", energy CIs with measurement error" if c.with_measurement_error else ""
    row_keys: list[str | None] = [None] * len(head)  # the head rows are no metric's
    row_keys += keys
    return _table("metrics", f"ipw compare: {c.n_queries} queries, {LEVEL:.0%} bootstrap CIs ({c.n_boot} {c.method} "
                  f"resamples{with_error})", ["metric"] + labels, rows,
                  _energy_cell(c, row_keys, labels, False))


def tables(c: Comparison) -> list[Table]:
    """The human tables, shared by the rich and Markdown output and the report."""
    labels = [b.label for b in c.backends]
    keys = _shown(c)
    out = [metrics_table(c)]
    others = [x for x in labels if x != c.reference]
    if others:
        out.append(_table("difference", f"difference vs {c.reference} (paired over the same queries)",
                          ["metric"] + others,
                          [[BY_NAME[k].label] + [fmt.estimate(c.vs_reference[x][k], BY_NAME[k].format, sign=True)
                                                 for x in others] for k in keys],
                          _energy_cell(c, keys, others, True)))
    fits = [c.models.get(x, {}) for x in labels]
    if any(math.isfinite(f[w].r2) for f in fits for w in f):
        rows = []
        for what, unit in (("energy", "J"), ("latency", "s")):
            for attr, name in (("intercept", f"a ({unit})"), ("per_prompt_token", f"b ({unit}/prompt token)"),
                               ("per_completion_token", f"c ({unit}/output token)")):
                rows.append([f"{what} {name}"] + [fmt.estimate(getattr(f[what], attr)) if what in f else "n/a"
                                                  for f in fits])
            rows.append([f"{what} R² (queries)"] + [f"{fmt.value(f[what].r2)} ({f[what].n})" if what in f else "n/a"
                                                    for f in fits])
        out.append(_table("fits", f"fitted per-query model y ≈ a + b·prompt tokens + c·output tokens (OLS, "
                          f"{LEVEL:.0%} CIs)", ["coefficient"] + labels, rows))
    return with_basis(c, out + carbon_tables(c) + serving_tables(c) + routing_tables(c) + bases_tables(c)
                      + cascade_tables(c) + judge_table(c))


def energy_dict(c: Comparison) -> dict[str, Any]:
    """The JSON's energy basis, each backend's PUE and carbon intensity, and the bases side by side."""
    return {
        "energy_basis": c.energy_basis,
        "facility": {b.label: {"pue": b.pue, "pue_source": b.pue_source} for b in c.backends},
        "carbon": {label: (None if x is None else x.to_dict()) for label, x in c.carbon.items()},
        "bases": [{"basis": v.basis, "energy_per_query_j": {k: _est(e) for k, e in v.energy_per_query_j.items()},
                   "gco2e_per_correct": {k: _est(e) for k, e in v.gco2e_per_correct.items()},
                   "oracle_energy_saved_fraction": _est(v.oracle_energy_saved_fraction),
                   "router_energy_saved_fraction": _est(v.router_energy_saved_fraction),
                   "unavailable": list(v.unavailable)} for v in c.bases],
    }


def with_basis(c: Comparison, ts: list[Table]) -> list[Table]:
    """Every table's title ends with the energy basis it compares, so a reader knows which joules they are."""
    return [t._replace(title=f"{t.title} · energy basis: {c.energy_basis}") for t in ts]


def carbon_tables(c: Comparison) -> list[Table]:
    """Per backend with a carbon intensity: gCO2e per query and per correct answer (CIs), and the intensity with
    its zone, source and date; nothing when no backend has one (no silent default)."""
    shown = [b for b in c.backends if c.carbon.get(b.label) is not None]
    if not shown:
        return []
    rows = []
    for b in shown:
        x = c.carbon[b.label]
        rows.append([b.label, fmt.estimate(c.metrics[b.label]["gco2e_per_correct"]),
                     fmt.estimate(c.metrics[b.label]["gco2e_per_query"]), f"{x.g_per_kwh:g}", x.zone or "-",
                     x.source + (f" ({x.detail})" if x.detail else ""), x.date])
    labels = [b.label for b in shown]
    return [_table("carbon", f"carbon (gCO2e of the {c.energy_basis} energy, {LEVEL:.0%} CIs)",
                   ["backend", "gCO2e/correct", "gCO2e/query", "gCO2e/kWh", "zone", "source", "date"], rows,
                   lambda i, j: j in (1, 2) and c.estimated(labels[i]))]


def bases_tables(c: Comparison) -> list[Table]:
    """The energy on each available basis side by side (chip; facility where a PUE is set; node where records
    have node readings): J/query per backend and the routing's energy saved, with CIs."""
    if not c.bases:
        return []
    labels = [b.label for b in c.backends]
    rows = []
    for v in c.bases:
        saved = [("n/a" if e is None else fmt.estimate(e, fmt.PERCENT))
                 for e in (v.oracle_energy_saved_fraction, v.router_energy_saved_fraction)]
        rows.append([BASIS_TEXT[v.basis] + (" (shown above)" if v.basis == c.energy_basis else "")]
                    + [fmt.estimate(v.energy_per_query_j[x]) for x in labels] + saved)
    alpha = c.routing.router.alpha if c.routing is not None else None
    router_head = f"router (α={alpha:g}) energy saved" if alpha is not None else "router energy saved"
    return [_table("bases", "energy by basis: J/query and the routing's energy saved on each "
                   f"({LEVEL:.0%} CIs; --energy-basis picks the one the other tables use)",
                   ["basis"] + [f"{x} J/query" for x in labels] + ["oracle energy saved", router_head], rows,
                   lambda i, j: (j <= len(labels) and c.estimated(labels[j - 1])) or (j > len(labels)
                                                                                     and c.routing_estimated))]


def _levels_text(labels: Sequence[str], by_label: dict[str, BackendInfo]) -> str:
    return ", ".join(f"c={by_label[x].concurrency}" for x in labels)


def serving_tables(c: Comparison) -> list[Table]:
    """Per backend and concurrency level: the serving metrics (when some backend ran above one request at
    a time), and with --deadline each backend's energy-optimal level within it."""
    out = []
    names = {k: m.label for k, m in BY_NAME.items()}
    if shown(c.backends):
        rows = [[b.label, str(b.concurrency), str(b.n_records)]
                + [fmt.value(c.metrics[b.label][k].value, BY_NAME[k].format) for k in SERVING_METRICS]
                + [", ".join(b.split_methods) or "none"] + _steady_cells(c.steady.get(b.label)) for b in c.backends]
        columns = [None] * 3 + list(SERVING_METRICS) + [None] + list(STEADY_METRICS) + [None]  # each column's metric

        def energy(i: int, j: int) -> bool:
            key = columns[j]
            return key is not None and BY_NAME[key].energy and c.estimated(c.backends[i].label)

        out.append(_table("serving", "serving: per backend and concurrency level (point values; CIs in the metrics "
                          "table; output tok/s: output tokens over the level's wall span; steady: over the level's "
                          "steady window, where its concurrency was in flight (share: of the level's span; CIs across "
                          "repeats; n/a: a level of 1, or no window), docs/SERVING.md)",
                          ["backend", "concurrency", "records"] + [names[k] for k in SERVING_METRICS]
                          + ["energy split"] + [f"steady {names[k]}" for k in STEADY_METRICS] + ["steady share"],
                          rows, energy))
    if c.deadline is not None:
        def chosen_estimated(i: int, j: int) -> bool:
            chosen = c.level_picks[i].chosen
            return j == 2 and chosen is not None and c.estimated(chosen)

        by_label = {b.label: b for b in c.backends}
        clash = {x.backend for x in c.level_picks if sum(y.backend == x.backend for y in c.level_picks) > 1}
        rows = []
        for x in c.level_picks:
            name = f"{x.run_id}/{x.backend}" if x.backend in clash else x.backend
            meeting = (f"{_levels_text(x.meeting, by_label)} of {_levels_text(x.levels, by_label)}" if x.meeting
                       else f"none of {_levels_text(x.levels, by_label)}")
            if x.chosen is None:
                rows.append([name, f"none meets {c.deadline.text}", "n/a", "n/a", meeting])
            else:
                rows.append([name, f"{x.chosen} (c={x.concurrency})",
                             fmt.value(x.energy_per_query_j, BY_NAME["energy_per_query_j"].format)
                             + (" (steady)" if x.steady else ""),
                             fmt.value(x.value_s, BY_NAME[c.deadline.key].format),
                             meeting])
        out.append(_table("deadline", f"energy-optimal concurrency level under {c.deadline.text} (the lowest J/query "
                          "among the levels that meet it: over a level's steady window where it has one, marked "
                          "'steady', else over the whole level)",
                          ["backend", "level", names["energy_per_query_j"], names[c.deadline.key], "levels meeting it"],
                          rows, chosen_estimated))
    return out


def _steady_cells(s: SteadyLevel | None) -> list[str]:
    """A level's steady figures (with their CI across repeats where it has several) and the window's share."""
    if s is None:
        return [fmt.NA] * (len(STEADY_METRICS) + 1)
    return [fmt.estimate(getattr(s, k), BY_NAME[k].format) for k in STEADY_METRICS] + [_pct(s.share)]


def _pct(x: float | None) -> str:
    """A share that is no metric's value (routing, the judge's agreement), as a metric's percentage."""
    return fmt.value(x, PERCENT)


def _est_text(v: dict[str, float | None] | None) -> str:
    """A share with its interval, from the JSON layout's {"value", "lo", "hi"} (None: unknown)."""
    if v is None:
        return "n/a"
    return fmt.estimate(Estimate(*(float("nan") if x is None else x for x in (v["value"], v["lo"], v["hi"]))), PERCENT)


def routing_tables(c: Comparison) -> list[Table]:
    """The routing section (``ipw compare``'s, and the end of ``ipw run`` with a cloud-role backend)."""
    r = c.routing
    if r is None:
        return []
    d = _routing_dict(c)
    assert d is not None  # c.routing is not None
    o = d["oracle"]
    est = _est_text
    routed_est = c.routing_estimated

    def saved(s: dict[str, Any] | None, unit: str) -> str:
        shown = {"j": "J", "s": "s", "usd": "USD"}[unit]
        return "n/a" if s is None else (f"{est(s['saved_fraction'])} ({fmt.value(s['saved_' + unit])} {shown} of "
                                        f"{fmt.value(s['cloud_only_' + unit])})")

    rr = d["router"]
    cov = d["coverage"]
    summary = [  # label, value, rests on energy
        ("cloud reference", r.cloud + (" (stand-in: no cloud role)" if r.cloud_is_stand_in else ""), False),
        ("local backends", ", ".join(r.local), False),
        ("local coverage", f"{est(cov['correct'])} (correct vs the dataset answer, {cov['n_scored']} scored)", False),
        ("local coverage, win/tie", f"{est(cov['win_tie'])} (vs {cov['win_tie_vs'] or 'a reference'}'s answer, "
                                    f"{cov['n_judged']} judged)", False),
        ("oracle routed to", ", ".join(f"{k}: {v}" for k, v in o["routed_to"].items()), False),
        ("oracle accuracy (cloud only)", f"{est(o['accuracy'])} ({_pct(o['cloud_accuracy'])})", False),
        ("oracle energy saved",
         saved(o["energy"], "j") + (f", {o['energy']['energy_quality']}" if o["energy"] else ""), True),
        ("oracle latency saved", saved(o["latency"], "s"), False),
        ("oracle cost saved", saved(o["cost"], "usd"), False),
        (f"router (α={rr['alpha']}) accuracy", _pct(rr["accuracy"]), False),
        (f"router (α={rr['alpha']}) energy saved",
         est(rr["energy_saved_fraction"]) + (f", {o['energy']['energy_quality']}" if o["energy"] else ""), True),
        (f"router (α={rr['alpha']}) latency saved", est(rr["latency_saved_fraction"]), False),
        (f"router (α={rr['alpha']}) cost saved", est(rr["cost_saved_fraction"]), False),
    ]
    out = [_table("routing", "routing (oracle: each query to the lowest-energy local backend that answers it, else "
                  "the cloud)", ["", "value"], [[label, value] for label, value, _ in summary],
                  lambda i, j: routed_est and summary[i][2])]

    def energy_columns(*columns: int) -> Callable[[int, int], bool]:
        return lambda i, j: routed_est and j in columns

    out.append(_table("router_curve", "router curve (α: share of queries routed as the oracle would)",
                      ["α", "accuracy", "energy saved", "latency saved", "cost saved"],
                      [[f"{p['alpha']:g}", _pct(p["accuracy"]), _pct(p["energy_saved_fraction"]),
                        _pct(p["latency_saved_fraction"]), _pct(p["cost_saved_fraction"])] for p in d["router_curve"]],
                      energy_columns(2)))
    if d["power_envelope"]:
        out.append(_table("power_envelope", "coverage within a power envelope (local backends whose mean power fits)",
                          ["power ≤ W", "backends", "coverage", "power"],
                          [[fmt.value(p["power_w"]), ", ".join(p["backends"]), est(p["coverage_ci"]),
                            p["energy_quality"]] for p in d["power_envelope"]],
                          lambda i, j: j == 2 and d["power_envelope"][i]["energy_quality"] == "estimated"))
    if d["energy_budget"]:  # which backends fit a budget rests on their energy
        out.append(_table("energy_budget", "coverage within a per-query energy budget", ["energy ≤ J", "coverage"],
                          [[fmt.value(p["energy_j"]), _pct(p["coverage"])] for p in d["energy_budget"]],
                          energy_columns(1)))
    headers = ["category", "queries", "local coverage (correct)", "scored", "local coverage (win/tie)", "judged",
               "cloud accuracy", "oracle accuracy", "energy saved", "latency saved", "cost saved"]
    out.append(_table("by_category", "routing per category (coverage: correct vs the dataset answer over the scored "
                      f"queries; win/tie vs {cov['win_tie_vs'] or 'the reference'}'s answer over the judged ones)",
                      headers,
                      [[k["category"] or "-", str(k["n_queries"]), _pct(k["local_coverage"]), str(k["n_scored"]),
                        _pct(k["win_tie_coverage"]), str(k["n_judged"]), _pct(k["cloud_accuracy"]),
                        _pct(k["oracle_accuracy"]), _pct(k["energy_saved_fraction"]),
                        _pct(k["latency_saved_fraction"]), _pct(k["cost_saved_fraction"])] for k in d["by_category"]],
                      energy_columns(headers.index("energy saved"))))
    return out


def _outcome_dict(o: Outcome) -> dict[str, Any]:
    return {"local_share": _est(o.local_share), "escalated_share": _est(o.escalated_share),
            "accuracy": _est(o.accuracy), "accuracy_loss": _est(o.accuracy_loss),
            "energy_saved_fraction": _est(o.energy_saved_fraction),
            "latency_saved_fraction": _est(o.latency_saved_fraction), "cost_saved_fraction": _est(o.cost_saved_fraction)}


def _cascade_list(c: Comparison) -> list[dict[str, Any]]:
    """The JSON of the cascades (``ipw.analysis.cascade``): per local backend with mean_logprob."""
    return [{
        "local": x.local, "cloud": x.cloud, "n_queries": x.n_queries, "n_without_logprob": x.n_without_logprob,
        "local_accuracy": _num(x.local_accuracy), "cloud_accuracy": _num(x.cloud_accuracy), "auc": _est(x.auc),
        "folds": x.k, "energy_quality": x.energy_quality,
        "picks": [{"max_accuracy_loss": p.max_accuracy_loss,
                   "thresholds": [None if t is None else _num(t) for t in p.thresholds], **_outcome_dict(p.outcome)}
                  for p in x.picks],
        "curve": [{"quantile": p.quantile, "threshold": _num(p.threshold), **_outcome_dict(p.outcome)}
                  for p in x.curve],
    } for x in c.cascade]


def cascade_tables(c: Comparison) -> list[Table]:
    """The cascade (``ipw.analysis.cascade``), when local answers carry mean_logprob: the confidence's AUC, the
    out-of-sample operating points per accuracy-loss target, and the curve over fixed thresholds."""
    if not c.cascade:
        return []
    est = fmt.estimate

    def pct(e: Estimate | None) -> str:
        return fmt.estimate(e, PERCENT)

    def estimated(x: Any) -> bool:
        return bool(x.energy_quality == "estimated")

    k = c.cascade[0].k
    summary = [[x.local, x.cloud, str(x.n_queries), str(x.n_without_logprob), est(x.auc), _pct(x.local_accuracy),
                _pct(x.cloud_accuracy)] for x in c.cascade]
    out = [_table("cascade", "cascade: local first, escalate to the cloud on low confidence (mean_logprob of the "
                  "local answer)", ["local", "cloud", "queries", "no mean_logprob", "AUC (predicts a right local "
                                    "answer)", "local-only accuracy", "cloud-only accuracy"], summary)]
    picks = [(x, p) for x in c.cascade for p in x.picks]
    if picks:
        def thresholds(ts: tuple[float | None, ...]) -> str:
            if all(t is None for t in ts):
                return "none: every query to the cloud"
            chosen = [t for t in ts if t is not None]
            cloud = sum(t is None for t in ts)
            span = fmt.value(min(chosen)) if min(chosen) == max(chosen) else \
                f"{fmt.value(min(chosen))}..{fmt.value(max(chosen))}"
            return span + (f" ({cloud} folds: none)" if cloud else "")

        headers = ["local", "max accuracy loss", "threshold (per fold)", "answered locally", "accuracy",
                   "accuracy loss", "energy saved", "latency saved", "cost saved"]
        out.append(_table("cascade_picks", f"cascade (out of sample: the threshold chosen on the other folds of a "
                          f"{k}-fold split by query; energy = the local attempt + the cloud for escalated queries, "
                          "saved vs cloud-only)", headers,
                          [[x.local, fmt.value(p.max_accuracy_loss, PERCENT), thresholds(p.thresholds),
                            pct(p.outcome.local_share), pct(p.outcome.accuracy), pct(p.outcome.accuracy_loss),
                            pct(p.outcome.energy_saved_fraction), pct(p.outcome.latency_saved_fraction),
                            pct(p.outcome.cost_saved_fraction)] for x, p in picks],
                          lambda i, j: j == headers.index("energy saved") and estimated(picks[i][0])))
    points = [(x, p) for x in c.cascade for p in x.curve]
    headers = ["local", "escalate below quantile", "threshold", "answered locally", "accuracy", "accuracy loss",
               "energy saved", "latency saved"]
    out.append(_table("cascade_curve", "cascade curve (fixed thresholds: quantiles of mean_logprob; reading the best "
                      "point off it is choosing in sample)", headers,
                      [[x.local, fmt.value(p.quantile, PERCENT),
                        fmt.value(p.threshold) if math.isfinite(p.threshold) else "every query", pct(p.outcome.local_share),
                        pct(p.outcome.accuracy), pct(p.outcome.accuracy_loss), pct(p.outcome.energy_saved_fraction),
                        pct(p.outcome.latency_saved_fraction)] for x, p in points],
                      lambda i, j: j == headers.index("energy saved") and estimated(points[i][0])))
    return out


def judge_table(c: Comparison) -> list[Table]:
    """The judge apart from the backends: per judged backend and category, how many records it compared,
    how often its two orders agree, unparsed replies, its calls and its own energy ([] when no run was
    judged). What it decided is in the records: the metrics (win/tie vs reference) and routing show it."""
    if not c.judge:
        return []
    judges = sorted({f"{r.judge} ({r.prompt_version}, {r.grading})" for r in c.judge})
    headers = ["backend", "category", "judged", "orders agree", "unparsed", "judge calls", "judge J"]
    rows = [[r.backend, r.category or "all", f"{r.judged} of {r.records}", _pct(r.orders_agree), str(r.unparsed),
             str(r.calls), fmt.value(r.energy_j)] for r in c.judge]
    return [_table("judge", f"judge {', '.join(judges)}: records compared, whether both orders agree, and its own "
                   "energy (kept apart: in no backend's numbers)", headers, rows,
                   lambda i, j: j == len(headers) - 1 and c.judge[i].energy_quality == "estimated")]


def markdown_tables(ts: list[Table]) -> list[str]:
    from ipw.sanitize import md_text  # backend names and categories are the user's text

    lines = []
    for t in ts:
        lines += [f"### {md_text(t.title)}", "", "| " + " | ".join(map(md_text, t.headers)) + " |",
                  "|" + "---|" * len(t.headers)]
        lines += ["| " + " | ".join(md_text(cell) for cell in row) + " |" for row in t.rows]
        lines.append("")
    return lines


def to_markdown(c: Comparison) -> str:
    from ipw.sanitize import md_text  # notes are the user's text

    lines = markdown_tables(tables(c)) + [f"- {md_text(note)}" for note in c.notes]
    return "\n".join(lines).rstrip("\n") + "\n"


def rich_tables(ts: list[Table]) -> list[RichTable]:
    """rich tables of ``tables(c)`` or ``routing_tables(c)``."""
    from rich.table import Table as RichTable

    from rich.markup import escape

    from ipw.sanitize import one_line  # names are the user's text: escapes and bidi controls shown escaped

    out = []
    for t in ts:
        rt = RichTable(title=escape(one_line(t.title)), title_justify="left")
        for i, h in enumerate(t.headers):
            rt.add_column(escape(one_line(h)), justify="left" if i == 0 else "right")
        for row in t.rows:
            rt.add_row(*(escape(one_line(cell)) for cell in row))
        out.append(rt)
    return out
