"""Run a query set through backends: warm-up, idle baseline, one measured window per query, scoring,
and a record appended to the run folder after every query."""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from dataclasses import asdict
from typing import Any, Callable

import numpy as np

from ipw import __version__
from ipw.backends.base import Backend, BackendSpec, Completion, QueryError, create_backend
from ipw.backends.worker import EngineStopped
from ipw.config import RunConfig
from ipw.datasets import Query, fingerprint, load_queries
from ipw.errors import IpwError
from ipw.phases import first_token_s, record_phases, sensor_splits
from ipw.results import QueryRecord, RunFolder, RunManifest, new_run_id
from ipw.scoring import record_score
from ipw.shard import Shard, shard_items
from ipw.telemetry.base import EnergyReading, Sensor, total_energy, worst_quality
from ipw.telemetry.hardware import node_identity
from ipw.telemetry.probe import default_probe
from ipw.telemetry.window import Closed, IdleBaseline, Window, measure_idle, with_estimate


def make_record(
    run_id: str, spec: BackendSpec, query: Query, repeat: int, completion: Completion | None,
    error: Exception | None, start_s: float, end_s: float, readings: list[EnergyReading], *, idle: IdleBaseline,
    estimate: Any = None, busy_s: float | None = None, splits: Callable[[], dict[str, Any]] | None = None,
) -> QueryRecord:
    """``estimate``: a remote endpoint's ApiEnergyEstimate (adds its ``estimate.api`` reading);
    ``busy_s``: the window's share of time when concurrent requests split it (for the idle part);
    ``splits``: each component's split at the first token (``ipw.phases.sensor_splits``), called now
    that the readings are final.  The record names the machine that measured it (``node_identity``)."""
    identity = node_identity()[0]
    duration = end_s - start_s
    ok = error is None and completion is not None
    readings = with_estimate(readings, estimate, completion.completion_tokens if ok else 0, ok, duration)
    total = total_energy(readings)
    net = None
    if total.energy_j is not None:
        basis = {r.component for r in readings if r.source in total.source.split("+") and r.energy_j is not None}
        net = total.energy_j - sum(idle.power_w.get(c, 0.0) for c in basis) * (duration if busy_s is None else busy_s)
    output = completion.text if completion else ""
    correct = record_score(query.scorer, output, query.answer, query.choices, error is not None)
    return QueryRecord(
        run_id=run_id, backend=spec.name, model=spec.model, role=spec.role, query_id=query.id,
        category=query.category, repeat=repeat, scorer=query.scorer, prompt=query.render(), answer=query.answer,
        output=output, correct=correct,
        error=None if error is None else f"{type(error).__name__}: {error}",
        error_category=None if error is None else getattr(error, "category", "backend_error"),
        prompt_tokens=completion.prompt_tokens if completion else 0,
        completion_tokens=completion.completion_tokens if completion else 0,
        ttft_s=completion.ttft_s if completion else None,
        latency_s=completion.latency_s if completion else duration,
        start_s=start_s, end_s=end_s,
        energy_j=total.energy_j, energy_quality=total.quality, energy_source=total.source,
        energy_scope=total.scope, best_effort_energy_j=total.best_effort_j, net_energy_j=net,
        energy_parts=json.dumps([asdict(r) for r in readings]),
        **record_phases(readings, splits() if splits is not None else {}),
        node=identity.node, hardware_id=identity.hardware_id, choices=tuple(query.choices or ()),
    )


def _generate(backend: Backend, query: Query, config: RunConfig) -> tuple[Completion | None, Exception | None]:
    """One query; a failure becomes the error of its record, never a crash (user errors and a stopped
    engine still stop)."""
    try:
        return backend.generate(query.render(), config.generation), None
    except IpwError:  # EngineStopped included
        raise
    except Exception as exc:
        return None, exc


ProbeFn = Callable[[Backend], list[Sensor]]


