"""The documentation: the README's two commands, the MkDocs site built from docs/ (mkdocs.yml) in strict
mode, links the site builder does not check (README.md's), docs/ holding the prose only, every raw evidence
path (bench/evidence/...) and every bench script a page names existing, and every command, option and config
key documented on the site's pages."""

from __future__ import annotations

import glob
import importlib.util
import re
from pathlib import Path

import click
import pytest
import typer.main

from ipw.inputs import config as ipw_config
from ipw.backends.base import backend_kinds, backend_options
from ipw.cli import app

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
EVIDENCE = ROOT / "bench" / "evidence"
# the site's own pages: the quick start, the user guide and docs/*.md
PAGES = sorted([*DOCS.glob("*.md"), *(DOCS / "guide").glob("*.md")])

RUN_COMMAND = "bash .ci/setup && .venv/bin/ipw run"
TEST_COMMAND = ("bash .ci/setup --dev && .venv/bin/ruff check ipw tests bench && .venv/bin/mypy && "
                ".venv/bin/python -m pytest -q -ra")

LINK = re.compile(r"\[(?:[^\]]|\][^(])*\]\(([^)\s]+)\)")


def _prose(text: str, inline_code: bool = False) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks, inline code emptied unless asked for."""
    lines, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            lines.append(line if inline_code else re.sub(r"`[^`]*`", "``", line))
    return lines


def _links(path: Path) -> list[str]:
    return [m.group(1) for line in _prose(path.read_text(encoding="utf-8")) for m in LINK.finditer(line)]


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (mkdocs.yml's slugify, pymdownx.slugs, makes the site's
    the same): lower case, every character but letters, digits, _, - and spaces dropped, a space a -."""
    out = set()
    for line in _prose(path.read_text(encoding="utf-8"), inline_code=True):
        m = re.match(r"^#{1,6} (.*)", line)
        if m:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def test_readme_two_commands_and_ci():
    """The README's two commands, verbatim, and .ci/run runs the second."""
    text = README.read_text(encoding="utf-8")
    assert f"\n{RUN_COMMAND}\n" in text
    assert f"\n{TEST_COMMAND}\n" in text
    # CI runs it naming the 25 slowest tests; its failure stops CI
    assert f"\n{TEST_COMMAND} --durations=25 || exit 1\n" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250, "the README is the five-minute read; the rest goes to docs/"


def test_links_resolve():
    """Every relative link of README.md and of the site's pages reaches a file or folder that exists; a page's
    stays inside docs/ (the site has nothing else); a README link to a heading reaches a heading."""
    broken = []
    for source in [README, *PAGES]:
        for url in _links(source):
            if re.match(r"^[a-z][a-z0-9+.-]*:", url) or url.startswith("#"):
                continue  # http:, mailto:; anchors on the same page: mkdocs checks the pages' own
            path, _, anchor = url.partition("#")
            target = (source.parent / path).resolve()
            where = f"{source.name if source == README else source.relative_to(DOCS)}: {url}"
            if source != README and DOCS not in target.parents:
                broken.append(f"{where} (outside docs/: write it as a code span)")
            elif not target.exists():
                broken.append(f"{where} (no such file or folder)")
            elif source == README and anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")


def test_docs_holds_prose_only():
    """docs/ is the site's pages and the figures they show (a PNG under docs/guide/img/ that a page embeds,
    each under 200 kB), nothing else, under 1 MB (issue 46): the raw evidence (run folders, traces,
    tarballs) is in bench/evidence/, which a page names as a code span."""
    shown = {(page.parent / m.group(1)).resolve() for page in PAGES
             for m in IMAGE.finditer(page.read_text(encoding="utf-8"))}
    files = [p for p in DOCS.rglob("*") if p.is_file()]
    figures = sorted(p for p in files if p.suffix == ".png" and p.parent == DOCS / "guide" / "img")
    assert sorted(set(files) - set(figures)) == PAGES, sorted(set(files) ^ set(PAGES) ^ set(figures))
    assert {p.resolve() for p in figures} <= shown, "a figure no page shows"
    assert all(p.stat().st_size < 200_000 for p in figures)
    assert sum(p.stat().st_size for p in files) < 1_000_000


EVIDENCE_PATH = re.compile(r"bench/evidence/[\w./*-]*")


def test_evidence_paths_exist():
    """Every bench/evidence/ path that README.md or a page names (a folder, a file or a glob) exists, so a
    figure leads to its raw files; bench/evidence/README.md has a line for every evidence folder."""
    missing = []
    for source in [README, *PAGES]:
        for n, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
            for m in EVIDENCE_PATH.finditer(line):
                path = m.group(0).rstrip(".,;:")
                if not glob.glob(str(ROOT / path)):
                    missing.append(f"{source.relative_to(ROOT)}:{n}: {path}")
    assert not missing, "\n".join(missing)
    index = (EVIDENCE / "README.md").read_text(encoding="utf-8")
    folders = sorted(p.relative_to(EVIDENCE).as_posix() for p in EVIDENCE.glob("*/*") if p.is_dir())
    assert len(folders) > 20
    unlisted = [f for f in folders if f"\n- `{f}/`: " not in index]
    assert not unlisted, f"bench/evidence/README.md: no line for {unlisted}"


