"""Sensor traces: what each platform's library answered, recorded on a real machine and replayed by
the tests' fakes (``ipw doctor --record-trace FILE``; docs/PLATFORMS.md).

A trace is one JSON object (gzip-compressed when the file name ends in ``.gz``)::

    {"format": "ipw-sensor-trace", "version": 1, "recorded_utc": ..., "host": ..., "duration_s": ...,
     "events": [{"t_ns": ..., "what": "load_start"}, ...],
     "platforms": {"nvml": {...}, "rapl": {...}, "amdsmi": {...}, "apple": {...}, "jetson": {...}}}

Every platform entry has ``available`` and, when false, ``why`` (one line).  A recorded one holds the
library's raw answers in the library's own units, each series ``{"t_ns": [...], "v": [...]}`` on the
monotonic clock (``time.monotonic_ns``; the time the answer was seen), its unit in the series' name
(``counter_mj``, ``energy_uj``), and ``errors``: ``[t_ns, call, error]`` for each call that failed.
Nothing is converted, so a fake replaying the trace answers what the library answered.

Recorders are polled by one loop; each reads its library directly (not through a sensor), so the
trace is what a sensor would see, at a finer period than a sensor reads it.
"""

from __future__ import annotations

import gzip
import json
import os
import platform as _platform
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from ipw.errors import IpwError

FORMAT = "ipw-sensor-trace"
VERSION = 1


class Unavailable(Exception):
    """A platform that cannot be recorded here; the message is the one-line reason."""


def series() -> dict[str, list[int | float]]:
    return {"t_ns": [], "v": []}


def _push(s: dict[str, list[Any]], t_ns: int, v: Any) -> None:  # a number, or a dict of them
    s["t_ns"].append(int(t_ns))
    s["v"].append(v)


