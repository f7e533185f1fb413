"""The readers of a run folder: its records as a frame (``load_run``), judge.jsonl, the log, power.parquet, and
some fields of some records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ipw.errors import IpwError
from ipw.results.schema import JUDGE_FILE, JudgeEntry, POWER_FILE
from ipw.results.files import own_file
from ipw.results.manifest import RunManifest, read_manifest
from ipw.results.log import load_records_jsonl, parquet_schema_problem, read_parquet, read_records, trusted_parquet

if TYPE_CHECKING:  # imported where used: `import ipw` stays light (tests/commands/test_startup.py)
    import pandas as pd


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
            problem = parquet_schema_problem(schema, columns)
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
