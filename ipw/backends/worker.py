"""Engines in worker processes: the measuring process never loads an engine library.

An engine's native libraries (llama.cpp, vLLM and its torch) and ipw's measuring and analysis stack
(numpy, pandas, pyarrow) corrupt each other's heap when they share a process on a real GPU image
(docs/ARCHITECTURE.md, 'Engines in worker processes').  So every engine runs in a worker process that ipw starts, feeds and stops:

- the worker is ``PYTHON HOME/ipw.backends.worker.py FD_IN FD_OUT`` (``worker_home``: this module, run from
  a folder that holds only this ipw), under this interpreter or another one
  (e.g. ``.venv-vllm/bin/python``), in a session of its own (Ctrl-C reaches ipw, not the engine);
- it imports only this module (standard library), then the engine class named by ``load``, whose module
  imports the engine before anything else; it never imports pandas or pyarrow;
- requests and answers are JSON lines on two pipes, matched by id, so a batching engine can answer
  out of order; the worker's own stdout and stderr go to a log file (a run's ``worker-NAME.log``);
- token timestamps are ``time.monotonic()`` in the worker: one clock for every process of the machine;
- the CPU energy model measures the worker's process tree (``pids()``);
- a worker that dies (SIGSEGV, SIGILL, SIGABRT, OOM kill, exit) fails the requests in flight with
  ``QueryError(category="engine_crash")`` naming the signal; ``recover()`` restarts it, at most
  ``MAX_RESTARTS`` times per backend, then raises ``EngineStopped``.
"""

from __future__ import annotations

import array
import atexit
import base64
import dataclasses
import functools
import importlib
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

from ipw.backends.base import BackendBase, BackendSpec, Completion, GenerationSettings, QueryError, ServerTimings
from ipw.backends.engine_log import (SIGNAL_HINTS, WRAPPER_IN_MESSAGE, exit_text, out_of_memory, read_log,
                                     root_cause)
from ipw.errors import IpwError

MAX_RESTARTS = 3
LOAD_TIMEOUT_S = 600.0  # a vLLM engine takes 25-35 s on 2 cores; a large GGUF from a slow disk longer
CLOSE_TIMEOUT_S = 30.0  # a worker's close: its answer, then its exit
#: a read of the answer pipe wakes this often to see whether the worker is still there: a process the engine
#: forked (vLLM's engine core with the fork start method) holds the pipe open after the worker is gone
POLL_S = 1.0
LEFTOVER_GRACE_S = 3.0  # what a closed worker left (its engine's processes) may end by itself, then SIGKILL
#: the wait for a process after SIGKILL; one stuck in the kernel (a GPU driver's teardown) is left, not waited on
KILL_WAIT_S = 10.0

class EngineStopped(IpwError):
    """A backend whose engine died while loading, or crashed more than ``MAX_RESTARTS`` times: the run
    stops that backend and goes on with the others (elsewhere it is a one-line error)."""


class WorkerDied(Exception):
    def __init__(self, returncode: int | None, log_tail: str) -> None:
        self.returncode = returncode
        self.log_tail = log_tail
        name = exit_text(returncode).split(" ")[0]
        hint = SIGNAL_HINTS.get(name, "")
        super().__init__(f"{exit_text(returncode)}" + (f", {hint}" if hint else "")
                         + (f"; its log ends: {log_tail}" if log_tail else ""))


