"""The steady window of a concurrency level (issue 58): the interval in which the level's concurrency was in
flight, its J/output token, J/query and output tokens/s (each record counted by the share of its time
inside), the window's share of the level, CIs across repeats, the serving table's steady columns and the
``--deadline`` pick on them. Every expected number is worked out here by hand."""

import json
import math

import numpy as np
import pytest

from runfolders import create, record

# a level of 3 in flight: three requests ramp up (0, 1, 2 s), each end frees a slot that the next request
# takes at once (4, 5, 6 s), then it drains (7, 8, 9 s). In flight: 1 from 0 s, 2 from 1 s, 3 from 2 s (the
# window opens), 3 through 4, 5, 6 s (an end and a start at one instant), 2 from 7 s (it closes), 1, 0.
# (start, end, output tokens, energy J)
RAMP_HOLD_DRAIN = [(0, 4, 12, 4.0), (1, 5, 12, 4.0), (2, 6, 12, 4.0), (4, 8, 12, 4.0), (5, 7, 12, 2.0), (6, 9, 12, 6.0)]
# each record's share of its time inside [2, 7]: 2 of 4 s, 3 of 4, 4 of 4, 3 of 4, 2 of 2, 1 of 3
SHARES = [0.5, 0.75, 1.0, 0.75, 1.0, 1 / 3]


def by_hand(records, shares, window_s):
    e = sum(x[3] * s for x, s in zip(records, shares))
    t = sum(x[2] * s for x, s in zip(records, shares))
    return {"j_per_output_token": e / t, "energy_per_query_j": e / sum(shares), "output_tokens_per_s": t / window_s}


def arrays(records, repeat=0):
    cols = np.array(records, dtype=float).T
    return cols[0], cols[1], cols[2], cols[3], np.full(len(records), repeat)


def test_window_and_figures_of_a_ramp_hold_and_drain_by_hand():
    from ipw.analysis.serving import steady_level, steady_window

    start, end, tokens, energy, repeat = arrays(RAMP_HOLD_DRAIN)
    assert steady_window(start, end, 3) == (2.0, 7.0)
    s = steady_level(start, end, tokens, energy, repeat, 3, n_boot=50)
    assert (s.window_s, s.span_s, s.share) == (5.0, 9.0, pytest.approx(5 / 9))
    assert s.records_in_window == pytest.approx(sum(SHARES))  # 4.333 records' worth
    # energy 2 + 3 + 4 + 3 + 2 + 2 = 16 J, tokens 12 x 4.333 = 52: 0.3077 J/token (whole level: 24 J / 72 = 0.333),
    # 16 / 4.333 = 3.69 J/query (whole: 4), 52 tokens / 5 s = 10.4 tokens/s (whole: 72 / 9 s = 8)
    expected = by_hand(RAMP_HOLD_DRAIN, SHARES, 5.0)
    assert expected == pytest.approx({"j_per_output_token": 16 / 52, "energy_per_query_j": 16 / (13 / 3),
                                      "output_tokens_per_s": 10.4})
    for key, value in expected.items():
        e = getattr(s, key)
        assert e.value == pytest.approx(value), key
        assert math.isnan(e.lo) and math.isnan(e.hi)  # one repeat: no interval


def test_no_window_at_one_in_flight_with_too_few_records_or_a_count_never_reached():
    from ipw.analysis.serving import steady_level, steady_window

    start, end, tokens, energy, repeat = arrays(RAMP_HOLD_DRAIN)
    assert steady_level(start, end, tokens, energy, repeat, 1, n_boot=50) is None  # a level of 1
    assert steady_window(start, end, 4) is None  # never 4 in flight
    first_wave = arrays(RAMP_HOLD_DRAIN[:3])  # 3 records at 3 in flight: the first wave alone, nothing held
    assert steady_window(first_wave[0], first_wave[1], 3) is None


