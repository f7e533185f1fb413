"""``ipw report``: HTML and Markdown (``ipw.analysis.report``)."""

from __future__ import annotations

from rich.console import Console


def report_command(runs, *, out, markdown, **routing) -> int:
    """``routing``: the options of ``ipw.options.ROUTING_OPTIONS``, by name."""
    from ipw.analysis.report import write

    ctx = write(runs, out, markdown, **routing)
    console = Console(stderr=True)
    console.print(f"wrote {out} ({len(ctx['figures'])} plots, {ctx['n_records']:,} records)"
                  + (f" and {markdown}" if markdown else ""), highlight=False, markup=False, soft_wrap=True)
    return 0
