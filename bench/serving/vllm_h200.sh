#!/usr/bin/env bash
# vLLM (the CUDA build) on an NVIDIA GPU machine without a package index (issue 41): the smallest set of
# wheels beside the machine's torch 2.11.0 + transformers 5.x that imports `vllm.LLM`, runs the OpenAI server
# ipw manages (python -m vllm.entrypoints.openai.api_server) and ipw's GGUF conversion (gguf, accelerate).
# vllm 0.26.0 pins torch==2.11.0 (as do 0.20.2-0.25.x); its wheel (290 MiB) is slimmed by `pack` to what a
# dense model on Hopper runs (FA3, no FA2/MoE/MLA/DeepGEMM/Rust-frontend binaries: PRUNE below; FULL=1 keeps all).
#
#   bash bench/serving/vllm_h200.sh download DEST      # here (an index): DEST/wheels/*.whl + DEST/wheels/wheels.sha256
#   bash bench/serving/vllm_h200.sh pack DEST          # here (~3 min): DEST/v1, v2, ... (one device call's carry each, <= 40 MiB)
#                                              # and DEST/README (folders, sizes, the package set)
#   bash bench/serving/vllm_h200.sh stash DIR...       # copy DIR's pieces to $W/parts (checked against parts.sha256)
#   bash bench/serving/vllm_h200.sh install [DIR...]   # reassemble, pip install --no-index --no-deps --target $W/site,
#                                              # import check (one line per missing module)
#   bash bench/serving/vllm_h200.sh check              # PYTHONPATH=$W/site: versions, CUDA, from vllm import LLM
#   bash bench/serving/vllm_h200.sh generate MODEL_DIR  # the engine on the GPU: MODEL_DIR's config and tokenizer, random
#                                              # weights (load_format dummy), 64 prompts x 64 tokens
#
#   bash bench/serving/vllm_h200.sh run sweep|rest|more|killed OUT # `ipw run configs/gpu-vllm.toml` with the NVML counter of
#                                              # bench/telemetry/gpu_counter.py:
#                                              # sweep: vLLM's server and llama-server at 1/4/16/64 (one run folder);
#                                              # rest: vLLM in process, 128 identical requests at 16 and 64, a server
#                                              # killed mid-run, a GPU without the memory asked for;
#                                              # more: vLLM in process at 16 and 64 over 3 repeats, the GPU without
#                                              # the memory, vLLM's server with CUDA graphs (enforce_eager = false)
#                                              # at 1/4/16/64; killed: only the server killed mid-run (issue 55: the
#                                              # run must exit); OUT/vllm-PART.md, .tar.xz and the counter
#                                              # (DEADLINE: epoch seconds the stage must end by)
#
# The pieces: .gpufiles/vllm/v1, v2, v3 (87.5 MiB: tar+xz of the wheels, uncompressed inside; PIECE_MIB=30 each;
# .gpufiles/vllm/README) and .gpufiles/a, b, c (llama-server's sources and the bundled GGUF: bench/serving/serving_h200.sh
# pack).  Each call carries the checkout too, 64 MiB in all: ~25 MiB with bench/evidence/, ~3 MiB with it (the raw
# result folders) moved aside, so one folder a call, or two.  $W (/tmp/ipw-vllm) and /tmp/ipw-serving survive
# between calls while the machine is warm (~30 s after a call), so the calls follow each other at once.
# The run of 2026-12-04 (bench/evidence/serving/vllm-h200-2026-12-04/), its raw result folders moved aside, 4 calls:
#
# call 1, carry [".gpufiles/vllm/v1", ".gpufiles/vllm/v3"] (seconds):
#   bash bench/serving/vllm_h200.sh stash .gpufiles/vllm/v1 .gpufiles/vllm/v3
# call 2, carry [".gpufiles/a", ".gpufiles/c"] (~6 min: llama-server with CUDA):
#   bash bench/serving/serving_h200.sh build .gpufiles/a .gpufiles/c
# call 3, carry [".gpufiles/vllm/v2", ".gpufiles/b"] (~8 min):
#   export DEADLINE=$(($(date +%s)+565)); bash bench/serving/serving_h200.sh stash .gpufiles/b && bash bench/serving/vllm_h200.sh install .gpufiles/vllm/v2 && bash bench/serving/vllm_h200.sh run sweep $OUT
# call 4, no carry (~9 min):
#   export DEADLINE=$(($(date +%s)+560)); bash bench/serving/vllm_h200.sh run rest $OUT
# From a full checkout (a clean `git archive`): stash v1, v3, c and b one call each, then calls 2 (carry a), 3
# (carry v2) and 4.  `check` and `generate .gpufiles/vllm/smol-cfg` (SmolLM2's config and tokenizer, random
# weights) try the engine without the model's pieces.  VLLM_USE_FLASHINFER_SAMPLER=0: vLLM's own top-k/top-p
# sampler (flashinfer is not carried); FA3 is the attention backend on Hopper.
#
# If a call says a piece is missing, the machine was handed back in between: start again at call 1.
# The machine's python3 (3.12) brings torch 2.11.0+cu130 (with triton), transformers 5.x and their deps: ASSUMED.
set -euo pipefail
stage=${1:-}
shift || true
W=${W:-/tmp/ipw-vllm}
PY=${PY:-python3}
args=()
for a in "$@"; do args+=("$(realpath -m "$a")"); done
cd "$(dirname "$0")/../.."  # the checkout: this file is bench/<question>/<script>.sh

