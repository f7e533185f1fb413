"""Which instruction sets this CPU runs: its feature flags (``/proc/cpuinfo``) and the x86 instruction-set
levels they allow.  A hardware fact, read by the hardware fingerprint (``cpu_isa``) and by the llama.cpp
build (``ipw/backends/llama_build.py`` names its ggml options after these levels), so that telemetry never imports
the engine's build helper (issue 57).

Standard library only: ``ipw/backends/llama_build.py`` imports it when ``.ci/setup`` runs that as a script, before
any virtual environment exists.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# The x86 instruction-set levels, in the order of ggml's CMakeLists (its options are GGML_<NAME>), each with
# the /proc/cpuinfo flags it needs.  avx512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw.
X86_ISAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sse42", ("sse4_2",)),
    ("avx", ("avx",)),
    ("avx_vnni", ("avx_vnni",)),
    ("avx2", ("avx2",)),
    ("bmi2", ("bmi2",)),
    ("avx512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("avx512_vbmi", ("avx512f", "avx512vbmi")),
    ("avx512_vnni", ("avx512f", "avx512_vnni")),
    ("avx512_bf16", ("avx512f", "avx512_bf16")),
    ("fma", ("fma",)),
    ("f16c", ("f16c",)),
)
X86_MACHINES = ("x86_64", "AMD64")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (the first ``flags`` line of /proc/cpuinfo, or of the file named by
    ``$IPW_CPUINFO``, which tests use to play another CPU); empty when unknown."""
    if cpuinfo is None:
        try:
            cpuinfo = Path(os.environ.get("IPW_CPUINFO") or "/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def usable_isas(flags: frozenset[str], machine: str | None = None) -> list[str]:
    """The x86 instruction-set levels of ``X86_ISAS`` that ``flags`` allow (other machines: none)."""
    if (machine or platform.machine()) not in X86_MACHINES:
        return []
    return [name for name, needs in X86_ISAS if all(f in flags for f in needs)]


def isa_name(flags: frozenset[str], machine: str | None = None) -> str:
    """The machine and its usable levels, e.g. ``x86_64+sse42+avx+avx2+bmi2+fma+f16c``."""
    machine = machine or platform.machine()
    return "+".join([machine, *usable_isas(flags, machine)])
