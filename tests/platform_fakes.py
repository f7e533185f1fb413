"""Fakes of each platform's library that replay a sensor trace (``ipw doctor --record-trace``,
``ipw/telemetry/recording.py``) at the time of a clock.

NVML: a trace's ``nvml`` entry becomes the ``Signals`` that tests/nvml_fakes.py's autospec'd pynvml
answers from, so a trace recorded on a real GPU replays through the same fake as the npz recordings.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import numpy as np
from nvml_fakes import Clock, Signals, real_pynvml as real


def nvml_signals(trace: dict[str, Any]) -> tuple[list[Signals], int]:
    """Per GPU of a trace's ``nvml`` entry, the ``Signals`` the NVML fake answers from, and the
    clock offset (monotonic ns - wall ns) from the trace's clock pairs."""
    entry = trace["platforms"]["nvml"]
    pairs = entry["clock_pairs"]
    mono = np.asarray(pairs["mono_ns"], dtype=np.int64)
    wall_ns = np.asarray(pairs["wall_us"], dtype=np.int64) * 1000
    offset = int(np.median(mono - wall_ns))
    out = []
    for dev in entry["devices"]:
        c, s, i = dev["counter_mj"], dev["samples_mw"], dev["instant_mw"]
        errors = {e[1] for e in dev["errors"]}
        out.append(Signals(
            samp_ts_us=np.asarray(s["ts_us"], dtype=np.int64), samp_mw=np.asarray(s["v"], dtype=np.int64),
            ctr_t_ns=np.asarray(c["t_ns"], dtype=np.int64), ctr_mj=np.asarray(c["v"], dtype=np.int64),
            inst_t_ns=np.asarray(i["t_ns"], dtype=np.int64), inst_mw=np.asarray(i["v"], dtype=np.int64),
            samples_ok=bool(s["v"]) or "samples" not in errors,
            counter_ok=bool(c["v"]), instant_ok=bool(i["v"]),
        ))
    return out, offset


def nvml_clock(trace: dict[str, Any], offset_ns: int) -> Clock:
    """A fake clock at the start of the recording."""
    return Clock(int(trace["start_ns"]), offset_ns)


def trace_events(trace: dict[str, Any]) -> dict[str, int]:
    """``{"load_start": t_ns, "load_end": t_ns}`` (those that happened)."""
    return {e["what"]: int(e["t_ns"]) for e in trace["events"]}


def scoped_fields(fake: Any, *, gpu_scope: bool = True, module_mw: Any = None) -> None:
    """Make the NVML fake's ``nvmlDeviceGetFieldValues`` answer scoped ids ``(field, scope)`` as the
    real binding does (pynvml.py sets ``scopeId`` from a tuple): GPU scope answers as before (or
    ``NVML_ERROR_NOT_SUPPORTED`` in the field when ``gpu_scope`` is false, as on a GH200 per
    ml-energy/zeus zeus/device/gpu/nvidia.py ``_resolve_power_field_scope``); module scope answers
    ``module_mw`` (mW, or a function giving it now), or ``NOT_SUPPORTED`` in the field when None (a
    discrete GPU)."""
    plain = fake.nvmlDeviceGetFieldValues.side_effect

    def fields(handle, ids):
        out = (real.c_nvmlFieldValue_t * len(ids))()
        for k, fid in enumerate(ids):
            field, scope = fid if isinstance(fid, tuple) else (fid, real.NVML_POWER_SCOPE_GPU)
            out[k].fieldId, out[k].scopeId = field, scope
            if scope == real.NVML_POWER_SCOPE_GPU and gpu_scope:
                out[k] = plain(handle, [field])[0]
                out[k].scopeId = scope
            elif scope == real.NVML_POWER_SCOPE_MODULE and module_mw is not None:
                out[k].valueType = real.NVML_VALUE_TYPE_UNSIGNED_INT
                out[k].value.uiVal = int(module_mw() if callable(module_mw) else module_mw)
                out[k].nvmlReturn = real.NVML_SUCCESS
            else:
                out[k].nvmlReturn = real.NVML_ERROR_NOT_SUPPORTED
        return out

    fake.nvmlDeviceGetFieldValues.side_effect = fields


