"""Table 3 of docs/PEERS.md (issue 59): NVIDIA AIPerf 0.13 drives a llama-server at 1, 16 and 64 in flight,
straight to it and through ``ipw serve`` in front of it; AIPerf's own GPU energy figures (``--gpu-telemetry
pynvml``: J per request, mJ per output token, over its profiling phase) against ipw's per-request energy and the
reference (the NVML counter read by bench/telemetry/gpu_counter.py, a process of its own) over the same span.

    python3 bench/peers/aiperf_serving.py tokenizer --gguf MODEL.gguf --out DIR   # a local HF tokenizer from the GGUF
    python3 bench/peers/aiperf_serving.py run --url http://127.0.0.1:PORT --server-pid PID --tokenizer DIR --out DIR \\
        [--levels 1,16,64] [--requests 64,256,512] [--deadline-s 240] [--gpu-telemetry pynvml]
    python3 bench/peers/tables.py aiperf DIR                                     # the table from DIR's files

AIPerf needs a tokenizer to make its synthetic prompts, and the device has no network: ``--tokenizer builtin``
loads tiktoken's o200k_base, which tiktoken downloads on first use, so ``tokenizer`` writes the model's own BPE
tokenizer (vocabulary, merges, chat template) from the GGUF's metadata into a folder that ``--tokenizer`` loads.
Output token counts are the server's (``--use-server-token-count``).

``run``: one ``ipw serve --upstream URL`` (its own run folder, ``--idle-s 1``: each AIPerf run is one of its
sessions); per level, AIPerf against the server, then against the proxy.  Each AIPerf run's span is its
profiling phase as AIPerf recorded it (the first request's start to the last response's end, wall-clock ns),
put on the monotonic clock of ipw and of the counter by the offset between the two clocks read at the start.

Output: DIR/aiperf/<path>-c<N>/ (AIPerf's artifacts), DIR/ipw-serve/ (ipw serve's run folder), DIR/runs.json
(per AIPerf run: path, level, requests, its span on both clocks, its command and exit status, its log tail),
DIR/meta.json (versions, the DCGM check, what failed); the table in docs/PEERS.md, evidence in bench/evidence/peers/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py
DCGM_URLS = ("http://localhost:9400/metrics", "http://localhost:9401/metrics")  # AIPerf's default GPU telemetry


def tokenizer(gguf_path: Path, out: Path) -> None:
    """A HuggingFace tokenizer folder (tokenizer.json, tokenizer_config.json) from a GGUF's gpt2-style BPE."""
    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    fields = GGUFReader(str(gguf_path)).fields

    def value(key: str) -> Any:
        return fields[key].contents() if key in fields else None

    if value("tokenizer.ggml.model") != "gpt2":
        raise SystemExit(f"{gguf_path}: tokenizer {value('tokenizer.ggml.model')!r}, only gpt2-style BPE is converted")
    tokens = value("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in value("tokenizer.ggml.merges")]
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    # digits one by one, then GPT-2's byte-level split: llama.cpp's 'smollm' pre-tokenizer (SmolLM2's own)
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    bpe.decoder = decoders.ByteLevel()
    types = value("tokenizer.ggml.token_type")
    special = [t for t, kind in zip(tokens, types) if kind == 3]  # llama.cpp's CONTROL tokens
    bpe.add_special_tokens(special)
    out.mkdir(parents=True, exist_ok=True)
    bpe.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192,
              "bos_token": tokens[value("tokenizer.ggml.bos_token_id")],
              "eos_token": tokens[value("tokenizer.ggml.eos_token_id")],
              "unk_token": tokens[value("tokenizer.ggml.unknown_token_id")],
              "chat_template": value("tokenizer.chat_template"), "source": gguf_path.name}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    print(f"tokenizer: {len(tokens)} tokens, {len(merges)} merges, {len(special)} special, from {gguf_path.name} -> {out}")


def dcgm_check() -> dict[str, str]:
    """What AIPerf's default GPU telemetry (a DCGM exporter's Prometheus endpoint) finds on this machine, and
    whether DCGM's programs (which would serve one) are installed at all."""
    found = {name: shutil.which(name) or "not installed" for name in ("dcgm-exporter", "nv-hostengine", "dcgmi")}
    for url in DCGM_URLS:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                found[url] = f"HTTP {r.status}, {len(r.read())} bytes"
        except Exception as e:  # refused, absent, timed out: what there is to say is the error itself
            found[url] = f"{type(e).__name__}: {e}"
    return found