# The set: vllm and what its import paths need (found one import error at a time), each pinned.
PKGS="vllm==0.26.0
accelerate==1.16.0 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7
annotated-types==0.8.0 apache-tvm-ffi==0.1.10 attrs==26.1.0 cachetools==8.0.2 cbor2==6.3.0
charset-normalizer==3.5.3 cloudpickle==3.1.3 einops==0.8.2 fastapi==0.136.3 frozenlist==1.8.0 gguf==0.19.0
httpx2==2.16.2 jmespath==1.1.0 llguidance==1.7.6 model-hosting-container-standards==0.1.16 msgspec==0.23.0
multidict==7.2.1 openai==3.60.0 openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 pillow==13.0.0
prometheus-client==0.26.0 prometheus-fastapi-instrumentator==8.1.0 propcache==0.5.4 py-cpuinfo==9.0.0
pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5 pyzmq==27.3.0 requests==2.34.2 sniffio==1.3.1
starlette==1.10.0 typing-inspection==0.4.5 urllib3==2.8.0 uvicorn==0.55.0 uvloop==0.23.0 watchfiles==1.3.0
xgrammar==0.2.7 yarl==1.25.1"
# their modules (install's import check), and the modules assumed on the machine already
MODS="vllm accelerate aiohappyeyeballs aiohttp aiosignal annotated_doc annotated_types tvm_ffi attr cachetools cbor2
charset_normalizer cloudpickle einops fastapi frozenlist gguf httpx2 jmespath llguidance
model_hosting_container_standards msgspec multidict openai openai_harmony partial_json_parser PIL prometheus_client
prometheus_fastapi_instrumentator propcache cpuinfo pybase64 pydantic pydantic_core zmq requests sniffio starlette
typing_inspection urllib3 uvicorn uvloop watchfiles xgrammar yarl"
ASSUMED="torch triton transformers huggingface_hub tokenizers safetensors regex yaml tqdm filelock numpy packaging
typing_extensions jinja2 fsspec httpx httpcore h11 anyio idna certifi click setuptools psutil pynvml"
# dropped from the vllm wheel: FA2 (Hopper runs FA3), MoE kernels, MLA, DeepGEMM/SM100 FMHA, the Rust frontend
PRUNE="vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/_flashmla_C.abi3.so
vllm/_flashmla_extension_C.abi3.so vllm/_qutlass_C.abi3.so vllm/vllm-rs vllm/third_party/deep_gemm/
vllm/third_party/fmha_sm100/"
PIECE=$((${PIECE_MIB:-30} * 1048576 - 8192))  # a piece with its parts.sha256 stays under PIECE_MIB (30) MiB

