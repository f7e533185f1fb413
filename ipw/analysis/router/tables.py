"""The router's scores as ``ipw compare --router``, ``ipw report --router`` and ``ipw route score`` show them
(``ipw.analysis.router``): rich tables, Markdown, the report's tables and the JSON of the scores."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


from ipw.analysis.router.data import check_threshold, parse_accuracy_loss, route_data
from ipw.analysis.router.evaluate import MIN_QUERIES, RouterScores, check_trainable, score_router
from ipw.analysis.router.file import check_runs_supply, load_router, scores_json
from ipw.analysis.router.model import C, Featurizer, sklearn_modules



def _pct(x: Any) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


def _ci(c: Any) -> str:
    if c is None:
        return "n/a"
    if c.lo != c.lo:
        return _pct(c.value)
    return f"{_pct(c.value)} [{_pct(c.lo)}, {_pct(c.hi)}]"


def policy_rows(s: Any) -> list[tuple[str, str]]:
    """One scored policy (``ipw.analysis.router.evaluate.PolicyScore``: the trained router; the cascade of issue 44 item 3
    fills the same shape) as label/value rows."""
    op = s.operating_point
    auc = ", ".join(f"{k}: {'n/a' if v != v else f'{v:.3f}'}" for k, v in s.auc.items())
    rows = [
        ("scored", f"{s.protocol}; {s.n_queries} queries, never on a training query"),
        ("AUC (answers as well as the cloud)", auc),
        ("operating point", f"{s.operating_reason}"),
        ("  routed locally", _ci(op.local_share)),
        ("  accuracy", f"{_ci(op.accuracy)} (cloud only {_pct(s.cloud_accuracy)}, local only "
                       f"{_pct(s.local_only_accuracy)})"),
        ("  accuracy loss vs cloud only", _ci(op.accuracy_loss)),
        ("  energy saved", _ci(op.energy_saved_fraction)),
        ("  latency saved", _ci(op.latency_saved_fraction)),
        ("  cost saved", _ci(op.cost_saved_fraction)),
        ("APGR", "n/a (no accuracy gap)" if s.apgr != s.apgr else f"{s.apgr:.3f}"),
        ("local share keeping 50% / 80% of the gap", f"{_pct(s.local_share_at_50)} / {_pct(s.local_share_at_80)}"),
    ]
    for c in s.by_category:
        rows.append((f"  held out: {c['category'] or '(none)'}",
                     f"{c['n_queries']} queries, local {_pct(c['local_share'])}, accuracy {_pct(c['accuracy'])} "
                     f"(cloud {_pct(c['cloud_accuracy'])}), energy saved {_pct(c['energy_saved_fraction'])}"))
    return rows


def curve_rows(s: Any) -> list[tuple[str, ...]]:
    return [(f"{p.threshold:.2f}", _ci(p.local_share), _ci(p.accuracy), _ci(p.accuracy_loss),
             _ci(p.energy_saved_fraction), _ci(p.latency_saved_fraction),
             "n/a" if p.pgr != p.pgr else f"{p.pgr:.2f}") for p in s.curve]


def print_scores(scores: Any, console: Any, *, curve: bool = True, beside: Sequence[tuple[str, str]] = ()) -> None:
    """The router's out-of-sample tables (``beside``: rows of the oracle and the α-router to show above it)."""
    from rich.table import Table

    for s in [scores.kfold] + ([scores.held_out_category] if scores.held_out_category else []):
        t = Table(title=f"{s.name}: {s.local and ', '.join(s.local)} vs cloud {s.cloud} ({s.protocol})")
        t.add_column("")
        t.add_column("value", justify="right")
        if beside and s is scores.kfold:
            for k, v in beside:
                t.add_row(k, v)
        for k, v in policy_rows(s):
            t.add_row(k, v)
        console.print(t)
        for n in s.notes:
            console.print(f"note: {n}", highlight=False, markup=False)
    if curve:
        s = scores.kfold
        t = Table(title=f"trained router, out-of-fold curve over the threshold ({s.protocol})")
        for h in ("threshold", "routed locally", "accuracy", "accuracy loss", "energy saved", "latency saved", "PGR"):
            t.add_column(h, justify="right")
        for r in curve_rows(s):
            t.add_row(*r)
        console.print(t)


