"""A concurrency sweep in compare and report: one backend measured at several levels is one backend per
level (``NAME@cN``); the serving table (J/query, J/output token, output tokens/s, latency and TTFT
quantiles, accuracy), the J/token-vs-throughput plot, ``--deadline`` and the routing reference level.
Every expected number is computed here by hand from the records written."""

import csv
import io
import json
import math

import pytest

from runfolders import create, record, write_run

N = 4
# per level of the server "srv": window starts (s, from the level's own beginning), durations (= latency),
# output tokens, energy, TTFT, correctness
LEVELS = {
    1: {"start": [0.0, 1.0, 2.0, 3.0], "duration": [1.0, 1.0, 1.0, 1.0], "tokens": [10, 10, 10, 10],
        "energy": [2.0, 2.0, 2.0, 2.0], "ttft": [0.1, 0.1, 0.1, 0.1], "correct": [1, 1, 1, 0]},
    4: {"start": [0.0, 0.0, 0.0, 0.0], "duration": [1.5, 1.5, 2.0, 2.5], "tokens": [10, 10, 20, 10],
        "energy": [1.0, 1.0, 1.5, 1.0], "ttft": [0.3, 0.3, 0.4, 0.5], "correct": [1, 1, 1, 0],
        "split_method": "tokens"},
    16: {"start": [0.0, 0.0, 0.0, 0.0], "duration": [3.0, 3.0, 3.0, 4.0], "tokens": [10, 10, 10, 10],
         "energy": [0.8, 0.8, 0.8, 0.8], "ttft": [1.0, 1.0, 1.2, 1.5], "correct": [1, 1, 0, 0],
         "split_method": "tokens"},
}
SMALL = {"role": "local", "correct": [1, 0, 1, 0], "energy": [0.5, 0.5, 0.5, 0.5], "quality": "measured"}


def sweep(tmp_path, role="cloud", name="sweep"):
    backends = {f"srv@c{c}": {**lv, "backend": "srv", "concurrency": c, "role": role, "quality": "measured"}
                for c, lv in LEVELS.items()}
    return write_run(tmp_path / name, name, {**backends, "small": SMALL})


def lower_q(xs, p):
    """The ceil(p·N)-th smallest (the metric table's quantile), by hand."""
    return sorted(xs)[math.ceil(p * len(xs)) - 1]


def expected(c):
    lv = LEVELS[c]
    span = max(s + d for s, d in zip(lv["start"], lv["duration"])) - min(lv["start"])
    return {
        "energy_per_query_j": sum(lv["energy"]) / N,
        "j_per_output_token": sum(lv["energy"]) / sum(lv["tokens"]),
        "output_tokens_per_s": sum(lv["tokens"]) / span,
        "latency_p50_s": lower_q(lv["duration"], 0.5), "latency_p95_s": lower_q(lv["duration"], 0.95),
        "ttft_p50_s": lower_q(lv["ttft"], 0.5), "ttft_p95_s": lower_q(lv["ttft"], 0.95),
        "accuracy": sum(lv["correct"]) / N,
    }


def compare_json(run_cli, *args):
    code, out, err = run_cli("compare", *args, "--format", "json", "--n-boot", "200")
    assert code == 0, err
    return json.loads(out)


def test_levels_are_backends_labelled_name_at_cn(tmp_path):
    from ipw.analysis.load import load

    _, infos, pq, _ = load([sweep(tmp_path)])
    assert [(b.label, b.backend, b.concurrency) for b in infos] == [
        ("srv@c1", "srv", 1), ("srv@c4", "srv", 4), ("srv@c16", "srv", 16), ("small", "small", 1)]
    assert [b.split_methods for b in infos] == [(), ("tokens",), ("tokens",), ()]
    assert pq.energy_j[1].tolist() == LEVELS[4]["energy"]  # each level's own records, not averaged together
    # one level only (here above 1): the plain name, its level still known
    one = write_run(tmp_path / "one", "one", {"srv": {**LEVELS[4], "concurrency": 4}})
    _, (info,), _, _ = load([one])
    assert (info.label, info.concurrency) == ("srv", 4)


