"""``ipw run CONFIG --ray ADDRESS``: the query set split into shards, one Ray task per (backend, shard).

Each task runs ipw's own runner (``ipw.running.runner.run_backend``) on the node Ray gives it, measuring
with that node's sensors, and streams its records back (a Ray streaming generator); the driver
appends them to its run folder, deduplicated by (backend, query_id, repeat), so a task that runs
again never writes a query twice.  Every record names the node that measured it (``node``,
``hardware_id``; the fingerprints are in the manifest's ``hardware_by_id``).

**Energy attribution on shared nodes** (no double counting): Ray may put several tasks on one node.
- GPUs: a task asks for ``num_gpus`` when its backend offloads to a GPU; Ray gives every GPU to one
  task at a time and sets ``CUDA_VISIBLE_DEVICES``, which the NVML sensor honours, so a GPU's energy
  is measured by exactly the one task that uses it.  A task without a GPU measures no GPU.
- CPU: the RAPL counters cover the whole package, which tasks on one node share, so under Ray the CPU
  part is always the CPU model of the task's own process tree (``estimated``): CPU seconds are
  per process, so two tasks on one node are each charged only their own.  For a measured (RAPL) CPU
  number, run one process per node with ``--shard K/N`` instead.

**Faults**: a task that fails (an exception, a killed worker process, a lost node) is submitted
again with only the keys still missing, up to ``MAX_ATTEMPTS`` times per (backend, shard); the
driver does this itself rather than Ray's ``max_retries`` so a retry never repeats finished queries.
Beyond that the run stops ``interrupted`` and ``ipw run --resume DIR --ray ADDRESS`` reruns only the
missing keys.
"""

from __future__ import annotations

import math
import os
import queue
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from ipw.backends.base import BackendSpec
from ipw.inputs.config import RunConfig
from ipw.inputs.datasets import Query
from ipw.errors import IpwError, missing_extra
from ipw.results import DoneKeys, QueryRecord, RunFolder, RunManifest
from ipw.running.shard import Shard, combine_backend_infos, shard_items

MAX_ATTEMPTS = 3  # per (backend, shard): the first run and two more


@dataclass(frozen=True)
class RayOptions:
    address: str  # "auto" (RAY_ADDRESS or the cluster this machine joined), "local", "HOST:PORT", "ray://HOST:PORT"
    shards: int | None = None  # None: as many as the cluster runs at once


def task_resources(spec: BackendSpec) -> dict[str, float]:
    """What one task of ``spec`` asks Ray for: ``ray_num_gpus``/``ray_num_cpus`` in its backend table
    when given; else one GPU (and one CPU) when the backend offloads to a GPU (llama-cpp with a
    non-zero ``n_gpu_layers``, in-process ``vllm``, a managed vLLM server), else ``n_threads`` CPUs
    (1 when unset)."""
    opts = spec.options
    gpus = opts.get("ray_num_gpus")
    if gpus is None:
        uses_gpu = ((spec.kind == "llama-cpp" and opts.get("n_gpu_layers", 0) != 0) or spec.kind == "vllm"
                    or (spec.kind == "openai" and opts.get("server") == "vllm"))
        gpus = 1 if uses_gpu else 0
    cpus = opts.get("ray_num_cpus")
    if cpus is None:
        cpus = 1 if gpus else opts.get("n_threads") or 1
    return {"num_cpus": float(cpus), "num_gpus": float(gpus)}


def default_shards(config: RunConfig, cluster: dict[str, float], n_queries: int) -> int:
    """As many shards as the cluster runs tasks of one backend at once (the most of any backend),
    at most one per query.  A backend the cluster can never run is an error, not a hang."""
    fits = []
    for spec in config.backends:
        need = task_resources(spec)
        n = math.inf
        for key, have in (("num_cpus", cluster.get("CPU", 0.0)), ("num_gpus", cluster.get("GPU", 0.0))):
            if need[key] > 0:
                n = min(n, math.floor(have / need[key]))
        if n < 1:
            raise IpwError(f"backend {spec.name} asks Ray for {need['num_cpus']:g} CPU(s) and {need['num_gpus']:g} "
                           f"GPU(s), but the cluster has {cluster.get('CPU', 0):g} CPU(s) and {cluster.get('GPU', 0):g} "
                           "GPU(s); set ray_num_cpus / ray_num_gpus in its [[backends]] table")
        fits.append(n)
    best = max(fits)
    return int(max(1, min(n_queries, best if math.isfinite(best) else 1)))


# -- on the worker --------------------------------------------------------------------------------


class _Sink:
    """What ``run_backend`` writes to, on the worker: records and power traces go to a queue that the
    task streams back; ``path`` (a temporary folder on the node) receives a managed server's log."""

    def __init__(self, run_id: str, out: "queue.Queue[Any]") -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"ipw-{run_id}-"))
        self.manifest = RunManifest(run_id=run_id)
        self.out = out

    def append(self, record: QueryRecord) -> None:
        self.out.put(("record", record))

    def add_power(self, backend: str, columns: dict[str, Any]) -> None:
        self.out.put(("power", columns))


