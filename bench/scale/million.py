"""A million queries through ``ipw run`` with the fake engine: memory, files, resume, compare, report.

1. writes a query set of ``--queries`` (10^6) short prompts (``What is A + B?``, numeric scorer);
2. ``ipw run`` on it with the fake engine of ``bench/overhead/fake_engine.py`` (in ipw's engine worker, answering
   in ``--answer-ms``), the machine's default sensors, no warm-up, no idle baseline; the resident memory
   of ipw and its worker is sampled every ``--every-s`` seconds (psutil, the process tree);
3. at ``--kill-at`` records (500,000) the run gets SIGKILL (its whole process group), then
   ``ipw run --resume`` continues it: the time from the resume's spawn to the start of its first query
   (the first new record's ``start_s``, on the same monotonic clock) is the "sending again" figure;
4. when the run is complete: records.jsonl (lines, every query exactly once) and records.parquet;
5. ``ipw compare RUN`` and ``ipw report RUN`` timed, with their peak RSS (``wait4``).

Writes a small summary (JSON) and prints it; the run folder is left in ``--work`` (large: delete it).

    nice -n 10 .venv/bin/python bench/scale/million.py --work /tmp/ipw-million --out bench/evidence/scale/million/summary.json
    .venv/bin/python bench/scale/million.py --queries 20000 --kill-at 10000 --work /tmp/m --out /tmp/m.json  # a try
    .venv/bin/python bench/scale/million.py --analyse /tmp/ipw-million/runs/RUN --work /tmp/ipw-million --out ...
        # time compare and report of a finished run again

Output: the ``--out`` summary (JSON), bench/evidence/scale/million/summary.json for the committed figures; they are in
    docs/PERFORMANCE.md, "A million queries".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py
FAKE = ROOT / "bench" / "overhead"  # fake_engine.py
IPW = [sys.executable, "-m", "ipw.cli"]
IPW_FAKE = [sys.executable, str(FAKE / "fake_engine.py")]  # ipw with the fake engine registered


def write_queries(path: Path, n: int) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            a, b = i % 97, (i // 97) % 89
            fh.write(f'{{"id": "q{i:07d}", "prompt": "What is {a} + {b}?", "answer": "{a + b}", '
                     f'"category": "c{i % 7}", "scorer": "numeric"}}\n')


def config(args, work: Path, queries: Path) -> Path:
    cfg = work / "million.toml"
    cfg.write_text(f"""dataset = "{queries}"
repeats = 1
warmup = 0
idle_s = 0
out_dir = "{work / 'runs'}"

[generation]
max_tokens = 4
temperature = 0.0