def test_repeats_give_a_ci_across_them():
    from ipw.analysis.serving import steady_level

    # repeat 1 runs right after repeat 0 at the same concurrency, its energies doubled: the level's records are
    # one closed loop, 0-9 s then 9-18 s (the pool refills a slot the instant it frees)
    second = [(s + 9, e + 9, t, 2 * j) for s, e, t, j in RAMP_HOLD_DRAIN]
    # one loop over 12 records: 3 in flight from 2 s; the last drop below 3 is at 16 s (7 + 9)
    both = RAMP_HOLD_DRAIN + second
    cols = [np.concatenate(x) for x in zip(arrays(RAMP_HOLD_DRAIN, 0), arrays(second, 1))]
    s = steady_level(*cols, 3, n_boot=400, seed=1)
    assert s.repeats == 2
    from ipw.analysis.serving import steady_window

    lo_s, hi_s = steady_window(cols[0], cols[1], 3)
    shares = [max(0.0, min(e, hi_s) - max(b, lo_s)) / (e - b) for b, e, _, _ in both]
    expected = by_hand(both, shares, hi_s - lo_s)
    assert s.j_per_output_token.value == pytest.approx(expected["j_per_output_token"])
    # the resamples hold repeat 0 twice, repeat 1 twice, or one of each: the 95% interval spans the two repeats'
    # own figures
    per_repeat = [by_hand(both[i:i + 6], shares[i:i + 6], 1.0)["j_per_output_token"] for i in (0, 6)]
    assert s.j_per_output_token.lo == pytest.approx(min(per_repeat))
    assert s.j_per_output_token.hi == pytest.approx(max(per_repeat))
    assert s.energy_per_query_j.lo < s.energy_per_query_j.value < s.energy_per_query_j.hi


def _sweep(tmp_path):
    """A run of backend "srv" at 1 in flight (6 requests one after the other, 3.8 J each) and at 3 (the ramp, hold
    and drain above): by the whole level c=3 costs 4 J/query, more than c=1; over its steady window 3.69 J/query,
    less."""
    n = len(RAMP_HOLD_DRAIN)
    folder = create(tmp_path, "sw", {"command": ["test"], "config": {},
                                     "dataset": {"name": "fixture", "n_queries": n, "fingerprint": "x"}})
    for i in range(n):
        folder.append(record(run_id="sw", backend="srv", query_id=f"q{i}", concurrency=1, start_s=float(i),
                             end_s=i + 1.0, latency_s=1.0, completion_tokens=12, energy_j=3.8))
    for i, (s, e, t, j) in enumerate(RAMP_HOLD_DRAIN):
        folder.append(record(run_id="sw", backend="srv", query_id=f"q{i}", concurrency=3, start_s=100.0 + s,
                             end_s=100.0 + e, latency_s=float(e - s), completion_tokens=t, energy_j=j,
                             split_method="priced"))
    folder.finish("complete")
    return folder.path


def test_serving_table_json_and_csv_carry_the_steady_columns(tmp_path, run_cli):
    from ipw.analysis.compare import compare
    from ipw.analysis.render import csv_rows, tables, to_dict

    c = compare([_sweep(tmp_path)], n_boot=100)
    (t,) = [t for t in tables(c) if t.key == "serving"]
    assert t.headers[-4:] == ["steady J/query", "steady J/out token", "steady output tok/s", "steady share"]
    rows = {r[0]: r for r in t.rows}
    assert rows["srv@c1"][-4:] == ["n/a"] * 4
    assert rows["srv@c3"][-4:] == [f"{16 / (13 / 3):.3g}", f"{16 / 52:.3g}", "10.4", "55.6%"]
    assert rows["srv@c3"][3:5] == ["4", f"{24 / 72:.3g}"]  # the whole level's, as before
    d = to_dict(c)
    steady = {x["label"]: x["steady"] for x in d["serving"]}
    assert steady["srv@c1"] is None
    assert steady["srv@c3"]["window_s"] == 5.0 and steady["srv@c3"]["span_s"] == 9.0
    assert steady["srv@c3"]["metrics"]["j_per_output_token"]["value"] == pytest.approx(16 / 52)
    csv = {(r[1], r[3]): r[4] for r in csv_rows(c) if r[0] == "serving"}
    assert csv[("srv@c3", "steady_output_tokens_per_s")] == pytest.approx(10.4)
    assert csv[("srv@c3", "steady_share")] == pytest.approx(5 / 9)
    assert ("srv@c1", "steady_output_tokens_per_s") not in csv


def test_deadline_pick_uses_the_steady_figure(tmp_path, run_cli):
    code, out, err = run_cli("compare", _sweep(tmp_path), "--deadline", "p95_latency=10s", "--format", "json",
                             "--n-boot", "100")
    assert code == 0, err
    (pick,) = json.loads(out)["deadline"]["picks"]
    assert pick["meeting"] == ["srv@c1", "srv@c3"]
    # whole levels: c=1 3.8 J/query < c=3 4.0; steady: c=3 3.69 < c=1 3.8 (a level of 1 has no window: its whole)
    assert (pick["chosen"], pick["steady"]) == ("srv@c3", True)
    assert pick["energy_per_query_j"] == pytest.approx(16 / (13 / 3))
    code, out, err = run_cli("compare", _sweep(tmp_path / "again"), "--deadline", "p95_latency=10s",
                             "--format", "markdown", "--n-boot", "50")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("| srv |"))
    assert "srv@c3 (c=3)" in line and "3.69 (steady)" in line
    assert "over a level's steady window where it has one" in out
