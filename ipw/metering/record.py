"""A query's record from its measured window or share (``make_record``), and the writer that makes records
final, writes and reports them off the query's path (``RecordWriter``): shared by ``ipw run`` and ``ipw serve``."""

from __future__ import annotations

import collections
import functools
import json
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Protocol

from ipw.backends.base import BackendSpec, Completion
from ipw.inputs.datasets import Query
from ipw.metering.meter import Share
from ipw.metering.call import call_energy
from ipw.metering.window import Closed, IdleBaseline, resolve
from ipw.results import QueryRecord, RunFolder, RunManifest
from ipw.grading.scoring import record_score
from ipw.telemetry.base import EnergyReading, Sensor
from ipw.telemetry.hardware import node_identity
from ipw.telemetry.phases import record_phases, sensor_splits_many


def make_record(
    run_id: str, spec: BackendSpec, query: Query, repeat: int, completion: Completion | None,
    error: Exception | None, start_s: float, end_s: float, readings: list[EnergyReading], *, idle: IdleBaseline,
    estimate: Any = None, busy_s: float | None = None, splits: Callable[[], dict[str, Any]] | None = None,
    concurrency: int = 1, split: Share | None = None,
) -> QueryRecord:
    """``estimate``: a remote endpoint's ApiEnergyEstimate (adds its ``estimate.api`` reading);
    ``busy_s``: the window's share of time when concurrent requests split it (for the idle part);
    ``splits``: each component's split at the first token (``ipw.telemetry.phases.sensor_splits``), called now
    that the readings are final; ``concurrency``: the requests in flight at the record's level; ``split``:
    how its energy was split from overlapping requests' (its method, and the uncertainty that the
    weighting adds to the components of the total).  The record names the machine that measured it
    (``node_identity``)."""
    identity = node_identity()[0]
    duration = end_s - start_s
    ok = error is None and completion is not None
    energy = call_energy(readings, estimate, completion.completion_tokens if ok and completion is not None else 0,
                         ok, duration)
    readings, total = energy.readings, energy.total
    net = split_uncertainty = None
    if total.energy_j is not None:
        basis = {r.component for r in readings if r.source in total.source.split("+") and r.energy_j is not None}
        net = total.energy_j - sum(idle.power_w.get(c, 0.0) for c in basis) * (duration if busy_s is None else busy_s)
        if split is not None and split.method:
            split_uncertainty = sum(split.uncertainty_j.get(c, 0.0) for c in basis)
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
        mean_logprob=completion.mean_logprob if completion else None,
        concurrency=concurrency, split_method=split.method if split is not None else "",
        split_uncertainty_j=split_uncertainty,
    )


class RecordSink(Protocol):
    """What ``run_backend`` writes to: a :class:`RunFolder`, or a Ray task's sink (``ipw.running.ray_runner``)."""

    @property
    def path(self) -> Path: ...

    @property
    def manifest(self) -> RunManifest: ...

    def append(self, record: QueryRecord) -> None: ...

    def add_power(self, backend: str, columns: dict[str, Any]) -> None: ...


