"""Metrics that render themselves (issue 31, item 4): a metric is one row of ``ipw.analysis.metrics.METRICS``,
with its format; ``ipw run``'s tables, ``compare``, ``check`` and the report show a new row with no other
edit, and every number goes through ``ipw.analysis.fmt``."""

import json
import math

import pytest
from rich.console import Console

from openai_stub import Stub, stub_config
from runfolders import write_run

from ipw.analysis import fmt, metrics
from ipw.analysis.stats import Estimate
from ipw.sanitize import md_text

NEW = metrics.Metric("j_per_correct", "J/correct answer", "J", "lower", "queries with energy and a score",
                     lambda g: metrics._ratio(g["energy_j"], g["correct"]), energy=True, needs="correct")


@pytest.fixture
def new_metric(monkeypatch):
    """The metric table with one more row, and nothing else changed."""
    monkeypatch.setattr(metrics, "METRICS", metrics.METRICS + (NEW,))
    monkeypatch.setitem(metrics.BY_NAME, NEW.name, NEW)
    return NEW


def test_a_new_metric_shows_in_compare_check_and_the_report(tmp_path, run_cli, new_metric):
    from ipw.analysis import report

    run = write_run(tmp_path / "r", "r1", {
        "a": {"correct": [1, 0, 1, 1], "energy": [2.0, 4.0, 6.0, 8.0], "quality": "measured"},
        "b": {"correct": [1, 1, 1, 1], "energy": [1.0, 1.0, 1.0, 1.0]}})  # estimated energy
    code, out, err = run_cli("compare", run, "--format", "json")
    assert code == 0, err
    got = {b["label"]: b["metrics"]["j_per_correct"] for b in json.loads(out)["backends"]}
    assert got["a"]["value"] == pytest.approx(20 / 3) and got["b"]["value"] == pytest.approx(1.0)
    assert got["a"]["lo"] <= 20 / 3 <= got["a"]["hi"]
    shown = fmt.estimate(Estimate(**got["a"]))  # "6.67 [lo, hi]"
    code, out, err = run_cli("compare", run, "--format", "markdown")
    assert code == 0, err
    assert f"| J/correct answer | {md_text(shown)} | {md_text('1 [1, 1]')} |" in out.splitlines()

    md = tmp_path / "check.md"
    code, out, err = run_cli("check", run, run, "--fail-if", "j_per_correct:+5%", "--markdown", md)
    assert code == 0, out + err
    rows = [line for line in md.read_text().splitlines() if "| j_per_correct |" in line]
    assert [r.split(" | ")[:6] for r in rows] == [
        ["| a", "j_per_correct", "j_per_correct:+5%", "6.67", "6.67", "+0.00% [+0.00, +0.00]"],
        ["| b", "j_per_correct", "j_per_correct:+5%", "1", "1", "+0.00% [+0.00, +0.00]"]]
    code, out, err = run_cli("check", run, run, "--fail-if", "j_per_correct:+5pp")
    assert code == 2 and "j_per_correct takes a threshold in %" in out + err

    ctx = report.build([run])
    (metrics_table,) = [t for t in ctx["tables"] if t["key"] == "metrics"]
    cells = next(r for r in metrics_table["rows"] if r[0]["text"] == "J/correct answer")
    assert cells[1]["text"] == shown
    assert [c["est"] for c in cells] == [False, False, True]  # b's energy is estimated, and the metric rests on it
    assert (f"| J/correct answer | {md_text(shown)} | {md_text('1 [1, 1]')} *(estimated)* |"
            in report.render_markdown(ctx).splitlines())


def _stub_run(tmp_path, run_cli, *args):
    tmp_path.mkdir(exist_ok=True)
    stub = Stub()
    try:
        data = tmp_path / "four.jsonl"
        data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Say {i}", "answer": "42"}) + "\n"
                                for i in range(4)))
        cfg = stub_config(tmp_path / "run.toml", data, stub.base_url, out_dir=tmp_path / "res",
                          backend_extra="remote = true")  # energy: the API estimate
        code, out, err = run_cli("run", cfg, *args)
    finally:
        stub.close()
    assert code == 0, out + err
    (run,) = (tmp_path / "res").iterdir()
    return run, out


