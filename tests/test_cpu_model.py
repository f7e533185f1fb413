from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from ipw.errors import IpwError
from ipw.telemetry.cpu_model import (
    GENERIC_CORE_POWER,
    CpuModelSensor,
    core_power_for,
    process_tree_cpu_s,
)

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < {busy_s}: pass\n"


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def test_reaped_child_cpu_is_counted():
    sensor = CpuModelSensor(lambda: [os.getpid()], watts_per_core=2.0)
    before = own_cpu_s()
    token = sensor.begin()
    subprocess.run([sys.executable, "-c", BUSY.format(busy_s=0.3)], check=True)
    (reading,) = sensor.end(token).result()
    cpu_s = own_cpu_s() - before
    assert cpu_s >= 0.3
    assert reading.energy_j == pytest.approx(cpu_s * 2.0, abs=0.05 * 2.0)
    assert (reading.component, reading.source, reading.quality, reading.scope) == (
        "cpu-process", "model.cpu", "estimated", "cpu_package",
    )
    assert "W/core" in reading.note


def test_live_grandchild_cpu_is_counted():
    # A launcher whose child burns 0.3 CPU s and then sleeps; measured while both still live.
    script = (
        "import subprocess, sys\n"
        f"subprocess.run([sys.executable, '-c', {BUSY.format(busy_s=0.3) + 'time.sleep(30)'!r}])\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script])
    try:
        sensor = CpuModelSensor(lambda: [launcher.pid], watts_per_core=4.0)
        token = sensor.begin()
        # the sensor's thread finds a process born into the tree within TREE_RESCAN_S (1 s) of its birth,
        # at a read inside this window
        time.sleep(1.5)
        (reading,) = sensor.end(token).result()
    finally:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            child.kill()
        launcher.kill()
        launcher.wait()
    # interpreter start-up of the grandchild is also in the window
    assert 0.3 * 4.0 <= reading.energy_j <= 0.6 * 4.0
    assert reading.quality == "estimated"


def test_vanished_processes_are_tolerated():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert process_tree_cpu_s([gone.pid]) == 0.0
    sensor = CpuModelSensor(lambda: [gone.pid])
    (reading,) = sensor.end(sensor.begin()).result()
    assert reading.energy_j == 0.0 and reading.quality == "estimated"


def test_default_coefficient_from_the_table():
    assert core_power_for("AMD EPYC 9654 96-Core Processor").watts_per_core == 3.75
    assert core_power_for("Intel(R) Xeon(R) Platinum 8480+").watts_per_core == 6.25
    assert core_power_for("Apple M2 Pro").watts_per_core == 3.0
    assert core_power_for("Some Unknown CPU") is GENERIC_CORE_POWER
    assert GENERIC_CORE_POWER.watts_per_core == 10.0
    info = CpuModelSensor(lambda: []).info()
    assert info.quality == "estimated" and info.source == "model.cpu"
    assert {"watts_per_core", "basis", "cpu_model"} <= set(info.params)
    assert CpuModelSensor(lambda: [], watts_per_core=7.5).info().params["watts_per_core"] == 7.5
    with pytest.raises(IpwError):
        CpuModelSensor(lambda: [], watts_per_core=0)
