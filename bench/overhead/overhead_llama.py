"""Harness overhead with llama.cpp: ``ipw run`` against a bare llama-cpp-python loop, side by side.

Each round runs two child processes one after the other, in alternating order (bare first in even
rounds, ipw first in odd ones, so a drift in the machine's load hits both sides alike):

- **ipw**: the real CLI, ``ipw run CONFIG`` (one llama-cpp backend, SmolLM2-135M-Instruct in chat mode,
  ``--idle-s 0``, 2 warm-up queries, the default CPU-model sensor with its snapshot thread on), under a
  pseudo-terminal so that the live progress bar renders as it does for a user;
- **bare**: this script in ``--bare-worker`` mode: ``llama_cpp.Llama`` with the same model file,
  ``n_ctx`` and ``n_threads`` (for prefill too: ``n_threads_batch``), a clean context per query
  (``Llama.reset``, as ipw without ``prefix_cache``), the same prompts rendered through the same chat template
  (``Jinja2ChatFormatter`` with the GGUF's template), the same 2 warm-up queries, and the same greedy
  settings (``Llama.generate`` with temp 0, top_k 1, top_p 1, min_p 0, repeat_penalty 1), stopping at
  an end-of-generation token or ``max_tokens``; nothing else (no sensor, no records, no progress bar).

Both sides take the same timestamps around each query (monotonic clock: start of the call, the first
token, the end), so the figures are defined identically:

- decode tokens/s = sum over queries of (completion tokens - 1) / sum of (end - first token);
- wall time of the query loop = end of the last query - start of the first (it contains the harness's
  work between queries: N - 1 of the N gaps);
- start-up = process spawn -> start of the first measured query (interpreter, imports, model load,
  warm-up), reported separately.

The outputs of both sides are compared query by query (greedy decoding: they must be identical).

    .venv/bin/python bench/overhead/overhead_llama.py                          # writes docs/PERFORMANCE.md
    .venv/bin/python bench/overhead/overhead_llama.py --rounds 3 --queries 20 --no-write

Output: docs/PERFORMANCE.md, section "Harness overhead: llama.cpp in a worker process" (``--no-write``:
    printed only; ``--json``: the raw result); GPU rounds in docs/GPU.md and bench/evidence/overhead/overhead-*/.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/_shared.py
from _shared import (DOC, IPW, Child, alternate, config_head, ipw_rows, loads, machine, median, query_stats,
                     write_section)

SECTION = "## Harness overhead: llama.cpp in a worker process"
MODEL = "smollm2-135m"
DECODE_TARGET = 0.97
WALL_TARGET = 1.03


# --- the bare loop ------------------------------------------------------------------------------------

def bare_worker(args) -> int:
    t_start = time.monotonic()
    import llama_cpp
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from ipw.inputs.datasets import load_queries
    from ipw.inputs.models import resolve_model

    prompts = [q.render() for q in load_queries(args.dataset)[: args.queries + args.warmup]]
    warm, prompts = prompts[: args.warmup], prompts[: args.queries]  # ipw warms up on its first queries too
    path, _ = resolve_model(MODEL)
    t_import = time.monotonic()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=args.n_ctx, n_threads=args.n_threads,
                          n_threads_batch=args.n_threads, n_gpu_layers=args.n_gpu_layers, verbose=False)
    model = llm._model
    eos, bos = llm.token_eos(), llm.token_bos()
    fmt = Jinja2ChatFormatter(template=llm.metadata["tokenizer.chat_template"],
                              eos_token=model.token_get_text(eos) if eos != -1 else "",
                              bos_token=model.token_get_text(bos) if bos != -1 else "")
    vocab = model.vocab
    # whether a token ends the generation, asked of llama.cpp once per distinct token (as ipw's backend does)
    is_eog = functools.cache(lambda tok: bool(llama_cpp.llama_vocab_is_eog(vocab, tok)))
    t_load = time.monotonic()

    def one(prompt: str) -> tuple[dict, str]:
        start = time.monotonic()
        text_prompt = fmt(messages=[{"role": "user", "content": prompt}]).prompt
        tokens = llm.tokenize(text_prompt.encode("utf-8"), add_bos=True, special=True)
        if len(tokens) >= 2 and tokens[0] == tokens[1] == bos:
            tokens = tokens[1:]
        llm.reset()  # a clean context per query, as ipw (no KV reuse from the previous prompt)
        llm.set_seed(0)
        out, first = [], None
        for tok in llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            now = time.monotonic()
            if is_eog(tok):
                break
            if first is None:
                first = now
            out.append(tok)
            if len(out) >= args.max_tokens:
                break
        # the answer's text is the engine's work too: ipw's engine ends its call (Completion.end_s) after it
        text = llm.detokenize(out).decode("utf-8", errors="ignore").strip()
        end = time.monotonic()
        return {"start": start, "first": first, "decode_end": end, "end": end, "tokens": len(out)}, text

    for p in warm:
        one(p)
    rows, outputs = [], []
    for p in prompts:
        row, text = one(p)
        rows.append(row)
        outputs.append(text)
    llm.close()
    Path(args.bare_worker).write_text(json.dumps({
        "t_start": t_start, "import_s": t_import - t_start, "load_s": t_load - t_import, "rows": rows,
        "outputs": outputs}), encoding="utf-8")
    return 0


def engine_worker(args) -> int:
    """Side ``inproc`` or ``worker`` (``--engine-side``): ipw's llama.cpp engine (``LlamaCppEngine``) called
    directly in this process, or through ipw's engine worker process and its pipe (``LlamaCppBackend``),
    with the run's generation settings, and nothing of ipw's measuring process (no sensor, record or
    progress).  Between ``bare`` and ``ipw`` they tell which part of ipw costs: the engine's own code,
    the worker process and its round trip, or the measuring process."""
    t_start = time.monotonic()
    from ipw.backends.base import BackendSpec, GenerationSettings
    from ipw.backends.llama_cpp import LlamaCppBackend, LlamaCppEngine
    from ipw.inputs.datasets import load_queries

    prompts = [q.render() for q in load_queries(args.dataset)[: args.queries + args.warmup]]
    warm, prompts = prompts[: args.warmup], prompts[: args.queries]
    spec = BackendSpec(name=MODEL, kind="llama-cpp", model=MODEL, mode="chat",
                       options={"n_threads": args.n_threads, "n_ctx": args.n_ctx, "n_gpu_layers": args.n_gpu_layers})
    engine = LlamaCppEngine(spec) if args.engine_side == "inproc" else LlamaCppBackend(spec)
    settings = GenerationSettings(max_tokens=args.max_tokens, temperature=0.0)
    t_import = time.monotonic()
    engine.load()
    t_load = time.monotonic()
    for p in warm:
        engine.generate(p, settings)
    rows, outputs = [], []
    for p in prompts:
        start = time.monotonic()
        c = engine.generate(p, settings)
        end = time.monotonic()
        rows.append({"start": start, "first": c.first_token_s, "decode_end": c.end_s, "end": end,
                     "tokens": c.completion_tokens})
        outputs.append(c.text)
    engine.close()
    Path(args.bare_worker).write_text(json.dumps({
        "t_start": t_start, "import_s": t_import - t_start, "load_s": t_load - t_import, "rows": rows,
        "outputs": outputs}), encoding="utf-8")
    return 0


# --- one trial of each side ------------------------------------------------------------------------------

def config_toml(args, out_dir: Path) -> str:
    return config_head(args.dataset, out_dir, args.warmup, args.max_tokens, args.queries) + f"""name = "{MODEL}"
