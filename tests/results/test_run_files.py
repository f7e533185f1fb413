"""The files of a run folder other than the manifest and the records, typed and read through ipw/results/:
judge.jsonl (``JudgeEntry``, versioned; old unversioned lines still read), power.parquet."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from ipw.errors import IpwError
from ipw.results import JUDGE_SCHEMA_VERSION, JudgeEntry, RunFolder, RunManifest, read_judge, read_power

# a judge.jsonl line as ipw wrote it before the schema version (commit c4a7f61 and earlier)
OLD_LINE = {"backend": "b", "query_id": "q1", "repeat": 0, "category": None, "judge": "j", "judge_model": "m",
            "grading": "reference", "vs_backend": None, "prompt_version": "reference-v1", "correct": True,
            "verdicts": ["correct"], "judge_outputs": ["CORRECT"], "judge_errors": [], "judge_calls": 1,
            "judge_prompt_tokens": 100, "judge_completion_tokens": 2, "judge_latency_s": 0.5,
            "judge_energy_j": 0.25, "judge_energy_quality": "estimated", "judge_energy_source": "model.cpu",
            "judge_cost_usd": 1e-4}


def test_judge_entries_round_trip_with_a_version(tmp_path):
    folder = RunFolder.create(tmp_path, "r", RunManifest(run_id="r"))
    folder.start_judge()
    assert read_judge(folder.path) == []
    entry = JudgeEntry.from_dict(OLD_LINE)
    folder.append_judge(entry)
    line = json.loads((folder.path / "judge.jsonl").read_text())
    assert line["schema_version"] == JUDGE_SCHEMA_VERSION and line["verdicts"] == ["correct"]
    assert folder.read_judge() == [entry]
    assert entry.category == "" and entry.verdicts == ("correct",) and entry.judge_energy_j == 0.25


def test_old_unversioned_judge_lines_still_read(tmp_path):
    (tmp_path / "judge.jsonl").write_text(json.dumps(OLD_LINE) + "\n\n")
    (entry,) = read_judge(tmp_path)
    assert entry.schema_version == 1 and entry.judge_calls == 1 and entry.correct is True


def test_a_newer_or_damaged_judge_line_is_an_error_naming_it(tmp_path):
    (tmp_path / "judge.jsonl").write_text(json.dumps({**OLD_LINE, "schema_version": JUDGE_SCHEMA_VERSION + 1}) + "\n")
    with pytest.raises(IpwError, match=r"judge.jsonl:1: field 'schema_version'.*newer ipw"):
        read_judge(tmp_path)
    (tmp_path / "judge.jsonl").write_text("{not json\n")
    with pytest.raises(IpwError, match="cannot read the judge's log"):
        read_judge(tmp_path)


def test_power_written_copied_and_read_through_the_run_folder(tmp_path):
    folder = RunFolder.create(tmp_path, "a", RunManifest(run_id="a"))
    assert read_power(folder.path) is None
    folder.write_power(pd.DataFrame({"t_s": [0.0, 0.1], "device": ["gpu0", "gpu0"], "power_w": [100.0, 110.0]}))
    other = RunFolder.create(tmp_path, "b", RunManifest(run_id="b"))
    other.copy_power(folder.path)
    power = read_power(other.path, columns=["t_s", "power_w", "node"])
    assert list(power.columns) == ["t_s", "power_w"] and list(power["power_w"]) == [100.0, 110.0]


def test_sampler_overhead_one_key_and_the_snapshot_threads_old_keys():
    from ipw.results import sampler_overheads

    backend = {"sampler_overhead": {
        "nvml": {"cpu_s": 0.5, "wall_s": 10.0, "cpu_fraction_of_one_core": 0.05, "calls": {}},
        "rapl": {"thread": "ipw-snapshots", "cpu_s": 0.2, "active_s": 4.0, "fraction_of_core": 0.05},
        "cpu_model": {}}}
    got = sampler_overheads(backend)
    assert set(got) == {"nvml", "rapl"}
    assert (got["rapl"].cpu_s, got["rapl"].wall_s, got["rapl"].cpu_fraction_of_one_core) == (0.2, 4.0, 0.05)
    assert (got["nvml"].wall_s, got["nvml"].cpu_fraction_of_one_core) == (10.0, 0.05)
