"""Sampler CPU overhead on this machine: CPU seconds per minute of ``ipw run`` at default settings.

The engine is a stand-in that uses no CPU: a backend (registered the way an extension would) whose
``generate`` sleeps for ``--query-s`` seconds and returns 24 timed tokens. So every CPU second of the
``ipw run`` process during the query loop is the harness's own work:

- the **CPU model sensor**: its begin/end reads of the measured process tree around every query (in the
  main thread) and its snapshot thread (``ipw-snapshots``: the process tree's CPU time every 20 ms while
  a window is open, for the prefill/decode split);
- every other **periodic thread** (the live progress bar's refresh thread: rich, 10 per second);
- the rest of the per-query work in the main thread (records: build, score, append + fsync; progress).

The real CLI runs (``ipw.cli.main(["run", CONFIG])``, default settings: 20 ms snapshot period, the
progress bar rendering into a pseudo-terminal) with two kinds of measured process:

- ``in-process``: the backend reports ipw's own PID (as the in-process llama.cpp and vLLM backends do);
- ``server``: the backend reports the PID of a child process tree of 4 sleeping processes (as a
  managed server does), whose CPU times are read from /proc.

Per-thread CPU time comes from each thread's CPU clock (``time.pthread_getcpuclockid``), read at the
start of the first measured query and at the end of the last one; CPU seconds per minute = the CPU
time between those points / their wall time x 60. A separate micro-benchmark times one begin/end pair
of ``CpuModelSensor`` alone.

    .venv/bin/python bench/overhead/sampler_cpu.py                         # writes docs/PERFORMANCE.md
    .venv/bin/python bench/overhead/sampler_cpu.py --seconds 20 --no-write

Output: docs/PERFORMANCE.md, section "Sampler CPU overhead" (``--no-write``: printed only; ``--json``: the raw
    result).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py
sys.path.insert(0, str(ROOT / "bench"))
from _shared import DOC, loads, machine, run_pty, write_section  # noqa: E402

SECTION = "## Sampler CPU overhead"
BUDGET = 0.02  # of one core
TREE = ("import subprocess, sys, time\n"
        "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1e6)']) for _ in range(3)]\n"
        "time.sleep(1e6)\n")


# --- the worker: ipw run with a stand-in backend --------------------------------------------------------

def thread_cpu() -> dict[str, float]:
    out = {}
    for t in threading.enumerate():
        try:
            out[f"{t.name}#{t.ident}"] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, TypeError):
            pass
    return out


class SleepBackend:
    OPTIONS = {"query_s": float, "tree": bool, "warmup_n": int, "queries_n": int, "stats": str}

    def __init__(self, spec) -> None:
        self.spec = spec
        o = spec.options
        self.query_s, self.tree = float(o["query_s"]), bool(o.get("tree", False))
        self.skip, self.last = int(o["warmup_n"]), int(o["warmup_n"]) + int(o["queries_n"])
        self.stats_path = Path(o["stats"])
        self.calls = 0
        self.child = None
        self.marks: list[dict] = []

    def load(self) -> None:
        if self.tree:
            self.child = subprocess.Popen([sys.executable, "-c", TREE])
            time.sleep(1.0)  # let it start its children

    def _mark(self) -> None:
        self.marks.append({"t": time.monotonic(), "process": time.process_time(), "threads": thread_cpu()})

    def generate(self, prompt, settings):
        from ipw.backends.base import Completion

        self.calls += 1
        if self.calls == self.skip + 1:
            self._mark()
        start = time.monotonic()
        n = 24
        times = [start + self.query_s * (0.1 + 0.9 * i / (n - 1)) for i in range(n)]
        time.sleep(self.query_s)
        if self.calls == self.last:
            self._mark()
        return Completion(text="42", prompt_tokens=40, completion_tokens=n, start_s=start, first_token_s=times[0],
                          end_s=time.monotonic(), token_times_s=tuple(times), finish_reason="length")

    def pids(self):
        return [self.child.pid] if self.child is not None else [os.getpid()]

    def describe(self):
        return {"engine": "bench-sleep", "query_s": self.query_s, "tree": self.tree}

    def close(self) -> None:
        if self.child is not None:
            import psutil

            for p in [*psutil.Process(self.child.pid).children(recursive=True), psutil.Process(self.child.pid)]:
                p.kill()
            self.child.wait()
        self.stats_path.write_text(json.dumps(self.marks), encoding="utf-8")


def worker(config: str) -> int:
    from ipw.backends.base import register_backend
    from ipw.cli import main

    register_backend("bench-sleep", SleepBackend)
    return main(["run", config])


# --- the benchmark -----------------------------------------------------------------------------------

def config_toml(tmp: Path, name: str, query_s: float, queries: int, tree: bool) -> str:
    return f"""dataset = "ipw-core"
