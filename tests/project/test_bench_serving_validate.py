"""bench/serving/serving_validate.py's checks that make a miss visible (issue 58): the provisional energy by load
with each round's phases, and conservation's ±0.3% target marked level by level.  Numbers worked out here."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import bench_module


@pytest.fixture(scope="module")
def validate():
    with bench_module("serving/serving_validate") as mod:
        yield mod


def test_by_load_separates_levels_and_shows_a_rounds_phase_drift(validate):
    # four requests one at a time (0-1, 1-2, 2-3, 3-4 s), then after a 1 s gap a round of 8 together (5-6 s to
    # 5-9.5 s, ending 0.5 s apart): the first two of that round read 20% low, the last two 20% high
    start = np.array([0.0, 1.0, 2.0, 3.0] + [5.0] * 8)
    end = np.array([1.0, 2.0, 3.0, 4.0] + [6.0 + 0.5 * k for k in range(8)])
    settled = np.full(12, 10.0)
    prov = np.array([10.0] * 4 + [8.0, 8.0, 10.0, 10.0, 10.0, 10.0, 12.0, 12.0])
    band = np.full(12, 1.5)  # ±1.5 J: the 8 J and 12 J values miss
    streamed = np.array([True, False] * 6)
    out = validate.by_load(start, end, streamed, prov, band, settled)
    assert set(out) == {"1", "2-24"}  # the round of 8 peaks at 8 in flight
    one, round_ = out["1"], out["2-24"]
    assert (one["records"], one["coverage_pct"], one["sum_ratio_minus_1_pct"]) == (4, 100.0, 0.0)
    assert one["streamed"]["records"] == one["plain"]["records"] == 2
    assert (round_["records"], round_["coverage_pct"], round_["sum_ratio_minus_1_pct"]) == (8, 50.0, 0.0)
    assert round_["quarters_sum_ratio_minus_1_pct"] == [-20.0, 0.0, 0.0, 20.0] and round_["rounds"] == 1
    assert "quarters_sum_ratio_minus_1_pct" not in one  # a stretch of fewer than 8 requests has no quarters


def test_conservation_marks_each_level_outside_the_target(validate):
    rows = [{"folder": "short", "backend": "b", "concurrency": c, "split": "priced", "requests": 32, "span_s": span,
             "parts_j": 1.0, "unattributed_j": 0.0, "counter_j": 1.0, "error_pct": err, "within_target": ok,
             "j_per_output_token": None, "output_tokens_per_s": None, "p95_latency_s": None, "pricing": None,
             "split_methods": {}}
            for c, err, ok, span in ((1, 0.12, True, 9.0), (16, -0.45, False, 0.8), (64, None, None, 1.0))]
    text = validate._markdown({"conservation": rows})
    assert "**1 of 2 levels within ±0.3%**: outside (✗): short c=16 -0.45% (0.8 s)." in text
    assert "| -0.45 ✗ |" in text and "| +0.12 |" in text
