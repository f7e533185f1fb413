"""One metric contract (issue 20): on the same run folder, ``ipw run``'s final table, ``compare --format
json``, ``check`` against itself and the report's numbers agree metric by metric, errors included."""

import json
import re

import pytest

from openai_stub import Stub, stub_config
from runfolders import write_run


def _compare(run_cli, run) -> dict:
    code, out, err = run_cli("compare", run, "--format", "json")
    assert code == 0, err
    return {b["label"]: b["metrics"] for b in json.loads(out)["backends"]}


def _shown(e: dict, key: str) -> str:
    """Compare's JSON estimate as every table shows it: the metric's format (``ipw.analysis.fmt``)."""
    from ipw.analysis import fmt
    from ipw.analysis.metrics import BY_NAME
    from ipw.analysis.stats import Estimate

    return fmt.estimate(Estimate(e["value"], e["lo"], e["hi"]), BY_NAME[key].format)


def _check_levels(run_cli, run, tmp_path) -> dict:
    md = tmp_path / "self.md"
    names = ["accuracy:-2pp", "error_rate:+2pp", "energy_per_query:+5%", "ipj:-5%", "j_per_token:+10%",
             "ttft_p50:+20%"]
    code, out, err = run_cli("check", run, run, "--markdown", md, *[a for n in names for a in ("--fail-if", n)])
    assert code == 0, out + err
    levels = {}
    for line in md.read_text().splitlines():
        if line.startswith("| ") and not line.startswith("| backend"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cells[2] == "exact":  # the work gate's token counts and errors (tests/analysis/test_check.py)
                continue
            assert cells[3] == cells[4]  # against itself
            levels[(cells[0], cells[1])] = cells[3]
    return levels


ALIAS = {"accuracy": "accuracy", "error_rate": "error_rate", "energy_per_query": "energy_per_query_j",
         "ipj": "ipj", "j_per_token": "j_per_output_token", "ttft_p50": "ttft_p50_s"}


def _agree(compared: dict, levels: dict) -> None:
    """check's baseline of each gated metric is compare's value, as the metric table formats it."""
    from ipw.analysis import fmt
    from ipw.analysis.metrics import BY_NAME

    for (backend, name), level in levels.items():
        key = ALIAS[name]
        assert level == fmt.value(compared[backend][key]["value"], BY_NAME[key].format), (backend, name)


def test_run_table_compare_check_and_report_agree(tmp_path, run_cli):
    from ipw.analysis import report

    stub = Stub()
    stub.modes = ["ok", "ok", "500", "ok", "ok", "ok", "500", "ok"]  # 2 of 8 queries fail
    try:
        data = tmp_path / "eight.jsonl"
        data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Say {i}", "answer": "42"}) + "\n"
                                for i in range(8)))
        cfg = stub_config(tmp_path / "run.toml", data, stub.base_url, out_dir=tmp_path / "res",
                          backend_extra="remote = true")  # energy: the API estimate
        code, out, err = run_cli("run", cfg)
    finally:
        stub.close()
    assert code == 0, out + err
    (run,) = (tmp_path / "res").iterdir()
    compared = _compare(run_cli, run)
    m = compared["stub"]
    assert m["error_rate"]["value"] == 0.25 and m["errors"]["value"] == 2
    # the final table of ipw run: the same estimates, formatted; each value over its interval
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if re.match(r"\W*stub\W", line))
    values, intervals = lines[i].split("│")[2:-2], lines[i + 1].split("│")[2:-2]
    shown = [_shown(m[key], key) for key in ("accuracy", "energy_per_query_j", "ipj", "errors")]
    assert [f"{v.strip()} {x.strip()}".strip() for v, x in zip(values, intervals)] == shown, lines[i:i + 2]
    _agree(compared, _check_levels(run_cli, run, tmp_path))
    ctx = report.build([run])
    assert {b["label"]: b["metrics"] for b in ctx["backends"]} == compared


def test_failed_and_unmeasured_queries_count_the_same_everywhere(tmp_path, run_cli):
    """Errored queries count as incorrect (accuracy, IPJ); a query without energy is missing from the
    energy metrics, never 0 J; repeats are averaged first."""
    from ipw.analysis import report

    run = write_run(tmp_path / "r", "r1", {
        # the timed-out query's score (1) is ignored: it counts 0
        "a": {"correct": [1, 1, 1, 0, 1], "energy": [1.0, None, 2.0, 3.0, 2.0], "ttft": [0.1, 0.2, None, 0.4, 0.3],
              "error": [None, None, "timeout", None, None]},
        "b": {"correct": [1, 0, 1, 1, 0], "energy": [0.5, 0.5, 1.0, 1.0, 2.0]},
    }, repeats=2)
    compared = _compare(run_cli, run)
    a = compared["a"]
    assert a["accuracy"]["value"] == pytest.approx(0.6)
    assert a["error_rate"]["value"] == pytest.approx(0.2)
    assert a["energy_per_query_j"]["value"] == pytest.approx(2.0)  # over the 4 queries with energy
    assert a["ipj"]["value"] == pytest.approx(0.6 / 2.0)
    assert a["ttft_p50_s"]["value"] == pytest.approx(0.2)  # lower median of the 4 known TTFTs
    _agree(compared, _check_levels(run_cli, run, tmp_path))
    assert {b["label"]: b["metrics"] for b in report.build([run])["backends"]} == compared


