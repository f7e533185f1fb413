"""Usage errors are one line and exit 2 with every typer that pyproject.toml allows.

typer >= 0.22 brings its own copy of click (``typer._click``), whose exceptions are not click's, and
typer < 0.18 mishandles click >= 8.2 (help crashes, a missing argument passes None): so the range is
pinned, and the same cases run with the installed typer (in-process; the newest allowed when the
venv is fresh) and with the oldest allowed, 0.18.0 with the newest click, installed once by pip into
~/.cache/ipw/typer-<version> (skipped when pip cannot reach the index).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OLDEST = "0.18.0"

# args -> (exit code, a fragment of the one line on stderr, or of stdout for 0)
CASES = {
    "bare": ([], 0, "Usage: ipw"),
    "help": (["--help"], 0, "Usage: ipw"),
    "version": (["--version"], 0, "ipw 0."),
    "bad type": (["run", "--limit", "ten"], 2, "Invalid value for '--limit'"),
    "bad float": (["run", "--idle-s", "abc"], 2, "Invalid value for '--idle-s'"),
    "unknown option": (["run", "--bogus"], 2, "No such option"),
    "unknown command": (["nosuchcommand"], 2, "No such command"),
    "missing argument": (["compare"], 2, "Missing argument"),
    "missing second argument": (["check", "only-one"], 2, "Missing argument"),
}


def _check(name: str, code: int, out: str, err: str) -> None:
    want_code, fragment, = CASES[name][1:]
    assert code == want_code, (name, code, out, err)
    assert "Traceback" not in out + err and "locals" not in err, (name, err)
    if want_code == 0:
        assert fragment in out, (name, out)
        assert err == "", (name, err)
    else:
        assert err.startswith("error: ") and err.count("\n") == 1, (name, err)
        assert fragment in err, (name, err)
        assert re.search(r"\(see: ipw( \w+)? --help\)", err), (name, err)


@pytest.mark.parametrize("name", list(CASES))
def test_usage_with_the_installed_typer(name, run_cli):
    code, out, err = run_cli(*CASES[name][0])
    _check(name, code, out, err)


def test_pyproject_pins_the_tested_range():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"typer>={OLDEST.rsplit(".", 1)[0]},<0.30"' in text


@pytest.fixture(scope="module")
def oldest_typer() -> Path:
    target = Path.home() / ".cache" / "ipw" / f"typer-{OLDEST}"
    if not (target / "typer").is_dir():
        try:
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            "--target", str(target), f"typer=={OLDEST}", "click"],
                           check=True, capture_output=True, timeout=300)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            pytest.skip(f"cannot install typer {OLDEST} with pip: {exc}")
    return target


def test_usage_with_the_oldest_allowed_typer(oldest_typer):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(oldest_typer), str(ROOT)])}
    code = ("import sys, typer, click; from ipw.cli import main\n"
            "assert typer.__file__.startswith(sys.argv[1]), typer.__file__\n"
            "sys.exit(main(sys.argv[2:]))")
    for name, (args, _, _) in CASES.items():
        proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code, str(oldest_typer), *args],
                              capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
        _check(name, proc.returncode, proc.stdout, proc.stderr)