def router_scores(runs: Sequence[Path], *, router_path: Path | None, local: Sequence[str] = (),
                  cloud: Sequence[str] = (), grading: str | None = None, threshold: float | None = None,
                  max_accuracy_loss: str | None = None, min_queries: int | None = None, folds: int = 5,
                  seed: int = 0, usd_per_kwh: float | None = None, api_prices: Sequence[str] = (),
                  energy_basis: str = "chip", pue: Sequence[str] = ()) -> RouterScores:
    """The router design (of ``router_path``, else the defaults) scored out of sample on ``runs``: retrained in
    folds with its settings, never scored on a query it was trained on."""
    if threshold is not None:
        check_threshold(threshold)
    loss = None if max_accuracy_loss is None else parse_accuracy_loss(max_accuracy_loss)
    sklearn_modules()
    featurizer, c = Featurizer(), C
    where = "the runs"
    if router_path is not None:
        router = load_router(router_path)
        training = router.meta.get("training") or {}
        grading = grading or training.get("label") or "answer"
        min_queries = min_queries if min_queries is not None else int(training.get("min_queries") or MIN_QUERIES)
        c = float(training.get("C") or C)
        threshold = router.threshold if threshold is None and loss is None else threshold
    data = route_data(runs, local=local, cloud=cloud, grading=grading or "answer", usd_per_kwh=usd_per_kwh,
                      api_prices=api_prices, energy_basis=energy_basis, pue=pue)
    if router_path is not None:
        check_runs_supply(router, data, router_path)
        featurizer = Featurizer(tuple(sorted({x for x in data.category if x})) if router.featurizer.categories
                              else (), router.featurizer.n_features, router.featurizer.ngram_range)
    elif data.has_categories:
        featurizer = Featurizer(tuple(sorted({x for x in data.category if x})))
    check_trainable(data, MIN_QUERIES if min_queries is None else min_queries, where)
    return score_router(data, featurizer, k=folds, seed=seed, c=c, threshold=threshold, max_accuracy_loss=loss)


def scores_doc(scores: Any) -> dict[str, Any]:
    return {"trained_router": {"kfold": scores_json(scores.kfold),
                               "held_out_category": None if scores.held_out_category is None
                               else scores_json(scores.held_out_category)}}


def beside_rows(result: Any) -> list[tuple[str, str]]:
    """The oracle's and the α-router's numbers of a ``Comparison``, to read the trained router against: both
    know each answer in advance (upper bounds, never deployable)."""
    r = result.routing
    if r is None:
        return []
    o, a = r.oracle, r.router
    local = sum(v for k, v in o.routed_to.items() if k != r.cloud) / max(r.n_queries, 1)

    def saved(s: Any) -> str:
        return "n/a" if s is None else _pct(s.saved_fraction)

    return [
        ("oracle (knows each answer: upper bound)", f"local {_pct(local)}, accuracy {_pct(o.accuracy)}, energy saved "
                                                    f"{saved(o.energy_j)}, latency saved {saved(o.latency_s)}"),
        (f"α-router (α={a.alpha:g}; upper bound: never sends a query the local model fails)",
         f"local {_pct(a.alpha * local)}, accuracy {_pct(a.accuracy)}, energy saved {_pct(a.energy_saved_fraction)}"),
        ("trained router (below: deployable, scored out of fold)", ""),
    ]


def scores_markdown(scores: Any, result: Any = None) -> str:
    from ipw.sanitize import md_text

    lines = []
    for s in [scores.kfold] + ([scores.held_out_category] if scores.held_out_category else []):
        lines += ["", f"**{s.name}** ({md_text(s.protocol)})", "", "| | value |", "|---|---:|"]
        rows = (beside_rows(result) if result is not None and s is scores.kfold else []) + policy_rows(s)
        lines += [f"| {md_text(k)} | {md_text(v)} |" for k, v in rows]
        lines += [f"- {md_text(n)}" for n in s.notes]
    return "\n".join(lines) + "\n"


def report_tables(scores: Any) -> list[dict[str, Any]]:
    """The router's tables in ``ipw report``'s form (cells ``{"text", "est"}``; ``build`` marks estimated energy)."""
    def cells(rows: Sequence[Sequence[str]]) -> list[list[dict[str, Any]]]:
        return [[{"text": x, "est": False} for x in row] for row in rows]

    out = []
    for s in [scores.kfold] + ([scores.held_out_category] if scores.held_out_category else []):
        out.append({"title": f"trained router, deployable, scored out of fold ({s.protocol}): "
                             f"{', '.join(s.local)} else {s.cloud}; the oracle and the α-router above are upper "
                             "bounds", "headers": ["", "value"], "rows": cells(policy_rows(s)),
                    "key": "trained_router", "section": "routing"})
    s = scores.kfold
    out.append({"title": f"trained router: out-of-fold curve over the threshold ({s.protocol})",
                "headers": ["threshold", "routed locally", "accuracy", "accuracy loss", "energy saved",
                            "latency saved", "PGR"], "rows": cells(curve_rows(s)), "key": "trained_router_curve",
                "section": "routing"})
    return out
