"""A fake engine that answers every query in a fixed time, for the harness benchmarks
(``bench/overhead/harness_breakdown.py``, ``bench/scale/million.py``): what ipw adds around a query is then the only
thing that varies.

It runs where a real engine runs, in ipw's engine worker process (``ipw.backends.worker``), so the pipe
round trip is measured too.  Register it in the measuring process with ``register()`` (backend kind
``fake``) and put this folder on the worker's ``PYTHONPATH`` (the worker keeps ``PYTHONPATH``).

Options (``[[backends]]`` keys): ``answer_ms`` (default 20), ``tokens`` (output tokens per answer, with
evenly spaced token times; default 16), ``concurrency`` (levels, e.g. ``[1, 64]``: the engine answers
that many requests at once, each in ``answer_ms``).

    PYTHONPATH=. python3 bench/overhead/fake_engine.py run CONFIG --out DIR     # ipw's CLI with the fake engine registered

Output: none of its own (a test engine); used by bench/overhead/harness_breakdown.py, bench/scale/million.py,
    bench/overhead/roundtrip.py and bench/telemetry/audit_h200.sh.
"""

from __future__ import annotations

import time

from ipw.backends.base import BackendSpec, Completion
from ipw.backends.worker import WorkerBackend

KIND = "fake"


def answer(prompt: str, answer_ms: float, tokens: int) -> Completion:
    """One answer of ``tokens`` tokens after ``answer_ms`` (sleeping: a GPU engine's process waits too)."""
    start = time.monotonic()
    end = start + answer_ms / 1000.0
    step = (end - start) / max(1, tokens)
    time.sleep(max(0.0, end - time.monotonic()))
    end = time.monotonic()
    times = tuple(start + step * (i + 1) for i in range(tokens))
    return Completion("A", max(1, len(prompt) // 4), tokens, start, times[0] if times else None, end, times, "stop")


class FakeEngine:
    """The engine itself: in the worker process."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        opts = spec.options
        self.answer_ms = float(opts.get("answer_ms", 20.0))
        self.tokens = int(opts.get("tokens", 16))
        self.concurrency = max(opts.get("concurrency", [1]) or [1])

    def load(self) -> None:
        pass

    def generate(self, prompt: str, settings) -> Completion:
        return answer(prompt, self.answer_ms, self.tokens)

    def describe(self) -> dict:
        return {"engine": "fake", "answer_ms": self.answer_ms, "tokens": self.tokens}

    def close(self) -> None:
        pass


class FakeBackend(WorkerBackend):
    """ipw's handle on the fake engine in its worker."""

    ENGINE = "fake_engine:FakeEngine"
    OPTIONS = {"answer_ms": float, "tokens": int, "concurrency": list}
    LABEL = "fake engine"

    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        levels = tuple(int(c) for c in spec.options.get("concurrency", []) or [])
        self.levels = levels if len(levels) > 1 else ()
        if len(levels) == 1:
            self.concurrency = levels[0]  # and once loaded, the engine says the same (FakeEngine.concurrency)


def register() -> None:
    from ipw.backends.base import register_backend

    register_backend(KIND, "fake_engine:FakeBackend", replace=True)


if __name__ == "__main__":  # ipw's CLI with the fake engine registered: python bench/overhead/fake_engine.py run CONFIG
    import os
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])  # the worker's
    register()
    from ipw.cli import main

    sys.exit(main(sys.argv[1:]))