def versions(aiperf: list[str]) -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("ipw", "nvidia-ml-py", "transformers", "tokenizers", "gguf"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "absent"
    probe = subprocess.run([*aiperf, "--version"], capture_output=True, text=True, timeout=120)
    out["aiperf"] = (probe.stdout or probe.stderr).strip().splitlines()[-1:][0] if (probe.stdout or probe.stderr) else "?"
    return out


def span_ns(folder: Path) -> tuple[int, int, int] | None:
    """(first request's start, last response's end, requests) of AIPerf's profiling phase, wall-clock ns."""
    path = folder / "profile_export.jsonl"
    if not path.exists():
        return None
    starts, ends = [], []
    with path.open(encoding="utf-8") as f:
        for line in f:
            m = json.loads(line).get("metadata", {})
            if m.get("benchmark_phase", "profiling") == "profiling" and m.get("request_end_ns"):
                starts.append(int(m["request_start_ns"]))
                ends.append(int(m["request_end_ns"]))
    return (min(starts), max(ends), len(starts)) if starts else None


def aiperf_once(args: argparse.Namespace, aiperf: list[str], path: str, url: str, level: int, requests: int,
                timeout_s: float) -> dict[str, Any]:
    folder = args.out / "aiperf" / f"{path}-c{level}"
    cmd = [*aiperf, "profile", "--model", args.model, "--url", url, "--endpoint-type", "chat", "--streaming",
           "--concurrency", str(level), "--request-count", str(requests),
           "--synthetic-input-tokens-mean", str(args.input_tokens), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(args.output_tokens), "--output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--tokenizer", str(args.tokenizer), "--use-server-token-count",
           "--gpu-telemetry", args.gpu_telemetry, "--ui", "none", "--random-seed", "1", "--artifact-dir", str(folder)]
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        rc, log = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        # the partial output comes back as bytes on a timeout, even with text=True
        out = b"".join(x if isinstance(x, bytes) else (x or "").encode() for x in (e.stdout, e.stderr))
        rc, log = None, f"timed out after {timeout_s:.0f} s\n" + out.decode(errors="replace")
    wall_s = time.monotonic() - t0
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "aiperf-console.txt").write_text(log)
    offset_s = time.time() - time.monotonic()  # wall - monotonic now: AIPerf's wall-clock span onto ipw's clock
    span = span_ns(folder)
    row: dict[str, Any] = {"path": path, "concurrency": level, "requests_asked": requests, "url": url, "rc": rc,
                           "wall_s": round(wall_s, 3), "folder": str(folder.relative_to(args.out)),
                           "command": " ".join(cmd), "log_tail": log.strip().splitlines()[-3:] if log else []}
    if span:
        row.update({"start_ns": span[0], "end_ns": span[1], "requests_done": span[2],
                    "start_s": span[0] / 1e9 - offset_s, "end_s": span[1] / 1e9 - offset_s, "clock_offset_s": offset_s})
    print(f"{path} c={level}: rc {rc}, {row.get('requests_done', 0)}/{requests} requests, {wall_s:.1f} s "
          f"(span {row['end_s'] - row['start_s']:.2f} s)" if span else f"{path} c={level}: rc {rc}, no requests "
          f"recorded, {wall_s:.1f} s: {row['log_tail']}", flush=True)
    return row


def run(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "bench" / "serving"))
    from serve_overhead import proxy_url, start_proxy  # ipw serve as bench/serving starts it

    deadline = time.monotonic() + args.deadline_s
    args.out.mkdir(parents=True, exist_ok=True)
    aiperf = args.aiperf.split() if args.aiperf else [sys.executable, "-m", "aiperf"]
    meta: dict[str, Any] = {"dcgm_endpoints": dcgm_check(), "gpu_telemetry": args.gpu_telemetry,
                            "versions": versions(aiperf), "failed": {},
                            "settings": {k: str(v) for k, v in vars(args).items()}}
    print(f"AIPerf's default GPU telemetry (DCGM exporter): {meta['dcgm_endpoints']}", flush=True)
    proxy = start_proxy(args.url, args.server_pid, str(args.out / "ipw-serve"), [])
    proxy_base = proxy_url(proxy).removesuffix("/v1")
    rows = []
    try:
        for level, n in zip(args.levels, args.requests):
            for path, url in (("direct", args.url), ("ipw", proxy_base)):
                left = deadline - time.monotonic()
                if left < args.min_run_s:
                    meta["failed"][f"{path}-c{level}"] = f"skipped: {left:.0f} s left before the deadline"
                    print(f"{path} c={level}: skipped, {left:.0f} s left", flush=True)
                    continue
                rows.append(aiperf_once(args, aiperf, path, url, level, n, left - 5))
                if rows[-1]["rc"] != 0:
                    meta["failed"][f"{path}-c{level}"] = f"rc {rows[-1]['rc']}: {rows[-1]['log_tail']}"
                time.sleep(args.gap_s)  # past ipw serve's --idle-s: each AIPerf run is a session of its own
    finally:
        proxy.terminate()
        proxy.wait(timeout=120)
    (args.out / "runs.json").write_text(json.dumps(rows, indent=1))
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer")
    t.add_argument("--gguf", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("--url", required=True, help="the llama-server, e.g. http://127.0.0.1:8089")
    r.add_argument("--server-pid", type=int, required=True, help="its process (ipw serve's --upstream-pid)")
    r.add_argument("--tokenizer", type=Path, required=True, help="a folder made by the tokenizer command")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--model", default="smollm2")
    r.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    r.add_argument("--requests", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 512],
                   help="AIPerf's --request-count per level")
    r.add_argument("--input-tokens", type=int, default=64)
    r.add_argument("--output-tokens", type=int, default=32)
    r.add_argument("--gpu-telemetry", default="pynvml", help="AIPerf's --gpu-telemetry (pynvml: NVML in-process)")
    r.add_argument("--aiperf", default="", help="the command that runs AIPerf (default: this python3 -m aiperf)")
    r.add_argument("--deadline-s", type=float, default=240.0)
    r.add_argument("--min-run-s", type=float, default=20.0, help="start no AIPerf run with less time left")
    r.add_argument("--gap-s", type=float, default=2.0)
    a = ap.parse_args()
    if a.cmd == "tokenizer":
        tokenizer(a.gguf, a.out)
    else:
        run(a)


if __name__ == "__main__":
    main()
