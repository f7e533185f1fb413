"""Record ten kinds of GPU load for the error model of a sampled window (issue 43).  Run on a real NVIDIA GPU.

    PYTHONPATH=. python3 bench/telemetry/loads.py --out DIR [--block-s 24] [--only compute-high,...]
    PYTHONPATH=. python3 bench/telemetry/loads.py --out DIR --dry-run    # CPU torch, no NVML: the loop and the file

Needs numpy, torch with CUDA and nvidia-ml-py.  About 4.5 minutes at the defaults.  Never changes clocks,
power limits or MIG.

Four kinds of load, each at two power levels (``LOADS``): steady compute (bf16 matrix products), memory-bound
(buffer copies; random gathers), decoding at batch 1 (a chain of matrix-vector products per token, over the
weights of an 8B-class model, and of a 135M-class one, which is launch-bound), and bursts (matrix products
for a fixed time every cycle, idle in between: every window starts at a rise of the load).

Each load runs as a block of identical *units* of work (``--block-s`` seconds): a unit ends with a
``torch.cuda.synchronize()`` and the host time is recorded there (a burst's unit is one cycle, from one burst's
start to the next).  About 1.5 s of the same load comes before the block and 1 s after it, then 3 s idle.
Windows of any length are cut from the unit boundaries afterwards (``bench/telemetry/uncertainty_fit.py``), so every
window is a whole number of units: **windows of equal unit counts have equal work by construction**, and
their reference is the counter's energy over the surrounding units, divided by the unit count.

Recorded, each on the host's monotonic clock:

- what ipw's live sensor sees: :class:`ipw.telemetry.nvml.NvmlSensor` at its defaults, its own thread (the
  driver's power samples and its sparse counter reads);
- the reference: the energy counter read back to back by ``bench/telemetry/gpu_counter.py`` in a process of its own;
- the unit boundaries of every block.

Writes ``DIR/loads.npz`` (the arrays), ``DIR/loads.json`` (the loads, their unit sizes, the machine) and
``DIR/counter.csv.gz`` after every block, so a crash keeps the blocks before it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Load:
    name: str
    kind: str  # compute | memory | decode | bursty
    what: str
    unit_s: float  # target length of one unit (a burst: the cycle)
    on_s: float = 0.0  # a burst's busy part


LOADS = (
    Load("compute-high", "compute", "bf16 matrix products 8192x8192x8192, back to back", 0.010),
    Load("compute-low", "compute", "bf16 matrix products 2048x2048x2048, back to back", 0.010),  # drew 688 W, as -high
    Load("compute-thin", "compute", "bf16 matrix products 256x8192 by 8192x8192 (few output tiles), back to back", 0.010),
    Load("compute-fp32", "compute", "fp32 matrix products 4096x4096x4096 (no tensor cores), back to back", 0.010),
    Load("memory-high", "memory", "copies of a 1 GiB buffer into another", 0.010),
    Load("memory-low", "memory", "random 4-byte gathers from a 1 GiB buffer (2^22 a step)", 0.010),
    Load("decode-large", "decode", "one token: 96 matrix-vector products over 8192x8192 bf16 weights (12 GiB)", 0.0),
    Load("decode-small", "decode", "one token: 120 matrix-vector products over 576x576 bf16 weights (launch-bound)", 0.0),
    Load("bursty-high", "bursty", "8192^3 bf16 products for 30 ms every 80 ms, idle between", 0.080, 0.030),
    Load("bursty-low", "bursty", "8192^3 bf16 products for 15 ms every 250 ms, idle between", 0.250, 0.015),
)
LEAD_S = 1.5
TRAIL_S = 1.0
IDLE_S = 3.0
WARM_S = 15.0  # the sampler has this much data before the first block (as the runner's idle baseline)


#: ``--clocks``: the driver's other sample buffers, polled by a thread of this bench (not ipw's sampler), to test
#: whether the clocks or the utilization tell the loads' short-window errors apart (issue 43).
CLOCK_BUFFERS = {"clk": "NVML_PROCESSOR_CLK_SAMPLES", "memclk": "NVML_MEMORY_CLK_SAMPLES",
                 "util": "NVML_GPU_UTILIZATION_SAMPLES"}


class ClockPoller:
    """Polls ``CLOCK_BUFFERS`` of GPU 0 every ``period_s`` on a thread of its own; ``arrays()``: each buffer's
    driver timestamps (us, wall clock) and values, and (monotonic ns, wall us) pairs to convert them."""

    def __init__(self, period_s: float = 0.5) -> None:
        import threading

        import pynvml

        from ipw.telemetry.nvml_reads import value_attr

        self.nvml, self.value_attr = pynvml, value_attr
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.data: dict[str, list[tuple[int, float]]] = {k: [] for k in CLOCK_BUFFERS}
        self.last = dict.fromkeys(CLOCK_BUFFERS, 0)
        self.pairs: list[tuple[int, int]] = []
        self.errors: dict[str, str] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self.thread.start()

    def _run(self, period_s: float) -> None:
        while not self.stop.wait(period_s):
            self.poll()

    def poll(self) -> None:
        nv = self.nvml
        self.pairs.append((time.monotonic_ns(), time.time_ns() // 1000))
        for key, const in CLOCK_BUFFERS.items():
            if key in self.errors:
                continue
            try:
                vtype, samples = nv.nvmlDeviceGetSamples(self.handle, getattr(nv, const), self.last[key])
            except nv.NVMLError as exc:
                self.errors[key] = str(exc)
                continue
            attr = self.value_attr(nv, int(vtype))
            new = [(int(x.timeStamp), float(getattr(x.sampleValue, attr))) for x in samples if int(x.timeStamp) > self.last[key]]
            if new:
                self.data[key].extend(new)
                self.last[key] = max(t for t, _ in new)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.poll()

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"clock_pairs": np.array(self.pairs, dtype=np.int64).reshape(-1, 2)}
        for key, rows in self.data.items():
            a = np.array(sorted(rows), dtype=np.float64).reshape(-1, 2)
            out[f"{key}_ts_us"], out[f"{key}_value"] = a[:, 0].astype(np.int64), a[:, 1]
        return out


class Work:
    """One load's step (a fixed amount of GPU work, then a synchronize) on ``device``."""

    def __init__(self, load: Load, torch: Any, device: str, small: bool = False) -> None:
        self.torch, self.load = torch, load
        dev = torch.device(device)
        g = torch.Generator(device=dev).manual_seed(0)
        bf = torch.bfloat16 if device != "cpu" else torch.float32
        self.sync: Callable[[], None] = torch.cuda.synchronize if device != "cpu" else (lambda: None)

        def rnd(*shape: int) -> Any:
            return torch.randn(*shape, device=dev, dtype=bf, generator=g)

        shrink = 16 if small else 1  # --dry-run: CPU-sized
        if load.kind in ("compute", "bursty"):
            n = {"compute-low": 2048, "compute-fp32": 4096}.get(load.name, 8192) // shrink
            if load.name == "compute-fp32":
                torch.backends.cuda.matmul.allow_tf32 = False
                a, b = (torch.randn(n, n, device=dev, generator=g) for _ in range(2))
            else:
                a, b = rnd(256 // shrink if load.name == "compute-thin" else n, n), rnd(n, n)
            c = torch.empty(a.shape[0], n, device=dev, dtype=a.dtype)
            self.step = lambda: torch.matmul(a, b, out=c)
        elif load.name == "memory-high":
            n = (1 << 29) // shrink // shrink  # bf16 elements: 1 GiB
            src, dst = rnd(n), torch.empty(n, device=dev, dtype=bf)
            self.step = lambda: dst.copy_(src)
        elif load.name == "memory-low":
            n = (1 << 28) // shrink // shrink  # float32: 1 GiB
            src = torch.randn(n, device=dev, generator=g)
            idx = torch.randint(0, n, ((1 << 22) // shrink,), device=dev, generator=g)
            out = torch.empty(idx.numel(), device=dev)
            self.step = lambda: torch.index_select(src, 0, idx, out=out)
        else:  # decode: one token through a chain of matrix-vector products
            d, layers = (8192, 96) if load.name == "decode-large" else (576, 120)
            d //= shrink
            weights = [rnd(d, d) * (1.0 / d ** 0.5) for _ in range(layers)]
            x0 = rnd(d)

            def token() -> None:
                x = x0
                for w in weights:
                    x = torch.nn.functional.silu(torch.mv(w, x))

            self.step = token
        self.steps = 1  # steps per unit (set by calibrate)

    def unit(self) -> None:
        for _ in range(self.steps):
            self.step()
        self.sync()

    def calibrate(self, seconds: float = 1.0) -> float:
        """Warm the load, then choose ``steps`` so that a unit (a burst's busy part) lasts its target."""
        self.unit()
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            self.step()
            n += 1
            if n % 8 == 0:
                self.sync()
        self.sync()
        per_step = (time.perf_counter() - t0) / n
        target = self.load.on_s if self.load.kind == "bursty" else self.load.unit_s
        self.steps = max(1, round(target / per_step)) if target else 1
        return per_step


def run_block(work: Work, block_s: float) -> list[float]:
    """Lead, the block, trail; the block's unit boundaries (monotonic s)."""
    load = work.load
    tick = time.monotonic()

    def one() -> float:
        nonlocal tick
        if load.kind != "bursty":
            work.unit()
            return time.monotonic()
        work.unit()  # busy, then idle until the next cycle
        tick += load.unit_s
        time.sleep(max(0.0, tick - time.monotonic()))
        return tick

    end_lead = time.monotonic() + LEAD_S
    while time.monotonic() < end_lead:
        one()
    bounds = [tick if load.kind == "bursty" else time.monotonic()]
    end = bounds[0] + block_s
    while bounds[-1] < end:
        bounds.append(one())
    end_trail = time.monotonic() + TRAIL_S
    while time.monotonic() < end_trail:
        one()
    return bounds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results" / "loads"))
    ap.add_argument("--block-s", type=float, default=24.0, help="seconds of each block (default 24)")
    ap.add_argument("--only", default="", help="comma-separated load names (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="torch on the CPU, small sizes, no NVML, no counter")
    ap.add_argument("--clocks", action="store_true", help="also record the driver's clock and utilization samples (ClockPoller)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loads = [ld for ld in LOADS if not args.only or ld.name in args.only.split(",")]
    import torch

    device = "cpu" if args.dry_run else "cuda:0"
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("bench/telemetry/loads.py needs torch with a CUDA device (or --dry-run)")
    sensor = counter = clocks = None
    meta: dict[str, Any] = {"bench": "bench/telemetry/loads.py", "block_s": args.block_s, "lead_s": LEAD_S, "trail_s": TRAIL_S,
                            "idle_s": IDLE_S, "host": platform.node(), "python": platform.python_version(),
                            "torch": torch.__version__, "loads": [], "dry_run": args.dry_run}
    if not args.dry_run:
        from ipw.telemetry.nvml import NvmlSensor

        meta["gpu"] = torch.cuda.get_device_name(0)
        counter = subprocess.Popen([sys.executable, str(ROOT / "bench" / "telemetry" / "gpu_counter.py"), str(out / "counter.csv")])
        sensor = NvmlSensor([0])  # ipw under test: its defaults, its own thread
        meta["sample_shift_s"] = sensor.sampler.sample_shift_s
        meta["power_limit_w"] = sensor.sampler.power_limits_w().get("gpu0")  # the capped-noise term's limit
        clocks = ClockPoller() if args.clocks else None
    t_start = time.monotonic()
    blocks: dict[str, np.ndarray] = {}

    def save() -> None:
        arrays = {f"units_{k}": v for k, v in blocks.items()}
        if sensor is not None:
            arrays.update(sensor.sampler.arrays("gpu0"))
        if clocks is not None:
            arrays.update(clocks.arrays())
            meta["clock_errors"] = clocks.errors
        np.savez_compressed(out / "loads.npz", **arrays)
        (out / "loads.json").write_text(json.dumps(meta, indent=1))

    try:
        if sensor is not None:
            time.sleep(max(0.0, WARM_S - (time.monotonic() - t_start)))
        for load in loads:
            t0 = time.monotonic()
            work = Work(load, torch, device, small=args.dry_run)
            per_step = work.calibrate()
            bounds = np.array(run_block(work, args.block_s))
            blocks[load.name] = bounds
            units = np.diff(bounds)
            meta["loads"].append({**load.__dict__, "steps_per_unit": work.steps, "step_s": per_step,
                                  "units": int(units.size), "unit_s_median": float(np.median(units)),
                                  "unit_s_cv": float(np.std(units) / np.mean(units)),
                                  "block_start_s": float(bounds[0]), "block_end_s": float(bounds[-1])})
            del work
            if device != "cpu":
                torch.cuda.empty_cache()
            save()
            print(f"{load.name:>13}: {units.size} units of {np.median(units) * 1000:.2f} ms (cv {np.std(units) / np.mean(units):.1%}),"
                  f" {meta['loads'][-1]['steps_per_unit']} steps, block {bounds[-1] - bounds[0]:.1f} s, {time.monotonic() - t0:.1f} s in all", flush=True)
            time.sleep(IDLE_S)
    finally:
        if counter is not None:
            counter.send_signal(signal.SIGTERM)
            counter.wait(10)
            with open(out / "counter.csv", "rb") as f, gzip.open(out / "counter.csv.gz", "wb", 6) as g:
                shutil.copyfileobj(f, g)
            (out / "counter.csv").unlink()
        if clocks is not None:
            clocks.close()
        if sensor is not None:
            meta["sampler_overhead"] = sensor.overhead()
            save()
            sensor.close()
        else:
            save()
    print(f"recorded {len(blocks)} loads in {time.monotonic() - t_start:.0f} s into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
