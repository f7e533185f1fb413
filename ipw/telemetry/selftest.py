"""The GPU self-test of ``ipw doctor --self-test``: NVML's call costs, its signals' update periods, an idle/load
step through the real sensor checked against the energy counter, and the sampler's own overhead.

:func:`gpu_self_test` (about ``seconds`` long, on GPU 0):

1. the cost of each NVML call (wall and CPU time per call);
2. how often each signal updates: the energy counter's step, the driver sample period, the
   instant-power field's period;
3. an idle / load step through the real sensor (:class:`ipw.telemetry.nvml.NvmlSensor`): idle, then
   5 s of matrix products (torch, if importable with CUDA; otherwise skipped with a note).  Over the
   steady middle of each phase, the calibrated samples must agree with the counter within 2%: PASS
   or FAIL.  The counter is read back to back around the edges of each compared span (a separate
   thread of the self-test), since the sampler reads it only every ~0.5 s on an H200 in a VM.  The
   delay between the host starting/stopping the load and the samples crossing half way is reported
   too (what ``sample_shift_s`` compensates);
4. the sampler thread's own CPU time (budget: 2% of one core).

It returns numbers (a dict); ``ipw.commands.doctor`` prints them.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Callable

#: Counter and calibrated samples must agree within this over each steady phase of the step.
STEP_TOLERANCE = 0.02
#: The sampler's budget, as a fraction of one core.
OVERHEAD_BUDGET = 0.02


def _cost(fn: Callable[[], Any], n: int) -> dict[str, float]:
    """Median wall and mean CPU seconds per call of ``fn`` over ``n`` calls."""
    walls = []
    cpu0 = time.thread_time()
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    cpu = (time.thread_time() - cpu0) / n
    return {"n": n, "wall_median_s": statistics.median(walls), "cpu_mean_s": cpu}


def _change_period(fn: Callable[[], float], duration_s: float, pause_s: float = 0.0) -> dict[str, Any]:
    """Poll ``fn`` for ``duration_s``; the median time between changes of its value."""
    times, last, n = [], None, 0
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        t0 = time.monotonic()
        v = fn()
        t1 = time.monotonic()
        n += 1
        if last is not None and v != last:
            times.append((t0 + t1) / 2)
        last = v
        if pause_s:
            time.sleep(pause_s)
    diffs = [b - a for a, b in zip(times, times[1:])]
    return {"polls": n, "changes": len(times), "median_period_s": statistics.median(diffs) if diffs else None}


class _DenseCounter(threading.Thread):
    """The self-test's reference: reads the energy counter back to back during given intervals
    (around the edges of each compared phase), so the counter is known there to a few ms rather
    than to the sampler's ~0.5 s read spacing.  A test harness, like bench/telemetry/attribution.py's."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        super().__init__(name="ipw-doctor-reference", daemon=True)
        self.nvml, self.h = nvml, handle
        self.intervals: list[tuple[float, float]] = []
        self.stop_ev = threading.Event()
        self.t: list[float] = []
        self.j: list[float] = []

    def add(self, lo_s: float, hi_s: float) -> None:
        self.intervals.append((lo_s, hi_s))

    def run(self) -> None:
        while not self.stop_ev.is_set():
            now = time.monotonic()
            if any(lo <= now <= hi for lo, hi in list(self.intervals)):
                t0 = time.monotonic()
                try:
                    e = self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.h)
                except Exception:
                    self.stop_ev.wait(0.01)
                    continue
                self.t.append((t0 + time.monotonic()) / 2)
                self.j.append(e / 1000.0)
                time.sleep(0.0005)
            else:
                upcoming = [lo - now for lo, _ in list(self.intervals) if lo > now]
                self.stop_ev.wait(min([0.05, *upcoming]))


def torch_load() -> tuple[Callable[[float], tuple[float, float]] | None, str]:
    """A function running matrix products for ``seconds`` -> (host start, host end), or None + why."""
    try:
        import torch
    except Exception as exc:
        return None, f"torch is not importable ({type(exc).__name__}); load step skipped"
    if not torch.cuda.is_available():
        return None, "torch has no CUDA device; load step skipped"
    dev = torch.device("cuda:0")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()

    def run(seconds: float) -> tuple[float, float]:
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            for _ in range(8):
                a @ b
            torch.cuda.synchronize()
        return start, time.monotonic()

    return run, "torch bf16 8192x8192 matrix products on cuda:0"


