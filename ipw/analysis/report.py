"""``ipw report``: one self-contained HTML file with plots, and a Markdown summary for CI pages.

Every metric, interval and routing number comes from :mod:`ipw.analysis.compare` (rendered by
:mod:`ipw.analysis.render`: its tables, with each cell's estimated-energy flag, and its JSON layout);
the report only adds views of the records themselves: energy against output tokens, power over time,
per-category means, the costliest and the wrong answers.

Safety: the HTML is rendered by Jinja2 with autoescaping (dataset and model text is never pasted into
markup), plots are matplotlib PNGs (Agg, imported lazily) inlined as ``data:`` URIs, the page has no
script, and its Content-Security-Policy forbids any script and every fetch but ``data:`` images.

Estimated energy (a model, not a sensor) is marked everywhere: hatched bars, hollow markers, dashed
lines and "(estimated)" in plot labels, a note in every energy plot, and "estimated" on table cells.

Scale: scatter plots draw a seeded sample of at most ``MAX_POINTS`` records per backend, power over
time is binned to at most ``MAX_WINDOWS`` steps, and the answer tables show at most ``MAX_ROWS`` rows,
each capped with a note saying how much is shown.

Three modules: :mod:`ipw.analysis.report_data` (what the report reads and tabulates),
:mod:`ipw.analysis.report_plots` (the figures) and this one (the context of the templates, and the HTML and
Markdown it renders).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any, Sequence

from ipw.analysis import report_data as data
from ipw.analysis import report_plots as plots
from ipw.errors import IpwError
from ipw.analysis.routing import ROUTER_ACCURACY
from ipw.inputs.resources import resource_path


def _imports() -> None:
    try:
        import jinja2  # noqa: F401 - only whether it imports
        import matplotlib  # noqa: F401 - only whether it imports
    except ImportError as exc:
        raise IpwError(f"ipw report needs jinja2 and matplotlib ({exc.name} is missing): install ipw's "
                       "report extra, e.g. pip install jinja2 matplotlib (bash .ci/setup installs it)") from None


# --- the report ---------------------------------------------------------------------------------------

def build(paths: Sequence[str | Path], *, reference: str | None = None, common_queries: bool = False,
          local: Sequence[str] = (), cloud: Sequence[str] = (), router_accuracy: float = ROUTER_ACCURACY,
          n_boot: int | None = None, seed: int = 0, deadline: str | None = None,
          extra_tables: Sequence[dict[str, Any]] = (), energy_basis: str = "chip",
          carbon_intensity: float | None = None, grid_region: str | None = None,
          pue: Sequence[str] = ()) -> dict[str, Any]:
    """Everything the templates show, from ``ipw.analysis.compare`` and the records of ``paths``.
    ``extra_tables``: tables of deployable policies scored out of sample (``ipw report --router``: the trained
    router; ``key`` trained_router or trained_router_curve), shown after the routing tables; their energy-saved
    cells are marked estimated when the routing's energy is."""
    _imports()
    import matplotlib

    from ipw import __version__
    from ipw.analysis.compare import compare
    from ipw.analysis.render import to_dict
    from ipw.analysis.serving import shown as serving_shown

    c = compare(paths, reference=reference, common_queries=common_queries, local=local, cloud=cloud,
                router_accuracy=router_accuracy, n_boot=n_boot, seed=seed, deadline=deadline,
                energy_basis=energy_basis, carbon_intensity=carbon_intensity, grid_region=grid_region, pue=pue)
    d = to_dict(c)
    labels = {(b.run_id, b.backend, b.concurrency): b.label for b in c.backends}
    est = {b.label: c.estimated(b.label) for b in c.backends}
    manifests, frame = data.load_records(c.runs, labels)
    if common_queries:  # the queries every backend has, as compare used
        per_q = frame.groupby("query_id")["label"].nunique()
        frame = frame[frame["query_id"].isin(per_q.index[per_q == len(c.backends)])]
    r = d["routing"]
    routing_est = c.routing_estimated
    tables = data.marked_tables(c)
    for t in extra_tables:
        rows = [[{**x, "est": routing_est and ("energy saved" in row[0]["text"] or "energy saved" in h)}
                 for x, h in zip(row, t["headers"])] for row in t["rows"]]
        tables.append({**t, "rows": rows, "has_est": any(x["est"] for r in rows for x in r)})
    costliest, wrong = data.costliest(c.runs, frame, est)
    p = plots.Plots([b.label for b in c.backends], est)
    with matplotlib.rc_context({"font.size": 9, "hatch.linewidth": 0.8}):
        plots.plot_accuracy_energy(p, d)
        plots.plot_ipj(p, d)
        plots.plot_energy_tokens(p, frame, {label: fits["energy"] for label, fits in c.models.items()})
        if serving_shown(c.backends):
            plots.plot_serving(p, d)
        for run, _ in manifests:
            plots.plot_power(p, run, frame, data.read_power_trace(run.path))
        if r:
            plots.plot_coverage(p, r, routing_est)
            plots.plot_savings(p, r, routing_est)
        category_note = plots.plot_categories(p, frame)
    backends = [{**b, "est": est[b["label"]]} for b in d["backends"]]
    return {
        "title": "ipw report: " + ", ".join(run.run_id for run in c.runs),
        "generated": dt.datetime.now().isoformat(timespec="seconds"),
        "ipw_version": __version__,
        "runs": [run.__dict__ for run in c.runs],
        "setup": data.setup_sections(manifests),
        "hardware_banner": c.hardware_note,
        "backends": backends,
        "any_est": any(est.values()),
        "tables": tables,
        "figures": p.out,
        "routing": r,
        "routing_note": None if r else "routing plots need a cloud reference and at least one other local backend "
                                       "(set roles with --local/--cloud)",
        "category_note": category_note,
        "costliest": costliest,
        "wrong": wrong,
        "notes": [n for n in c.notes if n != c.hardware_note],  # that one is the banner
        "n_queries": c.n_queries,
        "n_records": int(len(frame)),
        "reference": c.reference,
        "max_rows": data.MAX_ROWS,
    }


