"""What ``GET /metrics`` and the OpenTelemetry export cost ``ipw serve`` (issue 56): the proxy without them
against the proxy with them, in one run, in front of a fast fake upstream (serve_cpu.py's, a process of its
own), so that the proxy's own cost dominates.

- **bare**: ``ipw serve --no-metrics``, no ``OTEL_*`` variable.
- **exports**: ``ipw serve`` with /metrics (the default) scraped every ``--scrape-s`` seconds by a thread of this
  script while it is loaded, and OTLP/HTTP to a sink (a process of its own that answers 200 and counts what it
  got): ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, and ``OTEL_METRIC_EXPORT_INTERVAL`` = the scrape's period (the
  SDK's default, 60 s, would leave the metric export out of a short load).
- Per round, level (``--levels``) and kind of request (``--kinds``: streamed, plain), the two proxies in turn,
  A B in even rounds and B A in odd ones: median latency, wall time of the same number of requests (closed
  loop), the proxy process's CPU per request (/proc, its threads included: the SDK's exporters too).
- The figures, over rounds: the added latency of exports over bare (median of each round's difference of
  medians, and a distribution-free ~95% interval of that median from the order statistics), the extra CPU per
  request likewise, and the throughput ratio exports / bare (bare's wall time over exports', per round).
- ``--no-otel``: exports is /metrics alone (scraped), no ``OTEL_*``: what ``ipw serve`` costs by default.
- At the end, the exports proxy's own ``ipw_requests_total`` (all requests counted, settled) and what the sink
  received (posts and bytes of spans and metrics): the exports really ran.

    .venv/bin/python bench/serving/serve_metrics_cost.py --out metrics-cost.json
    git archive HEAD | tar -x -C /tmp/ipw-head && .venv/bin/python bench/serving/serve_metrics_cost.py \\
        --src /tmp/ipw-head --out metrics-cost.json
    (the second: a committed tree's ipw serve, not the working tree's)

Output: printed (Markdown), and ``--out`` (JSON); the figures are in docs/PERFORMANCE.md, "`ipw serve` with
    /metrics and OTLP (issue 56)", and bench/evidence/serving/metrics-cost-*/.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_cpu.py, beside it: the fake upstream and the load
from serve_cpu import cpu_s, free_port, load

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from _shared import machine  # noqa: E402


def sink(port: int) -> None:
    """The OTLP/HTTP sink (``--sink PORT``): 200 with an empty body (an empty Export*ServiceResponse) to every
    POST, counting posts and bytes by path; ``GET /`` answers the counts as JSON."""
    counts: dict[str, list[int]] = {}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _answer(self, payload: bytes, kind: str) -> None:
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                             % (kind.encode(), len(payload), payload))

        def do_POST(self) -> None:
            n = len(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            with lock:
                posts = counts.setdefault(self.path, [0, 0])
                posts[0] += 1
                posts[1] += n
            self._answer(b"", "application/x-protobuf")

        def do_GET(self) -> None:
            with lock:
                payload = json.dumps({path: {"posts": p, "bytes": b} for path, (p, b) in counts.items()}).encode()
            self._answer(payload, "application/json")

    class Server(ThreadingHTTPServer):
        daemon_threads = True

    server = Server(("127.0.0.1", port), Handler)
    print("ready", flush=True)
    server.serve_forever()


def get(url: str) -> bytes:
    host, port, path = re.match(r"http://([^:/]+):(\d+)(/.*)", url).groups()  # type: ignore[union-attr]
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", path)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"GET {url}: {resp.status} {body[:200]!r}")
    return body


class Scraper:
    """GET /metrics every ``period_s`` while on (a Prometheus's scrape), counting scrapes."""

    def __init__(self, url: str, period_s: float) -> None:
        self.url, self.period_s, self.scrapes = url, period_s, 0
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> "Scraper":
        self.stop.clear()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join()

    def _run(self) -> None:
        while not self.stop.wait(self.period_s):
            get(self.url)
            self.scrapes += 1


def start_proxy(src: Path, upstream: str, upstream_pid: int, out: str, options: list[str],
                env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "ipw.cli", "serve", "--upstream", upstream, "--port", "0",
                             "--upstream-pid", str(upstream_pid), "--idle-s", "0", "--out", out, *options],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=src,
                            env={**env, "PYTHONPATH": str(src)})
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        match = re.search(r"(http://127\.0\.0\.1:\d+/v1) ->", line)
        if match:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, match.group(1)
    raise SystemExit(f"ipw serve {' '.join(options)} did not start: {''.join(lines)[-500:]}")


