"""Run folders: ``results/<run_id>/`` with manifest.json (:class:`RunManifest`), records.jsonl and
records.parquet (:class:`QueryRecord`), power.parquet, judge.jsonl (:class:`JudgeEntry`), queries.parquet
and ipw.lock; docs/ARCHITECTURE.md tabulates each file with the methods that write and read it.

``records.jsonl`` is appended and fsynced as records become final (several at once when they are ready
together), before ``ipw run`` reports them: a crash loses no reported record.  ``ipw serve`` answers before
a record is final: each answered request's record is in ``pending.jsonl`` first (:class:`PendingLog`), which
every reader of the log reads with it (``record_chunks``).
This is the only module that turns records into pandas frames, and the one reader of run folders
(resume, compare, report, check, merge, rescore): a folder is read whole, or an IpwError names the
file (and line) and what is wrong with it.  Nothing is dropped silently: only a torn *last* line of
the log (no newline at its end: the query in flight when the process died) is left out.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, cast

from ipw.errors import IpwError

if TYPE_CHECKING:  # imported where used: `import ipw` stays light (tests/test_startup.py)
    import numpy as np
    import pandas as pd
    import pyarrow as pa

SCHEMA_VERSION = 1
STATUSES = ("running", "complete", "interrupted", "failed")
KEY_FIELDS = ("backend", "query_id", "repeat")  # what identifies a record
NUMERIC_COLUMNS = ("correct", "energy_j")  # what every analysis reads: numbers (or null)


@dataclass(frozen=True)
class QueryRecord:
    run_id: str
    backend: str
    model: str
    role: str
    query_id: str
    category: str
    repeat: int
    scorer: str
    prompt: str
    answer: str
    output: str
    correct: float | None  # 0..1; an error counts 0; None: unscored (a ``judge`` item no judge has graded)
    error: str | None  # None when the query succeeded
    error_category: str | None
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    latency_s: float
    start_s: float  # monotonic seconds of the window
    end_s: float
    energy_j: float | None  # gross energy on the record's basis (see energy_quality)
    energy_quality: str  # measured | measured_interpolated | estimated | unavailable
    energy_source: str
    energy_scope: str
    best_effort_energy_j: float | None  # every available part, measured and estimated, summed
    net_energy_j: float | None  # energy_j minus idle power x duration
    energy_parts: str = "[]"  # JSON list of per-component readings
    # prefill (window start -> first token) and decode (first token -> end): the same readings as
    # energy_j cut at the first token, so they sum to it; None without a first token (ipw/telemetry/phases.py)
    prefill_energy_j: float | None = None
    decode_energy_j: float | None = None
    prefill_uncertainty_j: float | None = None  # ± energy that may belong to the other phase
    phase_quality: str = ""  # worst quality of the split: measured_interpolated | estimated
    prefill_unresolved: bool | None = None  # the prefill is shorter than the sensor resolves
    phase_note: str = ""
    # the machine that measured the record (ipw.telemetry.hardware.NodeIdentity): a hash of its host name,
    # and the key of its hardware fingerprint in the manifest's ``hardware_by_id``; "" in older runs
    node: str = ""
    hardware_id: str = ""
    choices: tuple[str, ...] = ()  # the query's options (mcq), kept for rescoring; () in older runs
    # coverage as the paper defines it (ipw/judge.py, grading vs-backend:NAME): a judge compared this
    # output with backend ``vs_backend``'s output to the same query in both orders; win_tie is 1.0 when
    # both orders rate it a win or a tie, 0.0 otherwise, None when it was not judged (or is the reference)
    win_tie: float | None = None
    vs_backend: str = ""
    judge_verdicts: tuple[str, ...] = ()  # per order: response | reference | tie | unparsed | error
    # ipw serve: the provisional energy its answer carried (J) and that value's ±90% band around the settled
    # energy_j (docs/SERVING.md); None where the answer carried none
    provisional_energy_j: float | None = None
    provisional_uncertainty_j: float | None = None
    # the mean log-probability of the output tokens where the engine gave them (``logprobs = true``): the
    # answer's confidence, on which a cascade escalates to the cloud (ipw/analysis/cascade.py); None where
    # the engine gave none, and in runs written before the field.  Kept before ``concurrency``: the last
    # three fields are the frame ``record_keys`` reads (``_TAIL``)
    mean_logprob: float | None = None
    # serving under load (docs/SERVING.md): the requests in flight at the record's level of a concurrency
    # sweep (1 in older runs); how energy measured while requests overlapped was split among them
    # ("" when the window was the request's alone; ipw.metering.split.SPLIT_METHODS), and how far the
    # other split (priced or local) would move this record's share (J)
    concurrency: int = 1
    split_method: str = ""
    split_uncertainty_j: float | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "QueryRecord":
        """A record from a row of records.parquet or records.jsonl (the one way back from a row): NaN ->
        None, numpy -> Python; a field the run predates gets its empty value."""
        import math

        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value: Any = row.get(f.name)
            if f.name in ("choices", "judge_verdicts"):  # a list (JSONL), an array (Parquet), or missing in older runs
                out[f.name] = tuple(str(c) for c in value) if isinstance(value, (list, tuple)) or hasattr(
                    value, "tolist") else ()
                continue
            if hasattr(value, "item") and not isinstance(value, str):
                value = value.item()
            if isinstance(value, float) and math.isnan(value):
                value = None
            out[f.name] = value
        for key in ("repeat", "prompt_tokens", "completion_tokens"):
            out[key] = int(out[key] or 0)
        out["energy_parts"] = out["energy_parts"] or "[]"
        for key in ("node", "hardware_id", "vs_backend", "split_method"):  # absent in runs written before these fields
            out[key] = out[key] or ""
        out["concurrency"] = int(out["concurrency"] or 1)
        return cls(**out)

    def to_json(self) -> str:
        from ipw.sanitize import scrub  # an API key never reaches the run folder, whatever a server echoed

        return escape_surrogates(scrub(json.dumps(dataclasses.asdict(self), ensure_ascii=False)), in_json=True)


RECORD_COLUMNS = [f.name for f in dataclasses.fields(QueryRecord)]
_SURROGATE = re.compile("[\ud800-\udfff]")


def escape_surrogates(text: str, in_json: bool = False) -> str:
    """``text`` with each lone surrogate (a prompt's ``"\\ud800"``, a non-UTF-8 byte of argv) written as the six
    characters of its escape (``\\ud800``), which UTF-8 can hold: a record that held one could not be written,
    and was lost.  ``in_json``: ``text`` is a JSON document (the surrogates are inside its strings), whose
    backslash is escaped too, so that it reads back as those six characters."""
    if _SURROGATE.search(text) is None:
        return text
    escape = "\\\\u%04x" if in_json else "\\u%04x"
    return _SURROGATE.sub(lambda m: escape % ord(m.group()), text)
# records.parquet's column types, by QueryRecord's field types (strings as pandas writes them: large_string)
_ARROW_TYPES = {"str": "large_string", "str | None": "large_string", "int": "int64", "float": "float64",
                "float | None": "float64", "bool | None": "bool", "tuple[str, ...]": "list<large_string>"}
RECORDS_CHUNK = 50_000  # records per row group of records.parquet, and per step of writing it


def record_schema() -> pa.Schema:
    """records.parquet's Arrow schema: one column per :class:`QueryRecord` field, typed by ``_ARROW_TYPES``."""
    import pyarrow as pa

    types: dict[str, pa.DataType] = {"large_string": pa.large_string(), "int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_(),
             "list<large_string>": pa.list_(pa.large_string())}
    return pa.schema([(f.name, types[_ARROW_TYPES[str(f.type)]]) for f in dataclasses.fields(QueryRecord)])

@dataclass(frozen=True)
class SamplerOverhead:
    """A sensor thread's own cost, one entry of a manifest backend's ``sampler_overhead`` (by sensor name):
    CPU seconds of the thread, the seconds it was measured over, and their ratio, under the keys every sensor
    writes (``cpu_s``, ``wall_s``, ``cpu_fraction_of_one_core``).  ``OLD_KEYS``: what the RAPL/CPU-model
    snapshot thread wrote before (run folders of earlier versions), read here and nowhere else."""

    OLD_KEYS: ClassVar[dict[str, str]] = {"wall_s": "active_s", "cpu_fraction_of_one_core": "fraction_of_core"}

    cpu_s: float | None
    wall_s: float | None
    cpu_fraction_of_one_core: float | None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplerOverhead":
        def value(key: str) -> float | None:
            found = data.get(key, data.get(cls.OLD_KEYS.get(key, key)))
            return None if found is None else float(found)

        return cls(*(value(f.name) for f in dataclasses.fields(cls)))


def sampler_overheads(backend: dict[str, Any]) -> dict[str, SamplerOverhead]:
    """A manifest backend entry's ``sampler_overhead``, typed (sensors that reported nothing left out)."""
    table = backend.get("sampler_overhead") or {}
    return {name: SamplerOverhead.from_dict(o) for name, o in table.items() if isinstance(o, dict) and o}


JUDGE_SCHEMA_VERSION = 1  # judge.jsonl lines written before the field existed have this layout: read as 1


@dataclass(frozen=True)
class JudgeEntry:
    """One line of ``judge.jsonl``: what the judge did, and cost, for one record of a rescored run
    (``ipw.rescore``); written by :meth:`RunFolder.append_judge`, read by :func:`read_judge`.  A record the
    judge did not grade has no calls and one string verdict saying why (error, empty, unscored)."""

    backend: str
    query_id: str
    repeat: int
    category: str
    judge: str  # the judge backend's name
    judge_model: str
    grading: str  # reference | pairwise | vs-backend
    vs_backend: str | None
    prompt_version: str
    correct: bool
    verdicts: tuple[str, ...]
    judge_outputs: tuple[str, ...]
    judge_errors: tuple[str, ...]
    judge_calls: int
    judge_prompt_tokens: int
    judge_completion_tokens: int
    judge_latency_s: float
    judge_energy_j: float | None  # None: no call, or a call's energy unavailable
    judge_energy_quality: str | None  # the calls' qualities, comma-joined
    judge_energy_source: str | None
    judge_cost_usd: float | None
    schema_version: int = JUDGE_SCHEMA_VERSION

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "judge.jsonl") -> "JudgeEntry":
        """An entry from a parsed line (an unversioned line is version 1; a newer one is an IpwError)."""
        version = data.get("schema_version", 1)
        if not isinstance(version, int) or version > JUDGE_SCHEMA_VERSION:
            raise IpwError(f"{where}: field 'schema_version': {version!r}, written by a newer ipw (this one reads "
                           f"up to {JUDGE_SCHEMA_VERSION}); upgrade ipw")
        tuples = ("verdicts", "judge_outputs", "judge_errors")
        out: dict[str, Any] = {f.name: data.get(f.name) for f in dataclasses.fields(cls)}
        missing = [k for k in ("backend", "query_id", "judge_calls", "verdicts") if out[k] is None]
        if missing:
            raise IpwError(f"{where}: field '{missing[0]}': missing")
        return cls(**{**out, **{k: tuple(out[k] or ()) for k in tuples}, "category": out["category"] or "",
                      "repeat": int(out["repeat"] or 0), "correct": bool(out["correct"]), "schema_version": version})

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)