# shellcheck source=bench/serving/pieces.sh
source bench/serving/pieces.sh  # stash (the working directory is the repository root)

download() {  # here: the wheels for CPython 3.12 on manylinux x86_64, no dependency resolution
  local dest=$1 plats="" v
  # glibc up to 2.35 (the machine's Ubuntu has 2.39; llguidance needs 2_31, vllm 2_28)
  for v in 2_35 2_34 2_31 2_28 2_27 2_26 2_24 2_17 2014 2_12 2010 2_5 1; do plats+=" --platform manylinux${v/#2_/_2_}_x86_64"; done
  mkdir -p "$dest/wheels"
  # shellcheck disable=SC2086
  $PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none $plats -d "$dest/wheels" $PKGS
  (cd "$dest/wheels" && sha256sum ./*.whl | sed 's# \./# #' > wheels.sha256)
  echo "$(ls "$dest/wheels"/*.whl | wc -l) wheels, $(du -cm "$dest/wheels"/*.whl | tail -1 | cut -f1) MiB in $dest/wheels"
}

pack() {  # here: the slim vllm wheel + the rest in one tar, cut into DEST/v1, v2, ... and DEST/README
  local dest=$1 tmp
  tmp=$(mktemp -d /tmp/ipw-vllm-pack-XXXX)
  mkdir "$tmp/wheels"
  (cd "$dest/wheels" && sha256sum -c --quiet wheels.sha256)
  cp "$dest/wheels"/*.whl "$tmp/wheels/"
  # every wheel rewritten uncompressed (ZIP_STORED: one xz stream over all of them packs ~30% smaller than
  # the wheels' own deflate), the vllm wheel without PRUNE (its RECORD too) unless FULL=1
  PRUNE="$([ -n "${FULL:-}" ] || echo "$PRUNE")" $PY - "$tmp/wheels"/*.whl <<'EOF'
import os, sys, zipfile
prune = os.environ["PRUNE"].split()
drop = lambda n: any(n == p or (p.endswith("/") and n.startswith(p)) for p in prune)
for path in sys.argv[1:]:
    src = zipfile.ZipFile(path); out = zipfile.ZipFile(path + ".new", "w", zipfile.ZIP_STORED)
    slim = os.path.basename(path).startswith("vllm-"); dropped = 0
    for info in src.infolist():
        if slim and drop(info.filename):
            dropped += info.file_size; continue
        data = src.read(info)
        if slim and info.filename.endswith(".dist-info/RECORD"):
            data = "".join(l for l in data.decode().splitlines(True) if not drop(l.split(",")[0])).encode()
        info.compress_type = zipfile.ZIP_STORED
        out.writestr(info, data)
    out.close(); os.replace(path + ".new", path)
    if slim:
        print(f"slim {os.path.basename(path)}: {dropped / 2**20:.0f} MiB (unpacked) dropped")
EOF
  (cd "$tmp/wheels" && sha256sum ./*.whl | sed 's# \./# #' > wheels.sha256)
  tar cf - -C "$tmp" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner wheels | xz -9 -T2 > "$tmp/wheels.tar.xz"
  (cd "$tmp" && split -b "$PIECE" -d -a 2 wheels.tar.xz wheels.tar.xz.)
  rm -rf "$dest"/v[0-9]*
  local n=0 p
  for p in "$tmp"/wheels.tar.xz.[0-9]*; do n=$((n + 1)); mkdir -p "$dest/v$n"; mv "$p" "$dest/v$n/"; done
  (cd "$dest" && for d in v[0-9]*; do (cd "$d" && sha256sum ./*); done | sed 's# \./# #' | sort -k 2 > parts.sha256)
  for p in "$dest"/v[0-9]*; do cp "$dest/parts.sha256" "$p/"; done
  {
    echo "Files for bench/serving/vllm_h200.sh (made by: bash bench/serving/vllm_h200.sh download $dest; ... pack $dest)"
    echo "v*/wheels.tar.xz.NN: split -b $PIECE of tar+xz of wheels/: the wheels below rewritten uncompressed"
    echo "  (ZIP_STORED) and their wheels.sha256; ${FULL:+the full vllm wheel}${FULL:-the vllm wheel without: $(echo $PRUNE)}"
    echo "One device call per folder: see the head of bench/serving/vllm_h200.sh."
    echo
    for p in "$dest"/v[0-9]*; do
      echo "$(basename "$p")/ ($(cat "$p"/* | wc -c | awk '{printf "%d bytes, %.1f MiB", $1, $1 / 1048576}')):"
      (cd "$p" && for f in *; do printf '  %-16s %10s  %s\n' "$f" "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -d' ' -f1)"; done)
    done
    echo
    echo "Wheels as downloaded (bytes, sha256 of PyPI's file; packed: $(stat -c %s "$tmp/wheels.tar.xz") bytes in $n folders):"
    (cd "$dest/wheels" && for f in *.whl; do printf '  %-72s %10s  %s\n' "$f" "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -d' ' -f1)"; done)
    echo "Assumed on the machine (python3 imports): $(echo $ASSUMED)"
  } > "$dest/README"
  rm -rf "$tmp"
  cat "$dest/README"
}

