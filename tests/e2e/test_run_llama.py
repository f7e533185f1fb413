"""End to end with the real llama.cpp engine and the bundled model packages."""

import json

import pandas as pd
import pytest

from ipw.grading.scoring import score

pytestmark = pytest.mark.llama

COLUMNS = ["run_id", "backend", "model", "query_id", "category", "repeat", "correct", "error", "output",
           "prompt_tokens", "completion_tokens", "ttft_s", "latency_s", "energy_j", "energy_quality",
           "energy_source"]


def _only_run(out_dir):
    (run_dir,) = list(out_dir.iterdir())
    return run_dir


def test_run_user_dataset(small_jsonl, tmp_path, run_cli):
    out = tmp_path / "res"
    code, stdout, err = run_cli("run", "--dataset", small_jsonl, "--limit", "3", "--backend",
                                "llama-cpp:smollm2-135m", "--warmup", "1", "--idle-s", "1", "--out", out)
    assert code == 0, err
    run_dir = _only_run(out)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["dataset"]["n_queries"] == 3
    assert manifest["dataset"]["fingerprint"].startswith("sha256:")
    assert manifest["hardware"] and manifest["software"]
    assert manifest["backends"][0]["sensors"], "sensors are recorded"
    frame = pd.read_parquet(run_dir / "records.parquet")
    assert set(COLUMNS) <= set(frame.columns)
    assert list(frame["query_id"]) == ["a1", "a2", "m1"]
    assert frame["error"].isna().all()
    assert (frame["completion_tokens"] > 0).all() and (frame["prompt_tokens"] > 10).all()
    assert (frame["ttft_s"] > 0).all() and (frame["latency_s"] >= frame["ttft_s"]).all()
    # no RAPL or NVML on these machines: the CPU model estimates, and says so
    assert set(frame["energy_quality"]) == {"estimated"}
    assert set(frame["energy_source"]) == {"model.cpu"}
    assert (frame["energy_j"] > 0).all()
    for row in frame.itertuples():
        choices = (["Venus", "Mars", "Jupiter", "Saturn"] if row.query_id == "m1" else None)
        scorer = {"a1": "numeric", "a2": "numeric", "m1": "mcq"}[row.query_id]
        assert row.correct == float(score(scorer, row.output, row.answer, tuple(choices) if choices else None))
    lines = (run_dir / "records.jsonl").read_text().splitlines()
    assert len(lines) == 3
    assert "accuracy" in stdout and "smollm2" in stdout


def test_embedded_default_local_and_cloud(tmp_path, run_cli):
    """The embedded default, cut to 4 queries: a local chat model in process and a cloud-role base model
    behind a managed llama.cpp server (few-shot completion over the OpenAI-compatible API), ending with
    the routing summary."""
    out = tmp_path / "res"
    code, stdout, err = run_cli("run", "--limit", "4", "--idle-s", "0", "--warmup", "0", "--out", out)
    assert code == 0, err
    run = _only_run(out)
    frame = pd.read_parquet(run / "records.parquet")
    assert len(frame) == 8 and frame["error"].isna().all()
    roles = frame.groupby("backend")["role"].first().to_dict()
    assert roles == {"gemma3-270m-server": "cloud", "smollm2-135m": "local"}
    gemma = frame[frame["backend"] == "gemma3-270m-server"]
    # few-shot completion stops at the end of the answer line
    assert (gemma["completion_tokens"] < 48).all()
    assert not gemma["output"].str.contains("Question:").any()
    assert (run / "server-gemma3-270m-server.log").is_file()  # the managed server's log is kept
    for text in ("local coverage", "oracle energy saved", "router (α=0.8) energy saved",
                 "coverage within a power envelope"):
        assert text in stdout, text


def test_interrupted_run_is_marked(small_jsonl, tmp_path, monkeypatch):
    """A crash mid-run leaves the records written so far and the manifest marked interrupted."""
    from ipw.inputs.config import apply_overrides, load_config
    from ipw.running.runner import execute
    from runfolders import start_run

    config = apply_overrides(load_config(None), {"dataset": str(small_jsonl), "backend": ["smollm2-135m"],
                                                 "out": str(tmp_path), "warmup": 0, "idle_s": 0})
    folder, queries = start_run(config, command=["test"])
    seen = []

    def progress(record):
        seen.append(record)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute(folder, config, queries, progress)
    manifest = json.loads((folder.path / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    assert len(pd.read_parquet(folder.path / "records.parquet")) == 2
