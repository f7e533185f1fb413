"""Helpers shared by the scripts in bench/ (not a benchmark itself).

- ``write_section(doc, section, body)``: the one place where a benchmark rewrites its section of a
  docs page (docs/PERFORMANCE.md and others): the text from the heading ``section`` up to the next
  ``## `` heading is replaced by ``body``, or ``body`` is appended when the heading is not there yet.
- ``machine()``: one line describing this machine (logical CPUs, CPU model, Python).
- ``loads()``, ``median()``: the 1-minute load average; a median that is NaN for no values.
- ``Child``, ``signal_tree``, ``alternate``, ``run_pty``, ``run_plain``: child processes under a
  pseudo-terminal or a file, paused and resumed in turns, reaped with their CPU time.
- ``query_stats``, ``ipw_rows``: per-query timings of a bare loop and of an ipw run folder.
- ``config_head``: the top of a benchmark's run config (dataset, repeats, warm-up, no idle baseline, out_dir,
  greedy generation), up to its ``[[backends]]``.

It stays at the top of bench/, beside the question folders that hold the scripts: a script puts bench/ on its
path (``sys.path.insert(0, str(ROOT / "bench"))``) and imports it as ``from _shared import ...``.

Output: none (imported by the scripts).
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import re
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "PERFORMANCE.md"
# the console script beside this interpreter, else the module (a GPU server running ipw from a checkout)
IPW = ([str(Path(sys.executable).with_name("ipw"))] if Path(sys.executable).with_name("ipw").exists()
       else [sys.executable, "-m", "ipw.cli"])


def machine() -> str:
    from ipw.telemetry.cpu_model import cpu_model_name

    return f"{os.cpu_count()} logical CPUs, {cpu_model_name()}, Python {platform.python_version()}"


class Child:
    """A child process, its output going to a pseudo-terminal (drained by a thread; rich then renders
    its live display as in a terminal) or to a file."""

    def __init__(self, cmd: list[str], *, pty: bool, cols: int = 160, rows: int = 40,
                 env: dict | None = None, cpus: set[int] | None = None, cwd: Path | None = None) -> None:
        self.cmd, self.chunks = cmd, []
        cwd = ROOT if cwd is None else cwd  # another checkout's folder: the code under test
        self.spawn = time.monotonic()
        # cpus: the child and everything it starts run on these CPUs only (both sides of a comparison alike)
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        if pty:
            master, slave = os.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
                                         preexec_fn=pin)
            os.close(slave)
            self.drain = threading.Thread(target=self._drain, args=(master,), daemon=True)
            self.drain.start()
            self.log = None
        else:
            self.log = tempfile.TemporaryFile()
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                         cwd=cwd, env=env, preexec_fn=pin)
            self.drain = None
        self.stopped: list[tuple[float, float]] = []  # (SIGSTOP sent, SIGCONT sent)
        self.rc: int | None = None
        self.cpu_s = 0.0
        self.end = 0.0

    def _drain(self, master: int) -> None:
        while True:
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            self.chunks.append(data)
        os.close(master)

    def poll(self) -> bool:
        """True once the child has exited (reaped here, with its CPU time)."""
        if self.rc is not None:
            return True
        pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
        if pid == 0:
            return False
        self.end = time.monotonic()
        self.rc = os.waitstatus_to_exitcode(status)
        self.proc.returncode = self.rc
        self.cpu_s = usage.ru_utime + usage.ru_stime
        if self.drain is not None:
            self.drain.join(timeout=5)
        return True

    def wait(self) -> None:
        while not self.poll():
            time.sleep(0.01)

    def output(self) -> str:
        if self.log is not None:
            self.log.seek(0)
            return self.log.read().decode("utf-8", "replace")
        return b"".join(self.chunks).decode("utf-8", "replace")

    def active(self, a: float, b: float) -> float:
        """Seconds in [a, b] during which the child was not stopped."""
        return (b - a) - sum(max(0.0, min(b, t1) - max(a, t0)) for t0, t1 in self.stopped)


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to a process and all its descendants (ipw's engine worker runs in a session of its own,
    so a process group would miss it)."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


def alternate(children: list[Child], slice_s: float) -> None:
    """Let the children take turns of ``slice_s`` seconds (SIGSTOP / SIGCONT, every other one stopped),
    until all have exited; a child that is alone runs to its end.  Each child's stopped intervals are
    recorded, so that durations it measured on the monotonic clock can be reduced to its running time."""
    for c in children[1:]:
        signal_tree(c.proc.pid, signal.SIGSTOP)
        c.stopped.append((c.spawn, float("inf")))
    turn = 0
    while True:
        alive = [c for c in children if not c.poll()]
        if not alive:
            return
        c = alive[turn % len(alive)]
        if c.stopped and c.stopped[-1][1] == float("inf"):
            signal_tree(c.proc.pid, signal.SIGCONT)
            c.stopped[-1] = (c.stopped[-1][0], time.monotonic())
        if len(alive) == 1:
            c.wait()
            return
        deadline = time.monotonic() + slice_s
        while time.monotonic() < deadline and not c.poll():
            time.sleep(0.005)
        if c.poll():
            continue
        signal_tree(c.proc.pid, signal.SIGSTOP)
        c.stopped.append((time.monotonic(), float("inf")))
        turn += 1


def run_pty(cmd: list[str], *, env: dict | None = None) -> dict:
    """Run ``cmd`` to its end with a pseudo-terminal as its stdio."""
    c = Child(cmd, pty=True, env=env)
    c.wait()
    return {"spawn": c.spawn, "wall_s": c.end - c.spawn, "rc": c.rc, "cpu_s": c.cpu_s, "output": c.output()}


def run_plain(cmd: list[str], env: dict | None = None) -> dict:
    spawn = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return {"spawn": spawn, "wall_s": time.monotonic() - spawn, "rc": proc.returncode,
            "output": proc.stdout + proc.stderr}


def config_head(dataset: object, out_dir: Path, warmup: int, max_tokens: int, limit: int | None = None) -> str:
    """A run config's top, through its ``[[backends]]`` line: the caller appends the backend's keys."""
    head = f'dataset = "{dataset}"\n' + (f"limit = {limit}\n" if limit is not None else "")
    return (head + f'repeats = 1\nwarmup = {warmup}\nidle_s = 0\nout_dir = "{out_dir}"\n\n'
            f"[generation]\nmax_tokens = {max_tokens}\ntemperature = 0.0\n\n[[backends]]\n")


def write_section(doc: Path, section: str, body: str) -> None:
    """Replace the section titled ``section`` (up to the next ``## ``) or append it."""
    text = doc.read_text(encoding="utf-8") if doc.exists() else "# Performance\n\n"
    body = body.rstrip("\n") + "\n"
    if section in text:
        head, _, rest = text.partition(section)
        nxt = re.search(r"^## ", rest, flags=re.M)
        text = head + body + ("\n" + rest[nxt.start():] if nxt else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    doc.write_text(text, encoding="utf-8")


def loads() -> float:
    return round(os.getloadavg()[0], 2)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def query_stats(rows: list[dict], active=lambda a, b: b - a) -> dict:
    """rows: start, first (or None), decode_end, end, tokens (monotonic seconds). ``active(a, b)``: the
    process's running time in [a, b] (the elapsed time minus the time it was stopped)."""
    dec = [r for r in rows if r["first"] is not None and r["tokens"] > 1]
    decode = [active(r["first"], r["decode_end"]) for r in dec]
    return {
        "n": len(rows),
        "tokens": sum(r["tokens"] for r in rows),
        "decode_tps": sum(r["tokens"] - 1 for r in dec) / sum(decode) if sum(decode) > 0 else float("nan"),
        "loop_wall_s": active(min(r["start"] for r in rows), max(r["end"] for r in rows)),
        "busy_s": sum(active(r["start"], r["end"]) for r in rows),
        "ttft_med_s": median([active(r["start"], r["first"]) for r in rows if r["first"] is not None]),
        # per query, for the paired per-query comparison
        "query_decode_s": [active(r["first"], r["decode_end"]) if r["first"] is not None else None for r in rows],
        "query_s": [active(r["start"], r["end"]) for r in rows],
    }


def ipw_rows(run_dir: Path) -> tuple[list[dict], list[str], dict]:
    """Per-query timings from a run folder's records: start_s/end_s are the measured window; ttft_s and
    latency_s are relative to the backend's own start of the call, which follows start_s by the prompt's
    rendering (well under a millisecond), so first token and end of the call are placed from start_s."""
    rows, outputs = [], []
    for line in (run_dir / "records.jsonl").read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        first = None if r["ttft_s"] is None else r["start_s"] + r["ttft_s"]
        rows.append({"start": r["start_s"], "end": r["end_s"], "first": first,
                     "decode_end": r["start_s"] + r["latency_s"], "tokens": r["completion_tokens"],
                     "error": r["error"]})
        outputs.append(r["output"])
    manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    return rows, outputs, manifest
