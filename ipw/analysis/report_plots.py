"""``ipw report``'s plots: matplotlib figures (Agg, imported lazily) as PNG ``data:`` URIs, from compare's
JSON (:func:`ipw.analysis.render.to_dict`), its fits, and the records :mod:`ipw.analysis.report_data` read.

Estimated energy (a model, not a sensor) is marked in every plot: hatched bars, hollow markers, dashed lines,
"(estimated)" in labels and a note under the figure.  Scale: scatter plots draw a seeded sample of at most
``MAX_POINTS`` records per backend, power over time is binned to at most ``MAX_WINDOWS`` steps.
"""

from __future__ import annotations

import base64
import io
import math
from typing import TYPE_CHECKING, Any, Sequence, cast

import numpy as np

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from ipw.analysis.fit import LinearFit
    from ipw.analysis.load import RunInfo

MAX_POINTS = 2000  # records per backend in a scatter plot
MAX_WINDOWS = 1500  # steps of power over time per backend
MAX_BOUNDARIES = 200  # query boundaries drawn as lines in power over time
MAX_TRACE_POINTS = 4000  # points per device of a power.parquet trace
MAX_CATEGORIES = 30  # categories in the per-category plot
DPI = 110
ESTIMATED_NOTE = "hatched bars, hollow markers, dashed lines, '(estimated)': estimated energy (a model, not a sensor)"


class Plots:
    """Figures as PNG data URIs; colors and estimated-energy styles fixed per backend label."""

    def __init__(self, labels: Sequence[str], est: dict[str, bool]):
        import matplotlib

        self.mpl = matplotlib
        self.labels = list(labels)
        self.est = est
        cycle = matplotlib.colormaps["tab10"]
        self.color = {x: cycle(i % 10) for i, x in enumerate(self.labels)}
        self.out: list[dict[str, Any]] = []

    def name(self, label: str) -> str:
        return _t(label) + (" (estimated)" if self.est.get(label) else "")

    def figure(self, w: float = 7.5, h: float = 4.0, ncols: int = 1) -> tuple[Figure, Any]:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(w, h), layout="constrained")
        axes = fig.subplots(1, ncols, squeeze=False)[0]
        for ax in axes:
            ax.grid(True, alpha=0.3)
        return fig, axes

    def add(self, fig: Figure, key: str, title: str, caption: str, estimated: bool = False) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        if estimated:
            fig.text(0.0, -0.01, ESTIMATED_NOTE, fontsize=8, style="italic", color="#7a4b00", va="top")
        FigureCanvasAgg(fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
        src = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
        self.out.append({"key": key, "title": title, "caption": caption, "src": src, "estimated": estimated})

    def bar_style(self, label: str) -> dict[str, Any]:
        if self.est.get(label):
            return {"facecolor": "white", "edgecolor": self.color[label], "hatch": "///", "linewidth": 1.2}
        return {"color": self.color[label]}

    def marker_style(self, label: str) -> dict[str, Any]:
        if self.est.get(label):
            return {"facecolors": "none", "edgecolors": self.color[label]}
        return {"color": self.color[label]}


def _log_x(ax: Axes) -> None:
    """A log x axis (call it after plotting) labeled in plain numbers: 1, 2, 5, 10, 20, 50, ... over up to
    two decades, the powers of ten only above (where the labels between would overlap)."""
    import matplotlib.ticker as mt

    ax.set_xscale("log")
    plain = mt.FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(plain)
    lo, hi = ax.get_xlim()
    if hi / lo <= 300:
        ax.xaxis.set_minor_locator(mt.LogLocator(subs=(2.0, 5.0)))
        ax.xaxis.set_minor_formatter(plain)
    else:
        ax.xaxis.set_minor_formatter(mt.NullFormatter())


def _t(text: object) -> str:
    """Dataset or run text as a plot label: literal dollars (matplotlib would read $...$ as math)."""
    return str(text).replace("$", r"\$")


def _ci(est: dict[str, Any] | None) -> tuple[float, float, float]:
    if not est or est.get("value") is None:
        return (math.nan,) * 3
    v = est["value"]
    lo = est["lo"] if est.get("lo") is not None else v
    hi = est["hi"] if est.get("hi") is not None else v
    return v, max(v - lo, 0.0), max(hi - v, 0.0)


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the (energy, accuracy) points no other point beats (less energy and at least the
    accuracy, or the same energy and more accuracy), in order of energy."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    best, out = -math.inf, []
    for i in order:
        if points[i][1] > best:
            out.append(i)
            best = points[i][1]
    return out


def plot_accuracy_energy(p: Plots, d: dict[str, Any]) -> None:
    fig, (ax,) = p.figure()
    pts, labels = [], []
    for b in d["backends"]:
        x, xlo, xhi = _ci(b["metrics"]["energy_per_query_j"])
        y, ylo, yhi = _ci(b["metrics"]["accuracy"])
        if not (math.isfinite(x) and math.isfinite(y)):
            continue
        label = b["label"]
        ax.errorbar([x], [y], xerr=[[xlo], [xhi]], yerr=[[ylo], [yhi]], fmt="none", ecolor=p.color[label],
                    alpha=0.6, linestyle="--" if p.est.get(label) else "-")
        ax.scatter([x], [y], s=70, zorder=3, label=p.name(label), **p.marker_style(label))
        pts.append((x, y))
        labels.append(label)
    if not pts:
        return
    front = pareto_frontier(pts)
    ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], drawstyle="steps-post", color="gray",
            linestyle=":", zorder=1, label="Pareto frontier")
    xs = [x for x, _ in pts]
    if min(xs) > 0 and max(xs) / min(xs) > 20:
        _log_x(ax)
    any_est = any(p.est.get(x) for x in labels)
    ax.set_xlabel("J/query" + (" (estimated where marked)" if any_est else ""))
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.03, 1.03)
    ax.yaxis.set_major_formatter(p.mpl.ticker.PercentFormatter(1.0))
    ax.legend(fontsize=8, loc="best")
    on = ", ".join(labels[i] for i in front)
    p.add(fig, "pareto", "Accuracy vs energy per query",
          f"Points with {_ci_words(d)} on both axes; Pareto frontier (no backend is both cheaper and more "
          f"accurate): {on}.", any_est)