def new_run_id(now: dt.datetime | None = None) -> str:
    now = now or dt.datetime.now()
    return f"{now:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def write_error(path: Path, exc: OSError) -> IpwError:
    """An OS error writing a run folder's file (the disk is full, a quota, a file size limit, a read-only
    file system) as one line naming the file."""
    what = exc.strerror or type(exc).__name__
    return IpwError(f"{path}: cannot write it ({what}); free space or choose another --out, then "
                    f"ipw run --resume {path.parent}")


def _atomic_write(path: Path, tmp: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)``, then rename it to ``path``: a crash never leaves a truncated file, and an OS error
    (disk full) leaves no temporary file and raises an IpwError naming ``path``."""
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_error(path, exc) from None
    except BaseException:  # e.g. a damaged record found while the file was being written
        tmp.unlink(missing_ok=True)
        raise


def _atomic_write_parquet(frame: pd.DataFrame, path: Path) -> None:
    _atomic_write(path, path.with_suffix(".parquet.tmp"), lambda tmp: frame.to_parquet(tmp, index=False))


def _json_text(data: dict[str, Any]) -> str:
    from ipw.sanitize import scrub  # e.g. a ``reason`` that quotes an exception which quoted a header

    return escape_surrogates(scrub(json.dumps(data, indent=2, ensure_ascii=False, default=str)), in_json=True) + "\n"


def _atomic_write_json(path: Path, data: dict[str, Any]) -> None:
    text = _json_text(data)
    _atomic_write(path, path.with_suffix(".tmp"), lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _rewrite_in_place(path: Path, text: str) -> bool:
    """Overwrite ``path`` in the blocks it already has (when the disk is too full for a temporary copy):
    only when ``text`` fits in them, so that no new block is needed. Whether it was written."""
    data = text.encode("utf-8")
    try:
        if len(data) > path.stat().st_blocks * 512:
            return False
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class RunManifest:
    """manifest.json, typed (docs/ARCHITECTURE.md, 'The files of a run folder'): written only by :class:`RunFolder`, read by
    :meth:`RunManifest.read` (``read_manifest`` checked). A field that is None is absent from the file;
    the nested tables (config, dataset, hardware, backends, ...) are the JSON objects as written."""

    run_id: str
    status: str = "running"
    schema_version: int = SCHEMA_VERSION
    ipw_version: str | None = None
    command: list[str] | None = None
    config: dict[str, Any] | None = None  # RunConfig.to_dict()
    dataset: dict[str, Any] | None = None  # name, n_queries, fingerprint
    shard: dict[str, Any] | None = None  # index, count, dataset (the full set) of a --shard run
    hardware: dict[str, Any] | None = None
    hardware_by_id: dict[str, Any] | None = None  # every machine whose records the run holds
    software: dict[str, Any] | None = None
    started_at: str | None = None
    backends: list[dict[str, Any]] | None = None  # what each backend reported (sensors, idle baseline, ...)
    finished_at: str | None = None
    reason: str | None = None  # why a run failed or was interrupted
    resumed_at: list[str] | None = None
    ray: dict[str, Any] | None = None  # the Ray tasks of a --ray run
    merged_from: list[dict[str, Any]] | None = None  # the shards of an ipw merge run
    merged_at: str | None = None
    rescored_from: dict[str, Any] | None = None
    rescored_at: str | None = None
    judge: dict[str, Any] | None = None  # the judge of ipw rescore --scorer judge
    # what records.parquet was built from: the count and sha256 of records.jsonl when it was written
    # (readers trust the Parquet file only while the log still matches; see trusted_parquet)
    records: dict[str, Any] | None = None
    # the grid's carbon intensity the run carries (ipw.carbon: g_per_kwh, source, zone, date); g_per_kwh None:
    # asked for, but the live feed gave none (its error says why)
    carbon: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys this ipw does not know, kept as they were

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunManifest":
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in data.items() if k in known},
                   extra={k: v for k, v in data.items() if k not in known})

    @classmethod
    def read(cls, run_dir: str | Path, require: tuple[str, ...] = ()) -> "RunManifest":
        """The checked manifest of a run folder (``read_manifest``: one-line errors)."""
        return cls.from_dict(read_manifest(run_dir, require))

    @classmethod
    def read_unfinished(cls, run_dir: str | Path) -> "RunManifest":
        """The manifest of a run folder that ``--resume`` can continue: with its config and dataset
        fingerprint, not complete (else an IpwError)."""
        manifest = cls.read(run_dir, require=("config", "dataset.fingerprint"))
        if manifest.status == "complete":
            raise IpwError(f"{run_dir}: the run is already complete; nothing to resume")
        return manifest

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**{k: v for k, v in out.items() if v is not None}, **self.extra}


LOCK_FILE = "ipw.lock"
#: A second writer that finds the folder locked waits at most this long (s) for the holder's PID, which the
#: holder writes just after it takes the lock, so that the refusal can name it.
HOLDER_WAIT_S = 1.0


def manifest_file(run_dir: str | Path) -> Path:
    """A run folder's manifest as a file (an artifact to upload, say), never a link to one elsewhere."""
    return own_file(Path(run_dir) / "manifest.json")


