"""Multi-GPU measurement on a real machine of two NVIDIA GPUs: selection, foreign activity, per-GPU sums.

    PYTHONPATH=. python3 bench/scale/multigpu.py [--out DIR] [--seconds 5] [--repeats 3] [--fake]
    PYTHONPATH=. python3 bench/scale/multigpu.py --reanalyse bench/evidence/scale/multigpu   # offline, from a run's files

Needs numpy, torch with CUDA and nvidia-ml-py; of ipw only ``ipw.telemetry`` (no typer, rich, pandas).
About two minutes at the defaults.  Writes ``multigpu.json`` (every window's numbers),
``multigpu.md`` (the tables) and ``multigpu_raw.npz`` (every recorded signal) into ``--out`` (default
``$OUT`` if set, else ``bench/results``).  ``--fake`` runs the same code against a simulated NVML of
two GPUs with sleeping workers: a dry run of the script where there is no GPU.

Workload: one worker process per GPU (``--worker N``, started with ``CUDA_VISIBLE_DEVICES`` set to
that GPU's UUID, so NVML index N and the worker's GPU are the same device) runs a fixed number of
bf16 8192x8192 matrix products, calibrated once to ``--seconds``, when the parent says so.

Three :class:`~ipw.telemetry.nvml.NvmlSensor` run side by side in the parent, each with its own
sampler thread: ``[1]`` (GPU 1 only), ``[0]`` (GPU 0 only) and ``both`` (every GPU).  Each window is
opened on all three at the same instants.  The reference is each GPU's energy counter read back to
back (every ~4-8 ms) by a separate thread around each window's edges, interpolated through its change
points (:func:`ipw.telemetry.estimator.counter_energy_between`).

1. ``gpu1``: the load on GPU 1 only.  ``[1]`` must attribute it fully (its reading vs GPU 1's counter
   delta), ``[0]`` none of it (its reading is GPU 0's counter delta, about its idle power times the
   duration) and report GPU 1 as foreign activity; ``both`` must not report foreign activity.
2. ``both``: loads on both GPUs (equal lengths, then GPU 1 half as long).  ``both``'s per-GPU readings
   and their total vs the counter deltas; ``[0]`` + ``[1]`` vs ``both``'s total (no double counting).
3. ``overhead``: each sensor alone (one GPU measured and one watched; then two measured) for
   ``--overhead-seconds`` of 0.5 s windows while both GPUs run short loads: the sampler thread's CPU
   time as a share of one core (budget 2%).

Never changes clocks, power limits or MIG; uses no NCCL (NCCL_NVLS_ENABLE=0 and the other multicast
switches are passed on to the workers all the same).

Output: ``--out`` (multigpu.json, multigpu.md, multigpu_raw.npz), the committed run in
    bench/evidence/scale/multigpu/; the figures are in docs/MULTIGPU.md, "Results on two NVIDIA H200s".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MATRIX_N = 8192
#: Acceptance: a loaded GPU's reading vs its counter delta, and a total vs the sum of deltas.
LOAD_TOL = 0.03
#: An idle GPU's reading vs its counter delta.
IDLE_TOL = 0.05
#: The GPU not selected: its reading above its idle power, as a share of the load's energy.
LEAK_TOL = 0.02
#: One-GPU sensors' sum vs the two-GPU sensor's total.
SUM_TOL = 0.01
OVERHEAD_BUDGET = 0.02
#: Idle time inside each window before the load starts and after it ends.  The counter steps every
#: ~100 ms and the reference interpolates linearly between its steps, so an edge next to a power
#: change would be off by up to half a step times the change (~25 J at 500 W); an edge in steady
#: power is exact.
EDGE_PAD_S = 0.4
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# --------------------------------------------------------------------------------------------------
# the worker (one process per GPU)


def worker_main(fake: bool) -> int:
    if fake:
        sec, uuid, name = 1e-3, "fake", "fake (sleep)"

        def run(n: int) -> None:
            time.sleep(n * sec)
    else:
        import torch

        dev = torch.device("cuda:0")
        g = torch.Generator(device=dev).manual_seed(0)
        a = torch.randn(MATRIX_N, MATRIX_N, device=dev, dtype=torch.bfloat16, generator=g)
        b = torch.randn(MATRIX_N, MATRIX_N, device=dev, dtype=torch.bfloat16, generator=g)
        c = torch.empty_like(a)

        def run(n: int) -> None:
            for _ in range(n):
                torch.matmul(a, b, out=c)
            torch.cuda.synchronize()

        run(50)  # clocks up, kernels chosen
        t0 = time.perf_counter()
        run(200)
        sec = (time.perf_counter() - t0) / 200
        props = torch.cuda.get_device_properties(0)
        uuid, name = str(getattr(props, "uuid", "?")).replace(" ", ""), props.name
    print(f"READY {sec:.9f} {uuid} {name}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "QUIT":
            break
        if cmd[0] == "RUN":
            t0 = time.monotonic()
            run(int(cmd[1]))
            print(f"DONE {t0:.6f} {time.monotonic():.6f}", flush=True)
    return 0


class Worker:
    """The parent's handle on one worker: lines in, lines out (read by a thread, with timeouts)."""

    def __init__(self, gpu: int, uuid: str, fake: bool) -> None:
        env = dict(os.environ)
        env.update(MULTICAST_OFF)
        env["CUDA_VISIBLE_DEVICES"] = uuid
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["PYTHONUNBUFFERED"] = "1"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker"] + (["--fake"] if fake else [])
        self.gpu = gpu
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.sec = float("nan")
        self.uuid = self.name = ""

    def _read(self) -> None:
        for line in self.p.stdout:  # type: ignore[union-attr]
            self.lines.put(line.strip())
        self.lines.put("EOF")

    def _expect(self, word: str, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit(f"worker for GPU {self.gpu}: no {word} within {timeout_s:.0f} s")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line == "EOF":
                raise SystemExit(f"worker for GPU {self.gpu} exited (code {self.p.wait()})")
            parts = line.split()
            if parts and parts[0] == word:
                return parts[1:]
            print(f"[worker {self.gpu}] {line}", flush=True)

    def ready(self, timeout_s: float = 240.0) -> None:
        parts = self._expect("READY", timeout_s)
        self.sec, self.uuid, self.name = float(parts[0]), parts[1], " ".join(parts[2:])

    def run(self, n: int) -> None:
        self.p.stdin.write(f"RUN {n}\n")  # type: ignore[union-attr]
        self.p.stdin.flush()  # type: ignore[union-attr]

    def done(self, timeout_s: float) -> tuple[float, float]:
        t0, t1 = self._expect("DONE", timeout_s)
        return float(t0), float(t1)

    def quit(self) -> None:
        try:
            self.p.stdin.write("QUIT\n")  # type: ignore[union-attr]
            self.p.stdin.flush()  # type: ignore[union-attr]
            self.p.wait(20)
        except Exception:
            self.p.kill()


# --------------------------------------------------------------------------------------------------
# the reference: every GPU's counter, read back to back around window edges


class RefPoller(threading.Thread):
    def __init__(self, nvml, handles: list[Any]) -> None:
        super().__init__(name="bench-ref-poller", daemon=True)
        self.nvml, self.handles = nvml, handles
        self.stop_ev = threading.Event()
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self.intervals: list[tuple[float, float]] = []
        self.t: list[list[float]] = [[] for _ in handles]
        self.j: list[list[float]] = [[] for _ in handles]

    def cover(self, a: float, b: float) -> None:
        with self.lock:
            self.intervals.append((a, b))
        self.wake.set()

    def _due(self, now: float) -> float | None:
        """0 when a read is due now, else seconds to the next interval (None: none left)."""
        with self.lock:
            self.intervals = [iv for iv in self.intervals if iv[1] > now]
            if not self.intervals:
                return None
            return max(0.0, min(a for a, _ in self.intervals) - now)

    def run(self) -> None:
        while not self.stop_ev.is_set():
            wait = self._due(time.monotonic())
            if wait is None or wait > 0:
                self.wake.wait(0.5 if wait is None else min(wait, 0.5))
                self.wake.clear()
                continue
            for k, h in enumerate(self.handles):
                t0 = time.monotonic()
                e = self.nvml.nvmlDeviceGetTotalEnergyConsumption(h)
                t1 = time.monotonic()
                self.t[k].append((t0 + t1) / 2)
                self.j[k].append(e / 1000.0)
            time.sleep(0.0005)

    def energy(self, k: int, a: float, b: float) -> tuple[float | None, float]:
        """GPU k's counter energy over [a, b], and the largest gap between reads at either edge."""
        from ipw.telemetry.estimator import counter_energy_between

        t, j = np.asarray(self.t[k]), np.asarray(self.j[k])
        gaps = []
        for x in (a, b):
            i = int(np.searchsorted(t, x))
            gaps.append(float(t[i] - t[i - 1]) if 0 < i < t.size else float("inf"))
        est = counter_energy_between(t, j, a, b)
        return est.energy_j, max(gaps)


# --------------------------------------------------------------------------------------------------
# a simulated NVML of two GPUs (``--fake``)


class _FakeGpu:
    def __init__(self, idle_w: float, load_w: float, origin: float) -> None:
        self.idle_w, self.load_w, self.origin = idle_w, load_w, origin
        self.busy: list[list[float | None]] = []

    def power(self, t: float) -> float:
        busy = any(a <= t and (b is None or t < b) for a, b in self.busy)
        return self.load_w if busy else self.idle_w

    def energy_j(self, t: float) -> float:
        e = self.idle_w * (t - self.origin)
        for a, b in self.busy:
            end = t if b is None else min(b, t)
            e += (self.load_w - self.idle_w) * max(0.0, end - max(a, self.origin))  # type: ignore[arg-type]
        return e


def fake_nvml(n_gpus: int = 2) -> types.ModuleType:
    """A pynvml stand-in whose GPUs idle at 80-90 W and draw 600 W while marked busy."""
    import pynvml as real

    m = types.ModuleType("pynvml")
    for name in dir(real):
        if name.startswith("NVML_") or name.startswith("c_nvml"):
            setattr(m, name, getattr(real, name))
    m.NVMLError = real.NVMLError
    origin = time.monotonic()
    wall_off = time.time() - time.monotonic()
    m.gpus = [_FakeGpu(80.0 + 10 * i, 600.0, origin - 60.0) for i in range(n_gpus)]
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: n_gpus
    m.nvmlDeviceGetHandleByIndex = lambda i: ("h", i)
    m.nvmlDeviceGetUUID = lambda h: f"GPU-fake{h[1]:04d}-0000"
    m.nvmlDeviceGetName = lambda h: "Fake H200"
    m.nvmlSystemGetDriverVersion = lambda: "fake"
    m.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000

    def mig(h):
        raise real.NVMLError(real.NVML_ERROR_NOT_SUPPORTED)

    def counter(h):
        time.sleep(0.002)  # ~ the H200's cost
        t = time.monotonic()
        g = m.gpus[h[1]]
        step = g.origin + np.floor((t - g.origin) / 0.1) * 0.1
        return int(g.energy_j(step) * 1000)

    def samples(h, kind, last_us):
        g = m.gpus[h[1]]
        now = time.monotonic()
        first = max(now - 2.4, (last_us / 1e6 - wall_off) if last_us else now - 2.4)
        k0, k1 = int(np.floor((first - g.origin) / 0.02)) + 1, int(np.floor((now - g.origin) / 0.02))
        ts = [g.origin + k * 0.02 for k in range(k0, k1 + 1)]
        ts = [t for t in ts if int((t + wall_off) * 1e6) > last_us]
        if not ts:
            raise real.NVMLError(real.NVML_ERROR_NOT_FOUND)
        out = (real.c_nvmlSample_t * len(ts))()
        for k, t in enumerate(ts):
            out[k].timeStamp = int((t + wall_off) * 1e6)
            out[k].sampleValue.uiVal = int(g.power(t - 0.01) * 1000)
        return real.NVML_VALUE_TYPE_UNSIGNED_INT, out[0: len(ts)]

    def fields(h, ids):
        out = (real.c_nvmlFieldValue_t * 1)()
        out[0].fieldId = ids[0]
        out[0].valueType = real.NVML_VALUE_TYPE_UNSIGNED_INT
        out[0].value.uiVal = int(m.gpus[h[1]].power(time.monotonic()) * 1000)
        return out

    m.nvmlDeviceGetMigMode = mig
    m.nvmlDeviceGetTotalEnergyConsumption = counter
    m.nvmlDeviceGetSamples = samples
    m.nvmlDeviceGetFieldValues = fields
    return m


# --------------------------------------------------------------------------------------------------
# measurement


SENSORS = ("[1]", "[0]", "both")


def wait_ready(pending: dict[str, Any], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.ready() for p in pending.values()) and time.monotonic() < deadline:
        time.sleep(0.01)


def measured_window(phase: str, rep: int, runs: dict[int, int], workers: list[Worker], sensors: dict[str, Any],
                    ref: RefPoller, fake_mod, idle_s: float) -> dict[str, Any]:
    """One window opened on every sensor at once: EDGE_PAD_S idle, ``runs`` ({gpu: products}) on their
    GPUs at once, EDGE_PAD_S idle; or idle_s of idle."""
    now = time.monotonic()
    ref.cover(now, now + 0.7)
    time.sleep(0.35)
    tokens = {k: s.begin() for k, s in sensors.items()}
    expected = max([n * workers[g].sec for g, n in runs.items()] or [idle_s])
    if runs:
        time.sleep(EDGE_PAD_S)  # the edges sit in steady (idle) power: the counter's reference is exact there
    for g, n in runs.items():
        if fake_mod is not None:  # busy for as long as the worker sleeps
            t = time.monotonic()
            fake_mod.gpus[g].busy.append([t, t + n * workers[g].sec])
        workers[g].run(n)
    done = {}
    for g in runs:
        done[g] = workers[g].done(timeout_s=3 * expected + 60)
    now = time.monotonic()
    if runs:  # dense counter reads from the load's end to past the window's end
        ref.cover(now, now + EDGE_PAD_S + 0.6)
        time.sleep(EDGE_PAD_S)
    else:
        ref.cover(now + idle_s - 0.5, now + idle_s + 0.6)
        time.sleep(idle_s)
    pend = {k: s.end(tokens[k]) for k, s in sensors.items()}
    t_end = time.monotonic()
    ref.cover(t_end, t_end + 0.4)
    wait_ready(pend)
    readings = {k: {r.component: r for r in p.result()} for k, p in pend.items()}
    time.sleep(max(0.0, t_end + 0.45 - time.monotonic()))
    return {"phase": phase, "rep": rep, "runs": runs, "start_s": pend["both"].start_s, "end_s": pend["both"].end_s,
            "worker_s": {g: t1 - t0 for g, (t0, t1) in done.items()}, "readings": readings,
            "foreign": {k: p.foreign_activity for k, p in pend.items()}}


def analyse_window(w: dict[str, Any], ref: RefPoller, idle_w: list[float] | None) -> dict[str, Any]:
    a, b = w["start_s"], w["end_s"]
    dur = b - a
    refs, gaps = [], []
    for k in range(2):
        e, gap = ref.energy(k, a, b)
        refs.append(e)
        gaps.append(gap)
    rd = w["readings"]

    def j(sensor: str, comp: str) -> float | None:
        r = rd[sensor].get(comp)
        return None if r is None else r.energy_j

    row: dict[str, Any] = {
        "phase": w["phase"], "rep": w["rep"], "start_s": a, "end_s": b, "duration_s": dur,
        "worker_s": {str(g): v for g, v in w["worker_s"].items()},
        "ref_j": refs, "ref_edge_gap_s": max(gaps),
        "ipw_j": {s: {c: r.energy_j for c, r in rd[s].items()} for s in rd},
        "notes": {s: {c: r.note for c, r in rd[s].items()} for s in rd},
        "sources": {s: {c: f"{r.source}/{r.quality}" for c, r in rd[s].items()} for s in rd},
        "foreign": {s: w["foreign"][s] for s in SENSORS},
    }

    def err(x, ref_j):
        return None if x is None or not ref_j else x / ref_j - 1

    row["err"] = {
        "[1] gpu1": err(j("[1]", "gpu1"), refs[1]),
        "[0] gpu0": err(j("[0]", "gpu0"), refs[0]),
        "both gpu0": err(j("both", "gpu0"), refs[0]),
        "both gpu1": err(j("both", "gpu1"), refs[1]),
    }
    both_total = sum(v for v in (j("both", "gpu0"), j("both", "gpu1")) if v is not None)
    singles = sum(v for v in (j("[0]", "gpu0"), j("[1]", "gpu1")) if v is not None)
    row["both_total_j"] = both_total
    row["singles_sum_j"] = singles
    row["err"]["both total"] = err(both_total, refs[0] + refs[1])
    row["err"]["[0]+[1] vs both"] = err(singles, both_total)
    if idle_w is not None:
        e0 = j("[0]", "gpu0")
        row["gpu0_idle_j"] = idle_w[0] * dur
        row["gpu0_above_idle_j"] = None if e0 is None else e0 - idle_w[0] * dur
    return row


def overhead_phase(label: str, indices, workers: list[Worker], seconds: float, fake_mod, n_short: list[int]) -> dict[str, Any]:
    """One sensor alone for ``seconds``: 0.5 s windows while both GPUs run ~0.3 s of products each."""
    from ipw.telemetry.nvml import NvmlSensor

    sensor = NvmlSensor(indices)
    time.sleep(1.0)
    pending: list[Any] = []
    taken = {"windows": 0, "foreign": 0}

    def take() -> None:
        p = pending.pop(0)
        p.result()
        taken["windows"] += 1
        taken["foreign"] += bool(p.foreign_activity)

    t_stop = time.monotonic() + seconds
    while time.monotonic() < t_stop:
        tok = sensor.begin()
        for g, w in enumerate(workers):
            if fake_mod is not None:
                t = time.monotonic()
                fake_mod.gpus[g].busy.append([t, t + n_short[g] * w.sec])
            w.run(n_short[g])
        for w in workers:
            w.done(timeout_s=60)
        time.sleep(0.2)
        pending.append(sensor.end(tok))
        while pending and pending[0].ready():  # as the runner does: each result once final
            take()
    deadline = time.monotonic() + 5
    while pending and time.monotonic() < deadline:
        if pending[0].ready():
            take()
        else:
            time.sleep(0.01)
    info = sensor.info()
    sensor.close()
    ov = sensor.overhead()
    return {"label": label, "indices": indices, "windows": taken["windows"],
            "windows_with_foreign_activity": taken["foreign"], "measured": list(info.components),
            "watched": [w["component"] for w in info.params["watched_gpus"]], "overhead": ov}


# --------------------------------------------------------------------------------------------------
# report


def fmt_err(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.2%}"


def _worst(xs: list[float | None]) -> float:
    """The largest |x|; inf when any is missing (a check with a missing number fails)."""
    return max((abs(x) if x is not None else math.inf for x in xs), default=math.inf)


def acceptance(rows: list[dict[str, Any]], overheads: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    checks: list[tuple[str, bool]] = []
    g1 = [r for r in rows if r["phase"] == "gpu1"]
    both = [r for r in rows if r["phase"].startswith("both")]
    if g1:
        worst = _worst([r["err"]["[1] gpu1"] for r in g1])
        checks.append((f"gpu1: [1] attributes GPU 1's load fully: |reading/counter - 1| max {worst:.2%} "
                       f"<= {LOAD_TOL:.0%}", worst <= LOAD_TOL))
        worst = _worst([r["err"]["[0] gpu0"] for r in g1])
        checks.append((f"gpu1: [0] reads only GPU 0 (its counter delta): max |err| {worst:.2%} "
                       f"<= {IDLE_TOL:.0%}", worst <= IDLE_TOL))
        leak = [None if r.get("gpu0_above_idle_j") is None or not r["ipw_j"]["[1]"].get("gpu1")
                else r["gpu0_above_idle_j"] / r["ipw_j"]["[1]"]["gpu1"] for r in g1]
        worst = _worst(leak)
        checks.append((f"gpu1: [0] attributes none of it: GPU 0's reading above its idle power x duration, "
                       f"max |x| {worst:.2%} of the load's energy <= {LEAK_TOL:.0%}", worst <= LEAK_TOL))
        checks.append(("gpu1: [0] reports GPU 1 (nvml1) as foreign activity in every window",
                       all([a["component"] for a in r["foreign"]["[0]"]] == ["nvml1"] for r in g1)))
        checks.append(("gpu1: [1] and both report no foreign activity (GPU 0 idle; nothing unmeasured)",
                       all(not r["foreign"]["[1]"] and not r["foreign"]["both"] for r in g1)))
    if both:
        worst = _worst([r["err"][k] for r in both for k in ("both gpu0", "both gpu1")])
        checks.append((f"both: per-GPU readings vs counter deltas max |err| {worst:.2%} <= {LOAD_TOL:.0%}", worst <= LOAD_TOL))
        worst = _worst([r["err"]["both total"] for r in both])
        checks.append((f"both: total vs sum of counter deltas max |err| {worst:.2%} <= {LOAD_TOL:.0%}", worst <= LOAD_TOL))
        worst = _worst([r["err"]["[0]+[1] vs both"] for r in both])
        checks.append((f"both: [0] + [1] vs both's total max |diff| {worst:.2%} <= {SUM_TOL:.0%} (no double counting)",
                       worst <= SUM_TOL))
        checks.append(("both: [0] sees nvml1 and [1] sees nvml0 as foreign; both sees none",
                       all([a["component"] for a in r["foreign"]["[0]"]] == ["nvml1"]
                           and [a["component"] for a in r["foreign"]["[1]"]] == ["nvml0"]
                           and not r["foreign"]["both"] for r in both)))
    for o in overheads:
        f = o["overhead"]["cpu_fraction_of_one_core"]
        checks.append((f"overhead, {o['label']}: sampler thread {f:.2%} of one core <= {OVERHEAD_BUDGET:.0%}",
                       f <= OVERHEAD_BUDGET))
    return checks


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [
        f"Machine: {m['gpus']}, driver {m['driver']}, {m['host']}; {res['date']}; `{res['command']}`",
        "",
        f"Idle power before the load (ipw, {res['idle_window_s']:.1f} s window): "
        + ", ".join(f"GPU {k} {w:.1f} W" for k, w in enumerate(res["idle_w"])) + ".",
        "",
        "Per window: the reference is each GPU's counter delta (dense reads at the edges); `[1]`, `[0]` and "
        "`both` are NvmlSensor([1]), NvmlSensor([0]) and NvmlSensor() opened at the same instants; errors are "
        "reading / reference - 1.",
        "",
        "| window | s | GPU 0 counter J | GPU 1 counter J | [1] gpu1 J (err) | [0] gpu0 J (err) | both gpu0 (err) "
        "| both gpu1 (err) | both total (err) | [0]+[1] vs both | foreign seen by [0] / [1] / both |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in res["windows"]:
        ij, e = r["ipw_j"], r["err"]

        def cell(s, c, k):
            v = ij[s].get(c)
            return "n/a" if v is None else f"{v:.1f} ({fmt_err(e[k])})"

        def fa(s):
            return ",".join(f"{a['component']} {a['mean_w']:.0f} W" for a in r["foreign"][s]) or "-"

        lines.append(
            f"| {r['phase']} #{r['rep']} | {r['duration_s']:.2f} | {r['ref_j'][0]:.1f} | {r['ref_j'][1]:.1f} | "
            f"{cell('[1]', 'gpu1', '[1] gpu1')} | {cell('[0]', 'gpu0', '[0] gpu0')} | {cell('both', 'gpu0', 'both gpu0')} | "
            f"{cell('both', 'gpu1', 'both gpu1')} | {r['both_total_j']:.1f} ({fmt_err(e['both total'])}) | "
            f"{fmt_err(e['[0]+[1] vs both'])} | {fa('[0]')} / {fa('[1]')} / {fa('both')} |")
    g1 = [r for r in res["windows"] if r["phase"] == "gpu1" and r.get("gpu0_above_idle_j") is not None]
    if g1:
        lines += ["", "GPU 1's load as [0] saw it: GPU 0's reading minus its idle power x duration: " + ", ".join(
            f"{r['gpu0_above_idle_j']:+.1f} J of {r['ipw_j']['[1]']['gpu1']:.0f} J" for r in g1) + "."]
    lines += ["", "Sampler overhead (the sampler thread's CPU time, `time.thread_time()`):", "",
              "| sensor alone | measured | watched | windows | wall s | CPU s | share of one core | calls | counter period s |",
              "|---|---|---|---:|---:|---:|---:|---|---:|"]
    for o in res["overhead"]:
        ov = o["overhead"]
        lines.append(f"| {o['label']} | {', '.join(o['measured'])} | {', '.join(o['watched']) or '-'} | {o['windows']} | "
                     f"{ov['wall_s']:.1f} | {ov['cpu_s']:.3f} | {ov['cpu_fraction_of_one_core']:.2%} | {ov['calls']} | "
                     f"{ov['periods_s']['counter']:.2f} |")
    for k, ov in res["overhead_side_by_side"].items():
        lines.append(f"| {k} (3 sensors + reference poller side by side) | | | | {ov['wall_s']:.1f} | {ov['cpu_s']:.3f} | "
                     f"{ov['cpu_fraction_of_one_core']:.2%} | {ov['calls']} | {ov['periods_s']['counter']:.2f} |")
    lines += ["", "Acceptance:", ""]
    for text, ok in res["acceptance"]:
        lines.append(f"- {'PASS' if ok else 'FAIL'}: {text}")
    lines.append(f"- (info) reference: largest gap between counter reads at a window edge "
                 f"{max(r['ref_edge_gap_s'] for r in res['windows']) * 1000:.1f} ms")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# offline: foreign activity recomputed from a run's recorded instant power


def reanalyse(folder: Path) -> int:
    """Recompute every window's foreign-activity verdict of ``[0]`` and ``[1]`` with the current rule
    (:func:`ipw.telemetry.foreign.foreign_verdict`) from ``multigpu_raw.npz``: the two-GPU sensor
    recorded both GPUs' instant power at the same 4 Hz at which ``[0]`` / ``[1]`` watched the other
    GPU.  Writes ``multigpu_foreign_recomputed.{json,md}`` beside the run's files."""
    from ipw.telemetry.foreign import foreign_verdict, idle_from_reads

    res = json.loads((folder / "multigpu.json").read_text())
    raw = np.load(folder / "multigpu_raw.npz")
    limits = {w["component"]: w["power_limit_w"] for k in ("[0]", "[1]")
              for w in res["sensor_info"][k]["watched_gpus"]}
    out = []
    for r in res["windows"]:
        row = {"phase": r["phase"], "rep": r["rep"], "as_run": {}, "recomputed": {}}
        for sensor, k in (("[0]", 1), ("[1]", 0)):
            t, w = raw[f"gpu{k}_instant_t_s"], raw[f"gpu{k}_instant_w"]
            upto = t <= r["end_s"]
            v = foreign_verdict(f"nvml{k}", t[upto], w[upto], idle_from_reads(w[upto]), limits.get(f"nvml{k}"),
                                r["start_s"], r["end_s"])
            row["recomputed"][sensor] = [v] if v else []
            row["as_run"][sensor] = r["foreign"][sensor]
        out.append(row)
    (folder / "multigpu_foreign_recomputed.json").write_text(json.dumps(out, indent=1))

    def cell(xs):
        return ", ".join(f"{a['component']} {a['mean_w']:.0f} W (idle {a['idle_w']:.0f} W, ~{a['excess_j']:.0f} J)"
                         for a in xs) or "-"

    lines = ["Foreign activity per window: as the run reported it, and recomputed from the recorded instant power "
             "with the committed rule (`sampler.foreign_verdict`, idle = lowest 1 s median since the start).", "",
             "| window | [0] as run | [0] recomputed | [1] as run | [1] recomputed |", "|---|---|---|---|---|"]
    for row in out:
        lines.append(f"| {row['phase']} #{row['rep']} | {cell(row['as_run']['[0]'])} | {cell(row['recomputed']['[0]'])} | "
                     f"{cell(row['as_run']['[1]'])} | {cell(row['recomputed']['[1]'])} |")
    same = all([a["component"] for a in row["as_run"][s]] == [a["component"] for a in row["recomputed"][s]]
               for row in out for s in ("[0]", "[1]"))
    lines += ["", f"Same GPUs flagged in every window: {'yes' if same else 'NO'}."]
    (folder / "multigpu_foreign_recomputed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if same else 1


# --------------------------------------------------------------------------------------------------
# main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each loaded window")
    ap.add_argument("--repeats", type=int, default=3, help="windows of the GPU-1-only load")
    ap.add_argument("--overhead-seconds", type=float, default=15.0)
    ap.add_argument("--fake", action="store_true", help="simulated NVML and sleeping workers (no GPU)")
    ap.add_argument("--reanalyse", metavar="DIR", help="recompute foreign activity from a run's files in DIR")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.fake)
    if args.reanalyse:
        return reanalyse(Path(args.reanalyse))
    for k, v in MULTICAST_OFF.items():
        os.environ.setdefault(k, v)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_begin = time.monotonic()

    fake_mod = None
    if args.fake:
        fake_mod = fake_nvml(2)
        sys.modules["pynvml"] = fake_mod
    from ipw.telemetry.nvml import NvmlSensor, import_pynvml

    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        print(f"CUDA_VISIBLE_DEVICES={cvd} in the parent: unset so that CUDA ordinals are NVML indices", flush=True)
        del os.environ["CUDA_VISIBLE_DEVICES"]
    nvml = import_pynvml()
    nvml.nvmlInit()
    count = nvml.nvmlDeviceGetCount()
    if count < 2:
        raise SystemExit(f"bench/scale/multigpu.py needs two GPUs; NVML sees {count}")
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
    text = lambda v: v.decode() if isinstance(v, bytes) else v  # noqa: E731
    uuids = [text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
    names = [text(nvml.nvmlDeviceGetName(h)) for h in handles]
    driver = text(nvml.nvmlSystemGetDriverVersion())
    print(f"{count} GPUs: " + ", ".join(f"{i}: {n} {u}" for i, (n, u) in enumerate(zip(names, uuids))), flush=True)

    workers = [Worker(i, uuids[i], args.fake) for i in range(2)]
    sensors = {"[1]": NvmlSensor([1]), "[0]": NvmlSensor([0]), "both": NvmlSensor()}
    t_sensors = time.monotonic()
    ref = RefPoller(nvml, handles)
    ref.start()
    for w in workers:
        w.ready()
    n_full = [max(1, round(args.seconds / w.sec)) for w in workers]
    n_short = [max(1, round(0.3 / w.sec)) for w in workers]
    print("workers: " + ", ".join(f"GPU {w.gpu} ({w.name} {w.uuid}): {w.sec * 1000:.3f} ms per product, "
                                  f"{n_full[w.gpu]} per window" for w in workers), flush=True)
    # calibration history, and the workers' warm-up heat gone
    time.sleep(max(3.0, 12.0 - (time.monotonic() - t_sensors)))

    windows: list[dict[str, Any]] = []
    idle = measured_window("idle", 0, {}, workers, sensors, ref, fake_mod, idle_s=args.seconds)
    windows.append(idle)
    idle_w = [idle["readings"]["both"][c].energy_j / (idle["end_s"] - idle["start_s"]) for c in ("gpu0", "gpu1")]
    print(f"idle: {idle_w[0]:.1f} W, {idle_w[1]:.1f} W", flush=True)
    plan = [("gpu1", r, {1: n_full[1]}) for r in range(args.repeats)]
    plan += [("both", r, {0: n_full[0], 1: n_full[1]}) for r in range(2)]
    plan += [("both, GPU 1 half", r, {0: n_full[0], 1: max(1, n_full[1] // 2)}) for r in range(2)]
    for phase, rep, runs in plan:
        time.sleep(1.5)
        w = measured_window(phase, rep, runs, workers, sensors, ref, fake_mod, idle_s=args.seconds)
        windows.append(w)
        print(f"{phase} #{rep}: {w['end_s'] - w['start_s']:.2f} s; " + "; ".join(
            f"{s}: " + ", ".join(f"{c} {r.energy_j:.1f} J" for c, r in w["readings"][s].items()) for s in SENSORS)
            + f"; foreign [0]={[a['component'] for a in w['foreign']['[0]']]} [1]={[a['component'] for a in w['foreign']['[1]']]}",
            flush=True)
    side = {k: s.overhead() for k, s in sensors.items()}
    infos = {k: s.info() for k, s in sensors.items()}
    arrays = {}
    for c in ("gpu0", "gpu1"):
        for key, v in sensors["both"].sampler.arrays(c).items():
            arrays[f"{c}_{key}"] = v
    for k in range(2):
        arrays[f"ref{k}_t_s"], arrays[f"ref{k}_j"] = np.asarray(ref.t[k]), np.asarray(ref.j[k])
    rows = [analyse_window(w, ref, idle_w) for w in windows]
    for s in sensors.values():
        s.close()
    ref.stop_ev.set()
    ref.join(2)

    overheads = [
        overhead_phase("1 GPU measured, 1 watched", [0], workers, args.overhead_seconds, fake_mod, n_short),
        overhead_phase("2 GPUs measured", None, workers, args.overhead_seconds, fake_mod, n_short),
    ]
    for w in workers:
        w.quit()
    nvml.nvmlShutdown()

    res: dict[str, Any] = {
        "machine": {"gpus": f"{count}x " + " / ".join(sorted(set(names))), "uuids": uuids, "driver": driver,
                    "host": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
                    "python": platform.python_version(), "fake": args.fake},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "PYTHONPATH=. python3 bench/scale/multigpu.py" + (" --fake" if args.fake else "")
        + (f" --seconds {args.seconds:g}" if args.seconds != 5.0 else "")
        + (f" --repeats {args.repeats}" if args.repeats != 3 else ""),
        "workers": [{"gpu": w.gpu, "cuda_uuid": w.uuid, "nvml_uuid": uuids[w.gpu], "name": w.name,
                     "seconds_per_product": w.sec, "products_per_window": n_full[w.gpu]} for w in workers],
        "idle_w": idle_w, "idle_window_s": idle["end_s"] - idle["start_s"],
        "windows": rows,
        "overhead": overheads,
        "overhead_side_by_side": side,
        "sensor_info": {k: {"detail": i.detail, "watched_gpus": i.params["watched_gpus"],
                            "components": list(i.components)} for k, i in infos.items()},
        "tolerances": {"load": LOAD_TOL, "idle": IDLE_TOL, "leak": LEAK_TOL, "sum": SUM_TOL, "overhead": OVERHEAD_BUDGET},
    }
    res["acceptance"] = acceptance(rows, overheads)
    res["runtime_s"] = time.monotonic() - t_begin
    (out / "multigpu.json").write_text(json.dumps(res, indent=1, default=float))
    md = markdown(res)
    (out / "multigpu.md").write_text(md)
    np.savez_compressed(out / "multigpu_raw.npz", **arrays)
    print(md, flush=True)
    print(f"runtime {res['runtime_s']:.0f} s; wrote {out}/multigpu.json, multigpu.md, multigpu_raw.npz", flush=True)
    return 0 if all(ok for _, ok in res["acceptance"]) else 1


if __name__ == "__main__":
    sys.exit(main())