kind = "llama-cpp"
model = "{MODEL}"
role = "local"
mode = "chat"
n_threads = {args.n_threads}
n_ctx = {args.n_ctx}
n_gpu_layers = {args.n_gpu_layers}
"""


def bare_cmd(args, out: Path, side: str = "bare") -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--bare-worker", str(out), "--engine-side", side,
            "--queries", str(args.queries),
            "--warmup", str(args.warmup), "--n-threads", str(args.n_threads),
            "--n-gpu-layers", str(args.n_gpu_layers), "--max-tokens", str(args.max_tokens),
            "--n-ctx", str(args.n_ctx), "--dataset", args.dataset]


def bare_result(child: Child, out: Path, load: float, side: str = "bare") -> dict:
    if child.rc != 0:
        raise SystemExit(f"{side} worker failed:\n{child.output()}")
    data = json.loads(out.read_text(encoding="utf-8"))
    stats = query_stats(data["rows"], child.active)
    first = min(r["start"] for r in data["rows"])
    stats.update(side=side, load_avg=load, process_s=child.active(child.spawn, child.end), load_s=data["load_s"],
                 startup_s=child.active(child.spawn, first), cpu_s=child.cpu_s, outputs=data["outputs"])
    return stats


def ipw_result(child: Child, runs: Path, load: float, side: str = "ipw") -> dict:
    if child.rc != 0:
        raise SystemExit(f"ipw run failed:\n{child.output()[-3000:]}")
    (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
    rows, outputs, manifest = ipw_rows(run_dir)
    if any(r["error"] for r in rows):
        raise SystemExit(f"ipw run had errors: {[r['error'] for r in rows if r['error']][:3]}")
    stats = query_stats(rows, child.active)
    backend = manifest["backends"][0]
    first = min(r["start"] for r in rows)
    stats.update(side=side, load_avg=load, process_s=child.active(child.spawn, child.end), load_s=backend["load_s"],
                 startup_s=child.active(child.spawn, first), cpu_s=child.cpu_s, outputs=outputs,
                 sampler_overhead=backend.get("sampler_overhead"))
    return stats


# ``ipw run`` with one part of its measuring process changed (``--sides``), to tell which part costs on a GPU:
# the code runs in the ipw process before its CLI, so the run is otherwise the user's command.
VARIANTS = {
    # no GPU sensor: NVML is never opened (the CPU model only)
    "ipw-nonvml": "from ipw.telemetry import nvml, probe; nvml.NvmlSensor.probe = classmethod(lambda cls, *a, **k: None); "
                  "probe.PLATFORMS = ()",
    # the NVML sampler reading less often: the energy counter every 2 s, the sample buffer at most once a second
    "ipw-slownvml": "from ipw.telemetry import sampler; sampler.DEFAULT_COUNTER_PERIOD_S = 2.0; "
                    "sampler.MIN_SAMPLES_POLL_INTERVAL_S = 1.0",
    # the CPU model reads the worker's CPU time at the window edges only (no 20 ms snapshot thread)
    "ipw-nosnap": "from ipw.telemetry import cpu_model; cpu_model.CpuModelSensor.__init__.__defaults__ = (None, None)",
}
SIDES = ("bare", "bare-again", "inproc", "worker", "ipw", "ipw-nopty", *VARIANTS)


def ipw_cmd(side: str, cfg: Path) -> list[str]:
    if side in VARIANTS:
        return [sys.executable, "-c", f"{VARIANTS[side]}; import sys; from ipw.cli import main; sys.exit(main())",
                "run", str(cfg)]
    return [*IPW, "run", str(cfg)]


def one_round(args, tmp: Path, r: int) -> dict:
    """One process per side (``--sides``: bare and ``ipw run``, and the engine sides of ``engine_worker``):
    taking turns of ``--slice-s`` seconds, or (0) one after the other; who starts rotates between rounds."""
    order = tuple(args.sides[r % len(args.sides):] + args.sides[: r % len(args.sides)])
    outs = {side: tmp / f"{side}-{r}" for side in order}  # a run folder's parent, or a JSON file

    def make(side: str) -> Child:
        if side.startswith("ipw"):  # ipw-nopty: its output not a terminal (no live display), as in CI
            cfg = tmp / f"{side}-{r}.toml"
            cfg.write_text(config_toml(args, outs[side]), encoding="utf-8")
            return Child(ipw_cmd(side, cfg), pty=args.pty and side != "ipw-nopty", cpus=args.cpus)
        # bare-again: a second bare process, the control (how far two runs of the same loop differ)
        return Child(bare_cmd(args, outs[side], "bare" if side.startswith("bare") else side), pty=False,
                     cpus=args.cpus)
    load = loads()
    children = {}
    if args.slice_s > 0:
        for side in order:
            children[side] = make(side)
        alternate([children[side] for side in order], args.slice_s)
    else:
        for side in order:
            children[side] = make(side)
            children[side].wait()
    load = round((load + loads()) / 2, 2)
    return {"order": order, **{side: ipw_result(children[side], outs[side], load, side) if side.startswith("ipw")
                                else bare_result(children[side], outs[side], load, side) for side in order}}


def paired_query_ratio(b: dict, w: dict, key: str) -> float:
    """Median over queries of bare time / ipw time for the same query (a speed ratio, ipw / bare)."""
    ratios = [x / y for x, y in zip(b[key], w[key]) if x and y]
    return median(ratios)


def measure(args) -> dict:
    trials = []
    others = [side for side in args.sides if side not in ("bare", "ipw")]
    with tempfile.TemporaryDirectory(prefix="ipw-overhead-llama-") as tmp_name:
        tmp = Path(tmp_name)
        for r in range(args.rounds):
            pair = one_round(args, tmp, r)
            for side in pair["order"]:
                t = pair[side]
                print(f"round {r + 1} {side:6s}: decode {t['decode_tps']:.1f} tok/s, loop {t['loop_wall_s']:.2f} s, "
                      f"{t['tokens']} tokens, TTFT median {1000 * t['ttft_med_s']:.2f} ms, start-up {t['startup_s']:.2f} s, CPU {t['cpu_s']:.1f} s, "
                      f"load avg {t['load_avg']}", file=sys.stderr, flush=True)
            b, w = pair["bare"], pair["ipw"]
            pair["same_outputs"] = sum(x == y for x, y in zip(b["outputs"], w["outputs"]))
            pair["decode_ratio"] = w["decode_tps"] / b["decode_tps"]
            pair["wall_ratio"] = w["loop_wall_s"] / b["loop_wall_s"]
            pair["query_decode_ratio"] = paired_query_ratio(b, w, "query_decode_s")
            pair["query_time_ratio"] = 1.0 / paired_query_ratio(b, w, "query_s")
            # the engine sides against bare: the same two ratios
            pair["sides"] = {side: {"decode_ratio": pair[side]["decode_tps"] / b["decode_tps"],
                                    "wall_ratio": pair[side]["loop_wall_s"] / b["loop_wall_s"],
                                    "ttft_ms_more": 1000 * (pair[side]["ttft_med_s"] - b["ttft_med_s"]),
                                    "same_outputs": sum(x == y for x, y in zip(b["outputs"], pair[side]["outputs"]))}
                             for side in others}
            print(f"round {r + 1}: decode ratio {pair['decode_ratio']:.4f}, wall ratio {pair['wall_ratio']:.4f} "
                  f"(per query medians: decode {pair['query_decode_ratio']:.4f}, time {pair['query_time_ratio']:.4f}), "
                  f"identical outputs {pair['same_outputs']}/{args.queries}"
                  + "".join(f"; {side}: decode {x['decode_ratio']:.4f}, wall {x['wall_ratio']:.4f}, identical "
                            f"{x['same_outputs']}" for side, x in pair["sides"].items()), file=sys.stderr, flush=True)
            for side in pair["order"]:
                pair[side].pop("outputs")
            trials.append(pair)
    return {"trials": trials, "decode_ratio": median([p["decode_ratio"] for p in trials]),
            "wall_ratio": median([p["wall_ratio"] for p in trials]),
            "query_decode_ratio": median([p["query_decode_ratio"] for p in trials]),
            "query_time_ratio": median([p["query_time_ratio"] for p in trials]),
            "sides": {side: {k: median([p["sides"][side][k] for p in trials])
                             for k in ("decode_ratio", "wall_ratio", "ttft_ms_more")}
                      for side in others}}


def command(args) -> str:
    return (f".venv/bin/python bench/overhead/overhead_llama.py --queries {args.queries} --rounds {args.rounds} "
            f"--n-threads {args.n_threads}")


def table_rows(res: dict) -> list[str]:
    t = res["trials"]
    rows = []
    for i, p in enumerate(t):
        b, w = p["bare"], p["ipw"]
        rows.append(f"| {i + 1} | {'bare, ipw' if i % 2 == 0 else 'ipw, bare'} | {b['decode_tps']:.1f} | "
                    f"{w['decode_tps']:.1f} | **{p['decode_ratio']:.3f}** | {b['loop_wall_s']:.2f} | "
                    f"{w['loop_wall_s']:.2f} | **{p['wall_ratio']:.3f}** | {p['same_outputs']}/{b['n']} | "
                    f"{b['load_avg']}, {w['load_avg']} |")
    return rows


def write_doc(args, res: dict) -> None:
    t = res["trials"]
    med = lambda side, key: median([p[side][key] for p in t])  # noqa: E731
    ok_d = res["decode_ratio"] >= DECODE_TARGET
    ok_w = res["wall_ratio"] <= WALL_TARGET
    from ipw.results import sampler_overheads  # the typed reader: old run folders' keys too

    snapshots = [sampler_overheads(p["ipw"]).get("cpu_model") for p in t]
    snap = [o.cpu_fraction_of_one_core for o in snapshots if o is not None and o.cpu_fraction_of_one_core]
    turns = (f"taking turns of {args.slice_s:g} s (SIGSTOP/SIGCONT: one runs while the other is stopped, so "
             "both meet the same machine load; every duration is reduced to the process's running time), "
             "who goes first alternating between rounds" if args.slice_s > 0 else
             "back to back, in alternating order")
    body = f"""{SECTION}

