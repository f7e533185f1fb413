"""Fakes of each platform's library that replay a sensor trace (``ipw doctor --record-trace``,
``ipw/telemetry/recording.py``) at the time of a clock.

NVML: a trace's ``nvml`` entry becomes the ``Signals`` that tests/nvml_fakes.py's autospec'd pynvml
answers from, so a trace recorded on a real GPU replays through the same fake as the npz recordings.
"""

from __future__ import annotations

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


def scoped_fields(fake: Any, *, gpu_scope: bool = True, module_mw: int | None = None) -> None:
    """Make the NVML fake's ``nvmlDeviceGetFieldValues`` answer scoped ids ``(field, scope)`` as the
    real binding does (pynvml.py sets ``scopeId`` from a tuple): GPU scope answers as before (or
    ``NVML_ERROR_NOT_SUPPORTED`` in the field when ``gpu_scope`` is false, as on a GH200 per
    ml-energy/zeus zeus/device/gpu/nvidia.py ``_resolve_power_field_scope``); module scope answers
    ``module_mw``, or ``NOT_SUPPORTED`` in the field when None (a discrete GPU)."""
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
                out[k].value.uiVal = int(module_mw)
                out[k].nvmlReturn = real.NVML_SUCCESS
            else:
                out[k].nvmlReturn = real.NVML_ERROR_NOT_SUPPORTED
        return out

    fake.nvmlDeviceGetFieldValues.side_effect = fields
