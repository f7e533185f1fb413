"""A test engine whose start leaves a stray process behind (tests/backends/test_engine_exit.py): its ``load`` forks a
child that ignores SIGTERM, leaves the worker's session (``setsid``), holds the worker's pipes (a fork
inherits them, as vLLM's engine core started with the fork method does) and never exits; then the load
fails (``on_load = "fail"``: an exception, as vLLM's "Engine core initialization failed") or the worker dies
(``on_load = "die"``: SIGKILL, with the answer pipe still open in the child).  Each child's pid goes to a line
of ``pid_file``.  Registered as kind ``stray`` in the measuring process (``register``); the worker imports
this module from ``PYTHONPATH``."""

from __future__ import annotations

import os
import signal
import time

from ipw.backends.base import BackendSpec
from ipw.backends.worker import WorkerBackend

KIND = "stray"


class StrayEngine:
    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.concurrency = 1

    def load(self) -> None:
        pid = os.fork()
        if pid == 0:  # the stray: no Python teardown, no exit
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.setsid()
            while True:
                time.sleep(60)
        with open(self.spec.options["pid_file"], "a") as fh:
            fh.write(f"{pid}\n")
        if self.spec.options.get("on_load") == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("Engine core initialization failed. See root cause above.")

    def generate(self, prompt, settings):  # never reached
        raise AssertionError

    def describe(self) -> dict:
        return {"engine": "stray"}

    def close(self) -> None:
        pass


class StrayBackend(WorkerBackend):
    ENGINE = "stray_engine:StrayEngine"
    OPTIONS = {"pid_file": str, "on_load": str}
    LABEL = "stray engine"


def register() -> None:
    from ipw.backends.base import register_backend

    register_backend(KIND, "stray_engine:StrayBackend", replace=True)
