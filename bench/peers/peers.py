"""ipw against Zeus, CodeCarbon and the bare begin/end counter on the same GPU work, each window measured by
every tool at once, against a reference none of them produces: the NVML energy counter read back to back by a
process of its own (``bench/telemetry/gpu_counter.py``) on the same monotonic clock (issue 59).  NVIDIA GPU only.

    PYTHONPATH=.:/tmp/peers/site python3 bench/peers/peers.py windows --out DIR [--deadline-s 300]
    PYTHONPATH=.:/tmp/peers/site python3 bench/peers/peers.py overhead --out DIR [--rounds 3]
    PYTHONPATH=.:/tmp/peers/site python3 bench/peers/peers.py queries --url http://127.0.0.1:PORT --out DIR
    python3 bench/peers/tables.py windows overhead queries DIR   # the tables of docs/PEERS.md from DIR's files

``windows`` (table 1): a GPU load runs without a break on a thread of its own (bf16 matrix products; copies
of a 1 GiB buffer; a decode-like chain of matrix-vector products over 12 GiB of weights) while the main
thread opens windows of 50 ms, 0.15 s, 0.5 s, 2 s and 8 s: every tool begins (ipw, Zeus, Zeus with
``approx_instant_energy``, CodeCarbon's task, the bare counter; which one first rotates from window to window),
the window's length passes, every tool ends in the reverse order.  ipw is one ``ipw.Monitor`` opened at the
start, as Zeus's ``ZeusMonitor`` and CodeCarbon's tracker are, with a block per window whose result is read when
the rows are written (the runs of docs/PEERS.md up to the H100 rerun used one ``ipw.measure`` per window instead:
the sensors probed, opened and closed each time, and each block's end waiting for the driver's samples).
The load is steady across each block, so the reference (the counter's steps, interpolated) is exact at every
step and holds the block's power between them.  Each tool's window is its own
(from its begin's return to its end's call); its reference is the counter over that span.

``overhead`` (table 4): a decode-like loop (120 matrix-vector products of 576x576 bf16 a token, launch-bound,
as a 135M model at batch 1), 64 tokens a query, each query in a window of the tool under test; rounds
A B C D then D C B A (bare, ipw, Zeus, CodeCarbon), tokens/s inside the windows and over the loop.

``queries`` (table 2): 150 short and 30 long chat requests to a llama-server on the GPU, each query measured
by every tool at once, as in ``windows``.

The peers are never dependencies of ipw: bench/peers/peers_h200.sh carries their pinned wheels to the device.

Output: DIR/windows.csv, DIR/overhead.csv, DIR/queries.csv with DIR/counter-windows.csv.gz and
    DIR/counter-queries.csv.gz (the reference), DIR/ipw-samples-queries.csv.gz (ipw's own NVML points over
    the queries) and DIR/meta.json; ``tables`` prints the tables of docs/PEERS.md (evidence in bench/evidence/peers/).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LENGTHS_S = (0.05, 0.15, 0.5, 2.0, 8.0)
TOOLS = ("ipw", "zeus", "zeus-approx", "codecarbon", "bare")
J_PER_KWH = 3.6e6


# --------------------------------------------------------------------------------------------- the tools
Energy = float | None | Callable[[], float | None]  # J, no figure, or a function that gives it once final


class Tool:
    """One energy tool: ``begin()``, then ``end()`` returns its GPU energy of the window (J, None: no figure), or a
    function that returns it once the tool has made it final (ipw's blocks: see ``final``)."""

    name = ""

    def begin(self) -> None:
        raise NotImplementedError

    def end(self) -> Energy:
        raise NotImplementedError


def final(energy: Energy) -> float | None:
    """A window's figure: ``energy``, or what its function returns (None, said on stdout, when that fails)."""
    if not callable(energy):
        return energy
    try:
        return energy()
    except Exception as e:
        print(f"a late energy figure failed: {e}", flush=True)
        return None


class Ipw(Tool):
    """ipw as a harness that measures query after query uses it: one ``ipw.Monitor`` (its sensors opened once, as
    Zeus's monitor), a block per window; a block's end only stamps the time, and its result is read when the rows
    are written (``final``), all at once."""

    name = "ipw"

    def __init__(self) -> None:
        import ipw

        self.monitor = ipw.Monitor(gpus=[0], rapl=False)
        self.block: Any = None

    def begin(self) -> None:
        self.block = self.monitor.measure()
        self.block.__enter__()

    def end(self) -> Energy:
        block = self.block
        block.__exit__(None, None, None)

        def gpu_j() -> float | None:
            gpu = [p for p in block.result.parts if p.component.startswith("gpu")]
            return gpu[0].energy_j if gpu else None

        return gpu_j

    def write_samples(self, path: Path) -> None:
        """ipw's own NVML points (the driver's samples, its counter and instant reads) over the monitor's life, as
        gzipped CSV: what table 2's second reference (tables.py ``idle_closure``) bounds, measured."""
        cols = self.monitor.trace()
        with gzip.open(path, "wt", newline="") as f:
            w = csv.writer(f)
            w.writerow(list(cols))
            w.writerows(zip(*cols.values()))


class Zeus(Tool):
    def __init__(self, approx: bool) -> None:
        from zeus.monitor import ZeusMonitor

        self.name = "zeus-approx" if approx else "zeus"
        # window edges are the host's: the load runs on a thread of its own, so no synchronisation at the edges
        self.mon = ZeusMonitor(gpu_indices=[0], cpu_indices=[], approx_instant_energy=approx)

    def begin(self) -> None:
        self.mon.begin_window("w", sync_execution=False)

    def end(self) -> float | None:
        return float(self.mon.end_window("w", sync_execution=False).gpu_energy[0])


class CodeCarbon(Tool):
    """CodeCarbon's task mode (``start_task``/``stop_task``): the one meant to isolate a piece of work inside a
    run; its GPU energy is the NVML counter's delta over the task (codecarbon/core/gpu_device.py)."""

    name = "codecarbon"

    def __init__(self) -> None:
        from codecarbon import OfflineEmissionsTracker

        self.tracker = OfflineEmissionsTracker(country_iso_code="USA", gpu_ids=[0], save_to_file=False,
                                               log_level="error", allow_multiple_runs=True, tracking_mode="machine")

    def begin(self) -> None:
        self.tracker.start_task("w")

    def end(self) -> float | None:
        data = self.tracker.stop_task("w")
        return None if data is None else float(data.gpu_energy) * J_PER_KWH


class Bare(Tool):
    """The bare method: the NVML counter read at the window's begin and end."""

    name = "bare"

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.read = lambda h=pynvml.nvmlDeviceGetHandleByIndex(0): pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
        self.start = 0

    def begin(self) -> None:
        self.start = self.read()

    def end(self) -> float | None:
        return (self.read() - self.start) / 1000.0


def make_tools(names: tuple[str, ...]) -> tuple[list[Tool], dict[str, str]]:
    """The tools that start here, and for each that does not, why (a peer is never dropped silently)."""
    makers: dict[str, Callable[[], Tool]] = {"ipw": Ipw, "zeus": lambda: Zeus(False), "zeus-approx": lambda: Zeus(True),
                                             "codecarbon": CodeCarbon, "bare": Bare}
    tools, failed = [], {}
    for n in names:
        try:
            tools.append(makers[n]())
        except Exception as e:  # any failure of a peer is a finding to report
            failed[n] = f"{type(e).__name__}: {e}"[:400]
            print(f"{n}: cannot start: {failed[n]}", flush=True)
    return tools, failed


def measured(tools: list[Tool], body: Callable[[], None]) -> list[dict[str, Any]]:
    """Every tool begins (in order), ``body`` runs, every tool ends (reverse order); each tool's own edges."""
    edges: dict[str, float] = {}
    for t in tools:
        t.begin()
        edges[t.name] = time.monotonic()
    body()
    rows = []
    for t in reversed(tools):
        end_s = time.monotonic()
        try:
            j = t.end()
        except Exception as e:
            print(f"{t.name}: end failed: {e}", flush=True)
            j = None
        rows.append({"tool": t.name, "start_s": edges[t.name], "end_s": end_s, "energy_j": j})
    return rows


# --------------------------------------------------------------------------------------------- GPU loads
def gpu_load(kind: str) -> Callable[[], None]:
    """One unit of a load (a few ms of GPU work, synchronised)."""
    import torch

    dev = torch.device("cuda")
    if kind == "matmul":
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

        def unit() -> None:
            for _ in range(4):
                a @ b
            torch.cuda.synchronize()
    elif kind == "memcopy":
        src = torch.randn(1 << 28, device=dev)  # 1 GiB of float32
        dst = torch.empty_like(src)

        def unit() -> None:
            for _ in range(4):
                dst.copy_(src)
            torch.cuda.synchronize()
    elif kind in ("decode", "decode-small"):
        n, layers = (8192, 96) if kind == "decode" else (576, 120)
        w = [torch.randn(n, n, device=dev, dtype=torch.bfloat16) / n ** 0.5 for _ in range(layers)]
        x0 = torch.randn(n, 1, device=dev, dtype=torch.bfloat16)

        def unit() -> None:  # one token
            x = x0
            for m in w:
                x = m @ x
            torch.cuda.synchronize()
    else:
        raise SystemExit(f"unknown load {kind}")
    return unit


class Background:
    """A load on a thread of its own, without a break, until ``stop``."""

    def __init__(self, unit: Callable[[], None]) -> None:
        self.unit = unit
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.halt.is_set():
            self.unit()

    def __enter__(self) -> "Background":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.thread.join()


class Counter:
    """The reference: bench/telemetry/gpu_counter.py in a process of its own."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "bench/telemetry/gpu_counter.py"), str(path)])
        time.sleep(1.0)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        with open(self.path, "rb") as f, gzip.open(f"{self.path}.gz", "wb", compresslevel=9) as g:
            shutil.copyfileobj(f, g)
        self.path.unlink()


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """The rows as CSV, each ``energy_j`` made final first (``final``)."""
    rows = [{**r, "energy_j": final(r["energy_j"])} if "energy_j" in r else r for r in rows]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def meta(out: Path, failed: dict[str, str], **extra: Any) -> None:
    import torch

    versions = {}
    for dist in ("zeus", "codecarbon", "aiperf", "nvidia-ml-py", "torch"):
        try:
            from importlib.metadata import version

            versions[dist] = version(dist)
        except Exception:
            versions[dist] = None
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,power.limit,memory.total", "--format=csv"],
                         capture_output=True, text=True).stdout
    old = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
    old.update({"gpu": torch.cuda.get_device_name(0), "nvidia_smi": smi, "versions": versions,
                "failed": {**old.get("failed", {}), **failed}, **extra})
    (out / "meta.json").write_text(json.dumps(old, indent=1))


# --------------------------------------------------------------------------------------------- table 1
def windows(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tools, failed = make_tools(TOOLS)
    counter = Counter(out / "counter-windows.csv")
    deadline = time.monotonic() + args.deadline_s
    # windows per length in one round of a load block: the short ones are cheap, so more of them
    per_round = {0.05: 4, 0.15: 4, 0.5: 2, 2.0: 1, 8.0: 1}
    rows: list[dict[str, Any]] = []
    units = {k: gpu_load(k) for k in ("matmul", "memcopy", "decode")}
    try:
        r = 0
        while time.monotonic() < deadline:
            for kind, unit in units.items():
                lengths = [x for x in LENGTHS_S for _ in range(per_round[x])]
                if r % 2:
                    lengths.reverse()
                with Background(unit):
                    time.sleep(0.6)  # the power settles at the block's level
                    for i, length in enumerate(lengths):
                        if time.monotonic() + length + 2 > deadline:
                            break
                        # each window rotates which tool begins first (its window then holds the others'
                        # begin and end calls), so that no tool is always the outermost
                        k = (r * len(lengths) + i) % len(tools)
                        for row in measured(tools[k:] + tools[:k], lambda s=length: time.sleep(s)):
                            rows.append({"load": kind, "length_s": length, "round": r, "i": i, **row})
                    time.sleep(0.3)
                time.sleep(0.5)
                print(f"round {r} {kind}: {len(rows)} rows, {deadline - time.monotonic():.0f} s left", flush=True)
            r += 1
    finally:
        counter.stop()
        if rows:
            write_rows(out / "windows.csv", rows)
        meta(out, failed, windows={"per_round": {str(k): v for k, v in per_round.items()}, "rounds": r})


# --------------------------------------------------------------------------------------------- table 4
def overhead(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = ("ipw", "zeus", "codecarbon")
    tools, failed = make_tools(names)
    by_name = {t.name: t for t in tools}
    token = gpu_load("decode-small")
    for _ in range(200):
        token()
    order = ["bare", *[n for n in names if n in by_name]]
    rows = []

    def query() -> None:
        for _ in range(args.tokens):
            token()

    for r in range(args.rounds):
        for side in order + order[::-1]:
            t0 = time.monotonic()
            inside = 0.0
            for _ in range(args.queries):
                if side == "bare":
                    a = time.monotonic()
                    query()
                    inside += time.monotonic() - a
                else:
                    row = measured([by_name[side]], query)[0]
                    inside += row["end_s"] - row["start_s"]
            wall = time.monotonic() - t0
            n = args.queries * args.tokens
            rows.append({"round": r, "side": side, "tokens": n, "inside_s": inside, "wall_s": wall,
                         "tok_s_inside": n / inside, "tok_s_wall": n / wall})
            print(f"round {r} {side}: {n / inside:.1f} tok/s inside, {n / wall:.1f} over the loop", flush=True)
    write_rows(out / "overhead.csv", rows)
    meta(out, failed, overhead={"queries": args.queries, "tokens": args.tokens, "rounds": args.rounds})


# --------------------------------------------------------------------------------------------- table 2
def chat(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    import urllib.request

    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def queries(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tools, failed = make_tools(TOOLS)
    words = "the energy of one query on a GPU is read by every tool at once".split()
    plan = [("short", args.short_tokens)] * args.short + [("long", args.long_tokens)] * args.long
    plan = plan[::5] + [p for i, p in enumerate(plan) if i % 5]  # long ones spread, not all at the end
    for _ in range(3):
        chat(args.url, "warm up", 16)
    counter = Counter(out / "counter-queries.csv")
    rows = []
    try:
        for i, (kind, n) in enumerate(plan):
            prompt = " ".join(words[(i + k) % len(words)] for k in range(24))
            answer: dict[str, Any] = {}
            for row in measured(tools, lambda: answer.update(chat(args.url, prompt, n))):
                rows.append({"query": i, "kind": kind, "max_tokens": n,
                             "completion_tokens": answer.get("usage", {}).get("completion_tokens"), **row})
            time.sleep(args.gap_s)
    finally:
        counter.stop()
        if rows:
            write_rows(out / "queries.csv", rows)
        for tool in tools:
            if isinstance(tool, Ipw):
                tool.write_samples(out / "ipw-samples-queries.csv.gz")
        meta(out, failed, queries={"short": args.short, "long": args.long, "short_tokens": args.short_tokens,
                                   "long_tokens": args.long_tokens, "gap_s": args.gap_s})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("windows")
    w.add_argument("--out", required=True)
    w.add_argument("--deadline-s", type=float, default=300.0)
    o = sub.add_parser("overhead")
    o.add_argument("--out", required=True)
    o.add_argument("--rounds", type=int, default=3)
    o.add_argument("--queries", type=int, default=20)
    o.add_argument("--tokens", type=int, default=64)
    q = sub.add_parser("queries")
    q.add_argument("--out", required=True)
    q.add_argument("--url", required=True)
    q.add_argument("--short", type=int, default=150)
    q.add_argument("--long", type=int, default=30)
    q.add_argument("--short-tokens", type=int, default=12)
    q.add_argument("--long-tokens", type=int, default=400)
    q.add_argument("--gap-s", type=float, default=0.2)
    args = ap.parse_args()
    os.environ.setdefault("CODECARBON_LOG_LEVEL", "error")
    {"windows": windows, "overhead": overhead, "queries": queries}[args.cmd](args)


if __name__ == "__main__":
    main()
