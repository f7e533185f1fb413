"""Where ipw's time per query goes: the real ``ipw run`` path, instrumented, against a bare loop.

A child process runs ``ipw run`` in-process (``ipw.cli.main``) under a pseudo-terminal (so the live
progress display renders as it does for a user), with timers wrapped around the parts of a query's
path.  Each timer counts its *own* time (a nested timer's time is taken out of its caller's), on the
thread it ran on, so the parts add up:

- ``edge``: ``Window.begin`` / ``Window.end`` (and, below them, each sensor's ``begin`` / ``end``);
  with requests in flight, ``Segments.event`` (a request's start or end);
- ``round trip``: a query's call as the measuring thread sees it minus the engine's own time in the
  worker (``Completion.end_s - start_s``): JSON, the pipes, waking the caller (an old checkout: its
  reader thread too);
- ``estimate``: NVML windows made final (``PendingWindow.result`` / ``resolve_all``); ``phase split``:
  the split at the first token (``sensor_splits``); ``split``: the concurrent energy split (``split_share``);
- ``record``: ``make_record`` (the rest of it: scoring, the record's fields); ``serialise``
  (``QueryRecord.to_json``); ``write`` (``RunFolder.append`` less the rest); ``fsync`` (``os.fsync``);
- ``counter reads``: the CPU model's reads of the process tree's CPU time on its own thread
  (``Counters.snap``; an old checkout read it at the edges, inside ``edge: cpu model``);
- ``progress``: the per-record callback of ``ipw run`` and rich's redraws (``Live.refresh``);
- ``sleep``: ``time.sleep`` calls.

Only what starts inside the query loop (from the first window's start to the last one's end) is
counted per query; start-up, warm-up and the end of the run are listed apart (``outside_loop_s``).
Per query, the "measuring thread" column is what lies on the query's path: with one query in flight,
whatever that thread does between a query's end and the next one's start, or inside a window but
outside the engine, is added to every query.  Work on other threads (the NVML sampler, the CPU
model's snapshots, the worker's reader, a recorder) is off the path, save for the interpreter lock it
holds; their CPU seconds are listed too.

The loop's figures come from the run's own records: loop wall = end of the last window - start of the
first; engine time = the completions' ``end_s - start_s``; "added per query" = (loop wall - engine
time) / queries.  With ``--engine fake`` (``bench/overhead/fake_engine.py``: answers in ``--answer-ms``, in
ipw's worker process) a bare loop of the same engine, called directly, runs in the same invocation
(``concurrency`` threads for a level above 1): the wall ratio ipw / bare is then measured in one run.

The code under test is whichever ``ipw`` Python imports: run it with ``PYTHONPATH=CHECKOUT`` to measure
another checkout (the child runs in that checkout's folder, so the engine worker imports the same code):

    .venv/bin/python bench/overhead/harness_breakdown.py --engine fake --queries 400 --concurrency 1 64 --nvml fake
    PYTHONPATH=/tmp/ipw-site:$PWD python3 bench/overhead/harness_breakdown.py --engine llama --n-gpu-layers -1 \\
        --n-threads 4 --queries 150 --json OUT.json                               # an NVIDIA GPU, real NVML

``--nvml fake`` puts the NVML fakes of tests/nvml_fakes.py (synthetic 20 ms samples on the real
clock) in place of the driver, so the NVML sensor's path runs on a machine without a GPU; ``real``
(default when a GPU answers) uses the driver; ``none`` leaves the GPU out.

Output: printed, and ``--json``; the figures are in docs/PERFORMANCE.md, "Harness overhead per query: where
    the time goes", and docs/GPU.md.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(HERE.parent)]  # fake_engine.py beside it; bench/_shared.py


# --- timers --------------------------------------------------------------------------------------------

class Prof:
    """Own time per (thread, part): a wrapped call's time less the wrapped calls inside it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, str, float, float]] = []  # thread, part, monotonic start, own seconds
        self.local = threading.local()

    @staticmethod
    def thread() -> str:
        t = threading.current_thread()
        if t is threading.main_thread():
            return "measuring"
        name = t.name.rstrip("0123456789").rstrip("-_ ")
        return name.split(" (")[0] or "thread"

    def add(self, part: str, seconds: float, at_s: float) -> None:
        with self.lock:
            self.events.append((self.thread(), part, at_s, seconds))

    def wrap(self, owner, attr: str, part: str, moved=None) -> None:
        """Time ``owner.attr``; ``moved(result)`` returns (part, seconds) of its time that belong elsewhere
        (the engine's time inside a query's call)."""
        fn = getattr(owner, attr, None)
        if fn is None:
            return
        if isinstance(owner, type) and isinstance(vars(owner).get(attr), (classmethod, staticmethod)):
            raw = vars(owner)[attr].__func__
            kind = type(vars(owner)[attr])
        else:
            raw, kind = fn, None
        prof = self

        @functools.wraps(raw)
        def timed(*args, **kwargs):
            stack = getattr(prof.local, "stack", None)
            if stack is None:
                stack = prof.local.stack = []
            stack.append(0.0)
            at = time.monotonic()
            t0 = time.perf_counter()
            result = None
            try:
                result = raw(*args, **kwargs)
                return result
            finally:
                dt = time.perf_counter() - t0
                inner = stack.pop()
                if stack:
                    stack[-1] += dt
                own = dt - inner
                if moved is not None and result is not None:
                    other, seconds = moved(result)
                    if seconds:
                        seconds = min(max(seconds, 0.0), own)
                        prof.add(other, seconds, at)
                        own -= seconds
                prof.add(part, own, at)

        setattr(owner, attr, kind(timed) if kind is not None else timed)


