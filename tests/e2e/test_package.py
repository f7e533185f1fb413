"""A real package: the wheel, installed into a fresh venv outside the checkout, runs ``ipw list`` and a
one-query ``ipw run`` from a directory outside the checkout, so every bundled file (query set, default
config, API energy table) must come from the installed package, never from the source tree.

The wheel is built from a copy of the package's sources (pyproject.toml, README.md, ipw/), so nothing
is written into the checkout.  Dependencies come from the package index (the pip cache makes them
fast after the first time); llama-cpp-python from the wheel this environment was installed from (or
the per-machine cache of .ci/setup); the model is the SmolLM2 GGUF of this environment, by path.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.package, pytest.mark.llama, pytest.mark.timeout(600)]


def llama_wheel() -> Path | None:
    """The llama-cpp-python wheel this environment was installed from."""
    try:
        dist = importlib.metadata.distribution("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return None
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    path = Path(unquote(urlparse(url).path))
    if url.startswith("file:") and path.suffix == ".whl" and path.is_file():
        return path
    from ipw.backends.llama_build import cache_key
    from ipw.telemetry.cpu_isa import cpu_flags

    cache = Path(os.environ.get("IPW_WHEEL_CACHE", Path.home() / ".cache" / "ipw" / "wheels"))
    wheels = sorted((cache / cache_key(dist.version, cpu_flags())).glob(f"llama_cpp_python-{dist.version}-*.whl"))
    return wheels[0] if wheels else None


def run(cmd: list, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path):
    from ipw.inputs.models import resolve_model

    wheel_llama = llama_wheel()
    if wheel_llama is None:
        pytest.skip("no llama-cpp-python wheel to install (run bash .ci/setup)")
    gguf, _ = resolve_model("smollm2-135m")

    src = tmp_path / "src"  # what the sdist holds
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "ipw", src / "ipw", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, src], cwd=tmp_path)
    (wheel,) = dist.glob("ipw-*.whl")

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel, wheel_llama],
        cwd=tmp_path)

    work = tmp_path / "work"  # neither the checkout nor the source copy
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    ipw = venv / "bin" / "ipw"
    check = ("import ipw.inputs.config, ipw.inputs.datasets, ipw.grading.judge, ipw.telemetry.api_estimate as api\n"
             "from ipw.inputs.resources import resource_path\n"
             "ipw.inputs.config.load_config(None); api.ApiEnergyEstimate.load(); ipw.grading.judge.load_prompt('pairwise-v1', 'pairwise')\n"
             "assert resource_path('templates', 'report.html.j2').is_file()\n"
             "print(ipw.inputs.datasets.DATASETS_DIR)\n")
    where = run([venv / "bin" / "python", "-c", check], cwd=work, env=env)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout  # the installed copy

    listed = run([ipw, "list"], cwd=work, env=env).stdout
    assert "ipw-core-default" in listed and "533" in listed and "24" in listed  # 485 scored + 48 chat

    out = work / "res"
    run([ipw, "run", "--limit", "1", "--backend", f"llama-cpp:{gguf}", "--warmup", "0", "--idle-s", "0",
         "--out", out], cwd=work, env=env, timeout=300)
    (manifest_path,) = out.glob("*/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    assert manifest["status"] == "complete" and manifest["dataset"]["name"] == "ipw-core-default"
    assert manifest["dataset"]["n_queries"] == 1
    (record,) = [json.loads(line) for line in (manifest_path.parent / "records.jsonl").read_text().splitlines()]
    assert record["error"] is None and record["energy_quality"] != "unavailable"