def run_backend(
    folder: RunFolder, config: RunConfig, spec: BackendSpec, queries: list[Query],
    progress: Callable[[QueryRecord], None], probe: ProbeFn = default_probe,
    done: frozenset[tuple[str, str, int]] = frozenset(),
) -> dict[str, Any] | None:
    """Run every query (× repeats) through one backend, skipping ``done`` (backend, query, repeat)
    keys; returns what the manifest records about the backend, or None when nothing was left."""
    work = [(r, q) for r in range(config.repeats) for q in queries if (spec.name, q.id, r) not in done]
    if not work:
        return None
    backend = create_backend(spec)
    if hasattr(backend, "attach"):
        backend.attach(folder.path)  # e.g. a managed server's log goes into the run folder
    t0 = time.monotonic()
    try:
        backend.load()
    except EngineStopped as exc:  # the engine's worker died while loading: this backend stops, others go on
        backend.close()
        return {"name": spec.name, "kind": spec.kind, "model": spec.model, "role": spec.role, "stopped": str(exc)}
    load_s = time.monotonic() - t0
    sensors = probe(backend)
    window = Window(sensors)
    stopped = None
    try:
        pending: list[tuple[Closed, Callable[[list[EnergyReading]], QueryRecord]]] = []

        def flush(wait: bool) -> None:
            # records are appended in query order as soon as their energy is final
            while pending and (wait or pending[0][0].ready()):
                closed, build = pending.pop(0)
                record = build(closed.readings())
                folder.append(record)
                progress(record)

        try:
            for query in queries[: config.warmup]:
                try:
                    backend.generate(query.render(), config.generation)
                except QueryError:
                    pass  # a failed warm-up query (e.g. a flaky endpoint) is not measured anyway
            idle = measure_idle(window, config.idle_s) if config.idle_s > 0 else IdleBaseline({}, {}, 0.0)
            if getattr(backend, "concurrency", 1) > 1:
                run_concurrent(folder, config, spec, backend, window, idle, work, progress)
                work = []
            for repeat, query in work:
                tokens = window.begin()
                start = time.monotonic()
                completion, error = _generate(backend, query, config)
                end = time.monotonic()
                closed = window.end(tokens)
                pending.append((closed, functools.partial(
                    make_record, folder.manifest.run_id, spec, query, repeat, completion, error, start, end,
                    idle=idle, estimate=getattr(backend, "energy_estimate", None),
                    splits=functools.partial(sensor_splits, sensors, tokens, closed.parts, first_token_s(completion)))))
                flush(wait=False)
                if getattr(error, "category", None) == "engine_crash" and hasattr(backend, "recover"):
                    backend.recover()  # a new worker, outside any window; EngineStopped after MAX_RESTARTS
        except EngineStopped as exc:
            stopped = str(exc)
        finally:  # on Ctrl-C too: every finished query gets its record
            flush(wait=True)
        for sensor in sensors:
            if hasattr(sensor, "trace"):
                folder.add_power(spec.name, sensor.trace())
        return {
            "name": spec.name, "kind": spec.kind, "model": spec.model, "role": spec.role,
            "load_s": round(load_s, 3), **backend.describe(),
            "sampler_overhead": {s.name: s.overhead() for s in sensors if hasattr(s, "overhead")},
            "sensors": [asdict(s.info()) for s in sensors] + (
                [asdict(backend.energy_estimate.info())] if getattr(backend, "energy_estimate", None) else []),
            "idle_baseline": asdict(idle),
            **({"stopped": stopped} if stopped else {}),
        }
    finally:
        for sensor in sensors:
            sensor.close()
        backend.close()


class _Segments:
    """Non-overlapping sensor windows, cut at every request's start and end while requests overlap.

    Each segment's energy is split among the requests active in it, weighted by the tokens each one
    produced in it (equally when none produced any), so the requests' parts sum to what the sensors
    measured (DESIGN.md §3).  Time with no request in flight is not measured.
    """

    def __init__(self, window: Window) -> None:
        self.window = window
        self.lock = threading.Lock()
        self.active: set[int] = set()
        self.token: Any = None
        self.opened_s = 0.0
        self.closed: list[tuple[float, float, Closed, frozenset[int]]] = []  # start, end, window, active

    def event(self, add: int | None = None, remove: int | None = None) -> float:
        with self.lock:
            now = time.monotonic()
            if self.token is not None:
                self.closed.append((self.opened_s, now, self.window.end(self.token), frozenset(self.active)))
                self.token = None
            if add is not None:
                self.active.add(add)
            self.active.discard(remove)
            if self.active:
                self.token, self.opened_s = self.window.begin(), now
            return now

    def of(self, job: int) -> list[tuple[float, float, Closed, frozenset[int]]]:
        with self.lock:
            return [seg for seg in self.closed if job in seg[3]]

    def release(self, done_through: int) -> set[int]:
        """Forget the segments of requests up to ``done_through`` (recorded, in job order), so that a long
        run holds only the segments of requests in flight; returns the jobs those still involve."""
        with self.lock:
            self.closed = [seg for seg in self.closed if max(seg[3]) > done_through]
            return set().union(*(seg[3] for seg in self.closed))


