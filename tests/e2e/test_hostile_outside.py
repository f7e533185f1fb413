"""Hardening, round 5 (issue 55): the calls ipw makes to services outside it, the carbon feed
(``ipw.carbon``) and a BMC's Redfish service (``ipw.telemetry.node_power``), and what their texts become:

- a credential never follows a redirect to another origin (two real local servers: what the second gets);
- a feed key with CR LF is refused at start, and the scrubber never breaks the JSON it scrubs;
- a feed's or a config's texts are bounded when stored and shown on one line by ``ipw compare``;
- every call has a total deadline (a server that trickles a byte now and then);
- ``--grid-region ''``, impossible BMC readings, a hand-edited manifest's intensity or PUE, a chassis link
  with CR LF: one line, exit 2, or a reading said to be unavailable.

The servers are real HTTP servers on 127.0.0.1 (``http.server``), each a few lines of Redfish or Electricity
Maps; nothing is faked but what they answer."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import pytest

from ipw import carbon, sanitize
from ipw.errors import IpwError
from ipw.telemetry import node_power
from runfolders import write_run
from scripted import ScriptedBackend

ROOT = "/redfish/v1/"
PASSWORD = "bmc-pw-55-redirect"
FEED_KEY = "em-key-55-redirect"


# --- real local servers -----------------------------------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.server.seen.append((self.path, dict(self.headers)))  # type: ignore[attr-defined]
        self.server.answer(self)  # type: ignore[attr-defined]

    def log_message(self, *args: Any) -> None:
        pass


def send_json(h: BaseHTTPRequestHandler, doc: Any, status: int = 200) -> None:
    body = json.dumps(doc).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def redirect(h: BaseHTTPRequestHandler, location: str) -> None:
    h.send_response(302)
    h.send_header("Location", location)
    h.send_header("Content-Length", "0")
    h.end_headers()


def trickle(h: BaseHTTPRequestHandler) -> None:
    """A status line, then a header byte every 0.5 s for 100 s: every byte resets a read timeout."""
    h.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    h.wfile.flush()
    h.server.trickled = 0  # type: ignore[attr-defined]
    for _ in range(200):
        time.sleep(0.5)
        try:
            h.wfile.write(b"x")
            h.wfile.flush()
        except OSError:
            return  # the client hung up
        h.server.trickled += 1  # type: ignore[attr-defined]


@contextlib.contextmanager
def server(answer: Callable[[BaseHTTPRequestHandler], None]):
    """A real HTTP server on 127.0.0.1 answering every GET with ``answer(handler)``; ``.seen``: each request's
    path and headers; ``.url``: its address."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.seen = []  # type: ignore[attr-defined]
    srv.answer = answer  # type: ignore[attr-defined]
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"  # type: ignore[attr-defined]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def bmc_docs(watts: Any = 500.0, member: str = "/redfish/v1/Chassis/1U") -> dict[str, Any]:
    """The few Redfish resources of a BMC with one chassis whose EnvironmentMetrics reads ``watts``."""
    return {
        ROOT: {"Id": "RootService", "Chassis": {"@odata.id": "/redfish/v1/Chassis"}},
        "/redfish/v1/Chassis": {"Members": [{"@odata.id": member}]},
        member: {"Id": "1U", "ChassisType": "RackMount",
                 "EnvironmentMetrics": {"@odata.id": "/redfish/v1/Chassis/1U/EnvironmentMetrics"}},
        "/redfish/v1/Chassis/1U/EnvironmentMetrics": {"PowerWatts": {"Reading": watts}},
    }


def bmc(docs: dict[str, Any]) -> Callable[[BaseHTTPRequestHandler], None]:
    """A Redfish service serving ``docs`` (changed in place by a test: the BMC's next reading)."""
    def answer(h: BaseHTTPRequestHandler) -> None:
        doc = docs.get(h.path)
        send_json(h, doc if doc is not None else {"error": "not found"}, 200 if doc is not None else 404)
    return answer