limit = {queries}
out_dir = "{tmp / name}"

[[backends]]
name = "{name}"
kind = "bench-sleep"
model = "stand-in"
query_s = {float(query_s)!r}
tree = {'true' if tree else 'false'}
warmup_n = 2
queries_n = {queries}
stats = "{tmp / (name + '.json')}"
"""


def scenario(tmp: Path, name: str, query_s: float, seconds: float, tree: bool) -> dict:
    queries = min(480, max(10, int(seconds / query_s)))  # the bundled set has 485 queries
    cfg = tmp / f"{name}.toml"
    cfg.write_text(config_toml(tmp, name, query_s, queries, tree), encoding="utf-8")
    load = loads()
    res = run_pty([sys.executable, str(Path(__file__).resolve()), "--worker", str(cfg)])
    if res["rc"] != 0:
        raise SystemExit(f"{name}: ipw run failed:\n{res['output'][-3000:]}")
    a, b = json.loads((tmp / f"{name}.json").read_text(encoding="utf-8"))
    wall = b["t"] - a["t"]
    per_min = 60.0 / wall
    threads = {}
    for key, cpu in b["threads"].items():
        label = key.split("#")[0]
        label = ("main" if label == "MainThread" else "ipw-snapshots" if label == "ipw-snapshots"
                 else "progress bar (rich refresh)" if key.split("#")[0].startswith("Thread") else label)
        threads[label] = threads.get(label, 0.0) + (cpu - a["threads"].get(key, 0.0)) * per_min
    (run_dir,) = [p for p in (tmp / name).iterdir() if p.is_dir()]
    manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    overhead = manifest["backends"][0]["sampler_overhead"]
    total = (b["process"] - a["process"]) * per_min
    return {"name": name, "query_s": query_s, "queries": queries, "tree": tree, "wall_s": wall, "load_avg": load,
            "process_cpu_s_per_min": total, "threads_cpu_s_per_min": threads, "manifest_overhead": overhead}


def start_sleepers(n: int) -> list[int]:
    """``n`` sleeping processes started by a shell that exits at once: re-parented, in no measured tree."""
    started = subprocess.run(["sh", "-c", f"for i in $(seq {n}); do sleep 3600 >/dev/null 2>&1 & echo $!; done"],
                             capture_output=True, text=True, check=True)
    return [int(x) for x in started.stdout.split()]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def sensor_micro(extra_procs: int, cadences: list[float], windows: int = 30) -> dict:
    """CPU time of CpuModelSensor's begin + end per window, windows opened every ``cadence`` seconds
    (begin, sleep, end: the descendants are looked for again at most every TREE_RESCAN_S, so the cost
    per window depends on the cadence), in-process (no child processes) and over a 4-process tree; then
    again with ``extra_procs`` more sleeping processes on the machine that are in neither tree (orphaned
    to init): each scan for descendants reads every process in /proc."""
    import psutil

    from ipw.telemetry.cpu_model import CpuModelSensor

    def n_procs() -> int:
        return sum(1 for p in os.listdir("/proc") if p.isdigit())

    def window_cost(pids: list[int], cadence: float) -> float:
        sensor = CpuModelSensor(lambda: pids)
        try:
            cpu = 0.0
            for _ in range(windows):
                t0 = time.thread_time()
                token = sensor.begin()
                cpu += time.thread_time() - t0
                time.sleep(cadence)
                t0 = time.thread_time()
                sensor.end(token)
                cpu += time.thread_time() - t0
            # the reads themselves run on the sensor's thread (issue 29: an edge is a timestamp)
            cpu += sensor.overhead().get("cpu_s", 0.0)
            return cpu / windows
        finally:
            sensor.close()

    def kill_tree(child) -> None:
        for p in [*psutil.Process(child.pid).children(recursive=True), psutil.Process(child.pid)]:
            p.kill()
        child.wait()

    out: dict = {"processes": n_procs(), "extra": extra_procs, "cost": {}}
    for c in cadences:
        out["cost"][f"in-process@{c:g}"] = window_cost([os.getpid()], c)
    child = subprocess.Popen([sys.executable, "-c", TREE])
    time.sleep(1.0)
    sleepers: list[int] = []
    try:
        for c in cadences:
            out["cost"][f"tree@{c:g}"] = window_cost([child.pid], c)
        sleepers = start_sleepers(extra_procs)
        time.sleep(0.5)
        out["processes_extra"] = n_procs()
        for c in cadences:
            out["cost"][f"tree+@{c:g}"] = window_cost([child.pid], c)
        kill_tree(child)
        child = None
        for c in cadences:
            out["cost"][f"in-process+@{c:g}"] = window_cost([os.getpid()], c)
    finally:
        kill_all(sleepers)
        if child is not None:
            kill_tree(child)
    return out


def measure(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="ipw-sampler-cpu-") as tmp_name:
        tmp = Path(tmp_name)
        for query_s in args.query_s:
            for tree in (False, True):
                name = f"{'server' if tree else 'inproc'}-{query_s:g}s"
                row = scenario(tmp, name, query_s, args.seconds, tree)
                print(f"{name}: {json.dumps(row['threads_cpu_s_per_min'])} total {row['process_cpu_s_per_min']:.3f} "
                      f"CPU s/min over {row['wall_s']:.1f} s, load avg {row['load_avg']}", file=sys.stderr, flush=True)
                rows.append(row)
    return {"rows": rows, "micro": sensor_micro(args.extra_procs, args.query_s)}


def micro_text(micro: dict, cadences: list[float], extra: str = "") -> str:
    parts = []
    for c in cadences:
        parts.append(f"every {c:g} s: {micro['cost'][f'in-process{extra}@{c:g}'] * 1e3:.2f} ms in-process, "
                     f"{micro['cost'][f'tree{extra}@{c:g}'] * 1e3:.2f} ms for the 4-process tree")
        if extra:
            parts[-1] += f" ({micro['cost'][f'tree{extra}@{c:g}'] * 60 / c:.2f} CPU s per minute)"
    return "; ".join(parts)


def write_doc(args, res: dict) -> None:
    micro = res["micro"]
    lines = []
    worst = 0.0
    for r in res["rows"]:
        th = r["threads_cpu_s_per_min"]
        snap = th.get("ipw-snapshots", 0.0)
        bar = th.get("progress bar (rich refresh)", 0.0)
        windows_per_min = 60.0 / r["query_s"]
        be = micro["cost"][f"{'tree' if r['tree'] else 'in-process'}@{r['query_s']:g}"] * windows_per_min
        sensor = snap + be
        periodic = sensor + bar
        worst = max(worst, periodic)
        lines.append(
            f"| {'server tree' if r['tree'] else 'in-process'} | {r['query_s']:g} s | {r['queries']} | "
            f"{snap:.3f} | {be:.3f} | **{sensor:.3f}** ({sensor / 60:.2%}) | {bar:.3f} | "
            f"**{periodic:.3f}** ({periodic / 60:.2%}) | {th.get('main', 0.0):.3f} | {r['process_cpu_s_per_min']:.3f} "
            f"({r['process_cpu_s_per_min'] / 60:.2%}) | {r['load_avg']} |")
    ok = worst / 60 <= BUDGET
    body = f"""{SECTION}