def _split_share(job: int, segs: list[tuple[float, float, Closed, frozenset[int]]], futures) -> tuple[list[EnergyReading], float]:
    """This request's share of each component's energy over its segments (which tile its window),
    split by ``estimator.split_concurrent`` among the requests active in each; and its busy seconds."""
    from ipw.telemetry.estimator import Request, split_concurrent

    if not segs:
        return [], 0.0
    peers = sorted(set().union(*(seg[3] for seg in segs)))
    requests = []
    for j in peers:
        completion, _, start, end = futures[j].result()
        requests.append(Request(start, end, completion.token_times_s if completion else ()))
    me = peers.index(job)
    edges = np.array([seg[0] for seg in segs] + [segs[-1][1]])
    busy_s = split_concurrent(edges, np.diff(edges), requests).per_request_j[me]  # time, split the same way
    by_component: dict[str, list[EnergyReading]] = {}
    for seg in segs:
        for r in seg[2].readings():
            by_component.setdefault(r.component, []).append(r)
    readings = []
    for component, rs in by_component.items():
        missing = len(rs) != len(segs) or any(r.energy_j is None for r in rs)
        share = None if missing else split_concurrent(edges, [r.energy_j for r in rs], requests).per_request_j[me]
        readings.append(EnergyReading(
            component=component, energy_j=share, source=rs[0].source, scope=rs[0].scope,
            quality="unavailable" if missing else worst_quality([r.quality for r in rs]),
            duration_s=float(edges[-1] - edges[0]),
            note=f"share of {len(segs)} segment(s) split among {len(peers)} overlapping request(s) by tokens produced",
        ))
    return readings, busy_s


def run_concurrent(
    folder: RunFolder, config: RunConfig, spec: BackendSpec, backend: Backend, window: Window,
    idle: IdleBaseline, work: list[tuple[int, Query]], progress: Callable[[QueryRecord], None],
) -> None:
    """Keep ``backend.concurrency`` requests in flight; every request has its own window
    ([start, end] in its record) and its split of the energy measured while it ran.  Records are
    appended in query order."""
    from concurrent.futures import ThreadPoolExecutor

    segments = _Segments(window)
    estimate = getattr(backend, "energy_estimate", None)

    def one(job: int, query: Query) -> tuple[Completion | None, Exception | None, float, float]:
        start = segments.event(add=job)
        try:
            completion, error = _generate(backend, query, config)
        finally:
            end = segments.event(remove=job)
        return completion, error, start, end

    pool = ThreadPoolExecutor(max_workers=backend.concurrency, thread_name_prefix="ipw-request")
    futures = {i: pool.submit(one, i, query) for i, (_, query) in enumerate(work)}
    kept: list[int] = []  # recorded requests whose results a later record's energy split may still need
    try:
        for job, (repeat, query) in enumerate(work):
            completion, error, start, end = futures[job].result()
            readings, busy_s = _split_share(job, segments.of(job), futures)
            record = make_record(folder.manifest.run_id, spec, query, repeat, completion, error, start, end,
                                 readings, idle=idle, estimate=estimate, busy_s=busy_s)
            folder.append(record)
            progress(record)
            # memory stays flat over long runs: drop what no later record needs (docs/RELIABILITY.md)
            needed = segments.release(job)
            for j in kept + [job]:
                if j not in needed:
                    del futures[j]
            kept = [j for j in kept + [job] if j in needed]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _load_full(config: RunConfig) -> list[Query]:
    """The run's full query set: the dataset with its options, cut to ``limit``."""
    queries = load_queries(config.dataset, **config.dataset_options())
    return queries[: config.limit] if config.limit else queries


def _dataset_entry(config: RunConfig, queries: list[Query]) -> dict[str, Any]:
    return {"name": config.dataset, "n_queries": len(queries), "fingerprint": fingerprint(queries),
            "categories": sorted({q.category for q in queries})}