# --------------------------------------------------------------------------------------------------
# replaying a series: the last answer at or before the clock


def answer_at(series: dict[str, list[Any]], t_ns: int) -> Any:
    """The answer a series recorded last at or before ``t_ns`` (the first one before it began)."""
    i = int(np.searchsorted(np.asarray(series["t_ns"], dtype=np.int64), t_ns, side="right")) - 1
    return series["v"][max(0, i)]


class PollClock:
    """A fake monotonic clock for the polled sensors (ns)."""

    def __init__(self, t_ns: int) -> None:
        self.t_ns = int(t_ns)

    def __call__(self) -> int:
        return self.t_ns


def drive_polled(sensor: Any, clock: PollClock, until_ns: int) -> None:
    """Poll an unthreaded PolledSensor every ``platform.period_s`` up to ``until_ns``."""
    step = int(sensor.platform.period_s * 1e9)
    while clock.t_ns + step <= until_ns:
        clock.t_ns += step
        sensor.poll()
    clock.t_ns = max(clock.t_ns, int(until_ns))


def polled_window(sensor: Any, clock: PollClock, a_ns: int, b_ns: int) -> list[Any]:
    """The readings of one window [a, b] (clock ns; a window asked for in the past starts now), polled
    through its end and until it is final."""
    drive_polled(sensor, clock, a_ns)
    token = sensor.begin()
    drive_polled(sensor, clock, b_ns)
    pending = sensor.end(token)
    assert not pending.ready()
    drive_polled(sensor, clock, clock.t_ns + int((sensor.settle_s + sensor.platform.period_s) * 1e9))
    assert pending.ready()
    return pending.result()


# --------------------------------------------------------------------------------------------------
# amdsmi: a module with amdsmi's surface (the amdsmi 7.0.2 wheel's amdsmi/__init__.py exports and
# amdsmi_interface.py signatures; ROCm/amdsmi py-interface/README.md for fields and units): its
# processor handles answer from a trace's ``amdsmi`` entry (ipw doctor --record-trace).


class AmdSmiException(Exception):
    """amdsmi.AmdSmiException (amdsmi/amdsmi_exception.py)."""


class AmdSmiLibraryException(AmdSmiException):
    """amdsmi.AmdSmiLibraryException: carries the status code, ``get_error_code()``."""

    def __init__(self, err_code: int) -> None:
        super().__init__(err_code)
        self.err_code = abs(err_code)

    def get_error_code(self) -> int:
        return self.err_code


AMDSMI_STATUS_NOT_SUPPORTED = 2  # amdsmi/amdsmi_wrapper.py
AMDSMI_STATUS_NO_PERM = 10


class AmdSmiInitFlags:
    INIT_AMD_GPUS = 2  # amdsmi_wrapper.AMDSMI_INIT_AMD_GPUS


class _AmdHandle:
    def __init__(self, device: dict[str, Any]) -> None:
        self.device = device


def fake_amdsmi(entry: dict[str, Any], clock: PollClock, *, init_status: int | None = None) -> types.ModuleType:
    """A module named ``amdsmi`` answering from a trace's ``amdsmi`` entry at ``clock``.  A recorded
    answer ``{"status": code}`` raises AmdSmiLibraryException(code), as the library does."""
    m = types.ModuleType("amdsmi")
    m.AmdSmiException = AmdSmiException
    m.AmdSmiLibraryException = AmdSmiLibraryException
    m.AmdSmiInitFlags = AmdSmiInitFlags
    handles = [_AmdHandle(d) for d in entry["devices"]]
    state = {"init": False}

    def amdsmi_init(flag=AmdSmiInitFlags.INIT_AMD_GPUS):
        if init_status is not None:
            raise AmdSmiLibraryException(init_status)
        state["init"] = True

    def amdsmi_shut_down():
        state["init"] = False

    def amdsmi_get_processor_handles():
        assert state["init"], "amdsmi_init() must come first (ROCm/amdsmi py-interface/README.md)"
        return list(handles)

    def _answer(h, key):
        assert isinstance(h, _AmdHandle), "amdsmi raises AmdSmiParameterException for a non-handle"
        v = answer_at(h.device[key], clock())
        if isinstance(v, dict) and "status" in v:
            raise AmdSmiLibraryException(v["status"])
        return dict(v)

    def amdsmi_get_gpu_asic_info(processor_handle):
        return {"market_name": processor_handle.device["market_name"]}

    def amdsmi_get_energy_count(processor_handle):
        return _answer(processor_handle, "energy_count")

    def amdsmi_get_power_info(processor_handle):
        return _answer(processor_handle, "power_info")

    for fn in (amdsmi_init, amdsmi_shut_down, amdsmi_get_processor_handles, amdsmi_get_gpu_asic_info,
               amdsmi_get_energy_count, amdsmi_get_power_info):
        setattr(m, fn.__name__, fn)
    m.state = state
    return m


