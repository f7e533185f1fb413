"""ipw check sees failures (issue 20): a candidate whose answers fail on 30% of the queries is a
regression, by default, on the error rate and on accuracy (failed queries count as incorrect). No engine:
the run folders are written with the shared helper."""

from pathlib import Path

from runfolders import write_run

GOLDEN = Path(__file__).parents[1] / "golden" / "check_failing_candidate.md"
N = 20


def _runs(tmp_path: Path) -> tuple[Path, Path]:
    base = {"smol": {"correct": [1] * 16 + [0] * 4, "energy": [2.0] * N, "tokens": [10] * N}}
    failed = {0, 3, 7, 10, 13, 17}  # 6 of 20: 30%
    assert len(failed) == 6
    cand = {"smol": {
        "correct": [0 if i in failed else c for i, c in enumerate(base["smol"]["correct"])],
        # a timed-out query was measured; a crashed engine's was not (it is missing, not 0 J)
        "energy": [None if i in (0, 10) else 2.0 for i in range(N)],
        "ttft": [None if i in failed else 0.1 for i in range(N)],
        "tokens": [0 if i in failed else 10 for i in range(N)],
        "error": ["timeout" if i in failed else None for i in range(N)],
    }}
    return write_run(tmp_path / "base", "base", base), write_run(tmp_path / "cand", "cand", cand)


def test_thirty_percent_failed_candidate_exits_1(tmp_path, run_cli):
    base, cand = _runs(tmp_path)
    md = tmp_path / "verdict.md"
    code, out, err = run_cli("check", base, cand, "--markdown", md)
    assert code == 1, out + err
    text = md.read_text()
    assert text == GOLDEN.read_text(), text  # the golden verdict table
    rows = {line.split("|")[2].strip(): line for line in text.splitlines() if line.startswith("| smol")}
    assert "regression" in rows["error_rate"] and "+30.00pp" in rows["error_rate"]
    assert "regression" in rows["accuracy"]  # the 6 failed queries count as incorrect: 80% -> 55%
    assert "6 of 20 candidate queries failed (counted incorrect)" in text
    assert "2 of 20 candidate queries have no energy" in text


def test_old_metric_names_are_aliases(tmp_path, run_cli):
    base, cand = _runs(tmp_path)
    code, out, err = run_cli("check", base, base, "--fail-if", "energy_per_query:+15%", "--fail-if",
                             "accuracy:-2pp", "--fail-if", "errors:+2pp", "--fail-if", "j_per_token:+10%",
                             "--fail-if", "ttft_p50:+20%")
    assert code == 0, out + err
    code, out, err = run_cli("check", base, cand, "--fail-if", "errors:+2pp")
    assert code == 1, out + err


def test_runs_made_before_phases_are_checked(tmp_path, run_cli):
    """Records without the phase columns (runs made before phases): check reads them as unknown."""
    import pandas as pd

    base, _ = _runs(tmp_path)
    frame = pd.read_parquet(base / "records.parquet")
    frame.drop(columns=["prefill_energy_j", "decode_energy_j", "choices"]).to_parquet(base / "records.parquet",
                                                                                      index=False)
    code, out, err = run_cli("check", base, base)
    assert code == 0, out + err


def test_a_baseline_of_0_j_is_not_comparable(tmp_path, run_cli):
    """0 J on every baseline query: no energy to compare against (exit 2, one line), not a ZeroDivisionError."""
    base = write_run(tmp_path / "base", "base", {"smol": {"correct": [1] * N, "energy": [0.0] * N}})
    cand = write_run(tmp_path / "cand", "cand", {"smol": {"correct": [1] * N, "energy": [2.0] * N}})
    for thresholds in ([], ["--fail-if", "j_per_token:+5%"], ["--fail-if", "ipj:-5%"]):
        code, out, err = run_cli("check", base, cand, *thresholds)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in out + err, err
        assert "the baseline has 0 J on every query, no energy to compare" in err


def test_github_notes_cannot_forge_a_workflow_command(tmp_path, run_cli):
    """A backend name from a run folder (a config refuses it) with a newline and ``::error``: every note and
    annotation stays one line, escaped as GitHub's workflow commands are (% CR LF as %25 %0D %0A)."""
    name = "b\n::error::x"
    energy = [None] + [2.0] * (N - 1)  # a query without energy: a note that names the backend
    base = write_run(tmp_path / "base", "base", {name: {"correct": [1] * N, "energy": energy}})
    cand = write_run(tmp_path / "cand", "cand", {name: {"correct": [1] * N, "energy": [None] + [4.0] * (N - 1)}})
    code, out, err = run_cli("check", base, cand, "--github")
    assert code == 1, out + err  # twice the energy: an annotation too
    commands = [line for line in out.splitlines() if line.lstrip().startswith("::")]
    assert commands and all(line.startswith("::error title=ipw check regression") for line in commands), commands
    assert f"note: b%0A::error::x: 1 of {N} baseline queries have no energy" in out
    code, out, err = run_cli("check", base, cand)  # without --github: one line each too
    assert not [line for line in out.splitlines() if line.lstrip().startswith("::")], out
    assert f"note: b\\n::error::x: 1 of {N} baseline queries have no energy" in out
