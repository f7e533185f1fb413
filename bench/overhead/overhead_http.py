"""Harness overhead over HTTP: ipw's ``openai`` backend against a bare client loop, on one local
llama.cpp server, at concurrency 1 and 8.

The bench starts one llama.cpp server (``python -m llama_cpp.server`` through ipw's managed-server code,
SmolLM2-135M-Instruct, ``--n_threads`` = ``--server-threads``), then for each round and each
concurrency runs, one after the other in alternating order:

- **ipw**: the real CLI, ``ipw run CONFIG`` with one ``openai`` backend at ``base_url`` (the chat API,
  streamed, ``concurrency`` = C, 2 warm-up queries, ``idle_s = 0``; the CPU-model sensor measures the
  server's process tree), under a pseudo-terminal so that the progress bar renders;
- **bare**: this script in ``--bare-worker`` mode: the standard library only (``http.client``, one
  connection per request as ipw opens, C threads), the same 2 warm-up requests, then the same request
  bodies (the same JSON ipw sends: every generation setting, ``stream`` with usage) for the same
  prompts; it reads each event stream to ``[DONE]``, parsing every chunk, and nothing else.

Throughput = requests completed / (end of the last request - start of the first), and output tokens
(content chunks) per second over the same span; ratio = ipw / bare, per round, then the median over rounds.

    .venv/bin/python bench/overhead/overhead_http.py                      # writes docs/PERFORMANCE.md
    .venv/bin/python bench/overhead/overhead_http.py --rounds 2 --queries 16 --no-write

Output: docs/PERFORMANCE.md, section "Harness overhead: HTTP (openai backend against a local llama.cpp
    server)" (``--no-write``: printed only).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py
sys.path.insert(0, str(ROOT / "bench"))
from _shared import (DOC, IPW, Child, config_head, ipw_rows, loads, machine, median, run_plain,  # noqa: E402
                            write_section)

SECTION = "## Harness overhead: HTTP (openai backend against a local llama.cpp server)"
MODEL = "smollm2-135m"
TARGET = 0.97


def request_body(prompt: str, max_tokens: int) -> bytes:
    """What ipw's openai backend sends for a chat query with the run's settings (checked in main)."""
    return json.dumps({
        "model": MODEL, "max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "seed": 0, "top_k": 40,
        "repeat_penalty": 1.0, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": prompt}],
    }).encode("utf-8")


# --- the bare client -----------------------------------------------------------------------------------

def bare_worker(args) -> int:
    from ipw.inputs.datasets import load_queries

    prompts = [q.render() for q in load_queries(args.dataset)[: max(args.queries, args.warmup)]]
    host, port = "127.0.0.1", args.port

    def one(prompt: str) -> dict:
        start = time.monotonic()
        conn = http.client.HTTPConnection(host, port, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", body=request_body(prompt, args.max_tokens),
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.status
            parts, first = [], None
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                for choice in json.loads(data).get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if first is None:
                            first = time.monotonic()
                        parts.append(piece)
        finally:
            conn.close()
        return {"start": start, "first": first, "end": time.monotonic(), "tokens": len(parts),
                "text": "".join(parts).strip()}

    for p in prompts[: args.warmup]:
        one(p)
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        rows = list(pool.map(one, prompts[: args.queries]))
    Path(args.bare_worker).write_text(json.dumps(rows), encoding="utf-8")
    return 0


# --- the benchmark -----------------------------------------------------------------------------------

def config_toml(args, base_url: str, concurrency: int, out_dir: Path) -> str:
    return config_head(args.dataset, out_dir, args.warmup, args.max_tokens, args.queries) + f"""name = "{MODEL}-http"
