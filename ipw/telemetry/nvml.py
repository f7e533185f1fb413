"""GPU energy from NVML: :class:`NvmlSensor`.

:class:`NvmlSensor` attributes energy per window from the driver's 20 ms power samples, calibrated by
the energy counter, all read by one background thread (:mod:`ipw.telemetry.sampler`); see
docs/ENERGY.md for how accurate it is on an H200.  Where the samples are missing it falls back, with
a label on each reading, to the energy counter alone (``nvml.counter``) or the instant power field.

Which GPUs: ``indices`` are CUDA ordinals as the inference engine sees them, i.e. positions in
``CUDA_VISIBLE_DEVICES`` when it is set (entries are NVML indices or ``GPU-`` UUIDs, full or a unique
prefix; like CUDA, parsing stops at the first entry that names no GPU).  Integer entries are taken
as NVML (PCI bus) indices, which matches CUDA's order when ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or on
machines of identical GPUs.  ``MIG-`` entries are refused: NVML has no energy per MIG slice.

The machine's other GPUs (not selected, or hidden by ``CUDA_VISIBLE_DEVICES``) are *watched*: their
instant power is read 4x a second, and a window during which one of them was busy says so
(``foreign activity`` in each reading's note, :attr:`PendingWindow.foreign_activity`): its energy is
in no reading, so a job spread over more GPUs than were selected is visibly under-measured.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from ipw.errors import IpwError
from ipw.telemetry.base import Deferred, EnergyReading, SensorBase, SensorInfo
from ipw.telemetry.estimator import (
    CALIBRATION_BOUNDS,
    COUNTER_DELTA_MIN_S,
    SHORT_WINDOW_S,
    WindowEstimate,
)
from ipw.telemetry.foreign import FOREIGN_BUSY_FRACTION, FOREIGN_RISE_FRACTION
from ipw.telemetry.sampler import (
    CALIBRATION_LOOKBACK_S,
    COUNTER_CPU_BUDGET,
    DEFAULT_SAMPLE_SHIFT_S,
    DEFAULT_SAMPLES_PERIOD_S,
    NvmlSampler,
)

_FIXES = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": "libnvidia-ml.so.1 was not found; install the NVIDIA driver",
    "NVML_ERROR_DRIVER_NOT_LOADED": "the NVIDIA driver is not loaded; check `nvidia-smi`",
    "NVML_ERROR_NO_PERMISSION": "run ipw as a user in the 'video' group "
    "(sudo usermod -aG video $USER, then log in again) or as root",
    "NVML_ERROR_NOT_SUPPORTED": "this GPU has no energy counter (it needs Volta or newer); "
    "hide it from ipw with CUDA_VISIBLE_DEVICES",
    "NVML_ERROR_NOT_FOUND": "no such GPU; list GPUs and UUIDs with `nvidia-smi -L`",
    "NVML_ERROR_GPU_IS_LOST": "the GPU fell off the bus; check `dmesg`, then reset or reboot",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": "the driver was upgraded without a reboot; reboot "
    "(or reload the nvidia kernel modules)",
    "NVML_ERROR_RESET_REQUIRED": "the GPU needs a reset; run `nvidia-smi -r` or reboot",
    "NVML_ERROR_FUNCTION_NOT_FOUND": "the NVIDIA driver is too old for this call; upgrade it",
}


def import_pynvml() -> ModuleType:
    try:
        import pynvml
    except ImportError as exc:
        raise IpwError(
            "pynvml is not importable; install it with: pip install nvidia-ml-py"
        ) from exc
    module: ModuleType = pynvml
    return module


def nvml_error(pynvml: ModuleType, exc: BaseException, what: str) -> IpwError:
    """Translate an NVMLError into an IpwError whose message says how to fix it."""
    value = getattr(exc, "value", None)
    for const, fix in _FIXES.items():
        if value is not None and value == getattr(pynvml, const, object()):
            return IpwError(f"NVML {what}: {exc} ({const}); {fix}")
    return IpwError(f"NVML {what}: {exc} (error {value}); check that `nvidia-smi` works")


def _is_error(pynvml: ModuleType, exc: BaseException, *consts: str) -> bool:
    value = getattr(exc, "value", None)
    return any(value == getattr(pynvml, c, object()) for c in consts)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class Gpu:
    component: str  # "gpuN", N the CUDA ordinal
    nvml_index: int
    uuid: str
    name: str
    mig_enabled: bool
    handle: Any


def visible_nvml_indices(pynvml: ModuleType) -> list[int]:
    """NVML indices of the GPUs CUDA would see, in CUDA ordinal order."""
    count = pynvml.nvmlDeviceGetCount()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return list(range(count))
    uuids = [_text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]
    visible: list[int] = []
    for entry in (e.strip() for e in env.split(",")):
        if entry.startswith("MIG-"):
            raise IpwError(
                f"CUDA_VISIBLE_DEVICES={env}: {entry} is a MIG slice; NVML cannot measure energy per "
                "MIG slice. Name the whole GPU (its index or GPU- UUID) to measure it"
            )
        if entry.isdigit() and int(entry) < count:
            index = int(entry)
        elif entry.startswith("GPU-"):
            matches = [i for i, u in enumerate(uuids) if u.startswith(entry)]
            if len(matches) != 1:
                break
            index = matches[0]
        else:
            break  # CUDA ignores this entry and everything after it
        if index in visible:
            break
        visible.append(index)
    return visible


def mig_enabled(pynvml: ModuleType, handle: Any) -> bool:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:
        return False  # not MIG-capable (or a driver without the call)
    return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)


def select_gpus(pynvml: ModuleType, indices: list[int] | None) -> list[Gpu]:
    """The GPUs to measure: CUDA ordinals ``indices`` (default: every visible GPU), honoring
    ``CUDA_VISIBLE_DEVICES``.  NVML errors become IpwError with the fix."""
    try:
        visible = visible_nvml_indices(pynvml)
        ordinals = list(range(len(visible))) if indices is None else list(indices)
        gpus = []
        for ordinal in ordinals:
            if not 0 <= ordinal < len(visible):
                raise IpwError(
                    f"GPU {ordinal} is not visible: {len(visible)} GPU(s) visible "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
                )
            index = visible[ordinal]
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(
                Gpu(
                    component=f"gpu{ordinal}",
                    nvml_index=index,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    mig_enabled=mig_enabled(pynvml, handle),
                    handle=handle,
                )
            )
    except pynvml.NVMLError as exc:
        raise nvml_error(pynvml, exc, "device query") from exc
    return gpus


def other_gpus(pynvml: ModuleType, selected: list[Gpu]) -> list[Gpu]:
    """Every NVML device not in ``selected`` (hidden by CUDA_VISIBLE_DEVICES or not chosen), named
    ``nvml<index>``: watched for foreign activity.  Best effort: a device that cannot be queried is
    left out, never an error."""
    taken = {g.nvml_index for g in selected}
    out: list[Gpu] = []
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return out
    for index in range(count):
        if index in taken:
            continue
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            name = _text(pynvml.nvmlDeviceGetName(handle))
        except Exception:
            continue
        out.append(Gpu(f"nvml{index}", index, uuid, name, False, handle))
    return out


def foreign_note(activity: list[dict[str, Any]], others: dict[str, Gpu]) -> str:
    """One note for the GPUs outside the measurement that were busy during a window."""
    parts = []
    for a in activity:
        gpu = others.get(a["component"])
        uuid = f" {gpu.uuid[:12]}" if gpu is not None else ""
        parts.append(f"{a['component']}{uuid} {a['mean_w']:.0f} W mean vs {a['idle_w']:.0f} W idle, "
                     f"~{_fmt_j(a['excess_j'])} above idle")
    return "foreign activity (GPUs not measured were busy; their energy is in no reading): " + "; ".join(parts)


def _init_probe(pynvml: ModuleType) -> bool:
    """nvmlInit + "is there a visible GPU", for ``probe``: False when there is no NVML library,
    driver or visible GPU; IpwError (with the fix) for other failures."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        if _is_error(pynvml, exc, "NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED"):
            return False
        raise nvml_error(pynvml, exc, "nvmlInit") from exc
    try:
        return bool(visible_nvml_indices(pynvml))
    except pynvml.NVMLError as exc:
        raise nvml_error(pynvml, exc, "device query") from exc
    finally:
        pynvml.nvmlShutdown()