def test_serving_table_values_by_hand(tmp_path, run_cli):
    from ipw.analysis.compare import compare
    from ipw.analysis.render import tables

    run = sweep(tmp_path)
    d = compare_json(run_cli, run)
    rows = {x["label"]: x for x in d["serving"]}
    assert list(rows) == ["srv@c1", "srv@c4", "srv@c16", "small"]
    for c in LEVELS:
        row = rows[f"srv@c{c}"]
        assert (row["backend"], row["concurrency"], row["n_records"]) == ("srv", c, N)
        for key, value in expected(c).items():
            assert row["metrics"][key]["value"] == pytest.approx(value), (c, key)
    assert rows["srv@c4"]["split_methods"] == ["tokens"] and rows["srv@c1"]["split_methods"] == []
    # the same metric as every backend's own table (one definition)
    b4 = next(b for b in d["backends"] if b["label"] == "srv@c4")
    assert b4["concurrency"] == 4 and b4["split_methods"] == ["tokens"]
    assert b4["metrics"]["output_tokens_per_s"] == rows["srv@c4"]["metrics"]["output_tokens_per_s"]
    assert expected(4)["output_tokens_per_s"] == 20.0  # 50 tokens over the 2.5 s the four requests overlapped

    (t,) = [t for t in tables(compare([run], n_boot=200)) if t.key == "serving"]
    assert t.headers == ["backend", "concurrency", "records", "J/query", "J/out token", "output tok/s",
                         "latency p50 (s)", "latency p95 (s)", "TTFT p50 (s)", "TTFT p95 (s)", "accuracy",
                         "energy split", "steady J/query", "steady J/out token", "steady output tok/s",
                         "steady share"]
    by_label = {r[0]: r for r in t.rows}
    for c in LEVELS:
        e = expected(c)
        # no steady window (tests/analysis/test_serving_steady.py): 4 records at 4 and 16 in flight are one wave
        assert by_label[f"srv@c{c}"][1:-4] == [
            str(c), str(N), *(f"{e[k]:.3g}" for k in ("energy_per_query_j", "j_per_output_token",
                                                       "output_tokens_per_s", "latency_p50_s", "latency_p95_s",
                                                       "ttft_p50_s", "ttft_p95_s")),
            f"{e['accuracy']:.1%}", "tokens" if c > 1 else "none"]
        assert by_label[f"srv@c{c}"][-4:] == ["n/a"] * 4


def test_serving_table_shown_only_with_a_level_above_one(tmp_path, run_cli):
    from ipw.analysis.compare import compare
    from ipw.analysis.render import tables

    plain = write_run(tmp_path / "p", "p", {"a": {"correct": [1, 0], "energy": [1.0, 2.0]}})
    assert "serving" not in [t.key for t in tables(compare([plain], n_boot=50))]
    one = write_run(tmp_path / "one", "one", {"srv": {**LEVELS[4], "concurrency": 4}})
    assert "serving" in [t.key for t in tables(compare([one], n_boot=50))]
    code, out, err = run_cli("compare", sweep(tmp_path), "--n-boot", "50")
    assert code == 0, err
    assert "serving: per backend and concurrency level" in out and "srv@c16" in out


@pytest.mark.parametrize("deadline, chosen", [
    ("p95_latency=2s", "srv@c1"),  # only c=1 (p95 1 s) meets it
    ("p95_latency=3s", "srv@c4"),  # c=1 and c=4 (2.5 s) meet it: c=4 costs less
    ("p50_ttft=1000ms", "srv@c16"),  # every level meets it (c=16: 1.0 s exactly): the cheapest
    ("p95_latency=500ms", None),  # none does
])
def test_deadline_picks_the_cheapest_level_that_meets_it(tmp_path, run_cli, deadline, chosen):
    from ipw.analysis.serving import DEADLINE_METRICS

    d = compare_json(run_cli, sweep(tmp_path), "--deadline", deadline)
    metric, _, value = deadline.partition("=")
    limit = float(value[:-2]) / 1000 if value.endswith("ms") else float(value[:-1])
    assert (d["deadline"]["metric"], d["deadline"]["limit_s"]) == (metric, limit)
    picks = {x["backend"]: x for x in d["deadline"]["picks"]}
    srv = picks["srv"]
    assert srv["levels"] == ["srv@c1", "srv@c4", "srv@c16"]
    meeting = [f"srv@c{c}" for c in LEVELS if expected(c)[DEADLINE_METRICS[metric]] <= limit]
    assert srv["meeting"] == meeting
    assert srv["chosen"] == chosen
    if chosen:
        c = int(chosen.split("@c")[1])
        assert srv["concurrency"] == c
        assert srv["energy_per_query_j"] == pytest.approx(min(expected(int(x.split("@c")[1]))["energy_per_query_j"]
                                                               for x in meeting))
        assert srv["value_s"] == pytest.approx(expected(c)[DEADLINE_METRICS[metric]])
    else:
        assert srv["concurrency"] is None and srv["energy_per_query_j"] is None
    code, out, err = run_cli("compare", sweep(tmp_path, name="again"), "--deadline", deadline, "--format", "markdown",
                             "--n-boot", "50")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("| srv |"))
    assert (f"{chosen} (c={srv['concurrency']})" if chosen else "none meets p95 latency ≤ 0.5 s") in line