kind = "openai"
model = "{MODEL}"
role = "cloud"
base_url = "{base_url}"
api = "chat"
concurrency = {concurrency}
"""


def throughput(rows: list[dict]) -> dict:
    wall = max(r["end"] for r in rows) - min(r["start"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    return {"n": len(rows), "wall_s": wall, "rps": len(rows) / wall, "tokens": tokens, "tps": tokens / wall}


def one_round(args, tmp: Path, port: int, concurrency: int, r: int) -> dict:
    base_url = f"http://127.0.0.1:{port}/v1"
    tag = f"c{concurrency}-{r}"
    cfg, runs, bare_out = tmp / f"{tag}.toml", tmp / f"ipw-{tag}", tmp / f"bare-{tag}.json"
    cfg.write_text(config_toml(args, base_url, concurrency, runs), encoding="utf-8")
    order = ("bare", "ipw") if r % 2 == 0 else ("ipw", "bare")
    out = {"order": order}
    for side in order:
        load = loads()
        if side == "bare":
            res = run_plain([sys.executable, str(Path(__file__).resolve()), "--bare-worker", str(bare_out),
                             "--port", str(port), "--concurrency", str(concurrency), "--queries", str(args.queries),
                             "--warmup", str(args.warmup), "--max-tokens", str(args.max_tokens),
                             "--dataset", args.dataset])
            if res["rc"] != 0:
                raise SystemExit(f"bare client failed:\n{res['output'][-3000:]}")
            rows = json.loads(bare_out.read_text(encoding="utf-8"))
            stats = throughput(rows)
            stats["outputs"] = [row["text"] for row in rows]
        else:
            child = Child([*IPW, "run", str(cfg)], pty=args.pty)
            child.wait()
            if child.rc != 0:
                raise SystemExit(f"ipw run failed:\n{child.output()[-3000:]}")
            (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
            rows, outputs, manifest = ipw_rows(run_dir)
            errors = [row["error"] for row in rows if row["error"]]
            if errors:
                raise SystemExit(f"ipw run had errors: {errors[:3]}")
            stats = throughput(rows)
            stats["outputs"] = outputs
            stats["sent"] = manifest["backends"][0].get("request_params")
        stats["load_avg"] = load
        out[side] = stats
        print(f"c={concurrency} round {r + 1} {side:4s}: {stats['rps']:.3f} req/s, {stats['tps']:.1f} tok/s, "
              f"{stats['wall_s']:.2f} s, load avg {load}", file=sys.stderr, flush=True)
    out["same_outputs"] = sum(a == b for a, b in zip(out["bare"]["outputs"], out["ipw"]["outputs"]))
    out["same_tokens"] = out["bare"]["tokens"] == out["ipw"]["tokens"]
    out["ratio"] = out["ipw"]["rps"] / out["bare"]["rps"]
    out["token_ratio"] = out["ipw"]["tps"] / out["bare"]["tps"]
    print(f"c={concurrency} round {r + 1}: throughput ratio {out['ratio']:.4f} (tokens/s {out['token_ratio']:.4f}), "
          f"identical outputs {out['same_outputs']}/{args.queries}", file=sys.stderr, flush=True)
    return out


def measure(args) -> dict:
    from ipw.backends.servers import start_server
    from ipw.inputs.models import resolve_model

    res = {c: [] for c in args.concurrency}
    with tempfile.TemporaryDirectory(prefix="ipw-overhead-http-") as tmp_name:
        tmp = Path(tmp_name)
        model_path, _ = resolve_model(MODEL)
        server = start_server("llama-cpp", model_path, tmp / "server.log", n_threads=args.server_threads,
                              n_ctx=4096, alias=MODEL, timeout_s=180)
        try:
            for r in range(args.rounds):
                for c in (args.concurrency if r % 2 == 0 else args.concurrency[::-1]):
                    res[c].append(one_round(args, tmp, server.port, c, r))
        finally:
            server.stop()
    sent = next(p["ipw"]["sent"] for rounds in res.values() for p in rounds)
    expect = json.loads(request_body("", args.max_tokens))
    expect.pop("messages")
    for rounds in res.values():
        for p in rounds:
            for side in ("bare", "ipw"):
                p[side].pop("outputs")
    return {"rounds": {str(c): v for c, v in res.items()}, "same_request": sent == expect, "sent": sent,
            "ratio": {str(c): median([p["ratio"] for p in v]) for c, v in res.items()},
            "token_ratio": {str(c): median([p["token_ratio"] for p in v]) for c, v in res.items()}}


def write_doc(args, res: dict) -> None:
    rows, summary = [], []
    for c, rounds in res["rounds"].items():
        for i, p in enumerate(rounds):
            b, w = p["bare"], p["ipw"]
            rows.append(f"| {c} | {i + 1} | {', '.join(p['order'])} | {b['rps']:.3f} | {w['rps']:.3f} | **{p['ratio']:.3f}** | "
                        f"{b['tps']:.1f} | {w['tps']:.1f} | {p['token_ratio']:.3f} | {p['same_outputs']}/{b['n']} | "
                        f"{b['load_avg']}, {w['load_avg']} |")
        ok = res["ratio"][c] >= TARGET
        summary.append(f"| {c} | {median([p['bare']['rps'] for p in rounds]):.3f} | "
                       f"{median([p['ipw']['rps'] for p in rounds]):.3f} | **{res['ratio'][c]:.3f}** | "
                       f"{res['token_ratio'][c]:.3f} | ≥ {TARGET} | {'PASS' if ok else 'FAIL'} |")
    body = f"""{SECTION}

One llama.cpp server (`python -m llama_cpp.server`, started through ipw's managed-server code,
SmolLM2-135M-Instruct, `--n_threads {args.server_threads}`) serves both clients: ipw (`ipw run` with an
`openai` backend at its `base_url`, chat API, streamed, the CPU-model sensor measuring the server's
process tree, the progress bar rendering into a pseudo-terminal) and a bare standard-library client
(`http.client`, one connection per request, C threads, every stream read to `[DONE]` and parsed) that
sends the same request bodies {'(checked: identical to the `request_params` in ipw’s manifest)' if res['same_request'] else '(NOT identical to ipw’s request_params)'}.
{args.queries} queries of `{args.dataset}`, `max_tokens = {args.max_tokens}`, greedy, {args.warmup} warm-up requests each;
{args.rounds} rounds, in each round and concurrency one bare and one ipw process back to back, in alternating
order; {machine()}.

| concurrency | bare requests/s | ipw requests/s | throughput ratio (median) | tokens/s ratio | target | |
|---|---|---|---|---|---|---|
{chr(10).join(summary)}

| concurrency | round | order | bare req/s | ipw req/s | ratio | bare tok/s | ipw tok/s | tok/s ratio | identical outputs | load avg (bare, ipw) |
|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Throughput = requests / (end of the last request − start of the first); tokens are content chunks.
llama.cpp's Python server runs one request at a time, so at concurrency 8 the requests queue in the
server and throughput is about that of concurrency 1; what concurrency adds on the client is the
overlap of the harness's work (energy split per segment, records) with the server's.

Reproduce (writes this section):

```bash
.venv/bin/python bench/overhead/overhead_http.py --queries {args.queries} --rounds {args.rounds} --server-threads {args.server_threads}
```
"""
    write_section(DOC, SECTION, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--server-threads", type=int, default=1)
    parser.add_argument("--dataset", default="ipw-core")
    parser.add_argument("--no-pty", dest="pty", action="store_false")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--bare-worker", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_worker:
        args.concurrency = args.concurrency[0]
        return bare_worker(args)
    res = measure(args)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1), encoding="utf-8")
    print(json.dumps({"ratio": res["ratio"], "token_ratio": res["token_ratio"], "same_request": res["same_request"]}))
    if not args.no_write:
        write_doc(args, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
