"""The bundled query set ipw-core: shape, references that score correct, a reproducible generator."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

from ipw.inputs.datasets import DATASETS_DIR, LETTERS, load_queries
from ipw.grading.scoring import score

GENERATOR = Path(__file__).resolve().parents[2] / "datasets" / "generate.py"


@pytest.fixture(scope="module")
def queries():
    return load_queries("ipw-core")


@pytest.fixture(scope="module")
def generate():
    spec = importlib.util.spec_from_file_location("ipw_core_generate", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_size_and_categories(queries):
    assert len(queries) >= 400
    counts = Counter(q.category for q in queries)
    assert len(counts) >= 6
    assert all(n >= 40 for c, n in counts.items() if c != "long_context"), counts
    assert 20 <= counts["long_context"] <= 30, counts
    assert counts["chat"] >= 40, counts  # open-ended, judge-scored (tests/inputs/test_chat_items.py)
    assert len({q.id for q in queries}) == len(queries)
    assert len({q.prompt for q in queries}) > 0.95 * len(queries)


def test_mcq_items_are_well_formed(queries):
    mcq = [q for q in queries if q.scorer == "mcq"]
    assert len(mcq) >= 120
    for q in mcq:
        assert q.choices and len(q.choices) == 4, q.id
        assert len(set(q.choices)) == 4, q.id
        assert q.answer in LETTERS[: len(q.choices)], q.id
    # the correct letter is spread over the positions
    positions = Counter(q.answer for q in mcq)
    assert set(positions) == set("ABCD")
    assert max(positions.values()) - min(positions.values()) <= 3


def test_generated_prompts_ask_for_a_short_answer(queries):
    for q in queries:
        if q.scorer not in ("mcq", "judge"):  # chat prompts ask for a short reply in their own words
            assert "Answer" in q.prompt, q.id


def reference_output(q) -> str:
    return f"The answer is ({q.answer})" if q.scorer == "mcq" else q.answer


def test_reference_answers_score_correct(queries):
    wrong = [q.id for q in queries if q.scorer != "judge" and not score(q.scorer, reference_output(q), q.answer, q.choices)]
    assert not wrong
    # judge items have no reference answer: without a judge they are unscored, never wrong
    assert all(score(q.scorer, "some reply", q.answer) is None for q in queries if q.scorer == "judge")


def test_a_wrong_letter_scores_wrong(queries):
    for q in queries:
        if q.scorer == "mcq":
            other = next(x for x in LETTERS[: len(q.choices)] if x != q.answer)
            assert not score("mcq", f"The answer is ({other})", q.answer, q.choices), q.id
            # the correct option's text alone is also accepted
            assert score("mcq", q.choices[LETTERS.index(q.answer)], q.answer, q.choices), q.id


def test_default_subset(queries):
    ids = (DATASETS_DIR / "ipw-core-default.txt").read_text().split()
    assert len(ids) == 24 and len(set(ids)) == 24
    by_id = {q.id: q for q in queries}
    assert all(i in by_id for i in ids)
    per_category = Counter(by_id[i].category for i in ids)
    assert set(per_category) == {q.category for q in queries} - {"long_context", "chat"}  # added later, not in it
    assert all(3 <= n <= 4 for n in per_category.values()), per_category


def test_generator_is_deterministic(generate, tmp_path: Path):
    out = generate.main(tmp_path / "ipw-core.jsonl", generate.DEFAULT_SEED)
    assert out.read_bytes() == (DATASETS_DIR / "ipw-core.jsonl").read_bytes()
    assert (tmp_path / "ipw-core-default.txt").read_bytes() == (DATASETS_DIR / "ipw-core-default.txt").read_bytes()
    again = generate.main(tmp_path / "again.jsonl", generate.DEFAULT_SEED)
    assert again.read_bytes() == out.read_bytes()
    assert generate.check(DATASETS_DIR / "ipw-core.jsonl", generate.DEFAULT_SEED)


def test_another_seed_gives_another_valid_set(generate, tmp_path: Path):
    out = generate.main(tmp_path / "other.jsonl", 7)
    assert out.read_bytes() != (DATASETS_DIR / "ipw-core.jsonl").read_bytes()
    other = load_queries(str(out))
    assert len(other) >= 400
    assert all(score(q.scorer, reference_output(q), q.answer, q.choices) for q in other if q.scorer != "judge")


def test_generator_fmt_and_syllogism_checker(generate):
    assert generate.fmt(generate.Fraction(9, 4)) == "2.25"
    assert generate.fmt(-35) == "-35"
    with pytest.raises(ValueError):
        generate.fmt(generate.Fraction(1, 3))
    barbara = [("all", 0, 1), ("all", 1, 2)]
    assert generate.follows(barbara, ("all", 0, 2), existential=False)
    assert not generate.follows([("some", 0, 1), ("some", 1, 2)], ("some", 0, 2), existential=True)
    # "some A are C" from two "all" premises needs existential import
    assert not generate.follows(barbara, ("some", 0, 2), existential=False)
    assert generate.follows(barbara, ("some", 0, 2), existential=True)
