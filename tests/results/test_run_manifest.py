"""The typed manifest (ipw.results.RunManifest): one reader and one writer, and the JSON layout is
unchanged, so earlier run folders (.ci/baseline-default) read and write back as they were."""

import json
from pathlib import Path

import pytest

from ipw.results import RunFolder, RunManifest

BASELINE = Path(__file__).resolve().parents[2] / ".ci" / "baseline-default"


def test_baseline_round_trips():
    data = json.loads((BASELINE / "manifest.json").read_text())
    manifest = RunManifest.read(BASELINE, require=("dataset.fingerprint",))
    assert manifest.status == "complete" and manifest.dataset["fingerprint"] == data["dataset"]["fingerprint"]
    assert manifest.to_dict() == data


def test_unknown_keys_are_kept_and_absent_fields_stay_absent():
    m = RunManifest.from_dict({"run_id": "r", "status": "complete", "future_key": [1]})
    assert m.extra == {"future_key": [1]} and m.hardware is None
    assert m.to_dict() == {"run_id": "r", "status": "complete", "schema_version": 1, "future_key": [1]}


def test_the_writer_takes_only_fields(tmp_path):
    folder = RunFolder.create(tmp_path, "r1", RunManifest(run_id="r1", config={}, backends=[]))
    folder.write_manifest(backends=[{"name": "b"}])
    assert json.loads((folder.path / "manifest.json").read_text())["backends"] == [{"name": "b"}]
    with pytest.raises(TypeError):
        folder.write_manifest(backend=[])  # a typo is an error, not a new key
    folder.finish("complete", reason="done")
    again = RunManifest.read(folder.path)
    assert (again.status, again.reason, again.run_id) == ("complete", "done", "r1") and again.finished_at
