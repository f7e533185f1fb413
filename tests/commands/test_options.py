"""Every command's options are declared once, in ipw/options.py (issue 46): bounds, choices, ``requires=`` and
``excludes=`` are checked in one place, and a broken rule is one line naming the option (and the other one),
exit 2, before anything runs."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from ipw import options as o
from ipw.errors import IpwError

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Mode:
    fast: bool = o.option("--fast", default=False, excludes=("--slow",), help="Fast.")
    slow: bool = o.option("--slow", default=False, help="Slow.")
    level: int = o.option("--level", default=3, low=1, high=5, requires=("--fast",), help="How fast.")
    pids: tuple[int, ...] = o.option("--pid", default=(), low=1, help="Repeatable.")
    out: Path | None = o.option("--out", "-o", help="Where.")


def test_a_group_declares_its_options_from_its_fields():
    fast, slow, level, pids, out = o.options_of(Mode)
    assert (level.name, level.value_type, level.default, level.many, level.flag) == ("level", int, 3, False, "--level")
    assert (pids.value_type, pids.many) == (int, True) and (out.value_type, out.flags) == (Path, ("--out", "-o"))
    assert o.options_of(o.GateOptions)[-2].flag == "--work-gate"  # of --work-gate/--no-work-gate


@pytest.mark.parametrize("mode, message", [
    (Mode(level=4), "--level: only with --fast"),  # given (not the default) without what it requires
    (Mode(fast=True, slow=True), "--fast and --slow: choose one"),
    (Mode(fast=True, level=9), "--level: must be >= 1 and <= 5, got 9"),
    (Mode(pids=(5, 0)), "--pid: must be >= 1, got 0"),  # each value of a repeatable option
])
def test_the_rules_of_a_group(mode, message):
    with pytest.raises(IpwError) as exc:
        o.check_options(mode)
    assert exc.value.message == message and exc.value.exit_code == 2


def test_what_is_given():
    o.check_options(Mode(), Mode(fast=True, level=5, pids=(1,)))
    o.check_options(Mode(level=3))  # the default is not "given": --level 3 alone is what no --level means
    assert o.given(o.RoutingOptions(local=("a",))) == {"local": ("a",), "common_queries": False, "energy_basis": "chip"}


# -- on the command line: one line, exit 2, the flags named, before anything runs -----------------------------


@pytest.mark.parametrize("args, line", [
    (["check", "a", "b", "--blocks", "8"], "--blocks: only with --rerun"),
    (["check", "a", "b", "--limit", "3"], "--limit: only with --rerun"),
    (["check", "a", "b", "--calibrate"], "--calibrate: only with --floor"),
    (["check", "a", "b", "--calibrate", "--rerun", "--floor", "f.json"], "--rerun and --calibrate: choose one"),
    (["check", "a", "b", "--alpha", "1"], "--alpha: must be a finite number > 0 and < 1, got 1.0"),
    (["check", "a", "b", "--energy-basis", "watts"], "--energy-basis: must be one of chip, facility, node, got 'watts'"),
    (["compare", "/no/such/run", "--router-threshold", "0.5"], "--router-threshold: only with --router"),
    (["compare", "/no/such/run", "--format", "xml"], "--format: must be one of table, json, csv, markdown, got 'xml'"),
    (["report", "/no/such/run", "--max-accuracy-loss", "1%"], "--max-accuracy-loss: only with --router"),
    (["route", "score", "/no/such/run", "--folds", "1"], "--folds: must be >= 2, got 1"),
    (["serve", "--route", "router.json"], "--route: only with --local and --cloud"),
    (["serve", "--local", "http://127.0.0.1:1/v1"], "--local: only with --route"),
    (["serve", "--route", "r.json", "--local", "http://a/v1", "--cloud", "http://b/v1", "--upstream", "http://c/v1"],
     "--route and --upstream: choose one"),
    (["serve", "--upstream", "http://127.0.0.1:1/v1", "--port", "70000"], "--port: must be >= 0 and <= 65535, got 70000"),
    (["wrap", "--upstream", "http://127.0.0.1:1/v1", "--role", "edge", "--", "true"],
     "--role: must be one of local, cloud, got 'edge'"),
    (["run", "--repair"], "--repair: only with --resume"),
    (["run", "--shard", "1/2", "--ray", "local"], "--ray and --shard: choose one"),
    (["doctor", "--seconds", "0"], "--seconds: must be a finite number > 0 and <= 3600, got 0.0"),
    (["doctor", "--json", "x.json"], "--json: only with --self-test"),
])
def test_a_broken_rule_is_one_line_naming_the_flags(args, line, run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(*args)
    assert code == 2, (args, out, err)
    assert err == f"error: {line}\n", (args, err)
    assert list(tmp_path.iterdir()) == [], args  # nothing written, nothing started


def test_every_option_of_every_command_is_declared_in_ipw_options():
    """No command declares an option of its own in cli.py: each flag is a field of a group in ipw/options.py."""
    import typer.main

    from ipw import cli

    declared = {flag for group in vars(o).values() if isinstance(group, type) and dataclasses.is_dataclass(group)
                and group is not o.Option for option in o.options_of(group) for flag in option.flags}
    declared |= {d for flag in declared for d in flag.split("/")}

    def commands(group, path=()):
        for name, command in group.commands.items():
            if hasattr(command, "commands"):
                yield from commands(command, (*path, name))
            else:
                yield (*path, name), command

    seen = 0
    for name, command in commands(typer.main.get_command(cli.app)):
        for param in command.params:
            if param.param_type_name == "option":
                seen += 1
                assert set(param.opts) | set(param.secondary_opts) <= declared, (name, param.opts)
    assert seen > 100


def test_the_library_defaults_and_choices_the_options_show_are_the_librarys():
    """A default or a list of choices the library owns is the library's: the option's help and choices say the
    same (ipw/options.py imports nothing heavy, so it cannot import them)."""
    from ipw.analysis import render
    from ipw.analysis.basis import BASES
    from ipw.analysis.routing import ROUTER_ACCURACY

    assert o.ROUTING["router_accuracy"].default is None  # not given: compare's own default
    assert f"default {ROUTER_ACCURACY:g})" in o.ROUTING["router_accuracy"].help
    assert o.ROUTING["energy_basis"].choices == tuple(BASES)
    assert o.by_name(o.options_of(o.GateOptions))["energy_basis"].choices == tuple(BASES)
    assert o.by_name(o.options_of(o.CompareOptions))["format"].choices == render.FORMATS


def test_one_sigterm_handler():
    source = "\n".join(p.read_text() for p in (ROOT / "ipw").rglob("*.py"))
    assert source.count("def sigterm_as_interrupt") == 1 and "_sigterm_as_interrupt" not in source


def test_doctor_runs_without_typer_from_the_same_options():
    """``python -m ipw.commands.doctor`` (docs/ENERGY.md) takes ipw doctor's options, with the same rules."""
    code = ("import sys; sys.modules['typer'] = None\n"
            "from ipw.commands.doctor import main\n"
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert proc.returncode == 0 and "--self-test" in proc.stdout and "--record-trace" in proc.stdout, proc.stderr
    proc = subprocess.run([sys.executable, "-c", code, "--self-test", "--seconds", "-5"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and proc.stderr == "error: --seconds: must be a finite number > 0 and <= 3600, got -5.0\n"
