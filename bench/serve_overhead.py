"""What ``ipw serve`` costs a client: the same requests straight to a llama.cpp server (``llama-server``)
and through the measuring proxy in front of it, in one run, in alternating order (A B B A ...).

- One llama-server (SmolLM2-135M-Instruct, ``--parallel`` = the highest concurrency, started through
  ipw's managed-server code), one ``ipw serve --upstream`` process in front of it (its own process, with
  the sensors this machine has: NVML, RAPL or the CPU model of the server's process tree).
- The load: this script, the standard library only (``http.client``, C threads, closed loop: each
  thread sends its next request when the last one ended), streamed chat requests with
  ``stream_options.include_usage``, read to ``[DONE]``; every request a different prompt (llama-server
  runs with ``--no-cache-prompt``).
- Per round and mode: per-request latency (send to ``[DONE]``), time to first token, and throughput
  (output tokens / span of the round).  Added latency = median(proxy) - median(direct) per round;
  throughput ratio = proxy / direct per round; the figures are medians over rounds.

    .venv/bin/python bench/serve_overhead.py --out bench/results/serve-overhead-cpu.json      # CPU, levels 1 and 64
    python3 bench/serve_overhead.py --n-gpu-layers -1 --server-threads 4 --max-tokens 64 --out o.json  # a GPU
    (bench/serving_h200.sh serve runs it on the H200 with and without --no-energy-in-response)
    git archive main | tar -x -C /tmp/ipw-main && .venv/bin/python bench/serve_overhead.py --baseline-src /tmp/ipw-main
    (a second proxy, from another source tree, in the same rounds: before and after a change under one load)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]


def one_request(url: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """One streamed chat request: (latency s, ttft s, content chunks)."""
    parts = urlsplit(url)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    conn.request("POST", parts.path.rstrip("/") + "/chat/completions", body=body,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:200]
    first, chunks = None, 0
    for line in resp:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        for choice in chunk.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    conn.close()
    return end - t0, (first or end) - t0, chunks


def load(url: str, concurrency: int, prompts: list[str], max_tokens: int) -> dict:
    """``prompts`` through ``url``, ``concurrency`` at a time (closed loop)."""
    results: list = []
    lock = threading.Lock()
    queue = list(prompts)

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            r = one_request(url, prompt, max_tokens)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    span = time.perf_counter() - t0
    return {"latency_s": statistics.median(r[0] for r in results), "ttft_s": statistics.median(r[1] for r in results),
            "tokens": sum(r[2] for r in results), "span_s": span, "tokens_per_s": sum(r[2] for r in results) / span,
            "requests": len(results)}


def start_proxy(upstream: str, pid: int, out: str, options: list[str], src: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """``ipw serve`` from the source tree ``src`` (this checkout, or --baseline-src)."""
    proc = subprocess.Popen([sys.executable, "-m", "ipw.cli", "serve", "--upstream", upstream, "--port", "0",
                             "--upstream-pid", str(pid), "--idle-s", "1", "--out", out, *options],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=src,
                            env={**os.environ, "PYTHONPATH": str(src)})
    line = proc.stderr.readline()
    match = re.search(r"(http://127\.0\.0\.1:\d+/v1) ->", line)
    if not match:
        proc.kill()
        raise SystemExit(f"ipw serve did not start: {line}{proc.stderr.read()}")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # drain its progress lines
    return proc, match.group(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1,64", help="concurrency levels (comma-separated)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=0, help="requests per level and mode (default 24 at 1, 2x C above)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--server-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--n-gpu-layers", type=int, default=None)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--proxy-option", action="append", default=[], help="an option for ipw serve (repeat)")
    ap.add_argument("--runs", help="folder for the proxy's run folder (default: a temporary one)")
    ap.add_argument("--baseline-src", help="also run an ipw serve from this source tree (e.g. a git archive of an "
                    "earlier commit) in the same rounds, so that both proxies see the same machine load")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    from ipw.backends.servers import start_server
    from ipw.models import resolve_model

    model = resolve_model("smollm2-135m")[0]
    tmp = Path(tempfile.mkdtemp(prefix="ipw-serve-bench-"))
    server = start_server("llama-server", model, tmp / "server.log", n_threads=args.server_threads, n_ctx=256,
                          alias="m", timeout_s=300, parallel=max(levels), n_gpu_layers=args.n_gpu_layers)
    runs_dir = Path(args.runs) if args.runs else tmp / "runs"
    proxy, proxy_url = start_proxy(server.base_url, server.pid, str(runs_dir), args.proxy_option)
    urls = {"direct": server.base_url, "proxy": proxy_url}
    baseline = None
    if args.baseline_src:
        baseline, urls["baseline"] = start_proxy(server.base_url, server.pid, str(runs_dir / "baseline"),
                                                 args.proxy_option, Path(args.baseline_src).resolve())
    counter = iter(range(10**9))
    rounds: dict[int, list[dict]] = {c: [] for c in levels}
    try:
        for c in levels:  # warm every path
            for url in urls.values():
                load(url, c, [f"Warm up {next(counter)}." for _ in range(c)], args.max_tokens)
        for r in range(args.rounds):
            for c in levels:
                n = args.requests or (24 if c == 1 else 2 * c)
                order = list(urls) if r % 2 == 0 else list(urls)[::-1]
                row = {}
                for mode in order:
                    prompts = [f"Write one sentence about the number {next(counter)}." for _ in range(n)]
                    row[mode] = load(urls[mode], c, prompts, args.max_tokens)
                row["load_average"] = os.getloadavg()[0]
                for mode, prefix in (("proxy", ""), ("baseline", "baseline_")):
                    if mode in row:
                        row[prefix + "added_latency_ms"] = 1000 * (row[mode]["latency_s"] - row["direct"]["latency_s"])
                        row[prefix + "added_ttft_ms"] = 1000 * (row[mode]["ttft_s"] - row["direct"]["ttft_s"])
                        row[prefix + "throughput_ratio"] = row[mode]["tokens_per_s"] / row["direct"]["tokens_per_s"]
                        print(f"round {r + 1} c={c} {mode}: added latency {row[prefix + 'added_latency_ms']:+.2f} ms, "
                              f"ttft {row[prefix + 'added_ttft_ms']:+.2f} ms, throughput ratio "
                              f"{row[prefix + 'throughput_ratio']:.4f} (load {row['load_average']:.2f})", flush=True)
                rounds[c].append(row)
    finally:
        for proc in (proxy, baseline):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=120)
        server.stop()
    runs = sorted(p for p in runs_dir.iterdir() if p.name != "baseline")
    manifest = json.loads((runs[-1] / "manifest.json").read_text())

    def session_line(run: Path) -> dict:
        line = json.loads((run / "manifest.json").read_text())["backends"][0]["sessions"][-1]
        return {k: v for k, v in line.items() if k in ("requests", "in_flight_peak", "meter_cost", "sampler_overhead", "wall_s")}
    summary = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "model": "smollm2-135m",
        "server_threads": args.server_threads, "n_gpu_layers": args.n_gpu_layers, "max_tokens": args.max_tokens,
        "sensors": [s.get("source") for s in manifest["backends"][0]["sensors"]], "proxy_options": args.proxy_option,
        "levels": {c: {"median_added_latency_ms": statistics.median(x["added_latency_ms"] for x in rows),
                       "median_added_ttft_ms": statistics.median(x["added_ttft_ms"] for x in rows),
                       "median_throughput_ratio": statistics.median(x["throughput_ratio"] for x in rows),
                       "direct_latency_s": statistics.median(x["direct"]["latency_s"] for x in rows),
                       "direct_tokens_per_s": statistics.median(x["direct"]["tokens_per_s"] for x in rows),
                       "requests_per_mode": rows[0]["direct"]["requests"], "rounds": rows} for c, rows in rounds.items()},
        **({"baseline_src": args.baseline_src, "baseline": {
            c: {k: statistics.median(x["baseline_" + k] for x in rows)
                for k in ("added_latency_ms", "added_ttft_ms", "throughput_ratio")} for c, rows in rounds.items()}}
           if args.baseline_src else {}),
        "proxy_records": sum(1 for _ in open(runs[-1] / "records.jsonl")),
        "proxy_session": session_line(runs[-1]),
        **({"baseline_session": session_line(sorted((runs_dir / "baseline").iterdir())[-1])} if args.baseline_src else {}),
    }
    print(json.dumps({c: {k: v for k, v in x.items() if k != "rounds"} for c, x in summary["levels"].items()}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
