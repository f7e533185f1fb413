"""Carbon per correct answer and the energy bases (issue 45, items 1, 2 and their bad input, item 4).

The offline region table, the live feed against a local HTTP stub (and its unreachable case), the run
options' bad input (one line, exit 2, no folder), compare's carbon columns with CIs and re-pricing, the
facility basis (PUE) with the routing saving under chip and facility, the node basis, and one real
``ipw run --grid-region DE`` on the embedded default."""

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ipw import carbon
from ipw.analysis import render
from ipw.analysis.compare import compare
from ipw.errors import IpwError
from runfolders import write_run
from scripted import ScriptedBackend

IPW = [str(Path(sys.executable).parent / "ipw")]


# --- the offline table ----------------------------------------------------------------------------------

def test_a_country_by_its_two_or_three_letter_code_and_a_cloud_region():
    de = carbon.lookup("DE")
    assert de.g_per_kwh == carbon.lookup("deu").g_per_kwh
    assert 300 < de.g_per_kwh < 500 and de.zone == "DE" and de.date.startswith("year 20")
    assert "CodeCarbon 3.3.2" in de.source and de.detail.startswith("Germany")
    fr = carbon.lookup("FR")
    assert fr.g_per_kwh < de.g_per_kwh  # nuclear
    gcp = carbon.lookup("gcp:europe-west3")
    assert gcp.g_per_kwh == 345 and gcp.zone == "gcp:europe-west3" and "cloud/impact.csv" in gcp.source


@pytest.mark.parametrize("zone", ["XX", "Germany", "aws:us-east-1", "gcp:mars-1"])
def test_an_unknown_region_is_an_error(zone):
    with pytest.raises(IpwError, match="--grid-region"):
        carbon.lookup(zone)


def test_the_vendored_table_names_its_source_version_and_license():
    text = (Path(carbon.__file__).parent / "data" / "CARBON-DATA.md").read_text()
    assert "codecarbon 3.3.2" in text and "MIT" in text and "global_energy_mix.json" in text


# --- the live feed, against a stub ----------------------------------------------------------------------

