"""``ipw --help`` and ``ipw list`` stay fast: heavy modules are imported only by the commands that need them.

Not a timing test (timings live in bench/overhead/startup.py and docs/PERFORMANCE.md): each command runs in a fresh
interpreter, and the modules it imported are read from ``sys.modules`` when it finishes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
from ipw.cli import main
try:
    code = main(sys.argv[2:])
except SystemExit as exc:
    code = exc.code
with open(sys.argv[1], "w") as fh:
    json.dump({"code": code, "modules": sorted(sys.modules)}, fh)
"""

HEAVY_FOR_HELP = ("pandas", "numpy", "pyarrow", "llama_cpp", "matplotlib", "pynvml", "jinja2", "psutil")
HEAVY_FOR_LIST = ("llama_cpp", "matplotlib", "pandas", "pyarrow", "jinja2")


def imported_by(tmp_path, *args: str) -> set[str]:
    out = tmp_path / "modules.json"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(out), *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["code"] == 0, proc.stdout + proc.stderr
    return {m.split(".")[0] for m in data["modules"]}


@pytest.mark.parametrize("args", [("--help",), ("run", "--help"), ("compare", "--help"), ("report", "--help"),
                                  ("check", "--help")])
def test_help_imports_nothing_heavy(tmp_path, args):
    loaded = imported_by(tmp_path, *args)
    assert "ipw" in loaded and "typer" in loaded  # the probe did run the CLI
    heavy = sorted(set(HEAVY_FOR_HELP) & loaded)
    assert not heavy, f"ipw {' '.join(args)} imported {heavy}"


def test_list_imports_no_engine_or_plotting(tmp_path):
    loaded = imported_by(tmp_path, "list")
    assert "ipw" in loaded
    heavy = sorted(set(HEAVY_FOR_LIST) & loaded)
    assert not heavy, f"ipw list imported {heavy}"