def _ci_words(d: dict[str, Any]) -> str:
    """How the captions name the CIs: with measurement error where compare drew it (issue 27)."""
    carried = str((d.get("bootstrap") or {}).get("measurement_error", "")).startswith("energy CIs include")
    return "95% bootstrap CIs" + (" (energy with each query's measurement error)" if carried else "")


def plot_ipj(p: Plots, d: dict[str, Any]) -> None:
    bs = [b for b in d["backends"] if math.isfinite(_ci(b["metrics"]["ipj"])[0])]
    if not bs:
        return
    fig, (ax,) = p.figure(h=3.6)
    for i, b in enumerate(bs):
        v, lo, hi = _ci(b["metrics"]["ipj"])
        ax.bar([i], [v], yerr=[[lo], [hi]], capsize=6, ecolor="black", **p.bar_style(b["label"]))
    ax.set_xticks(range(len(bs)), [p.name(b["label"]) for b in bs], rotation=15 if len(bs) > 3 else 0,
                  ha="right" if len(bs) > 3 else "center", fontsize=8)
    ax.set_ylabel("IPJ: correct answers per joule")
    ax.set_ylim(bottom=0)
    p.add(fig, "ipj", "IPJ per backend", f"Intelligence per joule (accuracy / mean J per query) with {_ci_words(d)}.",
          any(p.est.get(b["label"]) for b in bs))


