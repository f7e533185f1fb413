"""``ipw doctor``: what this machine can measure, at what resolution, and (on a GPU) a self-test.

``doctor(self_test, seconds)`` prints one table of sensors (available, source, quality, update
period) and returns an exit code.  With ``self_test`` on a machine with an NVIDIA GPU it runs
:func:`gpu_self_test` (about ``seconds`` long):

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

Runs without typer: ``python -m ipw.commands.doctor [--self-test] [--seconds 60] [--json out.json]``.  Rich is
used for tables when importable, plain text otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any, Callable

#: Counter and calibrated samples must agree within this over each steady phase of the step.
STEP_TOLERANCE = 0.02
#: The sampler's budget, as a fraction of one core.
OVERHEAD_BUDGET = 0.02


class _Out:
    """Tables and lines through rich when importable, else plain text."""

    def __init__(self, file: Any = None) -> None:
        self.file = file or sys.stdout
        try:
            from rich.console import Console

            tty = hasattr(self.file, "isatty") and self.file.isatty()
            self._console: Console | None = Console(file=self.file, highlight=False, width=None if tty else 240)
        except ImportError:
            self._console = None

    def line(self, text: str = "") -> None:
        if self._console is not None:
            self._console.print(text, markup=False)
        else:
            print(text, file=self.file, flush=True)

    def table(self, title: str, columns: list[str], rows: list[list[str]]) -> None:
        if self._console is not None:
            from rich.table import Table
            from rich.text import Text

            t = Table(title=title, title_justify="left")
            for c in columns:
                t.add_column(c, overflow="fold")
            for r in rows:
                t.add_row(*[Text(str(x)) for x in r])  # plain text: "ipw[amd]" is not markup
            self._console.print(t)
            return
        widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
        print(title, file=self.file)
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths)), file=self.file)
        for r in rows:
            print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)), file=self.file)
        print(file=self.file, flush=True)


# --------------------------------------------------------------------------------------------------
# what this machine can measure


def engine_rows() -> list[list[str]]:
    """llama.cpp as a run would load it: imported in a worker, its CPU variant (the instruction sets the
    build was compiled for) checked against this CPU's flags."""
    import importlib.util

    from ipw.errors import IpwError
    from ipw.llama_build import cpu_flags, variant

    this_cpu = f"this CPU: {variant(cpu_flags())}"
    if importlib.util.find_spec("llama_cpp") is None:
        return [["llama.cpp", "not installed", f"pip install 'ipw[llama]' or bash .ci/setup; {this_cpu}"]]
    from ipw.backends.llama_cpp import probe_engine

    try:
        info = probe_engine()
    except IpwError as exc:
        return [["llama.cpp", "cannot run here", f"{exc.message}; {this_cpu}"]]
    gpu = "GPU offload" if info["gpu_offload_supported"] else "CPU only"
    return [["llama.cpp", "ok", f"llama-cpp-python {info['engine_version']}, CPU variant {info['cpu_variant']}, "
             f"{gpu}; {this_cpu}"]]


def _resolution(name: str, params: dict[str, Any]) -> str:
    if name == "nvml":
        return (f"driver samples ~20 ms (buffer polled every {params.get('samples_period_s', 1.0):g} s); "
                f"counter ~100 ms steps (read every {params.get('counter_period_s', 0.25):.2g} s"
                f"{', adapted to its cost' if params.get('counter_period_adaptive') else ''}); "
                f"instant ~100 ms; windows < 0.15 s flagged")
    if name == "rapl":
        return "energy counter ~1 ms updates, read at window edges"
    if name == "cpu_model":
        return "process CPU time (~10 ms ticks) x per-core power model, at window edges"
    if "period_s" in params:  # a polled platform sensor (ipw.telemetry.polled)
        return (f"polled every {params['period_s']:g} s; counter/monitor updates every "
                f"{params['counter_step_s']:g} s; shorter windows flagged")
    return "-"