def _crossing(t: Any, p: Any, t_from: float, t_to: float, level: float, rising: bool) -> float | None:
    """First time in [t_from, t_to] where the linearly interpolated power crosses ``level``."""
    import numpy as np

    sel = np.flatnonzero((t >= t_from) & (t <= t_to))
    for i in sel[1:]:
        a, b = p[i - 1], p[i]
        if (rising and a < level <= b) or (not rising and a > level >= b):
            return float(t[i - 1] + (level - a) / (b - a) * (t[i] - t[i - 1]))
    return None


def step_lag_s(samples_t_s: Any, samples_w: Any, host_on_s: float, host_off_s: float) -> dict[str, float | None]:
    """Delay from the host starting (stopping) a load to the driver samples crossing half way between
    the levels before and during it (during and after it)."""
    import numpy as np

    t, p = np.asarray(samples_t_s), np.asarray(samples_w)
    before = p[(t > host_on_s - 1.0) & (t < host_on_s - 0.1)]
    during = p[(t > host_on_s + 0.5) & (t < host_off_s - 0.2)]
    after = p[(t > host_off_s + 0.5) & (t < host_off_s + 1.5)]
    out: dict[str, float | None] = {"rise_s": None, "fall_s": None}
    if before.size and during.size:
        lvl = (np.median(before) + np.median(during)) / 2
        c = _crossing(t, p, host_on_s - 0.1, host_on_s + 0.3, lvl, rising=True)
        out["rise_s"] = None if c is None else c - host_on_s
    if during.size and after.size:
        lvl = (np.median(during) + np.median(after)) / 2
        c = _crossing(t, p, host_off_s - 0.1, host_off_s + 0.3, lvl, rising=False)
        out["fall_s"] = None if c is None else c - host_off_s
    return out