# --------------------------------------------------------------------------------------------------
# zeus-apple-silicon: AppleEnergyMonitor / AppleEnergyMetrics as its README documents them
# (ml-energy/zeus-apple-silicon README.md: mJ fields, None where the chip lacks the channel;
# get_cumulative_energy(); RuntimeError on misuse, tests/tests_python/test_monitor.py)


class AppleEnergyMetrics:
    FIELDS = ("cpu_total_mj", "efficiency_cores_mj", "performance_cores_mj", "efficiency_cluster_mj",
              "performance_cluster_mj", "efficiency_core_manager_mj", "performance_core_manager_mj",
              "dram_mj", "gpu_mj", "gpu_sram_mj", "ane_mj")

    def __init__(self, values: dict[str, Any]) -> None:
        for f in self.FIELDS:
            setattr(self, f, values.get(f))


def fake_zeus_apple_silicon(entry: dict[str, Any], clock: PollClock, *, fail: str | None = None) -> types.ModuleType:
    m = types.ModuleType("zeus_apple_silicon")

    class AppleEnergyMonitor:
        def __init__(self) -> None:
            if fail:
                raise RuntimeError(fail)
            self._windows: dict[str, Any] = {}

        def get_cumulative_energy(self) -> AppleEnergyMetrics:
            return AppleEnergyMetrics(answer_at(entry["cumulative"], clock()))

        def begin_window(self, label: str, restart: bool = False) -> None:
            if label in self._windows and not restart:
                raise RuntimeError(f"window {label} already active")
            self._windows[label] = self.get_cumulative_energy()

        def end_window(self, label: str) -> AppleEnergyMetrics:
            if label not in self._windows:
                raise RuntimeError(f"no window {label}")
            a, b = self._windows.pop(label), self.get_cumulative_energy()
            return AppleEnergyMetrics({f: (None if getattr(a, f) is None else getattr(b, f) - getattr(a, f))
                                       for f in ("cpu_total_mj", "dram_mj", "gpu_mj", "gpu_sram_mj", "ane_mj")})

    m.AppleEnergyMonitor = AppleEnergyMonitor
    m.AppleEnergyMetrics = AppleEnergyMetrics
    return m


# --------------------------------------------------------------------------------------------------
# Jetson: a sysfs hwmon tree under tmp_path whose value files follow a trace's ``jetson`` entry


class FakeHwmon:
    """Writes a trace's ``jetson`` entry under ``root``: its static files once, and each series'
    value at the clock's time before every poll (``sync``)."""

    def __init__(self, entry: dict[str, Any], root: Path, clock: PollClock) -> None:
        self.entry, self.root, self.clock = entry, Path(root), clock
        for rel, text in entry["files"].items():
            p = self.root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(f"{text}\n")
        self.sync()

    def sync(self) -> None:
        for rel, s in self.entry["series"].items():
            (self.root / rel).write_text(f"{answer_at(s, self.clock())}\n")


def drive_hwmon(sensor: Any, hwmon: FakeHwmon, until_ns: int) -> None:
    clock = hwmon.clock
    step = int(sensor.platform.period_s * 1e9)
    while clock.t_ns + step <= until_ns:
        clock.t_ns += step
        hwmon.sync()
        sensor.poll()
    clock.t_ns = max(clock.t_ns, int(until_ns))
