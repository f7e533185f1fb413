"""Which llama.cpp build suits this CPU, and the cache key of its wheel.

llama-cpp-python compiles llama.cpp from source.  A build carries the instruction sets it was compiled
for, and a CPU without one of them dies with SIGILL ("Illegal instruction") the first time it runs
that code.  ipw builds for the CPU it runs on, with every ggml instruction-set option set explicitly
from the CPU's own flags (``/proc/cpuinfo``), and never with AMX: some Intel CPUs advertise AMX in
cpuid without the kernel enabling it, and the AMX path then dies.  The wheel cache is keyed by the
llama-cpp-python version, the Python tag, the machine and that option set, so a wheel built for
another CPU (or other flags) is never reused.

llama.cpp is compiled once for both of ipw's uses of it: the wheel is built with its build tree kept,
then ``llama-server`` is built in that same tree (``SERVER_ARGS`` turn the tools folder on; nothing of
ggml, llama or common compiles again), and ``bundle-server`` copies it out with the shared libraries of
that build it links (libllama, libggml*, libllama-common, libmtmd, libllama-server-impl), their run paths
made relative (``$ORIGIN``), so the binary runs from ``<prefix>/bin`` with ``<prefix>/lib/llama-server``
beside it, wherever that prefix is.

Standard library only (as is ``ipw/telemetry/cpu_isa.py``, the CPU's flags and instruction-set levels, which it
imports): ``.ci/setup`` runs it as a script before any virtual environment exists::

    python3 ipw/backends/llama_build.py cmake-args [--cuda ARCH]   # the CMAKE_ARGS for this machine
    python3 ipw/backends/llama_build.py key [--cuda ARCH]          # the cache key of its wheel and llama-server
    python3 ipw/backends/llama_build.py variant                    # e.g. x86-64+avx2+fma+f16c+bmi2
    python3 ipw/backends/llama_build.py server-args                # added to the wheel's build tree for llama-server
    python3 ipw/backends/llama_build.py commit --version V CHANGELOG.md   # the llama.cpp commit that V pins
    python3 ipw/backends/llama_build.py bundle-server BUILD OUT [--cmake CMAKE]   # OUT/bin/llama-server + OUT/lib/llama-server
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

if not __package__:  # run as a script (.ci/setup, before any environment): the ipw package is one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ipw.telemetry.cpu_isa import X86_ISAS, X86_MACHINES, cpu_flags, isa_name, usable_isas

# ggml's x86 options (in the order of its CMakeLists): GGML_<NAME> for each instruction-set level of the CPU
# (ipw/telemetry/cpu_isa.py), with the /proc/cpuinfo flags it needs.
X86_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = tuple((f"GGML_{name.upper()}", needs) for name, needs in X86_ISAS)
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


def enabled_options(flags: frozenset[str], machine: str | None = None) -> list[str]:
    """The ggml instruction-set options this CPU can run (x86-64 only; other machines: none, so that
    ggml's own defaults for that architecture apply)."""
    return [f"GGML_{name.upper()}" for name in usable_isas(flags, machine)]


def cmake_args(flags: frozenset[str], machine: str | None = None, cuda_arch: str | None = None) -> str:
    """CMAKE_ARGS for llama-cpp-python: every x86 option explicitly ON or OFF, AMX and native off."""
    machine = machine or platform.machine()
    args = []
    if machine in X86_MACHINES:
        on = set(enabled_options(flags, machine))
        args += [f"-D{name}={'ON' if name in on else 'OFF'}" for name, _ in X86_OPTIONS]
    args += [f"-D{name}=OFF" for name in ALWAYS_OFF]
    if cuda_arch:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}"]
    return " ".join(args)


def variant(flags: frozenset[str], machine: str | None = None, cuda_arch: str | None = None) -> str:
    """A short human name of the build, e.g. ``x86_64+sse42+avx+avx2+bmi2+fma+f16c`` (+``cuda90``)."""
    return isa_name(flags, machine) + (f"+cuda{cuda_arch}" if cuda_arch else "")


def cache_key(version: str, flags: frozenset[str], machine: str | None = None, cuda_arch: str | None = None,
              python_tag: str | None = None) -> str:
    """The wheel cache's folder name: version, Python, and a digest of the exact CMAKE_ARGS."""
    python_tag = python_tag or f"cp{sys.version_info[0]}{sys.version_info[1]}"
    args = cmake_args(flags, machine, cuda_arch)
    digest = hashlib.sha256(f"{version}\n{python_tag}\n{machine or platform.machine()}\n{args}".encode()).hexdigest()
    return f"{version}-{python_tag}-{variant(flags, machine, cuda_arch).replace('+', '-')}-{digest[:12]}"


# -- llama-server from the wheel's build tree ------------------------------------------------------------

SERVER_LIB_DIR = "lib/llama-server"  # the server's shared libraries, relative to the prefix of its bin/
# Added (cmake -S SRC -B BUILD ...) to the build tree the wheel was compiled in, then only the target
# llama-server is built.  llama.cpp embedded in llama-cpp-python leaves its tools out by default; its web
# UI is left out too (ipw only speaks to the server's API, and the UI would be fetched from Hugging Face
# at build time: a build that needs no network, and the same binary with or without one).  The build run
# path gets the bundle's own in front, so that bundle-server's rewrite (in place: never longer) fits
# whatever the build folder's name; it changes links only, no compilation.
SERVER_ARGS = ("-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_USE_PREBUILT_UI=OFF",
               f"-DCMAKE_BUILD_RPATH=$ORIGIN/../{SERVER_LIB_DIR}")


