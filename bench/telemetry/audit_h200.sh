#!/usr/bin/env bash
# The run-level energy audit on a real GPU, without an engine build: `ipw run` with the fake engine of
# bench/overhead/fake_engine.py (50 ms answers, the GPU idle) N times for each source tree given, alternating,
# then each run's audit line (OUT/audit.txt) and the runs (OUT/audit-runs.tgz).
#
#   bash bench/telemetry/audit_h200.sh OUT N TREE...     (TREE: a checkout or `git archive` holding ipw/ and bench/)
#
# Output: OUT/audit.txt and OUT/audit-runs.tgz; the figures are in docs/GPU.md and the session folders under bench/evidence/telemetry/gpu/.
set -u
OUT=$(realpath "$1"); N=$2; shift 2
R=/tmp/audit-h200; rm -rf $R; mkdir -p $R
printf 'dataset = "ipw-core"\nlimit = 150\nwarmup = 2\nidle_s = 0\n[generation]\nmax_tokens = 8\n[[backends]]\nname = "fake"\nkind = "fake"\nmodel = "fake-50ms"\nrole = "local"\nanswer_ms = 50\ntokens = 8\n' > $R/c.toml
for i in $(seq "$N"); do
  for tree in "$@"; do
    name=$(basename "$(realpath "$tree")")
    fake=$tree/bench/overhead/fake_engine.py
    [ -f "$fake" ] || fake=$tree/bench/fake_engine.py  # a tree from before bench/'s question folders
    PYTHONPATH=$(realpath "$tree"):$(dirname "$(realpath "$fake")") PYTHONUNBUFFERED=1 \
      python3 "$fake" run $R/c.toml --out $R/runs-$name > $R/run-$name-$i.log 2>&1 || tail -5 $R/run-$name-$i.log
  done
done
python3 - "$R" <<'PY' | tee $OUT/audit.txt
import glob, json, sys
for m in sorted(glob.glob(f"{sys.argv[1]}/runs-*/*/manifest.json")):
    for b in json.load(open(m))["backends"]:
        for a in b.get("energy_audit") or [{"line": "no audit"}]:
            print(m.split("/")[-3], m.split("/")[-2], a.get("line") or a)
PY
tar czf $OUT/audit-runs.tgz -C $R .
