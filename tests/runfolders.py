"""The one test helper that writes run folders (through ipw.results, as ``ipw run`` does): ``create``
a folder, ``record`` a QueryRecord with plain defaults, or ``write_run`` a whole run from per-query lists.
Tests that damage a folder on purpose write those files by hand."""

from pathlib import Path

from ipw.results import QueryRecord, RunFolder, RunManifest


def record(**fields) -> QueryRecord:
    """A record of one successful, correct query with estimated CPU energy; ``fields`` override any
    field (``energy_j=None`` makes the energy unavailable)."""
    energy = fields.get("energy_j", 1.0)
    base = dict(run_id="r1", backend="b", model="m", role="local", query_id="q0", category="", repeat=0,
                scorer="exact", prompt="p", answer="a", output="a", correct=1.0, error=None, error_category=None,
                prompt_tokens=10, completion_tokens=10, ttft_s=0.1, latency_s=1.0, start_s=0.0, end_s=1.0,
                energy_j=energy, energy_quality="estimated" if energy is not None else "unavailable",
                energy_source="model.cpu" if energy is not None else "",
                energy_scope="cpu_package" if energy is not None else "",
                best_effort_energy_j=energy, net_energy_j=energy)
    return QueryRecord(**{**base, **fields})


def create(out: Path, run_id: str, manifest: dict | None = None) -> RunFolder:
    """An open run folder (status running) with a minimal manifest, or ``manifest``."""
    manifest = manifest if manifest is not None else {"command": ["test"], "config": {}}
    return RunFolder.create(out, run_id, RunManifest.from_dict({**manifest, "run_id": run_id}))


def write_run(out: Path, run_id: str, backends: dict, *, query_ids=None, categories=None,
              fingerprint="sha256:same", status="complete", repeats=1, shard=None) -> Path:
    """A run folder with one record per (backend, query, repeat). ``backends`` maps a name to lists of
    per-query values: correct, energy (None: unavailable), duration, latency, ttft, tokens, error, and
    the backend's role and energy quality. A serving sweep: ``backend`` (the records' backend name, default
    the key, so one backend can have several entries), ``concurrency`` (default 1), ``split_method``
    (default ""), and ``start``: per-query window starts (s) relative to the entry's own beginning, so
    windows may overlap (default: one after the other; every repeat gets the same windows). ``shard``: (K, N),
    a ``--shard K/N`` run of a full set whose fingerprint is ``fingerprint`` (the queries given are the shard's)."""
    n = len(next(iter(backends.values()))["correct"])
    query_ids = query_ids or [f"q{i}" for i in range(n)]
    categories = categories or ["cat"] * n
    dataset = {"name": "fixture", "n_queries": n, "fingerprint": fingerprint}
    manifest = {"command": ["test"], "config": {}, "dataset": dataset}
    if shard is not None:
        manifest["dataset"] = {**dataset, "fingerprint": f"{fingerprint}/shard-{shard[0]}-of-{shard[1]}"}
        manifest["shard"] = {"index": shard[0], "count": shard[1], "dataset": dataset}
    folder = create(out, run_id, manifest)
    t = 0.0
    for name, b in backends.items():
        begin = t
        for i, qid in enumerate(query_ids):
            for r in range(repeats):
                energy = b["energy"][i]
                duration = b.get("duration", [1.0] * n)[i]
                error = (b.get("error") or [None] * n)[i]
                if "start" in b:
                    t = begin + b["start"][i]
                folder.append(record(
                    run_id=run_id, backend=b.get("backend", name), model=b.get("model", b.get("backend", name)),
                    role=b.get("role", "local"), concurrency=b.get("concurrency", 1),
                    split_method=b.get("split_method", ""),
                    query_id=qid, category=categories[i], repeat=r, output="a" if b["correct"][i] else "b",
                    correct=float(b["correct"][i]), error=error, error_category="timeout" if error else None,
                    prompt_tokens=b.get("prompt_tokens", 10), completion_tokens=b.get("tokens", [10] * n)[i],
                    ttft_s=b.get("ttft", [0.1] * n)[i], latency_s=b.get("latency", [duration] * n)[i],
                    start_s=t, end_s=t + duration, energy_j=energy,
                    energy_quality=b.get("quality", "estimated") if energy is not None else "unavailable",
                    energy_scope="cpu_package",
                ))
                t += duration + 0.01
        if "start" in b:
            t = begin + max(s + d for s, d in zip(b["start"], b.get("duration", [1.0] * n))) + 0.01
    folder.finish(status)
    return folder.path


def start_run(config, command=None, shard=None):
    """``ipw run``'s load and plan steps (``ipw.commands.run._run``) for a config already made: returns the
    run folder and the queries to run, as ``ipw.running.runner.execute`` takes them."""
    from ipw.commands.run import check_run
    from ipw.inputs.datasets import load_query_set
    from ipw.running.runner import plan_run

    query_set = load_query_set(config.dataset, limit=config.limit, **config.dataset_options())
    check_run(config)
    return plan_run(config, query_set, shard, command)


def resume_run(run_dir):
    """``ipw run --resume``'s load and plan steps: the folder, its config, the queries and what is done."""
    from ipw.commands.run import check_run, load_resumed
    from ipw.running.runner import plan_resume

    config, query_set = load_resumed(run_dir)
    plan = plan_resume(run_dir, query_set, config, check_run(config))
    return plan.folder, config, plan.queries, plan.done
