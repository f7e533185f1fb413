"""The record writer (ipw/metering/record.py, ``RecordWriter``) on its own: records made final in query order, each
reported only once it is on disk, a window whose energy is not final holding back the ones after it, and an error
of the writer's thread (a full disk) raised on the measuring thread.  Real run folders (tests/runfolders.py); the
one stand-in is a deferred part made final by the test, as an NVML window is once the sampler has read past it."""

from __future__ import annotations

import threading
import time

import pytest
from runfolders import create, record

from ipw.errors import IpwError
from ipw.metering.record import RecordWriter
from ipw.metering.window import Closed
from ipw.results import RunFolder, read_log
from ipw.telemetry.base import Deferred, EnergyReading


class Gate(Deferred):
    """A window part that is final once the test opens it (``open``), with one reading of ``energy_j``."""

    def __init__(self, energy_j: float) -> None:
        self.energy_j, self.opened = energy_j, threading.Event()

    def ready(self) -> bool:
        return self.opened.is_set()

    def result(self) -> list[EnergyReading]:
        return [EnergyReading(component="gpu0", energy_j=self.energy_j, source="nvml", quality="measured",
                              scope="gpu", duration_s=0.1)]


def build(query_id: str):
    """A record's builder, as the runner hands one over: its energy the sum of the window's readings."""
    def make(readings: list[EnergyReading], splits=None) -> object:
        return record(query_id=query_id, energy_j=sum(r.energy_j or 0.0 for r in readings))
    return make


def on_disk(folder: RunFolder) -> list[str]:
    return [row["query_id"] for row in read_log(folder.path)]


def test_records_are_written_in_query_order_and_reported_once_on_disk(tmp_path):
    folder = create(tmp_path, "r1")
    reported: list[tuple[str, bool]] = []  # each record as it was reported, and whether it was on disk then
    writer = RecordWriter(folder, lambda r: reported.append((r.query_id, r.query_id in on_disk(folder))))
    for i in range(6):
        if i % 2:
            reading = EnergyReading(component="cpu", energy_j=float(i), source="rapl", quality="measured", scope="cpu",
                                    duration_s=0.1)
            writer.put(Closed([[reading]]), [], None, build(f"q{i}"))
        else:
            writer.put_record(record(query_id=f"q{i}", energy_j=float(i)))
    writer.close()
    assert on_disk(folder) == [f"q{i}" for i in range(6)]
    assert reported == [(f"q{i}", True) for i in range(6)]
    assert [row["energy_j"] for row in read_log(folder.path)] == [float(i) for i in range(6)]


def test_a_window_not_final_holds_back_the_records_after_it(tmp_path):
    folder = create(tmp_path, "r1")
    reported: list[str] = []
    writer = RecordWriter(folder, lambda r: reported.append(r.query_id))
    gate = Gate(7.5)
    writer.put_record(record(query_id="q0"))
    writer.put(Closed([gate]), [], None, build("q1"))
    writer.put_record(record(query_id="q2"))
    deadline = time.monotonic() + 30
    while reported != ["q0"] and time.monotonic() < deadline:  # q0 is final: written without waiting for q1
        writer.started()
        time.sleep(0.05)
    time.sleep(3 * RecordWriter.PACE_S)  # the writer looked again, more than once: q1 is still not final
    assert reported == ["q0"] and on_disk(folder) == ["q0"]
    gate.opened.set()
    writer.close()
    assert reported == ["q0", "q1", "q2"] and on_disk(folder) == ["q0", "q1", "q2"]
    assert read_log(folder.path)[1]["energy_j"] == 7.5


def test_close_makes_every_window_final_and_writes_it(tmp_path):
    """At close every handed-over record is written: a window still not final is waited for (its readings)."""
    folder = create(tmp_path, "r1")
    gate = Gate(2.0)
    writer = RecordWriter(folder, lambda r: None)
    writer.put(Closed([gate]), [], None, build("q0"))
    threading.Timer(0.3, gate.opened.set).start()
    writer.close()
    assert on_disk(folder) == ["q0"] and read_log(folder.path)[0]["energy_j"] == 2.0


class FullDisk:
    """A sink that is not a run folder (a Ray task's): its records come one ``append`` at a time; the third fails."""

    def __init__(self) -> None:
        self.records: list[str] = []

    def append(self, r) -> None:
        if len(self.records) == 2:
            raise IpwError("records.jsonl: No space left on device")
        self.records.append(r.query_id)


def test_an_error_of_the_writer_is_raised_on_the_measuring_thread(tmp_path):
    sink = FullDisk()
    reported: list[str] = []
    writer = RecordWriter(sink, lambda r: reported.append(r.query_id))  # type: ignore[arg-type]
    for i in range(3):
        writer.put_record(record(query_id=f"q{i}"))
        writer.started()
        time.sleep(0.05)
    deadline = time.monotonic() + 30
    with pytest.raises(IpwError, match="No space left"):  # at the next put, once the thread has failed
        while time.monotonic() < deadline:
            writer.put_record(record(query_id="later"))
            writer.started()
            time.sleep(0.05)
    with pytest.raises(IpwError, match="No space left"):
        writer.close()
    assert sink.records == ["q0", "q1"]
    assert "q2" not in reported and "later" not in reported  # a record not written is never reported
