"""Coverage as the paper defines it: a judge compares each answer with a reference backend's answer to
the same query, in both orders (``--grading vs-backend:NAME``).  A scripted judge pins the win/tie
rule, order disagreement and unparsed replies; a real llama.cpp judge grades a handful of chat items."""

import json
from pathlib import Path

import pandas as pd
import pytest

from ipw.backends.base import BackendSpec
from ipw.errors import IpwError
from ipw.grading.spec import JudgeSpec, orders_agree
from runfolders import create, record
from scripted import FixedSensor, ScriptedBackend

# (query_id, scorer, answer, local output, cloud output, local error); the outputs carry the words the
# scripted judge reacts to
ITEMS = [
    ("c1", "judge", "", "GOOD tip: water less", "GOOD tip: more light", None),  # tie both orders -> covered
    ("c2", "judge", "", "BEST poem", "plain poem", None),  # local wins both orders -> covered
    ("c3", "judge", "", "plain advice", "BEST advice", None),  # cloud wins both orders -> not covered
    ("c4", "judge", "", "LEFT biased", "other text", None),  # judge always says "A": the orders disagree
    ("c5", "judge", "", "MUMBLE reply", "some text", None),  # unparsed reply -> not covered
    ("c6", "judge", "", "", "some text", None),  # empty local output -> not covered, not judged
    ("c7", "judge", "", "", "", "QueryError: timeout"),  # local error -> not covered, not judged
    ("c8", "judge", "", "an answer", "", None),  # the cloud answer failed -> nothing to compare: unscored
    ("m1", "numeric", "7", "7", "7", None),  # dataset item: correct kept, and judged (tie)
]


class ScriptedJudge(ScriptedBackend):
    """TIE when both answers say GOOD or the item is m1; the answer saying BEST wins; "A" whenever the
    local answer says LEFT (position bias); an unreadable reply for MUMBLE."""

    def tokens(self, prompt, text):
        return 80, 1

    def reply(self, prompt):
        a = prompt.split("Answer A:\n", 1)[1].split("\n\nAnswer B:", 1)[0]
        b = prompt.split("Answer B:\n", 1)[1].split("\n\n", 1)[0]
        if "MUMBLE" in a + b:
            return "I would rather not say."
        if "LEFT" in a + b:
            return "A"
        if "GOOD" in a and "GOOD" in b or a == b:
            return "TIE"
        return "A" if "BEST" in a else "B"


def make_run(out: Path, items=ITEMS, prompts=None) -> Path:
    """A finished run of a local and a cloud-role backend over ``items``, as the runner writes it."""
    folder = create(out, "20260101-000000-chat", {"config": {"dataset": "hand-made", "backends": []},
                                                  "dataset": {"name": "hand-made"}, "backends": []})
    for backend, role in (("local", "local"), ("cloud", "cloud")):
        for qid, scorer, answer, local_out, cloud_out, error in items:
            output = local_out if backend == "local" else cloud_out
            err = error if backend == "local" else None
            correct = 0.0 if err else (None if scorer == "judge" else float(output.strip() == answer))
            folder.append(record(run_id=folder.path.name, backend=backend, model=backend, role=role, query_id=qid,
                                 category="chat" if scorer == "judge" else "arithmetic", scorer=scorer,
                                 prompt=(prompts or {}).get(qid, f"Request {qid}"), answer=answer, output=output, correct=correct, error=err,
                                 error_category="timeout" if err else None))
    folder.finish("complete")
    return folder.path


def spec(vs="cloud"):
    return JudgeSpec(BackendSpec("judge:scripted", "scripted", "any"), grading=f"vs-backend:{vs}")