def bmc_env(url: str) -> dict[str, str]:
    return {"IPW_NODE_POWER": url, "IPW_BMC_USER": "admin", "IPW_BMC_PASSWORD": PASSWORD, "IPW_BMC_PERIOD_S": "0.05"}


def feed_answer(**fields: Any) -> Callable[[BaseHTTPRequestHandler], None]:
    doc = {"zone": "DE", "carbonIntensity": 312, "datetime": "2026-12-04T05:00:00.000Z",
           "emissionFactorType": "lifecycle", "isEstimated": False, **fields}
    return lambda h: send_json(h, doc)


@pytest.fixture
def feed_env(monkeypatch):
    def point(url: str, key: str = FEED_KEY) -> None:
        monkeypatch.setenv(carbon.FEED_URL_ENV, url + "/v3")
        monkeypatch.setenv(carbon.FEED_KEY_ENV, key)
    return point


class ScriptedJudge(ScriptedBackend):
    """The ``scripted`` fixture's backend kind: answers every query at once."""

    def reply(self, prompt):
        return "5"


def _scripted_config(tmp_path: Path, small_jsonl: Path) -> Path:
    config = tmp_path / "run.toml"
    config.write_text(f'dataset = "{small_jsonl}"\nwarmup = 0\nidle_s = 0.0\n'
                      '[[backends]]\nname = "s"\nkind = "scripted"\nmodel = "x"\n')
    return config


def _one_line_exit_2(code: int, err: str) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


# --- 1. credentials never follow a redirect to another origin ----------------------------------------------

def test_a_bmc_redirect_to_another_origin_gets_no_credentials():
    """A BMC answering its service root with a 302 to another host:port: before, urllib's redirect handler
    sent ``Authorization: Basic admin:PASSWORD`` there too."""
    with server(bmc(bmc_docs())) as other, server(lambda h: redirect(h, other.url + h.path)) as bmc_:
        config = node_power.node_config(bmc_env(bmc_.url))
        with pytest.raises(IpwError) as info:
            node_power.discover(node_power.RedfishClient(config))
        assert [h.get("Authorization") for _, h in other.seen] in ([], [None]), other.seen
        assert not other.seen  # nothing at all goes there
    assert "another origin" in info.value.message and "\n" not in info.value.message
    assert PASSWORD not in info.value.message


def test_a_bmc_redirect_on_its_own_origin_is_followed():
    """``/redfish/v1`` -> ``/redfish/v1/`` on the same scheme, host and port: followed, with the credentials."""
    docs = bmc_docs()
    answer = bmc(docs)
    with server(lambda h: redirect(h, h.path + "/") if h.path == "/redfish/v1" else answer(h)) as srv:
        client = node_power.RedfishClient(node_power.node_config(bmc_env(srv.url)))
        assert client.get("/redfish/v1") == docs[ROOT]
    assert [p for p, _ in srv.seen] == ["/redfish/v1", ROOT]
    assert all(h.get("Authorization", "").startswith("Basic ") for _, h in srv.seen)


def test_a_feed_redirect_to_another_origin_gets_no_key(feed_env):
    with server(feed_answer()) as other, server(lambda h: redirect(h, other.url + h.path)) as feed:
        feed_env(feed.url)
        got, note = carbon.resolve(None, "DE", grid_live=True)
        assert not other.seen, other.seen  # before: the whole auth-token went there
        assert [h.get("auth-token") for _, h in feed.seen] == [FEED_KEY]
    assert got["g_per_kwh"] is None and "another origin" in got["error"]
    assert note.startswith("carbon: the grid feed is unavailable") and FEED_KEY not in note


# --- 2. a feed key with CR LF; the scrubber and JSON -------------------------------------------------------

