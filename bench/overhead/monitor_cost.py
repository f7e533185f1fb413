"""What a measured block costs with ``ipw.measure`` (sensors probed, opened and closed per block) and with one
``ipw.Monitor`` (opened once), in one run on this machine, with the NVML of tests/nvml_fakes.py (an autospec'd
pynvml on the real clock: no GPU, no driver) and the CPU model, as ``bench/peers/peers.py overhead`` measures
ipw (``gpus=[0], rapl=False``).

Per path, in rounds A B then B A: a tiny block's begin + end (wall ms, median over ``--blocks``) and the time to
read every block's result; then a CPU-bound decode-like loop (``--tokens`` tokens a query, each token 120 small
numpy matrix-vector products) with each query in a block, in tokens/s over the loop as a ratio to the same loop
bare.  Mocked NVML: its calls cost Python, not the driver's milliseconds, and the loop runs on the CPU, so the
figures compare the two paths' own cost here; the GPU's are bench/peers' (docs/PEERS.md, table 4).

    .venv/bin/python bench/overhead/monitor_cost.py [--blocks 20] [--rounds 2] [--queries 20] [--tokens 64]

Output: printed (``--json``: the raw figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def mocked_nvml() -> None:
    """A fake GPU at a steady 100 W, for the rest of this process."""
    import pytest
    from nvml_fakes import RealClock, make_fake, synthetic

    offset = time.monotonic_ns() - time.time_ns()
    sig, _ = synthetic(duration_s=3600.0, t0_s=time.monotonic(), load=(1e6, 1e6 + 1), offset_ns=offset)
    make_fake(pytest.MonkeyPatch(), [sig], RealClock())


def token_fn() -> Callable[[], None]:
    import numpy as np

    w = np.random.default_rng(0).standard_normal((120, 256, 256)).astype(np.float32)
    x = np.ones(256, dtype=np.float32)

    def token() -> None:  # launch-bound, as a small model's decode step: many small calls into numpy
        for k in range(120):
            w[k] @ x

    return token


def run_path(path: str, blocks: int, queries: int, query: Callable[[], None]) -> dict[str, Any]:
    import ipw

    monitor = ipw.Monitor(gpus=[0], rapl=False) if path == "monitor" else None

    def block() -> Any:
        return monitor.measure() if monitor is not None else ipw.measure(gpus=[0], rapl=False)

    edges, done = [], []
    for _ in range(blocks):
        b = block()
        t0 = time.perf_counter()
        with b:
            pass
        edges.append(time.perf_counter() - t0)
        done.append(b)
    t0 = time.perf_counter()
    assert all(b.result.energy_j is not None for b in done)
    read_s = time.perf_counter() - t0
    done.clear()
    t0 = time.perf_counter()
    for _ in range(queries):
        if path == "bare":
            query()
            continue
        with block() as b:
            query()
        done.append(b)
    loop_s = time.perf_counter() - t0
    if monitor is not None:
        monitor.close()
    return {"block_ms": 1e3 * statistics.median(edges) if edges else None, "read_all_ms": 1e3 * read_s, "loop_s": loop_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--queries", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    mocked_nvml()
    token = token_fn()

    def query() -> None:
        for _ in range(args.tokens):
            token()

    order = ["bare", "measure", "monitor"]
    out: dict[str, list[dict[str, Any]]] = {p: [] for p in order}
    for r in range(args.rounds):
        for path in order if r % 2 == 0 else order[::-1]:
            out[path].append(run_path(path, 0 if path == "bare" else args.blocks, args.queries, query))
    if args.json:
        print(json.dumps(out, indent=1))
        return
    bare = statistics.median(x["loop_s"] for x in out["bare"])
    print(f"mocked NVML (tests/nvml_fakes.py) + CPU model; {args.rounds} rounds; {args.blocks} tiny blocks and "
          f"{args.queries} queries of {args.tokens} tokens per path and round")
    print("| path | tiny block's begin + end (ms, median) | reading its result (ms per block) | "
          "tokens/s over the loop, ratio to bare |")
    print("|---|---|---|---|")
    for path in ("measure", "monitor"):
        rows = out[path]
        block = statistics.median(x["block_ms"] for x in rows)
        read = statistics.median(x["read_all_ms"] for x in rows) / args.blocks
        ratio = bare / statistics.median(x["loop_s"] for x in rows)
        print(f"| {path} | {block:.3f} | {read:.3f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