def probe_power_scopes(pynvml: ModuleType, handle: Any) -> dict[str, str]:
    """Whether the instant-power field answers at GPU scope and at module scope (GPU + CPU + memory of a
    superchip: GH200, GB200, GB10): ``{"gpu": "ok" | why, "module": "ok" | why}``.  Zeus probes the same
    two scopes (ml-energy/zeus, zeus/device/gpu/nvidia.py, ``_resolve_power_field_scope``); where the
    module scope answers, ``ipw.telemetry.superchip`` measures the rest of the module."""
    out = {}
    fid = pynvml.NVML_FI_DEV_POWER_INSTANT
    for scope, scope_id in (("gpu", pynvml.NVML_POWER_SCOPE_GPU), ("module", pynvml.NVML_POWER_SCOPE_MODULE)):
        try:
            ret = pynvml.nvmlDeviceGetFieldValues(handle, [(fid, scope_id)])[0].nvmlReturn
            out[scope] = "ok" if ret == pynvml.NVML_SUCCESS else _error_name(pynvml, ret)
        except pynvml.NVMLError as exc:
            out[scope] = _error_name(pynvml, exc.value)
        except Exception as exc:  # an old binding without scoped field ids
            out[scope] = f"{type(exc).__name__}: {exc}"
    return out