def shared_node_probe(backend: Any) -> list:
    """The sensors of a task that may share its node: the GPUs Ray gave it (none when it has none),
    and the CPU model of its own process tree (never the package-wide RAPL)."""
    import ray

    from ipw.telemetry.probe import probe_sensors

    gpus = ray.get_gpu_ids()  # Ray also set CUDA_VISIBLE_DEVICES to them, which NvmlSensor honours
    return probe_sensors(backend.pids, gpu_indices=None if gpus else [], remote=backend.remote,
                         rapl=False)


def shard_task(config: RunConfig, spec: BackendSpec, queries: list[Query], done: DoneKeys,
               run_id: str) -> Iterator[tuple]:
    """One (backend, shard) on a Ray worker: yields ("node", identity, hardware), then ("record",
    QueryRecord) per query as it finishes, ("power", columns) per trace, and ("backend", info)."""
    from ipw.running.runner import run_backend
    from ipw.telemetry.hardware import node_identity

    identity, hardware = node_identity()
    yield ("node", identity, hardware)
    out: queue.Queue[Any] = queue.Queue()
    result: dict[str, Any] = {}
    sink = _Sink(run_id, out)

    def work() -> None:
        try:
            result["info"] = run_backend(sink, config, spec, queries, lambda record: None, shared_node_probe, done)
        except BaseException as exc:  # re-raised in the task, where Ray reports it to the driver
            result["error"] = exc
        finally:
            try:
                sink.path.rmdir()  # kept when it holds something (a managed server's log)
            except OSError:
                pass
            out.put(None)

    thread = threading.Thread(target=work, name="ipw-shard", daemon=True)
    thread.start()
    while (item := out.get()) is not None:
        yield item
    thread.join()
    if "error" in result:
        raise result["error"]
    if result.get("info") is not None:  # None: nothing was left to run
        yield ("backend", result["info"])


# -- on the driver --------------------------------------------------------------------------------


def import_ray():
    try:
        import ray
    except ImportError:
        raise missing_extra("ray", "ray") from None
    return ray


