"""The ``judge`` scorer: verdict parsing, both-orders pairwise grading, bookkeeping kept apart from the
judged backend, and a real judge run with the local llama.cpp model."""

import json
from pathlib import Path

import pandas as pd
import pytest

from ipw.backends.base import BackendSpec
from ipw.inputs.datasets import Query
from ipw.errors import IpwError
from ipw.grading.spec import JudgeSpec
from ipw.grading.judge import (PROMPTS_DIR, JudgeCall, grade_pairwise, grade_reference, load_prompt, parse_pairwise_verdict,
                       parse_reference_verdict, render)
from runfolders import create, record
from scripted import FixedSensor, ScriptedBackend

ITEMS = [  # (query, output, error) of the judged run
    (Query("n1", "What is 3 + 4?", "7", scorer="numeric"), "3 + 4 makes seven, so 7.", None),
    (Query("m1", "Which planet is red?", "B", ("Venus", "Mars", "Jupiter"), "science", "mcq"), "Mars", None),
    (Query("e1", "Capital of Peru?", "Lima"), "", None),  # empty output: wrong, not judged
    (Query("e2", "Capital of Chile?", "Santiago"), "", "QueryError: timeout"),  # error: 0, not judged
]


def make_run(out: Path) -> Path:
    """A finished run folder of ITEMS (as the runner writes it), without running a model."""
    from ipw.grading.scoring import score

    folder = create(out, "20260101-000000-orig", {"config": {"dataset": "hand-made", "backends": []},
                                                  "dataset": {"name": "hand-made"}, "backends": []})
    for i, (q, output, error) in enumerate(ITEMS):
        folder.append(record(
            run_id=folder.path.name, query_id=q.id, category=q.category, scorer=q.scorer, prompt=q.render(),
            answer=q.answer, output=output, correct=0.0 if error else float(score(q.scorer, output, q.answer, q.choices)),
            error=error, error_category="timeout" if error else None, completion_tokens=3 + i, ttft_s=0.05,
            latency_s=0.2, start_s=float(i), end_s=i + 0.2, energy_j=1.5 + i, net_energy_j=1.0 + i))
    folder.finish("complete")
    return folder.path


@pytest.mark.parametrize("reply,verdict", [
    ("CORRECT", True), ("INCORRECT.", False), ("**Correct**", True), ("correct\n\nThe answer matches.", True),
    ("The answer is correct.", True), ("Verdict: incorrect", False), ("Not correct", False), ("Yes", True),
    ("The answer to grade is incorrect; the correct answer is 7.", False),
    ("CORRECT or INCORRECT", None), ("I cannot tell", None), ("", None),
])
def test_reference_verdicts(reply, verdict):
    assert parse_reference_verdict(reply) is verdict


@pytest.mark.parametrize("reply,verdict", [
    ("A", "A"), ("B.", "B"), ("**B**", "B"), ("TIE", "tie"), ("tie", "tie"), ("Both give 7, so they tie.", "tie"),
    ("Answer A is better.", "A"), ("A, B or TIE.", None), ("A, B", None), ("A and B tie", None), ("hmm", None),
])
def test_pairwise_verdicts(reply, verdict):
    assert parse_pairwise_verdict(reply) == verdict


def test_prompts_are_versioned_files():
    assert {p.name for p in PROMPTS_DIR.glob("*.txt")} >= {"reference-v1.txt", "pairwise-v1.txt"}
    ref = load_prompt("reference-v1", "reference")
    assert ref.version == "reference-v1" and ref.sha256.startswith("sha256:")
    text = render(ref.text, question="Q {{answer_a}}", reference=r"\boxed{7}", response="{{question}}")
    assert r"\boxed{7}" in text and "Q {{answer_a}}" in text and text.count("{{question}}") == 1  # one pass
    with pytest.raises(IpwError, match="placeholders"):
        load_prompt("reference-v1", "pairwise")
    with pytest.raises(IpwError, match="judge prompt 'reference-v9' not found"):
        load_prompt("reference-v9", "reference")


def _call(replies):
    seen = []

    def call(prompt):
        seen.append(prompt)
        return JudgeCall(replies[len(seen) - 1], 20, 1, 0.01, 0.5, "estimated", "model.cpu")

    return call, seen