`ipw run` against a bare llama-cpp-python loop: {args.queries} queries of the bundled set `{args.dataset}`
through SmolLM2-135M-Instruct (Q4_1, chat template from the GGUF), greedy, `max_tokens = {args.max_tokens}`,
`n_ctx = {args.n_ctx}`, `n_threads = {args.n_threads}`, {args.warmup} warm-up queries, `idle_s = 0`, the
default sensor (CPU model with its 20 ms snapshot thread) on, the live progress bar rendering into a
pseudo-terminal. The bare loop (`--bare-worker`) uses the same model file, settings, rendered prompts and
chat template path (`Jinja2ChatFormatter`) and does nothing else. {args.rounds} rounds, each one bare
process and one `ipw run` process {turns}; {machine()}.

| round | order | bare decode tok/s | ipw decode tok/s | decode ratio | bare loop s | ipw loop s | wall ratio | identical outputs | load avg (bare, ipw) |
|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(table_rows(res))}

| measure (median over rounds) | bare | ipw | ratio ipw/bare | target | |
|---|---|---|---|---|---|
| decode tokens/s | {med('bare', 'decode_tps'):.1f} | {med('ipw', 'decode_tps'):.1f} | **{res['decode_ratio']:.3f}** | ≥ {DECODE_TARGET} | {'PASS' if ok_d else 'FAIL'} |
| wall time of the query loop | {med('bare', 'loop_wall_s'):.2f} s | {med('ipw', 'loop_wall_s'):.2f} s | **{res['wall_ratio']:.3f}** | ≤ {WALL_TARGET} | {'PASS' if ok_w else 'FAIL'} |
| start-up: spawn → first measured query (imports, load, {args.warmup} warm-up) | {med('bare', 'startup_s'):.2f} s | {med('ipw', 'startup_s'):.2f} s | | | |
| of which model load | {med('bare', 'load_s'):.2f} s | {med('ipw', 'load_s'):.2f} s | | | |
| whole process | {med('bare', 'process_s'):.2f} s | {med('ipw', 'process_s'):.2f} s | | | |

