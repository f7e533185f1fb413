"""The worker round trip alone: ``generate`` on the fake engine (bench/overhead/fake_engine.py) in ipw's worker
process, as ipw's measuring thread calls it, less the engine's own time; median and quartiles of many
calls, with or without a thread that holds the interpreter lock in between (as the record writer and the
sensors' threads do in a run).

    PYTHONPATH=CHECKOUT .venv/bin/python bench/overhead/roundtrip.py --calls 2000 --answer-ms 0 [--busy]

Output: printed, and ``--json``; the figures are in docs/PERFORMANCE.md, "Harness overhead per query: where
    the time goes".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def busy(stop: threading.Event) -> None:
    """Pure Python work in slices, with short sleeps: a thread that wants the interpreter lock."""
    while not stop.is_set():
        x = 0
        for i in range(20_000):
            x += i
        time.sleep(0.001)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--answer-ms", type=float, default=0.0)
    parser.add_argument("--busy", action="store_true", help="a thread holding the interpreter lock in slices")
    parser.add_argument("--switch-interval", type=float, default=0.0005)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    import ipw
    from fake_engine import FakeBackend

    from ipw.backends.base import BackendSpec, GenerationSettings

    backend = FakeBackend(BackendSpec(name="fake", kind="fake", model="fake",
                                      options={"answer_ms": args.answer_ms, "tokens": 16, "concurrency": [1]}))
    backend.attach(Path(tempfile.mkdtemp(prefix="ipw-roundtrip-")))
    backend.load()
    settings = GenerationSettings()
    stop = threading.Event()
    helper = threading.Thread(target=busy, args=(stop,), daemon=True) if args.busy else None
    sys.setswitchinterval(args.switch_interval)
    if helper is not None:
        helper.start()
    out = []
    try:
        for n in range(args.calls + 50):
            t0 = time.monotonic()
            c = backend.generate(f"What is {n}?", settings)
            t1 = time.monotonic()
            if n >= 50:  # the first calls warm up
                out.append(1000 * ((t1 - t0) - (c.end_s - c.start_s)))
    finally:
        stop.set()
        backend.close()
    q = statistics.quantiles(out, n=4)
    res = {"ipw": str(Path(ipw.__file__).resolve().parent), "calls": args.calls, "busy": args.busy,
           "answer_ms": args.answer_ms, "median_ms": statistics.median(out), "q1_ms": q[0], "q3_ms": q[2],
           "mean_ms": statistics.fmean(out), "load": os.getloadavg()}
    print(json.dumps(res))
    if args.json:
        args.json.write_text(json.dumps(res), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
