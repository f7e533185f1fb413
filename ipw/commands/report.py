"""``ipw report``: HTML and Markdown (``ipw.analysis.report``)."""

from __future__ import annotations

from rich.console import Console

from ipw.options import ReportOptions, RouterOptions, RoutingOptions, given, naming_flags


@naming_flags
def report_command(runs, routing: RoutingOptions, written: ReportOptions, router: RouterOptions) -> int:
    """``router.router``: a router file whose design is scored out of sample on these runs and shown after the
    routing tables (as ipw compare --router)."""
    from ipw.analysis.report import write

    extra = []
    if router.router is not None:
        from ipw.analysis.router.tables import report_tables, router_scores

        extra = report_tables(router_scores(runs, router_path=router.router, local=routing.local, cloud=routing.cloud,
                                            threshold=router.router_threshold,
                                            max_accuracy_loss=router.max_accuracy_loss,
                                            energy_basis=routing.energy_basis, pue=routing.pue))
    ctx = write(runs, written.out, written.markdown, extra_tables=extra, **given(routing))
    console = Console(stderr=True)
    console.print(f"wrote {written.out} ({len(ctx['figures'])} plots, {ctx['n_records']:,} records)"
                  + (f" and {written.markdown}" if written.markdown else ""), highlight=False, markup=False,
                  soft_wrap=True)
    return 0