class _Feed(BaseHTTPRequestHandler):
    seen: list = []

    def do_GET(self):
        _Feed.seen.append((self.path, self.headers.get("auth-token")))
        body = json.dumps({"zone": "DE", "carbonIntensity": 312, "datetime": "2026-12-04T05:00:00.000Z",
                           "emissionFactorType": "lifecycle", "isEstimated": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def feed(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Feed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv(carbon.FEED_URL_ENV, f"http://127.0.0.1:{server.server_address[1]}/v3")
    monkeypatch.setenv(carbon.FEED_KEY_ENV, "em-test-key-123456")
    _Feed.seen = []
    yield server
    server.shutdown()


def test_the_live_feed_gives_the_zone_its_hour_and_source(feed):
    got, note = carbon.resolve(None, "DE", grid_live=True)
    assert note is None
    assert got["g_per_kwh"] == 312 and got["zone"] == "DE" and got["date"] == "2026-12-04T05:00:00.000Z"
    assert got["source"] == "electricitymaps (live)" and "lifecycle" in got["detail"]
    assert _Feed.seen == [("/v3/carbon-intensity/latest?zone=DE", "em-test-key-123456")]


def test_an_unreachable_feed_gives_one_note_and_no_intensity(monkeypatch):
    import socket

    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(carbon.FEED_URL_ENV, f"http://127.0.0.1:{port}/v3")
    monkeypatch.setenv(carbon.FEED_KEY_ENV, "em-test-key-123456")
    got, note = carbon.resolve(None, "DE", grid_live=True)
    assert got["g_per_kwh"] is None and "could not be reached" in got["error"]
    assert note.startswith("carbon: the grid feed is unavailable") and "no carbon intensity" in note
    assert "\n" not in note and carbon.CarbonIntensity.from_dict(got) is None  # never made up


def test_the_feed_needs_its_key():
    env = {k: v for k, v in os.environ.items() if k != carbon.FEED_KEY_ENV}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "environ", env)
        with pytest.raises(IpwError, match=carbon.FEED_KEY_ENV):
            carbon.check_request(None, "DE", True)


# --- ipw run's bad input: one line, exit 2, before any folder -------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--carbon-intensity", "-5"], "--carbon-intensity: must be a finite number >= 0 and <= 2000"),
    (["--carbon-intensity", "5000"], "--carbon-intensity: must be a finite number >= 0 and <= 2000"),
    (["--grid-region", "XX"], "--grid-region 'XX': unknown region"),
    (["--grid-region", "DE", "--carbon-intensity", "300"], "give one of them"),
    (["--grid-live"], "--grid-live: needs --grid-region"),
])
def test_bad_carbon_options_exit_2_with_one_line_and_no_folder(tmp_path, args, message):
    out = tmp_path / "runs"
    out.mkdir()
    result = subprocess.run(IPW + ["run", "-n", "1", "-o", str(out), *args], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("line, message", [("pue = 0.95", "must be a finite number >= 1 and <= 5"),
                                           ("pue = 12", "must be a finite number >= 1 and <= 5"),
                                           ("carbon_intensity = -1", "field 'carbon_intensity'")])
def test_a_config_with_a_pue_below_1_or_a_bad_intensity_is_refused(tmp_path, line, message):
    from ipw.inputs.config import load_config

    top, backend = (line, "") if line.startswith("carbon") else ("", line)
    path = tmp_path / "run.toml"
    path.write_text(f'dataset = "ipw-core-default"\n{top}\n[[backends]]\nname = "a"\nkind = "llama-cpp"\n'
                    f'model = "smollm2-135m"\n{backend}\n')
    with pytest.raises(IpwError, match=message):
        load_config(str(path))


# --- compare: carbon with CIs, re-pricing, the bases ----------------------------------------------------

def _runs(tmp_path, *, pue=None, carbon_record=None, node=False):
    """A local and a cloud-role backend over 8 queries (the cloud more accurate and costlier at the chip)."""
    p = write_run(tmp_path, "r1", {
        "loc": {"correct": [1, 0, 1, 1, 0, 1, 1, 0], "energy": [1.0, 1.2, 0.9, 1.1, 1.0, 1.0, 0.95, 1.05]},
        "cl": {"correct": [1, 1, 1, 1, 1, 0, 1, 1], "energy": [1.1, 1.2, 1.05, 1.2, 1.1, 1.3, 1.15, 1.0],
               "role": "cloud"}})
    m = json.loads((p / "manifest.json").read_text())
    if pue is not None:
        m["config"] = {"backends": [{"name": "loc", "options": {}},
                                    {"name": "cl", "options": {"pue": pue, "pue_source": "provider's 2025 report"}}]}
    if carbon_record is not None:
        m["carbon"] = carbon_record
    (p / "manifest.json").write_text(json.dumps(m))
    if node:  # node readings (scope node, as ipw.telemetry.node_power writes them) on the local backend only
        lines = []
        for line in (p / "records.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r["backend"] == "loc":
                r["energy_parts"] = json.dumps([{"component": "node", "scope": "node", "energy_j": 3 * r["energy_j"],
                                                 "quality": "measured", "source": "redfish.power"}])
            lines.append(json.dumps(r))
        (p / "records.jsonl").write_text("\n".join(lines) + "\n")
        (p / "records.parquet").unlink(missing_ok=True)
    return p


DE = {"g_per_kwh": 380.95, "source": "CodeCarbon 3.3.2 global_energy_mix.json", "zone": "DE", "date": "year 2023"}


def test_a_run_without_an_intensity_shows_no_carbon(tmp_path):
    c = compare([_runs(tmp_path)], n_boot=200)
    assert all(v is None for v in c.carbon.values())
    assert all(c.metrics[x]["gco2e_per_correct"].value != c.metrics[x]["gco2e_per_correct"].value for x in c.metrics)
    assert not [t for t in render.tables(c) if t.key == "carbon"]
    assert "gCO2e/query" not in render.to_markdown(c)


def test_compare_shows_gco2e_per_query_and_per_correct_answer_with_cis_and_source(tmp_path):
    c = compare([_runs(tmp_path, carbon_record=DE)], n_boot=400)
    for label in ("loc", "cl"):
        m = c.metrics[label]
        jpq, acc = m["energy_per_query_j"].value, m["accuracy"].value
        assert m["gco2e_per_query"].value == pytest.approx(jpq / 3.6e6 * 380.95)
        assert m["gco2e_per_correct"].value == pytest.approx(jpq / 3.6e6 * 380.95 / acc)
        e = m["gco2e_per_correct"]
        assert e.lo < e.value < e.hi
    table = next(t for t in render.tables(c) if t.key == "carbon")
    assert table.headers[:3] == ["backend", "gCO2e/correct", "gCO2e/query"]
    assert table.rows[0][4] == "DE" and "CodeCarbon" in table.rows[0][5] and table.rows[0][6] == "year 2023"
    d = json.loads(render.to_json(c))
    assert d["carbon"]["loc"]["g_per_kwh"] == 380.95
    assert "gco2e_per_correct" in d["backends"][0]["metrics"]
    assert any("carbon: run r1 at 380.95 gCO2e/kWh (DE" in n for n in c.notes)


def test_compare_re_prices_old_runs_labelled(tmp_path, run_cli):
    p = _runs(tmp_path, carbon_record=DE)
    c = compare([p], n_boot=200, carbon_intensity=100.0)
    assert c.metrics["loc"]["gco2e_per_query"].value == pytest.approx(
        c.metrics["loc"]["energy_per_query_j"].value / 3.6e6 * 100)
    assert any("re-priced at 100 gCO2e/kWh" in n and "it recorded: 380.95" in n for n in c.notes)
    fr = compare([p], n_boot=200, grid_region="FR")
    assert fr.carbon["loc"].zone == "FR"
    code, out, err = run_cli("compare", str(p), "--carbon-intensity", "-1")
    assert code == 2 and "--carbon-intensity" in err
    code, out, err = run_cli("compare", str(p), "--grid-region", "Atlantis")
    assert code == 2 and "unknown region" in err


def test_facility_basis_and_the_routing_saving_under_chip_and_facility(tmp_path, run_cli):
    """The acceptance: a local and a cloud-role backend, pue = 1.2 on the cloud: both bases and the routing
    saving under each, on compare's tables."""
    p = _runs(tmp_path, pue=1.2)
    chip = compare([p], n_boot=400)
    facility = compare([p], n_boot=400, energy_basis="facility")
    assert facility.metrics["cl"]["energy_per_query_j"].value == pytest.approx(
        1.2 * chip.metrics["cl"]["energy_per_query_j"].value)
    assert facility.metrics["loc"]["energy_per_query_j"].value == pytest.approx(
        chip.metrics["loc"]["energy_per_query_j"].value)  # a laptop pays no facility
    saved_chip = chip.routing_ci["oracle_energy_saved_fraction"].value
    saved_facility = facility.routing_ci["oracle_energy_saved_fraction"].value
    assert saved_facility > saved_chip  # chip joules tilt the verdict toward the cloud
    views = {v.basis: v for v in chip.bases}
    assert set(views) == {"chip", "facility"}
    assert views["chip"].oracle_energy_saved_fraction.value == pytest.approx(saved_chip)
    assert views["facility"].oracle_energy_saved_fraction.value == pytest.approx(saved_facility)
    assert views["facility"].router_energy_saved_fraction.value == pytest.approx(0.8 * saved_facility)
    assert any("cl 1.2 (provider's 2025 report)" in n for n in facility.notes)
    code, out, err = run_cli("compare", str(p), "--n-boot", "200")
    assert code == 0
    assert "energy by basis" in out and "facility (chip x each backend's PUE)" in out and "chip (measured" in out
    assert out.count("energy basis: chip") >= 3  # on every table
    code, out, err = run_cli("compare", str(p), "--n-boot", "200", "--energy-basis", "facility", "--format", "json")
    d = json.loads(out)
    assert d["energy_basis"] == "facility" and d["facility"]["cl"] == {"pue": 1.2,
                                                                      "pue_source": "provider's 2025 report"}
    assert [b["basis"] for b in d["bases"]] == ["chip", "facility"]
    code, out, err = run_cli("compare", str(p), "--energy-basis", "wall")
    assert code == 2 and "--energy-basis" in err


def test_without_a_pue_only_the_chip_basis_is_shown(tmp_path):
    c = compare([_runs(tmp_path)], n_boot=100)
    assert c.bases == () and not [t for t in render.tables(c) if t.key == "bases"]
    assert all(b.pue == 1.0 for b in c.backends)


def test_node_basis_uses_node_readings_and_says_where_there_are_none(tmp_path):
    p = _runs(tmp_path, node=True)
    c = compare([p], n_boot=100, energy_basis="node")
    chip = compare([p], n_boot=100)
    assert c.metrics["loc"]["energy_per_query_j"].value == pytest.approx(
        3 * chip.metrics["loc"]["energy_per_query_j"].value)
    assert c.metrics["cl"]["energy_per_query_j"].value != c.metrics["cl"]["energy_per_query_j"].value  # NaN
    assert any("energy basis node: unavailable for cl" in n for n in c.notes)
    assert {v.basis for v in chip.bases} == {"chip", "node"}
    assert next(v for v in chip.bases if v.basis == "node").unavailable == ("cl",)


# --- the acceptance: a real run on the embedded default, offline ----------------------------------------

@pytest.mark.llama
@pytest.mark.timeout(300)
def test_ipw_run_grid_region_de_shows_gco2e_per_correct_answer_with_its_source(tmp_path):
    out = tmp_path / "runs"
    env = {**os.environ, "COLUMNS": "220"}  # the table is read from the package: no request leaves the machine
    result = subprocess.run(IPW + ["run", "--grid-region", "DE", "--limit", "2", "-o", str(out)], capture_output=True,
                            text=True, timeout=280, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "gCO2e/correct" in result.stdout and "CodeCarbon 3.3.2 global_energy_mix.json" in result.stdout
    assert "energy basis: chip" in result.stdout
    (run,) = list(out.iterdir())
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["carbon"]["zone"] == "DE" and manifest["carbon"]["g_per_kwh"] == carbon.lookup("DE").g_per_kwh
    assert manifest["carbon"]["date"].startswith("year ") and manifest["carbon"]["source"].startswith("CodeCarbon")
    assert manifest["config"]["grid_region"] == "DE"


def test_check_gates_gco2e_per_correct_answer_on_the_basis_it_names(tmp_path, run_cli):
    base = _runs(tmp_path / "a", pue=1.2, carbon_record=DE)
    cand = _runs(tmp_path / "b", pue=1.2, carbon_record=DE)
    code, out, err = run_cli("check", str(base), str(cand), "--fail-if", "gco2e_per_correct:+5%",
                             "--energy-basis", "facility")
    assert code == 0, out + err
    assert "energy basis: facility" in out and "gco2e_per_correct" in out
    assert "cl: energy basis facility: chip energy x PUE 1.2 (provider's 2025 report)" in out
    code, out, err = run_cli("check", str(base), str(cand), "--energy-basis", "wall")
    assert code == 2 and "--energy-basis" in err


def test_a_remote_api_estimate_states_whether_it_includes_the_facility(tmp_path):
    from ipw.telemetry.api_estimate import ApiEnergyEstimate

    bundled = ApiEnergyEstimate.load()
    assert bundled.includes_facility == "partly"
    assert "datacenter overhead (PUE) included: partly" in bundled.info().detail
    assert "datacenter overhead included: partly" in bundled.reading(10, True, 1.0).note
    bad = tmp_path / "t.toml"
    bad.write_text(Path(bundled.table).read_text().replace('includes_facility = "partly"', 'includes_facility = "maybe"'))
    with pytest.raises(IpwError, match="includes_facility"):
        ApiEnergyEstimate.load(bad)


def test_report_shows_carbon_and_the_bases_on_the_basis_it_names(tmp_path, run_cli):
    p = _runs(tmp_path, pue=1.2, carbon_record=DE)
    html, md = tmp_path / "r.html", tmp_path / "r.md"
    code, out, err = run_cli("report", str(p), "-o", str(html), "--markdown", str(md), "--energy-basis", "facility")
    assert code == 0, err
    text = html.read_text()
    assert "carbon (gCO2e of the facility energy" in text and "energy by basis" in text
    assert "· energy basis: facility" in text and "year 2023" in text


def test_merge_keeps_the_shards_intensity_and_drops_differing_ones():
    from ipw.commands.merge import merged_carbon

    assert merged_carbon([DE, dict(DE)]) == DE
    assert merged_carbon([None, None]) is None
    live = {**DE, "g_per_kwh": 300.0}
    out = merged_carbon([DE, live])
    assert out["g_per_kwh"] is None and "300.0, 380.95" in out["error"]


class ScriptedJudge(ScriptedBackend):
    """The ``scripted`` fixture's backend kind: answers every query at once."""

    def reply(self, prompt):
        return "5"


def test_an_unreachable_feed_during_a_run_is_one_note_and_the_run_carries_no_intensity(tmp_path, run_cli, scripted,
                                                                                       small_jsonl, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(carbon.FEED_URL_ENV, f"http://127.0.0.1:{port}/v3")
    monkeypatch.setenv(carbon.FEED_KEY_ENV, "em-test-key-123456")
    config = tmp_path / "run.toml"
    config.write_text(f'dataset = "{small_jsonl}"\nwarmup = 0\nidle_s = 0.0\n'
                      '[[backends]]\nname = "s"\nkind = "scripted"\nmodel = "x"\n')
    code, out, err = run_cli("run", config, "--grid-region", "DE", "--grid-live", "-o", tmp_path / "runs")
    assert code == 0, err
    (note,) = [line for line in err.splitlines() if "grid feed" in line]  # one note, on one line
    assert note.startswith("note: carbon: the grid feed is unavailable") and "could not be reached" in note
    assert "em-test-key-123456" not in out + err
    (run,) = list((tmp_path / "runs").iterdir())
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["carbon"]["g_per_kwh"] is None and manifest["carbon"]["zone"] == "DE"
    assert "gCO2e" not in out  # no carbon shown: none was made up


def test_compare_pue_prices_old_runs_by_role_or_backend(tmp_path, run_cli):
    p = _runs(tmp_path)  # recorded no PUE
    c = compare([p], n_boot=100, energy_basis="facility", pue=["cloud=1.2"])
    chip = compare([p], n_boot=100)
    assert c.metrics["cl"]["energy_per_query_j"].value == pytest.approx(1.2 * chip.metrics["cl"]["energy_per_query_j"].value)
    assert next(b for b in c.backends if b.label == "cl").pue_source == "--pue cloud=1.2"
    both = compare([p], n_boot=100, energy_basis="facility", pue=["loc=1.5", "local=1.1"])  # the backend wins
    assert both.metrics["loc"]["energy_per_query_j"].value == pytest.approx(
        1.5 * chip.metrics["loc"]["energy_per_query_j"].value)
    assert {v.basis for v in compare([p], n_boot=100, pue=["cloud=1.2"]).bases} == {"chip", "facility"}
    for bad in ("cloud=0.9", "cloud", "nobody=1.2"):
        code, out, err = run_cli("compare", str(p), "--pue", bad)
        assert code == 2 and "--pue" in err and len(err.strip().splitlines()) == 1, err