def sensor_rows() -> list[list[str]]:
    """One row per sensor: name, available, source, quality, scope, resolution, detail (never raises)."""
    from ipw.errors import IpwError

    rows = []
    try:
        from ipw.telemetry.nvml import NvmlSensor

        sensor = NvmlSensor.probe()
    except IpwError as exc:
        rows.append(["nvml", "no", "nvml.samples", "unavailable", "gpu", "-", exc.message])
    except Exception as exc:  # doctor reports, never crashes
        rows.append(["nvml", "no", "nvml.samples", "unavailable", "gpu", "-", f"{type(exc).__name__}: {exc}"])
    else:
        if sensor is None:
            rows.append(["nvml", "no", "nvml.samples", "unavailable", "gpu", "-",
                         "no NVIDIA library, driver or visible GPU"])
        else:
            try:
                info = sensor.info()
                rows.append(["nvml", "yes", info.source, info.quality, info.scope,
                             _resolution("nvml", info.params), info.detail])
            finally:
                sensor.close()
    try:
        from ipw.telemetry.probe import describe_sensors

        others = [i for i in describe_sensors() if i.name != "nvml"]
    except Exception as exc:
        rows.append(["cpu", "?", "-", "-", "-", "-", f"could not probe: {type(exc).__name__}: {exc}"])
        others = []
    for info in others:
        rows.append([info.name, "yes" if info.available else "no", info.source, info.quality, info.scope,
                     _resolution(info.name, info.params) if info.available else "-", info.detail])
    return rows


def counter_check_rows(seconds: float = 3.0) -> list[list[str]]:
    """Each energy counter read beside power readings for ``seconds``, checked
    (:func:`ipw.telemetry.estimator.counter_checks`; NVML's through :func:`ipw.telemetry.sampler.counter_check`,
    as a run checks it): one row per component: sensor, component, verdict,
    counter / (power x time), problems (a counter without power readings: backwards only).  A counter
    that fails is what a run labels "counter distrusted, not used".  Empty, without waiting, where no
    sensor here reads a counter."""
    from ipw.errors import IpwError
    from ipw.telemetry.probe import platform_sensors
    from ipw.telemetry.sampler import counter_check

    sensors: list[Any] = []
    try:
        from ipw.telemetry.nvml import NvmlSensor

        nvml = NvmlSensor.probe()
        if nvml is not None:
            sensors.append(nvml)
    except IpwError:
        pass
    sensors += [s for _, s in platform_sensors(quiet=True)[0]]
    rows: list[list[str]] = []
    try:
        if sensors:
            time.sleep(seconds)
        for sensor in sensors:
            if sensor.name == "nvml":
                for comp in sensor.sampler.components():
                    c = counter_check(sensor.sampler.arrays(comp))
                    if c is not None:
                        rows.append(_check_row("nvml", comp, c))
            else:
                for comp, c in sensor.check().items():
                    rows.append(_check_row(sensor.name, comp, c))
    finally:
        for sensor in sensors:
            sensor.close()
    return rows


def _check_row(sensor: str, comp: str, c: Any) -> list[str]:
    return [sensor, comp, "ok" if c.ok else "DISTRUSTED", "-" if c.ratio is None else f"{c.ratio:.4f}",
            "; ".join(c.problems) or "-"]