def _error_name(pynvml: ModuleType, value: Any) -> str:
    return next((k for k, v in vars(pynvml).items() if k.startswith("NVML_ERROR_") and v == value), f"error {value}")


def power_scope_note(scopes: dict[str, dict[str, str]]) -> str:
    """One line for ``info``: the power scope measured, and the module where NVML offers it."""
    module = [c for c, s in scopes.items() if s.get("module") == "ok"]
    if not module:
        return "power scope: GPU (NVML offers no module scope here)"
    return (f"power scope: GPU; module scope offered on {', '.join(module)} (a superchip): the rest of the "
            "module is measured by the nvml_module sensor")


def _gpu_params(gpus: list[Gpu]) -> list[dict[str, Any]]:
    return [
        {"component": g.component, "nvml_index": g.nvml_index, "uuid": g.uuid, "name": g.name,
         "mig_enabled": g.mig_enabled}
        for g in gpus
    ]


# --------------------------------------------------------------------------------------------------
# the sampling sensor


def _fmt_j(x: float) -> str:
    return f"{x:.3g} J" if abs(x) < 100 else f"{x:.0f} J"


def reading_from_estimate(
    gpu: Gpu, est: WindowEstimate, duration_s: float, extra_notes: list[str] | None = None
) -> EnergyReading:
    """One EnergyReading (the sensor contract) from one estimator result, every caveat in its note."""
    notes: list[str] = []
    if est.source == "nvml.samples" and est.calibration_ratio is not None:
        notes.append(f"calibration ratio {est.calibration_ratio:.4f}")
    if est.note:
        notes.append(est.note)
    if est.counter_delta_j is not None:
        notes.append(f"counter delta {_fmt_j(est.counter_delta_j)}")
    if est.short_window and est.uncertainty_j is not None:
        notes.append(f"short window: ±{_fmt_j(est.uncertainty_j)}")
    if gpu.mig_enabled:
        notes.append("MIG enabled: whole-GPU energy, slices not attributable")
    notes.extend(extra_notes or [])
    if est.energy_j is None or est.quality == "unavailable":
        return EnergyReading(gpu.component, None, est.source or "nvml.samples", "unavailable", "gpu",
                             duration_s, note="; ".join(notes))
    return EnergyReading(
        component=gpu.component,
        energy_j=max(0.0, float(est.energy_j)),
        source=est.source,
        quality=est.quality,
        scope="gpu",
        duration_s=duration_s,
        note="; ".join(notes),
        uncertainty_j=est.uncertainty_j,
        calibration_sd_j=est.calibration_sd_j,
    )