class Recorder:
    """One platform: ``open()`` (raises :class:`Unavailable`), then ``poll(now_ns)`` every
    ``period_s``, then ``dump()`` (the platform's trace entry)."""

    name = ""
    period_s = 0.05

    def open(self) -> None:
        raise NotImplementedError

    def poll(self, now_ns: int) -> None:
        raise NotImplementedError

    def dump(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the library."""


# --------------------------------------------------------------------------------------------------
# NVML


def _nvml_error_name(nvml: Any, exc: BaseException) -> str:
    if isinstance(exc, nvml.NVMLError):
        for name, value in vars(nvml).items():
            if name.startswith("NVML_ERROR_") and value == exc.value:
                return str(name)
    return f"{type(exc).__name__}: {exc}"


class NvmlRecorder(Recorder):
    """Per GPU: the energy counter (mJ) and the instant-power field (mW, GPU scope, and module scope
    where the driver offers it) every 50 ms; the driver's power-sample buffer (driver wall-clock µs,
    mW) every 0.5 s, each poll with a (monotonic ns, wall µs) clock pair."""

    name = "nvml"
    period_s = 0.05
    samples_period_s = 0.5

    def open(self) -> None:
        from ipw.telemetry.nvml import probe_power_scopes

        try:
            import pynvml
        except ImportError as exc:
            raise Unavailable("pynvml is not importable (pip install nvidia-ml-py)") from exc
        self.nvml = nvml = pynvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise Unavailable(f"nvmlInit: {_nvml_error_name(nvml, exc)}") from exc
        self.meta: dict[str, Any] = {"library": "nvidia-ml-py", "devices": []}
        try:
            driver = nvml.nvmlSystemGetDriverVersion()
            self.meta["driver"] = driver.decode() if isinstance(driver, bytes) else driver
        except Exception:  # metadata only
            self.meta["driver"] = None
        self.pairs: dict[str, list[int]] = {"mono_ns": [], "wall_us": []}
        self.devices = []
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            nvml.nvmlShutdown()
            raise Unavailable("NVML sees no GPU")
        for i in range(count):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            dev: dict[str, Any] = {"index": i, "handle": h, "last_ts_us": 0,
                                   "counter_mj": series(), "samples_mw": {"ts_us": [], "v": []},
                                   "instant_mw": series(), "module_instant_mw": series(), "errors": []}
            for key, call in (("name", nvml.nvmlDeviceGetName), ("uuid", nvml.nvmlDeviceGetUUID),
                              ("power_limit_mw", nvml.nvmlDeviceGetEnforcedPowerLimit)):
                try:
                    v = call(h)
                    dev[key] = v.decode() if isinstance(v, bytes) else v
                except Exception as exc:
                    dev[key] = None
                    dev["errors"].append([time.monotonic_ns(), key, _nvml_error_name(nvml, exc)])
            dev["power_scope_probe"] = probe_power_scopes(nvml, h)  # ipw.telemetry.nvml
            self.devices.append(dev)
        self._next_samples_ns = 0

    def _call(self, dev: dict[str, Any], what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except self.nvml.NVMLError as exc:
            name = _nvml_error_name(self.nvml, exc)
            if not (what == "samples" and name == "NVML_ERROR_NOT_FOUND"):  # no new samples: not an error
                dev["errors"].append([time.monotonic_ns(), what, name])
            return None

    def poll(self, now_ns: int) -> None:
        nvml = self.nvml
        fid = nvml.NVML_FI_DEV_POWER_INSTANT
        for dev in self.devices:
            h = dev["handle"]
            t0 = time.monotonic_ns()
            mj = self._call(dev, "counter", lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h))
            if mj is not None:
                _push(dev["counter_mj"], (t0 + time.monotonic_ns()) // 2, int(mj))
            for scope_key, scope in (("instant_mw", "gpu"), ("module_instant_mw", "module")):
                if dev["power_scope_probe"].get(scope) != "ok":
                    continue
                t0 = time.monotonic_ns()
                fv = self._call(dev, f"instant_{scope}", lambda: nvml.nvmlDeviceGetFieldValues(
                    h, [(fid, _scope_id(nvml, scope))]))
                if fv is None:
                    continue
                if fv[0].nvmlReturn != nvml.NVML_SUCCESS:
                    dev["errors"].append([t0, f"instant_{scope}", f"field return {fv[0].nvmlReturn}"])
                    continue
                _push(dev[scope_key], (t0 + time.monotonic_ns()) // 2, int(fv[0].value.uiVal))
        if now_ns >= self._next_samples_ns:
            self._next_samples_ns = now_ns + int(self.samples_period_s * 1e9)
            m1 = time.monotonic_ns()
            w = time.time_ns()
            m2 = time.monotonic_ns()
            self.pairs["mono_ns"].append((m1 + m2) // 2)
            self.pairs["wall_us"].append(w // 1000)
            for dev in self.devices:
                h = dev["handle"]
                out = self._call(dev, "samples", lambda: nvml.nvmlDeviceGetSamples(
                    h, nvml.NVML_TOTAL_POWER_SAMPLES, dev["last_ts_us"]))
                if not out:
                    continue
                value_type, samples = out
                value_of: Callable[[Any], Any] = {nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: lambda v: v.ulVal,
                            nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: lambda v: v.ullVal,
                            nvml.NVML_VALUE_TYPE_DOUBLE: lambda v: v.dVal}.get(value_type, lambda v: v.uiVal)
                for s in sorted(samples, key=lambda s: int(s.timeStamp)):
                    ts = int(s.timeStamp)
                    if ts > dev["last_ts_us"]:
                        dev["samples_mw"]["ts_us"].append(ts)
                        dev["samples_mw"]["v"].append(value_of(s.sampleValue))
                        dev["last_ts_us"] = ts

    def dump(self) -> dict[str, Any]:
        devices = [{k: v for k, v in d.items() if k not in ("handle", "last_ts_us")} for d in self.devices]
        return {"available": True, **self.meta, "devices": devices, "clock_pairs": self.pairs}

    def close(self) -> None:
        self.nvml.nvmlShutdown()


def _scope_id(nvml: Any, scope: str) -> int:
    return int({"gpu": nvml.NVML_POWER_SCOPE_GPU, "module": nvml.NVML_POWER_SCOPE_MODULE}[scope])


# --------------------------------------------------------------------------------------------------
# RAPL


class RaplRecorder(Recorder):
    """Every ``package-N`` zone and its ``dram`` subzone: ``energy_uj`` every 50 ms."""

    name = "rapl"
    period_s = 0.05

    def __init__(self, root: Path | None = None) -> None:
        from ipw.telemetry.rapl import DEFAULT_ROOT

        self.root = Path(root) if root is not None else DEFAULT_ROOT

    def open(self) -> None:
        from ipw.telemetry.rapl import discover_zones

        try:
            zones = discover_zones(self.root)
        except IpwError as exc:
            raise Unavailable(exc.message) from exc
        if not zones:
            raise Unavailable(f"no RAPL package zones under {self.root}")
        self.zones: list[dict[str, Any]] = [{"component": z.component, "path": str(z.energy_path),
                       "max_energy_range_uj": z.max_energy_range_uj, "energy_uj": series(), "errors": []}
                      for z in zones]

    def poll(self, now_ns: int) -> None:
        for z in self.zones:
            t0 = time.monotonic_ns()
            try:
                v = int(Path(z["path"]).read_text())
            except OSError as exc:
                z["errors"].append([t0, "energy_uj", f"{type(exc).__name__}: {exc.strerror}"])
                continue
            _push(z["energy_uj"], (t0 + time.monotonic_ns()) // 2, v)

    def dump(self) -> dict[str, Any]:
        return {"available": True, "root": str(self.root), "zones": self.zones}


# --------------------------------------------------------------------------------------------------
# the platforms of ipw.telemetry.polled: each library's answers as it gave them


class AmdRecorder(Recorder):
    """Per GPU: ``amdsmi_get_energy_count`` and ``amdsmi_get_power_info`` answers (dicts, as returned;
    ``{"status": code}`` where the call raised) every 50 ms."""

    name = "amdsmi"
    period_s = 0.05

    def open(self) -> None:
        from ipw.telemetry import amd

        try:
            self.lib = lib = amd.import_amdsmi()
            lib.amdsmi_init(lib.AmdSmiInitFlags.INIT_AMD_GPUS)
        except IpwError as exc:
            raise Unavailable(exc.message) from exc
        except Exception as exc:  # amdsmi_init's own failure (no permission, no driver)
            raise Unavailable(f"amdsmi_init: {amd._status(lib, exc)}") from exc
        self.handles = list(lib.amdsmi_get_processor_handles())
        if not self.handles:
            lib.amdsmi_shut_down()
            raise Unavailable("amdsmi: no AMD GPU found")
        self.devices: list[dict[str, Any]] = [{"index": i, "market_name": str(lib.amdsmi_get_gpu_asic_info(h).get("market_name", "?")),
                         "energy_count": series(), "power_info": series(), "errors": []}
                        for i, h in enumerate(self.handles)]

    def _answer(self, fn: Callable[[], dict[str, Any]], keys: tuple[str, ...] | None = None) -> dict[str, Any]:
        try:
            d = fn()
        except self.lib.AmdSmiLibraryException as exc:
            return {"status": exc.get_error_code()}
        return {k: v for k, v in d.items() if keys is None or k in keys}

    def poll(self, now_ns: int) -> None:
        lib = self.lib
        for h, dev in zip(self.handles, self.devices):
            t0 = time.monotonic_ns()
            _push(dev["energy_count"], t0, self._answer(lambda: lib.amdsmi_get_energy_count(h)))
            t0 = time.monotonic_ns()
            _push(dev["power_info"], t0, self._answer(lambda: lib.amdsmi_get_power_info(h),
                                                      ("current_socket_power", "average_socket_power", "power_limit")))

    def dump(self) -> dict[str, Any]:
        return {"available": True, "library": "amdsmi", "devices": self.devices}

    def close(self) -> None:
        self.lib.amdsmi_shut_down()


class AppleRecorder(Recorder):
    """``AppleEnergyMonitor.get_cumulative_energy()`` (the CPU, GPU, ANE, DRAM fields, mJ) every 50 ms."""

    name = "apple"
    period_s = 0.05

    def open(self) -> None:
        from ipw.telemetry import apple

        try:
            lib = apple.import_zeus_apple_silicon()
            self.monitor = lib.AppleEnergyMonitor()
        except IpwError as exc:
            raise Unavailable(exc.message) from exc
        except RuntimeError as exc:
            raise Unavailable(f"zeus-apple-silicon: {exc}") from exc
        self.fields = apple.FIELDS
        self.metric = apple._metric
        self.cumulative = series()

    def poll(self, now_ns: int) -> None:
        t0 = time.monotonic_ns()
        m = self.monitor.get_cumulative_energy()
        _push(self.cumulative, (t0 + time.monotonic_ns()) // 2, {f: self.metric(m, f) for f in self.fields.values()})

    def dump(self) -> dict[str, Any]:
        return {"available": True, "library": "zeus-apple-silicon", "cumulative": self.cumulative}


class JetsonRecorder(Recorder):
    """Every INA3221/INA2xx hwmon directory: its name, labels and update interval once, and each value
    file (``in*_input``, ``curr*_input``, ``power1_input``, ``energy1_input``: the text, as an int)
    every 50 ms, named relative to the hwmon root."""

    name = "jetson"
    period_s = 0.05

    def __init__(self, root: Path | None = None) -> None:
        from ipw.telemetry import jetson

        self.root = Path(root) if root is not None else jetson.DEFAULT_ROOT

    def open(self) -> None:
        from ipw.telemetry import jetson

        self.files: dict[str, str] = {}
        self.series: dict[str, dict[str, list[Any]]] = {}
        if not self.root.is_dir():
            raise Unavailable(f"{self.root}: no hwmon")
        for d in sorted(self.root.iterdir()):
            name = d / "name"
            if not name.is_file():
                continue
            chip = name.read_text().strip()
            if chip != jetson.INA3221 and chip not in jetson.INA2XX:
                continue
            for f in sorted(d.iterdir()):
                rel = f"{d.name}/{f.name}"
                if f.name == "name" or f.name.endswith("_label") or f.name in ("label", "update_interval"):
                    self.files[rel] = f.read_text().strip()
                elif f.name.endswith("_input") and f.name[:2] in ("in", "cu", "po", "en"):
                    self.series[rel] = series()
        if not self.series:
            raise Unavailable(f"{self.root}: no INA3221/INA238 power monitor (not a Jetson board)")

    def poll(self, now_ns: int) -> None:
        for rel, s in self.series.items():
            t0 = time.monotonic_ns()
            try:
                v = int((self.root / rel).read_text().split()[0])
            except (OSError, ValueError):
                continue
            _push(s, (t0 + time.monotonic_ns()) // 2, v)

    def dump(self) -> dict[str, Any]:
        return {"available": True, "root": str(self.root), "files": self.files, "series": self.series}


# --------------------------------------------------------------------------------------------------
# the recording loop and the file


def recorders() -> list[Recorder]:
    """One recorder per platform, in the order ``ipw doctor`` lists them."""
    return [NvmlRecorder(), AmdRecorder(), AppleRecorder(), JetsonRecorder(), RaplRecorder()]


def record(seconds: float, *, load: Callable[[], None] | None = None, load_at_s: float = 0.0,
           recs: list[Recorder] | None = None, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Record every platform for ``seconds``; ``load`` (if given) is called in this thread
    ``load_at_s`` after the start while the recorders poll in theirs.  Returns the trace."""
    recs = recorders() if recs is None else recs
    platforms: dict[str, Any] = {}
    opened: list[Recorder] = []
    for r in recs:
        try:
            r.open()
        except Unavailable as exc:
            platforms[r.name] = {"available": False, "why": str(exc)}
            log(f"record-trace: {r.name}: not recorded: {exc}")
            continue
        except Exception as exc:  # one broken platform never stops the others
            platforms[r.name] = {"available": False, "why": f"{type(exc).__name__}: {exc}"}
            log(f"record-trace: {r.name}: not recorded: {type(exc).__name__}: {exc}")
            continue
        opened.append(r)
    events: list[dict[str, Any]] = []
    stop = threading.Event()
    start_ns = time.monotonic_ns()
    end_ns = start_ns + int(seconds * 1e9)

    def loop() -> None:
        due = {id(r): start_ns for r in opened}
        while not stop.is_set():
            now = time.monotonic_ns()
            if now >= end_ns:
                break
            for r in opened:
                if now >= due[id(r)]:
                    try:
                        r.poll(now)
                    except Exception as exc:
                        events.append({"t_ns": now, "what": f"{r.name} poll failed: {type(exc).__name__}: {exc}"})
                    due[id(r)] = now + int(r.period_s * 1e9)
            wait = (min(due.values(), default=end_ns) - time.monotonic_ns()) / 1e9
            if wait > 0:
                stop.wait(min(wait, 0.5))

    thread = threading.Thread(target=loop, name="ipw-record-trace", daemon=True)
    thread.start()
    try:
        if load is not None:
            stop.wait(max(0.0, load_at_s - (time.monotonic_ns() - start_ns) / 1e9))
            events.append({"t_ns": time.monotonic_ns(), "what": "load_start"})
            load()
            events.append({"t_ns": time.monotonic_ns(), "what": "load_end"})
        thread.join(max(0.0, (end_ns - time.monotonic_ns()) / 1e9) + 5.0)
    finally:
        stop.set()
        thread.join(5.0)
        for r in opened:
            try:
                platforms[r.name] = r.dump()
            finally:
                r.close()
    return {
        "format": FORMAT, "version": VERSION,
        "recorded_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"machine": _platform.machine(), "system": _platform.system(), "release": _platform.release()},
        "start_ns": start_ns, "duration_s": seconds, "events": events, "platforms": platforms,
    }


def write_trace(trace: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    data = json.dumps(trace, separators=(",", ":")).encode()
    if p.name.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    p.write_bytes(data)
    return p


def read_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A trace file; IpwError naming the file when it is not one."""
    p = Path(path)
    try:
        raw = p.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        trace = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise IpwError(f"{p}: not a readable sensor trace ({exc})") from None
    if not isinstance(trace, dict) or trace.get("format") != FORMAT:
        raise IpwError(f"{p}: field 'format': not {FORMAT!r}")
    if trace.get("version") != VERSION:
        raise IpwError(f"{p}: field 'version': {trace.get('version')!r}, this ipw reads version {VERSION}")
    return trace