def test_ipw_run_full_table_has_every_metric_the_summary_the_marked_ones(tmp_path, run_cli, new_metric):
    run, out = _stub_run(tmp_path, run_cli, "--full-table")
    code, cmp_out, err = run_cli("compare", run, "--format", "json")
    assert code == 0, err
    m = json.loads(cmp_out)["backends"][0]["metrics"]
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.splitlines()
            if line.count("│") == 3}
    for x in metrics.METRICS:  # every metric that has a value, the new one included, as compare shows it
        if m[x.name]["value"] is not None:
            nan = float("nan")
            e = Estimate(*(nan if m[x.name][k] is None else m[x.name][k] for k in ("value", "lo", "hi")))
            assert rows[x.label] == fmt.estimate(e, x.format), x.name
    assert "J/correct answer" in rows

    run2, summary = _stub_run(tmp_path / "again", run_cli)
    header = next(line for line in summary.splitlines() if "backend" in line and "┃" in line)
    assert [h.strip() for h in header.split("┃")[1:-1]] == (
        ["backend"] + [x.label for x in metrics.METRICS if x.summary] + ["energy"])
    assert "J/correct answer" not in summary  # not marked for the summary


def test_run_summary_fits_100_columns(tmp_path):
    """Three backends with long names and long numbers: every value and interval whole, within 100 columns."""
    from ipw.analysis.compare import compare
    from ipw.commands.run import summary_table

    energy = [0.00123, 0.00456, 0.00789, 0.00234, 0.00567, 0.00891]
    run = write_run(tmp_path, "wide", {
        name: {"correct": [1, 0, 1, 1, 0, 1], "energy": [e * k for e in energy],
               "error": [None, "timeout", None, None, None, None]}
        for k, name in enumerate(("SmolLM2-135M-Q8", "Qwen2.5-0.5B@c4", "llama-3.2-1b-q4"), start=1)})
    c = compare([run])
    console = Console(width=100, record=True)
    console.print(summary_table(c))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 100
    assert "…" not in text
    for b in c.backends:
        for x in metrics.METRICS:
            if x.summary:
                value, _, interval = fmt.estimate(c.metrics[b.label][x.name], x.format).partition(" ")
                assert value in text and interval in text, (b.label, x.name)
                assert not math.isnan(c.metrics[b.label][x.name].value)


def test_one_formatter():
    """Shares as percentages (changes in pp), other numbers with 3 significant digits, unknowns n/a."""
    assert fmt.value(0.625, fmt.PERCENT) == "62.5%" and fmt.PERCENT.change_unit == "pp"
    assert fmt.value(0.000123456) == "0.000123" and fmt.NUMBER.change_unit == "%"
    assert fmt.value(123456789, fmt.COUNT) == "123456789"
    assert fmt.value(None) == fmt.value(float("nan")) == fmt.estimate(Estimate(float("nan"), 0, 1)) == "n/a"
    assert fmt.estimate(Estimate(0.5, 0.25, 0.75), fmt.PERCENT) == "50.0% [25.0%, 75.0%]"
    assert fmt.estimate(Estimate(-0.1, -0.2, 0.05), sign=True) == "-0.1 [-0.2, +0.05]"
    assert fmt.estimate(Estimate(2.0, float("nan"), float("nan"))) == "2"
    assert fmt.change_interval(1.234, -0.5, 3.0, "pp") == "+1.23pp [-0.50, +3.00]"
    assert fmt.change(float("inf"), "%") == "+inf%"
    assert {m.name: m.change_unit for m in metrics.METRICS if m.format.percent} == {
        "accuracy": "pp", "error_rate": "pp", "prefill_energy_share": "pp", "win_tie_rate": "pp"}
