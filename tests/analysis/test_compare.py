"""ipw compare: run folders written directly with ipw.results, checked against hand-computed values,
plus one end-to-end check on two real llama.cpp runs against an independent recomputation."""

import csv
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import bench_module
from runfolders import write_run
from ipw.analysis.stats import bootstrap_draws, lower_quantile, resample_weights

ROOT = Path(__file__).resolve().parents[2]


def compare_json(run_cli, *args):
    code, out, err = run_cli("compare", *args, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def backend(d, label):
    return next(b for b in d["backends"] if b["label"] == label)


HAND = {
    "x": {"correct": [1, 0, 1, 1], "energy": [1.0, 2.0, 3.0, 4.0], "duration": [1.0, 1.0, 2.0, 2.0],
          "tokens": [10, 10, 20, 20], "ttft": [0.1, 0.2, 0.3, 0.4], "latency": [1.0, 1.5, 2.5, 2.0]},
    "y": {"correct": [0, 0, 1, 1], "energy": [0.5, 0.5, 1.0, 1.0], "duration": [0.5, 0.5, 0.5, 0.5],
          "tokens": [5, 5, 5, 5], "ttft": [0.05, None, 0.05, 0.07], "latency": [0.5, 0.5, 0.6, 0.5],
          "error": [None, "timeout", None, None]},
}


def test_metrics_by_hand(tmp_path, run_cli):
    run = write_run(tmp_path, "r1", HAND)
    d = compare_json(run_cli, run)
    assert d["schema_version"] == 1 and d["reference"] == "x"
    assert d["queries"] == {"n_queries": 4, "common_queries": False}
    x = backend(d, "x")["metrics"]
    v = {k: e["value"] for k, e in x.items()}
    assert v["accuracy"] == 0.75
    assert v["energy_per_query_j"] == 2.5
    assert v["ipj"] == pytest.approx(0.3)  # 0.75 / 2.5
    assert v["mean_power_w"] == pytest.approx(10 / 6)  # 10 J over 6 s of windows
    assert v["ipw"] == pytest.approx(0.45)  # 0.75 / (10 / 6)
    assert v["j_per_output_token"] == pytest.approx(10 / 60)
    assert (v["ttft_p50_s"], v["ttft_p95_s"]) == (0.2, 0.4)  # the 2nd and 4th smallest of 4
    assert (v["latency_p50_s"], v["latency_p95_s"]) == (1.5, 2.5)
    assert v["errors"] == 0 and v["cost_per_query_usd"] is None
    for key, e in x.items():
        if e["value"] is not None:
            assert e["lo"] <= e["value"] <= e["hi"], key
    y = backend(d, "y")
    assert y["metrics"]["errors"]["value"] == 1
    assert y["metrics"]["ttft_p50_s"]["value"] == 0.05  # over the 3 known TTFTs
    assert y["metrics"]["accuracy"]["value"] == 0.5
    diff = y["vs_reference"]
    assert diff["accuracy"]["value"] == pytest.approx(-0.25)
    assert diff["energy_per_query_j"]["value"] == pytest.approx(0.75 - 2.5)
    assert diff["errors"]["value"] == 1
    assert backend(d, "x")["vs_reference"] is None
    assert backend(d, "x")["energy_quality"] == "estimated"
    assert backend(d, "x")["energy_sources"] == ["model.cpu"]


def test_repeats_are_averaged_first(tmp_path, run_cli):
    one = compare_json(run_cli, write_run(tmp_path / "a", "r1", HAND))
    three = compare_json(run_cli, write_run(tmp_path / "b", "r3", HAND, repeats=3))
    for label in ("x", "y"):
        for key, e in backend(one, label)["metrics"].items():
            # errors count records; output tokens/s is a rate over the wall span, which three repeats lengthen
            if key not in ("errors", "output_tokens_per_s"):
                assert backend(three, label)["metrics"][key]["value"] == pytest.approx(e["value"]), key
        assert backend(three, label)["n_records"] == 12
    assert backend(three, "y")["metrics"]["errors"]["value"] == 3  # errors count records


def test_backend_compared_with_itself_shows_zero_difference(tmp_path, run_cli):
    rng = np.random.default_rng(3)
    for i in range(4):
        n = int(rng.integers(2, 40))
        b = {"z": {"correct": rng.integers(0, 2, n).tolist(), "energy": rng.uniform(0.1, 9, n).tolist(),
                   "duration": rng.uniform(0.1, 3, n).tolist(), "tokens": rng.integers(1, 50, n).tolist(),
                   "ttft": rng.uniform(0.01, 0.5, n).tolist(), "latency": rng.uniform(0.1, 3, n).tolist()}}
        a = write_run(tmp_path / str(i), "first", b)
        copy = tmp_path / str(i) / "second"
        shutil.copytree(a, copy)
        manifest = json.loads((copy / "manifest.json").read_text())
        (copy / "manifest.json").write_text(json.dumps({**manifest, "run_id": "second"}))
        d = compare_json(run_cli, a, copy)
        assert [x["label"] for x in d["backends"]] == ["first/z", "second/z"]  # names collide across runs
        for key, e in backend(d, "second/z")["vs_reference"].items():
            if key not in ("cost_per_query_usd", "j_per_prefill_token", "j_per_decode_token",
                           "prefill_energy_share", "win_tie_rate", "gco2e_per_query",
                           "gco2e_per_correct"):  # None: no prices, phases, judge or carbon intensity here
                assert (e["value"], e["lo"], e["hi"]) == (0.0, 0.0, 0.0), key


def test_fingerprint_mismatch_exits_2(tmp_path, run_cli):
    a = write_run(tmp_path, "r1", {"x": HAND["x"]}, fingerprint="sha256:aaaa")
    b = write_run(tmp_path, "r2", {"y": HAND["y"]}, fingerprint="sha256:bbbb")
    code, out, err = run_cli("compare", a, b)
    assert code == 2
    assert "fingerprints differ" in err and "--common-queries" in err


def test_common_queries_restricts_and_says_so(tmp_path, run_cli):
    a = write_run(tmp_path, "r1", {"x": {"correct": [1, 1, 0, 0, 1, 1], "energy": [1.0] * 6}},
                  query_ids=["q0", "q1", "q2", "q3", "q4", "q5"], fingerprint="sha256:aaaa")
    b = write_run(tmp_path, "r2", {"y": {"correct": [1, 0, 0, 1, 1, 1], "energy": [2.0] * 6}},
                  query_ids=["q3", "q4", "q5", "q6", "q7", "q8"], fingerprint="sha256:bbbb")
    d = compare_json(run_cli, a, b, "--common-queries")
    assert d["queries"] == {"n_queries": 3, "common_queries": True}
    assert any("--common-queries" in n and "3 queries" in n for n in d["notes"])
    assert backend(d, "x")["metrics"]["accuracy"]["value"] == pytest.approx(2 / 3)  # q3 0, q4 1, q5 1
    assert backend(d, "y")["metrics"]["accuracy"]["value"] == pytest.approx(1 / 3)  # q3 1, q4 0, q5 0
    code, out, err = run_cli("compare", a, b, "--common-queries")  # the table says so too
    assert code == 0 and "--common-queries" in out


def test_interrupted_run_missing_queries(tmp_path, run_cli):
    a = write_run(tmp_path, "r1", {"x": {"correct": [1, 0, 1], "energy": [1.0] * 3}})
    b = write_run(tmp_path, "r2", {"y": {"correct": [1, 1], "energy": [1.0] * 2}}, status="interrupted")
    code, _, err = run_cli("compare", a, b)
    assert code == 2 and "has 2 of the 3 queries" in err
    d = compare_json(run_cli, a, b, "--common-queries")
    assert d["queries"]["n_queries"] == 2


# the routing example of tests/analysis/test_routing.py: durations make mean powers 5 W, 20 W and 300 W
ROUTE_CORRECT = [[1, 1, 1], [1, 0, 1], [0, 1, 1], [0, 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0], [1, 0, 0], [0, 0, 1],
                 [1, 1, 1]]
ROUTE_ENERGY = [[1, 3, 10]] * 5 + [[2, 1, 10], [2, 3, 10], [2, 3, 10], [2, 3, 10], [2, 1, 10]]


def routing_runs(tmp_path, roles=("local", "local", "cloud")):
    watts = (5.0, 20.0, 300.0)
    backends = {}
    for j, name in enumerate(("A", "B", "C")):
        e = [float(row[j]) for row in ROUTE_ENERGY]
        backends[name] = {"correct": [row[j] for row in ROUTE_CORRECT], "energy": e, "role": roles[j],
                          "duration": [x / watts[j] for x in e], "latency": [(0.5, 1.0, 2.0)[j]] * 10,
                          "quality": ("measured", "measured", "estimated")[j]}
    return write_run(tmp_path, "route", backends, categories=["math"] * 5 + ["text"] * 5)


def test_routing_through_compare(tmp_path, run_cli):
    d = compare_json(run_cli, routing_runs(tmp_path))
    assert d["reference"] == "C"  # the first cloud-role backend
    r = d["routing"]
    assert (r["cloud"], r["local"], r["cloud_is_stand_in"]) == ("C", ["A", "B"], False)
    assert r["local_coverage"]["value"] == pytest.approx(0.7)
    assert r["local_coverage"]["lo"] <= 0.7 <= r["local_coverage"]["hi"]
    assert r["coverage_by_backend"] == {"A": 0.5, "B": 0.5}
    o = r["oracle"]
    assert o["routed_to"] == {"A": 3, "B": 4, "C": 3}
    assert o["accuracy"]["value"] == pytest.approx(0.9) and o["cloud_accuracy"] == pytest.approx(0.7)
    assert (o["energy"]["cloud_only_j"], o["energy"]["routed_j"], o["energy"]["saved_j"]) == (100.0, 42.0, 58.0)
    assert o["energy"]["saved_fraction"]["value"] == pytest.approx(0.58)
    assert o["energy"]["energy_quality"] == "estimated"
    assert o["energy"]["routed_by_quality_j"] == {"measured": 12.0, "estimated": 30.0}
    assert o["latency"]["saved_fraction"]["value"] == pytest.approx(0.425)
    assert o["cost"] is None
    assert r["router"]["alpha"] == 0.8
    assert r["router"]["energy_saved_fraction"]["value"] == pytest.approx(0.464)
    lo, hi = o["energy"]["saved_fraction"]["lo"], o["energy"]["saved_fraction"]["hi"]
    assert r["router"]["energy_saved_fraction"]["lo"] == pytest.approx(0.8 * lo)
    assert r["router"]["energy_saved_fraction"]["hi"] == pytest.approx(0.8 * hi)
    assert r["router"]["accuracy"] == pytest.approx(0.86)
    assert len(r["router_curve"]) == 11
    assert [(p["power_w"], p["backends"], p["coverage"]) for p in r["power_envelope"]] == [
        (pytest.approx(5.0), ["A"], 0.5), (pytest.approx(20.0), ["A", "B"], 0.7)]
    assert r["energy_budget"][0] == {"energy_j": 1.0, "coverage": 0.4}
    cats = {c["category"]: c for c in r["by_category"]}
    assert cats["math"]["energy_saved_fraction"] == pytest.approx(0.5)
    assert cats["text"]["local_coverage"] == pytest.approx(0.8)
    assert any("different bases" in n for n in d["notes"])  # A and B measured, C estimated


def test_roles_and_reference_options(tmp_path, run_cli):
    run = routing_runs(tmp_path, roles=("local", "local", "local"))
    d = compare_json(run_cli, run)
    assert d["reference"] == "A" and d["routing"]["cloud_is_stand_in"] is True
    assert any("stand-in" in n or "as the cloud" in n for n in d["notes"])
    d = compare_json(run_cli, run, "--cloud", "C")
    assert d["reference"] == "C" and d["routing"]["oracle"]["energy"]["saved_j"] == 58.0
    assert backend(d, "C")["role"] == "cloud"
    d = compare_json(run_cli, run, "--cloud", "C", "--local", "B", "--reference", "C")
    assert d["routing"]["local"] == ["A", "B"]
    code, _, err = run_cli("compare", run, "--reference", "nope")
    assert code == 2 and "no such backend" in err
    code, _, err = run_cli("compare", run, "--router-accuracy", "1.5")
    assert code == 2


def test_costs(tmp_path, run_cli):
    run = routing_runs(tmp_path)
    d = compare_json(run_cli, run, "--usd-per-kwh", "0.30", "--api-price", "C=1.0,4.0")
    # C: 10 prompt tokens x $1/M + 10 output tokens x $4/M per query
    assert backend(d, "C")["metrics"]["cost_per_query_usd"]["value"] == pytest.approx(50e-6)
    assert backend(d, "A")["metrics"]["cost_per_query_usd"]["value"] == pytest.approx(1.5 / 3.6e6 * 0.30)
    cost = d["routing"]["oracle"]["cost"]
    routed = (1 + 1 + 2) / 3.6e6 * 0.3 + (3 + 1 + 3 + 1) / 3.6e6 * 0.3 + 3 * 50e-6
    assert cost["routed_usd"] == pytest.approx(routed) and cost["cloud_only_usd"] == pytest.approx(500e-6)
    code, _, err = run_cli("compare", run, "--api-price", "C=cheap")
    assert code == 2 and "NAME=IN,OUT" in err


def test_formats(tmp_path, run_cli):
    run = routing_runs(tmp_path)
    code, out, _ = run_cli("compare", run, "--format", "csv")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == ["section", "backend", "key", "metric", "value", "lo", "hi"]
    acc = next(r for r in rows if r["section"] == "metric" and r["backend"] == "A" and r["metric"] == "accuracy")
    assert float(acc["value"]) == 0.5
    assert any(r["section"] == "vs_reference" and r["key"] == "C" for r in rows)
    assert any(r["section"] == "category" and r["key"] == "text" for r in rows)
    code, out, _ = run_cli("compare", run, "--format", "markdown")
    assert code == 0 and "| metric | A | B | C |" in out and "### routing" in out
    code, out, _ = run_cli("compare", run)
    assert code == 0 and "ipw compare: 10 queries" in out and "local coverage" in out and "measured" in out
    code, _, err = run_cli("compare", run, "--format", "xml")
    assert code == 2 and "--format" in err
    code, _, err = run_cli("compare", tmp_path / "missing")
    assert code == 2 and "not a run folder" in err


def test_unavailable_energy_stays_unavailable(tmp_path, run_cli):
    b = {"x": {"correct": [1, 0, 1], "energy": [None, None, None]},
         "y": {"correct": [1, 1, 0], "energy": [1.0, 1.0, 1.0], "role": "cloud"}}
    d = compare_json(run_cli, write_run(tmp_path, "r", b))
    x = backend(d, "x")
    assert x["energy_quality"] == "unavailable"
    assert x["metrics"]["energy_per_query_j"]["value"] is None and x["metrics"]["accuracy"]["value"] == 2 / 3
    assert d["routing"]["oracle"]["energy"] is None  # not guessed
    assert d["routing"]["oracle"]["latency"] is not None


def test_running_run_is_read_from_its_log(tmp_path, run_cli):
    run = write_run(tmp_path, "r", HAND)
    (run / "records.parquet").unlink()  # a run still going (or killed) has only records.jsonl
    d = compare_json(run_cli, run)
    assert backend(d, "x")["metrics"]["ipj"]["value"] == pytest.approx(0.3)
    assert backend(d, "y")["metrics"]["errors"]["value"] == 1


def test_single_backend_has_no_routing(tmp_path, run_cli):
    d = compare_json(run_cli, write_run(tmp_path, "r", {"x": HAND["x"]}))
    assert d["routing"] is None and any("routing: needs" in n for n in d["notes"])
    code, out, _ = run_cli("compare", tmp_path / "r")
    assert code == 0 and "routing: needs" in out


def test_mixed_energy_quality_within_a_backend_is_labeled(tmp_path, run_cli):
    run = write_run(tmp_path, "r", {"x": HAND["x"]})
    frame = pd.read_parquet(run / "records.parquet")
    frame.loc[0, "energy_quality"] = "measured"
    frame.to_parquet(run / "records.parquet", index=False)
    d = compare_json(run_cli, run)
    assert backend(d, "x")["energy_qualities"] == {"measured": 1, "estimated": 3}
    assert backend(d, "x")["energy_quality"] == "estimated"
    assert any("mixes qualities" in n for n in d["notes"])


# --- the bootstrap engine -------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("n", [7, 300, 30_000])
def test_windowed_quantiles_match_brute_force(n, tied):
    """The quantile of each resample, found from a window around it, equals the brute-force weighted
    quantile over all items (multinomial weights below 20,000 items, Poisson above); ``tied``: half the
    values 0.0 and the rest rounded (runs of equal values, summed as indicator rows from 256 on)."""
    rng = np.random.default_rng(n)
    values = rng.lognormal(size=n)
    if tied:
        values = np.where(rng.random(n) < 0.5, 0.0, np.round(values, 1))
    values[rng.random(n) < 0.05] = np.nan
    d = bootstrap_draws([np.ones(n)], [(values, (0.5, 0.95))], n_boot=40, seed=5)
    assert d.point_quantiles[0] == lower_quantile(values, 0.5)
    order = np.argsort(np.where(np.isnan(values), np.inf, values))
    finite = ~np.isnan(values[order])
    b = 0
    for w in resample_weights(n, 40, seed=5):
        for row in w:
            cum = np.cumsum(row[order] * finite)
            for j, p in enumerate((0.5, 0.95)):
                need = max(np.ceil(p * cum[-1]), 1)
                assert d.quantiles[b, j] == values[order][np.searchsorted(cum, need)]
            assert d.sums[b, 0] == row.sum()
            b += 1
    assert d.method == ("poisson" if n > 20_000 else "multinomial")


def test_compare_matches_independent_recomputation_at_larger_n(tmp_path):
    """25,000 queries (Poisson weights, quantile windows): point values against plain pandas."""
    with bench_module("scale/compare_scale") as compare_scale:
        paths = compare_scale.generate(tmp_path, 25_000)
    from ipw.analysis.compare import compare
    from ipw.analysis.render import to_dict

    d = to_dict(compare(paths))
    assert d["bootstrap"]["method"] == "poisson" and d["bootstrap"]["n_boot"] == 2000
    frames = pd.concat([pd.read_parquet(p / "records.parquet") for p in paths])
    for name, g in frames.groupby("backend"):
        m = backend(d, name)["metrics"]
        e, t = g["energy_j"].to_numpy(), (g["end_s"] - g["start_s"]).to_numpy()
        assert m["accuracy"]["value"] == pytest.approx(g["correct"].mean())
        assert m["mean_power_w"]["value"] == pytest.approx(e.sum() / t.sum())
        assert m["latency_p95_s"]["value"] == np.quantile(g["latency_s"], 0.95, method="inverted_cdf")
        assert m["ttft_p50_s"]["value"] == np.quantile(g["ttft_s"].dropna(), 0.5, method="inverted_cdf")
        assert m["latency_p95_s"]["lo"] < m["latency_p95_s"]["value"] < m["latency_p95_s"]["hi"]


def test_scale_bench_runs_small(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "scale" / "compare_scale.py"), "--queries", "2000",
                          "--repeats", "1", "--no-write"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert row["n_records"] == 10_000 and row["wall_s"] > 0 and row["peak_rss_mb"] > 0


# --- two real runs ---------------------------------------------------------------------------------------

SIX = [
    {"id": "a1", "prompt": "What is 2 + 3? Answer with just the number.", "answer": "5", "category": "arithmetic",
     "scorer": "numeric"},
    {"id": "a2", "prompt": "What is 10 - 4? Answer with just the number.", "answer": "6", "category": "arithmetic",
     "scorer": "numeric"},
    {"id": "a3", "prompt": "What is 3 x 3? Answer with just the number.", "answer": "9", "category": "arithmetic",
     "scorer": "numeric"},
    {"id": "m1", "prompt": "Which planet is known as the Red Planet?", "answer": "B",
     "choices": ["Venus", "Mars", "Jupiter", "Saturn"], "category": "science"},
    {"id": "s1", "prompt": "Write the word 'dog' in uppercase. Answer with just the word.", "answer": "DOG",
     "category": "strings", "scorer": "exact"},
    {"id": "s2", "prompt": "What is the capital of France? Answer with one word.", "answer": "Paris",
     "category": "general_knowledge", "scorer": "contains"},
]


def _expected(g: pd.DataFrame) -> dict:
    """Independent recomputation of one backend's metrics from records.parquet (plain pandas)."""
    e, t = g["energy_j"], g["end_s"] - g["start_s"]
    acc = g["correct"].mean()
    power = e.sum() / t.sum()
    return {
        "accuracy": acc, "energy_per_query_j": e.mean(), "ipj": acc / e.mean(), "mean_power_w": power,
        "ipw": acc / power, "j_per_output_token": e.sum() / g["completion_tokens"].sum(),
        "ttft_p50_s": np.quantile(g["ttft_s"].dropna(), 0.5, method="inverted_cdf"),
        "ttft_p95_s": np.quantile(g["ttft_s"].dropna(), 0.95, method="inverted_cdf"),
        "latency_p50_s": np.quantile(g["latency_s"], 0.5, method="inverted_cdf"),
        "latency_p95_s": np.quantile(g["latency_s"], 0.95, method="inverted_cdf"),
        "errors": int(g["error"].notna().sum()),
    }


@pytest.mark.llama
def test_two_real_runs_match_recomputation(tmp_path, run_cli):
    data = tmp_path / "six.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in SIX))
    runs = []
    for model in ("smollm2-135m", "gemma3-270m"):
        out = tmp_path / model
        code, _, err = run_cli("run", "--dataset", data, "--limit", "6", "--backend", f"llama-cpp:{model}",
                               "--idle-s", "0", "--warmup", "0", "--out", out)
        assert code == 0, err
        (run,) = out.iterdir()
        runs.append(run)
    check_real_runs(runs, compare_json(run_cli, *runs))


def check_real_runs(runs, d):
    smol, gemma = "llama-cpp:smollm2-135m", "llama-cpp:gemma3-270m"
    assert d["queries"]["n_queries"] == 6 and d["reference"] == smol
    frames = {}
    for run in runs:
        f = pd.read_parquet(run / "records.parquet")
        for name, g in f.groupby("backend"):
            frames[name] = g.sort_values("query_id").reset_index(drop=True)
    assert sorted(frames) == [gemma, smol]
    for name, g in frames.items():
        b = backend(d, name)
        assert b["energy_quality"] == "estimated" and b["n_records"] == 6
        for key, value in _expected(g).items():
            assert b["metrics"][key]["value"] == pytest.approx(value, rel=1e-9, abs=1e-12), (name, key)
            assert b["metrics"][key]["lo"] <= b["metrics"][key]["value"] <= b["metrics"][key]["hi"], (name, key)
    ref, other = frames[smol], frames[gemma]
    exp_ref, exp_other = _expected(ref), _expected(other)
    for key in exp_ref:
        got = backend(d, gemma)["vs_reference"][key]["value"]
        assert got == pytest.approx(exp_other[key] - exp_ref[key], rel=1e-9, abs=1e-12), key
    # routing: the reference stands in for the cloud; gemma is the local backend
    r = d["routing"]
    assert r["cloud"] == smol and r["local"] == [gemma] and r["cloud_is_stand_in"]
    solved = other["correct"].to_numpy() >= 0.5
    assert r["local_coverage"]["value"] == pytest.approx(solved.mean())
    routed_e = np.where(solved, other["energy_j"], ref["energy_j"])
    routed_c = np.where(solved, other["correct"], ref["correct"])
    routed_t = np.where(solved, other["latency_s"], ref["latency_s"])
    o = r["oracle"]
    assert o["energy"]["routed_j"] == pytest.approx(routed_e.sum())
    assert o["energy"]["cloud_only_j"] == pytest.approx(ref["energy_j"].sum())
    assert o["energy"]["saved_fraction"]["value"] == pytest.approx(1 - routed_e.sum() / ref["energy_j"].sum())
    assert o["latency"]["saved_fraction"]["value"] == pytest.approx(1 - routed_t.sum() / ref["latency_s"].sum())
    assert o["accuracy"]["value"] == pytest.approx(routed_c.mean())
    assert r["router"]["energy_saved_fraction"]["value"] == pytest.approx(
        0.8 * (1 - routed_e.sum() / ref["energy_j"].sum()))


# -- unscored queries and win/tie against a reference backend (QueryRecord.correct None, win_tie) --------

# per backend: (correct, win_tie, energy) per query; q0-q2 math (a dataset answer), q3-q5 chat (judge items:
# unscored, and judged against cloud's answer where win_tie is set); small failed q2 (an error, correct 0)
JUDGED = {
    "cloud": {"role": "cloud", "rows": [(1.0, None, 10.0), (1.0, None, 10.0), (0.0, None, 10.0),
                                        (None, None, 10.0), (None, None, 10.0), (None, None, 10.0)]},
    "small": {"role": "local", "rows": [(1.0, None, 1.0), (0.0, None, 1.0), (0.0, None, 2.0),
                                        (None, 1.0, 1.0), (None, 0.0, 1.0), (None, None, 1.0)]},
    "mid": {"role": "local", "rows": [(0.0, None, 3.0), (1.0, None, 3.0), (0.0, None, 3.0),
                                      (None, 0.0, 3.0), (None, 0.0, 3.0), (None, None, 3.0)]},
}
JUDGED_CATEGORY = ["math"] * 3 + ["chat"] * 3


def _judged_run(tmp_path):
    from runfolders import create, record

    folder = create(tmp_path, "judged", {"command": ["test"], "config": {},
                                         "dataset": {"name": "j", "n_queries": 6, "fingerprint": "sha256:j"}})
    for name, b in JUDGED.items():
        for i, (correct, win, energy) in enumerate(b["rows"]):
            error = "timeout" if (name, i) == ("small", 2) else None
            folder.append(record(run_id="judged", backend=name, role=b["role"], query_id=f"q{i}",
                                 category=JUDGED_CATEGORY[i], correct=correct, error=error,
                                 error_category="timeout" if error else None, energy_j=energy,
                                 scorer="judge" if i >= 3 else "exact", win_tie=win,
                                 vs_backend="cloud" if win is not None else ""))
    folder.finish("complete")
    return folder.path


def test_unscored_queries_count_in_no_accuracy_and_win_tie_is_a_metric(tmp_path, run_cli):
    d = compare_json(run_cli, _judged_run(tmp_path))
    for name, b in JUDGED.items():
        m = backend(d, name)["metrics"]
        scored = [c for c, _, _ in b["rows"] if c is not None]
        judged = [w for _, w, _ in b["rows"] if w is not None]
        energy = np.mean([e for _, _, e in b["rows"]])  # every query's energy counts
        accuracy = np.mean(scored)  # over the 3 scored queries, never the 3 unscored ones
        assert m["accuracy"]["value"] == pytest.approx(accuracy)
        assert m["ipj"]["value"] == pytest.approx(accuracy / energy)
        assert m["ipw"]["value"] == pytest.approx(accuracy / (energy / 1.0))  # 1 s windows
        assert m["unscored"]["value"] == 3
        assert m["error_rate"]["value"] == pytest.approx((name == "small") / 6)
        if judged:
            assert m["win_tie_rate"]["value"] == pytest.approx(np.mean(judged))
        else:
            assert m["win_tie_rate"]["value"] is None  # the reference is never judged against itself


def test_coverage_both_ways_overall_and_per_category(tmp_path, run_cli):
    path = _judged_run(tmp_path)
    d = compare_json(run_cli, path)
    r = d["routing"]
    rows = {name: b["rows"] for name, b in JUDGED.items()}
    local = ["small", "mid"]
    # (a) correct vs the dataset answer, over the queries with a score: q0 (small), q1 (mid) of q0-q2
    scored = [i for i in range(6) if any(rows[x][i][0] is not None for x in local + ["cloud"])]
    covered = [i for i in scored if any((rows[x][i][0] or 0) >= 0.5 for x in local)]
    assert (len(scored), len(covered)) == (3, 2)
    # (b) win/tie vs cloud's answer, over the queries a judge compared: q3 (small wins), q4 (neither)
    judged = [i for i in range(6) if any(rows[x][i][1] is not None for x in local)]
    won = [i for i in judged if any((rows[x][i][1] or 0) >= 0.5 for x in local)]
    assert (len(judged), len(won)) == (2, 1)
    cov = r["coverage"]
    assert cov["correct"]["value"] == pytest.approx(len(covered) / len(scored)) == r["local_coverage"]["value"]
    assert cov["n_scored"] == 3 and cov["n_judged"] == 2 and cov["win_tie_vs"] == "cloud"
    assert cov["win_tie"]["value"] == pytest.approx(len(won) / len(judged))
    cats = {k["category"]: k for k in r["by_category"]}
    assert (cats["math"]["local_coverage"], cats["math"]["n_scored"], cats["math"]["n_judged"]) == (
        pytest.approx(2 / 3), 3, 0)
    assert cats["math"]["win_tie_coverage"] is None
    assert (cats["chat"]["local_coverage"], cats["chat"]["n_scored"]) == (None, 0)  # nothing to be wrong about
    assert (cats["chat"]["win_tie_coverage"], cats["chat"]["n_judged"]) == (pytest.approx(0.5), 2)
    # the oracle's accuracy is over the scored queries too: q0 small, q1 mid, q2 cloud (0)
    assert r["oracle"]["accuracy"]["value"] == pytest.approx(2 / 3)
    assert r["oracle"]["cloud_accuracy"] == pytest.approx(2 / 3)
    code, out, err = run_cli("compare", path, "--format", "markdown")
    assert code == 0, err
    assert "| local coverage | 66.7% " in out and "| local coverage, win/tie | 50.0% " in out
    assert "| chat | 3 | n/a | 0 | 50.0% | 2 |" in out