def plot_energy_tokens(p: Plots, frame: pd.DataFrame, fits: dict[str, LinearFit]) -> None:
    """Energy per query against prompt tokens and against output tokens, one point per record, with each
    backend's fitted model E = a + b*prompt + c*output drawn with the other token count held at its mean.
    ``fits``: label -> the energy ``LinearFit`` of ``Comparison.models`` (ipw.analysis.compare.fitted_models:
    per query, repeats averaged, errored queries left out), the fit ipw compare reports."""
    fig, (ax_p, ax_k) = p.figure(w=10.0, ncols=2)
    rng = np.random.default_rng(0)
    notes, drawn = [], []
    for label, g in frame.groupby("label", sort=False):
        label = cast(str, label)  # a backend label (pandas types a group key as any scalar)
        g = g[g["energy_j"].notna() & g["completion_tokens"].notna()]
        if g.empty:
            continue
        shown = g
        if len(g) > MAX_POINTS:
            shown = g.iloc[np.sort(rng.choice(len(g), MAX_POINTS, replace=False))]
            notes.append(f"{label}: {MAX_POINTS:,} of {int((frame['label'] == label).sum()):,} records")
        style = p.marker_style(label)
        for ax, col in ((ax_p, "prompt_tokens"), (ax_k, "completion_tokens")):
            ax.scatter(shown[col], shown["energy_j"], s=14, alpha=0.55, label=p.name(label), **style)
        fit = fits.get(label)
        if fit is not None and np.isfinite(fit.per_prompt_token.value):
            a, b, c = fit.intercept.value, fit.per_prompt_token.value, fit.per_completion_token.value
            xs = np.linspace(g["prompt_tokens"].min(), g["prompt_tokens"].max(), 50)
            ax_p.plot(xs, a + b * xs + c * g["completion_tokens"].mean(), lw=1.2, ls="--",
                      label=f"fit {p.name(label)}: {b:.3g} J/prompt tok (R² {fit.r2:.2f})")
            xs = np.linspace(g["completion_tokens"].min(), g["completion_tokens"].max(), 50)
            ax_k.plot(xs, a + b * g["prompt_tokens"].mean() + c * xs, lw=1.2, ls="--",
                      label=f"fit {p.name(label)}: {c:.3g} J/output tok")
        drawn.append(label)
    if not drawn:
        return
    unit = "J/query" + (" (estimated where marked)" if any(p.est.get(x) for x in drawn) else "")
    for ax, xlabel in ((ax_p, "prompt tokens"), (ax_k, "output tokens")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(unit)
        ax.legend(fontsize=7)
    sample = f" Seeded random sample shown ({'; '.join(notes)})." if notes else ""
    p.add(fig, "energy_tokens", "Energy per query vs prompt and output tokens",
          "One point per record; dashed: the fitted model E = a + b·prompt + c·output per backend (other "
          "token count at its mean), the same least-squares fit ipw compare reports (over the queries without "
          "an error, repeats averaged)." + sample,
          any(p.est.get(x) for x in drawn))


def plot_serving(p: Plots, d: dict[str, Any]) -> None:
    """J per output token against output tokens/s, one line per backend through its concurrency levels
    (each point labeled c=N): where batching stops paying."""
    lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for x in d["serving"]:
        lines.setdefault((x["run_id"], x["backend"]), []).append(x)
    fig, (ax,) = p.figure()
    drawn, xs = [], []
    for levels in lines.values():
        pts = [(x["metrics"]["output_tokens_per_s"]["value"], x["metrics"]["j_per_output_token"]["value"],
                x["concurrency"]) for x in sorted(levels, key=lambda x: x["concurrency"])]
        pts = [(x, y, k) for x, y, k in pts if x is not None and y is not None]
        if not pts:
            continue
        top = max(levels, key=lambda x: x["concurrency"])  # its color and estimated style: its highest level's
        label = top["label"]
        name = p.name(label).replace(f"@c{top['concurrency']}", "", 1)  # run_id/NAME where names clash
        ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], color=p.color[label], zorder=2,
                linestyle="--" if p.est.get(label) else "-")
        ax.scatter([x for x, _, _ in pts], [y for _, y, _ in pts], s=40, zorder=3, label=name,
                   **p.marker_style(label))
        for x, y, k in pts:
            ax.annotate(f"c={k}", (x, y), fontsize=8, textcoords="offset points", xytext=(5, 4))
        drawn.append(label)
        xs += [x for x, _, _ in pts]
    if not drawn:
        return
    if min(xs) > 0 and max(xs) / min(xs) > 20:
        _log_x(ax)
    any_est = any(p.est.get(x) for x in drawn)
    ax.set_xlabel("output tokens/s (output tokens over the level's wall span)")
    ax.set_ylabel("J per output token" + (" (estimated where marked)" if any_est else ""))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="best")
    p.add(fig, "serving", "Energy per output token vs throughput, per concurrency level",
          "One line per backend through the concurrency levels it was measured at (c = requests in flight); "
          "down and to the right is cheaper and faster.", any_est)


