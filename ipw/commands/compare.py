"""``ipw compare``: runs side by side (the numbers: ``ipw.analysis.compare``; the tables: ``ipw.analysis.render``)."""

from __future__ import annotations

from ipw.commands.output import stdout
from ipw.errors import IpwError


def compare_command(runs, *, fmt, n_boot, seed, usd_per_kwh, api_prices, **routing) -> int:
    """``routing``: the options of ``ipw.options.ROUTING_OPTIONS``, by name."""
    import sys

    from ipw.analysis import render
    from ipw.analysis.compare import compare

    if fmt not in render.FORMATS:
        raise IpwError(f"--format {fmt!r}: must be one of {', '.join(render.FORMATS)}")
    result = compare(runs, n_boot=n_boot, seed=seed, usd_per_kwh=usd_per_kwh, api_prices=api_prices, **routing)
    if fmt == "table":
        console = stdout()
        for table in render.rich_tables(render.tables(result)):
            console.print(table)
        for note in result.notes:
            console.print(f"note: {note}", highlight=False, markup=False)
    else:
        sys.stdout.write({"json": render.to_json, "csv": render.to_csv, "markdown": render.to_markdown}[fmt](result))
    return 0