CPU seconds per minute of `ipw run` at default settings, with an engine that uses no CPU itself (a
stand-in backend that sleeps `query_s` per query and returns 24 timed tokens), so every CPU second of
the process during the query loop is ipw's own. Two measured-process kinds: ipw's own PID (in-process
engines: llama.cpp, vLLM) and a child tree of 4 processes (a managed server). The real CLI ran
(`ipw run`, default 20 ms snapshot period, progress bar rendering into a pseudo-terminal); per-thread
CPU clocks were read at the start of the first measured query and the end of the last; {machine()}.

| measured process | query length | queries | snapshot thread | begin/end reads | **CPU model sensor** (share of a core) | progress bar thread | **sensor + periodic threads** | main thread (all per-query work) | whole process | load avg |
|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(lines)}

(CPU seconds per minute of run. "begin/end reads" = windows per minute x the CPU time of
`CpuModelSensor.begin` + `end` per window, measured alone with windows opened at the same cadence
({micro_text(micro, args.query_s)}; {micro['processes']} processes on the machine); these reads run in the main
thread and are part of its column too.)

Finding the measured processes' descendants (psutil `children(recursive=True)`) reads every process in
/proc, so its cost grows with the machine's processes, not with the measured tree. It ran at every
begin and every end: 1.8–2.2 ms per window here, 11 ms with 400 more processes on the machine (473),
which is 2.0–2.8% of a core at 10 queries a second (the sensor failed the target at 0.1 s queries) and
2.3% at 2 queries a second on the busier machine. **Fixed**: `CpuModelSensor` now looks for descendants
at most every second (`TREE_RESCAN_S`) and reads the processes it found last time in between
(`ipw/telemetry/cpu_model.py`, `processes()`); a process born into the tree is found within a second.
With {micro['extra']} more sleeping processes ({micro['processes_extra']} in all) a window now costs
{micro_text(micro, args.query_s, '+')}.