def _binned_power(t0: np.ndarray, t1: np.ndarray, e: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Energy-weighted average power in ``n_bins`` equal time bins (query windows by their midpoint)."""
    edges = np.linspace(t0.min(), t1.max(), n_bins + 1)
    idx = np.clip(np.searchsorted(edges, (t0 + t1) / 2, side="right") - 1, 0, n_bins - 1)
    energy = np.bincount(idx, e, n_bins)
    busy = np.bincount(idx, t1 - t0, n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        return edges, np.where(busy > 0, energy / busy, np.nan)


def plot_power(p: Plots, run: RunInfo, frame: pd.DataFrame, power: pd.DataFrame | None) -> None:
    """Power over time of one run: the power.parquet trace when present, else each query window's average
    power (its energy / its duration); query boundaries as lines (or backend spans when there are many)."""
    recs = frame[frame["run_id"] == run.run_id]
    recs = recs[recs["start_s"].notna() & recs["end_s"].notna()]
    if recs.empty:
        return
    origin = float(recs["start_s"].min())
    fig, (ax,) = p.figure(h=3.8)
    any_est, drawn = False, power is not None
    if power is not None:
        for device, g in power.groupby("device", sort=False, observed=True):
            g = g.sort_values("t_s")
            t, w = g["t_s"].to_numpy(float) - origin, g["power_w"].to_numpy(float)
            if len(t) > MAX_TRACE_POINTS:  # mean per time bin
                edges = np.linspace(t[0], t[-1], MAX_TRACE_POINTS + 1)
                idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, MAX_TRACE_POINTS - 1)
                with np.errstate(invalid="ignore", divide="ignore"):
                    w = np.bincount(idx, w, MAX_TRACE_POINTS) / np.bincount(idx, minlength=MAX_TRACE_POINTS)
                t = (edges[:-1] + edges[1:]) / 2
            ax.plot(t, w, linewidth=0.9, label=f"{_t(device)} (sampled)")
        what = "sampled power from power.parquet (measured)"
        ylabel = "power (W)"
    else:
        for label, g in recs.groupby("label", sort=False):
            label = cast(str, label)  # a backend label (pandas types a group key as any scalar)
            g = g[g["energy_j"].notna() & (g["end_s"] > g["start_s"])]
            if g.empty:
                continue
            t0, t1 = g["start_s"].to_numpy(float) - origin, g["end_s"].to_numpy(float) - origin
            e = g["energy_j"].to_numpy(float)
            kw = {"color": p.color[label], "linestyle": "--" if p.est.get(label) else "-"}
            if len(g) > MAX_WINDOWS:
                edges, w = _binned_power(t0, t1, e, MAX_WINDOWS)
                ax.stairs(w, edges, baseline=None, label=p.name(label), **kw)
            else:
                ax.hlines(e / (t1 - t0), t0, t1, label=p.name(label), linewidth=2, **kw)
            any_est = any_est or bool(p.est.get(label))
            drawn = True
        what = "average power per query window (its energy / its duration; not a sampled trace)"
        ylabel = "average power per query window (W)" + (" (estimated)" if any_est else "")
    if not drawn:
        return  # no energy and no trace: nothing to show
    starts = recs["start_s"].to_numpy(float) - origin
    if len(starts) <= MAX_BOUNDARIES:
        ax.vlines(starts, 0, 1, transform=ax.get_xaxis_transform(), color="gray", alpha=0.35, linewidth=0.6)
        bounds = "thin gray lines mark where each query starts"
    else:
        for label, g in recs.groupby("label", sort=False):
            label = cast(str, label)  # a backend label (pandas types a group key as any scalar)
            ax.axvspan(g["start_s"].min() - origin, g["end_s"].max() - origin, color=p.color[label], alpha=0.08)
        bounds = (f"{len(starts):,} queries: boundaries not drawn one by one; shaded spans mark each backend's "
                  f"queries{f', power binned into {MAX_WINDOWS:,} steps' if power is None else ''}")
    ax.set_xlabel("seconds since the run's first query")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="best")
    p.add(fig, f"power_{run.run_id}", f"Power over time: run {run.run_id}", f"{what.capitalize()}; {bounds}.",
          any_est)


def plot_coverage(p: Plots, r: dict[str, Any], est_routing: bool) -> None:
    if not r["power_envelope"] and not r["energy_budget"]:
        return
    fig, axes = p.figure(w=9.0, h=3.8, ncols=2)
    style = {"linestyle": "--" if est_routing else "-", "marker": "o", "drawstyle": "steps-post"}
    suffix = " (estimated)" if est_routing else ""
    env = r["power_envelope"]
    if env:
        axes[0].plot([x["power_w"] for x in env], [x["coverage"] for x in env], **style)
        for x in env:
            axes[0].annotate(_t("+".join(x["backends"])[:40]), (x["power_w"], x["coverage"]), fontsize=7,
                             textcoords="offset points", xytext=(4, -10))
    axes[0].set_xlabel("power envelope: mean W of a local backend" + suffix)
    axes[0].set_title("coverage within a power envelope", fontsize=10)
    bud = r["energy_budget"]
    if bud:
        axes[1].plot([x["energy_j"] for x in bud], [x["coverage"] for x in bud], **style)
        if bud[0]["energy_j"] > 0 and bud[-1]["energy_j"] / bud[0]["energy_j"] > 20:
            _log_x(axes[1])
    axes[1].set_xlabel("energy budget per query (J)" + suffix)
    axes[1].set_title("coverage within an energy budget", fontsize=10)
    for ax in axes:
        ax.set_ylabel("local coverage")
        ax.set_ylim(0, 1.02)
        ax.yaxis.set_major_formatter(p.mpl.ticker.PercentFormatter(1.0))
    p.add(fig, "coverage", "Coverage vs power envelope and energy budget",
          f"Share of the {r['coverage']['n_scored']:,} scored queries (of {r['n_queries']:,}) some local backend "
          f"({', '.join(r['local'])}) answers correctly, "
          f"using only local backends whose mean power fits (left), or within a per-query energy budget (right).",
          est_routing)


def plot_savings(p: Plots, r: dict[str, Any], est_routing: bool) -> None:
    curve = r["router_curve"]
    if not curve:
        return
    fig, axes = p.figure(w=9.0, h=3.8, ncols=2)
    alphas = [x["alpha"] for x in curve]
    energy = ("energy saved (estimated)", "--") if est_routing else ("energy saved", "-")
    for key, name, ls in (("energy", *energy), ("latency", "latency saved", "-"), ("cost", "cost saved", "-")):
        ys = [x[f"{key}_saved_fraction"] for x in curve]
        if any(y is not None for y in ys):
            axes[0].plot(alphas, [math.nan if y is None else y for y in ys], marker="o", markersize=3, linestyle=ls,
                         label=name)
    a = r["router"]["alpha"]
    axes[0].axvline(a, color="gray", linestyle=":", label=f"α = {a:g}")
    axes[0].set_xlabel("α: share of queries routed as the oracle would (1 = oracle)")
    axes[0].set_ylabel("saved vs cloud only")
    axes[0].yaxis.set_major_formatter(p.mpl.ticker.PercentFormatter(1.0))
    axes[0].legend(fontsize=8)
    axes[0].set_title("oracle and α-router savings", fontsize=10)
    axes[1].plot(alphas, [math.nan if x["accuracy"] is None else x["accuracy"] for x in curve], marker="o",
                 markersize=3, color="black")
    axes[1].axvline(a, color="gray", linestyle=":")
    axes[1].set_xlabel("α")
    axes[1].set_ylabel("routed accuracy")
    axes[1].yaxis.set_major_formatter(p.mpl.ticker.PercentFormatter(1.0))
    axes[1].set_title("routed accuracy", fontsize=10)
    o = r["oracle"]
    saved = o["energy"]["saved_fraction"]["value"] if o["energy"] else None
    p.add(fig, "savings", "Oracle and α-router savings",
          f"Against sending every query to {r['cloud']}; the oracle (α = 1) routes "
          f"{', '.join(f'{k}: {v:,}' for k, v in o['routed_to'].items())} and saves "
          f"{'n/a' if saved is None else f'{saved:.1%}'} of the energy.", est_routing)


def plot_categories(p: Plots, frame: pd.DataFrame) -> str:
    per_query = frame.groupby(["label", "category", "query_id"], sort=False, observed=True)[
        ["correct", "energy_j"]].mean()
    per_cat = per_query.groupby(level=["label", "category"], sort=False).mean()
    counts = frame.groupby("category", observed=True)["query_id"].nunique().sort_values(ascending=False)
    cats = sorted(counts.index[:MAX_CATEGORIES].tolist())
    if not cats:
        return ""
    labels = [x for x in p.labels if x in per_cat.index.get_level_values(0)]
    n = len(labels)
    height = min(2.0 + 0.22 * len(cats) * max(n, 1), 16.0)
    fig, axes = p.figure(w=9.0, h=height, ncols=2)
    y = np.arange(len(cats))
    bar_h = 0.8 / max(n, 1)
    any_est = False
    for k, label in enumerate(labels):
        sub = per_cat.loc[label].reindex(cats)
        pos = y - 0.4 + bar_h * (k + 0.5)
        axes[0].barh(pos, sub["correct"].to_numpy(float), height=bar_h, label=p.name(label), color=p.color[label])
        axes[1].barh(pos, sub["energy_j"].to_numpy(float), height=bar_h, label=p.name(label),
                     **p.bar_style(label))
        any_est = any_est or bool(p.est.get(label))
    for ax in axes:
        ax.set_yticks(y, [_t(c) or "-" for c in cats], fontsize=8)
        ax.invert_yaxis()
    axes[0].set_xlabel("accuracy")
    axes[0].set_xlim(0, 1.0)
    axes[0].xaxis.set_major_formatter(p.mpl.ticker.PercentFormatter(1.0))
    energy = per_cat["energy_j"].to_numpy(float)
    energy = energy[np.isfinite(energy) & (energy > 0)]
    if len(energy) and energy.max() / energy.min() > 50:
        _log_x(axes[1])
    axes[1].set_xlabel("J/query" + (" (estimated where marked)" if any_est else ""))
    axes[0].legend(fontsize=8, loc="lower right")
    note = (f"; the {MAX_CATEGORIES} largest of {len(counts)} categories shown" if len(counts) > MAX_CATEGORIES
            else "")
    p.add(fig, "categories", "Accuracy and energy per category",
          f"Means over each category's queries (repeats averaged first){note}.", any_est)
    return note
