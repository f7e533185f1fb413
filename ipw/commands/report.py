"""``ipw report``: HTML and Markdown (``ipw.analysis.report``)."""

from __future__ import annotations

from rich.console import Console


def report_command(runs, *, out, markdown, router=None, router_threshold=None, max_accuracy_loss=None,
                   **routing) -> int:
    """``routing``: the options of ``ipw.options.ROUTING_OPTIONS``, by name. ``router``: a router file whose
    design is scored out of sample on these runs and shown after the routing tables (as ipw compare --router)."""
    from ipw.analysis.report import write
    from ipw.errors import IpwError

    if router is None and (router_threshold is not None or max_accuracy_loss is not None):
        raise IpwError("--router-threshold and --max-accuracy-loss need --router FILE")
    extra = []
    if router is not None:
        from ipw.commands.route import report_tables, router_scores

        extra = report_tables(router_scores(runs, router_path=router, local=routing.get("local") or (),
                                            cloud=routing.get("cloud") or (), threshold=router_threshold,
                                            max_accuracy_loss=max_accuracy_loss, seed=routing.get("seed") or 0,
                                            energy_basis=routing.get("energy_basis") or "chip",
                                            pue=routing.get("pue") or ()))
    ctx = write(runs, out, markdown, extra_tables=extra, **routing)
    console = Console(stderr=True)
    console.print(f"wrote {out} ({len(ctx['figures'])} plots, {ctx['n_records']:,} records)"
                  + (f" and {markdown}" if markdown else ""), highlight=False, markup=False, soft_wrap=True)
    return 0