def test_a_feed_key_with_crlf_is_refused_at_start(tmp_path, run_cli, scripted, small_jsonl, feed_env):
    """Before: the run went on, the key was printed whole in the note ("Invalid header value ..."), and its
    scrubbing cut manifest.json inside a JSON escape."""
    with server(feed_answer()) as feed:
        feed_env(feed.url, "em-key-55\r\nX-Injected: yes")
        code, out, err = run_cli("run", _scripted_config(tmp_path, small_jsonl), "--grid-region", "DE", "--grid-live",
                                 "-o", tmp_path / "runs")
        assert not feed.seen
    _one_line_exit_2(code, err)
    assert carbon.FEED_KEY_ENV in err and "a control character" in err and "X-Injected" not in err
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def _strings(x: Any) -> list[str]:
    return [x] if isinstance(x, str) else [s for v in (x.values() if isinstance(x, dict) else x) for s in _strings(v)] \
        if isinstance(x, (dict, list)) else []


@pytest.mark.parametrize("secret", ["s55-cr\r\nlf-0123456789", 'p55"quo\\te-0123456789', "s55\\u00e9-\\\\-abcdefgh",
                                    "é55-ünïcødé-\u2028-0123", 'q55-abcdefgh"', '"r55-abcdefgh'])
def test_scrub_never_breaks_the_json_it_scrubs(secret):
    """A secret's JSON-escaped form is replaced whole: no scrubbed span starts or ends inside an escape, nor
    takes a string's quote (before: ``\\***``, a dangling backslash, and the manifest was not JSON)."""
    sanitize.register(secret)
    doc = {"whole": secret, "head": secret[:12], "tail": secret[-12:], "middle": "x" + secret[2:14] + "y",
           "masked": secret[:9] + "****", "list": [secret[i:] for i in range(8)], "after": [secret, "next"]}
    for text in (json.dumps(doc), json.dumps(doc, ensure_ascii=False)):
        back = json.loads(sanitize.scrub(text))  # still JSON
        assert back.keys() == doc.keys() and back["after"][1] == "next"
        shown = _strings(back)
        assert not [w for w in (secret[i: i + 8] for i in range(len(secret) - 7)) if any(w in s for s in shown)]
    # a JSON text inside JSON (a record's energy_parts) stays JSON at both levels
    inner = json.loads(json.loads(sanitize.scrub(json.dumps({"parts": json.dumps(doc)})))["parts"])
    assert inner.keys() == doc.keys()
    assert json.loads(sanitize.scrub(json.dumps({"k": secret})))["k"].strip('"') == "***"  # a quote at an end may stay


# --- 3. a feed's and a config's texts: bounded when stored, one line when shown ---------------------------

FORGED = "\n::error file=ipw.py::forged"


def test_compare_shows_feed_and_config_texts_on_one_line(tmp_path, run_cli):
    """A manifest's carbon zone and emission factor (from the feed) and a config's pue_source reached
    ``ipw compare``'s notes raw: a line that starts ``::error`` is a forged CI annotation."""
    p = write_run(tmp_path, "r1", {"loc": {"correct": [1, 0, 1, 1], "energy": [1.0, 1.2, 0.9, 1.1]},
                                   "cl": {"correct": [1, 1, 1, 1], "energy": [1.1, 1.2, 1.0, 1.2], "role": "cloud"}})
    m = json.loads((p / "manifest.json").read_text())
    m["carbon"] = {"g_per_kwh": 312, "source": "electricitymaps (live)", "zone": "DE" + FORGED, "date": "2026" + FORGED,
                   "detail": "lifecycle" + FORGED + " emission factors"}
    m["config"] = {"backends": [{"name": "loc", "options": {}},
                                {"name": "cl", "options": {"pue": 1.2, "pue_source": "report" + FORGED}}]}
    (p / "manifest.json").write_text(json.dumps(m))
    for fmt in ("table", "markdown", "csv"):
        code, out, err = run_cli("compare", p, "--energy-basis", "facility", "--format", fmt)
        assert code == 0, err
        assert "forged" in out or fmt == "csv"
        lines = (out + err).splitlines()
        assert not [line for line in lines if line.lstrip().startswith("::")], (fmt, out)