def test_win_tie_rule_order_disagreement_and_unparsed(scripted, tmp_path):
    from ipw.grading.rescore import rescore

    run = make_run(tmp_path / "runs")
    folder = rescore(run, judge=spec(), out_dir=tmp_path / "judged", probe=lambda backend: [FixedSensor(0.5)])
    frame = pd.read_parquet(folder.path / "records.parquet")
    local = frame[frame["backend"] == "local"].set_index("query_id")
    cloud = frame[frame["backend"] == "cloud"].set_index("query_id")
    win_tie = {q: (None if pd.isna(v) else v) for q, v in local["win_tie"].items()}
    assert win_tie == {"c1": 1.0, "c2": 1.0, "c3": 0.0, "c4": 0.0, "c5": 0.0, "c6": 0.0, "c7": 0.0,
                       "c8": None, "m1": 1.0}
    verdicts = {q: tuple(v) for q, v in local["judge_verdicts"].items()}
    assert verdicts["c1"] == ("tie", "tie") and verdicts["c2"] == ("response", "response")
    assert verdicts["c3"] == ("reference", "reference")
    assert verdicts["c4"] == ("response", "reference")  # "A" both times: the position, not the answer, won
    assert verdicts["c5"] == ("unparsed", "unparsed")
    assert verdicts["c6"] == ("empty",) and verdicts["c7"] == ("error",) and verdicts["c8"] == ("unscored",)
    assert [orders_agree(verdicts[q]) for q in ("c1", "c2", "c3", "c4", "c5", "c6")] == [True, True, True, False,
                                                                                          None, None]
    # the dataset score is kept apart: chat items stay unscored, the numeric item keeps its score
    assert local["correct"].isna().sum() == 8 and local.loc["m1", "correct"] == 1.0
    # a failed chat item has no answer to be wrong against: unscored, still an error and not covered
    assert pd.isna(local.loc["c7", "correct"]) and local.loc["c7", "error"] and local.loc["c7", "win_tie"] == 0.0
    # the reference backend is not judged against itself
    assert cloud["win_tie"].isna().all() and set(frame["vs_backend"]) == {"cloud"}
    # bookkeeping: only the judged records cost calls, and the cost is kept out of the records' energy
    lines = [json.loads(x) for x in (folder.path / "judge.jsonl").read_text().splitlines()]
    assert len(lines) == 9 and sum(x["judge_calls"] for x in lines) == 12  # 6 judged records x 2 orders
    assert all(x["vs_backend"] == "cloud" for x in lines)
    assert folder.manifest.judge["totals"]["energy_j"] == pytest.approx(12 * 0.5)
    assert folder.manifest.judge["totals"]["unparsed"] == 1
    assert folder.manifest.rescored_from["vs_backend"] == "cloud"
    assert list(frame["energy_j"]) == [1.0] * 18
    # compare (and so the report and the run's end) shows the judge apart: verdicts, order agreement, its energy
    from ipw.analysis.compare import compare
    from ipw.analysis.render import judge_table, to_dict

    c = compare([folder.path])
    rows = {r.category: r for r in c.judge}
    assert set(rows) == {"", "chat", "arithmetic"} and {r.backend for r in c.judge} == {"local"}
    overall = rows[""]  # judged: c1-c5 and m1; covered: c1, c2, m1; both orders parsed: all but c5, c4 disagrees
    assert (overall.records, overall.judged, overall.unparsed, overall.calls) == (9, 6, 1, 12)
    assert overall.orders_agree == pytest.approx(4 / 5)
    assert overall.energy_j == pytest.approx(6.0) and overall.energy_quality == "estimated"
    chat = rows["chat"]
    assert (chat.records, chat.judged, chat.orders_agree) == (8, 5, pytest.approx(3 / 4))
    assert (rows["arithmetic"].judged, rows["arithmetic"].orders_agree) == (1, 1.0)
    (table,) = judge_table(c)
    assert table.rows[0][:5] == ["local", "all", "6 of 9", "80.0%", "1"]
    assert table.est[0][-1] and not table.est[0][3]  # the judge's energy is an estimate here, marked
    # what it decided is defined once: win/tie over the records that have one (c1-c7, m1; c8 has none)
    assert c.metrics["local"]["win_tie_rate"].value == pytest.approx(3 / 8)
    assert to_dict(c)["judge"][0]["orders_agree"] == pytest.approx(0.8)
    # ... and the report: coverage both ways per category, and the judge's table, in the answer section
    pytest.importorskip("matplotlib")
    from ipw.analysis import report

    html = report.render_html(report.build([folder.path]))
    answer = html[html.index("<h2>The answer"):html.index("<h2>Compare in detail")]
    assert "local coverage (win/tie)" in answer and "orders agree" in answer and "80.0%" in answer