BENCH_SCRIPT = re.compile(r"bench/[\w/]*\.(?:py|sh)\b")


def test_bench_script_paths_exist():
    """Every bench script that README.md, a page or an evidence folder's README names (``bench/scale/million.py``)
    is there: the scripts live in bench/'s question folders, and a page that names one by an old path fails."""
    missing = []
    for source in [README, *PAGES, *EVIDENCE.rglob("README.md")]:
        for n, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
            missing += [f"{source.relative_to(ROOT)}:{n}: {m.group(0)}" for m in BENCH_SCRIPT.finditer(line)
                        if not (ROOT / m.group(0)).is_file()]
    assert not missing, "\n".join(missing)


def _commands(cmd: click.Command, path: list[str]):
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, [*path, name])
    else:
        yield " ".join(["ipw", *path]), cmd


def test_every_command_and_option_documented():
    """Each command of `ipw` and each of its long options is named on a page of the site."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in PAGES)
    missing = []
    for name, cmd in _commands(typer.main.get_command(app), []):
        if name not in text:
            missing.append(name)
        missing += [f"{name} {opt}" for param in cmd.params for opt in param.opts
                    if opt.startswith("--") and opt not in text]
    assert not missing, missing


def test_every_config_key_documented():
    """Each key a config accepts (top level, [generation], [[backends]] of every kind, [judge]) is named on a
    page of the site, as `key` or `key = ...` (a table as [table])."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in PAGES)
    keys = {*ipw_config._TOP, *ipw_config._GENERATION, *ipw_config._BACKEND, *ipw_config._RAY_RESOURCES,
            *ipw_config._FACILITY, *ipw_config._JUDGE}
    for kind in backend_kinds():
        keys |= set(backend_options(kind))
    missing = sorted(k for k in keys
                     if not re.search(rf"`{k}`|\b{k} = |\[\[?{k}\]\]?", text))
    assert not missing, missing


needs_mkdocs = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                                  reason="mkdocs is not installed (the dev extra installs it)")


def _build(config_file: Path, site_dir: Path) -> None:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    build(load_config(config_file=str(config_file), site_dir=str(site_dir), strict=True))


@needs_mkdocs
def test_site_builds_strict(tmp_path, monkeypatch):
    """What .ci/run does: the site, strict (a warning fails it)."""
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    monkeypatch.chdir(ROOT)  # the quick start's snippets are read from README.md, relative to the root
    _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert (tmp_path / "site" / "guide" / "python-api" / "index.html").is_file()


_GOOD = {
    "index.md": "# Home\n\nSee [a](guide/a.md#part-one) and [a file](files/x.json).\n",
    "guide/a.md": "# A\n\n## Part one\n\nBack [home](../index.md).\n",
    "guide/b.md": "# B\n",
    "files/x.json": "{}\n",
}
_NAV = "nav:\n  - Home: index.md\n  - Guide:\n      - A: guide/a.md\n      - B: guide/b.md\n"


@needs_mkdocs
@pytest.mark.parametrize("case", ["good", "missing page", "missing anchor", "outside docs", "folder",
                                  "nav to nothing", "page not in nav"])
def test_strict_fails_on_broken_links(tmp_path, monkeypatch, case):
    """mkdocs.yml's settings, on a scratch site: a broken link between pages, to an anchor, out of docs/ or
    to a folder, a nav entry without its page and a page the nav leaves out each fail the build."""
    from mkdocs.exceptions import Abort

    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    monkeypatch.chdir(tmp_path)
    pages, nav = dict(_GOOD), _NAV
    if case == "missing page":
        pages["guide/b.md"] += "\nSee [c](c.md).\n"
    elif case == "missing anchor":
        pages["guide/b.md"] += "\nSee [a](a.md#part-two).\n"
    elif case == "outside docs":
        pages["guide/b.md"] += "\nSee [the script](../../bench/scale/million.py).\n"
    elif case == "folder":
        pages["guide/b.md"] += "\nSee [the files](../files/).\n"
    elif case == "nav to nothing":
        nav += "      - C: guide/c.md\n"
    elif case == "page not in nav":
        pages["guide/c.md"] = "# C\n"
    for name, text in pages.items():
        (tmp_path / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "docs" / name).write_text(text, encoding="utf-8")
    settings = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "\ndocs_dir: docs\n" in settings and "\nnav:\n" in settings
    (tmp_path / "mkdocs.yml").write_text(settings[:settings.index("\nnav:\n") + 1] + nav, encoding="utf-8")
    if case == "good":
        _build(tmp_path / "mkdocs.yml", tmp_path / "site")
        assert (tmp_path / "site" / "files" / "x.json").is_file()
    else:
        with pytest.raises(Abort, match="strict mode"):
            _build(tmp_path / "mkdocs.yml", tmp_path / "site")
