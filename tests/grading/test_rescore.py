"""``ipw rescore``: re-score a saved run into a new linked run folder, energy untouched."""

import hashlib
import json
from pathlib import Path

import pandas as pd
import pytest

from ipw.inputs.datasets import Query, load_queries
from ipw.grading.rescore import choices_from_prompt
from ipw.results import RunFolder
from ipw.grading.scoring import score
from runfolders import create, record

DATA = Path(__file__).parents[1] / "data" / "presets"
ENERGY = ["energy_j", "energy_quality", "energy_source", "energy_scope", "best_effort_energy_j", "net_energy_j",
          "energy_parts", "prompt_tokens", "completion_tokens", "ttft_s", "latency_s", "start_s", "end_s"]

ITEMS = [  # (query, output, error)
    (Query("n1", "What is 3 + 4?", "7", scorer="numeric"), "The answer is: 7", None),
    (Query("m1", "Which planet is red?", "B", ("Venus", "Mars", "Jupiter"), "science", "mcq"), "I'd say Mars.", None),
    (Query("e1", "Capital of France?", "Paris", category="geo"), "It is Paris.", None),  # exact: wrong; contains: right
    (Query("e2", "Capital of Spain?", "Madrid", category="geo"), "Madrid", None),
    (Query("e3", "Capital of Peru?", "Lima", category="geo"), "", "QueryError: timeout"),  # an error record
]


def make_run(out: Path, items=ITEMS, run_id="20260101-000000-orig", finish=True, manifest=None) -> Path:
    """A run folder as the runner writes it (records with energy), without running a model."""
    folder = create(out, run_id, {"config": {"dataset": "hand-made", "backends": []},
                                  "dataset": {"name": "hand-made", "fingerprint": "sha256:x"},
                                  "backends": [{"name": "b", "idle_baseline": {"power_w": {"cpu": 1.0}}}],
                                  **(manifest or {})})
    for i, (q, output, error) in enumerate(items):
        folder.append(record(
            run_id=run_id, query_id=q.id, category=q.category, scorer=q.scorer, prompt=q.render(), answer=q.answer,
            output=output, correct=0.0 if error else float(score(q.scorer, output, q.answer, q.choices)),
            error=error, error_category="timeout" if error else None, prompt_tokens=10 + i, completion_tokens=3,
            ttft_s=None if error else 0.05, latency_s=0.2, start_s=float(i), end_s=i + 0.2, energy_j=1.5 + i,
            net_energy_j=1.3 + i, energy_parts=json.dumps([{"component": "cpu", "energy_j": 1.5 + i}]),
        ))
    if finish:
        folder.finish("complete")
    return folder.path


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _new_run(out: Path, original: Path) -> Path:
    (new,) = [p for p in out.iterdir() if p != original]
    return new


