"""records.parquet is written from records.jsonl in chunks (``write_records_parquet``), one row group per
chunk, in the schema declared next to QueryRecord: the same records as the whole-log file it replaces."""

import pandas as pd
import pyarrow.parquet as pq
import pytest
from runfolders import create, record

from ipw import results
from ipw.errors import IpwError
from ipw.results import QueryRecord, load_records_jsonl, load_run, write_records_parquet


def _folder(tmp_path, n=10):
    folder = create(tmp_path, "run")
    for i in range(n):  # the field kinds a run holds: errors, unavailable energy, options, judge fields, a sweep
        folder.append(record(query_id=f"q{i}", category=f"c{i % 3}", repeat=i % 2, correct=float(i % 2),
                             error="boom" if i == 3 else None, error_category="timeout" if i == 3 else None,
                             energy_j=None if i == 4 else 0.5 * i, choices=("x", "y") if i % 4 == 0 else (),
                             win_tie=1.0 if i == 5 else None, judge_verdicts=("tie",) if i == 5 else (),
                             prefill_unresolved=True if i % 2 else None, concurrency=1 + i % 2,
                             energy_parts='[{"component": "cpu", "energy_j": 0.1}]'))
    return folder


def _records(path):
    return [QueryRecord.from_row(row) for row in pd.read_parquet(path).to_dict("records")]


def test_chunked_parquet_holds_what_the_whole_log_file_held(tmp_path):
    folder = _folder(tmp_path)
    log = folder.path / "records.jsonl"
    load_records_jsonl(log).to_parquet(tmp_path / "old.parquet", index=False)  # how finish wrote it before
    write_records_parquet(log, tmp_path / "new.parquet", chunk=3)
    assert pq.ParquetFile(tmp_path / "new.parquet").metadata.num_row_groups == 4  # 3 + 3 + 3 + 1
    assert list(pd.read_parquet(tmp_path / "new.parquet").columns) == list(pd.read_parquet(tmp_path / "old.parquet").columns)
    assert _records(tmp_path / "new.parquet") == _records(tmp_path / "old.parquet")


def test_finish_writes_one_row_group_per_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(results.log, "RECORDS_CHUNK", 4)
    folder = _folder(tmp_path)
    folder.finish("complete")
    path = folder.path / "records.parquet"
    assert pq.ParquetFile(path).metadata.num_row_groups == 3  # 4 + 4 + 2: memory held 4 records at a time
    manifest, frame = load_run(folder.path)
    assert manifest.status == "complete" and sorted(frame["query_id"]) == sorted(f"q{i}" for i in range(10))


def test_a_damaged_line_found_while_writing_leaves_no_parquet(tmp_path, monkeypatch):
    monkeypatch.setattr(results.log, "RECORDS_CHUNK", 4)
    folder = _folder(tmp_path)
    log = folder.path / "records.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    lines[6] = lines[6][:40] + "\n"  # after the first chunk was written
    log.write_text("".join(lines))
    with pytest.raises(IpwError, match="records.jsonl:7: torn or corrupt record"):
        folder.finish("complete")
    assert not list(folder.path.glob("records.parquet*"))
    assert results.read_manifest(folder.path)["status"] == "failed"


def test_readers_check_the_log_by_its_size_and_last_mib(tmp_path):
    """A reader trusts records.parquet while the log has the size and last MiB it had when the file was
    written (not the whole log's digest: seconds for a million records); an older entry (count and whole
    sha256 only) is still checked whole."""
    folder = _folder(tmp_path)
    folder.finish("complete")
    log = folder.path / "records.jsonl"
    manifest = results.read_manifest(folder.path)
    assert results.trusted_parquet(folder.path, manifest) == folder.path / "records.parquet"
    text = log.read_text()
    log.write_text(text.replace('"q9"', '"q8"'))  # same size, changed near the end
    assert results.trusted_parquet(folder.path, manifest) is None
    log.write_text(text)
    old = {**manifest, "records": {k: manifest["records"][k] for k in ("count", "jsonl_sha256")}}
    assert results.trusted_parquet(folder.path, old) == folder.path / "records.parquet"
    log.write_text(text.replace('"q0"', '"q1"'))
    assert results.trusted_parquet(folder.path, old) is None
