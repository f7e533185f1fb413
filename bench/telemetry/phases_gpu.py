"""Prefill/decode split of NVML energy on a real GPU (issue 13): a Llama-3-8B-shaped model with random
weights (transformers, no download), prompts of 64-8192 tokens, 16-128 output tokens; prints JSON.

    PYTHONPATH=. python3 bench/telemetry/phases_gpu.py > phases.json     # an NVIDIA GPU, torch and transformers

Output: JSON on stdout; the figures are in docs/guide/prefill-decode.md.
"""
import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ipw.analysis.fit import fit_linear
from ipw.telemetry.phases import record_phases, sensor_splits
from ipw.telemetry.base import total_energy
from ipw.telemetry.nvml import NvmlSensor

cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=16384)
torch.manual_seed(0)
with torch.device("cuda"):
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(cfg).eval()
sensor = NvmlSensor()


def query(prompt_len, out_len):
    ids = torch.randint(0, 32000, (1, prompt_len), device="cuda")
    torch.cuda.synchronize()
    token = sensor.begin()
    start = time.monotonic()
    with torch.no_grad():
        out = model(ids, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        first = time.monotonic()
        past = out.past_key_values
        for _ in range(out_len - 1):
            out = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    end = time.monotonic()
    pending = sensor.end(token)
    while not pending.ready():
        time.sleep(0.02)
    readings = pending.result()
    ph = record_phases(readings, sensor_splits([sensor], [token], [pending], first))
    return {"prompt_tokens": prompt_len, "completion_tokens": out_len, "ttft_s": first - start, "latency_s": end - start,
            "energy_j": total_energy(readings).energy_j, **ph}


for _ in range(3):
    query(512, 8)  # warm-up
time.sleep(2)
rows = []
lens = [64, 256, 1024, 2048, 4096, 8192]
for rep in range(2):
    for i, p in enumerate(lens):
        for k in (16, 128) if (i + rep) % 2 else (128, 16):
            rows.append(query(p, k))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
ok = [r for r in rows if r["prefill_energy_j"] is not None]
f = lambda key: [r[key] for r in ok]  # noqa: E731
summary = {
    "n": len(rows), "with_phases": len(ok),
    "max_abs_conservation_error_j": max(abs(r["prefill_energy_j"] + r["decode_energy_j"] - r["energy_j"]) for r in ok),
    "unresolved": sum(bool(r["prefill_unresolved"]) for r in ok),
    "j_per_prefill_token": sum(f("prefill_energy_j")) / sum(f("prompt_tokens")),
    "j_per_decode_token": sum(f("decode_energy_j")) / sum(f("completion_tokens")),
    "energy_fit": fit_linear(f("prompt_tokens"), f("completion_tokens"), f("energy_j")).__repr__(),
    "latency_fit": fit_linear(f("prompt_tokens"), f("completion_tokens"), f("latency_s")).__repr__(),
    "prefill_fit": fit_linear(f("prompt_tokens"), f("completion_tokens"), f("prefill_energy_j")).__repr__(),
    "overhead": sensor.overhead(),
}
print(json.dumps({"rows": rows, "summary": summary}, indent=1, default=str))
sensor.close()
