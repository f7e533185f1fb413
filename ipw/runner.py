"""Run a query set through backends: warm-up, idle baseline, one measured window per query, scoring,
and a record appended to the run folder after every query."""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from ipw import __version__
from ipw.backends.base import Backend, BackendSpec, Completion, create_backend
from ipw.config import RunConfig
from ipw.datasets import Query, fingerprint, load_queries
from ipw.errors import IpwError
from ipw.results import QueryRecord, RunFolder, new_run_id
from ipw.scoring import score
from ipw.telemetry.base import EnergyReading, Sensor, total_energy


@dataclass(frozen=True)
class IdleBaseline:
    """Idle power per component, measured with the model loaded and no request in flight."""

    power_w: dict[str, float]
    spread_w: dict[str, float]  # standard deviation over 1 s slices
    duration_s: float


class Closed:
    """A closed window: each sensor's readings, or a deferred result that becomes final later."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def ready(self) -> bool:
        return all(isinstance(p, list) or p.ready() for p in self.parts)

    def readings(self, timeout_s: float = 10.0) -> list[EnergyReading]:
        """All readings; waits (sleeping, not spinning) for deferred parts, at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        out: list[EnergyReading] = []
        for part in self.parts:
            out.extend(part if isinstance(part, list) else part.result())
        return out


class Window:
    """Opens a measurement window on every sensor and closes it."""

    def __init__(self, sensors: list[Sensor]) -> None:
        self.sensors = sensors

    def begin(self) -> list[Any]:
        return [s.begin() for s in self.sensors]

    def end(self, tokens: list[Any]) -> Closed:
        return Closed([sensor.end(token) for sensor, token in zip(self.sensors, tokens)])


def measure_idle(window: Window, seconds: float) -> IdleBaseline:
    slices: dict[str, list[float]] = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tokens = window.begin()
        time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        for r in window.end(tokens).readings():
            if r.energy_j is not None and r.duration_s > 0:
                slices.setdefault(r.component, []).append(r.energy_j / r.duration_s)
    return IdleBaseline(
        power_w={k: statistics.fmean(v) for k, v in slices.items()},
        spread_w={k: statistics.pstdev(v) if len(v) > 1 else 0.0 for k, v in slices.items()},
        duration_s=seconds,
    )


def make_record(
    run_id: str, spec: BackendSpec, query: Query, repeat: int, completion: Completion | None,
    error: Exception | None, start_s: float, end_s: float, readings: list[EnergyReading], *, idle: IdleBaseline,
) -> QueryRecord:
    total = total_energy(readings)
    duration = end_s - start_s
    net = None
    if total.energy_j is not None:
        basis = {r.component for r in readings if r.source in total.source.split("+") and r.energy_j is not None}
        net = total.energy_j - sum(idle.power_w.get(c, 0.0) for c in basis) * duration
    output = completion.text if completion else ""
    correct = 0.0 if error else float(score(query.scorer, output, query.answer, query.choices))
    return QueryRecord(
        run_id=run_id, backend=spec.name, model=spec.model, role=spec.role, query_id=query.id,
        category=query.category, repeat=repeat, scorer=query.scorer, prompt=query.render(), answer=query.answer,
        output=output, correct=correct,
        error=None if error is None else f"{type(error).__name__}: {error}",
        error_category=None if error is None else "backend_error",
        prompt_tokens=completion.prompt_tokens if completion else 0,
        completion_tokens=completion.completion_tokens if completion else 0,
        ttft_s=completion.ttft_s if completion else None,
        latency_s=completion.latency_s if completion else duration,
        start_s=start_s, end_s=end_s,
        energy_j=total.energy_j, energy_quality=total.quality, energy_source=total.source,
        energy_scope=total.scope, best_effort_energy_j=total.best_effort_j, net_energy_j=net,
        energy_parts=json.dumps([asdict(r) for r in readings]),
    )


