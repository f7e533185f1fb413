"""``ipw compare``: runs side by side (the numbers: ``ipw.analysis.compare``; the tables: ``ipw.analysis.render``)."""

from __future__ import annotations

from ipw.commands.output import stdout
from ipw.errors import IpwError


def compare_command(runs, *, fmt, n_boot, seed, usd_per_kwh, api_prices, router=None, router_threshold=None,
                    max_accuracy_loss=None, **routing) -> int:
    """``routing``: the options of ``ipw.options.ROUTING_OPTIONS``, by name. ``router``: a router file (ipw route
    train) whose design is scored out of sample on these runs and shown beside the oracle and the α-router."""
    import sys

    from ipw.analysis import render
    from ipw.analysis.compare import compare

    if fmt not in render.FORMATS:
        raise IpwError(f"--format {fmt!r}: must be one of {', '.join(render.FORMATS)}")
    if router is None and (router_threshold is not None or max_accuracy_loss is not None):
        raise IpwError("--router-threshold and --max-accuracy-loss need --router FILE")
    if router is not None:  # bad router input fails before any work
        from ipw.analysis.router import check_threshold, load_router, parse_accuracy_loss

        if router_threshold is not None:
            check_threshold(router_threshold)
        if max_accuracy_loss is not None:
            parse_accuracy_loss(max_accuracy_loss)
        load_router(router)
    result = compare(runs, n_boot=n_boot, seed=seed, usd_per_kwh=usd_per_kwh, api_prices=api_prices, **routing)
    # deployable policies scored out of sample, shown after the routing tables: the trained router (issue 44);
    # the cascade (issue 44 item 3) belongs beside it here, as another ipw.analysis.router.PolicyScore
    scores = None
    if router is not None:
        from ipw.commands.route import router_scores

        scores = router_scores(runs, router_path=router, local=routing.get("local") or (),
                               cloud=routing.get("cloud") or (), threshold=router_threshold,
                               max_accuracy_loss=max_accuracy_loss, seed=seed, usd_per_kwh=usd_per_kwh,
                               api_prices=api_prices, energy_basis=routing.get("energy_basis") or "chip",
                               pue=routing.get("pue") or ())
    if fmt == "table":
        console = stdout()
        for table in render.rich_tables(render.tables(result)):
            console.print(table)
        if scores is not None:
            from ipw.commands.route import beside_rows, print_scores

            print_scores(scores, console, beside=beside_rows(result))
        for note in result.notes:
            console.print(f"note: {note}", highlight=False, markup=False)
    elif fmt == "json" and scores is not None:
        import json

        from ipw.commands.route import scores_doc
        from ipw.sanitize import json_bidi

        doc = {**json.loads(render.to_json(result)), **scores_doc(scores)}
        sys.stdout.write(json_bidi(json.dumps(doc, indent=2, ensure_ascii=False)) + "\n")
    else:
        sys.stdout.write({"json": render.to_json, "csv": render.to_csv, "markdown": render.to_markdown}[fmt](result))
        if scores is not None:
            from ipw.commands.route import scores_markdown

            sys.stdout.write(scores_markdown(scores, result) if fmt == "markdown" else
                             "".join(f"trained_router,,,{k},{v},,\n" for k, v in scores_csv(scores)))
    return 0


def scores_csv(scores) -> list[tuple[str, object]]:
    op = scores.kfold.operating_point
    return [("threshold", op.threshold), ("local_share", op.local_share.value), ("accuracy", op.accuracy.value),
            ("accuracy_loss", op.accuracy_loss.value),
            ("energy_saved_fraction", None if op.energy_saved_fraction is None else op.energy_saved_fraction.value),
            *((f"auc:{k}", v) for k, v in scores.kfold.auc.items()), ("apgr", scores.kfold.apgr)]