class PendingWindow(Deferred):
    """The deferred result of one :class:`NvmlSensor` window (the runner's ``Deferred``): ready once
    the sampler has read every signal far enough past the window's end."""

    def __init__(self, sensor: "NvmlSensor", start_ns: int, end_ns: int) -> None:
        self._sensor = sensor
        self.start_s = start_ns / 1e9
        self.end_s = end_ns / 1e9
        self.end_ns = end_ns
        self._result: list[EnergyReading] | None = None
        #: The watched GPUs that were busy during the window (see
        #: :meth:`~ipw.telemetry.sampler.NvmlSampler.foreign_activity`); set by :meth:`result`.
        self.foreign_activity: list[dict[str, Any]] = []

    def ready(self) -> bool:
        if self._result is not None:
            return True
        try:
            return self._sensor.sampler.settled_until() >= self.end_s
        except Exception:
            return True  # result() will say what went wrong

    def result(self) -> list[EnergyReading]:
        if self._result is None:
            self._result, self.foreign_activity = self._sensor._windows([(self.start_s, self.end_s)])[0]
        return self._result

    @classmethod
    def resolve_all(cls, pending: list["PendingWindow"]) -> None:
        """Make many ready windows final with one estimate per sensor (``ipw serve`` under load ends a
        window every few ms; one estimate each would cost a calibration over the lookback each)."""
        by_sensor: dict[int, tuple[NvmlSensor, list[PendingWindow]]] = {}
        for p in pending:
            if p._result is None and p.ready():
                by_sensor.setdefault(id(p._sensor), (p._sensor, []))[1].append(p)
        for sensor, group in by_sensor.values():
            for p, (readings, foreign) in zip(group, sensor._windows([(p.start_s, p.end_s) for p in group])):
                p._result, p.foreign_activity = readings, foreign