def _env() -> Any:
    import jinja2

    from markupsafe import Markup

    from ipw.sanitize import show_bidi  # names are the user's text: a bidi override is shown, not obeyed

    def finalize(value: Any) -> Any:
        if isinstance(value, Markup):
            return Markup(show_bidi(str(value)))
        return show_bidi(value) if isinstance(value, str) else value

    return jinja2.Environment(loader=jinja2.FileSystemLoader(resource_path("templates")),
                              autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
                              lstrip_blocks=True, finalize=finalize)


def render_html(ctx: dict[str, Any]) -> str:
    html: str = _env().get_template("report.html.j2").render(**ctx)
    return html


def _md_cell(text: str) -> str:
    """Text shown literally (``ipw.sanitize.md_text``): pipes, newlines, HTML and link brackets escaped."""
    from ipw.sanitize import md_text

    return md_text(text)


def render_markdown(ctx: dict[str, Any], html_name: str | None = None) -> str:
    """A short summary: what ran, the compare tables and the routing summary (estimated cells marked)."""
    lines = [f"## {ctx['title']}", ""]
    if ctx["hardware_banner"]:
        lines += [f"> **Different hardware.** {_md_cell(ctx['hardware_banner'])}", ""]
    order = ("metrics", "serving", "deadline", "routing", "trained_router", "cascade_picks", "by_category", "judge",
             "difference")  # as in the HTML (the cascade's out-of-sample picks, when records carry mean_logprob)
    keep = sorted((t for t in ctx["tables"] if t["key"] in order), key=lambda t: order.index(t["key"]))
    for t in keep:  # the answer first; what ran, and on what, at the end
        lines += [f"### {_md_cell(t['title'])}", "", "| " + " | ".join(map(_md_cell, t["headers"])) + " |",
                  "|" + "---|" * len(t["headers"])]
        lines += ["| " + " | ".join(_md_cell(x["text"]) + (" *(estimated)*" if x["est"] else "") for x in row) + " |"
                  for row in t["rows"]]
        lines.append("")
    if ctx["any_est"]:
        lines += ["> *(estimated)*: energy from a model, not a sensor.", ""]
    lines += [f"- {_md_cell(n)}" for n in ctx["notes"]]
    lines += ["", "### What was run, and on what", ""]
    for s in ctx["setup"]:
        hw = dict(s["hardware"])
        run = dict(s["run"])
        gpus = hw.get("gpus", "[]")
        lines.append(f"- **{_md_cell(s['run_id'])}** ({_md_cell(run['status'])}): {_md_cell(run['dataset'])}, "
                     f"{_md_cell(run['records'])} records on {_md_cell(hw.get('cpu_model', 'n/a'))}"
                     + ("" if gpus in ("[]", "n/a") else f", GPUs {_md_cell(gpus)}"))
    qualities = ", ".join(f"{_md_cell(b['label'])}: {b['energy_quality']}" for b in ctx["backends"])
    lines += [f"- energy quality: {qualities}"]
    if html_name:
        lines += ["", f"Plots, per-category results and the costliest and wrong answers: `{html_name}`."]
    return "\n".join(lines).rstrip("\n") + "\n"


def write(paths: Sequence[str | Path], out: str | Path, markdown: str | Path | None = None,
          **options: Any) -> dict[str, Any]:
    """Build the report of ``paths`` and write the HTML (and the Markdown summary); returns the context."""
    ctx = build(paths, **options)
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render_html(ctx), encoding="utf-8")
        if markdown is not None:
            Path(markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(markdown).write_text(render_markdown(ctx, out.name), encoding="utf-8")
    except OSError as exc:
        raise IpwError(f"{exc.filename or out}: cannot write the report ({exc.strerror})") from None
    return ctx