def test_vs_backend_through_the_cli(scripted, tmp_path, run_cli):
    run = make_run(tmp_path / "runs")
    code, out, err = run_cli("rescore", run, "--judge", "scripted:any", "--grading", "vs-backend:cloud",
                             "--out", tmp_path / "judged")
    assert code == 0, err
    (judged,) = list((tmp_path / "judged").iterdir())
    frame = pd.read_parquet(judged / "records.parquet")
    assert frame[frame["backend"] == "local"]["win_tie"].sum() == 3.0
    code, out, err = run_cli("rescore", run, "--judge", "scripted:any", "--grading", "vs-backend:nope")
    assert code == 2 and "vs-backend:nope: the run has no backend 'nope'" in err
    code, out, err = run_cli("rescore", run, "--judge", "scripted:any", "--grading", "vs-backend:cloud",
                             "--scorer", "judge")
    assert code == 2 and "leave out --scorer" in err


def test_vs_backend_in_a_run_config(tmp_path):
    from ipw.inputs.config import load_config
    from ipw.grading.rescore import judge_spec

    path = tmp_path / "run.toml"
    text = '''dataset = "ipw-core"
[[backends]]
name = "smol"
kind = "llama-cpp"
model = "smollm2-135m"

[[backends]]
name = "cloud"
kind = "llama-cpp"
model = "gemma3-270m"
role = "cloud"

[judge]
kind = "llama-cpp"
model = "smollm2-135m"
grading = "vs-backend:cloud"
'''
    path.write_text(text)
    config = load_config(str(path))
    assert config.judge.vs_backend == "cloud" and config.judge.prompt_ref == "vs-backend-v1"
    assert judge_spec({"config": json.loads(json.dumps(config.to_dict()))}).vs_backend == "cloud"
    path.write_text(text.replace("vs-backend:cloud", "vs-backend:gpt"))
    with pytest.raises(IpwError, match=r"run.toml:16: field 'judge.grading': vs-backend:gpt names no backend"):
        load_config(str(path))
    path.write_text(text.replace("vs-backend:cloud", "vs-backend:"))
    with pytest.raises(IpwError, match=r"run.toml:16: field 'judge.grading': unknown grading 'vs-backend:'"):
        load_config(str(path))


CHAT = [  # a handful of open-ended items with plausible answers from two small models
    ("c1", "Give one tip for keeping a houseplant alive in winter.",
     "Keep it near a bright window and water it less often, since it grows slowly in winter.",
     "Water it."),
    ("c2", "In one sentence, why do we see lightning before we hear thunder?",
     "Light travels much faster than sound, so the flash reaches us before the rumble.",
     "Because thunder is loud."),
    ("c3", "Suggest a name for a friendly robot in a children's story.",
     "Bolt", "How about Sprocket, a cheerful robot who loves to help?"),
]