def gpu_self_test(
    seconds: float = 60.0, log: Callable[[str], None] = print, *, probe_s: float = 1.5, phase_s: float = 5.0
) -> dict[str, Any]:
    """The self-test on GPU 0 (CUDA ordinal); returns every number it measured and ``passed``.

    ``probe_s`` is how long each update period is watched; ``phase_s`` the length of the load phase
    and of the compared part of the idle phase (tests shorten both)."""
    import numpy as np

    from ipw.telemetry.estimator import counter_energy_between
    from ipw.telemetry.nvml import NvmlSensor, import_pynvml, select_gpus

    nvml = import_pynvml()
    result: dict[str, Any] = {"seconds": seconds}

    # 1-2: call costs and update periods, before the sampler thread owns the handles
    nvml.nvmlInit()
    try:
        gpu = select_gpus(nvml, [0])[0]
        h = gpu.handle
        result["gpu"] = {"name": gpu.name, "uuid": gpu.uuid, "nvml_index": gpu.nvml_index,
                         "mig_enabled": gpu.mig_enabled}
        try:
            result["driver"] = nvml.nvmlSystemGetDriverVersion()
            if isinstance(result["driver"], bytes):
                result["driver"] = result["driver"].decode()
        except Exception:
            result["driver"] = None
        fid = nvml.NVML_FI_DEV_POWER_INSTANT
        last = [0]

        def samples() -> Any:
            try:
                _, s = nvml.nvmlDeviceGetSamples(h, nvml.NVML_TOTAL_POWER_SAMPLES, last[0])
            except nvml.NVMLError:
                return []
            if s:
                last[0] = max(int(x.timeStamp) for x in s)
            return s

        log("self-test: NVML call costs")
        costs = {
            "counter (nvmlDeviceGetTotalEnergyConsumption)": _cost(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h), 20),
            "samples (nvmlDeviceGetSamples)": _cost(samples, 10),
            "instant (field NVML_FI_DEV_POWER_INSTANT)": _cost(lambda: nvml.nvmlDeviceGetFieldValues(h, [fid]), 50),
        }
        try:  # cost only: ipw never integrates the 1 s average
            costs["average (nvmlDeviceGetPowerUsage), never used"] = _cost(lambda: nvml.nvmlDeviceGetPowerUsage(h), 50)
        except nvml.NVMLError:
            pass
        result["call_costs"] = costs

        log("self-test: update periods")
        periods = {"counter_step": _change_period(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h), probe_s)}
        _, buf = nvml.nvmlDeviceGetSamples(h, nvml.NVML_TOTAL_POWER_SAMPLES, 0)
        ts = sorted(int(x.timeStamp) for x in buf)
        diffs = [(b - a) / 1e6 for a, b in zip(ts, ts[1:])]
        periods["sample"] = {"samples_in_buffer": len(ts), "buffer_span_s": (ts[-1] - ts[0]) / 1e6 if ts else None,
                             "median_period_s": statistics.median(diffs) if diffs else None}

        def inst() -> float:
            return float(nvml.nvmlDeviceGetFieldValues(h, [fid])[0].value.uiVal)

        periods["instant"] = _change_period(inst, probe_s, pause_s=0.001)
        result["update_periods"] = periods
    except BaseException:
        nvml.nvmlShutdown()
        raise

    # 3-4: the idle/load step through the real sensor; the reference is the counter read densely at
    # the edges of each compared phase (its own thread, this module's NVML handle)
    load, load_note = torch_load()
    result["load"] = load_note
    idle_s = max(phase_s + 1.0, seconds - 20.0)
    log(f"self-test: sampler running; idle {idle_s:.0f} s" + (f", then {phase_s:g} s of load" if load else ""))
    dense = _DenseCounter(nvml, h)
    sensor = None
    try:
        sensor = NvmlSensor([0])
        t_start = time.monotonic()
        idle_end = t_start + idle_s
        phases = {"idle": (idle_end - phase_s, idle_end - 0.5)}
        for edge in phases["idle"]:
            dense.add(edge - 0.3, edge + 0.3)
        dense.start()
        time.sleep(max(0.0, idle_end - time.monotonic()))
        on = off = None
        if load is not None:
            on = time.monotonic()
            phases["load"] = (on + 0.5, on + phase_s - 0.5)
            for edge in phases["load"]:
                dense.add(edge - 0.3, edge + 0.3)
            on, off = load(phase_s)
            time.sleep(2.0)
        t_end = time.monotonic()
        time.sleep(0.2)
        sensor.sampler.mark(t_end)
        deadline = time.monotonic() + 3.0
        while sensor.sampler.settled_until() < t_end and time.monotonic() < deadline:
            time.sleep(0.02)
        dense.stop_ev.set()
        dense.join(2.0)
        overhead = sensor.overhead()
        a = sensor.sampler.arrays("gpu0")
        ests = sensor.energy_windows(list(phases.values()))["gpu0"]  # calibrated over all it recorded
        ref_t, ref_j = np.asarray(dense.t), np.asarray(dense.j)
        step: dict[str, Any] = {}
        passed = True
        for (name, (lo, hi)), est in zip(phases.items(), ests):
            ref = counter_energy_between(ref_t, ref_j, lo, hi)
            err = None if not est.energy_j or not ref.energy_j else est.energy_j / ref.energy_j - 1
            ok = err is not None and abs(err) <= STEP_TOLERANCE
            passed &= ok
            step[name] = {"start_s": lo - t_start, "end_s": hi - t_start, "mean_w": (ref.energy_j or 0) / (hi - lo),
                          "samples_calibrated_j": est.energy_j, "counter_j": ref.energy_j, "error": err,
                          "calibration_ratio": est.calibration_ratio, "source": est.source,
                          "reference_reads": int(np.sum((ref_t > lo - 0.5) & (ref_t < hi + 0.5))), "pass": ok}
        if on is not None and off is not None:  # set together
            step["lag"] = step_lag_s(a["samples_t_s"], a["samples_w"], on, off)
        result["step"] = step
        # the run-level audit of ipw run (issue 27), over these windows: counter vs windows + the idle between
        from ipw.telemetry.audit import audit_dicts

        records = [{"start_s": lo, "end_s": hi, "energy_parts": [{
            "component": "gpu0", "energy_j": e.energy_j, "source": e.source, "quality": e.quality,
            "uncertainty_j": e.uncertainty_j}]} for (lo, hi), e in zip(phases.values(), ests)]
        result["energy_audit"] = audit_dicts([sensor], records, since_s=t_start)
        result["sampler_overhead"] = overhead
        frac = overhead["cpu_fraction_of_one_core"]
        result["overhead_pass"] = frac <= OVERHEAD_BUDGET
        result["passed"] = bool(passed and result["overhead_pass"])
    finally:
        dense.stop_ev.set()
        if sensor is not None:
            sensor.close()
        nvml.nvmlShutdown()
    return result