def engine_time(result):
    completion = result[0] if isinstance(result, tuple) else result
    if completion is None or not hasattr(completion, "end_s"):
        return "engine", 0.0
    return "engine", completion.end_s - completion.start_s


def instrument(prof: Prof) -> None:
    """Timers around the parts of a query's path (whatever of them this checkout has)."""
    import rich.live

    import ipw.metering.meter
    import ipw.results
    import ipw.running.runner
    import ipw.telemetry.nvml
    import ipw.telemetry.snapshots
    import ipw.metering.window
    from ipw.telemetry.cpu_model import CpuModelSensor

    w = prof.wrap
    w(ipw.metering.window.Window, "begin", "edge")
    w(ipw.metering.window.Window, "end", "edge")
    w(ipw.metering.window.Window, "cut", "edge")
    w(ipw.telemetry.nvml.NvmlSensor, "begin", "edge: nvml")
    w(ipw.telemetry.nvml.NvmlSensor, "end", "edge: nvml")
    w(CpuModelSensor, "begin", "edge: cpu model")
    w(CpuModelSensor, "end", "edge: cpu model")
    w(CpuModelSensor, "cut", "edge: cpu model")
    counters = getattr(ipw.telemetry.snapshots, "Counters", None)
    if counters is not None:  # the CPU model's reads on its own thread (not in an old checkout)
        w(counters, "snap", "counter reads")
    segments = getattr(ipw.metering.meter, "Segments", None)
    if segments is not None:  # an older checkout's request events (today's cut the Window, timed above)
        w(segments, "event", "edge")
    w(ipw.running.runner, "run_query", "round trip", moved=engine_time)
    w(ipw.telemetry.nvml.PendingWindow, "result", "estimate")
    w(ipw.telemetry.nvml.PendingWindow, "resolve_all", "estimate")
    w(ipw.running.runner, "sensor_splits", "phase split")
    w(ipw.running.runner, "sensor_splits_many", "phase split")
    w(ipw.running.runner, "split_share", "split")
    w(ipw.running.runner, "make_record", "record")
    w(ipw.results.QueryRecord, "to_json", "serialise")
    w(ipw.results.RunFolder, "append", "write")
    w(ipw.results.RunFolder, "append_many", "write")
    w(os, "fsync", "fsync")
    w(time, "sleep", "sleep")
    w(rich.live.Live, "refresh", "progress")
    execute = ipw.running.runner.execute

    @functools.wraps(execute)
    def timed_execute(folder, config, queries, progress, *args, **kwargs):
        holder = type("H", (), {"cb": staticmethod(progress)})
        prof.wrap(holder, "cb", "progress")
        return execute(folder, config, queries, holder.cb, *args, **kwargs)

    ipw.running.runner.execute = timed_execute


