"""The two test tiers (tests/conftest.py, issue 57): a test that starts a process is marked slow at collection,
from its code, its helpers and its fixtures; one that starts a process unmarked fails; the fast tier
(``pytest -m "not slow"``) keeps most of the suite."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import SLOW_KEYS, starts_process

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def _helper_that_starts():
    return subprocess.run([sys.executable, "-c", "pass"], check=True)


class _Server:
    def start(self):
        _helper_that_starts()


def test_a_process_is_found_in_the_code_its_helpers_and_classes():
    def direct():
        subprocess.Popen(["true"])

    def through_a_helper():
        return _helper_that_starts()

    def through_a_class():
        _Server().start()

    def pure():
        return sorted([3, 1, 2])

    assert starts_process(direct) and starts_process(through_a_helper) and starts_process(through_a_class)
    assert not starts_process(pure) and not starts_process(len)


def test_every_listed_slow_test_exists():
    """A SLOW_TESTS entry whose module or test was renamed would leave that test in the fast tier unnoticed."""
    gone = []
    for key in SLOW_KEYS:
        module, _, name = key.partition("::")
        path = next(TESTS.rglob(module), TESTS / module)  # the suite mirrors the package: the module in its folder
        test = name.partition("[")[0]
        if not path.exists() or (test and not re.search(rf"^def {test}\(", path.read_text(encoding="utf-8"), re.M)):
            gone.append(key)
    assert not gone


TIERED = '''
import importlib
import subprocess
import sys

import pytest


def start():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.fixture
def server():
    start()
    yield


def test_unit():
    assert sum([1, 2]) == 3


def test_direct():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_fixture(server):
    pass


@pytest.mark.llama
def test_marked():
    pass


def test_hidden():
    importlib.import_module("subprocess").run(["true"], check=True)
'''


def test_the_fast_tier_leaves_out_the_process_starters_and_fails_one_it_missed(tmp_path):
    """A copy of tests/conftest.py with a module of five tests, run as ``-m "not slow"``: the test that starts
    a process by a name the collection cannot see fails with the rule; the others are in their tier."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text((TESTS / "conftest.py").read_text(encoding="utf-8"))
    (tmp_path / "tests" / "test_tiered.py").write_text(TIERED)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers\nmarkers =\n  slow\n  llama\n  vllm\n"
                                         "  ray\n  package\n")
    fast = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "not slow", "-rA", "tests"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = fast.stdout
    assert fast.returncode == 1, out
    assert re.search(r"PASSED tests/test_tiered.py::test_unit\b", out), out
    assert "ERROR at teardown of test_hidden" in out, out
    assert "tests/test_tiered.py::test_hidden started a process (subprocess.Popen" in out, out
    assert "2 passed, 3 deselected, 1 error" in out, out
    slow = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "slow", "--collect-only",
                           "-q", "tests"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert slow.stdout.split("\n\n")[0].split() == [f"tests/test_tiered.py::test_{name}"
                                                   for name in ("direct", "fixture", "marked")], slow.stdout


def _collected(*args: str) -> int:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=600).stdout
    return int(re.search(r"^(\d+)(?:/\d+)? tests? collected", out, re.M).group(1))


def test_the_fast_tier_holds_most_of_the_suite():
    """The inner loop (README) runs at least 60% of the tests (issue 57)."""
    every, fast = _collected(), _collected("-m", "not slow")
    assert fast >= 0.6 * every, (fast, every)