def test_a_feeds_texts_are_bounded_when_stored(feed_env):
    """A 300,000-character zone made a 605 KB manifest."""
    with server(feed_answer(zone="Z" * 300_000, emissionFactorType="f" * 300_000, datetime="d" * 300_000)) as feed:
        feed_env(feed.url)
        got, note = carbon.resolve(None, "DE", grid_live=True)
    assert note is None and got["g_per_kwh"] == 312
    assert len(json.dumps(got)) < 1000, len(json.dumps(got))


def test_a_configs_pue_source_is_bounded(tmp_path):
    from ipw.inputs.config import load_config

    path = tmp_path / "run.toml"
    path.write_text('dataset = "ipw-core-default"\n[[backends]]\nname = "a"\nkind = "llama-cpp"\n'
                    f'model = "smollm2-135m"\npue = 1.2\npue_source = "{"r" * 300_000}"\n')
    with pytest.raises(IpwError, match="pue_source") as info:
        load_config(str(path))
    assert len(info.value.message) < 300


# --- 4. a total deadline for every outside call -------------------------------------------------------------

def test_a_trickling_feed_is_cut_at_the_total_deadline(feed_env):
    """A feed that sends a byte every 0.5 s: each byte reset the 10 s read timeout, and it held ``ipw run``
    for as long as it trickled (over 200 s)."""
    with server(trickle) as feed:
        feed_env(feed.url)
        t0 = time.monotonic()
        with pytest.raises(carbon.FeedUnavailable, match="total deadline"):
            carbon.live("DE", FEED_KEY, timeout_s=2.0)
        took = time.monotonic() - t0
    assert took < 30, took  # the trickle lasts 100 s
    assert feed.trickled < 60  # type: ignore[attr-defined]


def test_a_trickling_bmc_is_cut_at_the_total_deadline():
    with server(trickle) as srv:
        client = node_power.RedfishClient(node_power.node_config(bmc_env(srv.url)))
        t0 = time.monotonic()
        with pytest.raises(IpwError, match="total deadline"):
            client.get(ROOT, 2.0)
        took = time.monotonic() - t0
    assert took < 30, took
    assert srv.trickled < 60  # type: ignore[attr-defined]


def test_a_bmc_discovery_has_a_total_deadline(monkeypatch):
    """A BMC that lists 2,000 chassis and answers each GET in 0.05 s: each GET is within its own deadline,
    and the discovery would take 100 s; it is given DISCOVER_S in all."""
    monkeypatch.setattr(node_power, "DISCOVER_S", 1.0)
    docs = bmc_docs()
    docs["/redfish/v1/Chassis"] = {"Members": [{"@odata.id": f"/redfish/v1/Chassis/{i}"} for i in range(2000)]}
    docs.update({f"/redfish/v1/Chassis/{i}": {"Id": str(i)} for i in range(2000)})
    answer = bmc(docs)

    def slow(h: BaseHTTPRequestHandler) -> None:
        time.sleep(0.05)
        answer(h)

    with server(slow) as srv:
        client = node_power.RedfishClient(node_power.node_config(bmc_env(srv.url)))
        with pytest.raises(IpwError, match="took over 1 s together"):
            node_power.discover(client)
        asked = len(srv.seen)
        assert client.get(ROOT) == docs[ROOT]  # the deadline was the discovery's only
    assert asked < 200, asked  # of the 2,002 GETs the discovery needed


# --- 5. --grid-region '' -------------------------------------------------------------------------------------

