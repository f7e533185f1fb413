"""docs/guide/layout.md is generated from the package (each module's first docstring sentence, grouped by the
layer it belongs to), and this test fails when the committed page is not what the code says, or when a module
belongs to no layer.  Write it anew with: ``.venv/bin/python tests/project/test_layout_doc.py --write``."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ipw"
PAGE = ROOT / "docs" / "guide" / "layout.md"

#: the data flow, top to bottom (docs/ARCHITECTURE.md draws it; tests/project/test_import_graph.py holds its edges):
#: each layer and the modules or packages (by their path under ipw/) in it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("the shell: the CLI, one module per verb, the Python API",
     ("cli.py", "commands", "options.py", "api.py", "__init__.py")),
    ("inputs: configs, query sets, models", ("inputs", "default.toml", "data")),
    ("running: queries through backends, measured", ("running", "serve")),
    ("grading: answers scored and judged", ("grading", "judge_prompts")),
    ("the run folder: the contract between running and analysis", ("results",)),
    ("the measuring core: windows, splits, the meter", ("metering",)),
    ("engines, and the build of llama.cpp", ("backends",)),
    ("measurement: sensors, estimates, the machine", ("telemetry",)),
    ("analysis: run folders to tables, gates and reports", ("analysis", "templates")),
    ("exports: where operators look", ("export",)),
    ("shared by all layers", ("errors.py", "limits.py", "sanitize.py", "outside.py", "carbon.py")),
]

OTHER = """\
## Beside the package

- `configs/`: example configs; `datasets/`: the bundled set's generator and description; `results/`: run
  output (git-ignored, but for its README).
- `tests/`: the suite, mirroring the package: `tests/<layer>/` for each folder of `ipw/` (`inputs/`, `running/`,
  `grading/`, `results/`, `metering/`, `backends/`, `telemetry/`, `analysis/`, `serve/`, `export/`, and
  `commands/` for the shell), `tests/e2e/` for whole runs through the CLI, `tests/project/` for the repository's
  own rules (layers, tree size, docs, tiers); the shared fakes and helpers beside `tests/conftest.py`, which marks
  the slow tier; `tests/data/` holds small slices of the evidence that tests replay.
- `bench/`: benchmarks, one folder a question, each with a script and its summary (`bench/README.md` is their
  generated index); `bench/evidence/` keeps each measurement's README and summaries, their raw files on the
  branch `evidence`.
- `.ci/`: `setup` (the environment, cached), `run` (what CI runs) and `baseline-default` (the gate's committed
  baseline run).
- `docs/`: the site (`mkdocs.yml`): the guides, and the measured results (`ENERGY.md`, `GPU.md`, `SERVING.md`,
  `MULTIGPU.md`, `PERFORMANCE.md`, `CHECK.md`, `RELIABILITY.md`, ...).
"""


def summary(path: Path) -> str:
    """The first sentence of a module's (or a package's ``__init__``'s) docstring; a data file or folder's name."""
    file = path / "__init__.py" if path.is_dir() else path
    if file.suffix != ".py" or not file.exists():
        return "data read with `importlib.resources`" if path.name != "templates" else "the report's HTML templates"
    doc = ast.get_docstring(ast.parse(file.read_text(encoding="utf-8"))) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    cut = re.search(r"(?<!e\.g)(?<!i\.e)(?<!vs)\.(\s|$)", text)
    text = text[:cut.start() + 1] if cut else text
    return text if len(text) <= 300 else text[:299].rstrip() + "…"


def parts(path: Path) -> list[Path]:
    """A package's modules and subpackages (sorted), each once."""
    return sorted(p for p in path.iterdir() if (p.suffix == ".py" and p.name != "__init__.py")
                  or (p.is_dir() and (p / "__init__.py").exists()))


def render() -> str:
    lines = ["# Code layout", "",
             "Generated from the package by `tests/project/test_layout_doc.py --write` (the test fails when this page is "
             "stale): each layer of the data flow, top to bottom, with what each module says of itself first. "
             "[ARCHITECTURE.md](../ARCHITECTURE.md) tells the flow; `tests/project/test_import_graph.py` holds which layer "
             "may import which.", ""]
    for title, names in LAYERS:
        lines += [f"## {title[0].upper()}{title[1:]}", ""]
        for name in names:
            path = PACKAGE / name
            lines.append(f"- `ipw/{name}{'/' if path.is_dir() else ''}`: {summary(path)}")
            if path.is_dir() and (path / "__init__.py").exists():
                lines += [f"  - `{p.name}{'/' if p.is_dir() else ''}`: {summary(p)}" for p in parts(path)]
        lines.append("")
    return "\n".join(lines) + OTHER


def unplaced() -> list[str]:
    placed = {n for _, names in LAYERS for n in names}
    return sorted(p.name for p in PACKAGE.iterdir()
                  if p.name not in placed and p.name != "__pycache__" and not p.name.endswith(".pyc"))


def test_every_module_has_a_layer():
    assert not unplaced(), f"add these to a layer of tests/project/test_layout_doc.py's LAYERS: {unplaced()}"


def test_the_layout_page_is_current():
    assert PAGE.read_text(encoding="utf-8") == render(), (
        "docs/guide/layout.md is stale: run .venv/bin/python tests/project/test_layout_doc.py --write")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        PAGE.write_text(render(), encoding="utf-8")
    else:
        print(render(), end="")
