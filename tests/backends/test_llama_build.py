"""The llama.cpp build for a CPU (ipw/backends/llama_build.py): flags from /proc/cpuinfo, AMX never, and a wheel
cache key that differs between CPUs, so a wheel built for another machine is never reused."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ipw.backends.llama_build import cache_key, cmake_args, compiled_features, missing_features, variant
from ipw.telemetry.cpu_isa import cpu_flags

ROOT = Path(__file__).resolve().parents[2]
AVX2_EPYC = "fpu sse sse2 ssse3 sse4_1 sse4_2 pni fma avx f16c avx2 bmi1 bmi2 popcnt aes"  # an AVX2-only EPYC
SAPPHIRE = (AVX2_EPYC + " avx_vnni avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi avx512_vnni avx512_bf16"
            " amx_tile amx_int8 amx_bf16")  # AVX-512 and AMX advertised
INFO_AVX512 = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
               "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |")


def _flags(text: str) -> frozenset[str]:
    return cpu_flags(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {text}\n")


def test_flags_are_explicit_and_amx_never():
    args = cmake_args(_flags(AVX2_EPYC), "x86_64").split()
    assert "-DGGML_AVX2=ON" in args and "-DGGML_FMA=ON" in args and "-DGGML_AVX512=OFF" in args
    assert "-DGGML_AVX512_VNNI=OFF" in args and "-DGGML_AVX_VNNI=OFF" in args and "-DGGML_NATIVE=OFF" in args
    sapphire = cmake_args(_flags(SAPPHIRE), "x86_64").split()
    assert "-DGGML_AVX512=ON" in sapphire and "-DGGML_AVX512_BF16=ON" in sapphire
    for amx in ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"):
        assert amx in sapphire  # advertised is not usable: never built in
    assert not any("AMX" in a and a.endswith("=ON") for a in sapphire)
    assert "-DGGML_CUDA=ON" in cmake_args(_flags(AVX2_EPYC), "x86_64", "90").split()
    # AVX512 needs all five of its subsets: a CPU with only avx512f does not get it
    assert "-DGGML_AVX512=OFF" in cmake_args(_flags(AVX2_EPYC + " avx512f"), "x86_64").split()


def test_cache_key_differs_between_cpus_and_builds():
    avx2, avx512 = _flags(AVX2_EPYC), _flags(SAPPHIRE)
    key = cache_key("0.3.36", avx2, "x86_64", python_tag="cp311")
    assert key.startswith("0.3.36-cp311-x86_64-") and "avx2" in key and "avx512" not in key
    assert key != cache_key("0.3.36", avx512, "x86_64", python_tag="cp311")  # a foreign CPU's wheel
    assert key != cache_key("0.3.36", avx2, "x86_64", "90", python_tag="cp311")  # CUDA is another build
    assert key != cache_key("0.3.37", avx2, "x86_64", python_tag="cp311")
    assert key == cache_key("0.3.36", avx2, "x86_64", python_tag="cp311")  # stable on the same CPU
    assert variant(avx2, "x86_64") == "x86_64+sse42+avx+avx2+bmi2+fma+f16c"


def test_a_build_for_another_cpu_is_recognised():
    assert compiled_features(INFO_AVX512)[:4] == ["SSE3", "SSSE3", "AVX", "AVX2"]
    assert missing_features(INFO_AVX512, _flags(SAPPHIRE)) == []
    assert missing_features(INFO_AVX512, _flags(AVX2_EPYC)) == ["AVX512", "AVX512_VBMI", "AVX512_VNNI",
                                                                "AVX512_BF16"]
    assert missing_features(INFO_AVX512, frozenset()) == []  # flags unknown: no verdict


def test_script_reads_the_cpu_named_by_ipw_cpuinfo(tmp_path):
    """`.ci/setup` asks the script for the key: another CPU's /proc/cpuinfo gives another key."""
    fake = tmp_path / "cpuinfo"
    fake.write_text(f"flags\t\t: {AVX2_EPYC}\n")
    run = lambda *a, env=None: subprocess.run([sys.executable, str(ROOT / "ipw" / "backends" / "llama_build.py"), *a],  # noqa: E731
                                              capture_output=True, text=True, check=True, env=env).stdout.strip()
    import os

    mine = run("key", "--version", "0.3.36")
    theirs = run("key", "--version", "0.3.36", env={**os.environ, "IPW_CPUINFO": str(fake)})
    if "avx512" in mine:
        assert mine != theirs
    assert "avx512" not in theirs and "-DGGML_AVX512=OFF" in run("cmake-args", env={**os.environ,
                                                                                   "IPW_CPUINFO": str(fake)})


# -- llama-server, built in the wheel's build tree (one compilation) -------------------------------------

CHANGELOG = """# Changelog

## [Unreleased]

## [0.3.36]

- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098
- fix: something

## [0.3.35]

- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f
"""

