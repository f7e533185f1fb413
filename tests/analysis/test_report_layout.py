"""The report opens with the answer (per-backend table, accuracy against energy, routing summary) and
ends with provenance; runs from different hardware get a banner (HTML and Markdown)."""

import json

import pytest

pytest.importorskip("jinja2")
pytest.importorskip("matplotlib")

from ipw.analysis import report
from test_report import fixture_runs, write_run

LOCAL_CLOUD = [{"name": "cloud-xl", "role": "cloud", "skill": 0.9, "j_per_token": 5.0},
               {"name": "local-mid", "role": "local", "skill": 0.7, "j_per_token": 1.0}]


def _set_hardware(run, **fields):
    path = run / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["hardware"].update(fields)
    path.write_text(json.dumps(manifest))


def test_the_answer_comes_first_and_provenance_last(tmp_path):
    runs = fixture_runs(tmp_path / "runs", n=12)
    html_path, md_path = tmp_path / "r.html", tmp_path / "r.md"
    report.write(runs, html_path, md_path)
    html, md = html_path.read_text(), md_path.read_text()
    order = [html.index(x) for x in ("<h2>The answer", "J/query", 'alt="', "oracle energy saved",
                                     "<h2>Compare in detail", "<h2>What was run, and on what")]
    assert order == sorted(order)
    assert html.index("fixture.toml") > html.index("<h2>What was run")  # the config is provenance
    first_figure = html[html.index("<h2>The answer"):html.index("<h2>Compare in detail")]
    assert "accuracy" in first_figure.lower() and "<img" in first_figure  # accuracy against energy
    assert md.index("| J/query |") < md.index("oracle energy saved") < md.index("### What was run")
    assert md.index("### What was run") < md.rindex("Test CPU")  # (the banner names it too: gpus differ)


def test_banner_for_runs_from_different_hardware(tmp_path):
    a = write_run(tmp_path / "runs", "run-a", LOCAL_CLOUD, 8, quality="estimated", power=False, seed=1)
    b = write_run(tmp_path / "runs", "run-b", LOCAL_CLOUD[1:], 8, quality="estimated", power=False, seed=2)
    for run in (a, b):
        _set_hardware(run, cpu_model="Xeon", cpu_isa="avx2+avx512f", machine="x86_64")
    ctx = report.build([a, b])
    assert ctx["hardware_banner"] is None  # the same machine: no banner
    html = report.render_html(ctx)
    assert "Different hardware" not in html

    _set_hardware(b, cpu_isa="avx2")  # the same CPU name, an AVX2-only machine
    ctx = report.build([a, b])
    banner = ctx["hardware_banner"]
    assert banner and "run-a: Xeon (avx2+avx512f)" in banner and "run-b: Xeon (avx2)" in banner
    assert "differ in cpu_isa" in banner and "not comparable" in banner
    html = report.render_html(ctx)
    assert html.index("Different hardware") < html.index("<h2>The answer")
    md = report.render_markdown(ctx)
    assert md.splitlines()[2].startswith("> **Different hardware.**")
    assert md.count("not comparable") == 1  # the banner, not again among the notes
    # ipw compare says the same, first among its notes and in JSON
    from ipw.analysis.compare import compare
    from ipw.analysis.render import to_dict

    c = compare([a, b])
    assert c.notes[0] == banner and to_dict(c)["hardware_note"] == banner


def test_coverage_within_an_envelope_or_budget_is_marked_estimated(tmp_path):
    """Which backends fit a power envelope or an energy budget rests on their energy: with estimated
    energy those coverage cells carry the mark (the report's tag), row by row for the envelope."""
    ctx = report.build(fixture_runs(tmp_path / "runs", n=12))
    tables = {t["key"]: t for t in ctx["tables"]}
    envelope = tables["power_envelope"]["rows"]
    assert [row[2]["est"] for row in envelope] == [row[3]["text"] == "estimated" for row in envelope]
    assert any(row[2]["est"] for row in envelope)
    assert all(row[1]["est"] for row in tables["energy_budget"]["rows"] if row[1]["text"] != "n/a")


@pytest.mark.parametrize("a,b,differ", [
    ({"cpu_model": "X", "gpus": []}, {"cpu_model": "X"}, None),  # no gpus key: unknown, not different
    ({"cpu_model": "X", "cpu_isa": "avx2"}, {}, None),  # a run without hardware: unknown
    ({"cpu_model": "X", "cpu_isa": "avx2"}, {"cpu_model": "X", "cpu_isa": "avx512"}, "cpu_isa"),
    ({"cpu_model": "X", "gpus": []}, {"cpu_model": "X", "gpus": [{"name": "H200"}]}, "gpus"),
])
def test_hardware_note_names_only_what_is_known_to_differ(a, b, differ):
    from ipw.telemetry.hardware import hardware_note

    note = hardware_note({"a": [a], "b": [b]})
    if differ is None:
        assert note is None
    else:
        assert f"differ in {differ}," in note and ("GPUs H200" in note) == (differ == "gpus")