Ratios are per round (the two processes of a round ran side by side), then the median over rounds.
Decode tokens/s = Σ(completion tokens − 1) / Σ(end of the call − first token); the loop wall time runs from
the start of the first measured query to the end of the last, so it contains ipw's work between queries
(closing and opening the measurement window, building, scoring and fsyncing the record, the progress
bar), N − 1 gaps of N. The snapshot thread used {', '.join(f'{x:.2%}' for x in snap) or 'n/a'} of a core
(manifest `sampler_overhead`). Load average: this machine's 2 cores are shared with other sessions' work,
whose load moves both sides' numbers; the interleaving pairs each ipw process with a bare one under
about the same load.

Reproduce (writes this section):

```bash
{command(args)}
```
"""
    write_section(DOC, SECTION, body)


def cpu_list(text: str) -> set[int]:
    """A CPU list as the kernel writes them ("0-7,16"), or "gpu": the CPUs local to the first NVIDIA GPU
    (its PCI device's ``local_cpulist``), those of this process's affinity only."""
    if text == "gpu":
        try:
            bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
                                 capture_output=True, text=True, check=True).stdout.split()[0].lower()
            text = Path(f"/sys/bus/pci/devices/{bus[-12:]}/local_cpulist").read_text().strip()
        except (OSError, IndexError, subprocess.CalledProcessError) as exc:
            raise argparse.ArgumentTypeError(f"the GPU's local CPUs are not known here: {exc}") from None
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    cpus &= os.sched_getaffinity(0)
    if not cpus:
        raise argparse.ArgumentTypeError(f"no CPU of {text!r} is available to this process")
    return cpus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--n-threads", type=int, default=1)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--n-gpu-layers", type=int, default=0, help="-1: every layer on the GPU (a CUDA build)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dataset", default="ipw-core")
    parser.add_argument("--slice-s", type=float, default=0.5,
                        help="the two processes of a round take turns of this many seconds (0: one after the other)")
    parser.add_argument("--cpus", type=cpu_list, metavar="LIST",
                        help="run both sides on these CPUs only (e.g. 0-7,16; 'gpu': the CPUs local to GPU 0, from "
                             "sysfs), so that neither meets a different socket or core than the other")
    parser.add_argument("--no-pty", dest="pty", action="store_false", help="ipw's stdio not a terminal")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--sides", type=lambda t: t.split(","), default=["bare", "ipw"],
                        help="which processes a round runs, of bare, inproc (ipw's llama.cpp engine called "
                             "directly), worker (the same through ipw's engine worker), ipw (ipw run), "
                             "ipw-nopty (ipw run, its output not a terminal) and the variants of ipw run with "
                             "one part of its measuring process changed (VARIANTS); bare and ipw always")
    parser.add_argument("--bare-worker", help=argparse.SUPPRESS)
    parser.add_argument("--engine-side", default="bare", help=argparse.SUPPRESS)
    parser.add_argument("--from-json", type=Path, help="write the doc from a saved --json result (no run)")
    args = parser.parse_args(argv)
    if args.bare_worker:
        return bare_worker(args) if args.engine_side == "bare" else engine_worker(args)
    if not {"bare", "ipw"} <= set(args.sides) <= set(SIDES):
        parser.error(f"--sides: bare and ipw, and any of {', '.join(SIDES[2:])}; got {','.join(args.sides)}")
    if args.from_json:
        res = json.loads(args.from_json.read_text(encoding="utf-8"))
        args = argparse.Namespace(**(res["args"] | {"no_write": args.no_write, "json": None}))
    else:
        res = measure(args)
        res["args"] = vars(args) | {"json": str(args.json) if args.json else None,
                                     "cpus": sorted(args.cpus) if args.cpus else None}
    if args.json:
        args.json.write_text(json.dumps(res, indent=1), encoding="utf-8")
    print(json.dumps({k: res[k] for k in ("decode_ratio", "wall_ratio", "sides") if k in res}))
    if not args.no_write:
        write_doc(args, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