# --- the child: ipw run, instrumented ---------------------------------------------------------------------

class _Patch:
    """What tests/nvml_fakes.make_fake needs of pytest's monkeypatch."""

    def setitem(self, mapping, key, value):
        mapping[key] = value

    def delenv(self, name, raising=True):
        os.environ.pop(name, None)


def fake_nvml(seconds: float) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from nvml_fakes import RealClock, make_fake, synthetic

    offset = time.monotonic_ns() - time.time_ns()
    # a busy GPU (400 W) for the whole run on the real clock: samples every 20 ms, counter every 100 ms
    sig, _ = synthetic(duration_s=seconds, t0_s=time.monotonic(), load=(0.0, seconds), offset_ns=offset)
    make_fake(_Patch(), [sig], RealClock())


def config_text(args, out_dir: Path, dataset: Path, level: int) -> str:
    from _shared import config_head

    common = config_head(dataset, out_dir, args.warmup, args.max_tokens)
    if args.engine == "fake":
        return common + f"""name = "fake"
kind = "fake"
model = "fake-{args.answer_ms:g}ms"
answer_ms = {args.answer_ms}
tokens = {args.tokens}
concurrency = [{level}]
"""
    return common + f"""name = "smollm2-135m"
kind = "llama-cpp"
model = "smollm2-135m"
mode = "chat"
n_threads = {args.n_threads}
n_ctx = 4096
n_gpu_layers = {args.n_gpu_layers}
"""


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's live threads, by name."""
    import psutil

    names = {t.native_id: Prof.thread() if t is threading.main_thread() else
             (t.name.rstrip("0123456789").rstrip("-_ ").split(" (")[0] or "thread") for t in threading.enumerate()}
    names[threading.main_thread().native_id] = "measuring"
    out: dict[str, float] = collections.defaultdict(float)
    for t in psutil.Process().threads():
        out[names.get(t.id, "ended or native")] += t.user_time + t.system_time
    return dict(out)


def child(args) -> int:
    import resource

    if args.nvml == "fake":
        fake_nvml(seconds=args.queries * (args.answer_ms / 1000 + 0.05) + 120)
    if args.engine == "fake":
        os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
        import fake_engine

        fake_engine.register()
    import ipw
    import ipw.cli

    if args.nvml == "none":
        import ipw.telemetry.nvml

        ipw.telemetry.nvml.NvmlSensor.probe = classmethod(lambda cls, *a, **k: None)
    prof = Prof()
    instrument(prof)
    tmp = Path(tempfile.mkdtemp(prefix="ipw-breakdown-"))
    cfg = tmp / "run.toml"
    cfg.write_text(config_text(args, tmp / "runs", Path(args.dataset_file), args.level), encoding="utf-8")
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    rc = ipw.cli.main(["run", str(cfg)])
    wall = time.monotonic() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    threads = thread_cpu()
    run_dir = next((tmp / "runs").iterdir())
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text(encoding="utf-8").splitlines()]
    manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    out = {
        "rc": rc, "ipw": str(Path(ipw.__file__).resolve().parent), "process_wall_s": wall,
        "process_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
        "threads_cpu_s": threads,
        "events": prof.events,
        "records": [{k: r[k] for k in ("start_s", "end_s", "latency_s", "completion_tokens", "error", "energy_source",
                                       "energy_quality")} for r in records],
        "sensors": [s["name"] for b in manifest.get("backends", []) for s in b.get("sensors", [])],
        "sampler_overhead": [b.get("sampler_overhead") for b in manifest.get("backends", [])],
        "status": manifest.get("status"),
    }
    Path(args.child).write_text(json.dumps(out), encoding="utf-8")
    return 0


