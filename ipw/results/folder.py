"""A run folder as one process writes it (``RunFolder``), held by its lock (``FolderLock``)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ipw.errors import IpwError
from ipw.results.schema import JUDGE_FILE, JudgeEntry, POWER_FILE, QueryRecord, SCHEMA_VERSION
from ipw.results.files import append_synced, atomic_write_json, atomic_write_parquet, cut_torn_tail, json_text, own_file, rewrite_in_place
from ipw.results.manifest import RunManifest
from ipw.results.log import PENDING_FILE, load_records_jsonl, log_digest, log_tail, read_records, write_records_parquet
from ipw.results.pending import PendingLog, fold_pending
from ipw.results.resume import DoneKeys, QUERIES_FILE, file_sha256, record_keys, write_queries
from ipw.results.readers import read_judge

if TYPE_CHECKING:  # imported where used: `import ipw` stays light (tests/commands/test_startup.py)
    import pandas as pd


LOCK_FILE = "ipw.lock"
#: A second writer that finds the folder locked waits at most this long (s) for the holder's PID, which the
#: holder writes just after it takes the lock, so that the refusal can name it.
HOLDER_WAIT_S = 1.0


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

            alive = pid_alive(stale)
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


def pid_alive(pid: int) -> bool:
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
                cut_torn_tail(log)  # the query in flight when the process died
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
            atomic_write_json(path, self.manifest.to_dict())
        except IpwError:  # the disk is full: the manifest must still say how the run ended
            if not rewrite_in_place(path, json_text(self.manifest.to_dict())):
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
            append_synced(log, "".join(record.to_json() + "\n" for record in records))
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
        atomic_write_parquet(frame, path)

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
        atomic_write_parquet(frame, self.path / POWER_FILE)

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
        append_synced(self.path / JUDGE_FILE, entry.to_json() + "\n")

    def read_judge(self) -> list[JudgeEntry]:
        return read_judge(self.path)