def _tail(path: Path, limit: int = 200) -> str:
    """The last non-empty line of a log, shortened (for a one-line error)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 4096))
            lines = [ln.strip() for ln in fh.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:limit] if lines else ""


#: The file a worker runs (in ``worker_home()``): the worker module, found through that folder's link.
WORKER_SCRIPT = "ipw.backends.worker.py"


@functools.cache
def worker_home() -> Path:
    """A folder of this process's own (``mkdtemp``, removed at exit) that holds only a link to this ``ipw``
    package and ``WORKER_SCRIPT``.  A worker runs that script by its path, so this folder comes first on
    its path on every Python version: it imports this very code, not an ``ipw`` of the folder it was
    started from (``python -m`` puts the current folder first) nor, under another interpreter, one of
    that environment."""
    home = Path(tempfile.mkdtemp(prefix="ipw-worker-home-"))
    (home / "ipw").symlink_to(Path(__file__).resolve().parents[1], target_is_directory=True)
    (home / WORKER_SCRIPT).write_text('import runpy\nrunpy.run_module("ipw.backends.worker", run_name="__main__", '
                                      'alter_sys=True)\n', encoding="utf-8")

    owner = os.getpid()

    def remove() -> None:
        if os.getpid() != owner:  # a forked child exiting: the folder is its parent's
            return
        for name in ("ipw", WORKER_SCRIPT):
            (home / name).unlink(missing_ok=True)
        home.rmdir()
    atexit.register(remove)
    return home


def worker_env(python: str) -> dict[str, str]:
    """The worker's environment: what an engine needs of ours (``servers.server_env``: no API keys,
    tokens or credentials) and ipw's own settings, with ``worker_home()`` first on ``PYTHONPATH`` too (for
    what the worker itself starts, e.g. vLLM's engine process, which imports the worker module again)."""
    from ipw.backends.servers import server_env

    env = server_env(extra_prefixes=("IPW_",))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(worker_home()), *filter(None, [env.get("PYTHONPATH")])])
    return env


class _Call:
    """One request in flight: its answer, and the event that wakes its caller (the answer came, the
    worker died, or it is this caller's turn to read the pipe)."""

    __slots__ = ("answer", "wake")

    def __init__(self) -> None:
        self.answer: dict[str, Any] | None = None
        self.wake = threading.Event()