def start_run(config: RunConfig, command: list[str] | None = None,
              shard: Shard | None = None) -> tuple[RunFolder, list[Query]]:
    """Validate everything that can be validated before any model loads, then create the folder.

    ``shard``: run only that shard of the query set (``ipw.shard``); the folder's ``dataset`` then
    describes the shard's queries and ``shard`` names the full set, which ``ipw merge`` restores."""
    from ipw.telemetry.hardware import software_fingerprint

    queries = full = _load_full(config)
    if shard is not None:
        queries = shard_items(full, shard)
    for spec in config.backends:
        backend = create_backend(spec)  # resolves the model file: a missing one fails here, before the run
        if hasattr(backend, "preflight"):
            backend.preflight()  # e.g. an engine build this CPU cannot run: one line, before the folder
    if config.judge is not None:  # the judge grades the finished run: its prompt and model fail here, not after
        from ipw.judge import Judge

        Judge(config.judge)  # reads the prompt and resolves the model; loads nothing
    run_id = new_run_id()
    identity, hardware = node_identity()
    folder = RunFolder.create(config.out_dir, run_id, RunManifest(
        run_id=run_id,
        ipw_version=__version__,
        command=list(command if command is not None else sys.argv),
        config=config.to_dict(),
        dataset=_dataset_entry(config, queries),
        shard={"index": shard.index, "count": shard.count, "dataset": _dataset_entry(config, full)}
        if shard is not None else None,
        hardware=hardware,
        hardware_by_id={identity.hardware_id: hardware},
        software=software_fingerprint(),
        started_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
        backends=[],
    ))
    return folder, queries


def resume_run(run_dir: str) -> tuple[RunFolder, RunConfig, list[Query], frozenset[tuple[str, str, int]]]:
    """Reopen an interrupted run: same config, same queries (fingerprint checked), what is done."""
    folder = RunFolder.reopen(run_dir)
    config = RunConfig.from_dict(folder.manifest.config)
    queries = _load_full(config)
    if folder.manifest.shard:
        queries = shard_items(queries, Shard(folder.manifest.shard["index"], folder.manifest.shard["count"]))
    if fingerprint(queries) != folder.manifest.dataset["fingerprint"]:
        raise IpwError(f"{run_dir}: the dataset {config.dataset} changed since the run started "
                       "(fingerprints differ); start a new run")
    done = frozenset(folder.done_keys())
    identity, hardware = node_identity()
    folder.write_manifest(status="running", resumed_at=(folder.manifest.resumed_at or [])
                          + [time.strftime("%Y-%m-%dT%H:%M:%S")],
                          hardware_by_id={**(folder.manifest.hardware_by_id or {}), identity.hardware_id: hardware})
    return folder, config, queries, done


def execute(folder: RunFolder, config: RunConfig, queries: list[Query],
            progress: Callable[[QueryRecord], None], probe: ProbeFn = default_probe,
            done: frozenset[tuple[str, str, int]] = frozenset(), dispatch: Callable[..., None] | None = None,
            notice: Callable[[str], None] = lambda line: None) -> str:
    """Run every backend and return the run's final status, which the manifest records with
    records.parquet in every case: ``complete``; ``failed`` when a backend stopped (its engine kept
    crashing; the other backends went on) or the run hit an error; ``interrupted`` on Ctrl-C or SIGTERM.
    ``ipw run --resume`` continues a failed or interrupted run.  ``notice`` gets one line per stopped
    backend.  ``dispatch(folder, config, queries, progress, done)`` runs the backends elsewhere instead
    of here (the command layer binds ``ipw.ray_runner.run_on_ray`` to its options)."""
    stopped: list[str] = []
    try:
        if dispatch is not None:
            dispatch(folder, config, queries, progress, done)
        else:
            for spec in config.backends:
                info = run_backend(folder, config, spec, queries, progress, probe, done)
                if info is not None:
                    others = [b for b in folder.manifest.backends or [] if b["name"] != spec.name]
                    folder.write_manifest(backends=others + [info])
                    if info.get("stopped"):
                        stopped.append(info["stopped"])
                        notice(info["stopped"])
    except KeyboardInterrupt:
        folder.finish("interrupted", reason="interrupted by the user")
        raise
    except BaseException as exc:
        folder.finish("failed", reason=f"{type(exc).__name__}: {exc}")
        raise
    if stopped:
        folder.finish("failed", reason="; ".join(stopped) + " (ipw run --resume retries its queries)")
        return "failed"
    folder.finish("complete")
    return "complete"
