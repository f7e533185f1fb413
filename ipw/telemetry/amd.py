"""AMD GPU energy through ``amdsmi``, AMD's own library (the ``amd`` extra; it loads ROCm's
``libamd_smi.so``): :func:`probe`.

Which GPUs: those HIP would see (:func:`visible_amd_indices`): ``ROCR_VISIBLE_DEVICES`` picks among
amdsmi's processors, then ``HIP_VISIBLE_DEVICES`` (or ``CUDA_VISIBLE_DEVICES``, which HIP also reads)
among those (ROCm's "GPU isolation techniques"; PyTorch's ``_parse_visible_devices`` applies them in the
same order), then ipw's own ``gpu_indices`` (HIP ordinals, as NVML's are CUDA ordinals).  amdsmi's
processor order is taken as HIP's device order, as PyTorch and Ray do.

Per GPU (``amd0``, ``amd1``, ...: the HIP ordinal), polled every 0.1 s:

- the energy counter, ``amdsmi_get_energy_count(h)``: ``energy_accumulator`` x ``counter_resolution``
  µJ (older releases named the accumulator ``power``; ml-energy/zeus zeus/device/gpu/amd.py reads both);
- the power, ``amdsmi_get_power_info(h)["current_socket_power"]`` (W); where that is ``"N/A"``, the
  ``average_socket_power`` (a ~1 s average, noted: short windows are smeared by it).

Windows are attributed like NVML's: the power integrated and scaled by the counter over a long span
(:mod:`ipw.telemetry.polled`).  The counter is checked at start-up as Zeus does (energy over 0.5 s vs
power x 0.5 s, ml-energy/zeus#252 and ROCm/amdsmi#38 for counters that are wrong) and on every
estimate; a counter that fails is not used and the readings say why.  A drop of the counter that fits
the range of a 32-bit accumulator is undone as a wrap; any other drop is a gap.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

from ipw.errors import IpwError
from ipw.telemetry.polled import Absent, Channel, Platform, Poll, PolledSensor

#: amdsmi status codes (amdsmi/amdsmi_wrapper.py of the amdsmi 7.0.2 wheel) and their fixes
_STATUS = {
    1: ("AMDSMI_STATUS_INVAL", ""),
    2: ("AMDSMI_STATUS_NOT_SUPPORTED", "this GPU does not report it"),
    10: ("AMDSMI_STATUS_NO_PERM", "run ipw as a user in the 'render' and 'video' groups "
         "(sudo usermod -aG render,video $USER, then log in again) or as root"),
    18: ("AMDSMI_STATUS_INIT_ERROR", "check that the amdgpu driver is loaded (`amd-smi list`)"),
    34: ("AMDSMI_STATUS_DRIVER_NOT_LOADED", "load the amdgpu driver"),
}
#: Counter vs power x time: larger disagreements mean a faulty counter.  Zeus's start-up bound is
#: loose (0.1x-10x); over a span of >= 1 s the two should agree far better than this.
TOLERANCE = 0.15
#: average_socket_power is a ~1 s average (as the note on it says): one reading stands for a second
AVERAGE_SOCKET_POWER_S = 1.0


def _status(lib: ModuleType, exc: BaseException) -> str:
    """An amdsmi exception as its status name and the fix."""
    if isinstance(exc, lib.AmdSmiLibraryException):
        code = exc.get_error_code()
        name, fix = _STATUS.get(code, (f"error {code}", ""))
        return f"{name}; {fix}" if fix else name
    return f"{type(exc).__name__}: {exc}"


def amd_gpu_present(kfd: Path = Path("/dev/kfd")) -> bool:
    """Whether the amdgpu compute driver is here (its device node, which ROCm opens)."""
    return kfd.exists()


def import_amdsmi() -> ModuleType:
    """amdsmi, or IpwError naming the extra (and ROCm's library, which it loads at import)."""
    error = IpwError if amd_gpu_present() else Absent
    try:
        import amdsmi
    except ImportError as exc:
        raise error("amdsmi is not installed; install it with: pip install 'ipw[amd]'"
                    + ("" if error is IpwError else " (and no AMD GPU driver here: no /dev/kfd)")) from exc
    except OSError as exc:  # the wheel is pure Python: it dlopens libamd_smi.so from ROCm at import
        raise error(f"amdsmi cannot load ROCm's libamd_smi.so ({exc}); install ROCm or set ROCM_PATH") from exc
    module: ModuleType = amdsmi
    return module


def _index_list(name: str, value: str, count: int) -> list[int]:
    """The indices of one visibility variable, each below ``count``; parsing stops at the first entry that
    names no device (as CUDA's does).  UUIDs are refused: ipw does not map them (name the GPUs by index)."""
    out: list[int] = []
    for entry in (e.strip() for e in value.split(",")):
        if entry.startswith("GPU-"):
            raise IpwError(f"{name}={value}: {entry} is a UUID; ipw maps AMD GPUs by index only: name them by index")
        if not entry.isdigit() or int(entry) >= count or int(entry) in out:
            break
        out.append(int(entry))
    return out


def visible_amd_indices(count: int, env: dict[str, str] | None = None) -> list[int]:
    """amdsmi processor indices of the GPUs HIP would see, in HIP ordinal order: ``ROCR_VISIBLE_DEVICES``
    first, then ``HIP_VISIBLE_DEVICES`` (else ``CUDA_VISIBLE_DEVICES``) indexing into what it left."""
    env = dict(os.environ) if env is None else env
    visible = list(range(count))
    if "ROCR_VISIBLE_DEVICES" in env:
        visible = [visible[i] for i in _index_list("ROCR_VISIBLE_DEVICES", env["ROCR_VISIBLE_DEVICES"], len(visible))]
    hip = next((k for k in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES") if k in env), None)
    if hip is not None:
        visible = [visible[i] for i in _index_list(hip, env[hip], len(visible))]
    return visible


def select_amd_gpus(count: int, indices: list[int] | None) -> list[int]:
    """The amdsmi indices to measure: HIP ordinals ``indices`` (default: every visible GPU), honoring the
    visibility variables; IpwError for an ordinal that is not visible."""
    visible = visible_amd_indices(count)
    ordinals = list(range(len(visible))) if indices is None else list(indices)
    for o in ordinals:
        if not 0 <= o < len(visible):
            env = ", ".join(f"{k}={os.environ[k]}" for k in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                                                              "CUDA_VISIBLE_DEVICES") if k in os.environ)
            raise IpwError(f"AMD GPU {o} is not visible: {len(visible)} visible of {count} ({env or 'no visibility variable set'})")
    return [visible[o] for o in ordinals]


class AmdPlatform(Platform):
    name = "amdsmi"
    period_s = 0.1
    counter_step_s = 0.1  # not measured on hardware here: the poll period bounds what is resolved

    def __init__(self, amdsmi: ModuleType, indices: list[int] | None = None) -> None:
        self.lib = amdsmi
        try:
            amdsmi.amdsmi_init(amdsmi.AmdSmiInitFlags.INIT_AMD_GPUS)
        except amdsmi.AmdSmiException as exc:
            raise IpwError(f"amdsmi_init: {_status(amdsmi, exc)}") from exc
        try:
            every = list(amdsmi.amdsmi_get_processor_handles())
            try:
                self.amdsmi_indices = select_amd_gpus(len(every), indices)
            except IpwError:
                amdsmi.amdsmi_shut_down()
                raise
            self.handles = [every[i] for i in self.amdsmi_indices]
            self.ordinals = list(range(len(self.handles))) if indices is None else list(indices)
            self.names: list[str] = []
            self.power_key: dict[str, str] = {}
            self.channels = []
            for i, h in zip(self.ordinals, self.handles):
                comp = f"amd{i}"
                self.names.append(str(amdsmi.amdsmi_get_gpu_asic_info(h).get("market_name", "?")))
                try:
                    info = amdsmi.amdsmi_get_power_info(h)
                except amdsmi.AmdSmiException:
                    info = {}  # no power readings: the counter alone, noted
                key = next((k for k in ("current_socket_power", "average_socket_power")
                            if isinstance(info.get(k), int)), "")
                self.power_key[comp] = key
                try:
                    counter = self._counter_j(h) is not None
                except amdsmi.AmdSmiException:
                    counter = False  # e.g. AMDSMI_STATUS_NOT_SUPPORTED: the power alone, noted
                resolution_uj = self._resolution_uj(h) if counter else None
                note = "" if key != "average_socket_power" else \
                    "power is amdsmi's average_socket_power (~1 s average): short windows are smeared"
                self.channels.append(Channel(
                    comp, "gpu", "amdsmi", has_counter=counter, has_power=bool(key),
                    counter_range_j=(2 ** 32) * resolution_uj / 1e6 if resolution_uj else None,
                    tolerance=TOLERANCE, note=note,
                    power_average_s=AVERAGE_SOCKET_POWER_S if key == "average_socket_power" else 0.0,
                    counter_resolution_j=resolution_uj / 1e6 if resolution_uj else None))
        except amdsmi.AmdSmiException as exc:
            amdsmi.amdsmi_shut_down()
            raise IpwError(f"amdsmi device query: {_status(amdsmi, exc)}") from exc
        if not any(c.has_counter or c.has_power for c in self.channels):
            amdsmi.amdsmi_shut_down()
            if not self.channels:
                raise Absent("amdsmi: no AMD GPU found" if not every else
                             "amdsmi: no AMD GPU visible (ROCR_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)")
            raise IpwError("amdsmi: no GPU reports an energy counter or power")

    def _resolution_uj(self, h: Any) -> float | None:
        try:
            return float(self.lib.amdsmi_get_energy_count(h)["counter_resolution"])
        except (self.lib.AmdSmiException, KeyError):
            return None

    def _counter_j(self, h: Any) -> float | None:
        d = self.lib.amdsmi_get_energy_count(h)
        count = d["energy_accumulator"] if "energy_accumulator" in d else d.get("power")
        if not isinstance(count, (int, float)):
            return None
        return float(count) * float(d["counter_resolution"]) / 1e6

    def read(self) -> Poll:
        p = Poll()
        for h, c in zip(self.handles, self.channels):
            if c.has_counter:
                try:
                    j = self._counter_j(h)
                    if j is not None:
                        p.counter_j[c.component] = j
                except self.lib.AmdSmiException as exc:
                    p.errors[c.component] = f"amdsmi_get_energy_count: {_status(self.lib, exc)}"
            if c.has_power:
                try:
                    w = self.lib.amdsmi_get_power_info(h)[self.power_key[c.component]]
                    if isinstance(w, int):
                        p.power_w[c.component] = float(w)
                except self.lib.AmdSmiException as exc:
                    p.errors[c.component] = f"amdsmi_get_power_info: {_status(self.lib, exc)}"
        return p

    def describe(self) -> str:
        parts = [f"{c.component}: {n} ({'counter' if c.has_counter else 'no counter'}, "
                 f"{self.power_key[c.component] or 'no power'})" for c, n in zip(self.channels, self.names)]
        return "; ".join(parts) + f"; polled every {self.period_s:g} s, power scaled by the counter"

    def params(self) -> dict[str, Any]:
        return {"gpus": [{"component": c.component, "amdsmi_index": i, "name": n, "power_field": self.power_key[c.component]}
                         for c, n, i in zip(self.channels, self.names, self.amdsmi_indices)],
                "visible_devices": {k: os.environ.get(k) for k in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                                                                   "CUDA_VISIBLE_DEVICES")}}

    def close(self) -> None:
        self.lib.amdsmi_shut_down()


def probe(indices: list[int] | None = None, **kwargs: Any) -> PolledSensor:
    """The AMD sensor of the GPUs at HIP ordinals ``indices`` (default: every visible one); IpwError with
    the reason when amdsmi or an AMD GPU is missing or unreadable."""
    return PolledSensor(AmdPlatform(import_amdsmi(), indices), **kwargs)