LDD = """\tlinux-vdso.so.1 (0x00007f1ae48f3000)
\tlibllama-server-impl.so => /tmp/b/bin/libllama-server-impl.so (0x00007f1ae4400000)
\tlibstdc++.so.6 => /lib/x86_64-linux-gnu/libstdc++.so.6 (0x00007f1ae4000000)
\tlibcudart.so.12 => not found
\t/lib64/ld-linux-x86-64.so.2 (0x00007f1ae48f5000)
"""


def test_the_server_is_built_with_the_wheels_flags_and_no_others():
    """The server's build adds the tools folder to the wheel's tree and nothing that changes how ggml,
    llama or common compile: no instruction set, no AMX, no build type."""
    from ipw.backends.llama_build import SERVER_ARGS

    assert "-DLLAMA_BUILD_SERVER=ON" in SERVER_ARGS and "-DLLAMA_BUILD_TOOLS=ON" in SERVER_ARGS
    assert not any(a.startswith(("-DGGML_", "-DCMAKE_C", "-DCMAKE_BUILD_TYPE", "-DBUILD_SHARED")) for a in SERVER_ARGS)
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in SERVER_ARGS  # no download from Hugging Face while building


def test_pinned_commit_and_ldd_and_run_paths():
    from ipw.backends.llama_build import parse_ldd, pinned_commit, relocated_runpath

    assert pinned_commit(CHANGELOG, "0.3.36") == "0c1e57098"
    assert pinned_commit(CHANGELOG, "0.3.35") == "4df29be4f"
    assert pinned_commit(CHANGELOG, "0.3.3") is None and pinned_commit("", "0.3.36") is None
    assert parse_ldd(LDD) == {"libllama-server-impl.so": "/tmp/b/bin/libllama-server-impl.so",
                              "libstdc++.so.6": "/lib/x86_64-linux-gnu/libstdc++.so.6", "libcudart.so.12": None}
    # the build tree's folders and empty entries (the working directory) go, other folders stay, in order
    old = "$ORIGIN/../lib/llama-server:/tmp/b/bin:/usr/local/cuda/lib64:/tmp/b/ggml/src:"
    assert relocated_runpath(old, "/tmp/b", "$ORIGIN") == "$ORIGIN:/usr/local/cuda/lib64"
    assert relocated_runpath("/tmp/b/bin:", "/tmp/b", "$ORIGIN") == "$ORIGIN"
    new = relocated_runpath(old, "/tmp/b", "$ORIGIN/../lib/llama-server")
    assert new == "$ORIGIN/../lib/llama-server:/usr/local/cuda/lib64" and len(new) <= len(old)


@pytest.mark.skipif(not all(shutil.which(t) for t in ("cc", "cmake", "readelf", "ldd")),
                    reason="needs cc, cmake, readelf and ldd")
def test_bundle_server_copies_the_build_trees_libraries_and_makes_it_relocatable(tmp_path):
    """A tree as the set-up leaves it (an executable linking a library of the tree, by a build run path
    with room for the bundle's), bundled: the copy loads its library from lib/llama-server beside it, not
    from the tree, and keeps running once the tree is gone."""
    from ipw.backends.llama_build import SERVER_LIB_DIR, bundle_server

    build = tmp_path / "build"
    (build / "bin").mkdir(parents=True)
    (tmp_path / "f.c").write_text("int f(void) { return 42; }\n")
    (tmp_path / "m.c").write_text('#include <stdio.h>\nint f(void);\nint main(void) { printf("%d\\n", f()); }\n')
    lib = build / "bin" / "libf.so.0"
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libf.so.0", "-o", lib, tmp_path / "f.c"], check=True)
    (build / "bin" / "libf.so").symlink_to("libf.so.0")
    subprocess.run(["cc", "-o", build / "bin" / "llama-server", tmp_path / "m.c", "-L", build / "bin", "-lf",
                    f"-Wl,-rpath,$ORIGIN/../{SERVER_LIB_DIR}:{build / 'bin'}:", "-Wl,--enable-new-dtags"], check=True)
    out = tmp_path / "cache" / "server"
    assert bundle_server(build, out) == ["libf.so.0"]
    shutil.rmtree(build)
    exe = out / "bin" / "llama-server"
    assert subprocess.run([exe], capture_output=True, text=True, check=True).stdout == "42\n"
    assert sorted(p.name for p in (out / SERVER_LIB_DIR).iterdir()) == ["libf.so.0"]
    elf = subprocess.run(["readelf", "-d", exe], capture_output=True, text=True, check=True).stdout
    assert f"[$ORIGIN/../{SERVER_LIB_DIR}]" in elf and str(build) not in elf
    moved = tmp_path / "venv"  # the venv's copy: bin/ and lib/llama-server/ under another prefix
    shutil.copytree(out, moved)
    assert subprocess.run([moved / "bin" / "llama-server"], capture_output=True, text=True).stdout == "42\n"