class RecordWriter:
    """Makes records final, writes them and reports them, on a thread of its own, off the query's path.

    The measuring thread hands over a closed window, its sensors' tokens, its first token and the
    function that builds its record (``put``), or a finished record (``put_record``), and goes on with
    the next query.  This thread takes the longest run of records whose energy is final (NVML's once
    the sampler has read past the window's end), in query order; makes their NVML windows final in
    one estimate (``window.resolve``) and their phase splits in another (``sensor_splits_many``);
    builds the records; appends them with one write and one fsync (``RunFolder.append_many``); and
    only then reports each to ``progress``.  So a kill -9 loses nothing that was reported, and the
    fsync, the estimates, the record's scoring and serialisation and the progress display cost the
    measuring thread nothing.  An error here (a full disk) is raised on the measuring thread at its
    next ``put`` and at ``close``.

    It works while a query is in flight: the measuring thread calls ``started`` once it has sent a
    query, and this thread looks at the queue ``AFTER_START_S`` later, when the measuring thread waits
    on the engine and needs no interpreter lock; so the lock is not held here when the answer comes
    back (each hand-over of it can cost up to the switch interval).  Without a ``started`` (requests in
    flight together) it looks every ``PACE_S``, or as soon as half the queue is full."""

    PACE_S = 0.25  # with no query started for this long, the queue is looked at anyway
    AFTER_START_S = 0.002  # from ``started`` to the work here: the measuring thread is waiting by then
    MAX_QUEUED = 1024  # records handed over and not yet written: beyond this, ``put`` waits

    def __init__(self, folder: RecordSink, progress: Callable[[QueryRecord], None],
                 sensors: list[Sensor] | None = None) -> None:
        self._folder, self._progress, self._sensors = folder, progress, list(sensors or [])
        def append_each(records: list[QueryRecord]) -> None:  # a Ray task's sink
            for r in records:
                folder.append(r)

        self._append = folder.append_many if isinstance(folder, RunFolder) else append_each  # one write and one fsync
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._started = 0  # queries sent (``started``)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ipw-record-writer", daemon=True)
        self._thread.start()

    def put(self, closed: Closed, tokens: list[Any], first_token_s: float | None,
            build: Callable[..., QueryRecord]) -> None:
        """A query's closed window, its sensors' tokens, its first token (where its phases split; None:
        none) and ``build(readings, splits=...)``, its record once the readings are final."""
        self._add((closed, tokens, first_token_s, build))

    def started(self) -> None:
        """A query was sent: the measuring thread now waits on the engine (see the class's docstring)."""
        with self._cond:
            self._started += 1
            self._cond.notify_all()

    def put_record(self, record: QueryRecord) -> None:
        self._add((None, None, None, record))

    def _add(self, item: tuple[Any, ...]) -> None:
        with self._cond:
            while len(self._queue) >= self.MAX_QUEUED and self._error is None:  # memory stays flat
                self._cond.wait()
            if self._error is not None:
                raise self._error
            self._queue.append(item)
            self._cond.notify_all()

    def close(self) -> None:
        """Write every record handed over (waiting for their energy to be final), then stop."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _due(self, seen: int) -> bool:
        return self._closing or self._started > seen or len(self._queue) >= self.MAX_QUEUED // 2

    def _run(self) -> None:
        try:
            seen = 0
            while True:
                with self._cond:
                    while not self._queue and not self._closing:
                        self._cond.wait()
                    if not self._due(seen):
                        self._cond.wait_for(lambda: self._due(seen), timeout=self.PACE_S)
                    if not self._queue:
                        return
                    closing, paced, seen = self._closing, self._started > seen, self._started
                if paced and not closing:
                    time.sleep(self.AFTER_START_S)
                with self._cond:
                    closing = self._closing
                    batch = []
                    for item in self._queue:  # the longest ready prefix, in query order
                        if not (closing or item[0] is None or item[0].ready()):
                            break
                        batch.append(item)
                if not batch:
                    continue
                self._write(batch)
                with self._cond:
                    for _ in batch:
                        self._queue.popleft()
                    self._cond.notify_all()
        except BaseException as exc:  # raised on the measuring thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _write(self, batch: list[tuple[Any, ...]]) -> None:
        windows = [item for item in batch if item[0] is not None]
        resolve([closed for closed, _, _, _ in windows])
        splits = iter(sensor_splits_many(self._sensors, [(tokens, closed.parts, at_s)
                                                         for closed, tokens, at_s, _ in windows]))
        records = [build if closed is None else build(closed.readings(), splits=functools.partial(dict, next(splits)))
                   for closed, _, _, build in batch]
        self._append(records)
        for record in records:
            self._progress(record)
