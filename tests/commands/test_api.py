"""The Python API: ``ipw.measure`` around a block of code, ``ipw.load_run``, a light ``import ipw``, and
the "Python API" page's examples (docs/guide/python-api.md) run as doctests."""

from __future__ import annotations

import dataclasses
import doctest
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ipw
from ipw.errors import IpwError
from ipw.telemetry.cpu_model import CpuModelSensor

ROOT = Path(__file__).resolve().parents[2]
BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"


def burn_cpu(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_import_ipw_is_light():
    code = ("import sys, ipw\n"
            "heavy = [m for m in ('pandas', 'numpy', 'pyarrow', 'psutil', 'pynvml', 'ipw.api') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "assert {'measure', 'load_run', 'Measurement'} <= set(dir(ipw))\n"
            "assert ipw.measure.__module__ == 'ipw.api' and 'pandas' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ipw.nope  # noqa: B018


def test_cpu_model_charges_this_process_tree():
    """No GPU, no RAPL: one estimated part, the CPU seconds of this process and its children × W/core."""
    watts = CpuModelSensor(lambda: []).watts_per_core
    with ipw.measure(gpus=[], rapl=False) as m:
        assert m.result is None
        cpu0 = time.process_time()
        burn_cpu(0.3)
        subprocess.run([sys.executable, "-c", BURN.format(s=0.3)], check=True)  # a child: in the tree
        own_s = time.process_time() - cpu0
    r = m.result
    assert dataclasses.is_dataclass(r) and r.__dataclass_params__.frozen
    (part,) = r.parts
    assert (part.component, part.source, part.quality, part.scope) == ("cpu-process", "model.cpu", "estimated",
                                                                       "cpu_package")
    assert (r.quality, r.source, r.scope) == ("estimated", "model.cpu", "cpu_package")
    assert r.energy_j == r.best_effort_energy_j == part.energy_j
    cpu_s = r.energy_j / watts
    # /proc counts CPU time in 10 ms ticks; the child's start-up costs CPU time too
    assert own_s + 0.3 - 0.03 <= cpu_s <= own_s + 0.3 + 0.3, (cpu_s, own_s)
    assert r.duration_s >= cpu_s * 0.5  # 2 cores at most, one busy at a time
    assert r.mean_power_w == pytest.approx(r.energy_j / r.duration_s)
    assert [s.name for s in r.sensors] == ["cpu_model"] and r.sensors[0].params["watts_per_core"] == watts


def test_pids_names_other_processes():
    """``pids``: another process's CPU time is charged, not this one's."""
    import psutil

    child = subprocess.Popen([sys.executable, "-c", BURN.format(s=30)])
    try:
        time.sleep(0.2)
        proc = psutil.Process(child.pid)
        before = sum(proc.cpu_times()[:2])
        with ipw.measure(gpus=[], rapl=False, pids=[child.pid]) as m:
            burn_cpu(0.3)  # this process: not charged
        after = sum(proc.cpu_times()[:2])
    finally:
        child.kill()
        child.wait()
    cpu_s = m.result.energy_j / CpuModelSensor(lambda: []).watts_per_core
    assert after - before - 0.05 <= cpu_s <= after - before + 1e-9, (cpu_s, after - before)  # float sums of ticks
    assert after - before > 0.1  # the child did run


def test_result_is_set_when_the_block_raises():
    with pytest.raises(ZeroDivisionError):
        with ipw.measure(gpus=[], rapl=False) as m:
            _ = 1 / 0
    assert m.result is not None and m.result.quality == "estimated"


def test_gpu_is_measured_and_the_estimate_kept_apart(monkeypatch):
    """An autospec'd NVML (tests/nvml_fakes.py) on the real clock: 400 W during the block, 100 W
    around it.  The total is the measured GPU part; the CPU model's estimate is only best effort.

    The load is switched by the block itself (its first statement turns it on, its last one off), not
    timed by sleeps against a schedule fixed in advance: on a loaded machine ``ipw.measure``'s set-up
    (probing, starting the sampler) can outlast any such schedule, and the block then measured the idle
    after the load.  Each switch rewrites only the fake's future (samples and counter steps not yet
    due), so what the sampler has read stays as it was."""
    from nvml_fakes import RealClock, make_fake, synthetic

    t0 = time.monotonic()
    offset = time.monotonic_ns() - time.time_ns()
    sig, _ = synthetic(duration_s=60.0, t0_s=t0, load=(1e6, 1e6 + 1), offset_ns=offset)  # idle until the block
    make_fake(monkeypatch, [sig], RealClock())

    def load(a_s, b_s):  # 400 W over [a_s, b_s] (monotonic s), 100 W elsewhere, from now on
        new, _ = synthetic(duration_s=60.0, t0_s=t0, load=(a_s - t0, b_s - t0), offset_ns=offset)
        sig.samp_mw, sig.ctr_mj, sig.inst_mw = new.samp_mw, new.ctr_mj, new.inst_mw  # same time grids

    time.sleep(0.5)  # idle history before the block
    with ipw.measure(gpus=[0], rapl=False) as m:
        on = time.monotonic()
        load(on, on + 1e6)
        time.sleep(1.0)
        load(on, time.monotonic())
    r = m.result
    gpu, cpu = r.parts
    assert (gpu.component, gpu.source, gpu.quality, gpu.scope) == ("gpu0", "nvml.samples", "measured_interpolated",
                                                                   "gpu")
    assert r.duration_s >= 1.0
    assert gpu.energy_j == pytest.approx(400 * r.duration_s, rel=0.1)
    assert (r.energy_j, r.quality, r.source, r.scope) == (gpu.energy_j, "measured_interpolated", "nvml.samples", "gpu")
    assert cpu.quality == "estimated" and r.best_effort_energy_j == pytest.approx(gpu.energy_j + cpu.energy_j)
    assert [s.name for s in r.sensors] == ["nvml", "cpu_model"]


def test_load_run(tmp_path):
    run = ipw.load_run(ROOT / ".ci" / "baseline-default")
    manifest, records = run
    assert manifest["status"] == "complete" and run.records is records
    assert len(records) == manifest["dataset"]["n_queries"] * len(manifest["backends"])
    assert {"backend", "query_id", "correct", "energy_j", "energy_quality", "energy_source"} <= set(records.columns)
    # a run still going has only its log
    live = tmp_path / "live"
    live.mkdir()
    (live / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))
    (live / "records.jsonl").write_text((ROOT / ".ci" / "baseline-default" / "records.jsonl").read_text()
                                        .splitlines(keepends=True)[0] + '{"torn')
    assert len(ipw.load_run(live).records) == 1
    with pytest.raises(IpwError, match="not a run folder"):
        ipw.load_run(tmp_path)


def test_python_api_page_doctests(monkeypatch):
    """The ```pycon blocks of the documentation's "Python API" page (README.md points to it), run as one
    doctest from the root."""
    page = "docs/guide/python-api.md"
    text = (ROOT / page).read_text(encoding="utf-8")
    assert text.startswith("# Python API\n")
    blocks = re.findall(r"^```pycon\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == 3
    assert page in (ROOT / "README.md").read_text(encoding="utf-8")
    monkeypatch.chdir(ROOT)
    test = doctest.DocTestParser().get_doctest("\n".join(blocks), {}, page, page, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
