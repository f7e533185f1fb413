"""ipw-core's ``chat`` category: open-ended prompts graded only by a judge against a reference
backend's answer (scorer ``judge``, no reference answer), kept out of the default subset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipw.inputs.datasets import DATASETS_DIR, load_queries
from ipw.errors import IpwError
from ipw.grading.scoring import score


@pytest.fixture(scope="module")
def chat():
    return load_queries("ipw-core", categories=("chat",))


def test_count_ids_and_scorer(chat):
    assert len(chat) >= 40
    ids = [q.id for q in chat]
    assert len(set(ids)) == len(ids)
    assert all(i.startswith("chat-") for i in ids)
    assert all(q.category == "chat" and q.scorer == "judge" and q.answer == "" and q.choices is None for q in chat)
    assert len({q.prompt for q in chat}) == len(chat)


def test_the_whole_set_holds_them_at_the_end(chat):
    """``--dataset ipw-core`` loads them too, after every earlier category (so earlier ids and a
    ``limit`` over the set are unchanged)."""
    core = load_queries("ipw-core")
    assert [q for q in core if q.category == "chat"] == chat
    assert [q.category for q in core[-len(chat):]] == ["chat"] * len(chat)


def test_not_in_the_default_subset(chat):
    default = (DATASETS_DIR / "ipw-core-default.txt").read_text().split()
    assert not {q.id for q in chat} & set(default)
    assert all(q.category != "chat" for q in load_queries("ipw-core-default"))
    with pytest.raises(IpwError, match="--category 'chat': no such category"):
        load_queries("ipw-core-default", categories=("chat",))


def test_prompts_ask_for_a_brief_reply(chat):
    """Answerable within the default 48-token cap: a short prompt that bounds the reply's length."""
    bounds = ("sentence", "line", "haiku", "slogan", "name", "brief", "short", "list", "tip", "one")
    for q in chat:
        words = q.prompt.split()
        assert 6 <= len(words) <= 25, q.id
        assert q.prompt.rstrip()[-1] in ".?", q.id
        assert any(b in q.prompt.lower() for b in bounds), q.id


def test_a_mix_of_advice_explanation_and_creative_tasks(chat):
    text = [q.prompt.lower() for q in chat]
    assert sum(t.startswith(("give", "suggest", "how", "what should", "in one or two sentences, how")) for t in text) >= 8
    assert sum("explain" in t or t.startswith("in one or two sentences, why") for t in text) >= 8
    assert sum(t.startswith(("write", "invent", "describe")) for t in text) >= 8


def test_unscored_without_a_judge(chat):
    assert all(score(q.scorer, "A reply in a sentence.", q.answer, q.choices) is None for q in chat)


def _write(tmp_path: Path, *rows: dict) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("answer", ["", "  ", None, "missing"])
def test_an_empty_answer_loads_for_judge(tmp_path, answer):
    row = {"id": "c1", "prompt": "Write a haiku about rain.", "category": "chat", "scorer": "judge"}
    if answer != "missing":
        row["answer"] = answer
    (query,) = load_queries(str(_write(tmp_path, row)))
    assert query.answer == "" and query.scorer == "judge"


def test_a_judge_item_may_keep_a_reference_text(tmp_path):
    row = {"id": "c1", "prompt": "Why is the sky blue?", "answer": "Rayleigh scattering", "scorer": "judge"}
    (query,) = load_queries(str(_write(tmp_path, row)))
    assert query.answer == "Rayleigh scattering"


def test_the_default_scorer_judge_needs_no_answer(tmp_path):
    (query,) = load_queries(str(_write(tmp_path, {"id": "c1", "prompt": "Say hello."})), default_scorer="judge")
    assert query.scorer == "judge" and query.answer == ""


@pytest.mark.parametrize("scorer", ["exact", "numeric", "contains", "regex"])
@pytest.mark.parametrize("answer", ["", "missing"])
def test_an_empty_answer_still_fails_for_other_scorers(tmp_path, scorer, answer):
    row = {"id": "c1", "prompt": "Write a haiku about rain.", "scorer": scorer}
    if answer != "missing":
        row["answer"] = answer
    with pytest.raises(IpwError, match=r":1: field 'answer': required field is missing"):
        load_queries(str(_write(tmp_path, row)))


@pytest.mark.parametrize("row,message", [
    ({"id": "c1", "prompt": "p", "answer": " \t ", "scorer": "exact"}, "required field is blank"),
    ({"id": "c1", "prompt": "p", "answer": ["x"], "scorer": "judge"}, "expected a string"),
    ({"id": "c1", "prompt": "p", "answer": "x", "scorer": "fuzzy"}, r"unknown scorer 'fuzzy' \(known: .*judge"),
])
def test_other_answer_errors_stay(tmp_path, row, message):
    """A blank answer for exact, a non-string answer even for judge, an unknown scorer (which lists judge)."""
    with pytest.raises(IpwError, match=rf":1: field '(answer|scorer)': {message}"):
        load_queries(str(_write(tmp_path, row)))


def test_the_chat_coverage_config_runs_a_mix_of_them():
    """configs/chat-coverage.toml: 12 chat prompts (4 of each kind), a local and a cloud-role backend,
    and a judge against the cloud backend's answer (read as TOML: the loader's checks are its own)."""
    import tomllib

    config = tomllib.loads((Path(__file__).resolve().parents[2] / "configs" / "chat-coverage.toml").read_text())
    queries = load_queries(config["dataset"], categories=tuple(config["categories"]), sample=config["sample"],
                           seed=config["seed"])
    assert len(queries) == 12 and all(q.scorer == "judge" for q in queries)
    numbers = [int(q.id.split("-")[1]) for q in queries]
    assert [sum((n - 1) // 16 == k for n in numbers) for k in range(3)] == [4, 4, 4]
    roles = {b["name"]: b.get("role") for b in config["backends"]}
    assert roles == {"smollm2-135m": "local", "gemma3-270m-server": "cloud"}
    assert config["judge"]["grading"] == "vs-backend:gemma3-270m-server"
