"""``ipw compare``: runs side by side (the numbers: ``ipw.analysis.compare``; the tables: ``ipw.analysis.render``)."""

from __future__ import annotations

from ipw.commands.output import stdout
from ipw.errors import IpwError


def compare_command(runs, *, reference, common_queries, local, cloud, router_accuracy, fmt, n_boot, seed,
                    usd_per_kwh, api_prices, deadline=None) -> int:
    import sys

    from ipw.analysis import render
    from ipw.analysis.compare import compare

    if fmt not in render.FORMATS:
        raise IpwError(f"--format {fmt!r}: must be one of {', '.join(render.FORMATS)}")
    result = compare(runs, reference=reference, common_queries=common_queries, local=local, cloud=cloud,
                     router_accuracy=router_accuracy, n_boot=n_boot, seed=seed, usd_per_kwh=usd_per_kwh,
                     api_prices=api_prices, deadline=deadline)
    if fmt == "table":
        console = stdout()
        for table in render.rich_tables(render.tables(result)):
            console.print(table)
        for note in result.notes:
            console.print(f"note: {note}", highlight=False, markup=False)
    else:
        sys.stdout.write({"json": render.to_json, "csv": render.to_csv, "markdown": render.to_markdown}[fmt](result))
    return 0
