"""records.jsonl, the log of records (with the pending.jsonl beside it): read in chunks, checked line by
line, repaired, and turned into records.parquet, which readers trust only while the log still matches."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ipw.errors import IpwError
from ipw.results.schema import KEY_FIELDS, NUMERIC_COLUMNS, RECORD_COLUMNS, QueryRecord, record_schema
from ipw.results.files import atomic_write, own_file
from ipw.results.manifest import RunManifest

if TYPE_CHECKING:  # imported where used: `import ipw` stays light (tests/commands/test_startup.py)
    import pandas as pd
    import pyarrow as pa


RECORDS_CHUNK = 50_000  # records per row group of records.parquet, and per step of writing it

PENDING_FILE = "pending.jsonl"


def record_key(row: dict[str, Any] | QueryRecord) -> tuple[str, str, int, int]:
    """What identifies a record of a log (its ``KEY_FIELDS`` and concurrency level; 1 in older runs)."""
    get = row.get if isinstance(row, dict) else lambda name: getattr(row, name)
    return str(get("backend")), str(get("query_id")), int(get("repeat") or 0), int(get("concurrency") or 1)


def pending_rows(log: Path) -> dict[tuple[str, str, int, int], dict[str, Any]]:
    """The entries of the pending.jsonl beside a records.jsonl (the last per key), {} without one."""
    side = log.with_name(PENDING_FILE)
    if log.name != "records.jsonl" or not own_file(side).is_file() or side.stat().st_size == 0:
        return {}
    return {record_key(row): row for chunk in log_chunks(side, RECORDS_CHUNK) for row in chunk}


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
    pending = pending_rows(path)
    for rows in log_chunks(path, size):
        for row in rows if pending else ():
            pending.pop(record_key(row), None)
        yield rows
    left = list(pending.values())
    for at in range(0, len(left), size):
        yield left[at:at + size]


def log_chunks(path: Path, size: int) -> Iterator[list[dict[str, Any]]]:
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

    atomic_write(path, path.with_suffix(".parquet.tmp"), write)


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


def parquet_schema_problem(schema: pa.Schema, columns: list[str] | None) -> str | None:
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