# --------------------------------------------------------------------------------------------------
# the GPU self-test


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
    than to the sampler's ~0.5 s read spacing.  A test harness, like bench/attribution.py's."""

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


def _torch_load() -> tuple[Callable[[float], tuple[float, float]] | None, str]:
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


def _crossing(t, p, t_from: float, t_to: float, level: float, rising: bool) -> float | None:
    """First time in [t_from, t_to] where the linearly interpolated power crosses ``level``."""
    import numpy as np

    sel = np.flatnonzero((t >= t_from) & (t <= t_to))
    for i in sel[1:]:
        a, b = p[i - 1], p[i]
        if (rising and a < level <= b) or (not rising and a > level >= b):
            return float(t[i - 1] + (level - a) / (b - a) * (t[i] - t[i - 1]))
    return None


def step_lag_s(samples_t_s, samples_w, host_on_s: float, host_off_s: float) -> dict[str, float | None]:
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

        def samples():
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

        def inst():
            return nvml.nvmlDeviceGetFieldValues(h, [fid])[0].value.uiVal

        periods["instant"] = _change_period(inst, probe_s, pause_s=0.001)
        result["update_periods"] = periods
    except BaseException:
        nvml.nvmlShutdown()
        raise

    # 3-4: the idle/load step through the real sensor; the reference is the counter read densely at
    # the edges of each compared phase (its own thread, this module's NVML handle)
    load, load_note = _torch_load()
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


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.3g} ms"


def _print_self_test(out: _Out, r: dict[str, Any]) -> None:
    out.line(f"GPU: {r['gpu']['name']} ({r['gpu']['uuid']}), driver {r.get('driver')}")
    out.table("NVML call costs", ["call", "wall per call (median)", "CPU per call (mean)"],
              [[k, _ms(v["wall_median_s"]), _ms(v["cpu_mean_s"])] for k, v in r["call_costs"].items()])
    p = r["update_periods"]
    out.table("update periods", ["signal", "period", "detail"], [
        ["energy counter", _ms(p["counter_step"]["median_period_s"]), f"{p['counter_step']['changes']} steps seen"],
        ["driver samples", _ms(p["sample"]["median_period_s"]),
         f"{p['sample']['samples_in_buffer']} in the buffer, spanning {p['sample']['buffer_span_s'] or 0:.2f} s"],
        ["instant field", _ms(p["instant"]["median_period_s"]), f"{p['instant']['changes']} changes seen"],
    ])
    rows = []
    for name in ("idle", "load"):
        s = r["step"].get(name)
        if s:
            rows.append([name, f"{s['mean_w']:.1f} W", f"{s['samples_calibrated_j']:.1f} J", f"{s['counter_j']:.1f} J",
                         "-" if s["error"] is None else f"{s['error']:+.2%}", "PASS" if s["pass"] else "FAIL"])
    out.table(f"idle/load step: calibrated samples vs counter (within {STEP_TOLERANCE:.0%})",
              ["phase", "power", "samples", "counter", "error", "result"], rows)
    if "load" not in r["step"]:
        out.line(f"load step: {r['load']}")
    if "lag" in r["step"]:
        lag = r["step"]["lag"]
        out.line(f"driver samples trail the host: rise {_ms(lag['rise_s'])}, fall {_ms(lag['fall_s'])} "
                 "(half-way crossing)")
    for a in r.get("energy_audit") or []:
        out.line(a.get("line") or f"energy audit: could not run ({a.get('error')})")
    o = r["sampler_overhead"]
    out.line(f"sampler overhead: {o['cpu_s']:.3f} CPU s over {o['wall_s']:.1f} s = "
             f"{o['cpu_fraction_of_one_core']:.2%} of one core (budget {OVERHEAD_BUDGET:.0%}): "
             f"{'PASS' if r['overhead_pass'] else 'FAIL'}; calls {o['calls']}")
    out.line(f"self-test: {'PASS' if r['passed'] else 'FAIL'}")


def record_trace_file(path: str, seconds: float, out: _Out, *, load: bool = True) -> dict[str, Any]:
    """``--record-trace``: record every platform's raw library answers for ``seconds`` into ``path``
    (:mod:`ipw.telemetry.recording`; the format the tests' fakes replay).  With ``load`` and torch on a
    CUDA GPU, the middle third is matrix products, so the trace holds an idle/load step."""
    from ipw.telemetry.recording import record, write_trace

    run, note = _torch_load() if load else (None, "load off")
    third = seconds / 3.0
    out.line(f"record-trace: recording {seconds:g} s into {path}"
             + (f"; load ({note}) from {third:.1f} s for {third:.1f} s" if run else f"; idle only ({note})"))
    def load_step() -> None:  # record calls it for its effect: the step's host times are not needed here
        if run is not None:
            run(third)

    trace = record(seconds, load=load_step if run else None, load_at_s=third, log=out.line)
    trace["load"] = note if run else f"none: {note}"
    write_trace(trace, path)
    rows = []
    for name, entry in trace["platforms"].items():
        rows.append([name, "yes" if entry["available"] else "no",
                     _trace_summary(entry) if entry["available"] else entry["why"]])
    out.table(f"record-trace: {path}", ["platform", "recorded", "what"], rows)
    return trace


def _trace_summary(entry: dict[str, Any]) -> str:
    """How many points of each series one platform's trace entry holds, and how many errors."""
    parts = []
    for group in ("devices", "zones", "rails"):
        for item in entry.get(group, []):
            label = item.get("component") or item.get("name") or str(item.get("index", ""))
            counts = [f"{k} {len(v.get('v', []))}" for k, v in item.items() if isinstance(v, dict) and "v" in v]
            errors = len(item.get("errors", []))
            parts.append(f"{label}: {', '.join(counts)}" + (f", {errors} errors" if errors else ""))
    parts += [f"{k} {len(v['v'])}" for k, v in entry.items() if isinstance(v, dict) and "v" in v]
    if entry.get("series"):
        parts.append(f"{len(entry['series'])} value files, {max(len(v['v']) for v in entry['series'].values())} reads each")
    return "; ".join(parts) or "-"


def doctor(self_test: bool = False, seconds: float = 60.0, *, json_path: str | None = None, file: Any = None,
           record_trace: str | None = None) -> int:
    """Print what this machine can measure; with ``self_test`` on a GPU machine, run the self-test;
    with ``record_trace``, record every platform's raw readings for ``seconds`` into that file.
    Returns the exit code: 1 when a self-test check fails, else 0."""
    import math

    from ipw.errors import IpwError

    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and 0 < seconds <= 3600):
        raise IpwError(f"--seconds {seconds}: must be a number of seconds > 0 and <= 3600")
    if json_path is not None:
        if not self_test:
            raise IpwError("--json: the self-test's numbers; only with --self-test")
        existed = os.path.exists(json_path)
        try:  # the self-test takes a minute: find out now that its numbers could not be written
            os.close(os.open(json_path, os.O_WRONLY | os.O_CREAT, 0o644))
        except OSError as exc:
            raise IpwError(f"--json {json_path}: cannot write there ({exc.strerror})") from None
        if not existed:
            os.unlink(json_path)
    if record_trace is not None:
        existed = os.path.exists(record_trace)
        try:  # find out now, not after the recording, that the trace could not be written
            with open(record_trace, "ab"):
                pass
        except OSError as exc:
            raise IpwError(f"--record-trace {record_trace}: cannot write there ({exc.strerror})") from None
        if not existed:
            os.unlink(record_trace)
    out = _Out(file)
    rows = sensor_rows()
    out.table("sensors on this machine (probed in this order)",
              ["sensor", "available", "source", "quality", "scope", "resolution", "detail"], rows)
    checks = counter_check_rows()
    if checks:
        out.table("energy counters checked against power x time (a DISTRUSTED counter is not used in a run)",
                  ["sensor", "component", "counter", "counter / power x time", "problems"], checks)
    else:
        out.line("counter cross-checks: no sensor here reads an energy counter beside power readings")
    from ipw.telemetry.node_power import doctor_rows

    out.table("node power from the BMC (IPW_NODE_POWER; scope node, never added to the chip total)",
              ["item", "found"], doctor_rows())
    out.table("engines (checked in a worker process)", ["engine", "status", "detail"], engine_rows())
    if record_trace is not None:
        record_trace_file(record_trace, seconds, out)
    if not self_test:
        return 0
    if not any(r[0] == "nvml" and r[1] == "yes" for r in rows):
        out.line("self-test: skipped (it needs an NVIDIA GPU that NVML can read; see the nvml row above)")
        return 0
    result = gpu_self_test(seconds, log=out.line)
    _print_self_test(out, result)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0 if result["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ipw.commands.doctor", description=__doc__.splitlines()[0])
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--json", dest="json_path", default=None, help="write the self-test's numbers here")
    ap.add_argument("--record-trace", default=None, help="record every platform's raw readings into this file")
    args = ap.parse_args(argv)
    return doctor(args.self_test, args.seconds, json_path=args.json_path, record_trace=args.record_trace)


if __name__ == "__main__":
    sys.exit(main())
