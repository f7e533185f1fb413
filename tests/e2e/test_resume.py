"""Resume after a crash: SIGKILL at random moments, resume, and every query is recorded exactly once."""

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import smol_config

pytestmark = pytest.mark.llama
IPW = [sys.executable, "-m", "ipw.cli"]


def _config(tmp_path: Path, dataset: Path | str, limit: int = 0) -> Path:
    return smol_config(tmp_path / "resume.toml", dataset, limit=limit, max_tokens=8, out_dir=tmp_path / "res",
                       top="repeats = 2")


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_sigkill_and_resume_loop(tmp_path):
    """20 SIGKILLs at random moments (during start-up and model load, or after 1-3 more records, mid-query),
    each followed by a resume.  The work is bounded by records, not by time: 40 queries x 2 repeats, and
    the kills together consume at most 60 of the 80 records, on a fast machine or a slow one."""
    from ipw.inputs.datasets import load_queries

    rng = random.Random(7)
    proc = subprocess.Popen(IPW + ["run", str(_config(tmp_path, "ipw-core", limit=40))], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "res").glob("*/manifest.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    (run_dir,) = [p.parent for p in (tmp_path / "res").glob("*/manifest.json")]
    log = run_dir / "records.jsonl"
    kills = 0
    for _ in range(20):
        if rng.random() < 0.3:  # start-up or model load (or the first query)
            time.sleep(rng.uniform(0.05, 1.0))
        else:  # mid-run: after 1-3 more records, at a random moment of the next query
            target, deadline = _lines(log) + rng.randint(1, 3), time.monotonic() + 300
            while _lines(log) < target and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.2))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        elif proc.returncode != 0:  # it ended by itself: only a completed run may
            pytest.fail(f"runner exited {proc.returncode}: {(tmp_path / 'stderr.log').read_text()[-2000:]}")
        proc.wait()
        if json.loads((run_dir / "manifest.json").read_text())["status"] == "complete":
            break
        proc = subprocess.Popen(IPW + ["run", "--resume", str(run_dir)], stdout=subprocess.DEVNULL,
                                stderr=open(tmp_path / "stderr.log", "w"))
    proc.wait(timeout=500)  # the rest of the run: at least 20 records
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert kills == 20, "the loop really kills the runner every time"
    assert manifest["status"] == "complete", (tmp_path / "stderr.log").read_text()[-2000:]
    frame = pd.read_parquet(run_dir / "records.parquet")
    keys = list(zip(frame["query_id"], frame["repeat"]))
    expected = {(q.id, r) for q in load_queries("ipw-core")[:40] for r in (0, 1)}
    assert len(keys) == len(set(keys)), "no query is duplicated"
    assert set(keys) == expected, "no query is lost"


def test_sigterm_marks_interrupted_and_resume_completes(small_jsonl, tmp_path):
    proc = subprocess.Popen(IPW + ["run", str(_config(tmp_path, small_jsonl))], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    run_dirs = []
    while time.monotonic() < deadline:
        run_dirs = [p.parent for p in (tmp_path / "res").glob("*/records.jsonl") if p.stat().st_size > 0]
        if run_dirs:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    (run_dir,) = run_dirs
    manifest = json.loads((run_dir / "manifest.json").read_text())
    if manifest["status"] == "complete":
        pytest.skip("the run finished before SIGTERM arrived")
    assert code == 130
    assert manifest["status"] == "interrupted"
    result = subprocess.run(IPW + ["run", "--resume", str(run_dir)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    frame = pd.read_parquet(run_dir / "records.parquet")
    assert len(frame) == 8 and not frame.duplicated(["query_id", "repeat"]).any()
    again = subprocess.run(IPW + ["run", "--resume", str(run_dir)], capture_output=True, text=True)
    assert again.returncode == 2 and "already complete" in again.stderr


def test_resume_refuses_options(tmp_path, run_cli):
    code, _, err = run_cli("run", "--resume", tmp_path, "--limit", "3")
    assert code == 2 and "drop --limit" in err
    code, _, err = run_cli("run", "--resume", tmp_path)
    assert code == 2 and "not a run folder" in err
