"""A run folder under stress: a disk that fills up, a second writer, stale or foreign files. Real
processes (``python -m ipw.cli``) against the loopback stub endpoint, real file systems and limits."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from openai_stub import Stub, stub_config

IPW = [sys.executable, "-m", "ipw.cli"]


@pytest.fixture(scope="module")
def stub():
    s = Stub()
    yield s
    s.close()


def _dataset(tmp_path: Path, n: int, prompt_chars: int = 20) -> Path:
    path = tmp_path / f"q{n}.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Say {i} " + "x" * prompt_chars, "answer": "42"})
                            + "\n" for i in range(n)))
    return path


def _manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def _only_run(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


def _file_size_limit(limit_bytes: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


def _assert_failed_cleanly(proc: subprocess.CompletedProcess, out: Path, fragment: str) -> None:
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "records.jsonl: cannot write it (" + fragment in last, proc.stderr
    assert "Traceback" not in proc.stderr and "unexpected" not in proc.stderr
    run = _only_run(out)
    manifest = _manifest(run)
    assert manifest["status"] == "failed" and "cannot write it" in manifest["reason"]
    assert not [p.name for p in run.iterdir() if p.name.endswith(".tmp")]


def test_a_file_size_limit_fails_the_run_in_one_line(stub, tmp_path):
    """RLIMIT_FSIZE stands in for a full disk on any machine: the write fails (EFBIG), the run exits 2 with
    one line, the manifest says failed with the reason, and no temporary file is left."""
    data = _dataset(tmp_path, 200, prompt_chars=300)
    cfg = stub_config(tmp_path / "run.toml", data, stub.base_url, out_dir=tmp_path / "res")
    proc = subprocess.run(IPW + ["run", str(cfg)], capture_output=True, text=True, timeout=300,
                          preexec_fn=_file_size_limit(64 * 1024))
    _assert_failed_cleanly(proc, tmp_path / "res", "File too large")
    # the space comes back: the same run resumes and completes
    proc = subprocess.run(IPW + ["run", "--resume", str(_only_run(tmp_path / "res"))], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = (_only_run(tmp_path / "res") / "records.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["query_id"] for line in lines) == sorted(f"q{i}" for i in range(200))


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 64 KiB tmpfs (needs root, as on these machines; skipped elsewhere)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_fails_the_run_in_one_line(stub, tmp_path, tiny_tmpfs):
    """A 64 KiB tmpfs fills up: one line, exit 2, the manifest failed (rewritten in its own blocks when there
    is no room for a temporary copy), no records.parquet.tmp left (before: exit 3 "unexpected OSError",
    manifest running, the temporary file left)."""
    data = _dataset(tmp_path, 200, prompt_chars=300)
    cfg = stub_config(tmp_path / "run.toml", data, stub.base_url, out_dir=tiny_tmpfs / "res")
    proc = subprocess.run(IPW + ["run", str(cfg)], capture_output=True, text=True, timeout=300)
    _assert_failed_cleanly(proc, tiny_tmpfs / "res", "No space left on device")
