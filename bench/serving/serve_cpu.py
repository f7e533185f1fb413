"""What ``ipw serve`` itself costs, without an inference engine's noise: a fake streaming upstream (the
standard library, a process of its own: ``--tokens`` chunks ``--delay-ms`` apart in llama-server's format,
``timings`` included, then the usage chunk and ``[DONE]``), one ``ipw serve --upstream`` per source tree
given (this checkout, an earlier commit's ``git archive``), and a closed-loop client in this process.

Per round, level, kind of request (``--kinds``: streamed, plain) and proxy: the proxy process's CPU seconds
per request (/proc, the sensors' threads included), the added median latency against the same fake direct,
the throughput against direct (the direct load's wall time over the proxy's, for the same requests), and the
load average.  The proxies run in alternating order in each round, so an earlier and a later commit see the
same machine load.  A source tree may carry options for its ``ipw serve`` after ``::`` (one proxy each):

    git archive 979245b | tar -x -C /tmp/ipw-old
    .venv/bin/python bench/serving/serve_cpu.py /tmp/ipw-old . ".::--energy-wait" ".::--no-energy-in-response" \
        --levels 1,32,64 --kinds streamed,plain --rounds 3 --out serve-cpu.json

Output: printed, and ``--out`` (JSON); the figures are in docs/PERFORMANCE.md, "ipw serve: what the measuring
    proxy costs a client".
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit


def upstream(port: int, tokens: int, delay_s: float) -> None:
    """The fake server (``--upstream PORT TOKENS DELAY_S``): /v1/models says llama.cpp, so the proxy asks for
    ``timings_per_token``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            payload = json.dumps({"object": "list", "data": [{"id": "m", "owned_by": "llamacpp"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if not body.get("stream"):  # a plain answer: the same tokens' time, one JSON body
                time.sleep(delay_s * tokens)
                payload = json.dumps({"id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m",
                                      "choices": [{"index": 0, "finish_reason": "length",
                                                   "message": {"role": "assistant", "content": " w" * tokens}}],
                                      "usage": {"prompt_tokens": 20, "completion_tokens": tokens,
                                                "total_tokens": 20 + tokens},
                                      "timings": {"prompt_n": 20, "prompt_ms": 5.0, "predicted_n": tokens,
                                                  "predicted_ms": 1000 * delay_s * tokens}}).encode()
                head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                        % len(payload))
                self.wfile.write(head + payload)  # one write, as llama-server does: no Nagle wait on a kept-alive
                return                             # connection between the headers and the body (~40 ms)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            t0 = time.monotonic()
            base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}

            def event(data: dict) -> None:
                line = b"data: " + json.dumps(data).encode() + b"\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))

            for i in range(tokens):
                time.sleep(delay_s)
                timings = {"prompt_n": 20, "prompt_ms": 5.0, "predicted_n": i + 1,
                           "predicted_ms": 1000 * (time.monotonic() - t0)}
                event({**base, "choices": [{"index": 0, "finish_reason": None, "delta": {"content": f" w{i}"}}],
                       **({"timings": timings} if body.get("timings_per_token") else {})})
            event({**base, "choices": [{"index": 0, "finish_reason": "length", "delta": {}}]})
            event({**base, "choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": tokens,
                                                    "total_tokens": 20 + tokens},
                   "timings": {"prompt_n": 20, "prompt_ms": 5.0, "predicted_n": tokens, "predicted_ms": 1.0}})
            done = b"data: [DONE]\n\n"
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 256  # the listen backlog: set before the socket listens (64 clients connect at once)

    server = Server(("127.0.0.1", port), Handler)
    print("ready", flush=True)
    server.serve_forever()


def one_request(url: str, n: int, stream: bool = True) -> tuple[float, bool]:
    """One chat request, streamed (read to [DONE]) or plain: its latency and whether it carried its energy."""
    parts = urlsplit(url)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"prompt {n}"}], "max_tokens": 16,
                       **({"stream": True, "stream_options": {"include_usage": True}} if stream else {})}).encode()
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    conn.request("POST", parts.path.rstrip("/") + "/chat/completions", body=body,
                 headers={"Content-Type": "application/json"})
    energy = False
    resp = conn.getresponse()
    if not stream:
        energy = b'"energy"' in resp.read()
        conn.close()
        return time.perf_counter() - t0, energy
    for line in resp:
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            energy |= b'"energy"' in data
    conn.close()
    return time.perf_counter() - t0, energy


