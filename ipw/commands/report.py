"""``ipw report``: HTML and Markdown (``ipw.analysis.report``)."""

from __future__ import annotations

from rich.console import Console


def report_command(runs, *, out, markdown, reference, common_queries, local, cloud, router_accuracy,
                   deadline=None) -> int:
    from ipw.analysis.report import write

    ctx = write(runs, out, markdown, reference=reference, common_queries=common_queries, local=local, cloud=cloud,
                router_accuracy=router_accuracy, deadline=deadline)
    console = Console(stderr=True)
    console.print(f"wrote {out} ({len(ctx['figures'])} plots, {ctx['n_records']:,} records)"
                  + (f" and {markdown}" if markdown else ""), highlight=False, markup=False, soft_wrap=True)
    return 0
