"""``ipw run`` exits, bounded, after an engine that could not start, and leaves no process behind (the H200's
hang after vLLM's failed start in process, docs/GPU.md): real processes on the CPU, with a test engine
(tests/stray_engine.py) whose start forks a stray that ignores SIGTERM, leaves the worker's session, holds
the worker's pipes and never exits, then fails (an exception: exit 2, one error line, a ``failed`` folder) or
dies (SIGKILL with the answer pipe still open in the stray: before, ipw read that pipe until the load's
600 s timeout, four times; now the backend stops after its restarts, exit 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import gone

HERE = Path(__file__).resolve().parents[1]
RUN = [sys.executable, "-c", "import sys, stray_engine; stray_engine.register(); from ipw.cli import main; "
       "sys.exit(main(sys.argv[1:]))", "run"]
BOUND_S = 30.0


@pytest.mark.parametrize("on_load", ["fail", "die"])
def test_a_failed_start_that_leaves_a_stray_exits_bounded_and_kills_it(tmp_path, on_load):
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "2+2?", "answer": "4", "scorer": "numeric"}) + "\n"
                            for i in range(2)))
    pid_file = tmp_path / "strays.txt"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'dataset = "{data}"\nout_dir = "{tmp_path / "res"}"\nwarmup = 0\nidle_s = 0\n'
                   f'[[backends]]\nname = "stray"\nkind = "stray"\nmodel = "m"\npid_file = "{pid_file}"\n'
                   f'on_load = "{on_load}"\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.monotonic()
    try:
        result = subprocess.run(RUN + [str(cfg)], env=env, capture_output=True, text=True, timeout=BOUND_S * 4,
                                cwd=tmp_path)
        took = time.monotonic() - t0
        strays = [int(line) for line in pid_file.read_text().split()]
        assert strays and all(gone(pid) for pid in strays), (strays, result.stderr[-3000:])
    finally:
        for pid in [int(line) for line in pid_file.read_text().split()] if pid_file.exists() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert took < BOUND_S, (took, result.stderr[-3000:])
    (run_dir,) = [p.parent for p in (tmp_path / "res").glob("*/manifest.json")]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed"
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: backend 'stray': killed (SIGKILL)")]
    if on_load == "fail":
        assert result.returncode == 2, result.stderr[-3000:]
        (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert line.startswith("error: backend 'stray': ") and "Engine core initialization failed" in line
        assert len(strays) == 1 and notes == [f"note: backend 'stray': killed (SIGKILL) 1 process(es) it left "
                                              f"running (pid {strays[0]})"], result.stderr[-3000:]
    else:
        assert result.returncode == 1, result.stderr[-3000:]
        assert "worker died 4 times, 3 restarts (last: SIGKILL" in manifest["reason"], manifest["reason"]
        assert len(strays) == 4 and len(notes) == 4, result.stderr[-3000:]  # the start and its 3 restarts
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("argv, code", [(["--version"], 0), (["run", "--no-such-flag"], 2)])
def test_an_exit_held_by_a_thread_ends_after_the_grace_with_the_commands_code(argv, code):
    """The console script (``ipw.cli.entry``): a non-daemon thread that never ends holds the interpreter's exit;
    after ``IPW_EXIT_GRACE_S`` the stacks are printed and the process exits with the command's own code."""
    script = ("import sys, threading, time; threading.Thread(target=time.sleep, args=(600,), name='holder').start(); "
              "from ipw.cli import entry; sys.argv = ['ipw'] + sys.argv[1:]; entry()")
    t0 = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "IPW_EXIT_GRACE_S": "1"})
    assert result.returncode == code, result.stderr
    assert time.monotonic() - t0 < 60
    assert "still running 1 s later" in result.stderr and "threading.py" in result.stderr, result.stderr
