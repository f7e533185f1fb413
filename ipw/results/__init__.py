"""Run folders: ``results/<run_id>/`` with manifest.json (:class:`RunManifest`), records.jsonl and
records.parquet (:class:`QueryRecord`), power.parquet, judge.jsonl (:class:`JudgeEntry`), queries.parquet
and ipw.lock; docs/ARCHITECTURE.md tabulates each file with the methods that write and read it.

``records.jsonl`` is appended and fsynced as records become final (several at once when they are ready
together), before ``ipw run`` reports them: a crash loses no reported record.  ``ipw serve`` answers before
a record is final: each answered request's record is in ``pending.jsonl`` first (:class:`PendingLog`), which
every reader of the log reads with it (``record_chunks``).
This is the only package that turns records into pandas frames, and the one reader of run folders
(resume, compare, report, check, merge, rescore): a folder is read whole, or an IpwError names the
file (and line) and what is wrong with it.  Nothing is dropped silently: only a torn *last* line of
the log (no newline at its end: the query in flight when the process died) is left out.

The package, one module a job, each importing only those before it: ``schema`` (records, judge entries, file
names), ``entry`` (a manifest's backend entry), ``files`` (atomic and appended writes), ``manifest``, ``log`` (records.jsonl and records.parquet),
``pending`` (``ipw serve``'s pending.jsonl), ``resume`` (kept queries, keys done), ``readers``, ``folder``
(``RunFolder`` and its lock).  What the rest of ipw uses is named here.
"""

from ipw.results.entry import ENTRY_VERSION, BackendEntry
from ipw.results.files import atomic_write, new_run_id, write_error
from ipw.results.folder import LOCK_FILE, FolderLock, RunFolder
from ipw.results.log import (PENDING_FILE, load_records_jsonl, read_records, record_chunks, repair_log, trusted_parquet,
                             write_records_parquet)
from ipw.results.manifest import RunManifest, manifest_field, manifest_file, read_manifest
from ipw.results.pending import PendingLog, fold_pending
from ipw.results.readers import load_run, parquet_rows, read_judge, read_log, read_power, read_record_fields
from ipw.results.resume import DoneKeys, KeptQueries, read_kept_queries, record_keys, write_queries
from ipw.results.schema import (JUDGE_FILE, JUDGE_SCHEMA_VERSION, POWER_FILE, RECORD_COLUMNS, SCHEMA_VERSION, STATUSES,
                                JudgeEntry, QueryRecord, SamplerOverhead, escape_surrogates, record_schema,
                                sampler_overheads)

__all__ = [
    "JUDGE_FILE", "JUDGE_SCHEMA_VERSION", "LOCK_FILE", "PENDING_FILE", "POWER_FILE", "RECORD_COLUMNS", "SCHEMA_VERSION",
    "STATUSES", "ENTRY_VERSION", "BackendEntry", "DoneKeys", "FolderLock", "JudgeEntry", "KeptQueries", "PendingLog", "QueryRecord", "RunFolder",
    "RunManifest", "SamplerOverhead", "atomic_write", "escape_surrogates", "fold_pending", "load_records_jsonl",
    "load_run", "manifest_field", "manifest_file", "new_run_id", "parquet_rows", "read_judge", "read_kept_queries",
    "read_log", "read_manifest", "read_power", "read_record_fields", "read_records", "record_chunks", "record_keys",
    "record_schema", "repair_log", "sampler_overheads", "trusted_parquet", "write_error", "write_queries",
    "write_records_parquet",
]
