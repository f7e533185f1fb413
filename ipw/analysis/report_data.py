"""``ipw report``'s data: the records of the compared runs (with compare's labels), what was run and on
what (from the manifests), compare's tables with their estimated-energy marks, the costliest and wrong
answers, and a run's power trace.  Read through :mod:`ipw.results` only; numbers come from
:mod:`ipw.analysis.compare`.  Plots are in :mod:`ipw.analysis.report_plots`, the page in
:mod:`ipw.analysis.report`."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from ipw.analysis import fmt

MAX_ROWS = 20  # rows of the costliest / wrong answer tables
MAX_TEXT = 1200  # characters of a prompt, reference or output shown
RECORD_COLUMNS = ["backend", "query_id", "category", "repeat", "correct", "prompt_tokens", "completion_tokens",
                  "start_s", "end_s", "energy_j", "concurrency"]
OVERHEAD = fmt.Format(percent=True, digits=2)  # a sampler's share of one core, e.g. 0.35%
TEXT_COLUMNS = ["prompt", "answer", "output", "error"]  # read only for the rows the answer tables show


def load_records(runs: Any, labels: dict[tuple[str, str, int], str]) -> Any:
    """Every run's records (the report's columns) with the compare label of their backend (and
    concurrency level: ``labels`` maps (run_id, backend, concurrency) to it)."""
    import pandas as pd

    from ipw.analysis.load import concurrency_of
    from ipw.results import load_run

    frames, manifests = [], []
    for run in runs:
        manifest, frame = load_run(run.path, columns=RECORD_COLUMNS, categorical=["backend", "category"])
        level = concurrency_of(frame["concurrency"])
        frame = frame.assign(run_id=run.run_id, row=np.arange(len(frame)), concurrency=level,
                             label=pd.Series(_labels(run.run_id, frame["backend"], level, labels), index=frame.index,
                                             dtype=object))
        frames.append(frame)
        manifests.append((run, manifest))
    frame = pd.concat(frames, ignore_index=True)
    frame["category"] = frame["category"].astype(str).replace({"None": "", "nan": ""})
    frame["correct"] = pd.to_numeric(frame["correct"], errors="coerce")  # NaN: unscored (in no mean, never wrong)
    for col in ("energy_j", "start_s", "end_s", "prompt_tokens", "completion_tokens"):
        frame[col] = pd.to_numeric(frame[col], errors="coerce")
    return manifests, frame


def _labels(run_id: str, backend: Any, level: np.ndarray, labels: dict[tuple[str, str, int], str]) -> np.ndarray:
    """Each record's compare label, looked up once per (backend, level) pair, not once per record."""
    import pandas as pd

    codes, names = pd.factorize(backend)
    base = int(level.max()) + 1 if len(level) else 1
    pairs, inverse = np.unique(codes * base + level, return_inverse=True)
    names = [str(n) for n in names]
    per_pair = [labels.get((run_id, names[p // base], int(p % base)), names[p // base]) for p in pairs]
    return np.asarray(per_pair, dtype=object)[inverse.reshape(-1)]


def _clip(text: Any, limit: int = MAX_TEXT) -> str:
    text = "" if text is None or (isinstance(text, float) and math.isnan(text)) else str(text)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit:,} more characters)"


def _value(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return json.dumps(v, ensure_ascii=False, default=str)
    return "n/a" if v is None else str(v)


def setup_sections(manifests: Any) -> list[dict[str, Any]]:
    """What was run and on what: per run, the manifest's dataset, hardware, software and backends."""
    from ipw.results import sampler_overheads

    out = []
    for run, m in manifests:
        config = m.config or {}
        ds = m.dataset or {}
        packages = (m.software or {}).get("packages") or {}
        run_rows = [
            ("run", run.run_id), ("status", m.status or "unknown"),
            ("command", " ".join(map(str, m.command or [])) or "n/a"),
            ("config", config.get("source", "n/a")),
            ("dataset", f"{ds.get('name', 'n/a')} ({ds.get('n_queries', '?')} queries, "
                        f"fingerprint {ds.get('fingerprint', 'n/a')})"),
            ("records", f"{run.n_records:,}"),
            ("started / finished", f"{m.started_at or 'n/a'} / {m.finished_at or 'n/a'}"),
            ("generation", _value(config.get("generation", "n/a"))),
            ("repeats / warm-up / idle s", f"{config.get('repeats', 'n/a')} / {config.get('warmup', 'n/a')} / "
                                           f"{config.get('idle_s', 'n/a')}"),
        ]
        hardware = [(k, _value(v)) for k, v in (m.hardware or {}).items()]
        software = [(k, _value(v)) for k, v in (m.software or {}).items() if k != "packages"]
        software.append(("packages", ", ".join(f"{k} {v}" for k, v in packages.items() if v) or "n/a"))
        backends = []
        for b in m.entries():
            sensors = [{"name": s.get("name", "?"), "source": s.get("source", "?"), "quality": s.get("quality", "?"),
                        "scope": s.get("scope", "?"), "available": s.get("available", True),
                        "detail": s.get("detail") or ""} for s in b.sensors or ()]
            idle = b.idle_baseline or {}
            spread = idle.get("spread_w") or {}
            idle_text = ", ".join(f"{c}: {fmt.value(w)} ± {fmt.value(spread.get(c))} W"
                                  for c, w in (idle.get("power_w") or {}).items())
            idle_text = (f"{idle_text} over {fmt.value(idle.get('duration_s'))} s" if idle_text
                         else "not measured (idle s = 0)")
            overhead = [f"{name}: {fmt.value(o.cpu_fraction_of_one_core, OVERHEAD)} of one core "
                        f"({fmt.value(o.cpu_s)} CPU s over {fmt.value(o.wall_s)} s)"
                        for name, o in sampler_overheads(b.to_json()).items()]
            engine = b.details  # what the backend said of itself
            info = [("kind / model", f"{b.kind or 'n/a'} / {b.model or 'n/a'}"), ("role", b.role or "n/a"),
                    ("engine", f"{engine.get('engine', 'n/a')} {engine.get('engine_version') or ''}".strip()),
                    ("mode", _value(engine.get("mode"))), ("load s", fmt.value(b.load_s)),
                    ("model file", _value(engine.get("model_file")))]
            backends.append({"name": b.name, "info": info, "sensors": sensors, "idle": idle_text,
                             "estimated_idle": any(s["quality"] == "estimated" for s in sensors),
                             "overhead": "; ".join(overhead)})
        out.append({"run_id": run.run_id, "run": run_rows, "hardware": hardware, "software": software,
                    "backends": backends})
    return out


def marked_tables(c: Any) -> list[dict[str, Any]]:
    """compare's tables, each cell with its estimated-energy flag (from ``ipw.analysis.render``)."""
    from ipw.analysis.render import tables

    out = []
    for t in tables(c):
        cells = [[{"text": text, "est": est} for text, est in zip(row, marks)] for row, marks in zip(t.rows, t.est)]
        out.append({"title": t.title, "headers": t.headers, "rows": cells, "key": t.key, "section": t.section,
                    "has_est": any(x["est"] for r in cells for x in r)})
    return out


def _texts(runs: Any, rows: Any) -> dict[tuple[str, int], dict[str, Any]]:
    """Prompt, reference, output and error of the given records (run_id, row), read for those rows only."""
    from ipw.results import read_record_fields

    out = {}
    for run in runs:
        want = sorted({int(r) for rid, r in zip(rows["run_id"], rows["row"]) if rid == run.run_id})
        if not want:
            continue
        values = read_record_fields(run.path, want, TEXT_COLUMNS)
        for i, r in enumerate(want):
            out[(run.run_id, r)] = {c: values[c][i] for c in TEXT_COLUMNS}
    return out


def _answer_table(rows: Any, texts: Any, total: int, what: str, est: dict[str, bool]) -> dict[str, Any]:
    shown = len(rows)
    return {
        "note": (f"showing the {shown} costliest of {total:,} {what}" if total > shown
                 else f"all {total:,} {what}"),
        "rows": [{
            "label": r.label, "query_id": str(r.query_id), "category": r.category or "-", "repeat": r.repeat,
            "correct": fmt.value(r.correct), "energy": fmt.value(r.energy_j), "est": est.get(r.label, False),
            "tokens": fmt.value(r.completion_tokens, fmt.COUNT),
            **{k: _clip(v) for k, v in texts[(r.run_id, r.row)].items()},
        } for r in rows.itertuples()],
    }


def costliest(runs: Any, frame: Any, est: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The costliest answers, and the costliest wrong or failed ones, at most ``MAX_ROWS`` each."""
    import pandas as pd

    top = frame.loc[frame["energy_j"].fillna(-np.inf).nlargest(MAX_ROWS).index]
    wrong = frame["correct"] < 0.5
    wtop = frame[wrong].loc[lambda f: f["energy_j"].fillna(-np.inf).nlargest(MAX_ROWS).index]
    texts = _texts(runs, pd.concat([top, wtop]))
    return (_answer_table(top, texts, len(frame), "answers (by energy)", est),
            _answer_table(wtop, texts, int(wrong.sum()), "wrong or failed answers (by energy)", est))


def read_power_trace(run_dir: Any) -> Any:
    """t_s, device and power_w of the points of a run's power.parquet that carry watts (None when none does)."""
    from ipw.results import read_power

    power = read_power(run_dir, columns=["t_s", "device", "power_w"])
    if power is None or not {"t_s", "power_w"} <= set(power.columns):
        return None
    power = power[np.isfinite(power["power_w"].to_numpy(float)) & np.isfinite(power["t_s"].to_numpy(float))]
    if "device" not in power:
        power = power.assign(device="power")
    return None if power.empty else power