def test_point_values_are_compares_numbers(tmp_path, run_cli):
    """``ipw.analysis.metrics.point_values`` (no bootstrap) gives the point values compare reports."""
    from ipw.analysis import compare as cmp
    from ipw.analysis.load import load
    from ipw.analysis.metrics import METRICS, point_values

    run = write_run(tmp_path / "r", "r1", {
        "a": {"correct": [1, 0, 1], "energy": [1.0, None, 3.0], "error": [None, "timeout", None]}})
    _, _, pq, _ = load([run], prompt_tokens=True)
    compared = _compare(run_cli, run)["a"]
    for name, value in point_values(cmp.backend_values(pq, 0)).items():
        expected = compared[name]["value"]
        assert (expected is None and value != value) or value == pytest.approx(expected), name
    assert {m.name for m in METRICS} == set(compared)
    assert all(m.better in ("higher", "lower", "") and m.change_unit in ("%", "pp") for m in METRICS)


def test_run_ends_with_compares_routing_section(tmp_path, run_cli):
    """With a cloud-role backend, ``ipw run`` ends with compare's own routing tables (the same function, so
    the same figures), and local coverage and the oracle's energy saved are what the records say."""
    from ipw.analysis.compare import compare
    from ipw.analysis.render import routing_tables, with_basis
    from ipw.commands.run import end_summary

    backends = {
        "cloud": {"role": "cloud", "correct": [1, 1, 1, 0, 1, 1], "energy": [9.0, 8.0, 9.0, 7.0, 9.0, 8.0],
                  "quality": "measured"},
        "small": {"correct": [1, 0, 1, 0, 0, 1], "energy": [1.0, 1.0, 1.5, 1.0, 1.0, 2.0], "quality": "measured"},
        "mid": {"correct": [1, 1, 0, 0, 0, 0], "energy": [3.0, 2.0, 3.0, 3.0, 3.0, 3.0], "quality": "measured",
                "duration": [2.0] * 6},
    }
    run = write_run(tmp_path, "routed", backends)
    summary = end_summary(run)
    assert [t.key for t in summary.routing] == ["routing", "power_envelope"]
    c = compare([run], common_queries=True)
    same = [t for t in with_basis(c, routing_tables(c)) if t.key in ("routing", "power_envelope")]  # as compare prints
    assert summary.routing == same, "the very tables of ipw compare RUN's routing section"
    rows = dict(summary.routing[0].rows)

    # by hand: a query is covered when a local backend answers it; the oracle takes the cheapest such one
    local = ["small", "mid"]
    covered = [i for i in range(6) if any(backends[x]["correct"][i] for x in local)]
    assert covered == [0, 1, 2, 5]
    routed = sum(min(backends[x]["energy"][i] for x in local if backends[x]["correct"][i]) if i in covered
                 else backends["cloud"]["energy"][i] for i in range(6))
    cloud_only = sum(backends["cloud"]["energy"])
    assert rows["local coverage"].startswith(f"{len(covered) / 6:.1%} [")
    saved = rows["oracle energy saved"]
    assert saved.startswith(f"{(cloud_only - routed) / cloud_only:.1%} [")
    assert f"({cloud_only - routed:.3g} J of {cloud_only:.3g}), measured" in saved
    assert rows["router (α=0.8) energy saved"].startswith(f"{0.8 * (cloud_only - routed) / cloud_only:.1%} [")
    assert rows["router (α=0.8) energy saved"].endswith(", measured")
    envelope = summary.routing[1].rows  # small: 1.25 W; mid: 1.42 W (2 s windows)
    assert [r[1] for r in envelope] == ["small", "small, mid"]
    assert envelope[0][2].startswith(f"{3 / 6:.1%} [") and envelope[1][2].startswith(f"{4 / 6:.1%} [")
    assert [r[3] for r in envelope] == ["measured", "measured"]

    code, out, err = run_cli("compare", run)
    assert code == 0, err
    assert rows["oracle energy saved"] in out and envelope[1][2] in out


def test_run_without_a_cloud_backend_ends_without_routing(tmp_path):
    from ipw.commands.run import end_summary

    run = write_run(tmp_path, "local", {"a": {"correct": [1, 0], "energy": [1.0, 2.0]},
                                        "b": {"correct": [0, 1], "energy": [2.0, 1.0]}})
    assert end_summary(run).routing == []
