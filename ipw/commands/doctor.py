"""``ipw doctor``: what this machine can measure, at what resolution, and (on a GPU) a self-test.

``doctor_command(options)`` prints one table of sensors (available, source, quality, update period), the
energy counters' cross-checks, node power and the engines, and returns an exit code.  With ``--self-test``
on a machine with an NVIDIA GPU it runs the self-test of :mod:`ipw.telemetry.selftest` (about ``--seconds``
long) and prints its numbers; with ``--record-trace``, records every platform's raw readings.

Runs without typer too: ``python -m ipw.commands.doctor [--self-test] [--seconds 60] [--json out.json]`` (the
options of ``ipw.options.DoctorOptions``).  Rich is used for tables when importable, plain text otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ipw.errors import IpwError
from ipw.options import DoctorOptions, check_options, options_of
from ipw.telemetry.selftest import OVERHEAD_BUDGET, STEP_TOLERANCE, gpu_self_test, torch_load
from ipw.telemetry.selftest import step_lag_s  # noqa: F401 - where bench/telemetry/attribution.py finds it


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
    from ipw.telemetry.cpu_isa import cpu_flags, isa_name

    this_cpu = f"this CPU: {isa_name(cpu_flags())}"
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
    (:func:`ipw.telemetry.energy_counter.counter_checks`; NVML's through :func:`ipw.telemetry.nvml_estimate.counter_check`,
    as a run checks it): one row per component: sensor, component, verdict,
    counter / (power x time), problems (a counter without power readings: backwards only).  A counter
    that fails is what a run labels "counter distrusted, not used".  Empty, without waiting, where no
    sensor here reads a counter."""
    from ipw.errors import IpwError
    from ipw.telemetry.probe import platform_sensors
    from ipw.telemetry.nvml_estimate import counter_check

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

    run, note = torch_load() if load else (None, "load off")
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
    """``ipw doctor`` from Python (the tests): its options checked as the command line's are, then run."""
    options = DoctorOptions(self_test=self_test, seconds=seconds, json=Path(json_path) if json_path else None,
                            record_trace=Path(record_trace) if record_trace else None)
    check_options(options)
    return doctor_command(options, file=file)


def doctor_command(options: DoctorOptions, *, file: Any = None) -> int:
    """Print what this machine can measure; with ``--self-test`` on a GPU machine, run the self-test; with
    ``--record-trace``, record every platform's raw readings for ``--seconds`` into that file.
    Returns the exit code: 1 when a self-test check fails, else 0."""
    json_path = str(options.json) if options.json is not None else None
    record_trace = str(options.record_trace) if options.record_trace is not None else None
    if json_path is not None:
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
        record_trace_file(record_trace, options.seconds, out)
    if not options.self_test:
        return 0
    if not any(r[0] == "nvml" and r[1] == "yes" for r in rows):
        out.line("self-test: skipped (it needs an NVIDIA GPU that NVML can read; see the nvml row above)")
        return 0
    result = gpu_self_test(options.seconds, log=out.line)
    _print_self_test(out, result)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0 if result["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m ipw.commands.doctor`` (docs/ENERGY.md): ``ipw doctor`` where typer is not installed, its
    options those of ``ipw.options.DoctorOptions``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ipw.commands.doctor", description=(__doc__ or "").splitlines()[0])
    for o in options_of(DoctorOptions):
        parser.add_argument(*o.flags, dest=o.name, default=o.default, help=o.help,
                            **({"action": "store_true"} if o.value_type is bool else {"type": o.value_type}))
    options = DoctorOptions(**vars(parser.parse_args(argv)))
    try:
        check_options(options)
        return doctor_command(options)
    except IpwError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
