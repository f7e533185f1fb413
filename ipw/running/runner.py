"""Run a query set through backends: warm-up, idle baseline, one measured window per query, scoring,
and a record appended to the run folder after every query."""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable


from ipw import __version__
from ipw.backends.base import Backend, BackendSpec, Completion, QueryError, create_backend, levels_of
from ipw.backends.worker import EngineStopped
from ipw.inputs.config import RunConfig
from ipw.inputs.datasets import Query, QuerySet
from ipw.errors import IpwError
from ipw.metering.call import open_call
from ipw.metering.meter import SWITCH_INTERVAL_S, Meter
from ipw.metering.split import RUN_PERIOD_S
from ipw.metering.record import RecordSink, RecordWriter, make_record
from ipw.telemetry.phases import first_token_s
from ipw.results import BackendEntry, DoneKeys, KeptQueries, QueryRecord, RunFolder, RunManifest, new_run_id
from ipw.running.shard import Shard, shard_items
from ipw.telemetry.base import Sensor
from ipw.telemetry.hardware import node_identity
from ipw.telemetry.probe import default_probe
from ipw.metering.window import IdleBaseline, Window, measure_idle


def run_query(backend: Backend, query: Query, config: RunConfig) -> tuple[Completion | None, Exception | None]:
    """One query; a failure becomes the error of its record, never a crash (user errors and a stopped
    engine still stop).  Public as the one call per query into the engine (its worker's round trip) that
    bench/overhead/harness_breakdown.py times apart from what ipw adds around it."""
    try:
        return backend.generate(query.render(), config.generation), None
    except IpwError:  # EngineStopped included
        raise
    except Exception as exc:
        return None, exc


ProbeFn = Callable[[Backend], list[Sensor]]
QUERY_CACHE_MIN = 10_000  # a run of this many queries keeps a copy of them (below it, parsing them again is quick)


def run_backend(
    folder: RecordSink, config: RunConfig, spec: BackendSpec, queries: list[Query],
    progress: Callable[[QueryRecord], None], probe: ProbeFn = default_probe, done: DoneKeys = DoneKeys(),
) -> dict[str, Any] | None:
    """Run every query (× repeats) through one backend at each of its concurrency levels, skipping
    ``done`` (backend, query, repeat, concurrency) keys; returns what the manifest records about the
    backend, or None when nothing was left.

    A level measured alone at concurrency 1 gets a window per query.  Otherwise (a sweep, or more than one
    request in flight) each level gets its own warm-up and idle baseline and one span, cut into windows
    at every request's start and end, whose energy is split among the requests (``run_concurrent``)."""
    backend = create_backend(spec)
    levels = levels_of(backend)
    todo = work_left(spec.name, levels, config.repeats, queries, done)
    if not any(todo.values()):
        return None
    backend.attach(folder.path)  # e.g. a managed server's log goes into the run folder
    t0 = time.monotonic()
    try:
        backend.load()
    except EngineStopped as exc:  # the engine's worker died while loading: this backend stops, others go on
        backend.close()
        return BackendEntry(spec.name, spec.kind, spec.model, spec.role, load_s=round(time.monotonic() - t0, 3),
                            stopped=str(exc)).to_json()  # load_s: until it stopped
    except IpwError as exc:  # an engine that could not start (a server's root cause, say): its one line names it
        backend.close()  # whatever its start left (bounded: a worker's close kills what does not end)
        if f"backend {spec.name!r}" in exc.message:
            raise
        raise IpwError(f"backend {spec.name!r}: {exc.message}", exc.exit_code) from exc
    except BaseException:  # Ctrl-C or SIGTERM while it loads, or a bug: its processes go too
        backend.close()
        raise
    load_s = time.monotonic() - t0
    sensors = probe(backend)
    window = Window(sensors)
    stopped = None
    level_lines: list[dict[str, Any]] = []
    idle = IdleBaseline({}, {}, 0.0)
    recorder = RecordWriter(folder, progress, sensors)
    switch_interval_s = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        try:
            for level in levels:
                work = todo[level]
                if not work:
                    continue
                backend.concurrency = level
                _warm_up(backend, queries, config, level)
                idle = measure_idle(window, config.idle_s) if config.idle_s > 0 else IdleBaseline({}, {}, 0.0)
                if level > 1 or len(levels) > 1:
                    line = run_concurrent(folder, config, spec, backend, window, idle, work, recorder, level)
                    level_lines.append({**line, "idle_baseline": asdict(idle)})
                    continue
                # the query's path: a timestamp at each edge of its window, which is also its record's
                # start and end, and the call; the record is made final, written and reported by the
                # recorder's thread (docs/PERFORMANCE.md)
                for repeat, query in work:
                    call = open_call(window)
                    recorder.started()
                    completion, error = run_query(backend, query, config)
                    measured = call.close()
                    recorder.put(measured.closed, measured.tokens, first_token_s(completion), functools.partial(
                        make_record, folder.manifest.run_id, spec, query, repeat, completion, error,
                        measured.start_s, measured.end_s, idle=idle, estimate=backend.energy_estimate))
                    if isinstance(error, QueryError) and error.category == "engine_crash":
                        backend.recover()  # a new worker, outside any window; EngineStopped after MAX_RESTARTS
        except EngineStopped as exc:
            stopped = str(exc)
        finally:  # on Ctrl-C too: every finished query gets its record
            sys.setswitchinterval(switch_interval_s)
            recorder.close()
        for sensor in sensors:
            if sensor.supports_trace:
                folder.add_power(spec.name, sensor.trace())
        audit = _energy_audit(folder, spec.name, sensors, t0)
        return BackendEntry(
            spec.name, spec.kind, spec.model, spec.role, load_s=round(load_s, 3), details=backend.describe(),
            sampler_overhead={s.name: s.overhead() for s in sensors},
            sensors=tuple(asdict(s.info()) for s in sensors) + (
                (asdict(backend.energy_estimate.info()),) if backend.energy_estimate is not None else ()),
            idle_baseline=asdict(idle), levels=tuple(level_lines) or None, stopped=stopped or None,
            energy_audit=tuple(audit) or None,
        ).to_json()
    finally:
        for sensor in sensors:
            sensor.close()
        backend.close()