class NvmlSensor(SensorBase):
    """GPU energy per window from the driver's 20 ms power samples, calibrated by the energy counter.

    One :class:`~ipw.telemetry.sampler.NvmlSampler` thread owns the NVML handles and records the
    counter (4x a second), the sample buffer (about once a second, and ~60 ms after each window
    ends) and the instant-power field.  ``begin()`` returns the monotonic time; ``end(token)`` returns
    a :class:`PendingWindow` whose ``result()`` is one reading per GPU:

    - ``nvml.samples``, ``measured_interpolated``: samples integrated over the window (edges
      interpolated), scaled by counter / samples over a long enclosing span; the note gives the
      ratio (flagged outside 0.97-1.03), the counter delta for windows >= 2 s, and an uncertainty
      for windows < 0.15 s;
    - fallbacks, labeled: uncalibrated samples (no counter), the counter alone (``nvml.counter``),
      the instant field (``nvml.instant``), else ``unavailable``.  A counter that goes backwards is a
      gap, never negative energy; an NVML failure mid-run gives ``unavailable`` readings, not an
      exception.

    The machine's other GPUs are watched (``watch_others``): a reading's note says when one of them
    was busy during its window (``foreign activity``); :attr:`PendingWindow.foreign_activity` has the
    numbers.
    """

    name = "nvml"
    supports_cut = True
    supports_energy_windows = True  # the phase split integrates both sub-windows (ipw.telemetry.phases)
    supports_trace = True

    def __init__(
        self,
        indices: list[int] | None = None,
        *,
        counter_period_s: float | None = None,
        samples_period_s: float = DEFAULT_SAMPLES_PERIOD_S,
        sample_shift_s: float = DEFAULT_SAMPLE_SHIFT_S,
        threaded: bool = True,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        wall_ns: Callable[[], int] = time.time_ns,
        watch_others: bool = True,
    ) -> None:
        self._nvml = import_pynvml()
        self._closed = False
        self._clock = clock_ns
        sampler: NvmlSampler | None = None
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            raise nvml_error(self._nvml, exc, "nvmlInit") from exc
        try:
            self.gpus = select_gpus(self._nvml, indices)
            self.power_scopes = {g.component: probe_power_scopes(self._nvml, g.handle) for g in self.gpus}
            self.others = other_gpus(self._nvml, self.gpus) if watch_others else []
            self.sampler = sampler = NvmlSampler(
                self._nvml, self.gpus, counter_period_s=counter_period_s,
                samples_period_s=samples_period_s, sample_shift_s=sample_shift_s,
                clock_ns=clock_ns, wall_ns=wall_ns, watch=self.others,
            )
            self._signals = self.sampler.start(threaded=threaded)
            self._check_signals()
        except BaseException:
            if sampler is not None:
                sampler.stop()
            self._nvml.nvmlShutdown()
            raise

    def _check_signals(self) -> None:
        """Refuse a GPU on which no signal works, with the fix for the counter's error."""
        nvml = self._nvml
        for gpu in self.gpus:
            states = {k: self.sampler.kind_state(gpu.component, k) for k in ("counter", "samples", "instant")}
            if any(status == "ok" for status, _ in states.values()):
                continue
            value = states["counter"][1]
            if value is None:
                value = next((v for _, v in states.values() if v is not None), None)
            err = nvml.NVMLError(value if value is not None else nvml.NVML_ERROR_NOT_SUPPORTED)
            raise nvml_error(nvml, err, f"power readings of {gpu.component} (energy counter, samples, instant power)")

    @classmethod
    def probe(cls, indices: list[int] | None = None, **kwargs: Any) -> NvmlSensor | None:
        """The sensor, or None when there is no NVML library, driver, or visible GPU.

        Other NVML failures (permissions, no power signal at all) raise IpwError with the fix.
        """
        try:
            pynvml = import_pynvml()
        except IpwError:
            return None
        if not _init_probe(pynvml):
            return None
        return cls(indices, **kwargs)

    # -- the Sensor protocol ------------------------------------------------------------------

    def info(self) -> SensorInfo:
        s = self.sampler
        signals = s.signals()
        mig = [g.component for g in self.gpus if g.mig_enabled]
        detail = ", ".join(f"{g.component}: {g.name}" for g in self.gpus)
        detail += (
            f"; driver power samples (~20 ms) polled every {s.samples_period_s:g} s, integrated per "
            f"window and scaled by the energy counter (read every {s.counter_period_s:.2g} s"
            + (", adapted to its cost)" if s.counter_adaptive else ")")
        )
        missing = sorted({f"{k} on {c}" for c, ks in signals.items() for k, v in ks.items() if v != "ok"})
        if missing:
            detail += f"; not available: {', '.join(missing)} (fallbacks are labeled per reading)"
        if mig:
            detail += (
                f"; MIG enabled on {', '.join(mig)}: energy is the whole GPU, MIG slices are "
                "not attributable"
            )
        detail += "; " + power_scope_note(self.power_scopes)
        watched = s.watched()
        if watched:
            detail += (
                f"; not measured, watched for foreign activity: "
                f"{', '.join(w['component'] for w in watched)}"
            )
        others = {g.component: g for g in self.others}
        return SensorInfo(
            name=self.name,
            available=True,
            source="nvml.samples",
            quality="measured_interpolated",
            scope="gpu",
            components=tuple(g.component for g in self.gpus),
            detail=detail,
            params={
                "gpus": _gpu_params(self.gpus),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "signals": signals,
                "power_scopes": self.power_scopes,
                "counter_period_s": s.counter_period_s,
                "counter_period_adaptive": s.counter_adaptive,
                "counter_cpu_budget": COUNTER_CPU_BUDGET if s.counter_adaptive else None,
                "samples_period_s": s.samples_period_s,
                "instant_period_s": s.instant_period_s,
                "settle_margin_s": s.settle_margin_s,
                "sample_shift_s": s.sample_shift_s,
                "power_limits_w": s.power_limits_w(),
                "calibration_lookback_s": CALIBRATION_LOOKBACK_S,
                "calibration_bounds": list(CALIBRATION_BOUNDS),
                "short_window_s": SHORT_WINDOW_S,
                "counter_delta_min_s": COUNTER_DELTA_MIN_S,
                "mig": "MIG slices are not attributable: readings are whole-GPU energy"
                if mig else "MIG not enabled",
                "never_used": "nvmlDeviceGetPowerUsage / NVML_FI_DEV_POWER_AVERAGE (1 s average)",
                "watched_gpus": [
                    {**w, "nvml_index": others[w["component"]].nvml_index,
                     "uuid": others[w["component"]].uuid, "name": others[w["component"]].name}
                    for w in watched
                ],
                "watch_period_s": s.watch_period_s if watched else None,
                "foreign_activity_rule": (
                    f"instant power above the GPU's idle by > {FOREIGN_RISE_FRACTION:.0%} of its power "
                    f"limit, or above {FOREIGN_BUSY_FRACTION:.0%} of it"
                ),
            },
        )

    def begin(self, t_s: float | None = None) -> int:
        start_ns = self._clock() if t_s is None else int(round(t_s * 1e9))
        try:
            self.sampler.mark_begin(start_ns / 1e9)
        except Exception:
            pass
        return start_ns

    def end(self, token: int, t_s: float | None = None) -> PendingWindow:
        end_ns = self._clock() if t_s is None else int(round(t_s * 1e9))
        try:
            # a long window also gets a counter read at its end, for its direct counter delta
            self.sampler.mark(end_ns / 1e9, counter=(end_ns - token) / 1e9 >= 0.75 * COUNTER_DELTA_MIN_S)
        except Exception:
            pass  # the result says what is missing
        return PendingWindow(self, int(token), end_ns)

    def cut(self, token: int, t_s: float | None = None) -> tuple[PendingWindow, int]:
        """Close the window and open the next at the same instant (windows that tile time: no energy is
        lost between them)."""
        pending = self.end(token, t_s)
        return pending, pending.end_ns

    def _readings(self, start_s: float, end_s: float) -> list[EnergyReading]:
        return self._windows([(start_s, end_s)])[0][0]

    def _windows(self, spans: list[tuple[float, float]]) -> list[tuple[list[EnergyReading], list[dict[str, Any]]]]:
        """The readings of each window and the foreign activity during it (one estimate for all)."""
        extra: list[str] = []
        if self.sampler._fatal:
            extra.append(f"sampler stopped: {self.sampler._fatal}")
        foreigns: list[list[dict[str, Any]]] = []
        notes: list[list[str]] = []
        for start_s, end_s in spans:
            foreign: list[dict[str, Any]] = []
            own = list(extra)
            try:
                foreign = self.sampler.foreign_activity(start_s, end_s)
            except Exception as exc:  # informational: never fails the window
                own.append(f"foreign activity unknown: {type(exc).__name__}: {exc}")
            if foreign:
                own.append(foreign_note(foreign, {g.component: g for g in self.others}))
            foreigns.append(foreign)
            notes.append(own)
        try:
            estimates = self.sampler.energy_windows(spans)
        except Exception as exc:  # never an exception into the runner
            return [([EnergyReading(g.component, None, "nvml.samples", "unavailable", "gpu", end_s - start_s,
                                    note="; ".join([f"estimate failed: {type(exc).__name__}: {exc}", *own]))
                      for g in self.gpus], foreign)
                    for (start_s, end_s), own, foreign in zip(spans, notes, foreigns)]
        signals = self.sampler.signals()
        out = []
        for k, (start_s, end_s) in enumerate(spans):
            readings = []
            for gpu in self.gpus:
                est = estimates[gpu.component][k]
                own = list(notes[k])
                failed = [f"{key} {v}" for key, v in signals[gpu.component].items() if v.startswith("failed")]
                if failed and est.coverage < 1.0:
                    own.append("NVML " + "; ".join(failed))
                readings.append(reading_from_estimate(gpu, est, end_s - start_s, own))
            out.append((readings, foreigns[k]))
        return out

    def foreign_activity(self, start_s: float, end_s: float) -> list[dict[str, Any]]:
        """The machine's other (watched, not measured) GPUs that were busy in ``[start_s, end_s]``."""
        return self.sampler.foreign_activity(start_s, end_s)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.sampler.stop()
            self._nvml.nvmlShutdown()

    # -- for the runner: manifest, power.parquet, progress display -------------------------------

    def overhead(self) -> dict[str, Any]:
        """Manifest ``sampler_overhead``: CPU s, wall s, fraction of one core, calls per kind."""
        return self.sampler.overhead()

    def trace(self, since_s: float | None = None) -> dict[str, Any]:
        """Columns for ``power.parquet``: t_s, device, power_w, kind, energy_j."""
        return self.sampler.trace(since_s)

    def current_power_w(self) -> dict[str, float | None]:
        """Latest watts per GPU, for the live progress display."""
        return self.sampler.current_power_w()

    def energy_windows(self, windows: list[tuple[float, float]], **kwargs: Any) -> dict[str, list[WindowEstimate]]:
        return self.sampler.energy_windows(windows, **kwargs)