def pinned_commit(changelog: str, version: str) -> str | None:
    """The llama.cpp commit that llama-cpp-python ``version`` vendors, from its CHANGELOG.md (``## [V]``
    then ``llama.cpp@<hash>``); None when the changelog does not say."""
    section = re.search(rf"^## \[{re.escape(version)}\]\s*$(.*?)(?=^## \[|\Z)", changelog, re.M | re.S)
    found = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section.group(1)) if section else None
    return found.group(1) if found else None


def parse_ldd(text: str) -> dict[str, str | None]:
    """``ldd``'s answer as {needed name: resolved path, or None when not found} (the vDSO and the loader
    itself, which have no ``=>`` to a file, left out)."""
    found: dict[str, str | None] = {}
    for line in text.splitlines():
        name, arrow, rest = line.strip().partition(" => ")
        if not arrow:
            continue
        target = rest.strip()
        found[name.strip()] = None if target.startswith("not found") else target.rsplit(" (", 1)[0].strip() or None
    return found


def relocated_runpath(runpath: str, build: str | Path, origin: str) -> str:
    """A run path with the build tree's folders (and empty entries, which mean the working directory)
    replaced by ``origin``, once, in front; other folders (e.g. CUDA's) are kept, in their order."""
    root = Path(build).resolve()
    kept = []
    for entry in runpath.split(":"):
        if not entry or entry.startswith("$ORIGIN") or Path(entry).resolve().is_relative_to(root):
            continue
        if entry not in kept:
            kept.append(entry)
    return ":".join([origin, *kept])


def _runpath(path: Path) -> str | None:
    """The DT_RUNPATH (or DT_RPATH) of an ELF file, by ``readelf -d``; None when it has none."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    found = re.search(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*)\]", out)
    return found.group(1) if found else None


def _ldd(path: Path) -> dict[str, str | None]:
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    return parse_ldd(subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=True, env=env).stdout)


def bundle_server(build: Path, out: Path, cmake: str = "cmake") -> list[str]:
    """Copy ``build``'s ``bin/llama-server`` to ``out/bin`` and every shared library of the build tree it
    loads to ``out/lib/llama-server``, each run path rewritten (``cmake -P``: file(RPATH_SET)) from the
    build tree's folders to ``$ORIGIN``; then check that the copy loads nothing from the build tree.
    Returns the libraries' names."""
    build, out = build.resolve(), out.resolve()
    exe = build / "bin" / "llama-server"
    deps = _ldd(exe)
    missing = sorted(name for name, path in deps.items() if path is None)
    if missing:  # not the build tree's (its run path would find those): e.g. the CUDA driver on a machine without
        print(f"bundle-server: not on this machine, left to the one that runs it: {', '.join(missing)}",
              file=sys.stderr)
    ours = {name: Path(path) for name, path in deps.items()
            if path and Path(path).resolve().is_relative_to(build)}
    (out / "bin").mkdir(parents=True, exist_ok=True)
    libdir = out / SERVER_LIB_DIR
    libdir.mkdir(parents=True, exist_ok=True)
    files = {out / "bin" / "llama-server": exe}
    files.update({libdir / name: path for name, path in ours.items()})
    script = out / "rpath.cmake"
    script.write_text('file(RPATH_SET FILE "${F}" NEW_RPATH "${R}")\n')
    for dest, src in files.items():
        shutil.copyfile(src.resolve(), dest)
        dest.chmod(0o755 if dest.parent.name == "bin" else 0o644)
        old = _runpath(dest)
        if old is None:
            continue  # no run path: it loads nothing of the build tree by one
        origin = "$ORIGIN/../" + SERVER_LIB_DIR if dest.parent.name == "bin" else "$ORIGIN"
        new = relocated_runpath(old, build, origin)
        if new != old:
            subprocess.run([cmake, f"-DF={dest}", f"-DR={new}", "-P", str(script)], check=True,
                           stdout=subprocess.DEVNULL)
    script.unlink()
    for dest in files:
        for name, path in _ldd(dest).items():
            if (name in ours and (path is None or Path(path).resolve().parent != libdir)) or (
                    path is not None and Path(path).resolve().is_relative_to(build)):
                raise SystemExit(f"bundle-server: {dest} loads {name} from {path}, not from {libdir}")
    return sorted(ours)


def _main(argv: list[str]) -> int:
    commands = ("cmake-args", "key", "variant", "server-args", "commit", "bundle-server")
    if not argv or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    cuda = argv[argv.index("--cuda") + 1] if "--cuda" in argv else None
    version = argv[argv.index("--version") + 1] if "--version" in argv else "0"
    flags = cpu_flags()
    if argv[0] == "cmake-args":
        print(cmake_args(flags, cuda_arch=cuda))
    elif argv[0] == "key":
        print(cache_key(version, flags, cuda_arch=cuda))
    elif argv[0] == "server-args":
        print(" ".join(SERVER_ARGS))
    elif argv[0] == "commit":
        print(pinned_commit(Path(argv[-1]).read_text(errors="replace"), version) or "unknown")
    elif argv[0] == "bundle-server":
        cmake = argv[argv.index("--cmake") + 1] if "--cmake" in argv else "cmake"
        print(" ".join(bundle_server(Path(argv[1]), Path(argv[2]), cmake)))
    else:
        print(variant(flags, cuda_arch=cuda))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
