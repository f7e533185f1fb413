"""``ipw compare``: runs side by side (the numbers: ``ipw.analysis.compare``; the tables: ``ipw.analysis.render``)."""

from __future__ import annotations

from ipw.commands.output import stdout
from ipw.options import CompareOptions, PriceOptions, RouterOptions, RoutingOptions, given, naming_flags


@naming_flags
def compare_command(runs, routing: RoutingOptions, view: CompareOptions, prices: PriceOptions,
                    router: RouterOptions) -> int:
    """``router.router``: a router file (ipw route train) whose design is scored out of sample on these runs and
    shown beside the oracle and the α-router."""
    import sys

    from ipw.analysis import render
    from ipw.analysis.compare import compare

    fmt = view.format
    if router.router is not None:  # bad router input fails before any work
        from ipw.analysis.router.data import parse_accuracy_loss
        from ipw.analysis.router.file import load_router

        if router.max_accuracy_loss is not None:
            parse_accuracy_loss(router.max_accuracy_loss)
        load_router(router.router)
    result = compare(runs, n_boot=view.n_boot, seed=view.seed, usd_per_kwh=prices.usd_per_kwh,
                     api_prices=prices.api_price, **given(routing))
    # deployable policies scored out of sample, shown after the routing tables: the trained router (issue 44);
    # the cascade (issue 44 item 3) belongs beside it here, as another ipw.analysis.router.evaluate.PolicyScore
    scores = None
    if router.router is not None:
        from ipw.analysis.router.tables import router_scores

        scores = router_scores(runs, router_path=router.router, local=routing.local, cloud=routing.cloud,
                               threshold=router.router_threshold, max_accuracy_loss=router.max_accuracy_loss,
                               seed=view.seed, usd_per_kwh=prices.usd_per_kwh, api_prices=prices.api_price,
                               energy_basis=routing.energy_basis, pue=routing.pue)
    if fmt == "table":
        console = stdout()
        for table in render.rich_tables(render.tables(result)):
            console.print(table)
        if scores is not None:
            from ipw.analysis.router.tables import beside_rows, print_scores

            print_scores(scores, console, beside=beside_rows(result))
        from ipw.sanitize import one_line  # notes hold texts from outside: a feed's zone, a config's pue_source

        for note in result.notes:
            console.print(f"note: {one_line(note)}", highlight=False, markup=False)
    elif fmt == "json" and scores is not None:
        import json

        from ipw.analysis.router.tables import scores_doc
        from ipw.sanitize import json_bidi

        doc = {**json.loads(render.to_json(result)), **scores_doc(scores)}
        sys.stdout.write(json_bidi(json.dumps(doc, indent=2, ensure_ascii=False)) + "\n")
    else:
        sys.stdout.write({"json": render.to_json, "csv": render.to_csv, "markdown": render.to_markdown}[fmt](result))
        if scores is not None:
            from ipw.analysis.router.tables import scores_markdown

            sys.stdout.write(scores_markdown(scores, result) if fmt == "markdown" else
                             "".join(f"trained_router,,,{k},{v},,\n" for k, v in scores_csv(scores)))
    return 0


def scores_csv(scores) -> list[tuple[str, object]]:
    op = scores.kfold.operating_point
    return [("threshold", op.threshold), ("local_share", op.local_share.value), ("accuracy", op.accuracy.value),
            ("accuracy_loss", op.accuracy_loss.value),
            ("energy_saved_fraction", None if op.energy_saved_fraction is None else op.energy_saved_fraction.value),
            *((f"auc:{k}", v) for k, v in scores.kfold.auc.items()), ("apgr", scores.kfold.apgr)]