def test_pairwise_counts_only_when_both_orders_agree():
    template = load_prompt("pairwise-v1", "pairwise").text
    for replies, correct, labels in [
        (["A", "B"], True, ("response", "response")),  # the response wins in both orders
        (["TIE", "TIE"], True, ("tie", "tie")),
        (["A", "A"], False, ("response", "reference")),  # a judge that always picks the first answer
        (["B", "B"], False, ("reference", "response")),
        (["A", "?"], False, ("response", "unparsed")),
    ]:
        call, seen = _call(replies)
        verdict = grade_pairwise(call, template, "Q?", "7", "it is 7")
        assert (verdict.correct, verdict.verdicts) == (correct, labels)
        assert len(verdict.calls) == 2
        # first order: the response is A; second order: the reference is A
        assert seen[0].index("it is 7") < seen[0].index("Answer B") < seen[1].index("it is 7")
    call, _ = _call(["INCORRECT"])
    assert grade_reference(call, load_prompt("reference-v1", "reference").text, "Q", "7", "8").verdicts == ("incorrect",)


# --------------------------------------------------------------------------------------------
# bookkeeping, with a scripted judge backend and a fixed-energy sensor


class ScriptedJudge(ScriptedBackend):
    """Replies CORRECT when the reference text occurs in the graded answer; pairwise: TIE / the answer."""

    def reply(self, prompt):
        if "Answer A:" in prompt:
            return "TIE" if "Mars" in prompt else "A"  # m1 ties both ways; n1 always "A" (position bias)
        return "CORRECT" if "(B) Mars" in prompt else "INCORRECT"


def test_judge_bookkeeping_is_separate(scripted, tmp_path):
    from ipw.inputs.config import load_judge_config
    from ipw.grading.rescore import rescore

    run = make_run(tmp_path / "runs")
    original = pd.read_parquet(run / "records.parquet")
    cfg = tmp_path / "judge.toml"
    cfg.write_text('[judge]\nkind = "scripted"\nmodel = "any"\ngrading = "reference"\n'
                   'usd_per_mtok_in = 1.0\nusd_per_mtok_out = 10.0\n')
    folder = rescore(run, judge=load_judge_config(str(cfg)), out_dir=tmp_path / "judged",
                     probe=lambda backend: [FixedSensor(0.25)])
    frame = pd.read_parquet(folder.path / "records.parquet")
    assert list(frame["correct"]) == [0.0, 1.0, 0.0, 0.0] and set(frame["scorer"]) == {"judge"}
    for col in ("energy_j", "net_energy_j", "best_effort_energy_j", "prompt_tokens", "completion_tokens"):
        assert list(frame[col]) == list(original[col])  # the judge's work is never added to the judged backend
    lines = [json.loads(x) for x in (folder.path / "judge.jsonl").read_text().splitlines()]
    assert [(x["query_id"], x["verdicts"], x["judge_calls"]) for x in lines] == [
        ("n1", ["incorrect"], 1), ("m1", ["correct"], 1), ("e1", ["empty"], 0), ("e2", ["error"], 0)]
    assert lines[0]["prompt_version"] == "reference-v1" and lines[0]["judge_outputs"] == ["INCORRECT"]
    assert (lines[0]["judge_prompt_tokens"], lines[0]["judge_completion_tokens"]) == (100, 2)
    assert lines[0]["judge_energy_j"] == 0.25 and lines[0]["judge_energy_quality"] == "estimated"
    assert lines[0]["judge_cost_usd"] == pytest.approx((100 * 1.0 + 2 * 10.0) / 1e6)
    assert lines[2]["judge_energy_j"] is None and lines[2]["judge_cost_usd"] is None
    judge = folder.manifest.judge
    assert judge["prompt_version"] == "reference-v1" and judge["prompt_sha256"].startswith("sha256:")
    assert judge["backend"]["kind"] == "scripted" and judge["sensors"][0]["name"] == "fixed"
    assert judge["totals"] == {"records": 4, "judged": 2, "calls": 2, "prompt_tokens": 200, "completion_tokens": 4,
                               "energy_j": 0.5, "cost_usd": pytest.approx(2 * 120 / 1e6), "unparsed": 0}
    # the mcq reference is shown with its option text; the question is the prompt the model saw
    assert folder.manifest.rescored_from["scorer"] == "judge"