@pytest.mark.llama
def test_real_llama_cpp_judge_on_chat_items(tmp_path, run_cli):
    """SmolLM2-135M judges cloud-style answers (weak as a judge: mechanics and bookkeeping are asserted,
    not its taste)."""
    items = [(q, "judge", "", local, cloud, None) for q, _, cloud, local in CHAT]
    run = make_run(tmp_path / "runs", items, prompts={q: p for q, p, _, _ in CHAT})
    code, _, err = run_cli("rescore", run, "--judge", "llama-cpp:smollm2-135m", "--grading",
                           "vs-backend:cloud", "--out", tmp_path / "judged")
    assert code == 0, err
    (judged,) = list((tmp_path / "judged").iterdir())
    manifest = json.loads((judged / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["judge"]["prompt_version"] == "vs-backend-v1"
    assert manifest["judge"]["engine"]["engine"] == "llama-cpp-python"
    frame = pd.read_parquet(judged / "records.parquet")
    local = frame[frame["backend"] == "local"]
    assert set(local["win_tie"]) <= {0.0, 1.0} and local["win_tie"].notna().all()
    assert frame[frame["backend"] == "cloud"]["win_tie"].isna().all()
    lines = [json.loads(x) for x in (judged / "judge.jsonl").read_text().splitlines()]
    judged_lines = [x for x in lines if x["judge_calls"]]
    assert len(judged_lines) == 3
    for line, (_, row) in zip(judged_lines, local.iterrows()):
        assert set(line["verdicts"]) <= {"response", "reference", "tie", "unparsed"}
        assert line["correct"] == bool(row["win_tie"])
        assert line["correct"] == all(v in ("response", "tie") for v in line["verdicts"])
        assert line["judge_prompt_tokens"] > 40 and line["judge_energy_j"] > 0
        assert len(line["judge_outputs"]) == 2


@pytest.mark.llama
def test_ipw_run_with_a_judge_ends_judged(tmp_path, run_cli):
    """``ipw run`` with a [judge] table: the finished run is graded into a linked folder, and the run's
    routing summary shows win/tie coverage from it (the same numbers as ``ipw compare`` on that folder)."""
    from openai_stub import Stub

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"id": q, "prompt": p, "answer": "", "scorer": "judge", "category": "chat"})
                            + "\n" for q, p, _, _ in CHAT[:2]))
    stub = Stub()
    try:
        cfg = tmp_path / "run.toml"
        cfg.write_text(f'''dataset = "{data}"
out_dir = "{tmp_path / 'res'}"
warmup = 0
idle_s = 0
[generation]
max_tokens = 12
[[backends]]
name = "smol"
kind = "llama-cpp"
model = "smollm2-135m"
n_threads = 1
[[backends]]
name = "cloud"
kind = "openai"
model = "stub"
role = "cloud"
base_url = "{stub.base_url}"
max_retries = 0
timeout_s = 10
[judge]
kind = "llama-cpp"
model = "smollm2-135m"
n_threads = 1
grading = "vs-backend:cloud"
max_tokens = 4
''')
        code, out, err = run_cli("run", cfg)
    finally:
        stub.close()
    assert code == 0, err
    runs = sorted((tmp_path / "res").iterdir())
    assert len(runs) == 2  # the run, and the judged run linked to it
    _, judged = (r for r in runs if not json.loads((r / "manifest.json").read_text()).get("rescored_from")), \
        next(r for r in runs if json.loads((r / "manifest.json").read_text()).get("rescored_from"))
    assert f"judged: {judged}" in err.replace("\n", "")
    frame = pd.read_parquet(judged / "records.parquet")
    local = frame[frame["backend"] == "smol"]
    assert local["win_tie"].notna().all() and local["correct"].isna().all()  # judged; unscored vs a dataset
    share = local["win_tie"].mean()
    assert "local coverage, win/tie" in out and f"{share:.1%}" in out and "2 judged" in out
    code, cmp_out, _ = run_cli("compare", judged, "--format", "json")
    routing = json.loads(cmp_out)["routing"]
    assert routing["coverage"]["win_tie"]["value"] == pytest.approx(share)
    assert "unscored" in out  # accuracy of chat-only backends: never shown as 0% or nan
    # --backend leaves the reference out: the run is kept, not judged, and says why
    code, out, err = run_cli("run", cfg, "--backend", "smol", "--out", tmp_path / "solo")
    assert code == 0, err
    assert "not judged" in err and len(list((tmp_path / "solo").iterdir())) == 1


