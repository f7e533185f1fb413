"""What ``ipw serve`` costs a client: the same requests straight to a llama.cpp server (``llama-server``)
and through measuring proxies in front of it, in one run, in alternating order (A B C D, D C B A, ...).

- One llama-server (SmolLM2-135M-Instruct, ``--parallel`` = the highest concurrency, started through
  ipw's managed-server code), and one ``ipw serve --upstream`` process per proxy mode in front of it (each its
  own process and run folder, with the sensors this machine has: NVML, RAPL or the CPU model of the server's
  process tree).  ``--proxy NAME=OPTIONS`` names a mode, e.g. ``provisional=`` (the default: the answer
  carries a provisional energy at once), ``wait=--energy-wait``, ``none=--no-energy-in-response``.
- The load: this script, the standard library only (``http.client``, C threads, closed loop: each
  thread sends its next request when the last one ended); streamed chat requests with
  ``stream_options.include_usage``, read to ``[DONE]``, and/or plain (non-streamed) ones (``--kinds``);
  every request a different prompt (llama-server runs with ``--no-cache-prompt``).
- Per round, level, kind and mode: per-request latency (send to ``[DONE]`` or to the whole body), time to
  first token (streams), and throughput (output tokens / span of the round).  Added latency =
  median(proxy) - median(direct) per round; throughput ratio = proxy / direct per round; the figures are
  medians over rounds.
- After the rounds, the answers' ``usage.energy``: for a proxy whose answers were provisional, up to 64 of the
  last round's are looked up at their ``settled_url`` (``GET /v1/ipw/energy/ID``: 200 settled, 202 pending),
  and the settled value is checked against the provisional one's ±90% band.

    .venv/bin/python bench/serving/serve_overhead.py --out bench/results/serve-overhead-cpu.json      # CPU, levels 1 and 64
    python3 bench/serving/serve_overhead.py --n-gpu-layers -1 --server-threads 4 --max-tokens 64 --levels 1,32,64 \\
        --kinds stream,plain --proxy provisional= --proxy wait=--energy-wait --proxy none=--no-energy-in-response \\
        --out o.json                                       # a GPU (bench/serving/serving_h200.sh serve)
    python3 bench/serving/serve_overhead.py --summary o.json       # the markdown tables of a saved result
    git archive main | tar -x -C /tmp/ipw-main && .venv/bin/python bench/serving/serve_overhead.py --baseline-src /tmp/ipw-main
    (a second proxy, from another source tree, in the same rounds: before and after a change under one load)

Output: printed (Markdown), and ``--out`` (JSON); the figures are in docs/PERFORMANCE.md, "ipw serve: what the
    measuring proxy costs a client", and docs/SERVING.md.
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

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py


def one_request(url: str, prompt: str, max_tokens: int, stream: bool = True) -> tuple[float, float, int, dict | None]:
    """One chat request: (latency s, ttft s, output tokens, usage.energy or None).  Streamed: read to [DONE], the
    tokens are the content chunks; plain: the whole body, the tokens are usage.completion_tokens."""
    parts = urlsplit(url)
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    conn.request("POST", parts.path.rstrip("/") + "/chat/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:200]
    first, chunks, usage = None, 0, None
    if stream:
        for line in resp:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
    else:
        usage = json.loads(resp.read()).get("usage") or {}
        chunks = int(usage.get("completion_tokens") or 0)
    end = time.perf_counter()
    conn.close()
    return end - t0, (first or end) - t0, chunks, (usage or {}).get("energy")


def load(url: str, concurrency: int, prompts: list[str], max_tokens: int, stream: bool = True) -> dict:
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
            r = one_request(url, prompt, max_tokens, stream)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    span = time.perf_counter() - t0
    energies = [r[3] for r in results if r[3]]
    provisional = [e for e in energies if e.get("provisional")]
    return {"latency_s": statistics.median(r[0] for r in results), "ttft_s": statistics.median(r[1] for r in results),
            "tokens": sum(r[2] for r in results), "span_s": span, "tokens_per_s": sum(r[2] for r in results) / span,
            "requests": len(results), "with_energy": len(energies), "provisional": len(provisional),
            "median_band_pct": round(statistics.median(100 * e["uncertainty_j"] / e["energy_j"] for e in provisional
                                                 if e.get("uncertainty_j") is not None and e.get("energy_j")), 2)
            if any(e.get("uncertainty_j") is not None and e.get("energy_j") for e in provisional) else None,
            "_energies": energies}


def start_proxy(upstream: str, pid: int, out: str, options: list[str], src: Path = ROOT) -> subprocess.Popen:
    """``ipw serve`` from the source tree ``src`` (this checkout, or --baseline-src); see ``proxy_url``."""
    return subprocess.Popen([sys.executable, "-m", "ipw.cli", "serve", "--upstream", upstream, "--port", "0",
                             "--upstream-pid", str(pid), "--idle-s", "1", "--out", out, *options],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=src,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [str(src), *filter(None, [os.environ.get("PYTHONPATH")])])})


def proxy_url(proc: subprocess.Popen) -> str:
    """The URL a started proxy prints first (its progress lines are drained from then on)."""
    line = proc.stderr.readline()
    match = re.search(r"(http://127\.0\.0\.1:\d+/v1) ->", line)
    if not match:
        proc.kill()
        raise SystemExit(f"ipw serve did not start: {line}{proc.stderr.read()}")
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    return match.group(1)


def check_settled(url: str, energies: list[dict], limit: int = 64) -> dict:
    """GET the settled energy of up to ``limit`` provisional answers; the settled value against the band."""
    parts = urlsplit(url)
    status: dict[str, int] = {}
    inside, pairs, pending = 0, [], []
    for e in [e for e in energies if e.get("provisional") and e.get("settled_url")][-limit:]:
        for _ in range(3):
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
            try:
                conn.request("GET", e["settled_url"])
                resp = conn.getresponse()
                code, body = resp.status, resp.read()
            finally:
                conn.close()
            if code != 202:
                break
            time.sleep(0.5)
        status[str(code)] = status.get(str(code), 0) + 1
        if code == 200:
            settled = json.loads(body)
            settled = settled.get("energy", settled) if isinstance(settled, dict) else {}
            if settled.get("energy_j") is not None and e.get("energy_j") is not None:
                pairs.append((e["energy_j"], settled["energy_j"]))
                inside += abs(settled["energy_j"] - e["energy_j"]) <= (e.get("uncertainty_j") or 0.0)
        elif code == 202:
            pending.append(e.get("request_id"))
    n = len(pairs)
    settled_sum = sum(s for _, s in pairs)
    return {"looked_up": sum(status.values()), "status": status, "compared": n,
            "coverage_pct": round(100 * inside / n, 2) if n else None,
            "sum_ratio_minus_1_pct": round(100 * (sum(p for p, _ in pairs) / settled_sum - 1), 3) if settled_sum else None,
            "still_pending": pending[:5]}


def markdown(summary: dict) -> str:
    """The tables of a result: per level and kind, each proxy against direct."""
    lines = [f"serve_overhead: {summary['machine']}, max_tokens {summary['max_tokens']}, rounds "
             f"{summary.get('rounds_done')}, proxies {summary['proxies']}", "",
             "| level | kind | proxy | added latency ms | added TTFT ms | throughput ratio | direct latency s | "
             "direct tok/s | answers with energy (provisional) | median band % |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c, kinds in summary["levels"].items():
        for kind, entry in kinds.items():
            for name, v in entry["proxies"].items():
                ttft = f"{v['median_added_ttft_ms']:+.2f}" if kind == "stream" else "-"  # plain: the whole answer
                lines.append(f"| {c} | {kind} | {name} | {v['median_added_latency_ms']:+.2f} | "
                             f"{ttft} | {v['median_throughput_ratio']:.4f} | "
                             f"{entry['direct_latency_s']:.4f} | {entry['direct_tokens_per_s']:.1f} | "
                             f"{v['with_energy']} ({v['provisional']}) | {v['median_band_pct']} |")
    for name, check in (summary.get("settled_lookup") or {}).items():
        lines.append(f"\nGET settled_url, {name}: {json.dumps(check)}")
    for name, line in (summary.get("sessions") or {}).items():
        lines.append(f"\nsession {name}: {json.dumps(line)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1,64", help="concurrency levels (comma-separated)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=0, help="requests per level and mode (default 24 at 1, 2x C above)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kinds", default="stream", help="stream, plain or stream,plain: streamed and/or plain requests")
    ap.add_argument("--server-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--n-gpu-layers", type=int, default=None)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--proxy", action="append", default=[], metavar="NAME=OPTIONS",
                    help="a proxy mode: a name and ipw serve's options (space-separated; repeat for several proxies)")
    ap.add_argument("--proxy-option", action="append", default=[],
                    help="an option for ipw serve of the single proxy 'proxy' (repeat; without --proxy)")
    ap.add_argument("--runs", help="folder for the proxies' run folders, one folder per proxy (default: a temporary one)")
    ap.add_argument("--baseline-src", help="also run an ipw serve from this source tree (e.g. a git archive of an "
                    "earlier commit) in the same rounds, so that both proxies see the same machine load")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="start no round that would end later than this many seconds after the start (0: no limit)")
    ap.add_argument("--summary", help="print the markdown tables of a saved --out JSON and stop")
    args = ap.parse_args()
    if args.summary:
        print(markdown(json.loads(Path(args.summary).read_text())))
        return
    t_start = time.monotonic()
    levels = [int(x) for x in args.levels.split(",")]
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    assert set(kinds) <= {"stream", "plain"}, kinds
    proxies: dict[str, tuple[list[str], Path]] = {}
    for spec in args.proxy:
        name, _, options = spec.partition("=")
        proxies[name] = (options.split(), ROOT)
    if not proxies:
        proxies["proxy"] = (args.proxy_option, ROOT)
    if args.baseline_src:
        proxies["baseline"] = (next(iter(proxies.values()))[0], Path(args.baseline_src).resolve())

    from ipw.backends.servers import start_server
    from ipw.inputs.models import resolve_model

    model = resolve_model("smollm2-135m")[0]
    tmp = Path(tempfile.mkdtemp(prefix="ipw-serve-bench-"))
    server = start_server("llama-server", model, tmp / "server.log", n_threads=args.server_threads, n_ctx=256,
                          alias="m", timeout_s=300, parallel=max(levels), n_gpu_layers=args.n_gpu_layers)
    runs_dir = Path(args.runs) if args.runs else tmp / "runs"
    procs = {name: start_proxy(server.base_url, server.pid, str(runs_dir / name), options, src)
             for name, (options, src) in proxies.items()}  # started together: their idle baselines overlap
    urls = {"direct": server.base_url, **{name: proxy_url(proc) for name, proc in procs.items()}}
    counter = iter(range(10**9))
    rounds: dict[int, dict[str, list[dict]]] = {c: {k: [] for k in kinds} for c in levels}
    last: dict[str, list[dict]] = {name: [] for name in proxies}
    settled: dict[str, dict] = {}
    rounds_done = 0
    try:
        for c in levels:  # warm every path
            for kind in kinds:
                for url in urls.values():
                    load(url, c, [f"Warm up {next(counter)}." for _ in range(c)], args.max_tokens, kind == "stream")
        round_s = 0.0
        for r in range(args.rounds):
            t_round = time.monotonic()
            if args.deadline_s and r > 0 and t_round - t_start + round_s > args.deadline_s:
                print(f"round {r + 1}: skipped, the deadline ({args.deadline_s:.0f} s) is near", flush=True)
                break
            for c in levels:
                n = args.requests or (24 if c == 1 else 2 * c)
                for kind in kinds:
                    order = list(urls) if r % 2 == 0 else list(urls)[::-1]
                    row: dict = {}
                    for mode in order:
                        prompts = [f"Write one sentence about the number {next(counter)}." for _ in range(n)]
                        row[mode] = load(urls[mode], c, prompts, args.max_tokens, kind == "stream")
                        if mode in last:
                            last[mode] = row[mode].pop("_energies")
                        else:
                            row[mode].pop("_energies")
                    row["load_average"] = os.getloadavg()[0]
                    row["vs_direct"] = {}
                    for mode in proxies:
                        v = {"added_latency_ms": 1000 * (row[mode]["latency_s"] - row["direct"]["latency_s"]),
                             "added_ttft_ms": 1000 * (row[mode]["ttft_s"] - row["direct"]["ttft_s"]),
                             "throughput_ratio": row[mode]["tokens_per_s"] / row["direct"]["tokens_per_s"]}
                        row["vs_direct"][mode] = v
                        print(f"round {r + 1} c={c} {kind} {mode}: added latency {v['added_latency_ms']:+.2f} ms, "
                              f"ttft {v['added_ttft_ms']:+.2f} ms, throughput ratio {v['throughput_ratio']:.4f} "
                              f"(load {row['load_average']:.2f})", flush=True)
                    rounds[c][kind].append(row)
            rounds_done += 1
            round_s = max(round_s, time.monotonic() - t_round)
        for name, energies in last.items():
            if any(e.get("provisional") for e in energies):
                settled[name] = check_settled(urls[name], energies)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=120)
        server.stop()

    def session_line(name: str) -> dict:
        folders = sorted(p for p in (runs_dir / name).iterdir() if (p / "manifest.json").exists())
        line = json.loads((folders[-1] / "manifest.json").read_text())["backends"][0]["sessions"][-1]
        keep = ("requests", "in_flight_peak", "meter_cost", "sampler_overhead", "wall_s", "energy_split", "split_methods")
        return {"run": folders[-1].name, "records": sum(1 for _ in open(folders[-1] / "records.jsonl")),
                **{k: v for k, v in line.items() if k in keep}}

    def med(rows: list[dict], mode: str, key: str) -> float:
        return statistics.median(x["vs_direct"][mode][key] for x in rows)

    summary = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "model": "smollm2-135m",
        "server_threads": args.server_threads, "n_gpu_layers": args.n_gpu_layers, "max_tokens": args.max_tokens,
        "proxies": {name: options for name, (options, _) in proxies.items()}, "kinds": kinds,
        "rounds_asked": args.rounds, "rounds_done": rounds_done, "wall_s": round(time.monotonic() - t_start, 1),
        **({"baseline_src": args.baseline_src} if args.baseline_src else {}),
        "levels": {c: {kind: {
            "direct_latency_s": statistics.median(x["direct"]["latency_s"] for x in rows),
            "direct_tokens_per_s": statistics.median(x["direct"]["tokens_per_s"] for x in rows),
            "requests_per_mode": rows[0]["direct"]["requests"],
            "proxies": {mode: {"median_added_latency_ms": med(rows, mode, "added_latency_ms"),
                               "median_added_ttft_ms": med(rows, mode, "added_ttft_ms"),
                               "median_throughput_ratio": med(rows, mode, "throughput_ratio"),
                               "with_energy": sum(x[mode]["with_energy"] for x in rows),
                               "provisional": sum(x[mode]["provisional"] for x in rows),
                               "median_band_pct": rows[-1][mode]["median_band_pct"]} for mode in proxies},
            "rounds": rows} for kind, rows in kinds_rows.items() if rows} for c, kinds_rows in rounds.items()},
        "settled_lookup": settled,
        "sessions": {name: session_line(name) for name in proxies},
    }
    print(markdown(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
