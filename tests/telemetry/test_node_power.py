"""Whole-node power from the BMC (ipw/telemetry/node_power.py), against real Redfish servers:

- ``sushy-static`` (sushy-tools' mockup server, DMTF's mockup layout: a folder per resource with its
  ``index.json``) serving tests/data/redfish_node/, whose power and energy counter a thread here rewrites
  every ``STEP_S`` (the server reads the file on every GET, so the "BMC" refreshes its readings as a
  real one does; sushy-tools has no way to vary a reading over time itself);
- ``sushy-emulator`` (sushy-tools' Flask emulator, fake driver) with HTTP basic authentication, for a BMC
  that refuses credentials and a Redfish service whose chassis has no power data;
- a scripted ``ipmitool`` on PATH printing ipmitool's ``dcmi power reading`` output, for IPMI DCMI.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from ipw.errors import IpwError
from ipw.telemetry import node_power
from ipw.telemetry.base import EnergyReading, total_energy

TREE = Path(__file__).parents[1] / "data" / "redfish_node"
BIN = Path(sys.executable).parent
IPW = [str(BIN / "ipw")]
STEP_S = 0.3  # the emulated BMC's refresh
POWERS = (420.0, 610.0, 515.0, 700.0, 455.0, 640.0)

pytestmark = pytest.mark.skipif(not (BIN / "sushy-static").exists(), reason="sushy-tools not installed (the dev extra)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"emulator exited {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


class Varier(threading.Thread):
    """Rewrites the mockup's power (EnvironmentMetrics PowerWatts, Power PowerControl) and its energy counter
    (EnergyJoules, EnergykWh: the exact integral of the power written) every ``STEP_S``; ``truth(a, b)`` is
    the energy of the power it served over [a, b]."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root, self.stop = root, threading.Event()
        self.env = root / "Chassis/1U/EnvironmentMetrics/index.json"
        self.legacy = root / "Chassis/1U/Power/index.json"
        self.steps: list[tuple[float, float]] = []  # (monotonic s from which, watts)
        self.energy_j = 1.0e6
        self.write(POWERS[0])

    def _put(self, path: Path, doc: dict) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)  # atomic: a GET sees the old file or the new one

    def write(self, watts: float) -> None:
        now = time.monotonic()
        if self.steps:
            self.energy_j += self.steps[-1][1] * (now - self.steps[-1][0])
        env = json.loads(self.env.read_text())
        env["PowerWatts"]["Reading"] = watts
        env["EnergyJoules"]["Reading"] = round(self.energy_j, 3)
        env["EnergykWh"]["Reading"] = round(self.energy_j / 3.6e6, 6)
        legacy = json.loads(self.legacy.read_text())
        legacy["PowerControl"][0]["PowerConsumedWatts"] = watts
        self._put(self.env, env)
        self._put(self.legacy, legacy)
        self.steps.append((time.monotonic(), watts))

    def run(self) -> None:
        k = 1
        while not self.stop.wait(STEP_S):
            self.write(POWERS[k % len(POWERS)])
            k += 1

    def truth(self, a: float, b: float) -> float:
        total = 0.0
        for (t0, w), nxt in zip(self.steps, [*self.steps[1:], (float("inf"), 0.0)]):
            lo, hi = max(a, t0), min(b, nxt[0])
            if hi > lo:
                total += w * (hi - lo)
        return total