def work_left(backend: str, levels: tuple[int, ...], repeats: int, queries: list[Query],
              done: DoneKeys) -> dict[int, list[tuple[int, Query]]]:
    """A backend's (repeat, query) pairs without a record yet, per concurrency level, in run order."""
    todo: dict[int, list[tuple[int, Query]]] = {c: [] for c in levels}
    for c in levels:
        for r in range(repeats):
            ids = done.done_ids(backend, r, c)
            todo[c] += [(r, q) for q in queries if q.id not in ids]
    return todo


def _energy_audit(folder: RecordSink, backend: str, sensors: list[Sensor], since_s: float) -> list[dict[str, Any]]:
    """The run-level energy audit of this backend's records of this session (``ipw.telemetry.audit``), once,
    after its last query: the counter over the span vs the queries plus the idle between them, per
    concurrency level when the backend ran more than one."""
    from ipw.telemetry.audit import audit_dicts

    # a Ray task's sink is no RunFolder: its records stream to the driver
    if not isinstance(folder, RunFolder) or not any(s.supports_energy_windows for s in sensors):
        return []
    try:
        records = folder.records_of(backend)
    except Exception as exc:  # the audit never costs a run
        return [{"error": f"{type(exc).__name__}: {exc}"}]
    return audit_dicts(sensors, records, since_s)


def _warm_up(backend: Backend, queries: list[Query], config: RunConfig, concurrency: int) -> None:
    """Unmeasured queries before a level: ``warmup`` of them, at least one per request slot, sent
    ``concurrency`` at a time (a failed one is not measured anyway)."""
    from concurrent.futures import ThreadPoolExecutor

    batch = queries[: warm_up_count(config, concurrency)]
    if not batch:
        return

    def one(query: Query) -> None:
        try:
            backend.generate(query.render(), config.generation)
        except QueryError:
            pass

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="ipw-warmup") as pool:
        list(pool.map(one, batch))


def warm_up_count(config: RunConfig, concurrency: int) -> int:
    """The warm-up's queries before a level: the set's first ``warmup``, at least one per request slot (none
    without ``warmup``)."""
    return max(config.warmup, concurrency) if config.warmup > 0 else 0