def test_judging_again_never_keeps_an_old_verdict(scripted, tmp_path):
    """Against another reference, the new reference's rows lose their old win/tie; a rescore without a
    vs-backend judge keeps none (the old judge's log and manifest are not copied)."""
    from ipw.grading.rescore import rescore

    probe = lambda backend: [FixedSensor(0.5)]  # noqa: E731
    first = rescore(make_run(tmp_path / "runs"), judge=spec("cloud"), out_dir=tmp_path / "a", probe=probe).path
    again = rescore(first, judge=spec("local"), out_dir=tmp_path / "b", probe=probe).path
    frame = pd.read_parquet(again / "records.parquet")
    local, cloud = (frame[frame["backend"] == b] for b in ("local", "cloud"))
    assert local["win_tie"].isna().all() and set(map(len, local["judge_verdicts"])) == {0}
    assert cloud["win_tie"].notna().any() and set(frame["vs_backend"]) == {"local"}
    plain = pd.read_parquet(rescore(first, out_dir=tmp_path / "c").path / "records.parquet")
    assert plain["win_tie"].isna().all() and set(plain["vs_backend"]) == {""}


def test_check_of_a_chat_run_against_itself(tmp_path, run_cli):
    """Nothing scored in either run: accuracy is reported as not checked (a note), not as an error; the
    energy and error gates still run."""
    folder = create(tmp_path, "chat-only", {"config": {}, "backends": [], "dataset": {
        "name": "chat", "n_queries": 2, "fingerprint": "sha256:chat"}})
    for qid in ("c1", "c2"):
        folder.append(record(run_id="chat-only", query_id=qid, category="chat", scorer="judge", answer="",
                             output="Some advice.", correct=None))
    folder.finish("complete")
    code, out, err = run_cli("check", folder.path, folder.path)
    assert code == 0, out + err
    assert "accuracy not checked: no query has a score" in out + err and "energy_per_query" in out


@pytest.mark.parametrize("judge_table,message", [
    ('kind = "llama-cpp"\nmodel = "smollm2-135m"\ngrading = "vs-backend:stub"\nprompt = "vs-backend-v9"',
     "judge prompt 'vs-backend-v9' not found"),
    ('kind = "llama-cpp"\nmodel = "/nowhere/judge.gguf"\ngrading = "vs-backend:stub"', "judge.gguf"),
])
def test_a_broken_judge_fails_before_the_run(tmp_path, run_cli, judge_table, message):
    from openai_stub import stub_config

    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"id": "q1", "prompt": "Hi", "answer": "", "scorer": "judge"}) + "\n")
    cfg = stub_config(tmp_path / "run.toml", data, "http://127.0.0.1:9/v1", out_dir=tmp_path / "res")
    cfg.write_text(cfg.read_text() + "\n[judge]\n" + judge_table + "\n")
    code, out, err = run_cli("run", cfg)
    assert code == 2 and message in err and not (tmp_path / "res").exists()


def test_rescore_with_a_scorer_leaves_the_runs_judge_out(scripted, tmp_path, run_cli):
    run = make_run(tmp_path / "runs")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["judge"] = {"backend": {"name": "j", "kind": "scripted", "model": "any"},
                                   "grading": "vs-backend:cloud"}
    (run / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli("rescore", run, "--scorer", "exact", "--out", tmp_path / "exact")
    assert code == 0, err
    (out,) = (tmp_path / "exact").iterdir()
    assert not (out / "judge.jsonl").exists()
    code, _, err = run_cli("rescore", run, "--out", tmp_path / "judged")  # no scorer: the run's own judge
    assert code == 0, err
    (out,) = (tmp_path / "judged").iterdir()
    assert (out / "judge.jsonl").exists()
