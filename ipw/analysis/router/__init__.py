"""A deployable router (issue 44; docs/ROUTING.md): trained on a run's own records, scored out of sample.

Per local backend, a logistic regression (scikit-learn) predicts from the prompt alone whether that backend
answers as well as the cloud reference: correct against the dataset's answer (``grading="answer"``), or a
win/tie against the reference's answer where a judge graded the records (``grading="vs-backend"``). The
features need nothing the user lacks offline: hashed word 1-2 grams of the prompt (``HashingVectorizer``:
no vocabulary to keep), the log of the prompt's length, and a one-hot of the query's category when the
training runs have categories. A query goes to the cheapest local backend (lowest mean J/query in the
training runs) whose predicted probability is at least the threshold, else to the cloud.

Scoring never uses a query a model was trained on: k-fold by query (the per-query matrix of
``ipw.analysis.load`` has one row per query, its repeats averaged and its concurrency levels aligned, so a
query's repeats never straddle folds), and held-out categories (each category predicted by a model trained
on the others: the out-of-distribution case). Over a grid of thresholds the out-of-fold predictions give
the share routed locally, the routed accuracy and the energy, latency and cost saved against cloud-only
(measured per query, as the oracle's in ``ipw.analysis.routing``), with 95% bootstrap CIs over queries;
APGR (RouteLLM), the local share that keeps 50% and 80% of the cloud's accuracy gap, and the AUC.

The router file is JSON (never pickle): ``FORMAT``, the ipw version, the date, the hashing parameters, each
classifier's intercept and non-zero coefficients, the default threshold, and what it was trained on.
sklearn is imported lazily (the ``route`` extra).

The package, by job: ``data`` (RouteData from run folders), ``model`` (features, classifiers, folds), ``evaluate``
(the curve, APGR, the operating point, the out-of-sample scores), ``file`` (the router file: train, save, load)
and ``tables`` (the scores as compare, report and route show them); each imports only those before it.
"""

from __future__ import annotations

from ipw.analysis.router.file import load_router as load_router  # ipw serve --route reads a router file here