# --- the parent -----------------------------------------------------------------------------------------------

def bare_loop(args, prompts: list[str], level: int) -> dict:
    """The fake engine called directly, ``level`` at a time (no worker, no sensor, no record)."""
    from fake_engine import answer

    def one(prompt: str):
        return answer(prompt, args.answer_ms, args.tokens)

    t0 = time.monotonic()
    if level == 1:
        done = [one(p) for p in prompts]
    else:
        with ThreadPoolExecutor(max_workers=level) as pool:
            done = list(pool.map(one, prompts))
    wall = time.monotonic() - t0
    return {"loop_wall_s": wall, "engine_s": sum(c.end_s - c.start_s for c in done), "n": len(done)}


def summarise(res: dict, n: int) -> dict:
    recs = sorted(res["records"], key=lambda r: r["start_s"])
    lo, hi = min(r["start_s"] for r in recs), max(r["end_s"] for r in recs)
    loop = hi - lo
    engine = sum(r["latency_s"] for r in recs)
    parts: dict[str, dict[str, float]] = collections.defaultdict(dict)
    outside: dict[str, float] = collections.defaultdict(float)
    for thread, part, at_s, seconds in res["events"]:
        # the query loop: from just before the first window (its begin edge) to the end of the last
        if lo - 0.05 <= at_s <= hi:
            parts[part][thread] = parts[part].get(thread, 0.0) + seconds
        else:
            outside[part] += seconds
    return {
        "n": len(recs), "errors": sum(1 for r in recs if r["error"]), "loop_wall_s": loop, "engine_s": engine,
        "added_ms_per_query": 1000 * (loop - engine) / len(recs) if recs else float("nan"),
        "ms_per_query": {p: {t: 1000 * s / n for t, s in by.items()} for p, by in parts.items()},
        "outside_loop_s": dict(outside),
        "threads_cpu_ms_per_query": {t: 1000 * s / n for t, s in res["threads_cpu_s"].items()},
        "process_cpu_ms_per_query": 1000 * res["process_cpu_s"] / n,
        "energy_sources": sorted({r["energy_source"] for r in recs}),
        "sensors": res["sensors"], "status": res["status"], "ipw": res["ipw"],
        "sampler_overhead": res["sampler_overhead"],
    }


def dataset_file(args, tmp: Path) -> Path:
    """The queries: the first ``--queries`` (+ warm-up) of ipw-core for llama; short generated prompts
    for the fake engine (as many as asked)."""
    path = tmp / "queries.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        if args.engine == "llama":
            src = ROOT / "ipw" / "data" / "ipw-core.jsonl"
            for line in src.read_text(encoding="utf-8").splitlines()[: args.queries]:
                fh.write(line + "\n")
        else:
            for i in range(args.queries):
                fh.write(json.dumps({"id": f"q{i:07d}", "prompt": f"What is {i % 97} + {i % 89}?",
                                     "answer": str(i % 97 + i % 89), "scorer": "numeric"}) + "\n")
    return path


def checkout_of_ipw() -> Path:
    spec = importlib.util.find_spec("ipw")
    if spec is None or spec.origin is None:
        raise SystemExit("no ipw package on the path (PYTHONPATH=CHECKOUT)")
    return Path(spec.origin).resolve().parents[1]