def manifest_field(run_dir: str | Path, name: str) -> str:
    """Where an error about a manifest's field points: ``RUN_DIR/manifest.json: field 'NAME'``."""
    return f"{Path(run_dir) / 'manifest.json'}: field '{name}'"


def own_file(path: Path) -> Path:
    """``path`` as a file of a run folder: a symbolic link (to a file outside it, say) is refused, so that
    no reader trusts and no writer appends to a file the folder does not hold."""
    if path.is_symlink():
        raise IpwError(f"{path}: a symbolic link; a run folder holds its own files (copy the target there)")
    return path


class FolderLock:
    """One writer per run folder: an advisory ``fcntl.flock`` on ``ipw.lock`` in it, held from the moment a
    run, resume, merge or rescore opens the folder until it finishes (or its process ends: the kernel
    releases a dead process's lock). The file holds the holder's PID while it writes, so that a second
    writer can name it; a PID left there by a process that was killed is a stale lock, taken over with a
    note."""

    def __init__(self, folder: Path) -> None:
        import fcntl

        self.fd = -1
        path = own_file(folder / LOCK_FILE)
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise IpwError(f"{path}: cannot open the run folder's lock ({exc.strerror})") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            deadline = time.monotonic() + HOLDER_WAIT_S
            while holder is None and time.monotonic() < deadline:  # it writes its PID just after it locks
                time.sleep(0.01)
                holder = self._holder()
            os.close(self.fd)
            self.fd = -1
            raise IpwError(f"{folder}: another ipw process (pid {holder or 'unknown'}) is writing this run "
                           "folder; wait for it to end, or stop it, then try again") from None
        stale = self._holder()
        if stale and stale != os.getpid():
            import sys

            alive = _pid_alive(stale)
            print(f"note: {folder}: took over the lock of ipw pid {stale}, "
                  f"{'which holds it no longer' if alive else 'which is no longer running'}",
                  file=sys.stderr, flush=True)
        pid = f"{os.getpid()}\n".encode()
        os.pwrite(self.fd, pid, 0)  # then cut what a longer stale PID left: a reader never sees the file empty
        os.ftruncate(self.fd, len(pid))

    def _holder(self) -> int | None:
        try:
            text = os.pread(self.fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def __del__(self) -> None:
        self.release()

    def release(self) -> None:
        """Clear the PID (a clean end leaves no stale lock) and unlock."""
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        os.close(self.fd)  # closing the descriptor releases the flock
        self.fd = -1


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class RunFolder:
    """Writes one run folder, as its only writer (:class:`FolderLock`). The manifest is rewritten
    atomically as the run progresses."""

    path: Path
    manifest: RunManifest
    write_failure: IpwError | None = None  # the first record that could not be written (disk full)
    lock: FolderLock | None = None
    _keys: DoneKeys | None = field(default=None, repr=False)  # read by reopen

    @classmethod
    def create(cls, out_dir: str | Path, run_id: str, manifest: RunManifest) -> "RunFolder":
        """A new folder ``out_dir/run_id`` with ``manifest`` (status running)."""
        path = Path(out_dir) / run_id
        try:
            path.mkdir(parents=True, exist_ok=False)
        except OSError as exc:
            raise IpwError(f"{path}: cannot create the run folder ({exc.strerror})") from None
        folder = cls(path, dataclasses.replace(manifest, run_id=run_id, status="running", schema_version=SCHEMA_VERSION),
                     lock=FolderLock(path))
        folder.write_manifest()
        (path / "records.jsonl").touch()
        return folder

    @classmethod
    def reopen(cls, run_dir: str | Path) -> "RunFolder":
        """Reopen an unfinished run folder for ``--resume`` (``RunManifest.read_unfinished``; the caller has
        read its config): the log holds only records (else an IpwError, before anything changes); a torn
        last line is cut off."""
        path = Path(run_dir)
        RunManifest.read_unfinished(path)  # before the lock: a folder that cannot be resumed is left as it was
        lock = FolderLock(path)
        try:
            manifest = RunManifest.read_unfinished(path)  # again, as the only writer: another may have finished it
            log = own_file(path / "records.jsonl")
            # every line but a torn last one is a record (checked before anything changes)
            keys = record_keys(log)
            if keys is None:  # the fast reader refused a line: find which, and what is wrong with it
                read_records(log)
                keys = None
            if log.exists():
                _cut_torn_tail(log)  # the query in flight when the process died
            if fold_pending(path):  # ipw serve's answered requests whose final record the kill kept out of the log
                keys = record_keys(log)
            # the records appended from now on are not in records.parquet: readers must not trust it
            (path / "records.parquet").unlink(missing_ok=True)
        except BaseException:
            lock.release()
            raise
        folder = cls(path, manifest, lock=lock)
        folder._keys = keys
        return folder

    def done_keys(self) -> DoneKeys:
        """(backend, query_id, repeat, concurrency) of every record already written (concurrency 1 in
        runs older than the field)."""
        keys = self._keys if self._keys is not None else record_keys(self.path / "records.jsonl")
        if keys is not None:
            return keys
        frame = load_records_jsonl(self.path / "records.jsonl")
        levels = frame["concurrency"].fillna(1).astype(int)
        return DoneKeys.of(zip(frame["backend"], frame["query_id"], frame["repeat"].astype(int), levels))

    def keep_queries(self, queries: list[Any], source: Path) -> None:
        """A large run's query set as loaded (``queries.parquet``), with the sha256 of its dataset file
        ``source`` and of the copy in the manifest's ``dataset``, so that ``--resume`` need not parse it again
        (``read_kept_queries``)."""
        self.write_manifest(dataset={**(self.manifest.dataset or {}), "file_sha256": file_sha256(source),
                                     "queries_file": QUERIES_FILE,
                                     "queries_sha256": write_queries(self.path / QUERIES_FILE, queries)})

    def records_of(self, backend: str) -> list[dict[str, Any]]:
        """The records of ``backend`` in the log (``records.jsonl``), as parsed rows."""
        log = self.path / "records.jsonl"
        return [r for r in read_records(log) if r.get("backend") == backend] if log.is_file() else []

    def write_manifest(self, **updates: Any) -> None:
        """Update fields of the manifest (a name that is not a field is a TypeError) and rewrite it."""
        self.manifest = dataclasses.replace(self.manifest, **updates)
        path = self.path / "manifest.json"
        try:
            _atomic_write_json(path, self.manifest.to_dict())
        except IpwError:  # the disk is full: the manifest must still say how the run ended
            if not _rewrite_in_place(path, _json_text(self.manifest.to_dict())):
                raise

    def pending_log(self) -> PendingLog:
        """``ipw serve``'s log of answered requests whose final record is not written yet (``PendingLog``)."""
        return PendingLog(self.path / PENDING_FILE)

    def append(self, record: QueryRecord) -> None:
        self.append_many([record])

    def append_many(self, records: list[QueryRecord]) -> None:
        """Append records to records.jsonl in one write and one fsync: on disk when this returns (the
        runner reports a record only after that, so a kill -9 loses nothing reported)."""
        log = self.path / "records.jsonl"
        if not records:
            return
        try:
            _append_synced(log, "".join(record.to_json() + "\n" for record in records))
        except IpwError as exc:  # a part of the line may be there: a torn last line, which resume drops
            self.write_failure = self.write_failure or exc
            raise self.write_failure from None

    def add_power(self, backend: str, columns: dict[str, Any]) -> None:
        """Append a backend's raw telemetry (t_s, device, power_w, kind, energy_j) to power.parquet."""
        import pandas as pd

        frame = pd.DataFrame(columns)
        if frame.empty:
            return
        frame.insert(0, "backend", backend)
        path = self.path / "power.parquet"
        if path.exists():
            frame = pd.concat([pd.read_parquet(path), frame], ignore_index=True)
        _atomic_write_parquet(frame, path)

    def finish(self, status: str, **updates: Any) -> None:
        """records.parquet from the log, then the manifest's final status.  When the Parquet file cannot be
        written (the disk is full), the manifest still records the run as ``failed`` with that reason; then
        the first write error of the run is raised (an IpwError naming the file)."""
        problem: IpwError | None = None
        try:
            fold_pending(self.path)  # ipw serve: whatever is still pending (nothing, when every record was written)
            write_records_parquet(self.path / "records.jsonl", self.path / "records.parquet")
            updates["records"] = {**log_digest(self.path / "records.jsonl"), **log_tail(self.path / "records.jsonl")}
        except IpwError as exc:
            problem = exc
            status = "failed"
            updates["reason"] = "; ".join(r for r in (updates.get("reason"), exc.message) if r)
        try:
            self.write_manifest(status=status, finished_at=dt.datetime.now().isoformat(timespec="seconds"), **updates)
        finally:
            if self.lock is not None:
                self.lock.release()
        if problem is not None:
            raise self.write_failure or problem

    def log_frame(self) -> pd.DataFrame:
        """The records written so far (records.jsonl) as a frame (``load_records_jsonl``)."""
        return load_records_jsonl(self.path / "records.jsonl")

    def write_power(self, frame: pd.DataFrame) -> None:
        """power.parquet as ``frame`` (merge: the shards' traces), replacing any there."""
        _atomic_write_parquet(frame, self.path / POWER_FILE)

    def copy_power(self, run_dir: str | Path) -> None:
        """The power.parquet of ``run_dir``, copied as it is (rescore: the same records, the same trace)."""
        import shutil

        source = own_file(Path(run_dir) / POWER_FILE)
        if source.exists():
            shutil.copy2(source, self.path / POWER_FILE)

    def start_judge(self) -> None:
        """An empty judge.jsonl: the run is judged, even before its first entry."""
        (self.path / JUDGE_FILE).touch()

    def append_judge(self, entry: JudgeEntry) -> None:
        """One judge.jsonl line, on disk (fsynced) when this returns."""
        _append_synced(self.path / JUDGE_FILE, entry.to_json() + "\n")

    def read_judge(self) -> list[JudgeEntry]:
        return read_judge(self.path)


POWER_FILE = "power.parquet"
JUDGE_FILE = "judge.jsonl"


def _append_synced(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` in one write and fsync it (an OS error: an IpwError naming the file)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        with open(fd, "a", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise write_error(path, exc) from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


PENDING_FILE = "pending.jsonl"


def record_key(row: dict[str, Any] | QueryRecord) -> tuple[str, str, int, int]:
    """What identifies a record of a log (its ``KEY_FIELDS`` and concurrency level; 1 in older runs)."""
    get = row.get if isinstance(row, dict) else lambda name: getattr(row, name)
    return str(get("backend")), str(get("query_id")), int(get("repeat") or 0), int(get("concurrency") or 1)


class PendingLog:
    """``ipw serve``'s ``pending.jsonl``: the record of each answered request, on disk (fsynced) before its answer
    leaves (``add``), until its final record is in records.jsonl (``done``).  Its energy is the settled one
    (``--energy-wait``), else the provisional one the answer carried, labelled so by the caller.  A kill in between
    loses no request a client saw answered: every reader of records.jsonl takes an entry whose key the log lacks as
    a record (``record_chunks``), and ``--resume`` and ``finish`` move those into the log (``fold_pending``).  The
    file is emptied whenever no entry is outstanding, so that it stays small."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._outstanding: set[tuple[str, str, int, int]] = set()
        try:
            self._fd = os.open(own_file(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise write_error(path, exc) from None

    def add(self, record: QueryRecord) -> None:
        """``record`` on disk when this returns (an OS error: an IpwError naming the file, and nothing of it left
        there)."""
        data = (record.to_json() + "\n").encode("utf-8")
        with self._lock:
            size = os.fstat(self._fd).st_size
            try:
                _write_all(self._fd, data)
            except OSError as exc:
                os.ftruncate(self._fd, size)  # no torn line, which would stop every read of the folder
                raise write_error(self.path, exc) from None
            self._outstanding.add(record_key(record))
        try:
            os.fsync(self._fd)  # outside the lock: requests that end together share the disk's flushes
        except OSError as exc:
            raise write_error(self.path, exc) from None

    def done(self, record: QueryRecord) -> None:
        """``record``'s final line is in records.jsonl (fsynced): its entry is no longer needed."""
        with self._lock:
            self._outstanding.discard(record_key(record))
            if not self._outstanding:
                try:
                    os.ftruncate(self._fd, 0)
                except OSError:  # kept: readers skip entries the log holds
                    pass

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _pending_rows(log: Path) -> dict[tuple[str, str, int, int], dict[str, Any]]:
    """The entries of the pending.jsonl beside a records.jsonl (the last per key), {} without one."""
    side = log.with_name(PENDING_FILE)
    if log.name != "records.jsonl" or not own_file(side).is_file() or side.stat().st_size == 0:
        return {}
    return {record_key(row): row for chunk in _log_chunks(side, RECORDS_CHUNK) for row in chunk}


def fold_pending(run_dir: str | Path) -> int:
    """Append to records.jsonl (fsynced) each pending.jsonl entry whose key it lacks, then remove pending.jsonl:
    the answered requests of an ``ipw serve`` that stopped (or was killed) before their final record was
    written.  Returns how many were added.  Run by ``--resume`` and ``finish``; a fold cut short is done again
    (an entry the log holds is skipped)."""
    side = own_file(Path(run_dir) / PENDING_FILE)
    if not side.is_file():
        return 0
    log = Path(run_dir) / "records.jsonl"
    left = _pending_rows(log)
    if left and log.exists():
        _cut_torn_tail(log)  # an append after a torn line would make it a damaged line in the middle
        for chunk in _log_chunks(log, RECORDS_CHUNK):
            for row in chunk:
                left.pop(record_key(row), None)
    if left:
        _append_synced(log, "".join(escape_surrogates(json.dumps(row, ensure_ascii=False), in_json=True) + "\n"
                                    for row in left.values()))
    side.unlink()
    return len(left)


QUERIES_FILE = "queries.parquet"  # a large run's query set as loaded, so that --resume need not parse it again


def read_kept_queries(run_dir: str | Path, manifest: RunManifest) -> KeptQueries | None:
    """A large run's queries as it loaded them (``RunFolder.keep_queries``), when neither the dataset file,
    nor that copy, nor ipw's version changed since; else None (the dataset is loaded again)."""
    from ipw import __version__
    from ipw.datasets import resolve_dataset

    entry = manifest.dataset or {}
    copy = Path(run_dir) / QUERIES_FILE
    if not entry.get("queries_file") or manifest.ipw_version != __version__ or not copy.is_file():
        return None
    try:
        source = resolve_dataset((manifest.config or {})["dataset"])
        if not source.is_file() or file_sha256(source) != entry.get("file_sha256") \
                or file_sha256(copy) != entry.get("queries_sha256"):
            return None
    except (IpwError, OSError, KeyError):
        return None
    return KeptQueries.read(copy, entry.get("name", ""), entry["fingerprint"])


def file_sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(own_file(path), "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def write_queries(path: Path, queries: list[Any]) -> str:
    """The run's queries (``ipw.datasets.Query``) as Parquet; returns the file's sha256."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "id": [q.id for q in queries], "prompt": [q.prompt for q in queries], "answer": [q.answer for q in queries],
        "choices": pa.array([list(q.choices) if q.choices else None for q in queries], type=pa.list_(pa.string())),
        "category": [q.category for q in queries], "scorer": [q.scorer for q in queries],
    })
    _atomic_write(path, path.with_suffix(".parquet.tmp"), lambda tmp: pq.write_table(table, tmp))
    return file_sha256(path)


@dataclass(frozen=True)
class KeptQueries:
    """A run's copy of its queries (queries.parquet, ``write_queries``) as an Arrow table: ``--resume``
    builds ``Query`` objects only for the rows it runs (``take``), found by their ``ids`` (``DoneKeys.left``).
    ``name`` and ``fingerprint``: the manifest's ``dataset`` entry, which the copy was checked against."""

    table: pa.Table
    name: str
    fingerprint: str

    @classmethod
    def read(cls, path: Path, name: str, fingerprint: str) -> "KeptQueries":
        import pyarrow.parquet as pq

        return cls(pq.ParquetFile(own_file(path)).read(), name, fingerprint)  # (read_table would import pandas)

    def __len__(self) -> int:
        return self.table.num_rows

    def ids(self) -> pa.Array[Any]:
        return self.table.column("id").combine_chunks()

    def take(self, rows: np.ndarray) -> list[Any]:
        """The ``ipw.datasets.Query`` of each row (numpy integers), in the order given."""
        import gc

        import numpy as np
        import pyarrow as pa

        from ipw.datasets import Query

        index = pa.py_buffer(np.asarray(rows, np.int64).tobytes())  # as Arrow's (pa.array would import pandas)
        cols = self.table.take(pa.Array.from_buffers(pa.int64(), len(rows), [None, index])).to_pydict()
        enabled = gc.isenabled()
        gc.disable()  # a million new objects: the collector would walk them again and again (a third of the time)
        try:
            return [Query(i, p, a, tuple(c) if c else None, cat, sc) for i, p, a, c, cat, sc in
                    zip(cols["id"], cols["prompt"], cols["answer"], cols["choices"], cols["category"], cols["scorer"])]
        finally:
            if enabled:
                gc.enable()


Group = tuple[str, int, int]  # (backend, repeat, concurrency): the records of one pass over the queries


@dataclass(frozen=True)
class DoneKeys:
    """What a run's log holds (``record_keys``): the distinct ids of the queries done in each (backend,
    repeat, concurrency), as Arrow string arrays (a million of them: no Python tuple per record).  As a
    collection: its (backend, query_id, repeat, concurrency) keys."""

    ids: dict[Group, pa.Array[Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, keys: Iterable[tuple[str, str, int, int]]) -> "DoneKeys":
        """From (backend, query_id, repeat, concurrency) keys."""
        import pyarrow as pa

        groups: dict[Group, set[str]] = {}
        for backend, query_id, repeat, level in keys:
            groups.setdefault((backend, int(repeat), int(level)), set()).add(query_id)
        return cls({g: pa.array(sorted(ids), pa.string()) for g, ids in groups.items()})

    @classmethod
    def from_columns(cls, backend: pa.Array[Any], query_id: pa.Array[Any], repeat: pa.Array[Any],
                     level: pa.Array[Any]) -> "DoneKeys":
        """From a log's key columns (no nulls): Arrow's kernels once per (backend, repeat, level) there is
        (a few).  Only Arrow values go in: Arrow's group_by, or a Python value given to a kernel, would
        import pandas (half a second of a resume)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        repeat, level = pc.cast(repeat, pa.int64()), pc.cast(level, pa.int64())
        ids: dict[Group, pa.Array[Any]] = {}
        for b in pc.unique(backend):
            of_b = pc.equal(backend, b)
            for r in pc.unique(repeat.filter(of_b)):
                of_br = pc.and_(of_b, pc.equal(repeat, r))
                for c in pc.unique(level.filter(of_br)):
                    group = (cast(str, b.as_py()), cast(int, r.as_py()), cast(int, c.as_py()))
                    ids[group] = pc.unique(query_id.filter(pc.and_(of_br, pc.equal(level, c))))
        return cls(ids)

    def __len__(self) -> int:
        return sum(len(ids) for ids in self.ids.values())

    def __iter__(self) -> Iterator[tuple[str, str, int, int]]:
        for (backend, repeat, level), ids in self.ids.items():
            for query_id in cast("list[str]", ids.to_pylist()):
                yield backend, query_id, repeat, level

    def __contains__(self, key: object) -> bool:
        backend, query_id, repeat, level = cast("tuple[str, str, int, int]", key)
        return query_id in self.done_ids(backend, repeat, level)

    def done_ids(self, backend: str, repeat: int, level: int) -> frozenset[str]:
        """The ids done in one (backend, repeat, concurrency), as a Python set."""
        ids = self.ids.get((backend, repeat, level))
        return frozenset() if ids is None else frozenset(cast("list[str]", ids.to_pylist()))

    def left(self, ids: pa.Array[Any], groups: Iterable[Group]) -> np.ndarray:
        """Which of the queries ``ids`` (a run's, in order) still have a record to make in any of ``groups``
        (each backend's repeats and concurrency levels): a boolean mask, Arrow's ``is_in`` per group."""
        import numpy as np
        import pyarrow.compute as pc

        import pyarrow as pa

        left = np.zeros(len(ids), dtype=bool)
        for group in groups:
            done = self.ids.get(group)
            if done is None:
                return np.ones(len(ids), dtype=bool)
            found = pc.cast(pc.is_in(ids, value_set=done), pa.uint8())  # (to_numpy would import pandas)
            left |= np.frombuffer(memoryview(cast("pa.Buffer", found.buffers()[1])), np.uint8, len(found), found.offset) == 0
        return left


def record_keys(path: Path) -> DoneKeys | None:
    """(backend, query_id, repeat, concurrency) of every record of a ``records.jsonl`` (``--resume``: what is
    done); None when any line is not a complete record (then ``read_records`` names it).  A torn last line
    is left out, as by ``read_records``.

    Fast path (``_framed_keys``): the lines ``QueryRecord.to_json`` writes are read by their frame only, the
    fields before ``repeat`` and after ``concurrency``, without parsing the JSON between (for 500,000
    records of the fake engine, 2.7 CPU seconds instead of 5.5 on a loaded 2-core VM).  A line whose frame
    is not that (an older record, an escaped key, damage) sends the whole log through Arrow's JSON reader,
    which parses every line.  The JSON between the frames is
    parsed when records.parquet is written (``RunFolder.finish``), where a damaged line is named."""
    import pyarrow as pa

    try:
        whole = _complete_length(own_file(path))  # a torn last line is left out, as by read_records
        if whole == 0:
            return DoneKeys()
        with pa.memory_map(str(path)) as mm:
            data = mm.read_buffer(whole)
            keys = _framed_keys(data)
            return keys if keys is not None else _json_keys(data)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError):
        return None


_STR = r'"(?:[^"\\]|\\.)*"'  # a JSON string
_HEAD = (r'^\{"run_id": ' + _STR + r', "backend": "(?P<backend>[^"\\]*)", "model": ' + _STR + r', "role": ' + _STR
         + r', "query_id": "(?P<query_id>[^"\\]*)", "category": ' + _STR + r', "repeat": (?P<repeat>\d+), ')
_TAIL = r', "concurrency": (?P<concurrency>\d+), "split_method": ' + _STR + r', "split_uncertainty_j": [^,"]+\}\n$'
_TAIL_BYTES = 160  # the end of a line, which holds concurrency and the fields after it


def _framed_keys(data: pa.Buffer) -> DoneKeys | None:
    """The keys of the log ``data`` (complete lines) from each line's head and tail (``record_keys``), or
    None when a line does not have the frame ``QueryRecord.to_json`` writes.  Lines are found with numpy and
    matched by Arrow's regular expressions (RE2, anchored: only each line's first and last bytes are read)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    step, view = 1 << 26, memoryview(data)
    ends = [np.flatnonzero(np.frombuffer(view, np.uint8, min(step, data.size - at), at) == 10) + (at + 1)
            for at in range(0, data.size, step)]
    offsets = np.concatenate([np.zeros(1, np.int64), *ends]).astype(np.int64)
    lines = pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(offsets) - 1,
                                             [None, pa.py_buffer(offsets.tobytes()), data])
    head = pc.extract_regex(lines.cast(pa.large_string()), _HEAD)  # the cast checks UTF-8
    tail = pc.extract_regex(pc.binary_slice(lines, -_TAIL_BYTES), _TAIL)
    if head.null_count or tail.null_count:
        return None
    return DoneKeys.from_columns(head.field("backend"), head.field("query_id"), head.field("repeat"),
                                 tail.field("concurrency"))  # no nulls (above)


def _json_keys(data: pa.Buffer) -> DoneKeys | None:
    """The keys of the log ``data`` with every line parsed by Arrow's JSON reader (C++, 10-20x faster
    than Python's json for a large log)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    fields: list[tuple[str, pa.DataType]] = [("backend", pa.string()), ("query_id", pa.string()),
                                             ("repeat", pa.int64()), ("concurrency", pa.int64())]
    schema = pa.schema(fields)
    table = pj.read_json(pa.BufferReader(data),  # type: ignore[arg-type]  # pyarrow-stubs 20: any NativeFile works
                         read_options=pj.ReadOptions(block_size=1 << 24),
                         parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"))
    if any(table.column(k).null_count for k in KEY_FIELDS):
        return None
    backend, query_id, repeat, given = (table.column(k).combine_chunks() for k in (*KEY_FIELDS, "concurrency"))
    level = pc.fill_null(pc.if_else(pc.equal(given, pa.scalar(0)), 1, given), 1)  # absent (older runs) or 0: 1
    return DoneKeys.from_columns(backend, query_id, repeat, level)


def _complete_length(log: Path) -> int:
    """The bytes of a log up to its last newline (read back from the end, not the whole file)."""
    with open(log, "rb") as fh:
        pos = fh.seek(0, os.SEEK_END)
        while pos > 0:
            start = max(0, pos - (1 << 20))
            fh.seek(start)
            cut = fh.read(pos - start).rfind(b"\n")
            if cut >= 0:
                return start + cut + 1
            pos = start
    return 0


def _cut_torn_tail(log: Path) -> None:
    """Cut a log after its last newline: the query in flight when the process died."""
    whole = _complete_length(log)
    if whole != log.stat().st_size:
        os.truncate(log, whole)


def log_digest(log: Path) -> dict[str, Any]:
    """The record count (lines) and sha256 of a records.jsonl, as the manifest stores them."""
    import hashlib

    digest, count = hashlib.sha256(), 0
    with open(own_file(log), "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
            count += block.count(b"\n")
    return {"count": count, "jsonl_sha256": digest.hexdigest()}


LOG_TAIL_BYTES = 1 << 20


def log_tail(log: Path) -> dict[str, Any]:
    """The size of a records.jsonl and the sha256 of its last MiB: what a reader checks, in place of the
    whole log's digest (seconds for a million records), to know the log is the one records.parquet was
    written from (a resume appends to it; ``--repair`` rewrites it)."""
    import hashlib

    with open(own_file(log), "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(0, size - LOG_TAIL_BYTES))
        return {"bytes": size, "tail_sha256": hashlib.sha256(fh.read()).hexdigest()}


def trusted_parquet(run_dir: str | Path, manifest: dict[str, Any]) -> Path | None:
    """The run folder's records.parquet when it holds what records.jsonl holds: its manifest's ``records``
    entry (the log's size and the sha256 of its last MiB when the Parquet file was written, ``log_tail``;
    in folders written before those, its count and whole sha256) matches the log now.  None when there is
    none, or it is stale (a resume appended to the log, a run was killed during a resume): then the log is
    read, with a note.  A folder written before the entry existed: trusted when complete."""
    path = Path(run_dir)
    parquet = own_file(path / "records.parquet")
    log = path / "records.jsonl"
    if not parquet.exists():
        return None
    entry = manifest.get("records")
    if not isinstance(entry, dict) or not log.exists():
        if manifest.get("status") == "complete" or not log.exists():
            return parquet
        _stale(parquet, "")
        return None
    if "tail_sha256" in entry:
        if log_tail(log) == {"bytes": entry.get("bytes"), "tail_sha256": entry["tail_sha256"]}:
            return parquet
    elif log_digest(log) == {"count": entry.get("count"), "jsonl_sha256": entry.get("jsonl_sha256")}:
        return parquet
    _stale(parquet, " (records.jsonl changed since it was written)")
    return None


def _stale(parquet: Path, why: str) -> None:
    import sys

    print(f"note: {parquet}: not used{why}; reading records.jsonl", file=sys.stderr, flush=True)
    return None


def read_manifest(run_dir: str | Path, require: tuple[str, ...] = ()) -> dict[str, Any]:
    """A run folder's manifest.json, checked: a JSON object of a schema this ipw reads, with a known
    ``status``; ``require`` names further fields that must be there (``dataset.fingerprint``)."""
    path = Path(run_dir)
    file = own_file(path / "manifest.json")
    try:
        text = file.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        raise IpwError(f"{path}: not a run folder (no manifest.json)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise IpwError(f"{file}: cannot read it ({type(exc).__name__})") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise IpwError(f"{file}:{exc.lineno}: invalid JSON ({exc.msg}); the manifest is damaged") from None
    except RecursionError:
        raise IpwError(f"{file}: invalid JSON (nested too deeply); the manifest is damaged") from None
    if not isinstance(manifest, dict):
        raise IpwError(f"{file}: expected a JSON object, got {type(manifest).__name__}; the manifest is damaged")
    version = manifest.get("schema_version", SCHEMA_VERSION)
    if isinstance(version, bool) or not isinstance(version, int):
        raise IpwError(f"{file}: field 'schema_version': expected an integer, got {version!r}")
    if version > SCHEMA_VERSION:
        raise IpwError(f"{file}: field 'schema_version': {version} was written by a newer ipw (this one reads up to "
                       f"{SCHEMA_VERSION}); upgrade ipw")
    status = manifest.get("status")
    if status not in STATUSES:
        raise IpwError(f"{file}: field 'status': expected one of {', '.join(STATUSES)}, got {status!r}")
    for key in ("config", "dataset"):
        if key in manifest and not isinstance(manifest[key], dict):
            raise IpwError(f"{file}: field '{key}': expected an object, got {type(manifest[key]).__name__}")
    for field_path in require:
        value: Any = manifest
        for part in field_path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            raise IpwError(f"{file}: field '{field_path}': missing")
    return manifest


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record in a ``records.jsonl``.  A torn last line (no newline at its end: the query in flight
    when the process died) is left out; any other line that is not a record is an error naming its
    line, so that nothing after it is ever dropped silently."""
    return [row for chunk in record_chunks(path) for row in chunk]


def record_chunks(path: Path, size: int = RECORDS_CHUNK) -> Iterator[list[dict[str, Any]]]:
    """``read_records`` in lists of at most ``size`` rows: a chunk is yielded once its lines are checked (a
    bad line raises when a line follows it, or at the end when it is complete, as in ``read_records``).
    After the log's rows, the entries of a ``pending.jsonl`` beside it whose key the log lacks (``PendingLog``:
    requests ``ipw serve`` answered before their record was final, then was killed)."""
    pending = _pending_rows(path)
    for rows in _log_chunks(path, size):
        for row in rows if pending else ():
            pending.pop(record_key(row), None)
        yield rows
    left = list(pending.values())
    for at in range(0, len(left), size):
        yield left[at:at + size]


def _log_chunks(path: Path, size: int) -> Iterator[list[dict[str, Any]]]:
    """The rows of one JSONL log (``record_chunks``, without pending.jsonl)."""
    try:
        fh = open(own_file(path), encoding="utf-8")
    except FileNotFoundError:
        raise IpwError(f"{path}: missing; the run folder is incomplete") from None
    except OSError as exc:
        raise IpwError(f"{path}: cannot read it ({exc.strerror})") from None
    rows: list[dict[str, Any]] = []
    bad: tuple[int, str, bool] | None = None  # line number, problem, ends with a newline
    number = 0
    with fh:
        try:
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                if bad is not None:  # more follows the bad line: it is not a crash's torn tail
                    raise _torn(path, bad)
                problem = _record_problem(line)
                if problem:
                    bad = (number, problem, line.endswith("\n"))
                else:
                    rows.append(json.loads(line))
                    if len(rows) >= size:
                        yield rows
                        rows = []
        except UnicodeDecodeError as exc:
            raise IpwError(f"{path}:{number + 1}: not valid UTF-8 (byte {exc.start}); to drop this line only: "
                           f"ipw run --resume {path.parent} --repair") from None
    if bad is not None and bad[2]:  # the last line, but complete: damaged, not torn by a crash
        raise _torn(path, bad)
    if rows:
        yield rows


def _torn(path: Path, bad: tuple[int, str, bool]) -> IpwError:
    return IpwError(f"{path}:{bad[0]}: {bad[1]}; the records after it would be lost. To drop this line only "
                    f"(its query runs again): ipw run --resume {path.parent} --repair")


def _record_problem(line: str) -> str | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"torn or corrupt record (invalid JSON: {exc.msg} at column {exc.colno})"
    except RecursionError:
        return "corrupt record (JSON nested too deeply)"
    if not isinstance(row, dict):
        return f"corrupt record (a JSON {type(row).__name__}, not an object)"
    missing = [k for k in KEY_FIELDS if k not in row]
    if missing:
        return f"corrupt record (no field '{missing[0]}')"
    return None


def repair_log(run_dir: str | Path) -> tuple[Path, list[int]]:
    """``ipw run --resume --repair``: the log of an unfinished run without the lines that are not records
    (``repair_records``); returns the log's path and the line numbers dropped."""
    if RunManifest.read(run_dir).status == "complete":
        raise IpwError(f"{run_dir}: the run is already complete; nothing to resume or repair")
    log = Path(run_dir) / "records.jsonl"
    return log, repair_records(log)


def repair_records(path: Path) -> list[int]:
    """Drop the lines of a ``records.jsonl`` that are not records (``ipw run --resume --repair``); they
    are kept in ``records.dropped.jsonl`` beside it.  Returns their line numbers."""
    try:
        lines = path.read_bytes().splitlines(keepends=True)
    except OSError as exc:
        raise IpwError(f"{path}: cannot read it ({exc.strerror})") from None
    keep, dropped, numbers = [], [], []
    for number, raw in enumerate(lines, start=1):
        try:
            text: str | None = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is None or text.strip() and _record_problem(text):
            dropped.append(raw if raw.endswith(b"\n") else raw + b"\n")
            numbers.append(number)
        else:
            keep.append(raw)
    if numbers:
        with open(path.with_name("records.dropped.jsonl"), "ab") as fh:
            fh.writelines(dropped)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(b"".join(keep))
        os.replace(tmp, path)
    return numbers


def load_records_jsonl(path: Path) -> pd.DataFrame:
    import pandas as pd

    frame = pd.DataFrame(read_records(path), columns=RECORD_COLUMNS)
    _check_numeric(frame, path)
    return frame


def write_records_parquet(log: Path, path: Path, chunk: int | None = None) -> None:
    """records.parquet from records.jsonl, ``chunk`` (``RECORDS_CHUNK``) records at a time (one row group
    each, in the ``record_schema`` types): memory holds one chunk, not the run.  Each chunk is checked as
    ``load_records_jsonl`` checks the whole log; the file appears only when complete (atomic rename)."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = record_schema()

    def write(tmp: Path) -> None:
        with pq.ParquetWriter(tmp, schema) as writer:
            for rows in record_chunks(log, chunk or RECORDS_CHUNK):
                frame = pd.DataFrame(rows, columns=RECORD_COLUMNS)
                _check_numeric(frame, log)
                writer.write_table(pa.Table.from_pandas(frame, schema=schema, preserve_index=False))

    _atomic_write(path, path.with_suffix(".parquet.tmp"), write)


def _check_numeric(frame: pd.DataFrame, path: Path) -> None:
    import pandas as pd

    for column in NUMERIC_COLUMNS:
        if column not in frame.columns:
            continue
        values = frame[column]
        if not pd.api.types.is_numeric_dtype(values):  # object, or pandas' string dtype
            numbers = pd.to_numeric(values.map(lambda v: None if isinstance(v, bool) else v), errors="coerce")
            wrong = values.notna() & numbers.isna()
            if wrong.any():
                example = values[wrong].iloc[0]
                raise IpwError(f"{path}: column '{column}': expected numbers, got {type(example).__name__} "
                               f"{str(example)[:40]!r}")
            frame[column] = numbers


def _parquet_schema_problem(schema: pa.Schema, columns: list[str] | None) -> str | None:
    import pyarrow as pa

    names = set(schema.names)
    needed = [c for c in KEY_FIELDS + NUMERIC_COLUMNS if columns is None or c in columns]
    missing = [c for c in needed if c not in names]
    if missing:
        return f"column '{missing[0]}' is missing"
    for column in NUMERIC_COLUMNS:
        if column in names and (columns is None or column in columns):
            kind = schema.field(column).type
            if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
                    or pa.types.is_null(kind) or pa.types.is_decimal(kind)):
                return f"column '{column}': expected numbers, got {kind}"
    return None


def read_parquet(path: Path, **options: Any) -> pd.DataFrame:
    """``pandas.read_parquet`` of a run folder's Parquet file, or an IpwError naming it (pyarrow raises
    many types for a truncated or corrupt file)."""
    import pandas as pd

    try:
        return pd.read_parquet(path, **options)
    except Exception as exc:
        text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise IpwError(f"{path}: cannot read Parquet ({type(exc).__name__}: {text}); the file is damaged") from None


def load_run(run_dir: str | Path, columns: list[str] | None = None, categorical: tuple[str, ...] | list[str] = (),
             require: tuple[str, ...] = ()) -> tuple[RunManifest, pd.DataFrame]:
    """The typed manifest (:class:`RunManifest`) and the records of a run folder (parquet when complete, else
    the JSONL log), read whole or an IpwError naming the file and what is wrong.

    ``columns`` reads only those record columns (default: all); one missing from the file is all null,
    except the record's key and its ``correct`` and ``energy_j``, which must be there.
    ``categorical`` columns come back as pandas categoricals (fast for low-cardinality strings).
    ``require``: manifest fields that must be there (see :func:`read_manifest`).
    """
    path = Path(run_dir)
    data = read_manifest(path, require)
    manifest = RunManifest.from_dict(data)
    parquet = trusted_parquet(path, data)
    if parquet is not None:
        import pandas as pd
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(parquet)
            problem = _parquet_schema_problem(schema, columns)
            if problem:
                raise IpwError(f"{parquet}: {problem}")
            if columns is None:
                return manifest, pd.read_parquet(parquet)
            present = set(schema.names)
            frame = pd.read_parquet(parquet, columns=[c for c in columns if c in present],
                                    read_dictionary=[c for c in categorical if c in present])
        except IpwError:
            raise
        except Exception as exc:  # pyarrow raises many types for a truncated or corrupt file
            text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise IpwError(f"{parquet}: cannot read Parquet ({type(exc).__name__}: {text}); the file is damaged"
                           + (" (its log records.jsonl is there: delete records.parquet to read the log)"
                              if (path / "records.jsonl").exists() else "")) from None
        return manifest, frame.assign(**{c: None for c in columns if c not in present})[columns]
    frame = load_records_jsonl(path / "records.jsonl")
    if columns is not None:
        frame = frame[columns]
    return manifest, frame.astype({c: "category" for c in categorical if c in frame.columns})


# --- the other files of a run folder, read ---------------------------------------------------------------

def read_judge(run_dir: str | Path) -> list[JudgeEntry]:
    """The entries of a run's judge.jsonl ([] for a run no judge graded); a line that is not an entry is
    an IpwError naming it."""
    path = Path(run_dir) / JUDGE_FILE
    if not own_file(path).is_file():
        return []
    entries = []
    try:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, start=1):
                if line.strip():
                    entries.append(JudgeEntry.from_dict(json.loads(line), f"{path}:{number}"))
    except (OSError, ValueError) as exc:
        raise IpwError(f"{path}: cannot read the judge's log ({type(exc).__name__}: {exc})") from None
    return entries


def read_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's records.jsonl (``read_records``: checked, a torn last line left out)."""
    return read_records(Path(run_dir) / "records.jsonl")


def read_power(run_dir: str | Path, columns: list[str] | None = None) -> pd.DataFrame | None:
    """A run's power.parquet (those of ``columns`` it has; all when None), or None when it has none."""
    import pyarrow.parquet as pq

    path = own_file(Path(run_dir) / POWER_FILE)
    if not path.exists():
        return None
    if columns is None:
        return read_parquet(path)
    try:
        present = set(pq.read_schema(path).names)
    except Exception as exc:  # a truncated or corrupt file
        raise IpwError(f"{path}: cannot read Parquet ({type(exc).__name__}); the file is damaged") from None
    return read_parquet(path, columns=[c for c in columns if c in present],
                        read_dictionary=[c for c in ("device", "backend") if c in present and c in columns] or None)


def parquet_rows(run_dir: str | Path) -> int | None:
    """How many records a run's records.parquet holds, from its footer; None without a readable one."""
    import pyarrow.parquet as pq

    path = Path(run_dir) / "records.parquet"
    try:
        return pq.ParquetFile(own_file(path)).metadata.num_rows if path.is_file() else None
    except Exception:  # load_run names what is wrong with the file when it reads it
        return None


def read_record_fields(run_dir: str | Path, rows: list[int], columns: list[str]) -> dict[str, list[Any]]:
    """``columns`` of the records at positions ``rows`` (in the order ``load_run`` reads them), read for those
    rows only: the report's answer texts. A column the run predates is all None."""
    path = Path(run_dir)
    parquet = trusted_parquet(path, read_manifest(path))  # the same file load_run reads
    if parquet is not None:
        import pyarrow.parquet as pq

        present = set(pq.read_schema(parquet).names)
        table = pq.read_table(parquet, columns=[c for c in columns if c in present]).take(rows)
        return {c: (table.column(c).to_pylist() if c in present else [None] * len(rows)) for c in columns}
    frame = load_records_jsonl(path / "records.jsonl")[columns].iloc[rows]  # an unfinished run: its log
    return {c: frame[c].tolist() for c in columns}
