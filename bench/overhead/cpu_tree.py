"""What the CPU model's thread costs on a machine with many processes: the measured tree is looked at
again every second (``TREE_RESCAN_S``), by a scan of every process (before) or by listing /proc and
asking only the newly born processes for their parent (``ProcessTree.refresh``, after).

Starts ``--extra`` sleeping processes outside the measured tree, then, for each source tree given (a
checkout, or an earlier commit's ``git archive``), in alternating order for ``--rounds`` rounds: one
``CpuModelSensor`` on this process's tree, ``--windows`` windows of 0.5 s back to back, and the CPU time
of the sensor's thread per window (its 20 ms snapshots and the looks at the tree; each source tree in a
process of its own).  Also times one full scan and one refresh of the tree alone (this checkout's code).

    git archive 51a4b50 ipw | tar -x -C /tmp/ipw-before
    .venv/bin/python bench/overhead/cpu_tree.py /tmp/ipw-before . --extra 500 --rounds 3 --json cpu-tree.json

Output: printed, and ``--json``; the figures are in docs/PERFORMANCE.md, "Sampler CPU overhead".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import json, os, sys, time
from ipw.telemetry import cpu_model
assert cpu_model.__file__.startswith(os.getcwd()), cpu_model.__file__  # the tree asked for
scans = [0]
full = cpu_model.process_tree
def counted(pids):
    scans[0] += 1
    return full(pids)
cpu_model.process_tree = counted
me = os.getpid()
sensor = cpu_model.CpuModelSensor(lambda: [me])
first = scans[0]
for _ in range({windows}):
    token = sensor.begin()
    time.sleep(0.5)
    sensor.end(token).result()
o = sensor.overhead()
sensor.close()
print(json.dumps({{"thread_ms_per_window": 1000 * o["cpu_s"] / {windows}, "snapshots": o["snapshots"],
                  "full_scans": scans[0] - first}}))
"""


def n_procs() -> int:
    return sum(1 for p in os.listdir("/proc") if p.isdigit())


def alone(repeats: int = 20) -> dict:
    """One full scan and one refresh of this process's tree, CPU ms each (this checkout's code)."""
    from ipw.telemetry.cpu_model import ProcessTree, process_tree

    me = os.getpid()
    tree = ProcessTree([me])
    t0 = time.thread_time()
    for _ in range(repeats):
        process_tree([me])
    t1 = time.thread_time()
    for _ in range(repeats):
        tree.refresh()
    t2 = time.thread_time()
    return {"full_scan_ms": 1000 * (t1 - t0) / repeats, "refresh_ms": 1000 * (t2 - t1) / repeats}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path, help="source trees holding ipw/ (each run alternately)")
    parser.add_argument("--extra", type=int, default=500, help="sleeping processes outside the measured tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from sampler_cpu import kill_all, start_sleepers  # this folder's

    sleepers = start_sleepers(args.extra)
    time.sleep(0.5)
    try:
        out: dict = {"processes": n_procs(), "cpus": os.cpu_count(), "alone": alone(), "rounds": []}
        for r in range(args.rounds):
            order = args.trees[r % len(args.trees):] + args.trees[: r % len(args.trees)]
            row = {}
            for tree in order:
                env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
                res = subprocess.run([sys.executable, "-c", CHILD.format(windows=args.windows)], env=env,
                                     cwd=tree.resolve(), capture_output=True, text=True, check=True)  # `-c`: the cwd comes first
                row[str(tree)] = {**json.loads(res.stdout), "load": round(os.getloadavg()[0], 2)}
            out["rounds"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        kill_all(sleepers)
    out["median_thread_ms_per_window"] = {
        str(t): statistics.median(r[str(t)]["thread_ms_per_window"] for r in out["rounds"]) for t in args.trees}
    print(json.dumps({k: out[k] for k in ("processes", "alone", "median_thread_ms_per_window")}))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
