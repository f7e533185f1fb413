"""The one test helper that writes run folders (through ipw.results, as ``ipw run`` does)."""

from pathlib import Path

from ipw.results import QueryRecord, RunFolder


def write_run(out: Path, run_id: str, backends: dict, *, query_ids=None, categories=None,
              fingerprint="sha256:same", status="complete", repeats=1) -> Path:
    """A run folder with one record per (backend, query, repeat). ``backends`` maps a name to lists of
    per-query values: correct, energy (None: unavailable), duration, latency, ttft, tokens, error, and
    the backend's role and energy quality."""
    n = len(next(iter(backends.values()))["correct"])
    query_ids = query_ids or [f"q{i}" for i in range(n)]
    categories = categories or ["cat"] * n
    folder = RunFolder.create(out, run_id, {
        "command": ["test"], "config": {},
        "dataset": {"name": "fixture", "n_queries": n, "fingerprint": fingerprint},
    })
    t = 0.0
    for name, b in backends.items():
        for i, qid in enumerate(query_ids):
            for r in range(repeats):
                energy = b["energy"][i]
                duration = b.get("duration", [1.0] * n)[i]
                error = (b.get("error") or [None] * n)[i]
                folder.append(QueryRecord(
                    run_id=run_id, backend=name, model=b.get("model", name), role=b.get("role", "local"),
                    query_id=qid, category=categories[i], repeat=r, scorer="exact", prompt="p", answer="a",
                    output="a" if b["correct"][i] else "b", correct=float(b["correct"][i]), error=error,
                    error_category="timeout" if error else None, prompt_tokens=b.get("prompt_tokens", 10),
                    completion_tokens=b.get("tokens", [10] * n)[i],
                    ttft_s=b.get("ttft", [0.1] * n)[i], latency_s=b.get("latency", [duration] * n)[i],
                    start_s=t, end_s=t + duration, energy_j=energy,
                    energy_quality=b.get("quality", "estimated") if energy is not None else "unavailable",
                    energy_source="model.cpu" if energy is not None else "", energy_scope="cpu_package",
                    best_effort_energy_j=energy, net_energy_j=energy,
                ))
                t += duration + 0.01
    folder.finish(status)
    return folder.path
