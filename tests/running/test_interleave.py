"""ipw check's interleaved A/B job (ipw.running.interleave, check_interleaved), its work gate and its noise floor.

The scheduler and the verdict are tested with a fake engine whose speed drifts over time: each block's
run folder is written (tests/runfolders.py) with every query's energy scaled by how slow the "machine" was
when that block ran. The command end to end (``ipw check --rerun``) runs real llama.cpp blocks."""

import json
import math
import sys
from pathlib import Path

import pytest

from ipw.analysis.check import check_interleaved, check_runs, parse_threshold
from ipw.errors import IpwError
from ipw.running.interleave import job_plan, run_blocks
from ipw.results import load_run
from runfolders import write_run

N = 12
ENERGY = [1.0 + 0.5 * q for q in range(N)]  # per query, J: queries differ (the pairing is per query)
TOKENS = [10 + q for q in range(N)]
DEFAULT = [parse_threshold(t) for t in ("energy_per_query:+5%", "accuracy:-2pp", "error_rate:+2pp")]


def _greedy(run_dir: Path, temperature: float = 0.0) -> Path:
    """The run as ipw run writes it: its config says how it decoded (the work gate reads it)."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["config"] = {"generation": {"temperature": temperature, "max_tokens": 64}}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return run_dir


def fake_engine(tmp_path: Path, *, n_shards: int = 1, drift_per_block: float = 0.0, effect: float = 0.0,
                tokens_b=TOKENS, burst: dict | None = None):
    """A block runner whose machine gets slower by a factor ``1 + drift_per_block`` with every block (energy follows
    speed on the CPU model), and ``burst[index]`` times slower in the blocks it names (another tenant's load); the
    candidate (B) costs ``1 + effect`` times as much and answers with ``tokens_b``. Query i is in shard
    ``i % n_shards + 1``, as ``ipw run --shard`` splits it."""

    def run_block(index: int, side: str, shard: int) -> Path:
        slow = (1.0 + drift_per_block) ** index * (burst or {}).get(index, 1.0)
        scale = slow * (1.0 + effect if side == "B" else 1.0)
        tokens = tokens_b if side == "B" else TOKENS
        mine = [i for i in range(N) if i % n_shards + 1 == shard]
        run = write_run(tmp_path / f"{index:02d}-{side}", f"block{index}",
                        {"smol": {"correct": [1] * len(mine), "energy": [ENERGY[i] * scale for i in mine],
                                  "tokens": [tokens[i] for i in mine]}},
                        query_ids=[f"q{i}" for i in mine], shard=(shard, n_shards) if n_shards > 1 else None)
        return _greedy(run)

    return run_block


def _job(tmp_path, plan=job_plan(16, 4), **engine):
    n_shards = max(shard for _, shard in plan)
    blocks = run_blocks(plan, fake_engine(tmp_path, n_shards=n_shards, **engine))
    return blocks, [(b.side, *load_run(b.run_dir)) for b in blocks]


def _row(result, metric):
    return next(v for v in result.verdicts if v.metric == metric)


def test_job_plan():
    assert job_plan(4) == (("A", 1), ("B", 1), ("B", 1), ("A", 1))
    plan = job_plan(16, 4)
    assert "".join(side for side, _ in plan) == "ABBAABBAABBAABBA"
    assert [shard for _, shard in plan] == [1, 1, 2, 2, 3, 3, 4, 4] * 2  # two rounds of four shards, a pair each
    assert job_plan(8, 4) == tuple((side, k + 1) for k in range(4) for side in ("AB" if k % 2 == 0 else "BA"))
    for bad in (2, 6, 0):
        with pytest.raises(IpwError, match="multiple of 4"):
            job_plan(bad)
    with pytest.raises(IpwError, match="whole number of rounds"):
        job_plan(12, 4)


def test_linear_drift_cancels_in_the_verdict(tmp_path):
    """The machine slows by 1% per block, A and B are the same: the verdict over the pairs (A B, B A, ...) sees no
    change at all, while two of the same blocks compared one after the other (what a baseline recorded earlier
    sees) would fail."""
    blocks, loaded = _job(tmp_path, drift_per_block=0.01)
    assert [(b.side, b.shard) for b in blocks] == list(job_plan(16, 4)) and [b.index for b in blocks] == list(range(16))
    result = check_interleaved(loaded, DEFAULT)
    energy = _row(result, "energy_per_query")
    assert energy.change == pytest.approx(0.0, abs=1e-9) and energy.status == "pass"
    assert result.blocks == tuple("ABBAABBAABBAABBA") and result.exit_code == 0
    drift = next(d for d in result.drift if d.metric == "energy_per_query")
    assert drift.change == pytest.approx(100 * (1.01 ** 8 - 1))  # each shard's A block of round 2, 8 blocks on
    assert energy.floor == pytest.approx(drift.change / 2) and "half the drift" in energy.floor_source
    # the baseline and candidate columns pool each side's blocks: every query's mean over its two A blocks
    assert energy.n_queries == N
    assert any("mean of the 8 block pairs' changes" in n for n in result.notes)
    sequential = check_runs(*loaded[0][1:], *loaded[9][1:], DEFAULT)  # shard 1: its first A, its last B (+9.4%)
    assert _row(sequential, "energy_per_query").status == "regression"


def test_a_real_change_is_measured_through_the_drift(tmp_path):
    _, loaded = _job(tmp_path, drift_per_block=0.01, effect=0.12)
    energy = _row(check_interleaved(loaded, DEFAULT), "energy_per_query")
    assert energy.change == pytest.approx(12.0) and energy.status == "regression"
    assert energy.ci_lo < 12.0 < energy.ci_hi and energy.p_value < 1e-4
    # a change within half the drift is not called: +4% under a drift of +8.3% (floor 4.1%)
    _, loaded = _job(tmp_path / "small", drift_per_block=0.01, effect=0.04)
    energy = _row(check_interleaved(loaded, DEFAULT), "energy_per_query")
    assert energy.change == pytest.approx(4.0) and energy.status == "pass"


def test_a_burst_over_whole_blocks_is_noise_not_a_regression(tmp_path):
    """Another tenant's load makes blocks 1-2 and 5-6 (B B in the middle of A B B A, twice) 25% slower; the code is
    the same. Pooled over queries, every B query is dearer and the bootstrap calls it a regression; over the 8 block
    pairs the change (+11.8%) is no more than 2.6 standard errors from 0: not significant, so not a failure."""
    burst = {1: 1.25, 2: 1.25, 5: 1.25, 6: 1.25}
    _, loaded = _job(tmp_path, burst=burst)
    result = check_interleaved(loaded, DEFAULT)
    energy = _row(result, "energy_per_query")
    assert energy.change == pytest.approx(100 * (math.sqrt(1.25) - 1))
    assert energy.status == "inconclusive" and 0.01 < energy.p_value < 0.05 and result.exit_code == 0
    pooled_a = [(m, f) for side, m, f in loaded if side == "A"]
    pooled_b = [(m, f) for side, m, f in loaded if side == "B"]
    from ipw.analysis.check import pool_blocks

    by_queries = _row(check_runs(*pool_blocks(pooled_a), *pool_blocks(pooled_b), DEFAULT), "energy_per_query")
    assert by_queries.change == pytest.approx(12.5) and by_queries.status == "regression"


def test_pool_blocks_makes_one_run_of_the_whole_query_set(tmp_path):
    """pool_blocks (a round of blocks as one committed baseline: bench/gate/gate_blocks.py): blocks of every shard
    pool into one run of the whole query set, each block a repeat; a round that misses a shard is refused."""
    from ipw.analysis.check import pool_blocks

    _, loaded = _job(tmp_path)  # job_plan(16, 4): blocks 0-7 are round 1, every shard once a side
    round_a = [(m, f) for side, m, f in loaded[:8] if side == "A"]
    manifest, frame = pool_blocks(round_a)
    assert manifest.shard is None and manifest.dataset == round_a[0][0].shard["dataset"]
    assert sorted(frame["query_id"]) == sorted(f"q{i}" for i in range(N))
    assert sorted(frame["repeat"].unique()) == [0, 1, 2, 3]
    with pytest.raises(IpwError, match="every shard"):
        pool_blocks(round_a[:3])


def test_four_whole_blocks_still_work(tmp_path):
    """--blocks 4 --shards 1 is the plain A B B A of whole runs: two pairs, one degree of freedom."""
    _, loaded = _job(tmp_path, plan=job_plan(4), effect=0.10)
    result = check_interleaved(loaded, DEFAULT)
    energy = _row(result, "energy_per_query")
    assert energy.change == pytest.approx(10.0) and energy.status == "regression"  # both pairs agree exactly
    assert any("2 block pairs" in n and "1 degrees of freedom" in n for n in result.notes)


def test_an_unbalanced_job_is_refused(tmp_path):
    _, loaded = _job(tmp_path, plan=(("A", 1), ("B", 1), ("B", 1)))
    with pytest.raises(IpwError, match="pairs of blocks, one A and one B"):
        check_interleaved(loaded, DEFAULT)
    _, loaded = _job(tmp_path / "aa", plan=(("A", 1), ("A", 1), ("B", 1), ("B", 1)))
    with pytest.raises(IpwError, match="pairs of blocks, one A and one B"):
        check_interleaved(loaded, DEFAULT)


def test_work_gate_counts_tokens_exactly(tmp_path):
    """Answers 2x as long on the same queries: a regression of the work gate, whatever the energy did."""
    _, loaded = _job(tmp_path, tokens_b=[2 * t for t in TOKENS])
    result = check_interleaved(loaded, DEFAULT)
    out = _row(result, "output_tokens")
    assert (out.baseline, out.candidate, out.status) == (sum(TOKENS), 2 * sum(TOKENS), "regression")
    assert out.detail == f"{N} of {N} queries differ" and result.exit_code == 1
    assert _row(result, "energy_per_query").status == "pass"  # the fake engine's energy did not move
    # one query one token shorter: reported as changed, not a failure unless --strict
    fewer = list(TOKENS)
    fewer[3] -= 1
    _, loaded = _job(tmp_path / "fewer", tokens_b=fewer)
    out = _row(check_interleaved(loaded, DEFAULT), "output_tokens")
    assert (out.status, out.detail) == ("changed", f"1 of {N} queries differ")


def test_work_gate_skips_sampled_runs(tmp_path):
    base = _greedy(write_run(tmp_path / "b", "b", {"smol": {"correct": [1] * N, "energy": ENERGY, "tokens": TOKENS}}))
    cand = _greedy(write_run(tmp_path / "c", "c", {"smol": {"correct": [1] * N, "energy": ENERGY,
                                                            "tokens": [t + 1 for t in TOKENS]}}), temperature=0.7)
    result = check_runs(*load_run(base), *load_run(cand), DEFAULT)
    assert not any(v.threshold == "exact" for v in result.verdicts)
    assert any("work gate not applied" in n for n in result.notes)


def test_calibrated_floor(tmp_path, run_cli):
    """Three identical runs at 1.00, 1.04 and 0.98 times the energy: the floor is the largest change between two
    of them, the earlier as baseline (1.04 -> 0.98: -5.77%); a +5.5% candidate is then inconclusive (noise),
    without the floor a regression."""
    runs = [_greedy(write_run(tmp_path / f"r{i}", f"r{i}", {"smol": {"correct": [1] * N, "tokens": TOKENS,
                                                                      "energy": [e * s for e in ENERGY]}}))
            for i, s in enumerate((1.00, 1.04, 0.98))]
    floor = tmp_path / "floor.json"
    code, out, err = run_cli("check", "--calibrate", *runs, "--floor", floor)
    assert code == 0, out + err
    data = json.loads(floor.read_text())
    assert data["n_runs"] == 3 and data["floors"]["smol"]["energy_per_query"] == pytest.approx(100 * (1 - 0.98 / 1.04),
                                                                                                abs=1e-3)
    cand = _greedy(write_run(tmp_path / "cand", "cand", {"smol": {"correct": [1] * N, "tokens": TOKENS,
                                                                  "energy": [e * 1.055 for e in ENERGY]}}))
    md = tmp_path / "v.md"
    code, out, err = run_cli("check", runs[0], cand, "--floor", floor, "--markdown", md)
    assert code == 0, out + err
    row = next(line for line in md.read_text().splitlines() if "| energy_per_query |" in line)
    assert "inconclusive" in row and "±5.77%" in row
    code, out, err = run_cli("check", runs[0], cand)
    assert code == 1, out + err
    code, _, err = run_cli("check", "--calibrate", runs[0], "--floor", floor)
    assert code == 2 and "at least 2 run folders" in err


def test_usage_errors(tmp_path, run_cli):
    code, _, err = run_cli("check", "--rerun", tmp_path / "a.toml", tmp_path / "b.toml")
    assert code == 2 and "not found" in err
    code, _, err = run_cli("check", "--rerun", "--blocks", "6", tmp_path / "a.toml", tmp_path / "b.toml")
    assert code == 2 and "multiple of 4" in err
    code, _, err = run_cli("check", tmp_path / "a", tmp_path / "b", "--base-python", "python3")
    assert code == 2 and "--base-python: only with --rerun" in err
    code, _, err = run_cli("check", tmp_path / "a", tmp_path / "b", "--floor", tmp_path / "nope.json")
    assert code == 2 and "--floor" in err


STORIES = ["apple", "river", "house", "green"]


def test_rerun_compares_the_configs_before_the_first_block(tmp_path, run_cli, monkeypatch):
    """Configs on other query sets, or a baseline backend the candidate lacks: one line naming what differs,
    exit 2, before any block runs (not after all of them)."""
    import ipw.running.interleave

    def no_blocks(*args, **kwargs):
        raise AssertionError("a block ran")

    monkeypatch.setattr(ipw.running.interleave, "run_blocks", no_blocks)
    for name, words in (("a", STORIES), ("b", STORIES[:3])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"id": f"s{i}", "prompt": f"Say {w}.", "answer": w})
                                                        + "\n" for i, w in enumerate(words)))

    def config(name: str, dataset: str, backend: str) -> Path:
        path = tmp_path / f"{name}.toml"
        path.write_text(f'dataset = "{tmp_path / dataset}"\n[[backends]]\nname = "{backend}"\nkind = "llama-cpp"\n'
                        'model = "smollm2-135m"\n')
        return path

    base = config("base", "a.jsonl", "smol")
    for cand, expected in ((config("other-data", "b.jsonl", "smol"), "the query sets differ (dataset "),
                           (config("other-name", "a.jsonl", "smol2"),
                            "backend(s) smol of the baseline missing from the candidate (its backends: smol2)")):
        code, out, err = run_cli("check", "--rerun", base, cand, "--out", tmp_path / "jobs")
        assert code == 2 and err.count("\n") == 1 and "not comparable" in err and expected in err, out + err
        assert not (tmp_path / "jobs").exists()
    code, _, err = run_cli("check", "--rerun", base, config("same", "a.jsonl", "smol"), "--limit", "3",
                           "--out", tmp_path / "jobs")
    assert code == 3 and "a block ran" in err  # comparable: on to the blocks
    code, _, err = run_cli("check", "--rerun", base, config("other-limit", "b.jsonl", "smol"), "--limit", "3",
                           "--out", tmp_path / "jobs2")
    assert code == 3 and "a block ran" in err  # the job's --limit: the same 3 queries


@pytest.mark.llama
def test_rerun_catches_doubled_max_tokens_exactly(tmp_path, run_cli):
    """``ipw check --rerun`` with real llama.cpp blocks: max_tokens 8 -> 16 on prompts whose answers run to the
    limit doubles every query's output tokens, and the work gate says so exactly."""
    data = tmp_path / "stories.jsonl"
    data.write_text("".join(json.dumps({"id": f"s{i}", "prompt": f"Write a long story about a {w}.", "answer": w,
                                        "scorer": "contains"}) + "\n" for i, w in enumerate(STORIES)))
    configs = []
    for name, max_tokens in (("base", 8), ("cand", 16)):
        configs.append(tmp_path / f"{name}.toml")
        configs[-1].write_text(f'dataset = "{data}"\nwarmup = 0\nidle_s = 0\n[generation]\nmax_tokens = {max_tokens}\n'
                               'temperature = 0.0\n[[backends]]\nname = "smol"\nkind = "llama-cpp"\n'
                               'model = "smollm2-135m"\nn_threads = 1\n')
    # the baseline's interpreter, as another checkout's venv would be: a wrapper that notes each block it runs
    marks = tmp_path / "base-python-ran"
    base_python = tmp_path / "base-python"
    base_python.write_text(f'#!/bin/sh\necho block >> "{marks}"\nexec "{sys.executable}" "$@"\n')
    base_python.chmod(0o755)
    md = tmp_path / "v.md"
    code, out, err = run_cli("check", "--rerun", *configs, "--out", tmp_path / "jobs", "--markdown", md,
                             "--base-python", base_python, "--blocks", "8", "--shards", "2")
    assert code == 1, out + err
    (job,) = list((tmp_path / "jobs").iterdir())
    assert sorted(p.name for p in job.iterdir()) == ["01-A", "02-B", "03-B", "04-A", "05-A", "06-B", "07-B", "08-A"]
    assert marks.read_text().count("block") == 4  # the four A blocks, and only they
    shards = [load_run(next(d for d in (job / name).iterdir() if d.is_dir()))[0].shard for name in ("01-A", "04-A")]
    assert [(s["index"], s["count"]) for s in shards] == [(1, 2), (2, 2)]  # each pair runs its shard
    row = next(line for line in md.read_text().splitlines() if "| output_tokens |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert int(cells[4]) == 2 * int(cells[3]) == 2 * 8 * len(STORIES), row
    assert "4 of 4 queries differ" in row and "regression" in row
    assert "drift of the A blocks from the first round to the last: smol: energy" in md.read_text()


def _stated(tmp_path: Path, run_id: str, scale: float, rel: float, source: str, quality: str) -> Path:
    """A run whose readings state a ±90% ``uncertainty_j`` of ``rel`` of their energy (ipw.telemetry.uncertainty)."""
    from runfolders import create, record

    # both runs on one machine ("vm"), whose backend's CPU model states its coefficient (the key of its shared error)
    sensor = {"name": "c", "source": source, "params": {"watts_per_core": 6.25, "basis": "test"}}
    folder = create(tmp_path, run_id, {"command": ["test"], "config": {"generation": {"temperature": 0.0}},
                                       "dataset": {"name": "fixture", "n_queries": N, "fingerprint": "sha256:x"},
                                       "backends": [{"name": "b", "kind": "k", "model": "m", "role": "local",
                                                     "sensors": [sensor]}]})
    for i, e in enumerate(ENERGY):
        part = {"component": "c", "energy_j": e * scale, "source": source, "quality": quality, "scope": "cpu",
                "duration_s": 0.05, "note": "", "uncertainty_j": rel * e * scale}
        folder.append(record(run_id=run_id, query_id=f"q{i}", energy_j=e * scale, energy_quality=quality, node="vm",
                             energy_source=source, energy_parts=json.dumps([part]), completion_tokens=TOKENS[i]))
    folder.finish("complete")
    return folder.path


def test_stated_uncertainty_is_a_floor(tmp_path):
    """Readings with an independent ±30% each: a +12% change is within what the stated uncertainty alone moves
    the change (its floor), so inconclusive; the same energies stated by the CPU model (one shared error for
    every query of both runs on one machine) cancel in the change: no floor from them, and a note says so."""
    base = load_run(_stated(tmp_path / "b", "b", 1.0, 0.30, "rapl", "measured"))
    cand = load_run(_stated(tmp_path / "c", "c", 1.12, 0.30, "rapl", "measured"))
    energy = _row(check_runs(*base, *cand, DEFAULT), "energy_per_query")
    assert energy.change == pytest.approx(12.0)
    assert energy.floor > 12.0 and energy.floor_source == "the stated measurement uncertainty (95%)"
    assert energy.status == "inconclusive"
    base = load_run(_stated(tmp_path / "mb", "mb", 1.0, 0.60, "model.cpu", "estimated"))
    cand = load_run(_stated(tmp_path / "mc", "mc", 1.12, 0.60, "model.cpu", "estimated"))
    result = check_runs(*base, *cand, DEFAULT)
    energy = _row(result, "energy_per_query")
    assert energy.status == "regression" and energy.floor != energy.floor  # NaN: no floor
    assert any("shared error (±60% at 90%" in n and "cancels in the change" in n for n in result.notes)


def test_work_gate_reports_a_backend_whose_blocks_disagree(tmp_path):
    """A batching server's answers can change from block to block (the embedded default's llama-server at 4 in
    flight did, once in 24 queries): when a side's own blocks differ, its token counts cannot fail the gate."""
    def run_block(index: int, side: str, shard: int) -> Path:
        tokens = list(TOKENS)
        if index == 3:  # the last A block: one answer a token longer than in the first
            tokens[5] += 1
        if side == "B":
            tokens[7] += 2
        return _greedy(write_run(tmp_path / f"{index:02d}-{side}", f"block{index}",
                                 {"smol": {"correct": [1] * N, "energy": ENERGY, "tokens": tokens}}))

    blocks = run_blocks(job_plan(4), run_block)
    result = check_interleaved([(b.side, *load_run(b.run_dir)) for b in blocks], DEFAULT)
    out = _row(result, "output_tokens")
    assert out.status == "changed" and out.candidate > out.baseline and result.exit_code == 0
    assert any("A blocks differ among themselves" in n for n in result.notes)


def test_work_gate_reports_a_batched_backend(tmp_path):
    base = _greedy(write_run(tmp_path / "b", "b", {"srv": {"correct": [1] * N, "energy": ENERGY, "tokens": TOKENS,
                                                            "concurrency": 4}}))
    cand = _greedy(write_run(tmp_path / "c", "c", {"srv": {"correct": [1] * N, "energy": ENERGY, "concurrency": 4,
                                                            "tokens": [t + 1 for t in TOKENS]}}))
    result = check_runs(*load_run(base), *load_run(cand), DEFAULT)
    assert _row(result, "output_tokens").status == "changed" and result.exit_code == 0
    assert any("served 4 requests at once" in n for n in result.notes)