def measure(args) -> dict:
    from _shared import Child

    checkout = checkout_of_ipw()
    out: dict = {"machine": machine(), "load_before": os.getloadavg(), "checkout": str(checkout),
                 "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "child"}, "levels": {}}
    with tempfile.TemporaryDirectory(prefix="ipw-breakdown-") as tmp_name:
        tmp = Path(tmp_name)
        data = dataset_file(args, tmp)
        prompts = [json.loads(line)["prompt"] for line in data.read_text(encoding="utf-8").splitlines()]
        for level in args.concurrency:
            entry: dict = {}
            if args.engine == "fake":
                entry["bare"] = bare_loop(args, prompts, level)
            res_path = tmp / f"child-{level}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(res_path), "--level", str(level),
                   "--dataset-file", str(data), *child_argv(args)]
            # in another checkout's folder (``python -m`` in the engine worker puts the working folder
            # first on its path: it must be the code under test)
            c = Child(cmd, pty=args.pty, env=None, cwd=checkout)
            c.wait()
            if c.rc != 0 or not res_path.exists():
                raise SystemExit(f"the instrumented run failed (rc {c.rc}):\n{c.output()[-4000:]}")
            entry["ipw"] = summarise(json.loads(res_path.read_text(encoding="utf-8")), args.queries)
            entry["load_after"] = os.getloadavg()
            if "bare" in entry:
                b, w = entry["bare"], entry["ipw"]
                entry["wall_ratio"] = w["loop_wall_s"] / b["loop_wall_s"]
                entry["added_ms_vs_bare"] = 1000 * (w["loop_wall_s"] - b["loop_wall_s"]) / args.queries
            out["levels"][str(level)] = entry
    return out


def child_argv(args) -> list[str]:
    return ["--engine", args.engine, "--queries", str(args.queries), "--answer-ms", str(args.answer_ms),
            "--tokens", str(args.tokens), "--warmup", str(args.warmup), "--max-tokens", str(args.max_tokens),
            "--n-threads", str(args.n_threads), "--n-gpu-layers", str(args.n_gpu_layers), "--nvml", args.nvml]


def machine() -> str:
    from _shared import machine as m

    try:
        import subprocess

        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        gpu = []
    return m() + (f", {gpu[0]}" if gpu else "")


ORDER = ["edge", "edge: nvml", "edge: cpu model", "counter reads", "round trip", "estimate", "phase split", "split", "record", "serialise",
         "write", "fsync", "progress", "sleep"]


def table(res: dict) -> str:
    """Markdown: per level, the parts in ms per query on the measuring thread and on other threads."""
    lines = []
    for level, e in res["levels"].items():
        w = e["ipw"]
        head = (f"concurrency {level}: {w['n']} queries, " + (
            f"ipw adds **{w['added_ms_per_query']:.2f} ms/query** (loop wall {w['loop_wall_s']:.2f} s - engine "
            f"{w['engine_s']:.2f} s)" if level == "1" else f"loop wall {w['loop_wall_s']:.2f} s"))
        if "bare" in e:
            head += (f"; bare loop {e['bare']['loop_wall_s']:.2f} s, wall ratio ipw/bare **{e['wall_ratio']:.3f}** "
                     f"(+{e['added_ms_vs_bare']:.2f} ms/query)")
        lines += [head, "", "| part | measuring thread ms/query | other threads ms/query (which) |", "|---|---|---|"]
        parts = w["ms_per_query"]
        for p in ORDER + sorted(set(parts) - set(ORDER) - {"engine"}):
            if p not in parts:
                continue
            by = parts[p]
            others = {t: v for t, v in by.items() if t != "measuring" and v >= 0.0005}
            lines.append(f"| {p} | {by.get('measuring', 0.0):.3f} | "
                         + (", ".join(f"{v:.3f} ({t})" for t, v in sorted(others.items(), key=lambda kv: -kv[1]))
                            or "-") + " |")
        attributed = sum(v.get("measuring", 0.0) for p, v in parts.items() if p not in ("engine", "edge: nvml",
                                                                                          "edge: cpu model"))
        lines.append(f"| (sum on the measuring thread; `edge: ...` rows are inside `edge`) | {attributed:.3f} | |")
        lines.append("")
        lines.append("CPU ms per query by thread: " + ", ".join(
            f"{t} {v:.2f}" for t, v in sorted(w["threads_cpu_ms_per_query"].items(), key=lambda kv: -kv[1]))
            + f"; whole process {w['process_cpu_ms_per_query']:.2f}. Sensors: {', '.join(w['sensors'])}; "
            f"energy sources {', '.join(w['energy_sources'])}; errors {w['errors']}; status {w['status']}.")
        lines.append("")
    return "\n".join(lines)