def median_interval(xs: list[float]) -> tuple[float, float, float]:
    """The median and a distribution-free interval for it from the order statistics: the widest k with
    P(Binomial(n, 1/2) < k) <= 2.5% (coverage >= 95%; all of the values below 6 of them)."""
    s, n = sorted(xs), len(xs)
    k = 1
    while sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n <= 0.025:
        k += 1
    return statistics.median(s), s[k - 1], s[n - k]


def requests_total(exposition: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines()
               if line.startswith("ipw_requests_total{") or line.startswith("ipw_requests_total "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=str(ROOT), help="the source tree whose ipw serve runs (default: this checkout)")
    ap.add_argument("--levels", default="1,64")
    ap.add_argument("--kinds", default="streamed,plain", help="streamed, plain or both (comma-separated)")
    ap.add_argument("--requests", type=int, default=1500, help="per round and proxy at a level above 1 (~5 s: ~5 scrapes)")
    ap.add_argument("--requests-1", type=int, default=150, help="per round and proxy at 1 in flight")
    ap.add_argument("--delay-ms", type=float, default=1.0, help="between the fake upstream's chunks")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20, help="short rounds, many: the load of a shared machine drifts less between the two proxies' turns")
    ap.add_argument("--scrape-s", type=float, default=1.0)
    ap.add_argument("--no-otel", action="store_true", help="exports = /metrics scraped, no OTLP (the default set-up)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    src = Path(args.src).resolve()
    levels, kinds = [int(x) for x in args.levels.split(",")], args.kinds.split(",")
    here = Path(__file__).resolve().parent
    up_port, sink_port = free_port(), free_port()
    fake = subprocess.Popen([sys.executable, str(here / "serve_cpu.py"), "--upstream", str(up_port), str(args.tokens),
                             str(args.delay_ms / 1000)], stdout=subprocess.PIPE, text=True)
    otlp = subprocess.Popen([sys.executable, __file__, "--sink", str(sink_port)], stdout=subprocess.PIPE, text=True)
    for p in (fake, otlp):
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    upstream = f"http://127.0.0.1:{up_port}/v1"
    bare_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    exports_env = bare_env if args.no_otel else {  # --no-otel: /metrics alone, ipw serve's default
        **bare_env, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
        "OTEL_METRIC_EXPORT_INTERVAL": str(int(args.scrape_s * 1000))}
    runs = tempfile.TemporaryDirectory(prefix="ipw-metrics-cost-")
    bare = start_proxy(src, upstream, fake.pid, runs.name, ["--no-metrics"], bare_env)
    exports = start_proxy(src, upstream, fake.pid, runs.name, [], exports_env)
    metrics_url = exports[1].removesuffix("/v1") + "/metrics"
    get(metrics_url)  # /metrics is on (a 404 would say why not)
    scraper = Scraper(metrics_url, args.scrape_s)
    proxies = {"bare": bare, "exports": exports}
    counter = iter(range(10**9))
    rows: list[dict] = []
    sent = 0
    try:
        for c in levels:  # warm every path
            for name, (_, url) in proxies.items():
                load(url, c, c, counter)
                sent += c if name == "exports" else 0
        for r in range(args.rounds):
            for c in levels:
                for kind in kinds:
                    n = args.requests if c > 1 else args.requests_1
                    for name in (("bare", "exports") if r % 2 == 0 else ("exports", "bare")):
                        proc, url = proxies[name]
                        before, scrapes = cpu_s(proc.pid), scraper.scrapes
                        if name == "exports":
                            with scraper:
                                latency_s, energy, wall = load(url, c, n, counter, kind == "streamed")
                            sent += n
                        else:
                            latency_s, energy, wall = load(url, c, n, counter, kind == "streamed")
                        row = {"round": r + 1, "level": c, "kind": kind, "proxy": name, "requests": n,
                               "latency_ms": 1000 * latency_s, "wall_s": wall,
                               "cpu_ms_per_request": 1000 * (cpu_s(proc.pid) - before) / n, "with_energy": energy,
                               "scrapes": scraper.scrapes - scrapes, "load_average": os.getloadavg()[0]}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        deadline = time.monotonic() + 60  # the last records settle, then the exports proxy's own count
        while (counted := requests_total(get(metrics_url).decode())) < sent and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2 * args.scrape_s)  # one more metric export and span batch reach the sink
        received = json.loads(get(f"http://127.0.0.1:{sink_port}/"))
    finally:
        for proc, _ in proxies.values():
            proc.terminate()
            proc.wait(timeout=60)
        fake.kill()
        otlp.kill()
        runs.cleanup()
    figures = []
    for c in levels:
        for kind in kinds:
            by_round: dict[int, dict[str, dict]] = {}
            for row in rows:
                if row["level"] == c and row["kind"] == kind:
                    by_round.setdefault(row["round"], {})[row["proxy"]] = row
            pairs = list(by_round.values())
            figures.append({
                "level": c, "kind": kind, "rounds": len(pairs),
                "bare_latency_ms": statistics.median(p["bare"]["latency_ms"] for p in pairs),
                "added_latency_ms": median_interval([p["exports"]["latency_ms"] - p["bare"]["latency_ms"] for p in pairs]),
                "bare_cpu_ms_per_request": statistics.median(p["bare"]["cpu_ms_per_request"] for p in pairs),
                "added_cpu_ms_per_request": median_interval([p["exports"]["cpu_ms_per_request"]
                                                             - p["bare"]["cpu_ms_per_request"] for p in pairs]),
                "throughput_ratio": median_interval([p["bare"]["wall_s"] / p["exports"]["wall_s"] for p in pairs]),
                "bare_requests_per_s": statistics.median(p["bare"]["requests"] / p["bare"]["wall_s"] for p in pairs),
                # over the whole run: CPU spent after a turn (records settled late) counts in the next one
                "run_cpu_ms_per_request": {name: sum(p[name]["cpu_ms_per_request"] * p[name]["requests"] for p in pairs)
                                           / sum(p[name]["requests"] for p in pairs) for name in proxies}})
    loads = [row["load_average"] for row in rows]
    summary = {"src": str(src), "machine": machine(), "delay_ms": args.delay_ms, "tokens": args.tokens,
               "scrape_s": args.scrape_s, "load_average": [min(loads), statistics.median(loads), max(loads)],
               "requests_sent_to_exports": sent, "exports_requests_total": counted, "sink_received": received,
               "figures": figures, "rows": rows}

    def f(x: list[float], digits: int) -> str:
        return f"{x[0]:+.{digits}f} [{x[1]:+.{digits}f}, {x[2]:+.{digits}f}]"

    print(f"\n{machine()}; load average {min(loads):.2f}-{max(loads):.2f} (median "
          f"{statistics.median(loads):.2f}); exports proxy counted {counted:g} of {sent} requests; sink: {received}\n")
    print("| in flight | kind | bare: latency, req/s, CPU/req | added latency (ms) | added CPU/req (ms) "
          "| throughput exports / bare |\n|---|---|---|---|---|---|")
    for g in figures:
        ratio = g["throughput_ratio"]
        print(f"| {g['level']} | {g['kind']} | {g['bare_latency_ms']:.1f} ms, {g['bare_requests_per_s']:.0f}/s, "
              f"{g['bare_cpu_ms_per_request']:.2f} ms | {f(g['added_latency_ms'], 3)} | "
              f"{f(g['added_cpu_ms_per_request'], 3)} | {ratio[0]:.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}] |")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sink"]:
        sink(int(sys.argv[2]))
    else:
        main()
