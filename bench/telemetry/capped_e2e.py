"""`ipw run` on a GPU at and below its power limit: the capped-noise term end to end (issue 43).  Real GPU only.

    PYTHONPATH=. python3 bench/telemetry/capped_e2e.py --out DIR [--limit 40]

A small OpenAI-compatible server in a process of its own answers every request with "42" after it has kept
the GPU busy for ``--work-s`` (default 0.15 s): model ``cap`` runs bf16 8192^3 matrix products (the H200 holds
its 700 W limit on them), model ``mem`` copies a 1 GiB buffer (about 80% of the limit).  ``ipw run`` (the
real CLI, its NVML sensor at its defaults) sends the bundled ipw-core queries to both, one backend each, one
request in flight.  The script then reads the run folder: per backend, each query's GPU energy, its ±90%
interval relative to the energy, and how many GPU readings say they are at the power limit.

Needs torch with CUDA, nvidia-ml-py and ipw's core dependencies.  Never changes clocks, power limits or MIG.

Output: DIR/runs/<run> (the run folder), DIR/capped_e2e.json and .md; the committed run in
bench/evidence/telemetry/gpu/h200-2026-12-04-capped/; the figures are in docs/GPU.md, "At the power limit".
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py
BACKENDS = {"gpu-capped": "cap", "gpu-memory": "mem"}


def serve(port_file: Path, work_s: float, dry_run: bool) -> None:
    """The server: each POST keeps the GPU busy for ``work_s`` with its model's load, then streams "42"
    (``dry_run``: sleeps instead, no torch: the plumbing on a machine without a GPU)."""
    if dry_run:
        steps: dict = {"cap": lambda: time.sleep(0.01), "mem": lambda: time.sleep(0.01)}
        sync = lambda: None  # noqa: E731
    else:
        import torch

        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        src = torch.empty(2**28, device="cuda", dtype=torch.float32)  # 1 GiB
        dst = torch.empty_like(src)
        steps = {"cap": lambda: a @ a, "mem": lambda: dst.copy_(src)}
        sync = torch.cuda.synchronize

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _send(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._send(json.dumps({"object": "list", "data": [{"id": m} for m in steps]}).encode(), "application/json")

        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            step = steps.get(req.get("model"), steps["cap"])
            t0 = time.monotonic()
            while time.monotonic() - t0 < work_s:
                step()
                sync()
            events = [{"choices": [{"index": 0, "delta": {"content": "42"}, "finish_reason": None}]},
                      {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                      {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}]
            body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            self._send(body.encode(), "text/event-stream")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_file.write_text(str(server.server_address[1]))
    server.serve_forever()


CONFIG = """dataset = "ipw-core"
limit = {limit}
warmup = 1
idle_s = 2.0
out_dir = "{out}"

[generation]
max_tokens = 4
"""
BACKEND = """
[[backends]]
name = "{name}"
kind = "openai"
model = "{model}"
base_url = "http://127.0.0.1:{port}/v1"
role = "cloud"
max_retries = 0
timeout_s = 30.0
"""


def summarize(run: Path) -> dict:
    """Per backend: n, median GPU J, median and range of the ±90% half-width / energy, readings at the limit."""
    out: dict = {}
    for line in (run / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        parts = [p for p in json.loads(r.get("energy_parts") or "[]") if p.get("component", "").startswith("gpu")]
        b = out.setdefault(r["backend"], {"energy_j": [], "rel_half_width": [], "at_limit": 0, "notes": set()})
        for p in parts:
            if p.get("energy_j"):
                b["energy_j"].append(p["energy_j"])
                if p.get("uncertainty_j") is not None:
                    b["rel_half_width"].append(p["uncertainty_j"] / p["energy_j"])
            b["at_limit"] += "power limit" in (p.get("note") or "")
            b["notes"].add(p.get("note") or "")
    res = {}
    for name, b in out.items():
        hw = sorted(b["rel_half_width"])
        res[name] = {"n": len(b["energy_j"]), "median_energy_j": statistics.median(b["energy_j"]) if b["energy_j"] else None,
                     "median_rel_half_width": statistics.median(hw) if hw else None,
                     "rel_half_width_range": [hw[0], hw[-1]] if hw else None, "at_power_limit": b["at_limit"],
                     "example_note": sorted(b["notes"], key=len)[-1] if b["notes"] else ""}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=40, help="queries per backend (default 40)")
    ap.add_argument("--work-s", type=float, default=0.15, help="GPU seconds per request (default 0.15)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: the server sleeps instead (the plumbing only)")
    ap.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the server process: its port goes here
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.work_s, args.dry_run)
        return 0
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    port_file = out / "port"
    server = subprocess.Popen([sys.executable, __file__, "--out", str(out), "--serve", str(port_file),
                               "--work-s", str(args.work_s)] + (["--dry-run"] if args.dry_run else []))
    try:
        t0 = time.monotonic()
        while not port_file.exists() and time.monotonic() - t0 < 120:
            time.sleep(0.2)
        port = int(port_file.read_text())
        cfg = out / "capped_e2e.toml"
        cfg.write_text(CONFIG.format(limit=args.limit, out=out / "runs") + "".join(
            BACKEND.format(name=n, model=m, port=port) for n, m in BACKENDS.items()))
        rc = subprocess.call([sys.executable, "-m", "ipw.cli", "run", str(cfg)], cwd=ROOT)
    finally:
        server.terminate()
        server.wait(30)
        port_file.unlink(missing_ok=True)
    run = max((out / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    res = {"rc": rc, "run": run.name, "backends": summarize(run)}
    (out / "capped_e2e.json").write_text(json.dumps(res, indent=1))
    lines = ["| backend | queries | median GPU J | median ±90% / energy | range | readings at the power limit |",
             "|---|---:|---:|---:|---|---:|"]
    for name, b in res["backends"].items():
        lo, hi = b["rel_half_width_range"] or (float("nan"), float("nan"))
        e, hw = b["median_energy_j"] or float("nan"), b["median_rel_half_width"] or float("nan")
        lines.append(f"| {name} | {b['n']} | {e:.1f} | {hw:.2%} | {lo:.2%}-{hi:.2%} | {b['at_power_limit']} |")
    (out / "capped_e2e.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({k: v["example_note"] for k, v in res["backends"].items()}, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
