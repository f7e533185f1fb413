"""The worker protocol without a real engine (ipw/backends/worker.py, bench/overhead/fake_engine.py): the caller
reads its own answer off the pipe (no reader thread), answers reach their callers with many requests in
flight, a worker killed mid-call fails every call in flight, and a call that times out kills the worker."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ipw.backends.base import BackendSpec, GenerationSettings, QueryError
from ipw.backends.worker import WorkerDied

BENCH = Path(__file__).resolve().parents[2] / "bench" / "overhead"  # fake_engine.py


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A started fake-engine backend (its worker imports bench/overhead/fake_engine.py): ``fake(answer_ms, concurrency)``."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(BENCH), *filter(None, [os.environ.get("PYTHONPATH")])]))
    from fake_engine import FakeBackend

    made = []

    def make(answer_ms: float = 5.0, concurrency: int = 1) -> FakeBackend:
        backend = FakeBackend(BackendSpec(name="fake", kind="fake", model="fake", options={
            "answer_ms": answer_ms, "tokens": 4, "concurrency": [concurrency]}))
        backend.attach(tmp_path)
        backend.load()
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def test_one_in_flight_is_read_by_its_caller(fake):
    backend = fake()
    names = set()
    original = threading.Thread.start

    def start(self):
        names.add(self.name)
        return original(self)

    threading.Thread.start = start
    try:
        for n in range(20):
            c = backend.generate("x" * (4 * n + 4), GenerationSettings())
            assert c.prompt_tokens == n + 1 and c.completion_tokens == 4 and len(c.token_times_s) == 4
    finally:
        threading.Thread.start = original
    assert not names  # no thread was started for a call: the caller read its answer itself


def test_many_in_flight_each_get_their_own_answer(fake):
    backend = fake(answer_ms=10.0, concurrency=8)
    got: dict[int, int] = {}
    errors: list[BaseException] = []

    def one(n: int) -> None:
        try:
            for k in range(5):
                m = 100 * n + k
                got[m] = backend.generate("y" * (4 * m + 4), GenerationSettings()).prompt_tokens - 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert got == {m: m for m in got} and len(got) == 60


def test_a_worker_killed_mid_call_fails_every_call_in_flight(fake):
    backend = fake(answer_ms=2000.0, concurrency=4)
    results: list[BaseException | None] = []

    def one() -> None:
        try:
            backend.generate("z", GenerationSettings())
            results.append(None)
        except QueryError as exc:
            results.append(exc)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    os.kill(backend.pids()[0], signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert len(results) == 3 and all(isinstance(r, QueryError) and r.category == "engine_crash" for r in results)
    assert "SIGKILL" in str(results[0])
    backend.recover()  # a new worker answers again
    assert backend.generate("abcd", GenerationSettings()).prompt_tokens == 1


def test_a_call_past_its_timeout_kills_the_worker(fake):
    backend = fake(answer_ms=3000.0)
    worker = backend._worker
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match="no answer within"):
        worker.call("generate", timeout_s=0.3, prompt="q", settings=GenerationSettings().__dict__ | {"stop": []})
    assert time.monotonic() - t0 < 2.5
    worker.proc.wait(10)
    assert not worker.alive()