def connect(address: str) -> bool:
    """Join the cluster (``local``: start Ray on this machine); True when this call started the
    connection (and so should end it).  A connection made by the caller is reused."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": "ERROR"}
    hint = "start one with `ray start --head`, or give its address (HOST:6379, ray://HOST:10001, or local)"
    if address != "local":
        target = _bootstrap_address(address)
        if target is not None and not _listening(*target):
            raise IpwError(f"--ray {address}: cannot connect to a Ray cluster (nothing answers at "
                           f"{target[0]}:{target[1]}); {hint}")
    # Ray retries a silent address for ever (~40 s per try): one try, unless the user set the variables
    saved = {k: os.environ.get(k) for k in RAY_CONNECT_ENV}
    if address != "local":
        for k, v in RAY_CONNECT_ENV.items():
            os.environ.setdefault(k, v)
    try:
        if address == "local":
            ray.init(include_dashboard=False, **kwargs)
        else:
            ray.init(address=address, **kwargs)
    except Exception as exc:  # ConnectionError, ValueError, ...: all mean "no cluster there"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise IpwError(f"--ray {address}: cannot connect to a Ray cluster ({first}); {hint}") from None
    finally:
        for k, was in saved.items():
            if was is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = was
    return True


#: set (unless already set) while ``ray.init`` joins a cluster: one try to reach its GCS (Ray's default is 20
#: tries of ~40 s each, so an address where something else listens hung for 14 minutes; now ~40 s)
RAY_CONNECT_ENV = {"RAY_gcs_server_port_wait_time_s": "1"}
#: how long the address of ``--ray`` is given to accept a TCP connection before ray.init is tried
PROBE_S = 5.0


def _bootstrap_address(address: str) -> tuple[str, int] | None:
    """The host and port that ``ray.init(address)`` will connect to (Ray's own reading of it: ``auto`` is
    RAY_ADDRESS or this machine's last cluster, and a loopback host becomes the node's address), or None
    when it cannot be told here (ray.init then reports it)."""
    if address.startswith("ray://"):
        parts = urlsplit(address)
        try:
            return (parts.hostname, parts.port or 10001) if parts.hostname else None
        except ValueError:
            return None
    try:
        from ray._private.services import canonicalize_bootstrap_address

        canonical = canonicalize_bootstrap_address(address)
    except Exception:  # Ray's private helper moved or failed: ray.init will say why
        return None
    if not canonical:
        return None
    host, _, port = canonical.rpartition(":")
    return (host.strip("[]"), int(port)) if port.isdigit() and host else None


def _listening(host: str, port: int) -> bool:
    """Whether something accepts a TCP connection at host:port within ``PROBE_S``."""
    try:
        socket.create_connection((host, port), timeout=PROBE_S).close()
        return True
    except OSError:
        return False


def _one_line(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"[:300]


def run_on_ray(folder: RunFolder, config: RunConfig, queries: list[Query], progress: Callable[[QueryRecord], None],
               options: RayOptions, levels: dict[str, tuple[int, ...]],
               done: DoneKeys = DoneKeys()) -> None:
    """Run every (backend, shard) as a Ray task; records stream into ``folder``.  ``levels``: each backend's
    concurrency levels (``backends.base.check_backends``), for the shards' keys.  Raises IpwError when
    a shard still fails after ``MAX_ATTEMPTS`` (the records so far are kept)."""
    ray = import_ray()
    started = connect(options.address)
    running: dict[Any, tuple[BackendSpec, int]] = {}  # generator -> its (backend, shard)
    node_of: dict[Any, Any] = {}  # generator -> the NodeIdentity its task reported
    attempts: dict[tuple[str, int], int] = {}  # in this call (a resumed run starts again from 0)
    try:
        previous = folder.manifest.ray or {}
        n = options.shards or previous.get("shards") or default_shards(config, ray.cluster_resources(), len(queries))
        n = max(1, min(n, len(queries)))
        remote = ray.remote(shard_task)
        seen = set(done)
        # the machines that measured records (not the driver's, unless it did)
        measured = set(folder.log_frame()["hardware_id"].dropna())
        hardware_by_id = {h: fp for h, fp in (folder.manifest.hardware_by_id or {}).items() if h in measured}
        fingerprints: dict[str, dict] = {}  # hardware_id -> fingerprint, as tasks report their node
        tasks = {(t["backend"], t["shard"]): t for t in previous.get("tasks", [])}
        infos: dict[str, list[dict]] = {}
        for b in folder.manifest.entries():  # a resumed run keeps what earlier tasks reported
            infos[b.name] = [dict(s) for s in b.shards] if b.shards else [b.to_json()]

        def save() -> None:
            folder.write_manifest(hardware_by_id=hardware_by_id, ray={
                "address": options.address, "shards": n, "max_attempts": MAX_ATTEMPTS,
                "tasks": sorted(tasks.values(), key=lambda t: (t["backend"], t["shard"]))})

        def submit(spec: BackendSpec, k: int) -> None:
            part = shard_items(queries, Shard(k, n))
            keys = {(spec.name, q.id, r, c) for c in levels[spec.name] for r in range(config.repeats) for q in part}
            if keys <= seen:
                return
            task = tasks.setdefault((spec.name, k), {"backend": spec.name, "shard": k, "attempts": 0, "errors": [],
                                                     "nodes": []})
            task["attempts"] += 1
            attempts[(spec.name, k)] = attempts.get((spec.name, k), 0) + 1
            gen = remote.options(num_returns="streaming", max_retries=0, name=f"ipw {spec.name} shard {k}/{n}",
                                 **task_resources(spec)).remote(config, spec, part, DoneKeys.of(keys & seen),
                                                                folder.manifest.run_id)
            running[gen] = (spec, k)

        for spec in config.backends:
            for k in range(1, n + 1):
                submit(spec, k)
        save()
        while running:
            ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
            if not ready:  # a stream that ended is not always reported ready
                ready = [gen for gen in running if gen.is_finished()]
            for gen in ready:
                spec, k = running[gen]
                task = tasks[(spec.name, k)]
                try:
                    item = ray.get(next(gen))
                except StopIteration:
                    del running[gen]
                    continue
                except ray.exceptions.RayError as exc:  # the task raised, its worker died or its node was lost
                    del running[gen]
                    task["errors"].append(_one_line(exc))
                    if attempts[(spec.name, k)] >= MAX_ATTEMPTS:
                        save()
                        raise IpwError(f"backend {spec.name} shard {k}/{n} failed {attempts[(spec.name, k)]} times (last: "
                                       f"{task['errors'][-1]}); the records so far are kept: ipw run --resume "
                                       f"{folder.path} --ray {options.address}") from None
                    submit(spec, k)
                    save()
                    continue
                kind = item[0]
                if kind == "node":
                    identity, hardware = item[1], item[2]
                    node_of[gen] = identity
                    fingerprints[identity.hardware_id] = hardware
                    if identity.node not in task["nodes"]:
                        task["nodes"].append(identity.node)
                elif kind == "record":
                    record = item[1]
                    key = (record.backend, record.query_id, record.repeat, record.concurrency)
                    if key in seen:
                        continue  # already written (a task that ran again)
                    if record.hardware_id not in hardware_by_id:
                        hardware_by_id[record.hardware_id] = fingerprints.get(record.hardware_id, {})
                        save()
                    folder.append(record)
                    seen.add(key)
                    progress(record)
                elif kind == "power":
                    columns = dict(item[1])
                    rows = len(next(iter(columns.values()), []))
                    folder.add_power(spec.name, {**columns, "node": [node_of[gen].node] * rows})
                elif kind == "backend":
                    infos.setdefault(spec.name, []).append(
                        {**item[1], "shard": k, "node": node_of[gen].node, "hardware_id": node_of[gen].hardware_id})
        save()
        folder.write_manifest(backends=[combine_backend_infos(infos[s.name]) for s in config.backends
                                        if s.name in infos])
    except BaseException:
        for gen in running:
            try:
                ray.cancel(gen, force=True)
            except Exception:
                pass
        raise
    finally:
        if started:
            ray.shutdown()
