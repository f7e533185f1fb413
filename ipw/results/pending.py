"""``ipw serve``'s pending.jsonl: each answered request's record on disk before its answer leaves
(``PendingLog``), folded into the log by ``--resume`` and ``finish`` (``fold_pending``)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ipw.results.schema import QueryRecord, escape_surrogates
from ipw.results.files import append_synced, cut_torn_tail, own_file, write_all, write_error
from ipw.results.log import RECORDS_CHUNK, PENDING_FILE, log_chunks, pending_rows, record_key

if TYPE_CHECKING:  # imported where used: `import ipw` stays light (tests/commands/test_startup.py)
    pass


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
                write_all(self._fd, data)
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


def fold_pending(run_dir: str | Path) -> int:
    """Append to records.jsonl (fsynced) each pending.jsonl entry whose key it lacks, then remove pending.jsonl:
    the answered requests of an ``ipw serve`` that stopped (or was killed) before their final record was
    written.  Returns how many were added.  Run by ``--resume`` and ``finish``; a fold cut short is done again
    (an entry the log holds is skipped)."""
    side = own_file(Path(run_dir) / PENDING_FILE)
    if not side.is_file():
        return 0
    log = Path(run_dir) / "records.jsonl"
    left = pending_rows(log)
    if left and log.exists():
        cut_torn_tail(log)  # an append after a torn line would make it a damaged line in the middle
        for chunk in log_chunks(log, RECORDS_CHUNK):
            for row in chunk:
                left.pop(record_key(row), None)
    if left:
        append_synced(log, "".join(escape_surrogates(json.dumps(row, ensure_ascii=False), in_json=True) + "\n"
                                    for row in left.values()))
    side.unlink()
    return len(left)
