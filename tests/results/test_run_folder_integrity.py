"""A run folder under stress: a disk that fills up, a second writer, stale or foreign files. Real
processes (``python -m ipw.cli``) against the loopback stub endpoint, real file systems and limits."""

from __future__ import annotations

import json
import os
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


# -- one writer per run folder ------------------------------------------------------------------------

def _interrupted_run(stub, tmp_path: Path, n: int, keep: int) -> Path:
    """A run of ``n`` queries stopped after ``keep`` records (status interrupted, its records.parquet of
    those records written, as after Ctrl-C)."""
    from ipw.cli import main
    from ipw.results import RunManifest, RunFolder

    cfg = stub_config(tmp_path / "run.toml", _dataset(tmp_path, n), stub.base_url, out_dir=tmp_path / "res")
    assert main(["run", str(cfg)]) == 0
    run = _only_run(tmp_path / "res")
    log = run / "records.jsonl"
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:keep]))
    (run / "records.parquet").unlink()
    folder = RunFolder(run, RunManifest.read(run))
    folder.finish("interrupted", reason="interrupted by the user")
    return run


def _query_keys(run: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    return sorted((r["backend"], r["query_id"], r["repeat"]) for r in rows)


def test_two_concurrent_resumes_one_succeeds_one_is_refused(stub, tmp_path):
    """Before: both exited 0 and the folder held 72 records for 40 queries."""
    run = _interrupted_run(stub, tmp_path, 40, keep=10)
    stub.delay_s = 0.05  # the resume takes about 1.5 s: long enough for the two to overlap
    try:
        procs = [subprocess.Popen(IPW + ["run", "--resume", str(run)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [(p.wait(timeout=300), p.stderr.read(), p.pid) for p in procs]
    finally:
        stub.delay_s = 0.0
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    (winner,) = [pid for code, _, pid in results if code == 0]
    (refusal,) = [err for code, err, _ in results if code == 2]
    last = refusal.strip().splitlines()[-1]
    assert (f"another ipw process (pid {winner}) is writing this run folder" in last
            or "the run is already complete" in last), refusal
    assert "Traceback" not in refusal
    assert _query_keys(run) == sorted(("stub", f"q{i}", 0) for i in range(40))  # one record per query
    assert _manifest(run)["status"] == "complete"
    assert (run / "ipw.lock").read_text() == ""  # released cleanly: no stale PID left


def test_a_second_writer_is_refused_naming_the_holder(stub, tmp_path):
    from ipw.results import FolderLock

    run = _interrupted_run(stub, tmp_path, 6, keep=3)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.name != "ipw.lock"}
    lock = FolderLock(run)  # this test process writes the folder
    try:
        proc = subprocess.run(IPW + ["run", "--resume", str(run)], capture_output=True, text=True, timeout=120)
    finally:
        lock.release()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"error: {run}: another ipw process (pid {os.getpid()}) is writing this run "
                                   "folder; wait for it to end, or stop it, then try again")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.name != "ipw.lock"} == before


def test_a_writer_that_locked_but_has_not_written_its_pid_yet_is_still_named(tmp_path):
    """The race CI met (two resumes at once): the holder takes the flock, then writes its PID; a second writer
    that comes in between waits for the PID (at most ``HOLDER_WAIT_S``) rather than saying "pid unknown"."""
    import fcntl
    import threading

    from ipw.errors import IpwError
    from ipw.results import LOCK_FILE, FolderLock

    fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked, the PID not written yet
    writer = threading.Timer(0.2, lambda: os.pwrite(fd, b"4242\n", 0))
    writer.start()
    try:
        with pytest.raises(IpwError, match=r"another ipw process \(pid 4242\) is writing this run folder"):
            FolderLock(tmp_path)
    finally:
        writer.join()
        os.close(fd)


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_note(stub, tmp_path):
    run = _interrupted_run(stub, tmp_path, 6, keep=3)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / "ipw.lock").write_text(f"{dead.pid}\n")  # what a killed ipw leaves (the kernel freed the flock)
    proc = subprocess.run(IPW + ["run", "--resume", str(run)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"note: {run}: took over the lock of ipw pid {dead.pid}, which is no longer running" in proc.stderr
    assert _query_keys(run) == sorted(("stub", f"q{i}", 0) for i in range(6))


# -- no stale or foreign files ------------------------------------------------------------------------

def test_resume_removes_the_stale_parquet_before_appending(stub, tmp_path):
    from ipw.results import RunFolder

    run = _interrupted_run(stub, tmp_path, 6, keep=3)
    assert (run / "records.parquet").exists()
    folder = RunFolder.reopen(run)
    try:
        assert not (run / "records.parquet").exists()
    finally:
        folder.lock.release()


def test_readers_use_the_log_when_the_parquet_is_stale(stub, tmp_path, run_cli, capsys):
    """A resume killed after appending (SIGINT, --resume, SIGKILL): the old records.parquet (3 records) no
    longer matches records.jsonl (5): compare, report and check read the log, with a note."""
    run = _interrupted_run(stub, tmp_path, 6, keep=3)
    log = run / "records.jsonl"
    extra = [json.loads(line) for line in log.read_text().splitlines()[:2]]
    with log.open("a") as fh:  # what the killed resume appended
        for i, row in enumerate(extra):
            fh.write(json.dumps({**row, "query_id": f"q{3 + i}"}) + "\n")
    capsys.readouterr()  # the run's own output
    code, out, err = run_cli("compare", run, "--format", "json")
    assert code == 0, err
    assert f"note: {run / 'records.parquet'}: not used (records.jsonl changed since it was written)" in err
    assert json.loads(out)["runs"][0]["n_records"] == 5
    code, _, err = run_cli("report", run, "--out", tmp_path / "r.html")
    assert code == 0 and "not used" in err, err


def test_symlinked_files_are_refused(stub, tmp_path, run_cli):
    """records.jsonl linked to a file outside the folder: before, --resume truncated that file as a torn tail
    and appended to it."""
    run = _interrupted_run(stub, tmp_path, 6, keep=3)
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes((run / "records.jsonl").read_bytes() + b'{"torn')
    (run / "records.jsonl").unlink()
    (run / "records.jsonl").symlink_to(outside)
    before = outside.read_bytes()
    for args in (["run", "--resume", run], ["compare", run], ["check", run, run]):
        code, out, err = run_cli(*args)
        assert code == 2 and f"{run / 'records.jsonl'}: a symbolic link; a run folder holds its own files" in err, err
    assert outside.read_bytes() == before
    (run / "records.jsonl").unlink()
    (run / "records.jsonl").write_bytes(before[: before.rfind(b"\n") + 1])
    (run / "manifest.json").rename(tmp_path / "m.json")
    (run / "manifest.json").symlink_to(tmp_path / "m.json")
    code, _, err = run_cli("compare", run)
    assert code == 2 and "manifest.json: a symbolic link" in err, err


@pytest.mark.parametrize("command", ["compare", "report"])
def test_compare_and_report_note_unfinished_runs(command, stub, tmp_path, run_cli):
    run = _interrupted_run(stub, tmp_path, 6, keep=3)
    args = ["compare", run] if command == "compare" else ["report", run, "--out", tmp_path / "r.html",
                                                          "--markdown", tmp_path / "r.md"]
    code, out, err = run_cli(*args)
    assert code == 0, err
    text = out if command == "compare" else (tmp_path / "r.md").read_text()
    run_id = _manifest(run)["run_id"]
    assert f"run {run_id} is unfinished (interrupted): its numbers cover the 3 records written so far" in text


def test_a_large_run_resumes_from_its_copy_of_the_queries(stub, tmp_path):
    """A run of >= QUERY_CACHE_MIN queries keeps them in queries.parquet; --resume reads that copy (the same
    queries, the same fingerprint) while the dataset file is unchanged, and parses the file again (and
    refuses it) once it changed."""
    from ipw.inputs.config import load_config
    from ipw.inputs.datasets import fingerprint, load_queries
    from ipw.errors import IpwError
    from ipw.running.runner import QUERY_CACHE_MIN
    from runfolders import resume_run, start_run

    data = _dataset(tmp_path, QUERY_CACHE_MIN)
    config = load_config(str(stub_config(tmp_path / "run.toml", data, stub.base_url, out_dir=tmp_path / "res")))
    folder, queries = start_run(config)
    folder.lock.release()  # as if the run had been killed: nothing recorded yet
    entry = _manifest(folder.path)["dataset"]
    assert (folder.path / entry["queries_file"]).is_file() and entry["file_sha256"].startswith("sha256:")
    again, _, resumed, done = resume_run(str(folder.path))
    assert resumed == queries == load_queries(str(data)) and not done
    assert fingerprint(resumed) == entry["fingerprint"]
    again.lock.release()
    with open(data, "a") as fh:  # the dataset changed: the copy is not used, and the run is refused
        fh.write(json.dumps({"id": "new", "prompt": "Say new", "answer": "42"}) + "\n")
    with pytest.raises(IpwError, match="fingerprints differ"):
        resume_run(str(folder.path))
