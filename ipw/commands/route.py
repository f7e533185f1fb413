"""``ipw route train`` and ``ipw route score``; the logic, and the router's tables that ``ipw compare --router``
and ``ipw report --router`` show too, are ``ipw.analysis.router``'s."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

from ipw.commands.output import stdout
from ipw.options import PriceOptions, RouteRoles, RouteScoreOptions, RouteTrainOptions, naming_flags


@naming_flags
def train_command(runs: Sequence[Path], roles: RouteRoles, options: RouteTrainOptions) -> int:
    from ipw.analysis.router.data import route_data
    from ipw.analysis.router.evaluate import score_router
    from ipw.analysis.router.file import check_out, save, scores_json, train
    from ipw.analysis.router.model import sklearn_modules
    from ipw.analysis.router.tables import print_scores

    out = options.out
    check_out(out)  # before the training: a file that cannot be replaced is refused at once
    sklearn_modules()
    data = route_data(runs, local=roles.local, cloud=roles.cloud, grading=options.grading)
    router = train(data, threshold=options.threshold, min_queries=options.min_queries)
    console = stdout()
    if options.score:
        scores = score_router(data, router.featurizer, k=options.folds, seed=options.seed,
                              threshold=options.threshold)
        router.meta["scores"] = {"kfold": scores_json(scores.kfold),
                                 "held_out_category": None if scores.held_out_category is None
                                 else scores_json(scores.held_out_category)}
        print_scores(scores, console, curve=False)
    save(router, out)
    console.print(f"wrote {out} (router: {', '.join(router.local)} else {router.cloud}; {data.n} queries, "
                  f"threshold {router.threshold:g})", highlight=False, markup=False, soft_wrap=True)
    return 0


@naming_flags
def score_command(runs: Sequence[Path], roles: RouteRoles, options: RouteScoreOptions, prices: PriceOptions) -> int:
    from ipw.analysis.router.tables import print_scores, router_scores, scores_doc

    scores = router_scores(runs, router_path=options.router, local=roles.local, cloud=roles.cloud,
                           grading=options.grading, threshold=options.router_threshold,
                           max_accuracy_loss=options.max_accuracy_loss, min_queries=options.min_queries,
                           folds=options.folds, seed=options.seed, usd_per_kwh=prices.usd_per_kwh,
                           api_prices=prices.api_price)
    if options.format == "json":
        sys.stdout.write(json.dumps(scores_doc(scores), indent=1) + "\n")
    else:
        print_scores(scores, stdout())
    return 0
