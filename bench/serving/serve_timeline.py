"""Where ``ipw serve``'s added latency goes, per request at 1 in flight: a timeline of each request through
the proxy against the fake streaming upstream of ``bench/serving/serve_cpu.py``.

The proxy runs in a child process of its own (``--proxy``) with the code of the source tree given, its
methods wrapped to note when each step of a request happened; the client (this process) notes when it sent
each request and when it read the first event, the usage event and ``[DONE]``.  All times are
CLOCK_MONOTONIC (``time.monotonic``), the same clock in every process of the machine.  The same number of
requests goes straight to the fake, alternating with the proxy's, for the added latency.

    .venv/bin/python bench/serving/serve_timeline.py . --requests 40 --out timeline.json

Output: printed, and ``--out`` (JSON); the figures are in docs/PERFORMANCE.md, "ipw serve: what the measuring
    proxy costs a client".
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent


# -- the proxy's side (``--proxy``): the code of PYTHONPATH, wrapped ----------------------------------------

def proxy(upstream_url: str, upstream_pid: int, out_dir: str, stamps_path: str) -> None:
    import ipw.serve as serve
    from ipw.metering.meter import Meter
    from ipw.serve import exchange
    from ipw.serve.handler import Handler
    from ipw.serve.session import Session
    from ipw.telemetry import snapshots

    local = threading.local()
    requests: list[dict[str, float]] = []
    reads: list[tuple[float, float]] = []  # the CPU model's reads: (start, end)
    settles: list[tuple[float, float]] = []  # the meter's batches

    def note(name: str, first: bool = True) -> None:
        stamps = getattr(local, "stamps", None)
        if stamps is not None and (not first or name not in stamps):
            stamps[name] = time.monotonic()

    def wrap(cls: Any, method: str, before: str | None, after: str | None,
             hook: Callable[..., None] | None = None) -> None:
        original = getattr(cls, method, None)
        if original is None:  # not in this tree (Session.write: the records are written on a thread since 2026-12-03)
            return

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if hook is not None:
                hook(*args, **kwargs)
            if before:
                note(before)
            result = original(*args, **kwargs)
            if after:
                note(after)
            return result

        setattr(cls, method, wrapped)

    original_post = Handler.do_POST

    def do_post(self: Any) -> None:
        local.stamps = {"received": time.monotonic()}  # the request line and headers read
        try:
            original_post(self)
        finally:
            local.stamps["handler_done"] = time.monotonic()
            requests.append(local.stamps)
            local.stamps = None

    Handler.do_POST = do_post  # type: ignore[method-assign]
    original_send_chunk = Handler.send_chunk

    def send_chunk(self: Any, data: bytes) -> None:
        original_send_chunk(self, data)
        stamps = getattr(local, "stamps", None)
        if stamps is not None:
            key = ("first_event_sent" if "first_event_sent" not in stamps else "energy_chunk_sent"
                   if b'"energy"' in data else "last_chunk_sent" if not data else "")
            if key:
                stamps.setdefault(key, time.monotonic())

    Handler.send_chunk = send_chunk  # type: ignore[method-assign]
    original_events = exchange.sse_events

    def sse_events(read: Any) -> Any:  # when each upstream event was found
        for event in original_events(read):
            stamps = getattr(local, "stamps", None)
            if stamps is not None:
                stamps.setdefault("events", []).append(time.monotonic())
            yield event

    exchange.sse_events = sse_events
    wrap(Meter, "start", None, "job_started")
    wrap(Handler, "open_upstream", "upstream_open", "upstream_headers")
    wrap(http.client.HTTPConnection, "connect", "connect_begin", "connected")
    wrap(Handler, "end_stream", "usage_received", None)
    wrap(Meter, "end", None, "window_cut")
    wrap(Meter, "share", None, "share_ready")
    wrap(Session, "build", None, "record_built")
    wrap(Session, "write", "write_begin", "write_done")
    original_snap = snapshots.Counters.snap

    def snap(self: Any) -> None:
        t0 = time.monotonic()
        original_snap(self)
        reads.append((t0, time.monotonic()))

    snapshots.Counters.snap = snap  # type: ignore[method-assign]
    original_settle = Meter.split_period

    def settle(self: Any, batch: Any) -> Any:
        t0 = time.monotonic()
        result = original_settle(self, batch)
        settles.append((t0, time.monotonic()))
        return result

    Meter.split_period = settle  # type: ignore[method-assign]

    running = serve.start(serve.ServeOptions(upstream=upstream_url, name="timeline", port=0, idle_s=0.0), out_dir,
                          upstream_pids=[upstream_pid])
    print(running.url, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    running.stop()
    Path(stamps_path).write_text(json.dumps({"requests": requests, "reads": reads, "settles": settles}))


# -- the client ------------------------------------------------------------------------------------------

def one_request(url: str, n: int, kept: dict[str, http.client.HTTPConnection] | None = None) -> dict[str, Any]:
    """One streamed chat request read to [DONE], as ``bench/serving/serve_cpu.py`` sends it, with its times; on a new
    connection, or on the one ``kept`` holds for ``url`` (kept alive: the body is read to its end)."""
    parts = urlsplit(url)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"prompt {n}"}], "max_tokens": 16,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    t: dict[str, Any] = {"sent": time.monotonic(), "client_events": []}
    conn = kept.get(url) if kept is not None else None
    if conn is None:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    conn.request("POST", parts.path.rstrip("/") + "/chat/completions", body=body,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    for line in resp:
        if line.startswith(b"data:"):
            data = line[5:].strip()
            t.setdefault("client_first_event", time.monotonic())
            t["client_events"].append(time.monotonic())
            if b'"usage"' in data:
                t["client_usage"] = time.monotonic()
            if data == b"[DONE]":
                t["client_done"] = time.monotonic()
                break
    if kept is not None:
        resp.read()  # the chunked body's end
        kept[url] = conn
    else:
        conn.close()
    t["client_closed"] = time.monotonic()
    return t


#: the proxy's steps, in order: (the step's name as the table prints it, its stamp)
STEPS = [
    ("handler thread has the request line and headers", "received"),
    ("meter.start (window cut at the start)", "job_started"),
    ("upstream: TCP connect begins", "connect_begin"),
    ("upstream: connected", "connected"),
    ("upstream: response headers", "upstream_headers"),
    ("first event relayed", "first_event_sent"),
    ("usage chunk parsed (end of stream)", "usage_received"),
    ("window cut at the end (meter.end)", "window_cut"),
    ("CPU model's read after the end done", "edge_read"),
    ("meter's batch begins (settle)", "settle_begin"),
    ("share ready (meter.share returns)", "share_ready"),
    ("record built (make_record)", "record_built"),
    ("energy chunk sent", "energy_chunk_sent"),
    ("terminal chunk sent", "last_chunk_sent"),
    ("write begins (fsync)", "write_begin"),
    ("write done", "write_done"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="the source tree whose ipw serve to time")
    ap.add_argument("--requests", type=int, default=40, help="through the proxy, and as many direct")
    ap.add_argument("--delay-ms", type=float, default=30.0)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--keep-alive", action="store_true", help="each path's requests on one client connection")
    ap.add_argument("--out", help="write the per-request timelines and the medians here (JSON)")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from serve_cpu import free_port

    port = free_port()
    fake = subprocess.Popen([sys.executable, str(HERE / "serve_cpu.py"), "--upstream", str(port), str(args.tokens),
                             str(args.delay_ms / 1000)], stdout=subprocess.PIPE, text=True)
    assert fake.stdout is not None and fake.stdout.readline().strip() == "ready"
    direct = f"http://127.0.0.1:{port}/v1"
    root = str(Path(args.src).resolve())
    out_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"ipw-serve-timeline-{os.getpid()}"
    stamps_path = out_dir / "stamps.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, __file__, "--proxy", direct, str(fake.pid), str(out_dir), str(stamps_path)],
                            stdout=subprocess.PIPE, text=True, cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    load0 = os.getloadavg()[0]
    clients: list[dict[str, Any]] = []
    directs: list[dict[str, Any]] = []
    try:
        kept: dict[str, http.client.HTTPConnection] | None = {} if args.keep_alive else None
        for i in range(4):  # warm both paths
            one_request(url, -1 - i, kept)
            one_request(direct, -1 - i, kept)
        for i in range(args.requests):
            directs.append(one_request(direct, 2 * i, kept))
            clients.append(one_request(url, 2 * i + 1, kept))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        fake.kill()
    load1 = os.getloadavg()[0]
    direct_s = [d["client_done"] - d["sent"] for d in directs]
    data = json.loads(stamps_path.read_text())
    server = data["requests"][-args.requests:]
    reads, settles = data["reads"], data["settles"]
    rows = []
    for c, s in zip(clients, server):
        row = {**c, **s}
        end = s.get("window_cut")
        if end is not None:
            row["edge_read"] = min((b for a, b in reads if a >= end), default=float("nan"))
        if "share_ready" in s:  # the handler waited for the share (it does only with --energy-wait now)
            row["settle_begin"] = max((a for a, b in settles if b <= s["share_ready"]), default=float("nan"))
        rows.append(row)
    proxy_s = [r["client_done"] - r["sent"] for r in rows]
    print(f"load average {load0:.2f} -> {load1:.2f}; {len(rows)} requests each")
    print(f"median latency: direct {1000 * statistics.median(direct_s):.2f} ms, "
          f"proxy {1000 * statistics.median(proxy_s):.2f} ms, "
          f"added {1000 * (statistics.median(proxy_s) - statistics.median(direct_s)):+.2f} ms")
    medians: dict[str, float] = {}
    previous = "sent"
    print(f"{'step':52s} {'median ms after the previous':>28s} {'p90':>7s}")
    for label, key in [("client sends (new connection)", "sent"), *STEPS,
                       ("client read [DONE]", "client_done")]:
        if key == "sent":
            continue
        gaps = [1000 * (r[key] - r[previous]) for r in rows if key in r and previous in r]
        if not gaps:
            continue
        gaps.sort()
        medians[key] = statistics.median(gaps)
        print(f"{label:52s} {medians[key]:28.3f} {gaps[int(0.9 * (len(gaps) - 1))]:7.3f}")
        if key not in ("write_begin", "write_done"):
            previous = key
    for label, a, b in [("write: after the client's [DONE]", "client_done", "write_begin"),
                        ("write: fsync etc.", "write_begin", "write_done"),
                        ("usage parsed -> client [DONE]", "usage_received", "client_done"),
                        ("sent -> first event at the client", "sent", "client_first_event")]:
        gaps = sorted(1000 * (r[b] - r[a]) for r in rows if a in r and b in r)
        if gaps:
            medians[f"{a}->{b}"] = statistics.median(gaps)
            print(f"{label:52s} {statistics.median(gaps):28.3f}")
    split = {"added_to_first_event_ms": 1000 * (statistics.median(r["client_first_event"] - r["sent"] for r in rows)
                                                - statistics.median(d["client_first_event"] - d["sent"] for d in directs)),
             "added_first_event_to_done_ms": 1000 * (
                 statistics.median(r["client_done"] - r["client_first_event"] for r in rows)
                 - statistics.median(d["client_done"] - d["client_first_event"] for d in directs))}
    split["added_first_event_to_usage_ms"] = 1000 * (
        statistics.median(r["client_usage"] - r["client_first_event"] for r in rows)
        - statistics.median(d["client_usage"] - d["client_first_event"] for d in directs))
    print(", ".join(f"{k} {v:+.2f}" for k, v in split.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "src": root, "keep_alive": args.keep_alive, "load_average": [load0, load1], "cores": os.cpu_count(),
            "direct_median_s": statistics.median(direct_s), "proxy_median_s": statistics.median(proxy_s),
            "gap_medians_ms": medians, **split, "requests": rows, "direct": directs}, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--proxy"]:
        proxy(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        main()
