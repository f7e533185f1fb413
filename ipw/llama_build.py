"""Which llama.cpp build suits this CPU, and the cache key of its wheel.

llama-cpp-python compiles llama.cpp from source.  A build carries the instruction sets it was compiled
for, and a CPU without one of them dies with SIGILL ("Illegal instruction") the first time it runs
that code.  ipw builds for the CPU it runs on, with every ggml instruction-set option set explicitly
from the CPU's own flags (``/proc/cpuinfo``), and never with AMX: some Intel CPUs advertise AMX in
cpuid without the kernel enabling it, and the AMX path then dies.  The wheel cache is keyed by the
llama-cpp-python version, the Python tag, the machine and that option set, so a wheel built for
another CPU (or other flags) is never reused.

Standard library only: ``.ci/setup`` runs it as a script before any virtual environment exists::

    python3 ipw/llama_build.py cmake-args [--cuda ARCH]   # the CMAKE_ARGS for this machine
    python3 ipw/llama_build.py key [--cuda ARCH]          # the cache key of its wheel
    python3 ipw/llama_build.py variant                    # e.g. x86-64+avx2+fma+f16c+bmi2
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path

# ggml's x86 options in the order of its CMakeLists, each with the /proc/cpuinfo flags it needs.
# GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw.
X86_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512vbmi")),
    ("GGML_AVX512_VNNI", ("avx512f", "avx512_vnni")),
    ("GGML_AVX512_BF16", ("avx512f", "avx512_bf16")),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
)
# Never: a CPU may advertise AMX that the kernel has not enabled (SIGILL in the AMX path).
ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16", "GGML_NATIVE", "LLAVA_BUILD")


# The CPU features llama.cpp reports as compiled in (``llama_print_system_info``: "AVX2 = 1 | ...") and
# the /proc/cpuinfo flag each one needs.
SYSTEM_INFO_FLAGS = {
    "SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX_VNNI": "avx_vnni", "AVX2": "avx2", "F16C": "f16c",
    "FMA": "fma", "BMI2": "bmi2", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
    "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8",
}


def compiled_features(system_info: str) -> list[str]:
    """The instruction sets a llama.cpp build was compiled for, from its system info string."""
    found = []
    for item in system_info.replace("|", "\n").splitlines():
        name, _, value = item.rpartition("=")
        name = name.split(":")[-1].strip()
        if name in SYSTEM_INFO_FLAGS and value.strip() == "1" and name not in found:
            found.append(name)
    return found


def missing_features(system_info: str, flags: frozenset[str]) -> list[str]:
    """Instruction sets the build uses that this CPU lacks (empty when the CPU's flags are unknown)."""
    if not flags:
        return []
    return [f for f in compiled_features(system_info) if SYSTEM_INFO_FLAGS[f] not in flags]


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


def enabled_options(flags: frozenset[str], machine: str | None = None) -> list[str]:
    """The ggml instruction-set options this CPU can run (x86-64 only; other machines: none, so that
    ggml's own defaults for that architecture apply)."""
    machine = machine or platform.machine()
    if machine not in ("x86_64", "AMD64"):
        return []
    return [name for name, needs in X86_OPTIONS if all(f in flags for f in needs)]


def cmake_args(flags: frozenset[str], machine: str | None = None, cuda_arch: str | None = None) -> str:
    """CMAKE_ARGS for llama-cpp-python: every x86 option explicitly ON or OFF, AMX and native off."""
    machine = machine or platform.machine()
    args = []
    if machine in ("x86_64", "AMD64"):
        on = set(enabled_options(flags, machine))
        args += [f"-D{name}={'ON' if name in on else 'OFF'}" for name, _ in X86_OPTIONS]
    args += [f"-D{name}=OFF" for name in ALWAYS_OFF]
    if cuda_arch:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}"]
    return " ".join(args)


def variant(flags: frozenset[str], machine: str | None = None, cuda_arch: str | None = None) -> str:
    """A short human name of the build, e.g. ``x86_64+sse42+avx+avx2+bmi2+fma+f16c`` (+``cuda90``)."""
    machine = machine or platform.machine()
    parts = [machine] + [name.removeprefix("GGML_").lower() for name in enabled_options(flags, machine)]
    if cuda_arch:
        parts.append(f"cuda{cuda_arch}")
    return "+".join(parts)


def cache_key(version: str, flags: frozenset[str], machine: str | None = None, cuda_arch: str | None = None,
              python_tag: str | None = None) -> str:
    """The wheel cache's folder name: version, Python, and a digest of the exact CMAKE_ARGS."""
    python_tag = python_tag or f"cp{sys.version_info[0]}{sys.version_info[1]}"
    args = cmake_args(flags, machine, cuda_arch)
    digest = hashlib.sha256(f"{version}\n{python_tag}\n{machine or platform.machine()}\n{args}".encode()).hexdigest()
    return f"{version}-{python_tag}-{variant(flags, machine, cuda_arch).replace('+', '-')}-{digest[:12]}"


def _main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("cmake-args", "key", "variant"):
        print(__doc__, file=sys.stderr)
        return 2
    cuda = argv[argv.index("--cuda") + 1] if "--cuda" in argv else None
    version = argv[argv.index("--version") + 1] if "--version" in argv else "0"
    flags = cpu_flags()
    if argv[0] == "cmake-args":
        print(cmake_args(flags, cuda_arch=cuda))
    elif argv[0] == "key":
        print(cache_key(version, flags, cuda_arch=cuda))
    else:
        print(variant(flags, cuda_arch=cuda))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
