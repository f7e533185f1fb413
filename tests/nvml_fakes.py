"""An autospec'd pynvml whose GPUs answer from arrays (recorded or synthetic) at the time of a clock.

Shared by tests/telemetry/test_nvml_basic.py, tests/telemetry/test_nvml_sampler.py, tests/telemetry/test_multigpu.py (and
tests/telemetry/test_doctor.py through test_nvml_sampler).  The energy counter is the last read at or before
now, the sample buffer returns the driver samples stamped after ``last_seen`` and no older than
~2.4 s (the driver's buffer), the instant field the last point.  ``drive`` runs an unthreaded
sampler through its own schedule, so a replay is deterministic and takes no real time; ``RealClock``
serves a threaded sensor on the real clock.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Sequence
from unittest import mock

import numpy as np
import pynvml as real_pynvml

from ipw.telemetry.nvml import NvmlSensor, PendingWindow

BUFFER_US = 2_400_000  # the driver's sample buffer holds ~2.4 s
POWER_LIMIT_MW = 700_000  # an H200 SXM


def err(name: str) -> real_pynvml.NVMLError:
    return real_pynvml.NVMLError(getattr(real_pynvml, name))


@dataclass
class Signals:
    samp_ts_us: np.ndarray  # driver wall-clock µs
    samp_mw: np.ndarray
    ctr_t_ns: np.ndarray  # monotonic ns at which each read's value was seen
    ctr_mj: np.ndarray
    inst_t_ns: np.ndarray
    inst_mw: np.ndarray
    samples_ok: bool = True
    counter_ok: bool = True
    instant_ok: bool = True
    lost_after_ns: int | None = None  # every call fails with GPU_IS_LOST from then on
    fail_with: str | None = None  # every power call fails with this NVML error (e.g. "NVML_ERROR_NO_PERMISSION")


class Clock:
    def __init__(self, mono_ns: int, offset_ns: int) -> None:
        self.mono_ns = int(mono_ns)
        self.offset_ns = int(offset_ns)  # mono - wall

    def mono(self) -> int:
        return self.mono_ns

    def wall(self) -> int:
        return self.mono_ns - self.offset_ns


class RealClock:
    def mono(self) -> int:
        return time.monotonic_ns()

    def wall(self) -> int:
        return time.time_ns()


def real_offset_ns() -> int:
    return time.monotonic_ns() - time.time_ns()


def make_fake(monkeypatch, gpus: list[Signals], clock, *, uuids: Sequence[str] | None = None) -> mock.MagicMock:
    """An autospec of pynvml whose device calls answer from ``gpus`` at ``clock.mono()``.

    Handles are ``("handle", nvml_index)``; UUIDs are ``GPU-{i:04d}aaaa-0000`` unless given."""
    m = mock.create_autospec(real_pynvml)
    m.NVMLError = real_pynvml.NVMLError
    for name in dir(real_pynvml):
        if name.startswith("NVML_"):
            setattr(m, name, getattr(real_pynvml, name))
    names = list(uuids) if uuids is not None else [f"GPU-{i:04d}aaaa-0000" for i in range(len(gpus))]
    m.nvmlDeviceGetCount.return_value = len(gpus)
    m.nvmlDeviceGetHandleByIndex.side_effect = lambda i: ("handle", i)
    m.nvmlDeviceGetUUID.side_effect = lambda h: names[h[1]]
    m.nvmlDeviceGetName.side_effect = lambda h: "NVIDIA H200"
    m.nvmlDeviceGetMigMode.side_effect = err("NVML_ERROR_NOT_SUPPORTED")
    m.nvmlDeviceGetEnforcedPowerLimit.side_effect = lambda h: POWER_LIMIT_MW

    def gpu(h) -> Signals:
        g = gpus[h[1]]
        if g.lost_after_ns is not None and clock.mono() >= g.lost_after_ns:
            raise err("NVML_ERROR_GPU_IS_LOST")
        if g.fail_with is not None:
            raise err(g.fail_with)
        return g

    def counter(h):
        g = gpu(h)
        if not g.counter_ok:
            raise err("NVML_ERROR_NOT_SUPPORTED")
        i = max(0, int(np.searchsorted(g.ctr_t_ns, clock.mono(), side="right")) - 1)
        return int(g.ctr_mj[i])

    def samples(h, kind, last_ts):
        g = gpu(h)
        assert kind == real_pynvml.NVML_TOTAL_POWER_SAMPLES
        if not g.samples_ok:
            raise err("NVML_ERROR_NOT_SUPPORTED")
        now_us = clock.wall() // 1000
        lo = int(np.searchsorted(g.samp_ts_us, max(int(last_ts), now_us - BUFFER_US), side="right"))
        hi = int(np.searchsorted(g.samp_ts_us, now_us, side="right"))
        if hi <= lo:
            raise err("NVML_ERROR_NOT_FOUND")
        out = (real_pynvml.c_nvmlSample_t * (hi - lo))()
        for k, j in enumerate(range(lo, hi)):
            out[k].timeStamp = int(g.samp_ts_us[j])
            out[k].sampleValue.uiVal = int(g.samp_mw[j])
        return real_pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, out[0: hi - lo]

    def fields(h, ids):
        g = gpu(h)
        assert list(ids) == [real_pynvml.NVML_FI_DEV_POWER_INSTANT]  # never the 1 s average
        out = (real_pynvml.c_nvmlFieldValue_t * 1)()
        out[0].fieldId = ids[0]
        if not g.instant_ok:
            out[0].nvmlReturn = real_pynvml.NVML_ERROR_NOT_SUPPORTED
            return out
        i = max(0, int(np.searchsorted(g.inst_t_ns, clock.mono(), side="right")) - 1)
        out[0].valueType = real_pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        out[0].value.uiVal = int(g.inst_mw[i])
        out[0].timestamp = clock.wall() // 1000
        return out

    m.nvmlDeviceGetTotalEnergyConsumption.side_effect = counter
    m.nvmlDeviceGetSamples.side_effect = samples
    m.nvmlDeviceGetFieldValues.side_effect = fields
    m.nvmlDeviceGetPowerUsage.side_effect = AssertionError("the 1 s averaged power is never read")
    monkeypatch.setitem(sys.modules, "pynvml", m)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return m


def drive(sensor: NvmlSensor, clock: Clock, t_ns: int, *others: NvmlSensor) -> None:
    """Run the (unthreaded) sampler(s) through every read due up to ``t_ns``."""
    samplers = [s.sampler for s in (sensor, *others)]
    while True:
        due, sampler = min((s.next_due_ns(), k) for k, s in enumerate(samplers))
        if due > t_ns:
            break
        clock.mono_ns = max(clock.mono_ns, due)
        samplers[sampler].run_due()
    clock.mono_ns = max(clock.mono_ns, int(t_ns))


def synthetic(duration_s: float = 60.0, *, idle_w: float = 100.0, load_w: float = 400.0,
              load: tuple[float, float] | Sequence[tuple[float, float]] = (20.0, 30.0),
              offset_ns: int = -1_795_964_883_910_343_200,
              t0_s: float = 1000.0) -> tuple[Signals, Clock]:
    """Power ``idle_w`` with ``load_w`` during ``load`` (seconds after t0; one interval or a list):
    20 ms driver samples, a counter that steps every 100 ms, instant power every 100 ms."""
    loads = [load] if isinstance(load[0], (int, float)) else list(load)  # type: ignore[index]

    def power(t_rel):
        on = np.zeros(np.shape(t_rel), dtype=bool)
        for a, b in loads:
            on |= (t_rel >= a) & (t_rel < b)
        return np.where(on, load_w, idle_w)

    t_rel = np.arange(-5.0, duration_s, 0.02) + 0.02
    samp_mono_ns = ((t0_s + t_rel) * 1e9).astype(np.int64)
    samp_mw = (power(t_rel - 0.01) * 1000).astype(np.int64)  # the average over the preceding 20 ms
    steps = np.arange(-5.0, duration_s, 0.1)
    e_mj = 5_000_000 + np.cumsum(power(steps) * 0.1 * 1000).astype(np.int64)
    inst = np.arange(-5.0, duration_s, 0.1)
    sig = Signals(
        samp_ts_us=(samp_mono_ns - offset_ns) // 1000, samp_mw=samp_mw,
        ctr_t_ns=((t0_s + steps + 0.1) * 1e9).astype(np.int64), ctr_mj=e_mj,
        inst_t_ns=((t0_s + inst) * 1e9).astype(np.int64), inst_mw=(power(inst) * 1000).astype(np.int64),
    )
    return sig, Clock(int(t0_s * 1e9), offset_ns)


def window(sensor, clock, a_s: float, b_s: float, t0_s: float = 1000.0, *others):
    """One window ``[a_s, b_s]`` (seconds after t0) on ``sensor`` (and ``others``, opened and closed
    at the same instants): the pending result, or a list of them with ``others``."""
    drive(sensor, clock, int((t0_s + a_s) * 1e9), *others)
    tokens = [s.begin() for s in (sensor, *others)]
    drive(sensor, clock, int((t0_s + b_s) * 1e9), *others)
    pend = [s.end(t) for s, t in zip((sensor, *others), tokens)]
    return pend if others else pend[0]


def finish(sensor, clock, pend: PendingWindow, *others):
    drive(sensor, clock, int((pend.end_s + 1.2) * 1e9), *others)
    assert pend.ready()
    return pend.result()
