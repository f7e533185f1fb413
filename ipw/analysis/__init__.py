"""Numbers from run folders only: ``load`` (run folders -> per-query frames), ``metrics`` (the metric
table), ``fmt`` (how its numbers are shown), ``stats`` (bootstrap), ``routing``, ``compare`` (metrics,
intervals and routing of a comparison), ``render`` (its JSON, CSV and tables), ``check`` (the gate) and
``report`` (HTML and Markdown)."""
