"""What the NVML sampler (:mod:`ipw.telemetry.sampler`) keeps per GPU, and what one NVML call's answer or
failure means: the recorded columns, each signal's status, the call wrapper that classifies failures
(unsupported, lost, failing again and again), and the decoding of a sample-buffer answer.
"""

from __future__ import annotations

import bisect
import math
import time
from array import array
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Sequence

import numpy as np

#: Consecutive errors of one kind after which it is given up on (until the sampler restarts).
MAX_CONSECUTIVE_ERRORS = 5

KINDS = ("counter", "samples", "instant")


@dataclass
class GpuHandle:
    """What the sampler needs of one GPU (``ipw.telemetry.nvml.Gpu`` fits)."""

    component: str
    handle: Any


class Columns:
    """Append-only float64 columns (compact ``array('d')``); copied out as numpy arrays."""

    def __init__(self, n: int) -> None:
        self.cols = [array("d") for _ in range(n)]

    def __len__(self) -> int:
        return len(self.cols[0])

    def append(self, *values: float) -> None:
        for col, v in zip(self.cols, values):
            col.append(v)

    def extend(self, *values: Sequence[float]) -> None:
        for col, v in zip(self.cols, values):
            col.extend(v)

    def numpy(self, lo_t: float | None = None) -> list[np.ndarray]:
        """Copies of the columns, from the first row whose first column is >= ``lo_t``."""
        start = 0
        if lo_t is not None and len(self):
            start = bisect.bisect_left(self.cols[0], lo_t)
        return [np.array(col[start:], dtype=np.float64) for col in self.cols]

    def last(self) -> tuple[float, ...] | None:
        return tuple(col[-1] for col in self.cols) if len(self) else None


@dataclass
class KindState:
    """One signal of one GPU: whether it works, and its errors."""

    status: str = "unknown"  # unknown | ok | unsupported | failed
    error: str = ""
    error_value: int | None = None  # the NVML error code of the last failure
    consecutive_errors: int = 0
    errors: int = 0

    def field_error(self, nvml: ModuleType, ret: int) -> None:
        """An instant-power field value came back with the error ``ret``."""
        self.errors += 1
        self.error, self.error_value = f"field value error {ret}", ret
        if ret == getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3) and self.status in ("unknown", "ok"):
            self.status = "unsupported"
        else:
            self.consecutive_errors += 1
            if self.consecutive_errors >= MAX_CONSECUTIVE_ERRORS:
                self.status = "failed"


@dataclass
class GpuState:
    gpu: Any
    samples: Columns = field(default_factory=lambda: Columns(2))  # t_s (monotonic), W
    counter: Columns = field(default_factory=lambda: Columns(2))  # t_s (middle of the call), J
    instant: Columns = field(default_factory=lambda: Columns(2))  # t_s, W
    last_sample_ts_us: int = 0
    sample_gaps: int = 0
    idle_w: float = math.inf  # watched GPUs: lowest median of FOREIGN_IDLE_READS consecutive instant reads
    kinds: dict[str, KindState] = field(default_factory=lambda: {k: KindState() for k in KINDS})


def value_attr(nvml: ModuleType, value_type: int) -> str:
    """The member of an ``nvmlValue_t`` union that holds a value of ``value_type``."""
    names = {
        getattr(nvml, "NVML_VALUE_TYPE_DOUBLE", 0): "dVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_INT", 1): "uiVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_LONG", 2): "ulVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", 3): "ullVal",
        getattr(nvml, "NVML_VALUE_TYPE_SIGNED_LONG_LONG", 4): "sllVal",
        getattr(nvml, "NVML_VALUE_TYPE_SIGNED_INT", 5): "siVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_SHORT", 6): "usVal",
    }
    return names.get(value_type, "uiVal")


def call_nvml(nvml: ModuleType, st: KindState, kind: str, fn: Callable[[], Any]) -> tuple[Any, float | None]:
    """Run one NVML call of the signal ``kind`` whose state is ``st``: (its answer, None when it failed; the
    seconds it took when it counts as a call, else None).  A failure is counted in ``st``, and the kind is given
    up on when it cannot work: unsupported, or failing again and again.  A kind already given up on is not
    called."""
    if st.status in ("unsupported", "failed"):
        return None, None
    t0 = time.perf_counter()
    try:
        out = fn()
    except nvml.NVMLError as exc:
        took_s = time.perf_counter() - t0
        value = getattr(exc, "value", None)
        if kind == "samples" and value == getattr(nvml, "NVML_ERROR_NOT_FOUND", 6):
            st.status, st.consecutive_errors = "ok", 0  # no new samples since last_seen
            return [], took_s
        st.errors += 1
        st.consecutive_errors += 1
        st.error = f"{exc} (error {value})"
        st.error_value = value
        unsupported = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND")
        lost = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_UNINITIALIZED", "NVML_ERROR_RESET_REQUIRED")
        if st.status == "unknown" and any(value == getattr(nvml, c, None) for c in unsupported):
            st.status = "unsupported"
        elif any(value == getattr(nvml, c, None) for c in lost) or st.consecutive_errors >= MAX_CONSECUTIVE_ERRORS:
            st.status = "failed"
        return None, took_s
    except Exception as exc:  # a broken binding must not kill the thread
        st.errors += 1
        st.consecutive_errors += 1
        st.error = f"{type(exc).__name__}: {exc}"
        if st.consecutive_errors >= MAX_CONSECUTIVE_ERRORS:
            st.status = "failed"
        return None, None
    took_s = time.perf_counter() - t0
    st.status, st.consecutive_errors = "ok", 0
    return out, took_s


def decode_samples(nvml: ModuleType, answer: Any, last_ts_us: int) -> tuple[np.ndarray, np.ndarray]:
    """The samples of a ``nvmlDeviceGetSamples`` answer ``(value type, samples)`` newer than ``last_ts_us``:
    (driver timestamps in wall-clock µs, int64; power in mW), sorted by time."""
    value_type, samples = answer
    attr = value_attr(nvml, value_type)
    ts = np.fromiter((int(s.timeStamp) for s in samples), dtype=np.int64, count=len(samples))
    mw = np.fromiter((float(getattr(s.sampleValue, attr)) for s in samples), dtype=np.float64, count=len(samples))
    keep = ts > last_ts_us
    ts, mw = ts[keep], mw[keep]
    order = np.argsort(ts, kind="stable")
    return ts[order], mw[order]
