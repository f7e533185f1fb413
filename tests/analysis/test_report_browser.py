"""ipw report in a real headless browser: Debian's chromium (/usr/bin/chromium, installed by .ci/setup),
driven over the Chrome DevTools Protocol with websocket-client. Checks that every plot is loaded and
visible, that there is no console error and no request but the file itself, that an XSS payload in a
model output stays text, and saves a full-page screenshot under test-artifacts/."""

import base64
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("jinja2")
pytest.importorskip("matplotlib")
websocket = pytest.importorskip("websocket")

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_report import XSS_IMG, XSS_OUTPUT, XSS_PROMPT, fixture_runs  # noqa: E402

from ipw.analysis import report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = os.environ.get("IPW_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--remote-debugging-port=0", "--window-size=1280,900"]

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} missing (bash .ci/setup installs it)")


class Browser:
    """One chromium process and a CDP session on its first page; events are kept in ``self.events``."""

    def __init__(self, tmp: Path):
        profile = tmp / "profile"
        profile.mkdir()
        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=(tmp / "chromium.log").open("wb"))
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start: {(tmp / 'chromium.log').read_text()[-2000:]}")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
                pages = [t for t in json.load(resp) if t["type"] == "page"]
            if pages:
                break
            time.sleep(0.1)
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
            self.events.append(msg)

    def wait_for(self, method: str, timeout: float = 60.0) -> dict:
        for e in self.events:
            if e.get("method") == method:
                return e
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = json.loads(self.ws.recv())
            self.events.append(msg)
            if msg.get("method") == method:
                return msg
        raise TimeoutError(method)

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    def close(self):
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def render(html: Path, tmp: Path, screenshot: Path) -> dict:
    """Open ``html`` and return what the page shows: images, console errors, requests, XSS globals."""
    b = Browser(tmp)
    try:
        for domain in ("Page", "Runtime", "Log", "Network"):
            b.send(f"{domain}.enable")
        url = html.resolve().as_uri()
        b.send("Page.navigate", url=url)
        b.wait_for("Page.loadEventFired")
        images = b.evaluate("""Promise.all(Array.from(document.images).map(i => i.decode().catch(() => null)))
            .then(() => Array.from(document.images).map(i => {
              const r = i.getBoundingClientRect(), s = getComputedStyle(i);
              return {alt: i.alt, complete: i.complete, w: i.naturalWidth, h: i.naturalHeight,
                      shown_w: r.width, shown_h: r.height, visible: s.visibility !== 'hidden' && s.display !== 'none'};
            }))""")
        svgs = b.evaluate("Array.from(document.querySelectorAll('svg')).map(s => s.getBBox().width)")
        state = b.evaluate("""({xss: typeof window.__xss, xss_img: typeof window.__xss_img,
            xss_prompt: typeof window.__xss_prompt, scripts: document.scripts.length,
            text: document.body.innerText, height: document.documentElement.scrollHeight})""")
        time.sleep(0.5)  # late events (a failing request, a console message) arrive
        b.evaluate("1")
        b.send("Emulation.setDeviceMetricsOverride", width=1280, height=min(state["height"], 16000),
               deviceScaleFactor=1, mobile=False)
        shot = b.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        events = b.events
    finally:
        b.close()
    errors = [e["params"] for e in events if e.get("method") == "Runtime.exceptionThrown"]
    errors += [e["params"] for e in events if e.get("method") == "Runtime.consoleAPICalled"
               and e["params"]["type"] in ("error", "assert", "warning")]
    errors += [e["params"]["entry"] for e in events if e.get("method") == "Log.entryAdded"
               and e["params"]["entry"]["level"] in ("error", "warning")]
    requests = [e["params"]["request"]["url"] for e in events if e.get("method") == "Network.requestWillBeSent"]
    return {"url": url, "images": images, "svgs": svgs, "errors": errors, "requests": requests, **state}


def check_page(page: dict, n_figures: int) -> None:
    assert page["errors"] == []
    assert [u for u in page["requests"] if u != page["url"] and not u.startswith("data:")] == []
    assert len(page["images"]) == n_figures > 0
    for img in page["images"]:
        assert img["complete"] and img["w"] > 100 and img["h"] > 100, img
        assert img["shown_w"] > 100 and img["shown_h"] > 50 and img["visible"], img
    assert all(w > 0 for w in page["svgs"])
    assert page["scripts"] == 0


def test_fixture_report_in_chromium(tmp_path):
    runs = fixture_runs(tmp_path / "runs")
    html = tmp_path / "report.html"
    ctx = report.write(runs, html, tmp_path / "summary.md")
    page = render(html, tmp_path, ARTIFACTS / "report-fixture.png")
    check_page(page, len(ctx["figures"]))
    # the payloads in the model output and the prompt did not run, and show as text
    assert page["xss"] == "undefined" and page["xss_img"] == "undefined" and page["xss_prompt"] == "undefined"
    assert XSS_OUTPUT in page["text"] and XSS_IMG in page["text"] and XSS_PROMPT in page["text"]
    assert "Estimated energy." in page["text"]
    assert (ARTIFACTS / "report-fixture.png").stat().st_size > 10_000


@pytest.mark.llama
def test_real_run_report_in_chromium(tmp_path, run_cli):
    """Acceptance: ipw report on a real run of the bundled set renders with every plot visible."""
    if not shutil.which("ipw", path=str(ROOT / ".venv" / "bin")):
        pytest.skip("no .venv/bin/ipw (bash .ci/setup)")
    proc = subprocess.run([str(ROOT / ".venv" / "bin" / "ipw"), "run", "--dataset", "ipw-core-default", "--limit",
                           "4", "--backend", "llama-cpp:smollm2-135m", "--idle-s", "0", "--warmup", "0", "--out",
                           str(tmp_path / "results")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = list((tmp_path / "results").iterdir())
    html, md = tmp_path / "real.html", tmp_path / "real.md"
    code, _, err = run_cli("report", run, "--out", html, "--markdown", md)
    assert code == 0, err
    page = render(html, tmp_path, ARTIFACTS / "report-real-run.png")
    n = html.read_text(encoding="utf-8").count("<figure ")
    assert n >= 5  # pareto, ipj, energy vs tokens, power over time, categories (no routing with one backend)
    check_page(page, n)
    assert "smollm2-135m" in page["text"] and "estimated" in page["text"]
    assert "| accuracy |" in md.read_text()