def test_an_empty_grid_region_is_a_usage_error(tmp_path, run_cli, scripted, small_jsonl):
    code, out, err = run_cli("run", _scripted_config(tmp_path, small_jsonl), "--grid-region", "", "-o", tmp_path / "runs")
    _one_line_exit_2(code, err)
    assert "--grid-region" in err
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())
    p = write_run(tmp_path, "r1", {"loc": {"correct": [1, 0], "energy": [1.0, 1.2]}})
    code, out, err = run_cli("compare", p, "--grid-region", " ")
    _one_line_exit_2(code, err)
    assert "--grid-region" in err


# --- 6. impossible BMC readings ------------------------------------------------------------------------------

@pytest.mark.parametrize("watts", [-500.0, 1e308])
def test_an_impossible_bmc_reading_at_start_is_refused(watts):
    with server(bmc(bmc_docs(watts))) as srv:
        with pytest.raises(IpwError, match="not a possible reading") as info:
            node_power.discover(node_power.RedfishClient(node_power.node_config(bmc_env(srv.url))))
    assert "\n" not in info.value.message


@pytest.mark.parametrize("watts", [-500.0, 1e308])
def test_an_impossible_bmc_reading_mid_run_is_unavailable_never_measured(watts):
    """Before: -500 W or 1e308 W read during a window was recorded as a measured 0 J."""
    docs = bmc_docs(500.0)
    now = [0]
    with server(bmc(docs)) as srv:
        platform = node_power.RedfishPlatform(node_power.node_config(bmc_env(srv.url)))
        sensor = node_power.NodePowerSensor(platform, threaded=False, clock_ns=lambda: now[0])
        docs["/redfish/v1/Chassis/1U/EnvironmentMetrics"] = {"PowerWatts": {"Reading": watts}}
        for k in range(1, 41):  # 4 s of polls, every 0.1 s
            now[0] = int(k * 0.1e9)
            sensor.poll()
        (reading,) = sensor.readings(1.0, 3.0)
        sensor.close()
    assert reading.quality == "unavailable" and reading.energy_j is None, reading
    assert "not a possible reading" in reading.note


# --- 7. a hand-edited manifest's intensity or PUE ------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("carbon.g_per_kwh", -5.0), ("carbon.g_per_kwh", float("nan")),
                                          ("pue", -1.0), ("pue", float("nan")), ("pue", 0.5)])
def test_a_manifest_with_a_bad_intensity_or_pue_is_refused_when_read(tmp_path, run_cli, field, value):
    p = write_run(tmp_path, "r1", {"loc": {"correct": [1, 0, 1], "energy": [1.0, 1.2, 0.9]}})
    m = json.loads((p / "manifest.json").read_text())
    if field == "pue":
        m["config"] = {"backends": [{"name": "loc", "options": {"pue": value, "pue_source": "edited"}}]}
    else:
        m["carbon"] = {"g_per_kwh": value, "source": "given (--carbon-intensity)", "zone": "", "date": "2026"}
    (p / "manifest.json").write_text(json.dumps(m))  # NaN is written as the bare NaN that json reads back
    code, out, err = run_cli("compare", p)
    _one_line_exit_2(code, err)
    assert "manifest.json" in err and field.split(".")[-1] in err


# --- 8. a chassis link with CR LF ----------------------------------------------------------------------------

@pytest.mark.parametrize("member", ["/redfish/v1/Chassis/1U\r\nX-Injected: yes", "http://elsewhere.invalid/x"])
def test_a_bad_chassis_link_is_one_line_exit_2(tmp_path, run_cli, member, monkeypatch):
    """Before: CR LF in a Chassis member's @odata.id ended ``ipw run`` with exit 3 (http.client's InvalidURL)."""
    with server(bmc(bmc_docs(member=member))) as srv:
        for k, v in bmc_env(srv.url).items():
            monkeypatch.setenv(k, v)
        out = tmp_path / "runs"
        out.mkdir()
        code, _, err = run_cli("run", "-n", "1", "-o", out)
    _one_line_exit_2(code, err)
    assert "Redfish" in err and ("1U\\r\\nX-Injected" in err or "not a path on this service" in err), err
    assert list(out.iterdir()) == []