def run_concurrent(
    folder: RecordSink, config: RunConfig, spec: BackendSpec, backend: Backend, window: Window,
    idle: IdleBaseline, work: list[tuple[int, Query]], recorder: "RecordWriter", concurrency: int,
) -> dict[str, Any]:
    """Keep ``concurrency`` requests in flight; every request has its own window ([start, end] in its
    record) and its share of the energy measured while it ran (``ipw.metering.meter.Meter``, split by
    ``config.split``).  Records are appended in query order.  Returns the level's line for the manifest:
    its span, requests, split methods, the prices of the priced split and, per component, the span's
    energy, the unattributed part and the sum of the requests' parts.  ``recorder`` writes and reports
    the records (``RecordWriter``)."""
    from concurrent.futures import ThreadPoolExecutor

    meter = Meter(window, split=config.energy_split, requests=len(work), idle_w=idle.power_w, period_s=RUN_PERIOD_S)
    methods: dict[str, int] = {}
    estimate = backend.energy_estimate
    stopped: list[EngineStopped] = []  # the first request that found the engine stopped

    def one(job: int, query: Query) -> tuple[Completion | None, Exception | None, float, float]:
        # once a request found the engine stopped, no other is sent: the request threads take the next
        # queries before this thread, which waits on the results in query order, sees the failure, and
        # each one sent to a dead server could wait for its whole timeout_s (--resume runs them)
        if stopped:
            raise EngineStopped(stopped[0].message)
        meter.start(job)
        completion: Completion | None = None
        try:
            completion, error = run_query(backend, query, config)
        except EngineStopped as exc:
            stopped.append(exc)
            raise
        finally:
            start, end = meter.end(job, completion)
        return completion, error, start, end

    def write(job: int, completion: Completion | None, error: Exception | None, start: float, end: float) -> None:
        repeat, query = work[job]
        share = meter.share(job)
        record = make_record(folder.manifest.run_id, spec, query, repeat, completion, error, start, end,
                             share.readings, idle=idle, estimate=estimate, busy_s=share.busy_s,
                             concurrency=concurrency, split=share)
        recorder.put_record(record)
        methods[record.split_method or "none"] = methods.get(record.split_method or "none", 0) + 1

    meter.open()
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="ipw-request")
    futures = {i: pool.submit(one, i, query) for i, (_, query) in enumerate(work)}
    try:
        for job in range(len(work)):
            try:
                result = futures.pop(job).result()
            except EngineStopped:
                # the engine stopped (a managed server exited): the requests not sent are dropped, and those
                # submitted later that had finished keep their records (--resume runs the rest).  The wait is
                # for the requests in flight: each ends within its timeout_s, at once where the server is
                # gone (what it left is killed: ManagedServer._watch), and none starts after this
                pool.shutdown(wait=True, cancel_futures=True)
                for later, future in sorted(futures.items()):
                    if not future.cancelled() and future.exception() is None:
                        write(later, *future.result())
                raise
            write(job, *result)
    finally:
        # on Ctrl-C too: the requests in flight end (each within its timeout_s); none starts after this
        pool.shutdown(wait=True, cancel_futures=True)
        energy = meter.close()
    return {"concurrency": concurrency, "requests": len(work), "start_s": meter.started_s, "end_s": meter.ended_s,
            "wall_s": round(meter.ended_s - meter.started_s, 6), "energy_split": config.energy_split,
            "split_methods": methods, "pricing": asdict(meter.pricing()), "energy": energy}