def test_pairwise_through_rescore(scripted, tmp_path, run_cli):
    run = make_run(tmp_path / "runs")
    code, out, err = run_cli("rescore", run, "--judge", "scripted:any", "--grading", "pairwise", "--out",
                             tmp_path / "judged")
    assert code == 0, err
    (judged,) = list((tmp_path / "judged").iterdir())
    frame = pd.read_parquet(judged / "records.parquet")
    assert list(frame["correct"]) == [0.0, 1.0, 0.0, 0.0]  # n1: "A" in both orders disagrees; m1 ties both
    lines = [json.loads(x) for x in (judged / "judge.jsonl").read_text().splitlines()]
    assert lines[0]["verdicts"] == ["response", "reference"] and lines[1]["verdicts"] == ["tie", "tie"]
    assert lines[0]["prompt_version"] == "pairwise-v1" and lines[0]["judge_calls"] == 2
    assert "4 calls" in err and "not in the records' energy" in err


def test_judge_config_table(tmp_path):
    from ipw.inputs.config import load_config, load_judge_config
    from ipw.grading.rescore import judge_spec

    path = tmp_path / "run.toml"
    path.write_text('''dataset = "ipw-core"
[[backends]]
name = "smol"
kind = "llama-cpp"
model = "smollm2-135m"
n_threads = 1

[judge]
kind = "llama-cpp"
model = "smollm2-135m"
grading = "pairwise"
n_threads = 2
max_tokens = 8
''')
    config = load_config(str(path))
    assert config.judge == JudgeSpec(BackendSpec("judge:llama-cpp:smollm2-135m", "llama-cpp", "smollm2-135m",
                                                 options={"n_threads": 2}), grading="pairwise", max_tokens=8)
    assert load_judge_config(str(path)) == config.judge
    manifest = {"config": json.loads(json.dumps(config.to_dict()))}
    assert judge_spec(manifest) == config.judge  # the run's own [judge] table
    assert judge_spec(manifest, grading="reference").grading == "reference"
    assert judge_spec(manifest, judge="smol").backend.name == "smol"  # a configured backend as the judge
    assert judge_spec({}, judge="llama-cpp:smollm2-135m").backend.kind == "llama-cpp"
    assert judge_spec({}) is None
    path.write_text(path.read_text().replace("max_tokens = 8", "max_token = 8"))
    with pytest.raises(IpwError, match=r"run.toml:13: field 'judge.max_token': unknown key"):
        load_config(str(path))
    path.write_text(path.read_text().replace("max_token = 8", 'grading = "vibes"').replace('grading = "pairwise"\n', ""))
    with pytest.raises(IpwError, match=r"run.toml:\d+: field 'judge.grading': unknown grading 'vibes' \(known: reference, pairwise, vs-backend:NAME\)"):
        load_config(str(path))


@pytest.mark.llama
def test_real_judge_with_llama_cpp(tmp_path, run_cli):
    """SmolLM2-135M as the judge: weak, so only mechanics and bookkeeping are asserted."""
    run = make_run(tmp_path / "runs")
    original = pd.read_parquet(run / "records.parquet")
    for grading, calls in (("reference", 1), ("pairwise", 2)):
        out = tmp_path / grading
        code, _, err = run_cli("rescore", run, "--judge", "llama-cpp:smollm2-135m", "--grading", grading, "--out", out)
        assert code == 0, err
        (judged,) = list(out.iterdir())
        manifest = json.loads((judged / "manifest.json").read_text())
        assert manifest["status"] == "complete"
        assert manifest["judge"]["prompt_version"] == f"{grading}-v1"
        assert manifest["judge"]["engine"]["engine"] == "llama-cpp-python"
        frame = pd.read_parquet(judged / "records.parquet")
        assert list(frame["energy_j"]) == list(original["energy_j"])
        assert set(frame["correct"]) <= {0.0, 1.0} and list(frame["correct"])[2:] == [0.0, 0.0]
        lines = [json.loads(x) for x in (judged / "judge.jsonl").read_text().splitlines()]
        assert [x["judge_calls"] for x in lines] == [calls, calls, 0, 0]
        allowed = {"correct", "incorrect", "unparsed"} if grading == "reference" else {"response", "reference",
                                                                                        "tie", "unparsed"}
        for line, correct in zip(lines[:2], frame["correct"]):
            assert set(line["verdicts"]) <= allowed and line["correct"] == bool(correct)
            assert line["judge_prompt_tokens"] > 50 and line["judge_completion_tokens"] > 0
            assert line["judge_energy_j"] > 0 and line["judge_energy_quality"] == "estimated"
            assert len(line["judge_outputs"]) == calls
        assert manifest["judge"]["totals"]["calls"] == 2 * calls