@pytest.fixture
def redfish(tmp_path):
    root = tmp_path / "mockup"
    shutil.copytree(TREE, root)
    port = _free_port()
    proc = subprocess.Popen([str(BIN / "sushy-static"), "-i", "127.0.0.1", "-p", str(port), "-m", str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url + "/redfish/v1/", proc)
        yield url, root
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def authed_emulator(tmp_path):
    """sushy-emulator (fake driver: a chassis without any power resource) behind basic authentication."""
    bcrypt = pytest.importorskip("bcrypt")
    (tmp_path / "htpasswd").write_text("admin:" + bcrypt.hashpw(b"right-password", bcrypt.gensalt()).decode() + "\n")
    conf = tmp_path / "emulator.conf"
    conf.write_text(f"SUSHY_EMULATOR_AUTH_FILE = {str(tmp_path / 'htpasswd')!r}\nSUSHY_EMULATOR_FAKE_DRIVER = True\n"
                    "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'\n")
    port = _free_port()
    proc = subprocess.Popen([str(BIN / "sushy-emulator"), "--config", str(conf), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url + "/redfish/v1/", proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def varied(redfish, monkeypatch):
    """The mockup's power varied over time (``Varier``) and ipw's BMC environment pointed at it."""
    url, root = redfish
    varier = Varier(root)
    varier.start()
    for k, v in _env(url).items():
        monkeypatch.setenv(k, v)
    try:
        yield varier
    finally:
        varier.stop.set()
        varier.join()


def _env(url: str, **more: str) -> dict[str, str]:
    return {"IPW_NODE_POWER": url, "IPW_BMC_USER": "admin", "IPW_BMC_PASSWORD": "s3cret-bmc-pw",
            "IPW_BMC_PERIOD_S": "0.05", **more}


def test_redfish_energy_matches_the_emulators_power_over_the_window(redfish):
    url, root = redfish
    varier = Varier(root)
    varier.start()
    sensor = node_power.open_node_sensor(node_power.node_config(_env(url)))
    try:
        assert sensor.name == "node_power"
        params = sensor.info().params
        assert (params["chassis"], params["power_field"], params["power_kind"], params["counter_field"]) == \
            ("1U", "EnvironmentMetrics.PowerWatts", "input", "EnergyJoules")  # the top-level chassis, not the GPU board
        assert params["psu_input_w"] == 500.0 and params["psu_output_w"] == 459.0
        time.sleep(1.0)
        windows = []
        for length in (3.0, 2.0, 0.1):  # the last is shorter than the BMC's refresh
            start = sensor.begin()
            time.sleep(length)
            windows.append(sensor.end(start))
        time.sleep(0.5)
        results = []
        for pending in windows:
            assert pending.wait(5.0)
            (reading,) = pending.result()
            results.append((pending, reading))
    finally:
        sensor.close()
        varier.stop.set()
        varier.join()
    period = sensor.platform.update_period_s  # type: ignore[attr-defined]
    assert period == pytest.approx(STEP_S, abs=0.06)
    for pending, reading in results[:2]:
        truth = varier.truth(pending.start_s, pending.end_s)
        assert reading.scope == "node" and reading.source == "redfish.power"
        assert reading.quality == "measured_interpolated"
        # within 3%, or the reading's own stated ±90% band where that is wider (a poll delayed on a busy machine
        # at a step of the served power, near a window's edge)
        assert abs(reading.energy_j - truth) <= max(0.03 * truth, reading.uncertainty_j or 0.0), (reading, truth)
        assert "calibration ratio" in reading.note and f"updates every {period:g} s (observed)" in reading.note
    pending, short = results[2]
    assert "short window" in short.note and short.uncertainty_j is not None  # labelled, never trusted silently
    assert abs(short.energy_j - varier.truth(pending.start_s, pending.end_s)) <= short.uncertainty_j + 0.03 * short.energy_j
    # the manifest's record of the sensor: the URL, never a credential
    text = json.dumps(sensor.info().params) + sensor.info().detail
    assert url in text and "s3cret-bmc-pw" not in text and "admin" not in text


def test_a_measured_window_carries_the_node_reading_beside_the_chip_total(redfish, monkeypatch):
    """Through the probe and Window that ipw run uses (here via ipw.measure): the node is one part of the
    window, attributed like any polled sensor's, and its joules are not in the chip total."""
    import ipw

    with varied(redfish, monkeypatch) as varier, ipw.measure(gpus=[]) as m:
        t0 = time.monotonic()
        time.sleep(2.0)
        t1 = time.monotonic()
    result = m.result
    (node,) = [p for p in result.parts if p.scope == "node"]
    assert node.energy_j == pytest.approx(varier.truth(t0, t1), rel=0.05)
    assert "node" not in result.scope
    assert result.best_effort_energy_j == pytest.approx(sum(p.energy_j or 0.0 for p in result.parts if p.scope != "node"))
    assert any(s.name == "node_power" for s in result.sensors)


def test_ipw_run_records_the_node_and_never_the_credentials(redfish, tmp_path):
    """ipw run end to end (the embedded model, one query): each record's parts carry the node's reading, the
    manifest names the BMC by URL, and the password is nowhere in the run folder."""
    url, root = redfish
    varier = Varier(root)
    varier.start()
    out = tmp_path / "runs"
    try:
        result = subprocess.run(IPW + ["run", "-n", "2", "-b", "smollm2-135m", "--warmup", "0", "-o", str(out)],
                                capture_output=True, text=True, timeout=300, env={**os.environ, **_env(url)})
    finally:
        varier.stop.set()
        varier.join()
    assert result.returncode == 0, result.stderr
    (run,) = list(out.iterdir())
    for f in run.rglob("*"):
        if f.is_file():
            assert b"s3cret-bmc-pw" not in f.read_bytes(), f
    manifest = json.loads((run / "manifest.json").read_text())
    (node,) = [s for b in manifest["backends"] for s in b["sensors"] if s["scope"] == "node"]
    assert (node["name"], node["params"]["url"], node["params"]["chassis"]) == ("node_power", url, "1U")
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        parts = json.loads(r["energy_parts"]) if isinstance(r["energy_parts"], str) else r["energy_parts"]
        (part,) = [p for p in parts if p["scope"] == "node"]
        assert part["source"] == "redfish.power" and part["energy_j"] > 0
        truth = varier.truth(r["start_s"], r["end_s"])
        assert part["energy_j"] == pytest.approx(truth, rel=0.05, abs=part["uncertainty_j"] or 0.0)
        assert "node" not in r["energy_scope"]


def test_redfish_legacy_power_control_and_kwh_counter(redfish):
    """A chassis with only the legacy Power resource: PowerControl[0].PowerConsumedWatts (input power)."""
    url, root = redfish
    chassis = root / "Chassis/1U/index.json"
    doc = json.loads(chassis.read_text())
    del doc["EnvironmentMetrics"], doc["PowerSubsystem"]
    chassis.write_text(json.dumps(doc))
    config = node_power.node_config(_env(url))
    picked, seen = node_power.discover(node_power.RedfishClient(config))
    assert picked.id == "1U" and picked.power_field == "Power.PowerControl[0].PowerConsumedWatts"
    assert picked.power_kind == "input" and picked.counter_field is None
    assert (picked.psu_input_w, picked.psu_output_w) == (500.0, 459.0)
    # only output watts: labelled output (PSU losses are not counted)
    legacy = json.loads((root / "Chassis/1U/Power/index.json").read_text())
    del legacy["PowerControl"]
    for p in legacy["PowerSupplies"]:
        del p["PowerInputWatts"]
    (root / "Chassis/1U/Power/index.json").write_text(json.dumps(legacy))
    picked, _ = node_power.discover(node_power.RedfishClient(config), "1U")
    assert picked.power_kind == "output" and picked.first_w == 459.0
    # a kWh counter alone
    doc["EnvironmentMetrics"] = {"@odata.id": "/redfish/v1/Chassis/1U/EnvironmentMetrics"}
    chassis.write_text(json.dumps(doc))
    env = json.loads((root / "Chassis/1U/EnvironmentMetrics/index.json").read_text())
    del env["PowerWatts"], env["EnergyJoules"]
    (root / "Chassis/1U/EnvironmentMetrics/index.json").write_text(json.dumps(env))
    picked, _ = node_power.discover(node_power.RedfishClient(config), "1U")
    assert picked.counter_field == "EnergykWh" and picked.first_counter_j == pytest.approx(0.278 * 3.6e6)


def test_doctor_shows_what_it_found(redfish, monkeypatch):
    url, _ = redfish
    with varied(redfish, monkeypatch):
        rows = dict(node_power.doctor_rows())
    assert rows["BMC"] == f"{url} (Redfish)"
    assert rows["chassis"].startswith("1U (RackMount)") and "GPU_Baseboard" in rows["chassis"]
    assert rows["power"] == "EnvironmentMetrics.PowerWatts: input power"
    assert rows["power supplies"] == "input 500 W, output 459 W"
    assert rows["energy counter"] == "EnergyJoules"
    assert rows["update period"].endswith("s (observed)")
    assert float(rows["update period"].split()[0]) == pytest.approx(STEP_S, abs=0.06)
    result = subprocess.run(IPW + ["doctor"], capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert "node power from the BMC" in result.stdout and "EnergyJoules" in result.stdout
    assert "s3cret-bmc-pw" not in result.stdout + result.stderr


def _run_refused(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    out = tmp_path / "runs"
    out.mkdir()
    result = subprocess.run(IPW + ["run", "-n", "1", "-o", str(out)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env})
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(out.iterdir()) == []  # before any folder exists
    return result


def test_a_bmc_that_refuses_the_credentials_is_one_line_exit_2_before_any_folder(authed_emulator, tmp_path):
    result = _run_refused(tmp_path, _env(authed_emulator, IPW_BMC_PASSWORD="wrong-password"))
    assert "refused the credentials (HTTP 401" in result.stderr and "wrong-password" not in result.stderr


def test_a_redfish_answer_without_power_data_is_one_line_exit_2(authed_emulator, tmp_path):
    result = _run_refused(tmp_path, _env(authed_emulator, IPW_BMC_PASSWORD="right-password"))
    assert "no power data" in result.stderr and "right-password" not in result.stderr


def test_redfish_over_https_with_a_self_signed_certificate(tmp_path):
    """A BMC's usual HTTPS with its own certificate: refused unless IPW_BMC_VERIFY trusts it or skips the check."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    cert, key = tmp_path / "bmc.pem", tmp_path / "bmc.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=bmc",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    port = _free_port()
    proc = subprocess.Popen([str(BIN / "sushy-static"), "-i", "127.0.0.1", "-p", str(port), "-m", str(TREE),
                             "-c", str(cert), "-k", str(key)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:  # up once the port accepts
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        with pytest.raises(IpwError, match="IPW_BMC_VERIFY=/path/to/its-ca.pem") as e:
            node_power.discover(node_power.RedfishClient(node_power.node_config(_env(url))))
        assert "\n" not in e.value.message
        for verify in (str(cert), "0"):
            picked, _ = node_power.discover(node_power.RedfishClient(node_power.node_config(_env(url, IPW_BMC_VERIFY=verify))))
            assert picked.id == "1U" and picked.first_w == 500.0
    finally:
        proc.terminate()
        proc.wait(10)


def test_configuration_errors(tmp_path):
    assert node_power.node_config({}) is None
    with pytest.raises(IpwError, match="no credentials in the URL"):
        node_power.node_config({"IPW_NODE_POWER": "https://admin:pw@bmc"})
    with pytest.raises(IpwError, match="set IPW_BMC_USER and IPW_BMC_PASSWORD"):
        node_power.node_config({"IPW_NODE_POWER": "https://bmc"})
    with pytest.raises(IpwError, match="IPMI account"):
        node_power.node_config({"IPW_NODE_POWER": "ipmi://bmc"})
    assert node_power.node_config({"IPW_NODE_POWER": "ipmi://"}).url == "ipmi://"  # in-band: no account
    with pytest.raises(IpwError, match="unknown scheme"):
        node_power.node_config({"IPW_NODE_POWER": "ftp://bmc"})
    with pytest.raises(IpwError, match="IPW_BMC_VERIFY"):
        node_power.node_config(_env("https://bmc", IPW_BMC_VERIFY=str(tmp_path / "none.pem")))
    c = node_power.node_config(_env("redfish://bmc.example:8443", IPW_BMC_VERIFY="0"))
    assert (c.kind, c.url, c.verify) == ("redfish", "https://bmc.example:8443", False)
    assert "s3cret" not in repr(c)
    with pytest.raises(IpwError, match="cannot reach the BMC"):
        node_power.discover(node_power.RedfishClient(node_power.node_config(_env(f"http://127.0.0.1:{_free_port()}"))))


def test_node_readings_are_never_added_to_the_chip_total():
    gpu = EnergyReading("gpu0", 100.0, "nvml.samples", "measured_interpolated", "gpu", 1.0)
    node = EnergyReading("node", 400.0, "redfish.power", "measured_interpolated", "node", 1.0)
    total = total_energy([gpu, node])
    assert (total.energy_j, total.best_effort_j, total.scope) == (100.0, 100.0, "gpu")


# --------------------------------------------------------------------------------------------------
# IPMI DCMI: a scripted ipmitool

DCMI_OUTPUT = """
    Instantaneous power reading:                   {w} Watts
    Minimum during sampling period:                 98 Watts
    Maximum during sampling period:                402 Watts
    Average power reading over sample period:      231 Watts
    IPMI timestamp:                           Fri Dec  4 05:40:01 2026
    Sampling period:                          00000001 Seconds.
    Power reading state is:                   activated

"""


def _fake_ipmitool(tmp_path: Path, body: str) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    script = bindir / "ipmitool"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return bindir


def test_ipmi_dcmi_reads_a_scripted_responder(tmp_path, monkeypatch):
    state = tmp_path / "watts"
    state.write_text("220")
    (tmp_path / "out.txt").write_text(DCMI_OUTPUT.replace("{w}", "$(cat " + str(state) + ")"))
    log = tmp_path / "argv"
    bindir = _fake_ipmitool(tmp_path, f'echo "$@" "pw=$IPMI_PASSWORD" >> {log}\n'
                                      f'eval "cat <<EOF\n$(cat {tmp_path / "out.txt"})\nEOF"\n')
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    sensor = node_power.open_node_sensor(node_power.node_config(_env("ipmi://bmc.example", IPW_BMC_PERIOD_S="0.05")))
    try:
        time.sleep(0.5)
        start = sensor.begin()
        time.sleep(1.0)
        pending = sensor.end(start)
        time.sleep(0.3)  # a step right at the window's end would be interpolated across the poll gap into it
        state.write_text("400")
        time.sleep(1.0)
        later = sensor.begin()
        time.sleep(1.0)
        pending2 = sensor.end(later)
        assert pending.wait(5.0) and pending2.wait(5.0)
        (r1,), (r2,) = pending.result(), pending2.result()
        info = sensor.info()
    finally:
        sensor.close()
    assert (r1.scope, r1.source, r1.component) == ("node", "ipmi_dcmi.power", "node")
    assert r1.energy_j == pytest.approx(220.0 * (pending.end_s - pending.start_s), rel=0.02)
    assert r2.energy_j == pytest.approx(400.0 * (pending2.end_s - pending2.start_s), rel=0.02)
    assert "uncalibrated" in r1.note and "input or output not stated" in r1.note
    assert info.params["power_kind"] == "not stated" and info.params["dcmi_sampling_period_s"] == 1.0
    argv = log.read_text().splitlines()[0]
    assert argv == "-I lanplus -H bmc.example -U admin -E dcmi power reading pw=s3cret-bmc-pw"  # never on the command line


def test_ipmi_refused_and_unsupported(tmp_path, monkeypatch):
    bindir = _fake_ipmitool(tmp_path, 'echo "Error: Unable to establish IPMI v2 / RMCP+ session" >&2\nexit 1\n')
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    for k, v in _env("ipmi://bmc.example").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(IpwError, match="the BMC refused the credentials") as e:
        node_power.check_configured()
    assert "\n" not in e.value.message and "s3cret" not in e.value.message
    _fake_ipmitool(tmp_path, 'echo "DCMI request failed because: Invalid command (c1)"\nexit 0\n')
    with pytest.raises(IpwError, match="no power reading"):
        node_power.check_configured()
    out = tmp_path / "runs"
    out.mkdir()
    result = subprocess.run(IPW + ["run", "-n", "1", "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and list(out.iterdir()) == []


def test_parse_dcmi():
    got = node_power.parse_dcmi(DCMI_OUTPUT.replace("{w}", "231"))
    assert got == {"instant_w": 231.0, "min_w": 98.0, "max_w": 402.0, "average_w": 231.0, "sampling_period_s": 1.0,
                   "state": "activated"}


def test_ipw_serves_provisional_energy_leaves_the_node_out():
    """The meter of ipw serve: a request's provisional energy sums what its settled total sums, never the node."""
    from ipw.metering.meter import Meter
    from ipw.metering.window import Window
    from ipw.telemetry.base import SensorBase, SensorInfo

    class Constant(SensorBase):
        supports_cut = True

        def __init__(self, name, comp, scope, watts):
            self.name, self.comp, self.scope, self.watts = name, comp, scope, watts

        def info(self):
            return SensorInfo(self.name, True, f"{self.name}.power", "measured", self.scope, (self.comp,))

        def begin(self, t_s=None):
            return time.monotonic() if t_s is None else t_s

        def end(self, token, t_s=None):
            now = time.monotonic() if t_s is None else t_s
            return [EnergyReading(self.comp, self.watts * (now - token), f"{self.name}.power", "measured", self.scope,
                                  now - token)]

        def cut(self, token, t_s=None):
            now = time.monotonic() if t_s is None else t_s
            return self.end(token, now), now

        def current_power_w(self):
            return {self.comp: self.watts}

    meter = Meter(Window([Constant("chip", "gpu0", "gpu", 100.0), Constant("node_power", "node", "node", 400.0)]),
                  live_tokens=True)
    meter.open()
    try:
        job = meter.start()
        meter.token(job)
        time.sleep(0.02)
        start, end = meter.end(job, None)
        provisional = meter.provisional(job)
    finally:
        meter.close()
    assert [r.component for r in provisional.readings] == ["gpu0"]
    assert provisional.readings[0].energy_j == pytest.approx(100.0 * (end - start), rel=1e-6)


def test_the_chip_totals_error_leaves_the_node_out():
    from dataclasses import asdict

    from ipw.telemetry.uncertainty import measurement_sd

    gpu = EnergyReading("gpu0", 100.0, "rapl.package", "measured", "gpu", 1.0, uncertainty_j=1.645)
    node = EnergyReading("node", 400.0, "redfish.power", "measured_interpolated", "node", 1.0, uncertainty_j=16.45)
    assert measurement_sd(json.dumps([asdict(gpu), asdict(node)])) == measurement_sd(json.dumps([asdict(gpu)]))
