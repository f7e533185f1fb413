"""bench/_shared.py: the one helper that rewrites a section of a docs page, and the helpers the bench
scripts share (no script carries its own copy)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import bench_module

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
# every Python script: the question folders' (bench/gate/, bench/overhead/, ...) and the top level's
SCRIPTS = sorted(p for p in BENCH.rglob("*.py") if "evidence" not in p.relative_to(BENCH).parts)


@pytest.fixture(scope="module")
def shared():
    with bench_module("_shared") as mod:
        yield mod


DOC = """# Performance

Intro.

## First

old first
more

## Second

old second

### a subsection of Second

kept with Second

## Third

third
"""


def test_write_section_replaces_a_middle_section(shared, tmp_path):
    doc = tmp_path / "P.md"
    doc.write_text(DOC)
    shared.write_section(doc, "## Second", "## Second\n\nnew second\n\n\n")
    text = doc.read_text()
    assert "old second" not in text and "kept with Second" not in text  # up to the next "## ", not "### "
    assert text == DOC.replace("old second\n\n### a subsection of Second\n\nkept with Second\n\n", "new second\n\n")
    # the same call again changes nothing
    shared.write_section(doc, "## Second", "## Second\n\nnew second\n")
    assert doc.read_text() == text


def test_write_section_replaces_the_last_section_and_appends_a_new_one(shared, tmp_path):
    doc = tmp_path / "P.md"
    doc.write_text(DOC)
    shared.write_section(doc, "## Third", "## Third\n\nnew third")
    assert doc.read_text() == DOC.replace("\nthird\n", "\nnew third\n")
    shared.write_section(doc, "## Fourth", "## Fourth\n\nfourth\n")
    assert doc.read_text().endswith("new third\n\n## Fourth\n\nfourth\n")


def test_write_section_starts_a_missing_page(shared, tmp_path):
    doc = tmp_path / "NEW.md"
    shared.write_section(doc, "## S", "## S\n\nbody\n")
    assert doc.read_text() == "# Performance\n\n## S\n\nbody\n"


def test_machine_line(shared):
    line = shared.machine()
    assert re.match(r"\d+ logical CPUs, .+, Python \d+\.\d+", line)


def test_child_runs_in_the_folder_given(shared, tmp_path):
    c = shared.Child([sys.executable, "-c", "import os; print(os.getcwd())"], pty=False, cwd=tmp_path)
    c.wait()
    assert c.rc == 0 and c.output().strip() == str(tmp_path)
    c = shared.Child([sys.executable, "-c", "import os; print(os.getcwd())"], pty=False)
    c.wait()
    assert c.output().strip() == str(ROOT)


def test_no_bench_script_carries_its_own_section_rewriter():
    """Replacing the text between a heading and the next ``## `` is done by ``_shared.write_section`` only."""
    own = [p.name for p in SCRIPTS
           if p.name != "_shared.py" and re.search(r"""re\.search\(r["']\^## """, p.read_text(encoding="utf-8"))]
    assert own == []


def test_no_bench_script_imports_helpers_from_another_script():
    """Shared helpers come from _shared, not from overhead_llama (a benchmark)."""
    users = [p.name for p in SCRIPTS
             if re.search(r"^\s*(from overhead_llama import|import overhead_llama)", p.read_text(encoding="utf-8"), re.M)]
    assert users == []


def test_config_head_is_a_run_config_top_that_a_backend_completes(shared, tmp_path):
    """The benchmarks' one run-config top (overhead_http, overhead_llama, harness_breakdown): ipw reads it, with
    a backend's keys after its ``[[backends]]``; ``limit`` only where given."""
    import tomllib

    from ipw.inputs.config import load_config

    text = shared.config_head("ipw-core-default", tmp_path / "runs", 1, 8, limit=3)
    cfg = tmp_path / "c.toml"
    cfg.write_text(text + 'name = "s"\nkind = "llama-cpp"\nmodel = "smollm2-135m"\n', encoding="utf-8")
    config = load_config(cfg)
    assert (config.limit, config.warmup, config.idle_s, config.generation.max_tokens) == (3, 1, 0, 8)
    assert "limit" not in tomllib.loads(shared.config_head("d", tmp_path, 0, 8) + 'name = "s"\n')