def test_same_scorer_reproduces_another_changes(tmp_path, run_cli):
    run = make_run(tmp_path)
    before = _hashes(run)
    original = pd.read_parquet(run / "records.parquet")
    assert list(original["correct"]) == [1.0, 1.0, 0.0, 1.0, 0.0]

    code, out, err = run_cli("rescore", run)  # next to the original by default
    assert code == 0, err
    same = _new_run(tmp_path, run)
    frame = pd.read_parquet(same / "records.parquet")
    assert list(frame["correct"]) == list(original["correct"])
    assert list(frame["scorer"]) == list(original["scorer"])
    assert (frame["run_id"] == same.name).all()
    pd.testing.assert_frame_equal(frame[ENERGY], original[ENERGY])  # energy copied unchanged
    manifest = json.loads((same / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["run_id"] == same.name
    assert manifest["rescored_from"] == {"run_id": run.name, "path": str(run.resolve()), "status": "complete",
                                         "scorer": "per-record (as recorded)"}
    assert manifest["dataset"] == {"name": "hand-made", "fingerprint": "sha256:x"}
    assert manifest["backends"][0]["idle_baseline"] == {"power_w": {"cpu": 1.0}}
    assert "changed" in out and "wrote" in err

    out_dir = tmp_path / "other"
    code, _, err = run_cli("rescore", run, "--scorer", "contains", "--out", out_dir)
    assert code == 0, err
    (changed,) = list(out_dir.iterdir())
    frame = pd.read_parquet(changed / "records.parquet")
    assert list(frame["correct"]) == [1.0, 0.0, 1.0, 1.0, 0.0]  # e1 now right; m1's "B" is not in the output
    assert set(frame["scorer"]) == {"contains"}
    assert frame.loc[4, "error"] == "QueryError: timeout" and frame.loc[4, "correct"] == 0.0  # errors stay 0
    pd.testing.assert_frame_equal(frame[ENERGY], original[ENERGY])
    assert json.loads((changed / "manifest.json").read_text())["rescored_from"]["scorer"] == "contains"
    assert _hashes(run) == before  # the original is never touched


def test_rescore_of_an_unfinished_run_and_a_chain(tmp_path):
    from ipw.grading.rescore import rescore

    run = make_run(tmp_path, finish=False)  # records.jsonl only, status running
    first = rescore(run, scorer="exact", out_dir=tmp_path / "a")
    assert first.manifest.rescored_from["status"] == "running"
    second = rescore(first.path, out_dir=tmp_path / "b")  # a rescored run can be rescored again
    frame = pd.read_parquet(second.path / "records.parquet")
    assert list(frame["correct"]) == [1.0, 0.0, 0.0, 1.0, 0.0] and set(frame["scorer"]) == {"exact"}
    assert second.manifest.rescored_from["run_id"] == first.manifest.run_id


def test_choices_come_back_from_the_rendered_prompt():
    mcq = [q for name in ("mmlu.jsonl", "mmlu_pro.jsonl", "arc.jsonl") for q in load_queries(str(DATA / name))]
    assert mcq and all(choices_from_prompt(q.render()) == q.choices for q in mcq)
    assert choices_from_prompt("What is 2 + 2?") is None
    assert choices_from_prompt("Q\n(B) x\nAnswer with the letter of the correct option.") is None


@pytest.mark.parametrize("args,message", [
    (["--scorer", "fuzzy"], "unknown scorer"),
    (["--scorer", "exact", "--judge", "llama-cpp:smollm2-135m"], "--judge applies to --scorer judge"),
    (["--scorer", "judge"], "--scorer judge needs a judge"),
    (["--grading", "pairwise"], "--grading applies to the judge"),
    (["--judge", "nokind:model"], "unknown backend kind"),
    (["--judge", "llama-cpp:/no/such.gguf"], "not found"),
])
def test_bad_usage_exits_2_and_writes_nothing(args, message, tmp_path, run_cli):
    run = make_run(tmp_path)
    code, _, err = run_cli("rescore", run, *args)
    assert code == 2 and message in err
    assert list(tmp_path.iterdir()) == [run]


def test_not_a_run_folder(tmp_path, run_cli):
    code, _, err = run_cli("rescore", tmp_path)
    assert code == 2 and "not a run folder" in err


@pytest.mark.llama
def test_real_run_with_a_preset_then_rescore(tmp_path, run_cli):
    """The acceptance path: a real llama.cpp run of the GSM8K fixture, scored, then re-scored."""
    out = tmp_path / "res"
    code, _, err = run_cli("run", "--dataset", DATA / "gsm8k.jsonl", "--dataset-preset", "gsm8k", "--limit", "3",
                           "--backend", "llama-cpp:smollm2-135m", "--idle-s", "0", "--warmup", "0", "--out", out)
    assert code == 0, err
    (run,) = list(out.iterdir())
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["config"]["dataset_preset"] == "gsm8k"
    assert manifest["dataset"]["n_queries"] == 3
    original = pd.read_parquet(run / "records.parquet")
    assert list(original["query_id"]) == ["gsm8k-0", "gsm8k-1", "gsm8k-2"]
    assert list(original["answer"]) == ["7", "48", "31"] and set(original["scorer"]) == {"numeric"}
    assert original["error"].isna().all() and (original["completion_tokens"] > 0).all()
    for row in original.itertuples():
        assert row.correct == float(score("numeric", row.output, row.answer))

    code, _, err = run_cli("rescore", run, "--out", tmp_path / "same")
    assert code == 0, err
    (same,) = list((tmp_path / "same").iterdir())
    frame = pd.read_parquet(same / "records.parquet")
    assert list(frame["correct"]) == list(original["correct"])
    pd.testing.assert_frame_equal(frame[ENERGY], original[ENERGY])

    code, _, err = run_cli("rescore", run, "--scorer", "contains", "--out", tmp_path / "contains")
    assert code == 0, err
    (other,) = list((tmp_path / "contains").iterdir())
    frame = pd.read_parquet(other / "records.parquet")
    assert list(frame["correct"]) == [float(score("contains", o, a)) for o, a in zip(original["output"],
                                                                                       original["answer"])]


def test_records_keep_choices_and_rescore_uses_them(tmp_path, run_cli):
    """A record keeps its query's choices (through records.parquet): rescoring an mcq answer needs no
    options rendered in the prompt (issue 20)."""
    q = Query("m1", "Which planet is red?", "B", ("Venus", "Mars", "Jupiter"), "science", "mcq")
    run = make_run(tmp_path, items=[(q, "I'd say Mars.", None)], finish=False)
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    lines = [{**r, "prompt": "Which planet is red?", "choices": list(q.choices)} for r in records]
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    RunFolder.reopen(run).finish("complete")  # records.parquet from records.jsonl
    assert list(pd.read_parquet(run / "records.parquet")["choices"].iloc[0]) == list(q.choices)
    code, out, err = run_cli("rescore", run, "--scorer", "mcq")
    assert code == 0, err
    frame = pd.read_parquet(_new_run(tmp_path, run) / "records.parquet")
    assert list(frame["correct"]) == [1.0] and list(frame["choices"].iloc[0]) == list(q.choices)