def plan_run(config: RunConfig, query_set: QuerySet, shard: Shard | None = None,
             command: list[str] | None = None) -> tuple[RunFolder, list[Query]]:
    """The plan step of a new run (nothing loaded, every input checked): its shard of the query set and its
    run folder, with the manifest (status running); a run of ``QUERY_CACHE_MIN`` queries or more keeps a copy
    of them for ``--resume``.  ``shard``: run only that shard (``ipw.running.shard``); the manifest's ``dataset`` then
    describes the shard's queries and ``shard`` names the full set, which ``ipw merge`` restores."""
    from ipw.telemetry.hardware import software_fingerprint

    mine = query_set if shard is None else QuerySet(query_set.name, shard_items(query_set.queries, shard),
                                                    query_set.source)
    run_id = new_run_id()
    identity, hardware = node_identity()
    folder = RunFolder.create(config.out_dir, run_id, RunManifest(
        run_id=run_id,
        ipw_version=__version__,
        command=list(command if command is not None else sys.argv),
        config=config.to_dict(),
        dataset=mine.entry(),
        shard={"index": shard.index, "count": shard.count, "dataset": query_set.entry()} if shard is not None else None,
        hardware=hardware,
        hardware_by_id={identity.hardware_id: hardware},
        software=software_fingerprint(),
        started_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
        backends=[],
    ))
    if len(mine.queries) >= QUERY_CACHE_MIN and mine.source is not None:
        folder.keep_queries(mine.queries, mine.source)
    return folder, mine.queries


@dataclass(frozen=True)
class ResumePlan:
    """The plan step of ``--resume`` (``plan_resume``)."""

    folder: RunFolder
    queries: list[Query]  # the queries with a record still to make, and the warm-up's, in the set's order
    n_queries: int  # the whole query set's
    done: DoneKeys


def plan_resume(run_dir: str | Path, query_set: QuerySet | KeptQueries, config: RunConfig,
                levels: dict[str, tuple[int, ...]], every_query: bool = False) -> ResumePlan:
    """The plan step of ``--resume``: the run folder reopened (``RunFolder.reopen``: its only writer again),
    its query set checked against the one it started with (fingerprints), what is done, and the queries
    still to run: those with a record left to make in any (backend, repeat, concurrency level), found by id
    in Arrow (``DoneKeys.left``) before any ``Query`` is built, and the first ones, which the warm-up sends
    (``warm_up_count``).  ``every_query``: all of them (Ray's shards split the whole list)."""
    import numpy as np

    folder = RunFolder.reopen(run_dir)
    assert folder.manifest.dataset is not None and folder.lock is not None  # read_unfinished, reopen
    if query_set.fingerprint != folder.manifest.dataset["fingerprint"]:
        folder.lock.release()
        raise IpwError(f"{run_dir}: the dataset {query_set.name} changed since the run started "
                       "(fingerprints differ); start a new run")
    done = folder.done_keys()
    left = done.left(query_set.ids(), [(spec.name, r, c) for spec in config.backends for c in levels[spec.name]
                                       for r in range(config.repeats)])
    left[:max((warm_up_count(config, c) for lv in levels.values() for c in lv), default=0)] = True
    if every_query:
        left[:] = True
    queries = query_set.take(np.flatnonzero(left))
    identity, hardware = node_identity()
    folder.write_manifest(status="running", resumed_at=(folder.manifest.resumed_at or [])
                          + [time.strftime("%Y-%m-%dT%H:%M:%S")],
                          hardware_by_id={**(folder.manifest.hardware_by_id or {}), identity.hardware_id: hardware})
    return ResumePlan(folder, queries, len(query_set), done)


def execute(folder: RunFolder, config: RunConfig, queries: list[Query],
            progress: Callable[[QueryRecord], None], probe: ProbeFn = default_probe,
            done: DoneKeys = DoneKeys(), dispatch: Callable[..., None] | None = None,
            notice: Callable[[str], None] = lambda line: None) -> str:
    """Run every backend and return the run's final status, which the manifest records with
    records.parquet in every case: ``complete``; ``failed`` when a backend stopped (its engine kept
    crashing; the other backends went on) or the run hit an error; ``interrupted`` on Ctrl-C or SIGTERM.
    ``ipw run --resume`` continues a failed or interrupted run.  ``notice`` gets one line per stopped
    backend.  ``dispatch(folder, config, queries, progress, done)`` runs the backends elsewhere instead
    of here (the command layer binds ``ipw.running.ray_runner.run_on_ray`` to its options)."""
    stopped: list[str] = []
    try:
        if dispatch is not None:
            dispatch(folder, config, queries, progress, done)
        else:
            for spec in config.backends:
                info = run_backend(folder, config, spec, queries, progress, probe, done)
                if info is not None:
                    others = [b.to_json() for b in folder.manifest.entries() if b.name != spec.name]
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
