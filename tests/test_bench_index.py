"""bench/README.md indexes every script and folder of bench/, and is what bench/index.py writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import bench_module

ROOT = Path(__file__).resolve().parents[1]
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
    names = [p.name for p in [*BENCH.glob("*.py"), *BENCH.glob("*.sh")]]
    assert len(names) > 30
    for name in names:
        assert f"\n## {name}\n" in readme, name
    for folder in index.folders():
        assert f"- `{folder}/`: " in readme, folder
        assert index.FOLDERS.get(folder), f"bench/{folder}/: say what it holds in bench/index.py FOLDERS"


def test_every_script_says_its_question_command_and_output(index):
    for path in index.scripts():
        e = index.entry(path)
        assert e["question"], path.name
        assert e["output"], f"{path.name}: an 'Output:' paragraph in its docstring (or index.OUTPUT)"
        if not path.name.startswith("_"):
            assert e["run"] and any(f"bench/{path.name}" in line for line in e["run"]), path.name


def test_entry_parses_docstring_and_shell_header(index, tmp_path):
    (tmp_path / "q.py").write_text('"""Does it?\n\nMore.\n\n    .venv/bin/python bench/q.py --a\n'
                                   '        --b\n    (not a command)\n\nOutput: docs/X.md,\n    section "Y".\n"""\n')
    (tmp_path / "s.sh").write_text("#!/usr/bin/env bash\n# Why?\n#\n#   bash bench/s.sh OUT   # the run\n"
                                   "#                      # its comment\n#\n# Output: OUT/x.tgz.\nset -u\n")
    q, s = index.entry(tmp_path / "q.py"), index.entry(tmp_path / "s.sh")
    assert q == {"name": "q.py", "question": "Does it?", "run": [".venv/bin/python bench/q.py --a", "    --b"],
                 "output": 'docs/X.md, section "Y".'}
    assert s["question"] == "Why?" and s["output"] == "OUT/x.tgz."
    assert s["run"] == ["bash bench/s.sh OUT   # the run", " " * 19 + "# its comment"]
