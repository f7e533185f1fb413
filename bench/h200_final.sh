#!/usr/bin/env bash
# The lead's final H200 call of session 5 (run from the archived checkout; CUDA llama-cpp-python in /tmp/ipw-site)
set -u
cd "$(dirname "$0")"
OUT=$1; OLD=$2
export PYTHONPATH=/tmp/ipw-site:$PWD PYTHONUNBUFFERED=1
R=/tmp/v; rm -rf $R; mkdir -p $R
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,driver_version,power.limit,memory.total --format=csv > $R/nvidia-smi.csv
python3 bench/gpu_counter.py $R/counter.csv & c=$!
sleep 1
for i in 1 2 3; do python3 -m ipw.cli run configs/gpu-small-models.toml --out $R/runs 2>&1 | grep -iE "wrote|audit|error|Traceback"; done
kill -TERM $c; wait $c
python3 bench/gpu_figures.py $R/counter.csv $R/runs/* --json $R/figures.json > $R/figures.md 2>&1
grep -E "ipw vs|span|audit|Σ" $R/figures.md
gzip -9 $R/counter.csv
tar czf $OUT/validate.tgz -C $R runs figures.md figures.json counter.csv.gz nvidia-smi.csv
echo "runs done at $(el) s"
( PYTHONPATH=/tmp/ipw-site:$PWD timeout 150 python3 bench/overhead_llama.py --n-gpu-layers -1 --n-threads 4 --rounds 3 --queries 60 --no-write --json $R/overhead-llama-new.json > $R/overhead-llama-new.log 2>&1 ); grep -E "ratio" $R/overhead-llama-new.log
OVERHEAD_ROUNDS=0 bash bench/breakdown_h200.sh "$OLD" $R/bd 200 > $R/bd.log 2>&1
cat $R/bd/steps.txt; cat $R/bd/compare-*.md 2>/dev/null | grep -E "added|wall ratio"
tar czf $OUT/bd.tgz -C $R bd bd.log overhead-llama-new.json overhead-llama-new.log
echo "breakdown done at $(el) s"
left=$(( 420 - $(el) ))
if [ $left -gt 160 ]; then
  timeout $left python3 bench/attribution.py --repeats 1 --out $R/attr > $R/attr.log 2>&1
  tail -n 40 $R/attr/attribution.md 2>/dev/null | grep -vE "^$"
  tar czf $OUT/attr.tgz -C $R attr attr.log
fi
echo "all done at $(el) s"; ls -la $OUT
