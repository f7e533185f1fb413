"""Issue 27: the ±90% interval of a sampled window holds on H200 recordings the fit never saw, and the
counter's sparse reads are placed on its update grid.

The replays use the recordings committed in bench/evidence/telemetry/h200-attribution (bench/telemetry/attribution.py:
identical windows with a back-to-back counter reference; the fresh 2026-12-01 recording was made after the fit) and tests/data
(LLM decoding and synthetic loads, full-rate counter).  bench/telemetry/uncertainty_fit.py made the fit (on the
2026-11-29 recording's first block of each length) and prints the tables in docs/ENERGY.md.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from ipw.telemetry import energy_counter, error_model, integrals
from ipw.telemetry import estimator as est
from ipw.telemetry.nvml_estimate import hold_counter_reads
import evidence_slices

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"


def _fit_module():
    spec = importlib.util.spec_from_file_location("uncertainty_fit", ROOT / "bench" / "telemetry" / "uncertainty_fit.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["uncertainty_fit"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def held_out():
    fit = _fit_module()
    return fit, [w for w in fit.all_windows() if w.set == "held-out"]


def test_held_out_coverage_and_width_of_matmul_windows(held_out):
    """Identical matmul windows (reference: the block's counter energy by time share), the 2026-11-29
    recording's second blocks and the fresh 2026-12-01 recording pooled, per window length.  Coverage
    85-95% where a length has at least 40 windows (below that, one window moves it by 2.5+ points and a
    block's windows share one calibration error): >= 85% only; half-width <= 2x p90 |error| everywhere."""
    fit, ws = held_out
    matmul = [w for w in ws if not w.recording.startswith("tests/data") and w.group in fit.LENGTHS]
    ev = fit.evaluate(matmul, error_model.DEFAULT_ERROR_MODEL)
    assert set(ev) == set(fit.LENGTHS)
    for group, x in ev.items():
        assert x["coverage"] >= 0.85, (group, x)
        if x["n"] >= 40:
            assert x["coverage"] <= 0.95, (group, x)
        assert x["median_half_width"] <= 2 * x["p90_abs_error"], (group, x)
    assert ev["50 ms"]["n"] == 400 and ev["0.15 s"]["n"] == 140


def test_held_out_decoding_and_synthetic_loads_are_covered(held_out):
    """tests/data (LLM decoding blocks and a steady load, reference: the full-rate counter; windows >=
    0.5 s): covered at least 85%, half-width <= 2x p90 |error|.  The interval is conservative there
    (0.5 s: ~99% covered; docs/ENERGY.md says so)."""
    fit, ws = held_out
    trace = [w for w in ws if w.recording.startswith("tests/data")]
    ev = fit.evaluate(trace, error_model.DEFAULT_ERROR_MODEL)
    assert set(ev) == {"0.5 s", "2 s", "8 s"}
    for group, x in ev.items():
        assert x["coverage"] >= 0.85 and x["median_half_width"] <= 2 * x["p90_abs_error"], (group, x)


def test_periodic_load_is_labeled_and_covered(held_out):
    """25 ms bursts every 100 ms beat against the 20 ms samples: at least 90% of the windows are labeled
    aliasing (61 of 66 when this was written), and the interval (wide there) still covers at least 90% of
    the errors."""
    fit, ws = held_out
    periodic = [w for w in ws if w.group == fit.PERIODIC]
    assert len(periodic) == 66
    assert sum(w.terms.aliasing_period_s is not None for w in periodic) >= 0.9 * len(periodic)
    ev = fit.evaluate(periodic, error_model.DEFAULT_ERROR_MODEL)[fit.PERIODIC]
    assert ev["coverage"] >= 0.9
    # and steady or decoding loads are never labeled
    assert not any(w.terms.aliasing_period_s is not None for w in ws if w.group != fit.PERIODIC)


# two runs of bench/evidence/telemetry/gpu/h200-2026-12-01 (power and records) and the counter over them, sliced from
# the evidence branch by tests/data/make_evidence_slices.py
GPU_RUNS = "h200-2026-12-01-grid.npz"


def test_grid_placement_recovers_the_dense_calibration():
    """The live sampler's own counter reads (~0.45 s apart, in power.parquet of the 2026-12-01 H200 runs)
    placed on the counter's update grid give, at every 15th query as it became final, the calibration
    ratio that the back-to-back counter (bench/telemetry/gpu_counter.py, counter.csv) gives over the same span,
    within 0.1%; held half a step before each read (the fallback), they were off by up to 0.8%."""
    pytest.importorskip("pandas")
    tables = evidence_slices.tables(GPU_RUNS)
    cnt = tables["counter"]
    dense = integrals.CounterIntegral((cnt["t_before_s"] + cnt["t_after_s"]).to_numpy() / 2, cnt["energy_mj"].to_numpy() / 1000)
    shift = 0.011
    worst_grid = worst_held = 0.0
    for run in ("20261201-053743-d827", "20261201-053807-923e"):
        p = tables[f"{run}-power"]
        ends = tables[f"{run}-records"]["end_s"].to_numpy()
        s, c = p[p["kind"] == "sample"], p[p["kind"] == "counter"]
        st, sw, ct, cj = s["t_s"].to_numpy(), s["power_w"].to_numpy(), c["t_s"].to_numpy(), c["energy_j"].to_numpy()
        for now in ends[::15] + 0.15:
            m, mc = st <= now, ct <= now
            grid = energy_counter.grid_counter_reads(ct[mc], cj[mc], st[m], sw[m], sample_shift_s=shift)
            assert grid is not None
            for placed, worst in (((grid.t_s, grid.j), "grid"), (hold_counter_reads(ct[mc], cj[mc]), "held")):
                cal = est.calibration_ratio(st[m] - shift, sw[m], *placed)
                si = integrals.PowerIntegral(st[m] - shift, sw[m], integrals.MAX_SAMPLE_GAP_S)
                truth = dense.window(cal.start_s, cal.end_s)[0] / si.window(cal.start_s, cal.end_s)[0]
                err = abs(cal.ratio / truth - 1)
                if worst == "grid":
                    worst_grid = max(worst_grid, err)
                else:
                    worst_held = max(worst_held, err)
    assert worst_grid < 0.001
    assert worst_held > 3 * worst_grid


def test_grid_placement_steps_aside_where_samples_do_not_pin_the_phase():
    """On the 2026-11-29 decoding recording (tests/data qtrace) the samples follow the counter less
    closely (3.3 J rms at its steps against 0.3 J on the 2026-12-01 runs), so no phase stands out from
    counter reads 0.6 s apart: the grid is refused and the held placement stays."""
    d = np.load(DATA / "h200_qtrace.npz")
    st = integrals.wall_us_to_mono_s(d["samp_ts_us"], d["pair_t_mono_ns"], d["pair_t_wall_us"])
    ct = (d["energy_t_mono_ns"] + d["energy_call_ns"] / 2) / 1e9
    cj = d["energy_mJ"] / 1000.0
    ticks = np.arange(ct[0] + 5, ct[0] + 65, 0.6)
    reads = cj[np.searchsorted(ct, ticks, side="right") - 1]
    m = (st > ticks[0] - 1) & (st < ticks[-1])
    assert energy_counter.grid_counter_reads(ticks, reads, st[m], d["samp_mW"][m] / 1000.0, sample_shift_s=0.011) is None


def test_grid_placement_refuses_a_counter_off_the_grid():
    """A counter that moves with every read (no update grid): no phase fits better than the reads' own
    times, so the caller keeps its placement."""
    t = np.arange(0.0, 30.0, 0.02)
    p = 200.0 + 100.0 * (np.sin(t) > 0)
    reads = np.arange(0.3, 29.0, 0.61)
    energy = np.interp(reads, t, np.concatenate(([0.0], np.cumsum(np.diff(t) * p[1:]))))
    assert energy_counter.grid_counter_reads(reads, energy, t, p) is None


def test_grid_placement_refuses_reads_at_few_phases():
    """Reads every 0.25 s on the dot see a 100 ms grid at two phases only, so any phase between them fits
    (on the NVML fake this put the ratio 2-3% off): refused; the same counter read with jitter is placed."""
    t = np.arange(0.0, 30.0, 0.02)
    p = 200.0 + 150.0 * ((t % 3.0) < 1.3)
    cum = np.concatenate(([0.0], np.cumsum(np.diff(t) * p[1:])))
    updates = np.arange(0.037, 30.0, 0.1)  # the counter's grid, its phase 37 ms

    def counter(reads):
        return np.interp(updates[np.searchsorted(updates, reads, side="right") - 1], t, cum)

    even = np.arange(1.0, 29.0, 0.25)
    assert energy_counter.grid_counter_reads(even, counter(even), t, p) is None
    jittered = even + np.random.default_rng(5).uniform(0.0, 0.1, even.size)
    grid = energy_counter.grid_counter_reads(jittered, counter(jittered), t, p)
    assert grid is not None and abs(grid.phase_s - 0.037) <= 0.002


def test_grid_placement_places_reads_with_a_wide_phase_gap_elsewhere():
    """15-16 reads ~1.2 s apart (the sampler's rate when a read costs ~6.6 ms; a run of ~19 s) at random
    phases often leave a gap of over 25 ms somewhere in the step (a quarter of the runs with 15 reads).
    Where reads fall close to the updates on both sides (at most 7 ms apart) the phase is still placed,
    between those reads' phases: within 2 ms where they are 4 ms apart or less; where the reads around
    the updates are further apart (in the gap, say), any phase between them fits as well: refused."""
    fine = np.arange(0.0, 25.0, 0.001)

    def power(x):
        return 250.0 + 100.0 * np.sin(2 * np.pi * x / 2.3) + 60.0 * np.sin(2 * np.pi * x / 0.7)

    cum = np.concatenate(([0.0], np.cumsum(np.diff(fine) * power(fine[:-1] + 0.0005))))
    t = np.arange(0.0, 25.0, 0.02)
    close = 0
    for seed in range(10):
        rng = np.random.default_rng(seed)
        p = power(t) + rng.normal(0.0, 5.0, t.size)  # the samples' own noise: 5 W
        n = 15 + seed % 2
        reads = 2.0 + 1.2 * np.arange(n) + rng.uniform(0.0, 0.065, n)  # no read at 65-100 ms
        seen = np.sort(np.mod(reads, 0.1))
        assert max(float(np.max(np.diff(seen))), float(seen[0] + 0.1 - seen[-1])) > 0.025
        for phase in (0.037, 0.082):
            updates = np.arange(phase, 25.0, 0.1)
            counter = np.interp(updates[np.searchsorted(updates, reads, side="right") - 1], fine, cum)
            grid = energy_counter.grid_counter_reads(reads, counter, t, p)
            if phase > seen[-1]:
                assert grid is None, (seed, grid)
                continue
            lo, hi = seen[seen < phase].max(), seen[seen >= phase].min()
            if hi - lo > 0.008:
                assert grid is None, (seed, lo, hi, grid.phase_s)
            elif hi - lo <= 0.007:
                assert grid is not None and lo - 0.001 <= grid.phase_s <= hi + 0.001, (seed, lo, hi, grid)
                if hi - lo <= 0.004:
                    assert abs(grid.phase_s - phase) <= 0.002, (seed, grid.phase_s)
                    close += 1
    assert close >= 3


def test_grid_placement_on_a_short_vllm_run():
    """The vLLM in-process run of bench/evidence/serving/vllm-h200-2026-12-04 (19 s; 16 counter reads, 0.25-2 s
    apart; 15 changes whose phases leave a 31 ms gap): the grid is placed at 70 ms, where the
    back-to-back counter (counter-rest.csv.gz) saw the updates (69-72 ms), and its calibration ratio is
    that counter's within 0.05%; held half a step before each read it came out 0.37% low."""
    pytest.importorskip("pandas")
    # vllm-rest.tar.xz's in-process run and GPU 0's counter-rest.csv.gz over it, sliced from the evidence branch
    # by tests/data/make_evidence_slices.py
    run = evidence_slices.tables("vllm-h200-2026-12-04-inproc.npz")
    p = run["power"]
    s, c = p[p["kind"] == "sample"], p[p["kind"] == "counter"]
    st, sw, ct, cj = s["t_s"].to_numpy(), s["power_w"].to_numpy(), c["t_s"].to_numpy(), c["energy_j"].to_numpy()
    seen = np.sort(np.mod(ct[1:], 0.1))  # the reads that saw a change
    assert ct.size == 16 and float(np.max(np.diff(seen))) > 0.03
    shift = 0.011
    grid = energy_counter.grid_counter_reads(ct, cj, st, sw, sample_shift_s=shift)
    assert grid is not None and 0.069 <= grid.phase_s <= 0.073
    cnt = run["counter"]
    dense = integrals.CounterIntegral((cnt["t_before_s"] + cnt["t_after_s"]).to_numpy() / 2, cnt["energy_mj"].to_numpy() / 1000)
    si = integrals.PowerIntegral(st - shift, sw, integrals.MAX_SAMPLE_GAP_S)
    errors = {}
    for name, placed in (("grid", (grid.t_s, grid.j)), ("held", hold_counter_reads(ct, cj))):
        cal = est.calibration_ratio(st - shift, sw, *placed)
        truth = dense.window(cal.start_s, cal.end_s)[0] / si.window(cal.start_s, cal.end_s)[0]
        errors[name] = cal.ratio / truth - 1
    assert abs(errors["grid"]) < 0.0005 and errors["held"] < -0.003, errors



# --------------------------------------------------------------------------------------------------
# issue 43: ten load shapes recorded for it (bench/telemetry/loads.py, bench/evidence/telemetry/h200-loads), all held out


@pytest.fixture(scope="module")
def loads():
    fit = _fit_module()
    ws = [w for w in fit.loads_recordings() if w.set == "held-out"]  # recording 1's fit shapes left out
    return fit, fit.per_load(ws, error_model.DEFAULT_ERROR_MODEL)


LOAD_SHAPES = {"compute-high", "compute-low", "compute-thin", "compute-fp32", "memory-high", "memory-low",
               "decode-large", "decode-small", "bursty-high", "bursty-low"}


def test_every_load_shape_is_replayed_at_every_window_length(loads, capsys):
    """The replay covers every shape bench/telemetry/loads.py recorded (five recordings), each at 50 ms .. 2 s (a burst's
    windows are whole cycles: 80 ms or 250 ms at the shortest), with enough windows to state a coverage; the
    per-load table (docs/ENERGY.md) is printed (``pytest -s``)."""
    fit, res = loads
    assert set(res) == LOAD_SHAPES
    for load, ev in res.items():
        assert len(ev) >= 3, load
        for group, x in ev.items():
            assert x["n"] >= 37, (load, group)
    with capsys.disabled():
        print("\n" + fit.loads_table("held out: bench/telemetry/loads.py, default constants", res))


def test_held_out_loads_as_measured(loads):
    """What the landed interval does on the held-out shapes (2026-12-04: the samples' noise terms fitted on
    recording 1's compute-high, memory-low, decode-large and bursty-high; recordings 1-5 of the other shapes and
    2, 4 and 5 of those, pooled per shape), so a change to the estimator shows here: from 0.5 s on every shape is
    covered at least 79% (decode-small 80%: on recording 5 its host-paced power defeats the time-share reference,
    docs/ENERGY.md), from 2 s at least 93%; memory and decode at least 77% at every length; the bursts are
    over-covered (the load term: 98-100%); the worst short windows are compute at the power limit with small
    kernels (65-72%: 47% before the capped-noise term, 31% before the noise term)."""
    _, res = loads
    for load, ev in res.items():
        for group, x in ev.items():
            if x["length_s"] >= 0.45:
                assert x["coverage"] >= 0.79, (load, group, x)
            if x["length_s"] >= 1.9:
                assert x["coverage"] >= 0.93, (load, group, x)
            if load.startswith(("memory", "decode")):
                assert x["coverage"] >= 0.77, (load, group, x)
    # at the power limit (compute): the capped-noise term lifted every short window of every compute shape
    for load in ("compute-low", "compute-high", "compute-thin", "compute-fp32"):
        assert min(x["coverage"] for x in res[load].values()) >= 0.63, load
    assert min(x["coverage"] for ev in res.values() for x in ev.values()) >= 0.63


def test_the_counter_resolved_reference_covers_every_steady_load_from_half_a_second():
    """Item 2 of issue 43: against the counter's own increments (windows of whole updates, no assumption about
    the load) every steady shape of every recording is covered at least 94% at 0.5 s (37 of 39: decode-small,
    recording 4) and 100% at 2 s, with errors of at most 0.3% (sd) at 0.5 s and 0.15% at 2 s; below 0.5 s the
    placement of the updates (reads 4-5 ms apart) makes that reference no cleaner than the unit reference
    (docs/ENERGY.md).  Each steady block's counter / samples ratio is 0.998-1.001."""
    fit = _fit_module()
    for rec in fit.LOADS_RECORDINGS:
        for load, x in fit.resolved_reference(fit.EVIDENCE / "h200-loads" / rec, error_model.DEFAULT_ERROR_MODEL).items():
            assert 0.99 < x["counter_over_samples"] < 1.06, (rec, load, x)
            if load.startswith("bursty"):
                continue
            assert 0.998 < x["counter_over_samples"] < 1.001, (rec, load, x)  # steady loads: one ratio
            assert x["500 ms coverage"] >= 0.94 and x["2000 ms coverage"] == 1.0, (rec, load, x)
            assert x["500 ms sd"] <= 0.003 and x["2000 ms sd"] <= 0.0015, (rec, load, x)


def test_the_samples_noise_term_falls_as_one_over_the_root_of_the_duration():
    """``ErrorTerms.noise_j`` is the window's energy x sqrt(sample period / duration) (one period at least), and
    ``ErrorModel.sample_noise`` weighs it into the half-width in quadrature with the other terms."""
    t = np.arange(0.0, 10.0, 0.02)
    si = integrals.PowerIntegral(t, np.full(t.size, 500.0), integrals.MAX_SAMPLE_GAP_S)
    short = error_model.error_terms(si, 4.0, 4.05, 25.0, 1.0, 0.0)
    long = error_model.error_terms(si, 4.0, 6.0, 1000.0, 1.0, 0.0)
    tiny = error_model.error_terms(si, 4.0, 4.01, 5.0, 1.0, 0.0)
    assert short.noise_j == pytest.approx(25.0 * np.sqrt(0.02 / 0.05), rel=0.01)
    assert long.noise_j == pytest.approx(1000.0 * np.sqrt(0.02 / 2.0), rel=0.01)
    assert tiny.noise_j == pytest.approx(5.0)  # shorter than one sample period: the whole energy, not more
    only_noise = error_model.ErrorModel(edge=0.0, within=0.0, calibration_floor=0.0, load=0.0, sample_noise=0.005)
    assert short.half_width_j(only_noise) == pytest.approx(1.645 * 0.005 * short.noise_j)
    assert short.half_width_j(error_model.DEFAULT_ERROR_MODEL) >= short.half_width_j(only_noise)


def test_a_window_at_the_power_limit_takes_the_capped_noise():
    """A window whose mean power is at least ``CAP_SHARE`` of the enforced limit is ``capped``: its samples' noise
    is weighed by ``ErrorModel.capped_noise``, not ``sample_noise``; without a known limit nothing is capped."""
    t = np.arange(0.0, 10.0, 0.02)
    si = integrals.PowerIntegral(t, np.full(t.size, 690.0), integrals.MAX_SAMPLE_GAP_S)
    at = error_model.error_terms(si, 4.0, 4.05, 34.5, 1.0, 0.0, power_limit_w=700.0)
    below = error_model.error_terms(si, 4.0, 4.05, 34.5, 1.0, 0.0, power_limit_w=800.0)  # 690 W is 86% of 800 W
    unknown = error_model.error_terms(si, 4.0, 4.05, 34.5, 1.0, 0.0)
    assert at.capped and not below.capped and not unknown.capped
    only_noise = error_model.ErrorModel(edge=0.0, within=0.0, calibration_floor=0.0, load=0.0, sample_noise=0.005,
                                capped_noise=0.02)
    assert at.half_width_j(only_noise) == pytest.approx(1.645 * 0.02 * at.noise_j)
    assert below.half_width_j(only_noise) == pytest.approx(1.645 * 0.005 * below.noise_j)
    assert error_model.at_power_limit(66.5, 0.1, 700.0) and not error_model.at_power_limit(66.4, 0.1, 700.0)
    assert not error_model.at_power_limit(66.5, 0.0, 700.0) and not error_model.at_power_limit(66.5, 0.1, None)


@pytest.mark.xfail(strict=True, reason="issue 43's target is not met yet: docs/ENERGY.md, 'Coverage per load shape'")
def test_target_holds_on_every_held_out_load_and_length(loads):
    """Issue 43's target: 85-95% coverage at every window length on every held-out load, with the median
    half-width <= 2x the p90 error.  Strict: when the model meets it, this fails (XPASS) until the mark goes."""
    _, res = loads
    for load, ev in res.items():
        for group, x in ev.items():
            assert 0.85 <= x["coverage"] <= 0.95 and x["median_half_width"] <= 2 * x["p90_abs_error"], (load, group)
