"""bench/README.md indexes every script of every question folder and every other folder of bench/, and is what
bench/index.py writes; the scripts reach ipw through its public names only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import bench_module

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def index():
    with bench_module("index") as mod:
        yield mod


def test_committed_readme_is_up_to_date(index):
    assert (BENCH / "README.md").read_text(encoding="utf-8") == index.render(), \
        "bench/README.md is stale: .venv/bin/python bench/index.py > bench/README.md"


def test_every_script_and_folder_is_listed(index):
    readme = (BENCH / "README.md").read_text(encoding="utf-8")
    names = [p.relative_to(BENCH).as_posix() for p in [*BENCH.rglob("*.py"), *BENCH.rglob("*.sh")]
             if "evidence" not in p.relative_to(BENCH).parts]
    assert len(names) > 30
    for name in names:
        assert f"\n### {name}\n" in readme, name
    for q in index.questions():
        assert f"\n## {q}/: {index.QUESTIONS[q]}\n" in readme, q
    for folder in index.folders():
        assert f"- `{folder}/`: " in readme, folder
        assert index.FOLDERS.get(folder), f"bench/{folder}/: say what it holds in bench/index.py FOLDERS"


def test_every_script_is_in_a_question_folder(index):
    """A script sits in the folder of the question it answers (the five of bench/evidence/), one level down;
    only the index and the shared helpers stay at the top of bench/."""
    assert sorted(p.name for p in index.scripts()) == ["_shared.py", "index.py"]
    assert set(index.questions()) == set(index.QUESTIONS) == {p.name for p in (BENCH / "evidence").iterdir()
                                                               if p.is_dir()}
    deeper = [p for q in index.QUESTIONS for p in [*(BENCH / q).rglob("*.py"), *(BENCH / q).rglob("*.sh")]
              if p.parent != BENCH / q]
    assert deeper == []


def test_every_script_says_its_question_command_and_output(index):
    scripts = index.all_scripts()
    assert len(scripts) > 30
    for path, name in scripts:
        e = index.entry(path, name)
        assert e["question"], name
        assert e["output"], f"{name}: an 'Output:' paragraph in its docstring (or index.OUTPUT)"
        if not path.name.startswith("_"):
            assert e["run"] and any(f"bench/{name}" in line for line in e["run"]), name


def test_entry_parses_docstring_and_shell_header(index, tmp_path):
    (tmp_path / "q.py").write_text('"""Does it?\n\nMore.\n\n    .venv/bin/python bench/gate/q.py --a\n'
                                   '        --b\n    (not a command)\n    python bench/scale/q.py\n\n'
                                   'Output: docs/X.md,\n    section "Y".\n"""\n')
    (tmp_path / "s.sh").write_text("#!/usr/bin/env bash\n# Why?\n#\n#   bash bench/gate/s.sh OUT   # the run\n"
                                   "#                           # its comment\n#\n# Output: OUT/x.tgz.\nset -u\n")
    q, s = index.entry(tmp_path / "q.py", "gate/q.py"), index.entry(tmp_path / "s.sh", "gate/s.sh")
    # a command that names another folder's q.py is not this script's
    assert q == {"name": "gate/q.py", "question": "Does it?",
                 "run": [".venv/bin/python bench/gate/q.py --a", "    --b"], "output": 'docs/X.md, section "Y".'}
    assert s["question"] == "Why?" and s["output"] == "OUT/x.tgz."
    assert s["run"] == ["bash bench/gate/s.sh OUT   # the run", " " * 24 + "# its comment"]


# The private ipw names a bench script may use, as (script, name): ipw/telemetry/estimator.py's calibration, which
# bench/telemetry/uncertainty_fit.py refits on recordings (the integrals it also reads are public:
# ipw/telemetry/integrals.py).  Nothing else: a script that needs more of ipw
# gets a public, documented function or method for it (Meter.split_due, check.pool_blocks, runner.run_query...).
PRIVATE_ALLOWED = {("telemetry/uncertainty_fit.py", "_calibrate")}


def _private(name: str) -> bool:
    return len(name) > 1 and name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes and methods, and the names and attributes it assigns."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
    return {n for n in out if _private(n)}


def _private_uses(tree: ast.AST, ipw_private: set[str]) -> set[str]:
    """The private ipw names a script uses: imported from ipw (``from ipw.x import _y``, ``ipw._x``), an attribute
    that ipw defines (``meter._periods``, ``Meter._settle = ...``; ``self._x`` only when the script does not define
    ``_x`` itself), or a string naming one that a call gets (``getattr(cls, "_open")``)."""
    own = _defined(tree)
    uses = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ipw":
            uses |= {part for part in node.module.split(".") if _private(part)}
            uses |= {alias.name for alias in node.names if _private(alias.name)}
        elif isinstance(node, ast.Import):
            uses |= {part for alias in node.names if alias.name.split(".")[0] == "ipw"
                     for part in alias.name.split(".") if _private(part)}
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in ipw_private:
            mine = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") and node.attr in own
            if not mine:
                uses.add(node.attr)
        elif isinstance(node, ast.Call):
            uses |= {a.value for a in [*node.args, *(k.value for k in node.keywords)]
                     if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value in ipw_private}
    return uses


def test_bench_scripts_use_no_private_ipw_name(index):
    """A benchmark measures what ipw offers, through public (or documented) names: a private one can change under
    it unseen, and the figures it wrote would no longer say what the code does.  Only PRIVATE_ALLOWED is let
    through, and each of its entries must still be used (an entry no script needs goes)."""
    ipw_private = set().union(*(_defined(ast.parse(p.read_text(encoding="utf-8"))) for p in (ROOT / "ipw").rglob("*.py")))
    assert {"_periods", "_settle_all", "_calibrate"} <= ipw_private  # the scan sees ipw's private names
    used = {(name, private) for path, name in index.all_scripts() if path.suffix == ".py"
            for private in _private_uses(ast.parse(path.read_text(encoding="utf-8")), ipw_private)}
    assert sorted(used - PRIVATE_ALLOWED) == [], "bench scripts use private ipw names: add a public, documented one"
    assert sorted(PRIVATE_ALLOWED - used) == [], "PRIVATE_ALLOWED: entries no script uses any more"


def test_private_uses_finds_each_way_of_reaching_a_private_name():
    ipw_private = {"_periods", "_settle", "_open", "_pool", "_x"}
    code = """
from ipw.analysis.check import _pool, check_runs
from ipw.metering import _hidden
import ipw._internal.mod
meter._periods.popleft()
Meter._settle = settle
getattr(Handler, "_open")
llm._model                      # not an ipw name
class Mine:
    def __init__(self):
        self._x = 1             # the script's own
    def f(self):
        return self._x, other._x
"""
    assert _private_uses(ast.parse(code), ipw_private) == {"_pool", "_hidden", "_internal", "_periods", "_settle",
                                                            "_open", "_x"}
    clean = "from ipw.metering.meter import Meter\nclass A:\n    def f(self):\n        self._x = 1\n        return self._x\n"
    assert _private_uses(ast.parse(clean), ipw_private) == set()
