"""Loading run folders into per-query frames (the analysis layer's input): a run's records, repeats
averaged per (backend, query) with ``np.bincount`` over integer codes, become a per-query matrix
(backends x queries) aligned across runs. Nothing here computes a metric or renders anything.

Concurrency levels (a serving sweep): a backend whose records hold several ``concurrency`` levels
becomes one backend per level, labeled ``NAME@cN`` (``level_label``), so every per-backend table,
paired comparison and routing works per level; a backend measured at one level keeps its plain name
(its level is still in ``BackendInfo.concurrency``). This is the one place that split is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ipw.analysis.stats import EnergyErrors
from ipw.errors import IpwError
from ipw.results import JudgeEntry, RunManifest, manifest_field
from ipw.telemetry.hardware import machines

LOAD_COLUMNS = ["backend", "model", "role", "query_id", "category", "correct", "error", "completion_tokens",
                "ttft_s", "latency_s", "start_s", "end_s", "energy_j", "energy_quality", "energy_source",
                "prefill_energy_j", "decode_energy_j", "win_tie", "vs_backend", "concurrency", "split_method",
                "node", "mean_logprob"]


@dataclass(frozen=True)
class RunInfo:
    path: str
    run_id: str
    status: str
    dataset: str | None
    fingerprint: str | None
    n_queries: int
    n_records: int
    machines: tuple[dict[str, Any], ...] = ()  # the kinds of machine that measured it (telemetry.hardware.machines)
    energy_audits: tuple[str, ...] = ()  # "backend: line" of each run-level energy audit (telemetry.audit)
    carbon: dict[str, Any] | None = None  # the grid's carbon intensity the run carries (manifest.carbon, ipw.carbon)


@dataclass(frozen=True)
class BackendInfo:
    label: str  # unique across the comparison: the backend name, or run_id/backend when names collide
    run_id: str
    backend: str
    model: str
    role: str
    n_records: int
    energy_quality: str  # worst quality among the records with energy
    energy_qualities: dict[str, int]  # records per quality
    energy_sources: tuple[str, ...]
    vs_backend: str = ""  # the reference backend(s) a judge compared its answers with ("": none judged)
    concurrency: int = 1  # requests in flight at this level of a serving sweep (1: one at a time, older runs)
    split_methods: tuple[str, ...] = ()  # how overlapping requests' energy was split ("": not split, omitted)
    pue: float = 1.0  # the backend's facility overhead (its config's pue; 1.0 unless set), for --energy-basis facility
    pue_source: str = ""  # where that PUE comes from (its config's pue_source; "": not stated)


@dataclass(frozen=True)
class PerQuery:
    """Per-query values, repeats averaged: arrays (n_backends, n_queries), one row per backend (the
    transpose of routing's queries x backends matrix); errors are record counts."""

    query_id: Any  # pandas Index
    category: np.ndarray  # int code per query
    categories: tuple[str, ...]  # names of the codes
    correct: np.ndarray
    energy_j: np.ndarray
    duration_s: np.ndarray
    latency_s: np.ndarray
    ttft_s: np.ndarray
    completion_tokens: np.ndarray
    prompt_tokens: np.ndarray | None
    errors: np.ndarray  # error records per query
    error_share: np.ndarray  # errored records / records
    prefill_energy_j: np.ndarray | None = None  # None when no record of any run has phases
    decode_energy_j: np.ndarray | None = None
    win_tie: np.ndarray | None = None  # vs a reference backend's answer; NaN: not judged; None: no record judged
    # the backend level's wall span (its first start to its last end) / its records: each record's share of
    # the wall clock, so a sum over queries is the span a level's query set took (NaN: no time window, or
    # records of several machines, whose monotonic clocks do not compare)
    wall_share_s: np.ndarray | None = None
    # each query's measurement error of energy_j, 1 sd (J), repeats averaged: independent per window, and
    # shared, by its source (_shared_key: one error for every reading of that source, whichever backend;
    # arrays (backends, queries), 0 where a backend has none of it); None when no record states one (runs
    # made before readings carried uncertainty_j, or read without their parts)
    energy_sd_j: np.ndarray | None = None
    shared_sd_j: dict[str, np.ndarray] | None = None
    # --common-queries: why query_id holds only the queries every backend shares ("": every backend has them all);
    # also one of ``load``'s notes, kept apart so that ``ipw run`` shows it without looking for it by its text
    query_set_note: str = ""
    # the answers' mean log-probability of their output tokens (the local engine's confidence, which the
    # cascade escalates on), repeats averaged; NaN: none given (an error, an engine not asked); None: no
    # record of any run has one
    mean_logprob: np.ndarray | None = None
    # the whole node's energy over each query's window (readings of scope node, ipw.telemetry.node_power),
    # repeats averaged, for --energy-basis node; NaN: no node reading; None: no record of any run has one (or
    # the run is too large for its readings to be read)
    node_energy_j: np.ndarray | None = None


FIELDS = ("correct", "energy_j", "duration_s", "latency_s", "ttft_s", "completion_tokens", "prompt_tokens", "errors",
          "error_share",
          "prefill_energy_j", "decode_energy_j", "win_tie", "wall_share_s", "energy_sd_j",
          "mean_logprob", "node_energy_j")
#: Runs up to this many records have their readings (energy_parts) read for the measurement error of their
#: energy; above it the parts are not read (hundreds of bytes a record) and CIs say they carry none.
#: Parsing them cost 46 µs a record on the 2-core VM at load average 9 (json), so up to ~5 s at this size.
MEASUREMENT_MAX_RECORDS = 100_000


@dataclass
class _Part:
    """One backend of one run, over that run's query ids."""

    run: RunInfo
    info: BackendInfo
    query_id: Any  # pandas Index of the run's query ids (order of first appearance)
    present: np.ndarray  # bool per run query
    category: np.ndarray  # int code per run query
    categories: list[str]
    values: dict[str, Any]  # arrays per query (None: no record has it); shared_sd_j: {source: array}


CATEGORICAL = ["backend", "model", "role", "category", "error", "energy_quality", "energy_source", "vs_backend",
               "split_method", "node"]


def _floats(series: Any) -> np.ndarray:
    floats: np.ndarray = series.to_numpy(dtype=float, na_value=np.nan)
    return floats


def _unscored_kept(failed: np.ndarray, correct: np.ndarray) -> np.ndarray:
    """``correct`` with every failed, scored record at 0 (an unscored one stays NaN)."""
    return np.where(failed & ~np.isnan(correct), 0.0, correct)


def _codes(series: Any, missing: str) -> tuple[np.ndarray, list[str]]:
    """Integer codes and names of a (categorical) column; a missing value gets the name ``missing``."""
    import pandas as pd

    if isinstance(series.dtype, pd.CategoricalDtype):
        codes = series.cat.codes.to_numpy().astype(np.int64)
        names = [str(x) for x in series.cat.categories]
    else:
        codes, uniq = pd.factorize(series)
        names = [str(x) for x in uniq]
    if (codes < 0).any():
        codes = np.where(codes < 0, len(names), codes)
        names.append(missing)
    return codes, names


def level_label(backend: str, concurrency: int) -> str:
    """The label of one concurrency level of a backend measured at several: ``NAME@cN``."""
    return f"{backend}@c{concurrency}"


def concurrency_of(series: Any) -> np.ndarray:
    """The records' concurrency levels as ints (a run made before the field: 1)."""
    x = _floats(series)
    return np.where(np.isnan(x), 1, x).astype(np.int64)


def _levels(bcode: np.ndarray, level: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups of records by (backend, concurrency level), in backend order then ascending level: each
    record's group code, and each group's backend code and level."""
    base = int(level.max()) + 1
    uniq, gcode = np.unique(bcode * base + level, return_inverse=True)
    return gcode.reshape(-1), uniq // base, uniq % base


def _release_arrow_memory() -> None:
    """Hand the memory of freed Arrow buffers back to the system (its pool keeps it otherwise)."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


def _read_run(path: Path, prompt_tokens: bool) -> list[_Part]:
    from ipw.results import load_run

    extra = (["prompt_tokens"] if prompt_tokens else []) + (["energy_parts"] if _small(path) else [])
    manifest, frame = load_run(path, columns=LOAD_COLUMNS + extra, categorical=CATEGORICAL)
    _release_arrow_memory()  # the Arrow table behind the frame is gone: keep the peak low
    return parts_of(path, manifest, frame, prompt_tokens)


def _small(path: Path) -> bool:
    """Whether a run has at most MEASUREMENT_MAX_RECORDS records (a JSONL log, unfinished: assumed so)."""
    from ipw.results import parquet_rows

    rows = parquet_rows(path)
    return rows is None or rows <= MEASUREMENT_MAX_RECORDS


def energy_audits(manifest: RunManifest) -> tuple[str, ...]:
    """Each backend's run-level energy audit as the manifest keeps it (``backends[].energy_audit``), and each
    proxy session's (``ipw serve``: ``backends[].sessions[].energy_audit``, its lines "in session N"), one
    ``"backend: line"`` each; runs made before the audit have none."""
    return tuple(f"{b.name}: {a.get('line') or a.get('error')}" for b in manifest.entries()
                 for audits in [b.energy_audit, *(s.get("energy_audit") for s in b.sessions or ())]
                 for a in audits or [] if a.get("line") or a.get("error"))


def parts_of(path: Path, manifest: RunManifest, frame: Any, prompt_tokens: bool = True) -> list[_Part]:
    """A run's backends with their per-query values (repeats averaged: the one place this is done)."""
    import pandas as pd

    from ipw.telemetry.base import QUALITY_ORDER

    path = Path(path)
    if prompt_tokens and "prompt_tokens" not in frame:
        prompt_tokens = False
    missing = [c for c in LOAD_COLUMNS if c not in frame]  # e.g. phases, in runs made before them: all null
    if missing:
        frame = frame.assign(**{c: None for c in missing})
    dataset = manifest.dataset or {}
    run_id = str(manifest.run_id or path.name)
    if len(frame) == 0:
        raise IpwError(f"{path}: the run has no records")
    qcode, qids = pd.factorize(frame["query_id"])
    bcode, bnames = _codes(frame["backend"], "")
    # one group per backend and concurrency level (a backend at one level: one group)
    gcode, gbackend, glevel = _levels(bcode, concurrency_of(frame["concurrency"]))
    several = np.bincount(gbackend, minlength=len(bnames)) > 1
    run = RunInfo(str(path), run_id, str(manifest.status or "unknown"), dataset.get("name"),
                  dataset.get("fingerprint"), len(qids), len(frame), tuple(machines(manifest)),
                  energy_audits(manifest), _carbon_of(path, manifest))
    nq, nb = len(qids), len(gbackend)
    key = gcode * nq + qcode
    size = nb * nq
    count = np.bincount(key, minlength=size)

    def mean(x: np.ndarray) -> np.ndarray:
        """Per (backend, query): the mean over repeats of the known values (NaN when none is known)."""
        ok = ~np.isnan(x)
        if ok.all():
            return (np.bincount(key, x, size) / count).reshape(nb, nq)
        with np.errstate(invalid="ignore", divide="ignore"):
            return (np.bincount(key, np.where(ok, x, 0.0), size) / np.bincount(key, ok, size)).reshape(nb, nq)

    start, end = _floats(frame["start_s"]), _floats(frame["end_s"])
    per_b = np.bincount(gcode, minlength=nb)
    span = (pd.Series(end).groupby(gcode).max() - pd.Series(start).groupby(gcode).min()).to_numpy(float)
    machines_per_group = pd.Series(_codes(frame["node"], "")[0]).groupby(gcode).nunique().to_numpy()
    span = np.where(machines_per_group > 1, np.nan, span)  # the monotonic clocks of several machines
    values = {
        # an errored record counts incorrect, an unscored one (None: a judge item, failed or not) is left
        # out (ipw.analysis.metrics)
        "correct": mean(_unscored_kept(frame["error"].notna().to_numpy(), _floats(frame["correct"]))),
        "energy_j": mean(_floats(frame["energy_j"])),
        "duration_s": mean(end - start),
        "latency_s": mean(_floats(frame["latency_s"])),
        "ttft_s": mean(_floats(frame["ttft_s"])),
        "completion_tokens": mean(_floats(frame["completion_tokens"])),
        "prompt_tokens": mean(_floats(frame["prompt_tokens"])) if prompt_tokens else None,
        "errors": np.bincount(key, frame["error"].notna().to_numpy(), size).reshape(nb, nq),
        "error_share": mean(frame["error"].notna().to_numpy(float)),
        "wall_share_s": np.where(count.reshape(nb, nq) > 0, (span / per_b)[:, None], np.nan),
    }
    for name in ("prefill_energy_j", "decode_energy_j", "win_tie", "mean_logprob"):  # None in runs made before them
        x = _floats(frame[name])
        values[name] = None if np.isnan(x).all() else mean(x)
    values["energy_sd_j"] = values["node_energy_j"] = None
    shared_sd: dict[str, np.ndarray] = {}  # by source (_shared_key): (backends, queries)
    if "energy_parts" in frame:  # the node's energy (--energy-basis node): only records with a node reading parsed
        node = _node_energy(frame["energy_parts"].astype(object))
        values["node_energy_j"] = None if np.isnan(node).all() else mean(node)
    if "energy_parts" in frame:  # measurement error: a mean of k repeats has sqrt(sum sd^2) / k, shared sd / k
        from ipw.telemetry.uncertainty import measurement_by_source

        texts = frame["energy_parts"].astype(object)
        stated = texts.str.contains('"uncertainty_j": [-0-9]', regex=True, na=False).to_numpy()
        sd = np.zeros(len(texts))
        by_source: dict[str, np.ndarray] = {}  # per record
        if stated.any():  # records made before readings stated it are skipped unparsed
            nodes = frame["node"].astype(object).to_numpy()
            backend_of = frame["backend"].astype(object).to_numpy()
            coefficients = _cpu_model_coefficients(manifest)
            for i in np.flatnonzero(stated):
                sd[i], shared = measurement_by_source(texts.iloc[i])
                for (scope, source), s in shared.items():
                    name = _shared_key(scope, source, nodes[i], run_id, str(backend_of[i]), coefficients)
                    by_source.setdefault(name, np.zeros(len(texts)))[i] += s
        e_ok = ~np.isnan(_floats(frame["energy_j"]))
        if (sd[e_ok] > 0).any() or any((x[e_ok] > 0).any() for x in by_source.values()):
            k = np.bincount(key, e_ok, size)
            with np.errstate(invalid="ignore", divide="ignore"):
                values["energy_sd_j"] = (np.sqrt(np.bincount(key, np.where(e_ok, sd ** 2, 0.0), size)) / k
                                         ).reshape(nb, nq)
                shared_sd = {name: (np.bincount(key, np.where(e_ok, x, 0.0), size) / k).reshape(nb, nq)
                             for name, x in by_source.items()}
    ccode, cnames = _codes(frame["category"], "")
    category = np.zeros(nq, np.int64)
    category[qcode] = ccode
    has_e = frame["energy_j"].notna().to_numpy()
    first = [int(np.argmax(gcode == g)) for g in range(nb)]  # the group's first record
    models = [str(frame["model"].iloc[i]) for i in first]
    judged_vs = frame["vs_backend"].astype(object).where(frame["win_tie"].notna())
    vs = [", ".join(sorted({str(x) for x in judged_vs[gcode == g].dropna() if x})) for g in range(nb)]
    split = frame["split_method"].astype(object)
    splits = [tuple(sorted({str(x) for x in split[gcode == g].dropna() if x})) for g in range(nb)]
    roles = [str(frame["role"].iloc[i]) for i in first]
    qual_code, qual_names = _codes(frame["energy_quality"], "unavailable")
    src_code, src_names = _codes(frame["energy_source"], "")
    qual_counts = np.bincount(gcode[has_e] * len(qual_names) + qual_code[has_e],
                              minlength=nb * len(qual_names)).reshape(nb, len(qual_names))
    src_counts = np.bincount(gcode[has_e] * len(src_names) + src_code[has_e],
                             minlength=nb * len(src_names)).reshape(nb, len(src_names))
    del frame
    facility = _pue_of(path, manifest)
    parts = []
    for g in range(nb):
        name, level = bnames[gbackend[g]], int(glevel[g])
        quals = {qual_names[i]: int(qual_counts[g, i]) for i in range(len(qual_names)) if qual_counts[g, i]}
        known = [q for q in quals if q in QUALITY_ORDER]
        info = BackendInfo(
            label=level_label(name, level) if several[gbackend[g]] else name, run_id=run_id, backend=name,
            model=models[g], role=roles[g], vs_backend=vs[g], concurrency=level, split_methods=splits[g],
            n_records=int(per_b[g]),
            energy_quality=max(known, key=QUALITY_ORDER.index) if known else "unavailable",
            energy_qualities=quals,
            energy_sources=tuple(src_names[i] for i in range(len(src_names)) if src_counts[g, i] and src_names[i]),
            pue=facility.get(name, (1.0, ""))[0], pue_source=facility.get(name, (1.0, ""))[1],
        )
        mine = {name: x[g] for name, x in shared_sd.items() if np.nan_to_num(x[g]).any()}
        parts.append(_Part(run, info, qids, count.reshape(nb, nq)[g] > 0, category, cnames,
                           {**{k: (None if v is None else v[g]) for k, v in values.items()},
                            "shared_sd_j": mine or None}))
    return parts


def _cpu_model_coefficients(manifest: RunManifest) -> dict[str, str]:
    """Each backend's CPU model coefficient as its manifest states it (``W/core``, and what it rests on)."""
    out = {}
    for b in manifest.entries():
        for sensor in b.sensors or ():
            params = sensor.get("params") or {}
            if sensor.get("source") == "model.cpu" and isinstance(params, dict) and params.get("watts_per_core") is not None:
                out[b.name] = f"{params['watts_per_core']} W/core ({params.get('basis', '')})"
    return out


def _shared_key(scope: str, source: str, node: Any, run_id: str, backend: str, coefficients: dict[str, str]) -> str:
    """The key of a shared error (``ipw.telemetry.uncertainty.measurement_by_source``): readings with one key
    have one error, drawn once per resample (``ipw.analysis.stats``).  The machine's (a device's own bias, the
    CPU model's coefficient) is keyed by the record's ``node`` and, for the CPU model, the coefficient its
    backend's manifest states; a sensor session's (one backend's calibration), or one whose record does not
    say its machine or coefficient, by the run and backend: drawn apart from every other backend."""
    from ipw.telemetry.uncertainty import CPU_MODEL_SOURCE, MACHINE

    machine = str(node) if isinstance(node, str) and node else ""
    if scope == MACHINE and machine:
        if source != CPU_MODEL_SOURCE:
            return f"{machine} {source}"
        if backend in coefficients:
            return f"{machine} {source} {coefficients[backend]}"
    return f"{run_id}/{backend} {source}"


def _node_energy(texts: Any) -> np.ndarray:
    """Each record's node energy (J): its readings of scope ``node`` summed (NaN: none, or one unavailable)."""
    import json

    out = np.full(len(texts), np.nan)
    has = texts.str.contains('"scope": "node"', regex=False, na=False).to_numpy()
    for i in np.flatnonzero(has):
        found = [p.get("energy_j") for p in json.loads(texts.iloc[i]) if p.get("scope") == "node"]
        if found and all(isinstance(e, (int, float)) for e in found):
            out[i] = float(sum(found))
    return out


def _pue_of(path: Path, manifest: RunManifest) -> dict[str, tuple[float, str]]:
    """Each configured backend's PUE and its stated source (``pue``, ``pue_source`` in its config table); a
    PUE that ipw would not have written (hand-edited: negative, NaN, below 1) is an IpwError naming the file
    and field, never used."""
    from ipw.carbon import bounded
    from ipw.limits import MAX_PUE, check_range

    out = {}
    for i, b in enumerate((manifest.config or {}).get("backends") or []):
        options = b.get("options") or {} if isinstance(b, dict) else {}
        if options.get("pue") is not None:
            check_range(options["pue"], manifest_field(path, f"config.backends[{i}].options.pue"),
                        low=1.0, high=MAX_PUE)
            out[str(b.get("name"))] = (float(options["pue"]), bounded(options.get("pue_source")))
    return out


def _carbon_of(path: Path, manifest: RunManifest) -> dict[str, Any] | None:
    """The run's carbon intensity record (``manifest.carbon``); one that ipw would not have written
    (hand-edited: a negative, NaN or huge intensity) is an IpwError naming the file and field, never used."""
    from ipw.carbon import check_intensity

    carbon = manifest.carbon
    if isinstance(carbon, dict) and carbon.get("g_per_kwh") is not None:
        check_intensity(carbon["g_per_kwh"], manifest_field(path, "carbon.g_per_kwh"))
    return carbon


def energy_errors(pq: PerQuery) -> EnergyErrors | None:
    """Every backend's measurement errors of energy (``ipw.analysis.stats.EnergyErrors``); None when no
    record states one."""
    if pq.energy_sd_j is None and pq.shared_sd_j is None:
        return None
    sd = np.nan_to_num(pq.energy_sd_j) if pq.energy_sd_j is not None else np.zeros_like(pq.energy_j)
    has = ~np.isnan(pq.energy_j)
    return EnergyErrors(np.where(has, sd, 0.0), {k: np.where(has, x, 0.0) for k, x in (pq.shared_sd_j or {}).items()})


def take(values: dict[str, Any], items: np.ndarray) -> dict[str, Any]:
    """One backend's per-query values (``_Part.values``) at ``items`` (indices)."""
    return {k: (None if x is None else {s: y[items] for s, y in x.items()} if isinstance(x, dict) else x[items])
            for k, x in values.items()}


def judge_lines(run: RunInfo) -> list[JudgeEntry]:
    """A judged run's ``judge.jsonl`` entries (one per record: the judge, its grading and prompt version,
    verdicts, calls and its own energy); [] for a run no judge graded."""
    from ipw.results import read_judge

    return read_judge(run.path)


def _query_set_error(parts: list[_Part]) -> str | None:
    runs = {p.run.run_id: p.run for p in parts}
    prints = {r.fingerprint for r in runs.values() if r.fingerprint}
    if len(prints) > 1:
        desc = "; ".join(f"{r.run_id}: {r.dataset or '?'}, {r.n_queries} queries, {r.fingerprint}"
                         for r in runs.values())
        return f"the runs measure different query sets (dataset fingerprints differ: {desc})"
    full = max(len(p.query_id) for p in parts)
    for p in parts:
        have = int(p.present.sum())
        if have < full:
            return (f"backend {p.info.label!r} of run {p.run.run_id} ({p.run.status}) has {have} of the {full} "
                    "queries")
    if len({id(p.query_id) for p in parts}) > 1:
        first = parts[0].query_id
        for p in parts[1:]:
            if not (p.query_id.equals(first) or (len(p.query_id) == len(first) and
                                                 len(first.intersection(p.query_id)) == len(first))):
                return f"run {p.run.run_id} has other query ids than run {parts[0].run.run_id}"
    return None


def load(paths: Sequence[str | Path], *, common_queries: bool = False,
         prompt_tokens: bool = False) -> tuple[tuple[RunInfo, ...], tuple[BackendInfo, ...], PerQuery, list[str]]:
    """Read run folders into one per-query matrix; refuse different query sets unless ``common_queries``."""
    if not paths:
        raise IpwError("give at least one run folder")
    parts: list[_Part] = []
    seen: dict[str, str] = {}
    for path in map(Path, paths):
        new = _read_run(path, prompt_tokens)
        rid = new[0].run.run_id
        if rid in seen:
            raise IpwError(f"{path}: run {rid} is given twice (also {seen[rid]})")
        seen[rid] = str(path)
        parts += new
    notes: list[str] = []
    for run in {p.run.run_id: p.run for p in parts}.values():
        if run.status != "complete":
            notes.append(f"run {run.run_id} is unfinished ({run.status}): its numbers cover the {run.n_records} "
                         f"records written so far; ipw run --resume {run.path} completes it")
        notes += [f"run {run.run_id}, {line}" for line in run.energy_audits]
    problem = _query_set_error(parts)
    if problem and not common_queries:
        raise IpwError(f"{problem}; compare them on the queries they share with --common-queries")
    # labels: the backend's (NAME or NAME@cN), or run_id/that where it occurs in several runs
    names = [p.info.label for p in parts]
    for p in parts:
        if names.count(p.info.label) > 1:
            p.info = BackendInfo(**{**p.info.__dict__, "label": f"{p.info.run_id}/{p.info.label}"})
    # the queries every backend has, in the first run's order
    universe = parts[0].query_id
    for p in parts:
        if not (p.present.all() and (p.query_id is universe or p.query_id.equals(universe))):
            universe = universe.intersection(p.query_id[p.present], sort=False)
    if len(universe) == 0:
        raise IpwError("the runs share no query: nothing to compare")
    query_set_note = ""
    if problem:
        sizes = ", ".join(f"{p.info.label}: {int(p.present.sum())}" for p in parts)
        query_set_note = (f"--common-queries: compared on the {len(universe)} queries all backends share "
                          f"({problem}; queries per backend: {sizes})")
        notes.append(query_set_note)
    positions: dict[int, np.ndarray | None] = {}
    for p in parts:
        if id(p.query_id) not in positions:
            positions[id(p.query_id)] = None if p.query_id.equals(universe) else p.query_id.get_indexer(universe)

    def aligned(p: _Part, v: np.ndarray) -> np.ndarray:
        pos = positions[id(p.query_id)]
        return v if pos is None else v[pos]

    categories = sorted({c for p in parts for c in p.categories})
    first = parts[0]
    category = np.searchsorted(categories, np.asarray(first.categories, dtype=object))[aligned(first, first.category)]
    n, m = len(universe), len(parts)
    out: dict[str, Any] = {}  # None: no record of any run has the field
    for name in FIELDS:
        if all(p.values[name] is None for p in parts):
            out[name] = None
            continue
        mat = np.empty((m, n))
        for j, p in enumerate(parts):
            v = p.values.pop(name)
            mat[j] = np.nan if v is None else aligned(p, v)
        out[name] = mat
    shared: dict[str, np.ndarray] = {}
    for j, p in enumerate(parts):
        for name, x in (p.values.pop("shared_sd_j") or {}).items():
            shared.setdefault(name, np.zeros((m, n)))[j] = np.nan_to_num(aligned(p, x))
    pq = PerQuery(query_id=universe, category=category, categories=tuple(categories), query_set_note=query_set_note,
                  shared_sd_j=shared or None, **out)
    runs = tuple({p.run.run_id: p.run for p in parts}.values())
    return runs, tuple(p.info for p in parts), pq, notes