ProbeFn = Callable[[Backend], list[Sensor]]


def default_probe(backend: Backend) -> list[Sensor]:
    from ipw.telemetry.probe import probe_sensors

    return probe_sensors(backend.pids)


def run_backend(
    folder: RunFolder, config: RunConfig, spec: BackendSpec, queries: list[Query],
    progress: Callable[[QueryRecord], None], probe: ProbeFn = default_probe,
) -> dict[str, Any]:
    """Run every query (× repeats) through one backend; returns what the manifest records about it."""
    backend = create_backend(spec)
    t0 = time.monotonic()
    backend.load()
    load_s = time.monotonic() - t0
    sensors = probe(backend)
    window = Window(sensors)
    try:
        for query in queries[: config.warmup]:
            backend.generate(query.render(), config.generation)
        idle = measure_idle(window, config.idle_s) if config.idle_s > 0 else IdleBaseline({}, {}, 0.0)
        pending: list[tuple[Closed, Callable[[list[EnergyReading]], QueryRecord]]] = []

        def flush(wait: bool) -> None:
            # records are appended in query order as soon as their energy is final
            while pending and (wait or pending[0][0].ready()):
                closed, build = pending.pop(0)
                record = build(closed.readings())
                folder.append(record)
                progress(record)

        for repeat in range(config.repeats):
            for query in queries:
                completion, error = None, None
                tokens = window.begin()
                start = time.monotonic()
                try:
                    completion = backend.generate(query.render(), config.generation)
                except IpwError:
                    raise
                except Exception as exc:  # a failed query is an error record, never a crash
                    error = exc
                end = time.monotonic()
                closed = window.end(tokens)
                pending.append((closed, functools.partial(
                    make_record, folder.manifest["run_id"], spec, query, repeat, completion, error, start, end,
                    idle=idle)))
                flush(wait=False)
        flush(wait=True)
        return {
            "name": spec.name, "kind": spec.kind, "model": spec.model, "role": spec.role,
            "load_s": round(load_s, 3), **backend.describe(),
            "sensors": [asdict(s.info()) for s in sensors],
            "idle_baseline": asdict(idle),
        }
    finally:
        for sensor in sensors:
            sensor.close()
        backend.close()


def start_run(config: RunConfig, command: list[str] | None = None) -> tuple[RunFolder, list[Query]]:
    """Validate everything that can be validated before any model loads, then create the folder."""
    from ipw.telemetry.hardware import hardware_fingerprint, software_fingerprint

    queries = load_queries(config.dataset)
    if config.limit:
        queries = queries[: config.limit]
    for spec in config.backends:
        create_backend(spec)  # resolves the model file: a missing one fails here, before the run
    run_id = new_run_id()
    folder = RunFolder.create(config.out_dir, run_id, {
        "ipw_version": __version__,
        "command": command if command is not None else sys.argv,
        "config": config.to_dict(),
        "dataset": {"name": config.dataset, "n_queries": len(queries), "fingerprint": fingerprint(queries),
                    "categories": sorted({q.category for q in queries})},
        "hardware": hardware_fingerprint(),
        "software": software_fingerprint(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "backends": [],
    })
    return folder, queries


def execute(folder: RunFolder, config: RunConfig, queries: list[Query],
            progress: Callable[[QueryRecord], None], probe: ProbeFn = default_probe) -> None:
    """Run every backend; the manifest ends ``complete``, or ``interrupted`` on Ctrl-C or a crash."""
    try:
        for spec in config.backends:
            info = run_backend(folder, config, spec, queries, progress, probe)
            folder.write_manifest(backends=folder.manifest["backends"] + [info])
    except KeyboardInterrupt:
        folder.finish("interrupted", reason="interrupted by the user")
        raise
    except BaseException as exc:
        folder.finish("interrupted", reason=f"{type(exc).__name__}: {exc}")
        raise
    folder.finish("complete")