def compare_table(old: dict, new: dict) -> str:
    """Markdown: the parts per query before (``old``) and after (``new``), level by level."""
    lines = []
    for level in new["levels"]:
        if level not in old["levels"]:
            continue
        o, n = old["levels"][level], new["levels"][level]
        ow, nw = o["ipw"], n["ipw"]
        lines.append(f"concurrency {level}, {nw['n']} queries:")
        lines.append("")
        lines += ["| part | before: measuring thread ms/query | after: measuring thread ms/query | "
                  "after: other threads ms/query |", "|---|---|---|---|"]
        op, np_ = ow["ms_per_query"], nw["ms_per_query"]
        for p in ORDER + sorted((set(op) | set(np_)) - set(ORDER) - {"engine"}):
            if p not in op and p not in np_:
                continue
            # other threads' sleeps are idle time, not a cost
            other = 0.0 if p == "sleep" else sum(v for t, v in np_.get(p, {}).items() if t != "measuring")
            lines.append(f"| {p} | {op.get(p, {}).get('measuring', 0.0):.3f} | {np_.get(p, {}).get('measuring', 0.0):.3f} "
                         f"| {other:.3f} |")
        if level == "1":
            lines.append(f"| **ipw's added time per query** (loop wall - engine time) / queries | "
                         f"**{ow['added_ms_per_query']:.2f}** | **{nw['added_ms_per_query']:.2f}** | |")
        for side, e in (("before", o), ("after", n)):
            if "wall_ratio" in e:
                lines.append(f"| loop wall ratio ipw / bare, {side} | {e['wall_ratio']:.3f} "
                             f"(+{e['added_ms_vs_bare']:.2f} ms/query) | | |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("fake", "llama"), default="fake")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1])
    parser.add_argument("--answer-ms", type=float, default=20.0, help="the fake engine's answer time")
    parser.add_argument("--tokens", type=int, default=16, help="the fake engine's output tokens")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--n-threads", type=int, default=4)
    parser.add_argument("--n-gpu-layers", type=int, default=-1)
    parser.add_argument("--nvml", choices=("fake", "real", "none"), default=None,
                        help="default: real where nvidia-smi exists, else fake")
    parser.add_argument("--no-pty", dest="pty", action="store_false")
    parser.add_argument("--json", type=Path, help="write the raw result here")
    parser.add_argument("--label", default="", help="a name for this measurement in the output (e.g. old, new)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OLD_JSON", "NEW_JSON"),
                        help="print the before/after table of two saved --json results (no run)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--level", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--dataset-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.nvml is None:
        import shutil

        args.nvml = "real" if shutil.which("nvidia-smi") else "fake"
    if args.child:
        return child(args)
    if args.compare:
        old, new = (json.loads(p.read_text(encoding="utf-8")) for p in args.compare)
        print(compare_table(old, new))
        return 0
    if args.engine == "llama" and any(c != 1 for c in args.concurrency):
        raise SystemExit("--engine llama: llama-cpp-python answers one query at a time (--concurrency 1)")
    res = measure(args)
    res["label"] = args.label
    text = table(res)
    print(f"# harness breakdown {args.label} ({res['checkout']}; {res['machine']}; load {res['load_before']})\n")
    print(text)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