**Target (≤ 2% of one core = 1.2 CPU s per minute) for the sensor and every periodic thread: worst case
{worst:.3f} CPU s per minute = {worst / 60:.2%} of a core: {'PASS' if ok else 'FAIL'}.** The whole
process, which adds the per-query record work of the main thread (build and score the record, append
and fsync it, update the progress bar), is listed for completeness; with real engines it is part of the
harness overhead measured against bare backends above.

**Fixed**: the progress bar redrew 10 times a second (rich's default), and that thread alone took
0.47–0.49 CPU s per minute (0.8% of a core; measured with this script, 5 s scenarios at 0.5 s per
query); it now redraws twice a second (`ipw/commands/run.py`, `refresh_per_second=2`: its numbers change
once per query). This matters beyond the budget: for an in-process engine (llama.cpp, vLLM) the
CPU model charges the CPU time of ipw's own process, so every CPU second of ipw's threads while a
query's window is open (snapshot thread, progress bar) is counted as that query's energy. With a
one-thread llama.cpp engine (~60 CPU s per minute) the periodic threads above are
{res['rows'][0]['threads_cpu_s_per_min'].get('ipw-snapshots', 0) + res['rows'][0]['threads_cpu_s_per_min'].get('progress bar (rich refresh)', 0):.2f} CPU s per minute, about
{(res['rows'][0]['threads_cpu_s_per_min'].get('ipw-snapshots', 0) + res['rows'][0]['threads_cpu_s_per_min'].get('progress bar (rich refresh)', 0)) / 60:.1%} of the estimated CPU energy (it was about 1% at 10 redraws a second).

On the H200 (NVML sensor, measured there, docs/ENERGY.md): the sampler used **1.06% of one core** over
the attribution bench (2.78 CPU s in 262 s, 0.64 CPU s per minute), 1.11% in `ipw doctor --self-test`
alone, and 1.14% in the doctor run of the acceptance table; with two GPUs 1.09–1.42% (docs/MULTIGPU.md).
All within the 2% budget; the adaptive counter period (`max(0.25 s, cost / 0.6%)`) is what keeps the
4–5 ms NVML counter reads inside it.

Reproduce (writes this section):

```bash
.venv/bin/python bench/overhead/sampler_cpu.py --seconds {args.seconds:g} --query-s {' '.join(f'{q:g}' for q in args.query_s)}
```
"""
    write_section(DOC, SECTION, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each scenario's query loop")
    parser.add_argument("--query-s", type=float, nargs="+", default=[0.5, 0.1])
    parser.add_argument("--extra-procs", type=int, default=500,
                        help="sleeping processes added for the second begin/end micro-benchmark")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--from-json", type=Path, help="write the doc from a saved --json result (no run)")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if args.from_json:
        res = json.loads(args.from_json.read_text(encoding="utf-8"))
        args.seconds, args.query_s, args.extra_procs = res["args"]
    else:
        res = measure(args)
        res["args"] = [args.seconds, args.query_s, args.extra_procs]
    if args.json:
        args.json.write_text(json.dumps(res, indent=1), encoding="utf-8")
    if not args.no_write:
        write_doc(args, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
