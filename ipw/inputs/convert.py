"""GGUF -> Hugging Face folder, for engines that cannot read GGUF (vLLM on the CPU).

transformers reads the GGUF (``gguf_file=``) and dequantizes every tensor, but refuses to save a model
it loaded that way ("quantized with GGUF, not serializable").  So the model is rebuilt from the same
config (``from_config``), given the dequantized weights (``load_state_dict``, strict) and saved with
``save_pretrained``, next to the tokenizer that transformers builds from the GGUF (chat template
included).  Weights are stored in float32: dequantized Q4 values are not exact in bfloat16, and vLLM
runs float32 on the CPU for stable greedy output.

Converted folders are cached per machine under ``~/.cache/ipw/models`` (``$IPW_MODEL_CACHE``), keyed by
the GGUF's SHA-256, so the same weights installed in two virtual environments convert once.  A folder
is complete when its ``ipw-convert.json`` exists: conversion writes into a temporary sibling and renames
it, under a file lock (in the cache's ``locks/``), so concurrent runs neither duplicate the work nor see a half-written folder.

Needs torch, transformers, gguf and accelerate (``pip install 'ipw[convert]'``; ``.ci/setup-vllm`` puts
them into ``.venv-vllm``).  ``ipw convert MODEL [OUT_DIR]`` is the command.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ipw.errors import IpwError

MARKER = "ipw-convert.json"
CONVERTER_VERSION = 2  # bump when the output changes: cached folders of other versions are redone


def model_cache_dir() -> Path:
    return Path(os.environ.get("IPW_MODEL_CACHE") or Path.home() / ".cache" / "ipw" / "models").expanduser()


def is_hf_dir(path: str | Path) -> bool:
    path = Path(path).expanduser()
    return path.is_dir() and (path / "config.json").is_file()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def cached_dir_for(gguf: Path, sha256: str | None = None) -> Path:
    sha256 = sha256 or file_sha256(gguf)
    return model_cache_dir() / f"{gguf.stem}-{sha256[:12]}-hf"


def conversion_info(hf_dir: str | Path) -> dict[str, Any] | None:
    """What ``ipw-convert.json`` says about a converted folder (None for any other folder)."""
    try:
        return json.loads((Path(hf_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _require_converters() -> None:
    missing = [m for m in ("torch", "transformers", "gguf", "accelerate") if _find(m) is None]
    if missing:
        raise IpwError(f"converting GGUF needs {', '.join(missing)}: pip install 'ipw[convert]', or run "
                       "bash .ci/setup-vllm and use .venv-vllm/bin/ipw convert")


def _find(module: str) -> Any:
    import importlib.util

    return importlib.util.find_spec(module)


def _convert_into(gguf: Path, target: Path, log: Any) -> dict[str, Any]:
    """The conversion itself (heavy imports); writes config, weights, tokenizer into ``target``."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm loads: the per-tensor dequantization bar
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.monotonic()
    folder, name = str(gguf.parent), gguf.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        log(f"reading the tokenizer from {name}")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        log("dequantizing the weights")
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, OSError) as exc:  # an architecture transformers cannot read from GGUF
        raise IpwError(f"cannot convert {gguf}: transformers {transformers.__version__} says: {exc}") from None
    # transformers drops the GGUF's BOS/EOS flags (Gemma needs its <bos>, or it answers nonsense)
    flags = _gguf_token_flags(gguf)
    for name, value in flags.items():
        setattr(tokenizer, name, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    del loaded
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return {
        "architecture": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": "float32", "chat_template": bool(getattr(tokenizer, "chat_template", None)), **flags,
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "convert_s": round(time.monotonic() - t0, 2),
    }


def _gguf_token_flags(gguf: Path) -> dict[str, bool]:
    """``add_bos_token`` / ``add_eos_token`` as the GGUF's metadata sets them (absent: not set)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    out = {}
    for key in ("add_bos_token", "add_eos_token"):
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None and field.data:
            out[key] = bool(field.parts[field.data[0]][0])
    return out


def _current(info: dict[str, Any] | None, sha: str) -> bool:
    return bool(info and info.get("source_sha256") == sha and info.get("converter_version") == CONVERTER_VERSION)


def convert_gguf(model: str, out_dir: str | Path | None = None, *, force: bool = False,
                 log: Any = None) -> Path:
    """Convert a GGUF (a path or a bundled short name) to a Hugging Face folder and return it.

    Without ``out_dir`` the folder goes to the per-machine cache, and an existing conversion of the
    same file is reused (``force`` redoes it).  With ``out_dir``: the folder must not exist or be
    empty, unless it holds a conversion of the same file (reused) or ``force`` is given."""
    from ipw.inputs.models import resolve_model

    log = log or (lambda msg: print(f"[ipw convert] {msg}", file=sys.stderr, flush=True))
    gguf, mode = resolve_model(model)
    sha = file_sha256(gguf)
    target = Path(out_dir).expanduser().resolve() if out_dir else cached_dir_for(gguf, sha)
    info = conversion_info(target)
    if _current(info, sha) and not force:
        log(f"already converted: {target}")
        return target
    if target.exists() and not force and not info and any(target.iterdir()):
        raise IpwError(f"{target} exists and is not an ipw conversion; choose an empty folder or pass --force")
    if info and info.get("source_sha256") != sha and not force:
        raise IpwError(f"{target} holds a conversion of another file ({info.get('source')}); pass --force to replace it")
    _require_converters()
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    locks = model_cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(target).encode()).hexdigest()[:16]
    with open(locks / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent conversion of the same file finishes first
        if _current(conversion_info(target), sha) and not force:
            return target
        log(f"converting {gguf.name} -> {target} (~20-40 s on 2 cores for a small model)")
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            details = _convert_into(gguf, tmp, log)
            details.update(converter_version=CONVERTER_VERSION, source=str(gguf), source_bytes=gguf.stat().st_size, source_sha256=sha,
                           bundled_name=model if mode is not None else None, mode=mode,
                           converted_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
            (tmp / MARKER).write_text(json.dumps(details, indent=2) + "\n")
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"done in {details['convert_s']} s: {target}")
    return target


def resolve_hf_model(model: str, *, python: str | None = None) -> Path:
    """An HF folder for ``model``: the folder itself, or the cached conversion of a GGUF (path or
    bundled name), converted now when missing.  When this interpreter lacks the converters and
    ``python`` names one that has them (e.g. ``.venv-vllm/bin/python``), the conversion runs there."""
    if is_hf_dir(model):
        return Path(model).expanduser().resolve()
    from ipw.inputs.models import resolve_model

    gguf, _ = resolve_model(model)
    sha = file_sha256(gguf)
    target = cached_dir_for(gguf, sha)
    if _current(conversion_info(target), sha):
        return target
    if python and Path(python).resolve() != Path(sys.executable).resolve() and _find("transformers") is None:
        proc = subprocess.run([python, "-m", "ipw.inputs.convert", str(gguf)], stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise IpwError(f"converting {gguf.name} with {python} failed (exit {proc.returncode}); "
                           f"try: {python} -m ipw.inputs.convert {gguf}")
        return Path(proc.stdout.strip().splitlines()[-1])
    return convert_gguf(model)


def main(argv: list[str] | None = None) -> int:
    """``python -m ipw.inputs.convert MODEL [OUT_DIR]``: prints the folder (used across environments)."""
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m ipw.inputs.convert MODEL [OUT_DIR]", file=sys.stderr)
        return 2
    try:
        print(convert_gguf(*args))
    except IpwError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