def load(url: str, concurrency: int, requests: int, counter: Iterator[int], stream: bool = True
         ) -> tuple[float, int, float]:
    """``requests`` through ``url``, ``concurrency`` at a time: median latency, answers with energy, wall seconds."""
    results: list[tuple[float, bool]] = []
    lock = threading.Lock()
    left = [requests]

    def worker() -> None:
        while True:
            with lock:
                if not left[0]:
                    return
                left[0] -= 1
                n = next(counter)
            result = one_request(url, n, stream)
            with lock:
                results.append(result)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(r[0] for r in results), sum(r[1] for r in results), time.perf_counter() - t0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", nargs="+", help="source trees whose ipw serve to run (e.g. . and an earlier git archive), "
                    "each optionally with its options after :: (e.g. '.::--energy-wait')")
    ap.add_argument("--levels", default="1,64")
    ap.add_argument("--kinds", default="streamed", help="streamed, plain or both (comma-separated)")
    ap.add_argument("--requests", type=int, default=128, help="per round and proxy at the highest level (1/4 at 1)")
    ap.add_argument("--delay-ms", type=float, default=30.0, help="between the fake server's chunks")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    port = free_port()
    fake = subprocess.Popen([sys.executable, __file__, "--upstream", str(port), str(args.tokens),
                             str(args.delay_ms / 1000)], stdout=subprocess.PIPE, text=True)
    assert fake.stdout is not None and fake.stdout.readline().strip() == "ready"
    direct = f"http://127.0.0.1:{port}/v1"
    runs = tempfile.mkdtemp(prefix="ipw-serve-cpu-")
    proxies = []
    kinds = args.kinds.split(",")
    for spec in args.src:
        src, _, extra = spec.partition("::")
        root = str(Path(src).resolve())
        proc = subprocess.Popen([sys.executable, "-m", "ipw.cli", "serve", "--upstream", direct, "--port", "0",
                                 "--upstream-pid", str(fake.pid), "--idle-s", "0", "--out", runs, *extra.split()],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=root,
                                env={**os.environ, "PYTHONPATH": root})
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(r"(http://127\.0\.0\.1:\d+/v1) ->", line)
        if not match:
            raise SystemExit(f"ipw serve from {root} did not start: {line}")
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        proxies.append((spec if extra else root, proc, match.group(1)))
    counter = iter(range(10**9))
    rows: list[dict] = []
    try:
        for c in levels:  # warm every path
            for url in [direct, *(p[2] for p in proxies)]:
                load(url, c, c, counter)
        for r in range(args.rounds):
            for c in levels:
                for kind in kinds:
                    n = args.requests if c > 1 else max(16, args.requests // 4)
                    stream = kind == "streamed"
                    direct_s, _, direct_wall = load(direct, c, n, counter, stream)
                    for root, proc, url in (proxies if r % 2 == 0 else proxies[::-1]):
                        before = cpu_s(proc.pid)
                        latency_s, energy, wall = load(url, c, n, counter, stream)
                        row = {"round": r + 1, "level": c, "kind": kind, "src": root, "requests": n,
                               "cpu_ms_per_request": 1000 * (cpu_s(proc.pid) - before) / n,
                               "added_latency_ms": 1000 * (latency_s - direct_s), "direct_latency_s": direct_s,
                               "throughput_vs_direct": direct_wall / wall,
                               "with_energy": energy, "load_average": os.getloadavg()[0]}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    finally:
        for _, proc, _ in proxies:
            proc.terminate()
            proc.wait(timeout=60)
        fake.kill()
    summary = {"delay_ms": args.delay_ms, "tokens": args.tokens, "cores": os.cpu_count(), "rounds": rows,
               "medians": [{"src": root, "level": c, "kind": kind,
                            **{k: statistics.median(x[k] for x in rows
                                                    if x["src"] == root and x["level"] == c and x["kind"] == kind)
                               for k in ("cpu_ms_per_request", "added_latency_ms", "throughput_vs_direct")}}
                           for root, _, _ in proxies for c in levels for kind in kinds]}
    for m in summary["medians"]:
        print(m)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--upstream"]:
        upstream(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    else:
        main()
