"""GPU energy from the NVML total-energy counter, read at window begin and end.

``nvmlDeviceGetTotalEnergyConsumption`` (mJ, Volta and newer) steps about every 100 ms and costs
~3-4 ms per read (DESIGN.md §3): its begin/end delta is accurate for windows of seconds and coarse
below ~0.15 s, which readings note.  Sub-second attribution from the sample buffer comes later.

Which GPUs: ``indices`` are CUDA ordinals as the inference engine sees them, i.e. positions in
``CUDA_VISIBLE_DEVICES`` when it is set (entries are NVML indices or ``GPU-`` UUIDs, full or a unique
prefix; like CUDA, parsing stops at the first entry that names no GPU).  Integer entries are taken
as NVML (PCI bus) indices, which matches CUDA's order when ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or on
machines of identical GPUs.  ``MIG-`` entries are refused: NVML has no energy per MIG slice.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ipw.errors import IpwError
from ipw.telemetry.base import EnergyReading, SensorInfo

#: Windows shorter than this are below the counter's update step (DESIGN.md §3).
COUNTER_STEP_S = 0.15

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
    return pynvml


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


class NvmlCounterSensor:
    """Measured GPU energy from begin/end reads of the NVML energy counter."""

    name = "nvml"

    def __init__(self, indices: list[int] | None = None) -> None:
        self._nvml = import_pynvml()
        self._closed = False
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            raise nvml_error(self._nvml, exc, "nvmlInit") from exc
        try:
            self.gpus = self._select(indices)
            for gpu in self.gpus:
                self._read_mj(gpu)  # fail now if the counter is unsupported
        except BaseException:
            self._nvml.nvmlShutdown()
            raise

    @classmethod
    def probe(cls, indices: list[int] | None = None) -> NvmlCounterSensor | None:
        """The sensor, or None when there is no NVML library, driver, or visible GPU.

        Other NVML failures (permissions, an unsupported counter) raise IpwError with the fix.
        """
        try:
            pynvml = import_pynvml()
        except IpwError:
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            if _is_error(pynvml, exc, "NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED"):
                return None
            raise nvml_error(pynvml, exc, "nvmlInit") from exc
        try:
            if not visible_nvml_indices(pynvml):
                return None
        except pynvml.NVMLError as exc:
            raise nvml_error(pynvml, exc, "device query") from exc
        finally:
            pynvml.nvmlShutdown()
        return cls(indices)

    def _select(self, indices: list[int] | None) -> list[Gpu]:
        nvml = self._nvml
        try:
            visible = visible_nvml_indices(nvml)
            ordinals = list(range(len(visible))) if indices is None else list(indices)
            gpus = []
            for ordinal in ordinals:
                if not 0 <= ordinal < len(visible):
                    raise IpwError(
                        f"GPU {ordinal} is not visible: {len(visible)} GPU(s) visible "
                        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
                    )
                index = visible[ordinal]
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                gpus.append(
                    Gpu(
                        component=f"gpu{ordinal}",
                        nvml_index=index,
                        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                        name=_text(nvml.nvmlDeviceGetName(handle)),
                        mig_enabled=self._mig_enabled(handle),
                        handle=handle,
                    )
                )
        except nvml.NVMLError as exc:
            raise nvml_error(nvml, exc, "device query") from exc
        return gpus

    def _mig_enabled(self, handle: Any) -> bool:
        try:
            current, _pending = self._nvml.nvmlDeviceGetMigMode(handle)
        except self._nvml.NVMLError:
            return False  # not MIG-capable (or a driver without the call)
        return current == self._nvml.NVML_DEVICE_MIG_ENABLE

    def _read_mj(self, gpu: Gpu) -> int:
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(gpu.handle))
        except self._nvml.NVMLError as exc:
            raise nvml_error(self._nvml, exc, f"energy counter of {gpu.component}") from exc

    def info(self) -> SensorInfo:
        mig = [g.component for g in self.gpus if g.mig_enabled]
        detail = ", ".join(f"{g.component}: {g.name}" for g in self.gpus)
        detail += "; energy counter read at window edges (~100 ms steps)"
        if mig:
            detail += (
                f"; MIG enabled on {', '.join(mig)}: energy is the whole GPU, MIG slices are "
                "not attributable"
            )
        return SensorInfo(
            name=self.name,
            available=True,
            source="nvml.counter",
            quality="measured",
            scope="gpu",
            components=tuple(g.component for g in self.gpus),
            detail=detail,
            params={
                "gpus": [
                    {
                        "component": g.component,
                        "nvml_index": g.nvml_index,
                        "uuid": g.uuid,
                        "name": g.name,
                        "mig_enabled": g.mig_enabled,
                    }
                    for g in self.gpus
                ],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            },
        )

    def begin(self) -> tuple[int, list[int]]:
        return time.monotonic_ns(), [self._read_mj(g) for g in self.gpus]

    def end(self, token: tuple[int, list[int]]) -> list[EnergyReading]:
        start_ns, start_mj = token
        end_mj = [self._read_mj(g) for g in self.gpus]
        duration_s = (time.monotonic_ns() - start_ns) / 1e9
        readings = []
        for gpu, e0, e1 in zip(self.gpus, start_mj, end_mj):
            notes = []
            if gpu.mig_enabled:
                notes.append("MIG enabled: whole-GPU energy, slices not attributable")
            if e1 < e0:
                readings.append(
                    EnergyReading(
                        gpu.component, None, "nvml.counter", "unavailable", "gpu", duration_s,
                        note="; ".join(["counter went backwards (gap)", *notes]),
                    )
                )
                continue
            if duration_s < COUNTER_STEP_S:
                notes.append(
                    f"window {duration_s * 1000:.0f} ms is below the counter's ~100 ms step: coarse"
                )
            readings.append(
                EnergyReading(
                    component=gpu.component,
                    energy_j=(e1 - e0) / 1000.0,
                    source="nvml.counter",
                    quality="measured",
                    scope="gpu",
                    duration_s=duration_s,
                    note="; ".join(notes),
                )
            )
        return readings

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._nvml.nvmlShutdown()