@pytest.mark.parametrize("bad", ["p95_latency=2", "p99_latency=2s", "p95_latency", "latency=2s", "p95_latency=0s",
                                 "p95_latency=-1s", "p95_latency=2min", "p95_latency=fast"])
def test_deadline_bad_input_is_a_usage_error(tmp_path, run_cli, bad):
    from ipw.analysis.serving import parse_deadline
    from ipw.errors import IpwError

    with pytest.raises(IpwError, match="^deadline "):  # the library names its parameter, the CLI the flag (below)
        parse_deadline(bad)
    run = sweep(tmp_path)
    for command in (("compare", run), ("report", run, "--out", tmp_path / "r.html")):
        code, out, err = run_cli(*command, "--deadline", bad)
        assert code == 2, (command, out, err)
        text = " ".join(err.split())  # the message may wrap
        assert "--deadline" in text and "p95_latency" in text and "p50_ttft" in text and "500ms" in text
    assert not (tmp_path / "r.html").exists()


def test_routing_reference_defaults_to_the_highest_level(tmp_path, run_cli):
    d = compare_json(run_cli, sweep(tmp_path))
    note = "routing reference: srv@c16 (highest concurrency measured; --reference to choose)"
    assert d["reference"] == "srv@c16" and note in d["notes"]
    r = d["routing"]
    assert r["cloud"] == "srv@c16" and r["local"] == ["small"]
    # the oracle: small where it is right (q0, q2), else the c=16 level
    assert r["oracle"]["routed_to"] == {"srv@c16": 2, "small": 2}
    cloud_only = sum(LEVELS[16]["energy"])
    routed = 0.5 + 0.5 + LEVELS[16]["energy"][1] + LEVELS[16]["energy"][3]
    assert r["oracle"]["energy"]["saved_j"] == pytest.approx(cloud_only - routed)
    # the table says it too
    code, out, err = run_cli("compare", sweep(tmp_path, name="t"), "--n-boot", "50")
    assert code == 0 and note in " ".join(out.split())


def test_reference_option_takes_a_level_and_other_levels_are_not_local(tmp_path, run_cli):
    run = sweep(tmp_path, role="local")  # no cloud role: the reference stands in for the cloud
    d = compare_json(run_cli, run, "--reference", "srv@c4")
    assert d["reference"] == "srv@c4" and d["routing"]["cloud"] == "srv@c4"
    assert d["routing"]["local"] == ["small"]  # srv@c1 and srv@c16 are the reference backend, not local ones
    assert not any(n.startswith("routing reference:") for n in d["notes"])
    d = compare_json(run_cli, run, "--reference", "srv")  # the plain name: its serving level
    assert d["reference"] == "srv@c16" and d["routing"]["local"] == ["small"]
    assert any(n.startswith("routing reference: srv@c16") for n in d["notes"])
    d = compare_json(run_cli, run)  # no cloud role, the first backend (srv): its highest level stands in
    assert d["reference"] == "srv@c16" and d["routing"]["cloud_is_stand_in"]
    d = compare_json(run_cli, run, "--cloud", "srv")  # a role applies to every level
    assert [b["role"] for b in d["backends"]] == ["cloud", "cloud", "cloud", "local"]
    code, out, err = run_cli("compare", run, "--reference", "srv@c8")
    assert code == 2 and "srv@c8" in err and "srv@c4" in err