[[backends]]
name = "fake"
kind = "fake"
model = "fake-{args.answer_ms:g}ms"
answer_ms = {args.answer_ms}
tokens = 4
""", encoding="utf-8")
    return cfg


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(FAKE), str(ROOT), *filter(None, [e.get("PYTHONPATH")])])
    return e


class Memory(threading.Thread):
    """RSS of a process and its descendants every ``every_s`` (MB), with the records written so far."""

    def __init__(self, every_s: float, log: Path, t0: float) -> None:
        super().__init__(daemon=True)
        self.every_s, self.log, self.t0 = every_s, log, t0
        self.pid: int | None = None
        self.samples: list[tuple[float, float, float, int]] = []  # t, ipw MB, worker(s) MB, records
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        while not self.stop.wait(self.every_s):
            if self.pid is None:
                continue
            try:
                root = psutil.Process(self.pid)
                kids = root.children(recursive=True)
                main = root.memory_info().rss / 1e6
                others = sum(k.memory_info().rss for k in kids) / 1e6
            except psutil.Error:
                continue
            self.samples.append((round(time.monotonic() - self.t0, 1), round(main, 1), round(others, 1),
                                 lines(self.log)))


_counted: dict[Path, tuple[int, int]] = {}


def lines(path: Path) -> int:
    """Newlines in a growing file (reads only what was added since the last call)."""
    offset, count = _counted.get(path, (0, 0))
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            while chunk := fh.read(1 << 22):
                count += chunk.count(b"\n")
                offset += len(chunk)
    except FileNotFoundError:
        return 0
    _counted[path] = (offset, count)
    return count


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def timed(cmd: list[str], log: Path) -> dict:
    """Run to its end; wall seconds, peak RSS (MB) of the process, exit code."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
    return {"wall_s": round(time.monotonic() - t0, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
            "rc": os.waitstatus_to_exitcode(status), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "load_before": os.getloadavg()[0]}


def first_start_after(log: Path, offset: int) -> float | None:
    with open(log, "rb") as fh:
        fh.seek(offset)
        line = fh.readline()
    return json.loads(line)["start_s"] if line.endswith(b"\n") else None


def resume_again(run_dir: Path, work: Path, records: int, times: int) -> list[dict]:
    """``--resume`` of a copy of a finished run cut back to ``records`` records (as if killed there), timed
    ``times`` times to its first query and then killed: the resume figure again, at another moment."""
    import shutil

    out = []
    for k in range(times):
        copy = work / f"resume-again-{k}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(run_dir, copy)
        log = copy / "records.jsonl"
        with open(run_dir / "records.jsonl", "rb") as src, open(log, "wb") as dst:
            for _, line in zip(range(records), src):
                dst.write(line)
        (copy / "records.parquet").unlink(missing_ok=True)
        manifest = json.loads((copy / "manifest.json").read_text(encoding="utf-8"))
        manifest["status"] = "running"  # what a killed run leaves
        (copy / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
        size = log.stat().st_size
        load = os.getloadavg()[0]
        t0 = time.monotonic()
        proc = start([*IPW_FAKE, "run", "--resume", str(copy)], work / "resume-again.log")
        first = None
        while first is None and proc.poll() is None:
            if log.stat().st_size > size:
                first = first_start_after(log, size)
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        out.append({"records": records, "spawn_to_first_query_s": None if first is None else round(first - t0, 2),
                    "load_before": load})
        shutil.rmtree(copy, ignore_errors=True)
    return out


def analyse(run_dir: Path, work: Path) -> dict:
    """``ipw compare RUN`` and ``ipw report RUN``, timed."""
    return {"compare": timed([*IPW, "compare", str(run_dir)], work / "compare.log"),
            "report": timed([*IPW, "report", str(run_dir), "--out", str(work / "report.html")], work / "report.log")}


def first_part(args, work: Path, out_log: Path, mem: Memory, loads: list, t0: float) -> tuple[dict, Path, Path]:
    """Step 1: the query set, the config, ``ipw run`` killed at ``--kill-at`` records."""
    summary: dict = {"machine": f"{os.cpu_count()} logical CPUs, {platform.processor() or platform.machine()}, "
                                f"Python {platform.python_version()}", "nice": os.nice(0),
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": {k: str(v) for k, v in vars(args).items()}}
    try:
        from ipw.telemetry.cpu_model import cpu_model_name

        summary["machine"] = f"{os.cpu_count()} logical CPUs, {cpu_model_name()}, Python {platform.python_version()}"
    except Exception:
        pass
    queries = work / "queries.jsonl"
    tq = time.monotonic()
    write_queries(queries, args.queries)
    summary["dataset"] = {"queries": args.queries, "bytes": queries.stat().st_size, "write_s": round(time.monotonic() - tq, 1)}
    cfg = config(args, work, queries)

    # 1. the run, killed at --kill-at records
    t_run = time.monotonic()
    proc = start([*IPW_FAKE, "run", str(cfg)], out_log)
    mem.pid = proc.pid
    run_dir = None
    while run_dir is None:
        found = list((work / "runs").glob("*/manifest.json")) if (work / "runs").exists() else []
        if found:
            run_dir = found[0].parent
        elif proc.poll() is not None:
            raise SystemExit(f"ipw run ended before its folder: {out_log.read_text()[-3000:]}")
        time.sleep(0.2)
    log = run_dir / "records.jsonl"
    mem.log = log
    while lines(log) < args.kill_at:
        if proc.poll() is not None:
            raise SystemExit(f"ipw run ended at {lines(log)} records: {out_log.read_text()[-3000:]}")
        if not loads or time.monotonic() - t0 - loads[-1][0] > 30:
            loads.append((round(time.monotonic() - t0), os.getloadavg()[0]))
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = lines(log)
    summary["first_part"] = {"records_at_kill": killed_at, "wall_s": round(time.monotonic() - t_run, 1),
                             "queries_per_s": round(killed_at / (time.monotonic() - t_run), 1)}

    return summary, run_dir, log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=1_000_000)
    parser.add_argument("--kill-at", type=int, default=500_000)
    parser.add_argument("--answer-ms", type=float, default=0.0)
    parser.add_argument("--every-s", type=float, default=10.0)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--resume-again", type=Path, metavar="RUN_DIR",
                        help="only time --resume of copies of this finished run cut back to --kill-at records")
    parser.add_argument("--times", type=int, default=2)
    parser.add_argument("--analyse", type=Path, metavar="RUN_DIR", help="only time compare and report of this run")
    parser.add_argument("--stop-after-kill", action="store_true",
                        help="stop after the kill (the summary so far goes to --out); --resume-killed goes on")
    parser.add_argument("--resume-killed", type=Path, metavar="RUN_DIR",
                        help="resume a run that --stop-after-kill left (perhaps with other code) and go on as usual")
    args = parser.parse_args(argv)
    work = args.work.resolve()
    if args.analyse:
        summary = json.loads(args.out.read_text(encoding="utf-8")) if args.out.exists() else {}
        res = analyse(args.analyse.resolve(), work)
        summary["analyse_again"] = summary.get("analyse_again", []) + [res]
        args.out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
        print(json.dumps(res))
        return 0
    if args.resume_again:
        res = resume_again(args.resume_again.resolve(), work, args.kill_at, args.times)
        summary = json.loads(args.out.read_text(encoding="utf-8")) if args.out.exists() else {}
        summary["resume_again"] = summary.get("resume_again", []) + res
        args.out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
        print(json.dumps(res))
        return 0
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    out_log = work / "ipw.log"
    loads: list[tuple[float, float]] = []
    mem = Memory(args.every_s, Path("/nonexistent"), t0)
    mem.start()
    last_load = 0.0
    if args.resume_killed:
        summary = json.loads(args.out.read_text(encoding="utf-8"))
        summary["resumed_separately"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        loads = [tuple(x) for x in summary.pop("load_1min_first_part", [])]
        mem.samples = [tuple(x) for x in summary.pop("memory_samples_first_part", [])]
        run_dir = args.resume_killed.resolve()
        log = run_dir / "records.jsonl"
        mem.log = log
    else:
        summary, run_dir, log = first_part(args, work, out_log, mem, loads, t0)
        if args.stop_after_kill:
            summary["run_dir"] = str(run_dir)
            summary["load_1min_first_part"] = loads
            summary["memory_samples_first_part"] = mem.samples
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
            print(json.dumps(summary, indent=1))
            return 0

    # 2. resume: time to the first query sent again
    size_before = log.stat().st_size
    t_resume = time.monotonic()
    proc = start([*IPW_FAKE, "run", "--resume", str(run_dir)], out_log)
    mem.pid = proc.pid
    first = None
    while first is None:
        if log.stat().st_size > size_before:
            first = first_start_after(log, size_before)
        if proc.poll() is not None and first is None:
            raise SystemExit(f"resume ended without a record: {out_log.read_text()[-3000:]}")
        time.sleep(0.01)
    summary["resume"] = {"spawn_to_first_query_s": round(first - t_resume, 2),
                         "spawn_to_first_record_on_disk_s": round(time.monotonic() - t_resume, 2),
                         "load_1min": os.getloadavg()[0]}
    while proc.poll() is None:
        if time.monotonic() - last_load > 30:
            loads.append((round(time.monotonic() - t0), os.getloadavg()[0]))
            last_load = time.monotonic()
        time.sleep(0.5)
    mem.stop.set()
    summary["second_part"] = {"rc": proc.returncode, "wall_s": round(time.monotonic() - t_resume, 1)}
    manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    ids = set()
    dup = 0
    with open(log, encoding="utf-8") as fh:
        for line in fh:
            qid = json.loads(line)["query_id"]
            dup += qid in ids
            ids.add(qid)
    summary["files"] = {
        "status": manifest["status"], "records_jsonl_lines": lines(log), "distinct_queries": len(ids),
        "duplicates": dup, "records_jsonl_mb": round(log.stat().st_size / 1e6, 1),
        "records_parquet_mb": round((run_dir / "records.parquet").stat().st_size / 1e6, 1)
        if (run_dir / "records.parquet").exists() else None,
    }
    samples = mem.samples
    summary["memory"] = {
        "every_s": args.every_s, "samples": len(samples),
        "ipw_rss_mb_min_max": [min(s[1] for s in samples), max(s[1] for s in samples)] if samples else None,
        "worker_rss_mb_min_max": [min(s[2] for s in samples), max(s[2] for s in samples)] if samples else None,
        # after the last record: records.parquet being written (RunFolder.finish)
        "ipw_rss_mb_max_after_last_record": max((s[1] for s in samples if s[3] >= args.queries), default=None),
        # growth between the first and last tenth of each part (the run before the kill, the resume)
        "trace": samples[:: max(1, len(samples) // 40)],
    }
    summary["load_1min"] = loads

    # 3. compare and report on the result
    summary.update(analyse(run_dir, work))
    summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    summary["total_s"] = round(time.monotonic() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in summary.items() if k != "memory"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