class Worker:
    """One worker process and its two pipes; ``call`` is safe from several threads.

    There is no reader thread: a caller reads the answer pipe itself.  One caller at a time reads (the
    reader); it hands every answer it reads to that answer's caller and stops once its own has come,
    waking another caller in flight, if any, to read next.  With one request in flight (a run at
    concurrency 1) the caller writes its request and reads its answer on its own thread: no thread
    hand-off, one wake-up when the answer arrives (docs/PERFORMANCE.md)."""

    READ_BYTES = 1 << 16

    def __init__(self, python: str, log_path: Path) -> None:
        self.python, self.log_path = python, log_path
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        log = open(log_path, "ab")
        self.log_offset = log.tell()  # where this worker's part of the log begins (a resume appends to it)
        try:
            self.proc = subprocess.Popen(
                [python, str(worker_home() / WORKER_SCRIPT), str(req_r), str(resp_w)], pass_fds=(req_r, resp_w),
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=worker_env(python), start_new_session=True)
        except OSError as exc:
            for fd in (req_r, req_w, resp_r, resp_w):
                os.close(fd)
            raise IpwError(f"cannot start an engine worker with {python}: {exc.strerror}") from None
        finally:
            log.close()
        os.close(req_r)
        os.close(resp_w)
        self._out_fd, self._in_fd = req_w, resp_r
        self._buffer = b""  # answer bytes read and not yet a whole line (the reader's)
        self._ids = itertools.count()
        self._pending: dict[int, _Call] = {}
        self._lock = threading.Lock()
        self._reading = False  # a caller is reading the answer pipe
        self.died: WorkerDied | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.died is None and self.proc.poll() is None

    def call(self, op: str, timeout_s: float | None = None, **args: Any) -> dict[str, Any]:
        """Send one request and wait for its answer; raises WorkerDied when the worker is gone."""
        mine = _Call()
        with self._lock:
            if self.died is not None:
                raise self.died
            rid = next(self._ids)
            self._pending[rid] = mine
            try:
                self._write_all((json.dumps({"id": rid, "op": op, **args}) + "\n").encode("utf-8"))
            except OSError:
                pass  # the worker is gone: the read below sees the end of the pipe
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            return self._wait(mine, deadline)
        except TimeoutError:
            with self._lock:
                self._pending.pop(rid, None)
            self.kill()
            raise WorkerDied(None, f"no answer within {timeout_s:.0f} s; the worker was killed") from None

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._out_fd, view):]

    def _wait(self, mine: _Call, deadline: float | None) -> dict[str, Any]:
        """Wait for ``mine``'s answer, reading the pipe while no other caller does."""
        while True:
            with self._lock:
                if mine.answer is not None:
                    return mine.answer
                if self.died is not None:
                    raise self.died
                lead = not self._reading
                self._reading = self._reading or lead
                mine.wake.clear()
            if lead:
                try:
                    self._read_until(mine, deadline)
                finally:
                    with self._lock:
                        self._reading = False
                        following = next((c for c in self._pending.values() if c is not mine), None)
                    if following is not None:
                        following.wake.set()  # its turn to read
                continue
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not mine.wake.wait(left):
                raise TimeoutError

    def _read_until(self, mine: _Call, deadline: float | None) -> None:
        """Read answers, handing each to its caller, until ``mine`` has come (or the worker died).  No read
        blocks for more than ``POLL_S``: the end of the pipe is not the only sign of a dead worker (a process
        it forked may hold the pipe open), so an idle pipe is a check of the worker's process."""
        while mine.answer is None:
            wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError
            if not select.select([self._in_fd], [], [], wait)[0]:
                if self.proc.poll() is not None and not select.select([self._in_fd], [], [], 0)[0]:
                    self._died()  # gone, and nothing left to read: whatever holds the pipe is not the worker
                    return
                continue
            chunk = os.read(self._in_fd, self.READ_BYTES)
            if not chunk:  # the pipe closed: the worker exited or died
                self._died()
                return
            *lines, self._buffer = (self._buffer + chunk).split(b"\n")
            for line in lines:
                try:
                    msg = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    continue
                with self._lock:
                    call = self._pending.pop(msg.get("id"), None)
                if call is not None:
                    call.answer = msg
                    call.wake.set()

    def _died(self) -> None:
        returncode = self._reap(KILL_WAIT_S)
        with self._lock:
            self.died = WorkerDied(returncode, _tail(self.log_path))
            pending, self._pending = self._pending, {}
        for call in pending.values():
            call.wake.set()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the worker and what it started (vLLM's engine core)
        except (ProcessLookupError, PermissionError):
            pass

    def _reap(self, timeout_s: float) -> int | None:
        """The worker's exit status, waiting up to ``timeout_s``, then SIGKILL (its session) and
        ``KILL_WAIT_S`` more; None when it is still there (stuck in the kernel): it is not waited on."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        try:
            return self.proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            return None

    def _descendants(self) -> list[Any]:
        """The worker's descendants now (``psutil``: this runs in ipw, never in the worker); one that left
        the worker's session (``setsid``) is still found here, while the worker is alive."""
        import psutil

        try:
            return psutil.Process(self.proc.pid).children(recursive=True) if self.proc.poll() is None else []
        except psutil.Error:
            return []

    def _pipe_holders(self) -> list[Any]:
        """The processes, other than this one and the worker, that still hold the answer pipe open once the
        worker has exited (what it forked: a fork inherits the pipe), found through ``/proc`` (none elsewhere),
        only when the pipe has not ended.  One that left the worker's session is found here too."""
        import psutil

        try:
            while select.select([self._in_fd], [], [], 0)[0]:  # what is left to read, then the end
                if not os.read(self._in_fd, self.READ_BYTES):
                    return []  # the pipe ended: nobody holds it
            target = f"pipe:[{os.fstat(self._in_fd).st_ino}]"
            pids = [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]
        except OSError:
            return []
        holders = []
        for pid in pids:
            if pid in (os.getpid(), self.proc.pid):
                continue
            try:
                if any(os.readlink(fd.path) == target for fd in os.scandir(f"/proc/{pid}/fd")):
                    holders.append(psutil.Process(pid))
            except (OSError, psutil.Error):
                continue
        return holders

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> str | None:
        """Stop the worker: its ``close`` request, a wait for its exit, then SIGKILL for it if it is still
        there and for what it left (its session's processes, its descendants and whatever still holds its
        answer pipe: vLLM's engine core) once they had ``LEFTOVER_GRACE_S`` to end by themselves.  Every wait
        is bounded.  Returns one line saying what had to be killed (None when nothing had to)."""
        import psutil

        from ipw.backends.servers import process_group

        tree = self._descendants()  # before the worker goes: its children are re-parented then
        if self.alive():
            try:
                self.call("close", timeout_s=timeout_s)
            except WorkerDied:
                pass
        killed: list[str] = []
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                killed.append(f"the worker (pid {self.proc.pid}), which had not exited {timeout_s:.0f} s after "
                              "its close")
        found: dict[int, Any] = {p.pid: p for p in tree}
        for proc in process_group(self.proc.pid) + (self._pipe_holders() if self.proc.poll() is not None else []):
            found.setdefault(proc.pid, proc)
        left = _running([p for pid, p in found.items() if pid != self.proc.pid], LEFTOVER_GRACE_S)
        for proc in left:
            try:
                proc.kill()
            except psutil.Error:
                pass
        if left:
            killed.append(f"{len(left)} process(es) it left running (pid {', '.join(str(p.pid) for p in left)})")
        returncode = self._reap(0 if killed else KILL_WAIT_S)  # SIGKILL for its session too
        stuck = _running(left, KILL_WAIT_S)
        stuck_pids = [p.pid for p in stuck] + ([self.proc.pid] if returncode is None else [])
        with self._lock:
            if self.died is None:
                self.died = WorkerDied(returncode, "")
        for fd in (self._out_fd, self._in_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        if not killed and not stuck_pids:
            return None
        line = ("killed (SIGKILL) " + " and ".join(killed)) if killed else ""
        if stuck_pids:
            line += ("; " if line else "") + (f"pid {', '.join(map(str, stuck_pids))} did not exit even after SIGKILL "
                                              f"({KILL_WAIT_S:.0f} s; stuck in the kernel, e.g. a GPU driver's "
                                              "teardown?): left behind, not waited on")
        return line


def _running(procs: list[Any], wait_s: float) -> list[Any]:
    """Those of ``procs`` (``psutil.Process``) still running after up to ``wait_s``; a zombie has ended (a
    container's first process may never reap the orphans it inherits)."""
    import psutil

    def running(proc: Any) -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + wait_s
    while True:
        procs = [p for p in procs if running(p)]
        if not procs or time.monotonic() >= deadline:
            return procs
        time.sleep(0.05)


class WorkerBackend(BackendBase):
    """A backend whose engine (``ENGINE``: ``module:Class``) runs in a worker process.

    The engine class has the Backend methods ``load``, ``generate``, ``describe``, ``close`` and may set
    ``concurrency``; it is built from the ``BackendSpec`` in the worker.  Subclasses resolve what can be
    checked cheaply (model files) in ``__init__``, in this process, before any run folder exists."""

    ENGINE = ""
    OPTIONS: ClassVar[dict[str, Any]] = {}
    LABEL = "engine"
    #: what to change when the engine could not load for want of memory (the options of the kind)
    MEMORY_HINT = ""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.concurrency = 1
        self.restarts = 0
        self.crashes: list[str] = []  # exit status of every death, e.g. "SIGSEGV (signal 11)"
        self._last_crash = ""
        self._worker: Worker | None = None
        self._log_dir: Path | None = None
        self._described: dict[str, Any] = {}
        self._recover_lock = threading.Lock()

    def python(self) -> str:
        """The interpreter of the worker (a backend option ``python``, else this one)."""
        return self.spec.options.get("python") or sys.executable

    def attach(self, run_dir: str | Path) -> None:
        self._log_dir = Path(run_dir)

    def _log_path(self) -> Path:
        from ipw.sanitize import file_part

        safe = file_part(self.spec.name)
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="ipw-worker-"))
        return self._log_dir / f"worker-{safe}.log"

    def engine_spec(self) -> BackendSpec:
        """The spec the engine is built from in the worker (subclasses resolve files here first)."""
        return self.spec

    def _close_worker(self, worker: Worker, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """``Worker.close``, and its one line on stderr when something had to be killed."""
        line = worker.close(timeout_s)
        if line:
            sys.stderr.write(f"note: backend {self.spec.name!r}: {line}\n")
            sys.stderr.flush()

    def _start(self) -> None:
        worker = Worker(self.python(), self._log_path())
        try:
            answer = worker.call("load", timeout_s=LOAD_TIMEOUT_S, engine=self.ENGINE,
                                 spec=dataclasses.asdict(self.engine_spec()))
        except WorkerDied as died:
            self._close_worker(worker)
            self.crashes.append(exit_text(died.returncode))
            self._last_crash = str(died)
            raise EngineStopped(f"backend {self.spec.name!r}: the {self.LABEL} worker died while loading "
                                f"{self.spec.model}: {died}") from None
        except BaseException:  # Ctrl-C (or SIGTERM) while it loads: the worker and its engine go too
            self._close_worker(worker, timeout_s=5)
            raise
        if not answer["ok"]:
            self._close_worker(worker)
            raise IpwError(self._load_failure(answer["message"], worker))
        self.concurrency = int(answer.get("concurrency", 1))
        self._worker = worker

    def _load_failure(self, message: str, worker: Worker) -> str:
        """The one line of an engine that could not load: its message, with the root cause its worker's log
        names (``root_cause``) where the message does not hold it (vLLM V1 raises "Engine core initialization
        failed. See root cause above": the engine core's own error went to the log), a hint when it ran out
        of memory (``MEMORY_HINT``), and the log's path."""
        cause = root_cause(read_log(worker.log_path, worker.log_offset))
        if cause and cause not in message:
            wrapper = WRAPPER_IN_MESSAGE.search(message)
            if wrapper:  # the wrapper's text gives way to the cause
                message = message[:wrapper.start()] + cause
            else:
                message = f"{message}; its log names: {cause}"
        if self.MEMORY_HINT and out_of_memory(message):
            message = f"{message.rstrip('.')}; hint: {self.MEMORY_HINT}"
        return f"{message} (log: {worker.log_path})" if cause else message

    def load(self) -> None:
        try:
            self._start()
        except EngineStopped:  # died while loading: the same restarts as a crash mid-run
            self._restart()

    def alive(self) -> bool:
        return self._worker is not None and self._worker.alive()

    def recover(self) -> None:
        """Restart a worker that died (the runner calls this outside any measurement window);
        ``EngineStopped`` once the backend has used its ``MAX_RESTARTS`` restarts."""
        with self._recover_lock:
            if not self.alive():
                self._restart()

    def _restart(self) -> None:
        while self.restarts < MAX_RESTARTS:
            self.restarts += 1
            if self._worker is not None:
                self._close_worker(self._worker, timeout_s=5)
                self._worker = None
            try:
                self._start()
                return
            except EngineStopped:
                continue
        raise EngineStopped(f"backend {self.spec.name!r} stopped: its {self.LABEL} worker died "
                            f"{len(self.crashes)} times, {self.restarts} restarts (last: {self._last_crash}); "
                            f"log: {self._log_path()}")

    def generate(self, prompt: str, settings: GenerationSettings) -> Completion:
        if not self.alive():
            self.recover()  # requests in flight together (concurrency > 1) restart it here
        worker = self._worker
        assert worker is not None
        try:
            answer = worker.call("generate", prompt=prompt, settings=dataclasses.asdict(settings))
        except WorkerDied as died:
            self.crashes.append(exit_text(died.returncode))
            self._last_crash = str(died)
            raise QueryError(f"the {self.LABEL} worker (pid {worker.pid}) died: {died}", "engine_crash") from None
        if not answer["ok"]:
            raise_answer_error(answer)
        result = answer["result"]
        timings = result.get("server_timings")
        return Completion(**{**result, "token_times_s": unpack_times(result["token_times_s"]),
                             "server_timings": ServerTimings(**timings) if timings else None})

    def pids(self) -> list[int]:
        return [self._worker.pid] if self._worker is not None else []

    def invoke(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Call another method of the engine in the worker (restarting a dead worker first); a worker
        that dies meanwhile is a QueryError ``engine_crash``."""
        if not self.alive():
            self.recover()
        try:
            answer = self._worker.call("call", timeout_s=timeout_s, method=method, kwargs=kwargs)  # type: ignore[union-attr]  # recover() started one
        except WorkerDied as died:
            raise QueryError(f"the {self.LABEL} worker died: {died}", "engine_crash") from None
        if not answer["ok"]:
            raise_answer_error(answer)
        return answer["result"]

    def describe(self) -> dict[str, Any]:
        if self.alive():
            try:
                self._described = self.invoke("describe", timeout_s=60)
            except (QueryError, IpwError):
                pass  # the last description stands
        return {**self._described, "worker": {"python": self.python(), "restarts": self.restarts,
                                              "crashes": list(self.crashes)}}

    def close(self) -> None:
        if self._worker is not None:
            worker, self._worker = self._worker, None
            self._close_worker(worker)


def pack_times(times: Any) -> str:
    """A completion's token times in its one answer message: the doubles' bytes in base64 (exact, and a
    third of the cost of JSON floats to write and read: ``bench/overhead/roundtrip.py``)."""
    return base64.b64encode(array.array("d", times).tobytes()).decode("ascii")


def unpack_times(packed: str) -> tuple[float, ...]:
    times = array.array("d")
    times.frombytes(base64.b64decode(packed))
    return tuple(times)


def raise_answer_error(answer: dict[str, Any]) -> None:
    if answer.get("kind") == "user":
        raise IpwError(answer["message"])
    raise QueryError(answer["message"], answer.get("category") or "backend_error")


# -- the worker side ---------------------------------------------------------------------------------

def _die_with_parent(poll_s: float = 1.0) -> None:
    """Leave when ipw is gone (killed, say), even mid-answer, so no engine outlives its run.  (Not
    PR_SET_PDEATHSIG: that fires when the *thread* that started the worker ends.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="ipw-worker-watchdog", daemon=True).start()


def serve(fd_in: int, fd_out: int) -> None:
    """Answer requests until ``close`` or the end of the request pipe; then leave at once (no
    interpreter teardown, where native libraries have crashed before)."""
    import faulthandler

    faulthandler.enable()  # a native crash leaves the Python stack in the worker's log (then the record)
    _die_with_parent()
    requests = os.fdopen(fd_in, "r", encoding="utf-8")
    answers = os.fdopen(fd_out, "w", encoding="utf-8")
    lock = threading.Lock()
    engine: Any = None
    threads: list[threading.Thread] = []

    def send(rid: Any, **msg: Any) -> None:
        with lock:
            answers.write(json.dumps({"id": rid, **msg}) + "\n")
            answers.flush()

    def answer(rid: Any, fn: Any) -> None:
        try:
            result = fn()
        except IpwError as exc:
            send(rid, ok=False, kind="user", message=exc.message)
        except QueryError as exc:
            send(rid, ok=False, kind="query", category=exc.category, message=str(exc))
        except Exception as exc:  # one query failed; the engine goes on
            send(rid, ok=False, kind="query", category="backend_error", message=f"{type(exc).__name__}: {exc}")
        else:
            if dataclasses.is_dataclass(result):  # a Completion: its fields as they are (asdict copies deeply)
                result = dict(vars(result))
                result["token_times_s"] = pack_times(result["token_times_s"])
                if result.get("server_timings") is not None:  # the engine's own timing (vLLM's request metrics)
                    result["server_timings"] = dataclasses.asdict(result["server_timings"])
            send(rid, ok=True, result=result, concurrency=getattr(engine, "concurrency", 1))

    def load(msg: dict[str, Any]) -> None:
        nonlocal engine
        module, _, name = msg["engine"].partition(":")
        engine = getattr(importlib.import_module(module), name)(BackendSpec(**msg["spec"]))
        engine.load()

    close_id = None
    for line in requests:
        msg = json.loads(line)
        rid, op = msg["id"], msg["op"]
        if op == "close":
            close_id = rid
            break
        if op == "load":
            answer(rid, lambda: load(msg))
        elif op == "generate":
            settings = GenerationSettings(**{**msg["settings"], "stop": tuple(msg["settings"]["stop"])})

            def work(p: str = msg["prompt"], s: GenerationSettings = settings) -> Any:  # bound now: runs in a thread
                return engine.generate(p, s)
            if getattr(engine, "concurrency", 1) > 1:  # a batching engine: requests in flight together
                thread = threading.Thread(target=answer, args=(rid, work), daemon=True)
                thread.start()
                threads = [t for t in threads if t.is_alive()] + [thread]
            else:
                answer(rid, work)
        elif op == "call":  # another method of the engine, e.g. a tokenizer's count
            answer(rid, lambda m=msg: getattr(engine, m["method"])(**m.get("kwargs", {})))
        else:
            send(rid, ok=False, kind="user", message=f"unknown worker request {op!r}")
    until = time.monotonic() + CLOSE_TIMEOUT_S / 2  # answers in flight may end; ipw kills the worker later
    for thread in threads:
        thread.join(max(0.0, until - time.monotonic()))
    try:
        if engine is not None:
            engine.close()
    finally:
        if close_id is not None:
            send(close_id, ok=True, result=None)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
