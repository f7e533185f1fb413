"""The rest of an NVIDIA superchip's module (Grace CPU, its memory, the C2C link) beside the GPU that
:class:`ipw.telemetry.nvml.NvmlSensor` measures: :func:`probe`.

On GH200, GB200 and GB10, NVML's instant-power field answers at module scope as well as GPU scope
(``nvmlDeviceGetFieldValues(h, [(NVML_FI_DEV_POWER_INSTANT, NVML_POWER_SCOPE_MODULE)])``; the same
probe as ml-energy/zeus zeus/device/gpu/nvidia.py ``_resolve_power_field_scope``); GPU-scope power
misses the module (ml-energy/zeus#242).  Where both scopes answer, this sensor reads them back to
back every 0.1 s and reports ``module<N>``: module power minus GPU power, integrated (scope
``module``, source ``nvml.module.power``), so that the run's total, gpu<N> (GPU scope, counter
calibrated) plus module<N>, is the whole module and nothing is counted twice.  Where only the module
scope answers (GPU-scope power not offered, as Zeus found on Grace Hopper), the module cannot be
separated from the GPU's counter: not measured, and ``ipw doctor`` says so.  On a discrete GPU (no
module scope) the sensor is absent: NvmlSensor's readings are GPU scope, as its ``info`` notes.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ipw.errors import IpwError
from ipw.telemetry.nvml import import_pynvml, probe_power_scopes, select_gpus
from ipw.telemetry.polled import Absent, Channel, Platform, Poll, PolledSensor


class ModulePlatform(Platform):
    name = "nvml_module"
    period_s = 0.1
    counter_step_s = 0.1  # the instant field updates about every 100 ms (doctor's self-test on the H200)

    def __init__(self, nvml: ModuleType, indices: list[int] | None = None) -> None:
        self.nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise Absent(f"no NVIDIA GPU readable through NVML ({exc})") from exc
        try:
            gpus = select_gpus(nvml, indices)
            scopes = {g.component: probe_power_scopes(nvml, g.handle) for g in gpus}
        except BaseException:
            nvml.nvmlShutdown()
            raise
        self.gpus = [g for g in gpus if scopes[g.component] == {"gpu": "ok", "module": "ok"}]
        self.scopes = scopes
        if not self.gpus:
            nvml.nvmlShutdown()
            only = [c for c, s in scopes.items() if s.get("module") == "ok"]
            if only:
                raise IpwError(f"module power scope on {', '.join(only)} but no GPU-scope power: the module cannot "
                               "be separated from the GPU's counter; not measured (GPU readings are GPU scope)")
            raise Absent("no module power scope (a discrete GPU, not a superchip): GPU readings are GPU scope"
                         if gpus else "no NVIDIA GPU visible")
        self.channels = [Channel(f"module{g.component.removeprefix('gpu')}", "module", "nvml.module",
                                 has_counter=False, has_power=True,
                                 note=f"module power minus {g.component}'s GPU power (NVML power scopes)")
                         for g in self.gpus]
        fid = nvml.NVML_FI_DEV_POWER_INSTANT
        self.ids = [(fid, nvml.NVML_POWER_SCOPE_MODULE), (fid, nvml.NVML_POWER_SCOPE_GPU)]

    def read(self) -> Poll:
        p = Poll()
        for g, c in zip(self.gpus, self.channels):
            try:
                module, gpu = self.nvml.nvmlDeviceGetFieldValues(g.handle, self.ids)
            except self.nvml.NVMLError as exc:
                p.errors[c.component] = str(exc)
                continue
            if module.nvmlReturn != self.nvml.NVML_SUCCESS or gpu.nvmlReturn != self.nvml.NVML_SUCCESS:
                p.errors[c.component] = f"field returns {module.nvmlReturn}, {gpu.nvmlReturn}"
                continue
            p.power_w[c.component] = max(0.0, (module.value.uiVal - gpu.value.uiVal) / 1000.0)
        return p

    def describe(self) -> str:
        return (", ".join(f"{c.component}: {g.name} module minus GPU" for g, c in zip(self.gpus, self.channels))
                + f"; instant power at module and GPU scope read every {self.period_s:g} s")

    def params(self) -> dict[str, Any]:
        return {"power_scopes": self.scopes}

    def close(self) -> None:
        self.nvml.nvmlShutdown()


def probe(indices: list[int] | None = None, **kwargs: Any) -> PolledSensor:
    """The module sensor; IpwError with the reason where there is no NVML or no superchip."""
    try:
        nvml = import_pynvml()
    except IpwError as exc:
        raise Absent(exc.message) from exc
    return PolledSensor(ModulePlatform(nvml, indices), **kwargs)