install() {  # $W/site from the pieces; then one line per module that does not import
  local pieces=("$W"/parts/wheels.tar.xz.[0-9]*)
  [ -f "${pieces[0]}" ] || { echo "install: no pieces in $W/parts (stash the folders first)" >&2; exit 3; }
  (cd "$W/parts" && sha256sum -c --quiet parts.sha256) || { echo "install: a piece is missing or damaged" >&2; exit 3; }
  rm -rf "$W/wheels" "$W/site"
  cat "${pieces[@]}" | xz -dc | tar xf - -C "$W"
  (cd "$W/wheels" && sha256sum -c --quiet wheels.sha256)
  $PY -m pip install --no-index --no-deps --disable-pip-version-check --no-compile -q --target "$W/site" "$W"/wheels/*.whl
  echo "installed $(ls "$W"/wheels/*.whl | wc -l) wheels into $W/site"
  # shellcheck disable=SC2086
  PYTHONPATH="$W/site" $PY - $MODS -- $ASSUMED <<'EOF'
import importlib, sys
args = sys.argv[1:]; cut = args.index("--")
bad = 0
for group, mods in (("carried", args[:cut]), ("assumed present", args[cut + 1:])):
    for m in mods:
        try:
            importlib.import_module(m)
        except Exception as e:  # ImportError, or a library that fails to load
            bad += 1; print(f"MISSING ({group}) {m}: {type(e).__name__}: {e}")
print(f"import check: {len(args) - 1 - bad} of {len(args) - 1} modules import" + ("" if bad else ", none missing"))
EOF
}

check() {  # versions, CUDA, the ipw import paths (engine and OpenAI server)
  [ -d "$W/site/vllm" ] || { echo "check: no $W/site/vllm (run install)" >&2; exit 3; }
  export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
  PYTHONPATH="$W/site" $PY -c '
import importlib.metadata as md, torch, transformers
print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print("transformers", transformers.__version__, "triton", md.version("triton") if __import__("importlib").util.find_spec("triton") else "-")
from vllm import LLM, SamplingParams
from vllm.sampling_params import RequestOutputKind
import vllm, vllm.entrypoints.openai.api_server
from vllm.platforms import current_platform
print("vllm", vllm.__version__, "platform", type(current_platform).__name__)
if torch.cuda.is_available():
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    print("flash-attn version", get_flash_attn_version())
'
  PYTHONPATH="$W/site" $PY -m vllm.entrypoints.openai.api_server --help > "$W/api_server-help.txt" 2>&1 \
    && echo "api_server --help: ok ($(wc -l < "$W/api_server-help.txt") lines)" \
    || { echo "api_server --help failed:"; tail -20 "$W/api_server-help.txt"; exit 1; }
}

generate() {  # MODEL_DIR: vLLM's engine on the GPU with MODEL_DIR's config and tokenizer and random weights
  [ -d "$W/site/vllm" ] || { echo "generate: no $W/site/vllm (run install)" >&2; exit 3; }
  export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
  PYTHONPATH="$W/site" $PY - "$1" <<'EOF'
import sys, time
t0 = time.monotonic()
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], load_format="dummy", enforce_eager=True, max_model_len=512, dtype="float32",
          gpu_memory_utilization=0.3, seed=0)
t1 = time.monotonic()
prompts = [f"Question {i}: what is {i} + {i}?" for i in range(64)]
outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
t2 = time.monotonic()
n = sum(len(o.outputs[0].token_ids) for o in outs)
print(f"generate: engine up in {t1 - t0:.1f} s; {len(outs)} prompts, {n} output tokens in {t2 - t1:.2f} s "
      f"({n / (t2 - t1):.0f} tok/s, random weights)")
EOF
}

run_stage() {  # PART OUT: `ipw run` with vLLM (configs/gpu-vllm.toml) on this GPU, the NVML counter polled by
  # bench/telemetry/gpu_counter.py; PART sweep: vLLM's server and llama-server over 1/4/16/64 (one run folder); rest: vLLM in
  # process, the symmetric requests at 16 and 64, and the failures (a server killed mid-run, a GPU without memory)
  local part=$1 out=$2 S=${SERVING_W:-/tmp/ipw-serving}
  [ -d "$W/site/vllm" ] || { echo "run: no $W/site/vllm (install first)" >&2; exit 3; }
  W=$S bash bench/serving/serving_h200.sh install  # the bundled GGUF into $S/site, from the stashed pieces
  export PYTHONPATH="$W/site:$S/site:$PWD" PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
  export IPW_LLAMA_SERVER="$S/build/bin/llama-server"
  local R="$W/runs" cfg=configs/gpu-vllm.toml t0 t1 counter
  mkdir -p "$R" "$out"
  left() { echo $(( ${DEADLINE:-$(( $(date +%s) + 100000 ))} - $(date +%s) )); }
  ipw() { python3 -m ipw.cli "$@"; }
  nvidia-smi --query-gpu=name,driver_version,power.limit,memory.total --format=csv > "$R/nvidia-smi.csv"
  git log -1 --format='%H %s' > "$R/commit-$part.txt" 2>/dev/null || true
  git status --short > "$R/git-status-$part.txt" 2>/dev/null || true
  PYTHONPATH="$W/site" $PY -m pip list --path "$W/site" --format freeze > "$R/site-freeze.txt" 2>/dev/null || true
  $PY -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__)' > "$R/base-versions.txt" 2>&1 || true
  t0=$(date +%s)
  [ -d "$R/data" ] || python3 bench/serving/serving_validate.py datasets "$R/data"
  if [ ! -f "$R/convert.txt" ]; then  # once: the GGUF into a Hugging Face folder (ipw's per-machine cache)
    t1=$(date +%s)
    python3 -m ipw.cli convert smollm2-135m > "$R/convert.txt" 2>&1 || { cat "$R/convert.txt"; exit 1; }
    echo "convert: $(($(date +%s) - t1)) s" >> "$R/convert.txt"
    tail -n 2 "$R/convert.txt"
  fi
  python3 bench/telemetry/gpu_counter.py "$R/counter-$part.csv" &
  counter=$!
  # the counter's PID expanded now: the trap runs where run_stage's locals are gone (a `set -u` error there left the
  # counter running, holding the caller's stdout open: the device call never ended; issue 55)
  trap "kill -TERM $counter 2> /dev/null || true" EXIT
  sleep 1
  runit() {  # NAME SECONDS-NEEDED ipw-run-options...: one run into $R/NAME unless DEADLINE is nearer
    local name=$1 need=$2; shift 2
    if [ "$(left)" -lt "$need" ]; then echo "$name: skipped, $(left) s before DEADLINE (needs ~$need)"; return 0; fi
    echo "$name: start at $(($(date +%s) - t0)) s"
    # interrupted (SIGINT: the records so far kept, the folder resumable) 45 s before DEADLINE, for the analysis
    # `|| rc=$?`: a run that fails (a server killed mid-run: exit 1) must not end the stage under `set -e`
    local rc=0
    timeout -s INT -k 20 "$(($(left) - 45))" python3 -m ipw.cli run "$cfg" "$@" --out "$R/$name" > "$R/$name.txt" 2>&1 || rc=$?
    echo "exit $rc" >> "$R/$name.txt"
    tail -n 6 "$R/$name.txt"
    echo "$name: done at $(($(date +%s) - t0)) s"
  }
  one() { ls -d "$R/$1"/*/ 2> /dev/null | head -n 1; }
  oom_starts() {  # a GPU without the memory asked for: another process holds all but ~10 GiB, vLLM asks for a
    # fifth of 141 GB; the hog is ready once it says so
    [ "$(left)" -gt 120 ] || { echo "oom: skipped, $(left) s before DEADLINE"; return 0; }
    $PY -c 'import time, torch; free, total = torch.cuda.mem_get_info(); x = torch.empty(free - (10 << 30), dtype=torch.uint8, device="cuda"); print(f"holding {x.numel() / 2**30:.1f} GiB of {total / 2**30:.1f}", flush=True); time.sleep(300)' > "$R/hog.txt" 2>&1 &
    local hog=$! _
    for _ in $(seq 60); do grep -q holding "$R/hog.txt" && break; sleep 0.5; done
    runit oom-inproc 60 -b smollm2-135m-vllm --limit 8
    runit oom-server 60 -b smollm2-135m-vllm-server --limit 8 --concurrency 1
    kill "$hog" 2> /dev/null || true; wait "$hog" 2> /dev/null || true
  }
  killed_run() {  # a server that dies mid-run (issue 55: ipw run must then exit, every wait bounded)
    # and 8 measured; records reach records.jsonl in batches, too late to trigger on), 4 in flight
    if [ "$(left)" -gt 150 ]; then
      local killer
      rm -rf "$R/killed" "$R/killed-at.txt" "$R/killed-gpu-after.txt"  # a former try's server log would set off the killer
      ( for _ in $(seq 1200); do
          n=$(cat "$R"/killed/*/server-*.log 2> /dev/null | grep -c "POST /v1/chat" || true)
          if [ "${n:-0}" -ge 12 ]; then
            pkill -9 -f vllm.entrypoints.openai.api_server && echo "killed the vLLM server after $n answers" > "$R/killed-at.txt"
            break
          fi
          sleep 0.25
        done ) &
      killer=$!
      runit killed 150 -b smollm2-135m-vllm-server --limit 64 --concurrency 4
      kill "$killer" 2> /dev/null || true; wait "$killer" 2> /dev/null || true  # not `wait`: the counter runs on
      sleep 2  # what still holds the GPU once ipw has stopped (an engine core the killed server left behind?)
      nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv > "$R/killed-gpu-after.txt" 2>&1
      nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9 2> /dev/null || true
    fi
  }
  if [ "$part" = sweep ]; then
    local llama=(-b smollm2-135m-llama-server)
    [ -x "$IPW_LLAMA_SERVER" ] || { echo "run: no $IPW_LLAMA_SERVER (serving_h200.sh build): llama-server left out"; llama=(); }
    runit sweep 200 -b smollm2-135m-vllm-server "${llama[@]}"
  elif [ "$part" = killed ]; then
    killed_run
  elif [ "$part" = more ]; then
    # in process over a longer span (3 repeats of the 200 queries), at 16 and at 64 in flight
    runit inproc16 150 -b smollm2-135m-vllm --repeats 3
    oom_starts
    sed 's/^batch_size = 16$/batch_size = 64/' "$cfg" > "$R/gpu-vllm-b64.toml"
    cfg="$R/gpu-vllm-b64.toml" runit inproc64 120 -b smollm2-135m-vllm --repeats 3
    # CUDA graphs (enforce_eager = false: vLLM captures a graph per batch size at its start)
    sed 's/^enforce_eager = true$/enforce_eager = false/' configs/gpu-vllm.toml > "$R/gpu-vllm-graphs.toml"
    cfg="$R/gpu-vllm-graphs.toml" runit graphs 240 -b smollm2-135m-vllm-server --limit 100
  else
    runit inproc 120 -b smollm2-135m-vllm
    runit symmetric 100 -b smollm2-135m-vllm-server --dataset "$R/data/symmetric.jsonl" --limit 128 --concurrency 16,64
    killed_run
    oom_starts
  fi
  kill -TERM "$counter"; wait "$counter" || true
  trap - EXIT
  local args=(--counter "$R/counter-$part.csv" --json "$R/validation-$part.json")
  if [ "$part" = sweep ]; then
    [ -n "$(one sweep)" ] && args+=(--conservation "$(one sweep)")
  elif [ "$part" = more ]; then
    for f in inproc16 inproc64 graphs; do [ -n "$(one $f)" ] && args+=(--conservation "$(one $f)"); done
  else
    [ -n "$(one inproc)" ] && args+=(--conservation "$(one inproc)")
    [ -n "$(one symmetric)" ] && args+=(--conservation "$(one symmetric)" --symmetric "vllm-server=$(one symmetric)")
  fi
  python3 bench/serving/serving_validate.py analyze "${args[@]}" > "$R/validation-$part.md" 2>&1 || true
  local swept=$([ "$part" = more ] && one graphs || one "$part")
  if [ "$part" != rest ] && [ "$part" != killed ] && [ -n "$swept" ]; then
    ipw compare "$swept" --deadline p95_latency=2s > "$R/compare-$part.txt" 2>&1 || true
    ipw compare "$swept" --format json > "$R/compare-$part.json" 2> /dev/null || true
  fi
  for f in "$R"/killed.txt "$R"/oom-*.txt "$R"/killed-at.txt "$R"/hog.txt; do [ -f "$f" ] && { echo "== $f"; tail -n 12 "$f"; }; done > "$R/failures-$part.txt" 2>&1 || true
  cat "$R/validation-$part.md" "$R/failures-$part.txt" "$R/compare-$part.txt" 2> /dev/null | tee "$out/vllm-$part.md" | head -n 80
  gzip -9 -f "$R/counter-$part.csv"
  tar cJf "$out/vllm-$part.tar.xz" -C "$R" --exclude='counter-*.csv.gz' --exclude=data . && cp "$R/counter-$part.csv.gz" "$out/"
  echo "run $part: $(($(date +%s) - t0)) s"; ls -la "$out"
}

case "$stage" in
  download) download "${args[0]}" ;;
  pack) pack "${args[0]}" ;;
  stash) stash "${args[@]}" ;;
  install) [ ${#args[@]} -gt 0 ] && stash "${args[@]}"; install ;;
  check) check ;;
  generate) generate "${args[0]}" ;;
  run) case "${1:-}" in sweep|rest|more|killed) ;; *) echo "usage: bash bench/serving/vllm_h200.sh run sweep|rest|more|killed OUT" >&2; exit 2 ;; esac
       run_stage "$1" "${args[1]}" ;;
  *) echo "usage: bash bench/serving/vllm_h200.sh download DEST | pack DEST | stash DIR... | install [DIR...] | check | generate MODEL_DIR | run sweep|rest|more|killed OUT" >&2; exit 2 ;;
esac
