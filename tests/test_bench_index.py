"""bench/README.md indexes every script of every question folder and every other folder of bench/, and is what
bench/index.py writes."""

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