def test_csv_has_serving_and_deadline_rows(tmp_path, run_cli):
    code, out, err = run_cli("compare", sweep(tmp_path), "--format", "csv", "--n-boot", "50",
                             "--deadline", "p95_latency=3s")
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    tps = {r["backend"]: float(r["value"]) for r in rows
           if r["section"] == "serving" and r["metric"] == "output_tokens_per_s"}
    assert tps == pytest.approx({f"srv@c{c}": expected(c)["output_tokens_per_s"] for c in LEVELS}
                                | {"small": tps["small"]})
    assert {r["key"] for r in rows if r["section"] == "serving" and r["backend"] == "srv@c16"} == {"16"}
    chosen = next(r for r in rows if r["section"] == "deadline" and r["backend"] == "sweep/srv"
                  and r["metric"] == "chosen_concurrency")
    assert (chosen["key"], chosen["value"]) == ("p95_latency<=3s", "4")


def test_report_shows_serving_table_plot_and_deadline(tmp_path):
    from ipw.analysis import report

    run = sweep(tmp_path)
    out, md = tmp_path / "report.html", tmp_path / "summary.md"
    ctx = report.write([run], out, md, deadline="p95_latency=2s", n_boot=100)
    (fig,) = [f for f in ctx["figures"] if f["key"] == "serving"]
    assert fig["src"].startswith("data:image/png;base64,") and len(fig["src"]) > 1000
    assert {"serving", "deadline"} <= {t["key"] for t in ctx["tables"]}
    html = out.read_text()
    assert "Serving: concurrency levels" in html and 'id="fig-serving"' in html
    assert "Energy per output token vs throughput" in html
    assert "routing reference: srv@c16 (highest concurrency measured; --reference to choose)" in html
    text = md.read_text()
    assert "### serving: per backend and concurrency level" in text
    assert "energy-optimal concurrency level under p95 latency ≤ 2 s" in text
    assert "| srv | srv@c1 (c=1) |" in text
    # the records' labels are the levels' (the per-backend plots draw each level)
    assert {b["label"] for b in ctx["backends"]} == {"srv@c1", "srv@c4", "srv@c16", "small"}


def test_report_without_levels_has_no_serving_section(tmp_path):
    from ipw.analysis import report

    run = write_run(tmp_path / "p", "p", {"a": {"correct": [1, 0], "energy": [1.0, 2.0]}})
    ctx = report.write([run], tmp_path / "r.html", n_boot=50)
    assert "serving" not in {f["key"] for f in ctx["figures"]}
    assert "Serving: concurrency levels" not in (tmp_path / "r.html").read_text()


def test_check_gates_each_level(tmp_path, run_cli):
    run = sweep(tmp_path)
    md = tmp_path / "check.md"
    code, out, err = run_cli("check", run, run, "--markdown", md, "--fail-if", "output_tokens_per_s:-10%")
    assert code == 0, out + err
    gated = [line.split("|")[1].strip() for line in md.read_text().splitlines()
             if "output_tokens_per_s" in line and line.startswith("| ")]
    assert gated == ["srv@c1", "srv@c4", "srv@c16", "small"]


def test_throughput_of_records_from_several_machines_is_unknown(tmp_path, run_cli):
    """Monotonic clocks of two machines (a merged, sharded run) do not make one wall span."""
    folder = create(tmp_path, "merged", {"command": ["test"], "config": {},
                                         "dataset": {"name": "fixture", "n_queries": 2, "fingerprint": "x"}})
    folder.append(record(run_id="merged", query_id="q0", node="n1", start_s=100.0, end_s=101.0))
    folder.append(record(run_id="merged", query_id="q1", node="n2", start_s=5.0, end_s=6.0))
    folder.finish("complete")
    d = compare_json(run_cli, folder.path)
    assert d["backends"][0]["metrics"]["output_tokens_per_s"]["value"] is None
    assert d["backends"][0]["metrics"]["energy_per_query_j"]["value"] == 1.0  # the rest as before
