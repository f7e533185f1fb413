"""Scorers on realistic, messy small-model outputs, including many that must score wrong."""

from __future__ import annotations

import pytest

from ipw.errors import IpwError
from ipw.grading.scoring import KNOWN_SCORERS, SCORERS, check_answer, extract_choice, extract_number, normalize, score

CAPITALS = ("Paris", "London", "Rome", "Berlin")  # "Which city is the capital of France?"
VITAMINS = ("Vitamin A", "Vitamin C", "Vitamin D", "Vitamin K")

# --------------------------------------------------------------------------------------------- mcq

MCQ_RIGHT = [
    "A",
    "a",
    "a)",
    "(A)",
    "**A**",
    "A. Paris",
    "A) Paris",
    "A: Paris",
    "A Paris",
    "Answer: A",
    "answer: a",
    "The answer is (A) Paris.",
    "The answer is A.",
    "The correct answer is: **A**",
    "The correct option is A because Paris is the capital of France.",
    "Final answer: (A)",
    "I would go with A.",
    "I choose option A.",
    "Option A is correct.",
    "(A) is the correct answer.",
    "I think the correct option is Paris",
    "The capital of France is paris.",
    "Paris",
    "The answer is (A) Paris.\n\nExplanation: (B) London is the capital of the UK.",
    "Let me think. France's capital city... Answer: A",
    "Not (B), I pick (A)",
    "A good question! The answer is (A).",
    "The answer is A, since Paris is the capital.",
    "The answer is (A). Wait, maybe (B)... no, (A).",  # first explicit marker wins
    "  \n**A) Paris**\n",
    "Hmm, it has to be A",
]

MCQ_WRONG = [
    "",
    "   ",
    "B",
    "(B) London",
    "The answer is B.",
    "The answer is A or B.",
    "The answer is (A) or (B).",
    "It's either A or B.",
    "A or B",
    "(A) Paris\n(B) London\n(C) Rome\n(D) Berlin",
    "A. Paris\nB. London\nC. Rome\nD. Berlin",
    "(A) could be right, but (B) is also plausible.",
    "Paris or London, I am not sure.",
    "A good question. I do not know.",  # the article "A" is not choice A
    "A capital city is usually the largest city.",
    "I don't know.",
    "The answer is a city in Europe.",
    "Berlin, definitely.",
    "The answer is (E).",  # not an option
    "E",
    "None of the above.",
    "The answer is not A.",
]


@pytest.mark.parametrize("output", MCQ_RIGHT)
def test_mcq_right(output):
    assert score("mcq", output, "A", CAPITALS), output


@pytest.mark.parametrize("output", MCQ_WRONG)
def test_mcq_wrong(output):
    assert not score("mcq", output, "A", CAPITALS), output


@pytest.mark.parametrize(
    "output, expected",
    [
        ("Vitamin C", "B"),
        ("The skin makes vitamin D in sunlight.", "C"),
        ("C", "C"),  # a bare letter is a letter, even if an option's text ends in one
        ("The answer is (D) Vitamin K", "D"),
        ("Vitamin A or Vitamin C", None),
    ],
)
def test_mcq_option_text_masks_letters(output, expected):
    assert extract_choice(output, VITAMINS) == expected


def test_mcq_option_text_inside_another_option():
    choices = ("Mars", "Mars and Venus", "Venus", "Earth")
    assert extract_choice("It is Mars and Venus.", choices) == "B"
    assert extract_choice("Mars.", choices) == "A"


def test_mcq_answer_letter_is_case_insensitive_and_without_choices():
    assert score("mcq", "The answer is (c)", "c", ("x", "y", "z", "w"))
    assert score("mcq", "Answer: C", "C", None)
    assert not score("mcq", "Answer: B", "C", None)


# ------------------------------------------------------------------------------------------- exact

EXACT_RIGHT = [
    ("Tuesday", "Tuesday"),
    ("tuesday.", "Tuesday"),
    ("  **Tuesday**  ", "Tuesday"),
    ("The answer is Tuesday.", "Tuesday"),
    ("Answer: Tuesday", "Tuesday"),
    ("Final answer: tuesday", "Tuesday"),
    ("Tuesday\n\nMarch 5, 2024 fell on a Tuesday.", "Tuesday"),
    ("Yes, all wugs are daxes.", "yes"),
    ("No.", "no"),
    ("'olleh'", "olleh"),
    ("`tenalp`", "tenalp"),
    ("apple, banana, cherry", "apple, banana, cherry"),
    ("apple banana cherry", "apple, banana, cherry"),
    ("2023-04-17", "2023-04-17"),
    ("2023-04-17.", "2023-04-17"),
    ("New   York", "new york"),
    ("Let me work it out.\nThe second letter is r, so the answer is: R", "r"),
    ("\u201cDon\u2019t panic\u201d", "don't panic"),
]

EXACT_WRONG = [
    ("", "Tuesday"),
    ("Wednesday", "Tuesday"),
    ("March 5, 2024 fell on a Tuesday.", "Tuesday"),  # not just the answer
    ("Tuesday or Wednesday", "Tuesday"),
    ("olleh h", "olleh"),
    ("hello", "olleh"),
    ("apple, cherry, banana", "apple, banana, cherry"),
    ("apple", "apple, banana, cherry"),
    ("2023-04-71", "2023-04-17"),
    ("3.5", "35"),  # a decimal point is not dropped
    ("Yes or no? It depends.", "yes"),
    ("Nope, not at all.", "no"),
    ("I cannot answer that.", "no"),
]


@pytest.mark.parametrize("output, answer", EXACT_RIGHT)
def test_exact_right(output, answer):
    assert score("exact", output, answer), output


@pytest.mark.parametrize("output, answer", EXACT_WRONG)
def test_exact_wrong(output, answer):
    assert not score("exact", output, answer), output


# ----------------------------------------------------------------------------------------- numeric

NUMERIC_RIGHT = [
    ("85", "85"),
    ("85.", "85"),
    ("The answer is 85.", "85"),
    ("47 + 38 = 85", "85"),
    ("47 + 38 = 85 (both numbers are below 50)", "85"),
    ("First, 23 + 19 = 42. Then 42 * 4 = 168. Finally 168 - 17 = 151. So the answer is 151.", "151"),
    ("**Answer:** 151", "151"),
    ("The answer is 151. Check: 151 + 17 = 168.", "151"),  # answer marker beats later numbers
    ("\\boxed{151}", "151"),
    ("-35", "-35"),
    ("23 - 58 = -35", "-35"),
    ("The result is \u221235.", "-35"),
    ("12.5", "12.5"),
    ("12.50 km", "12.5"),
    ("The answer is approximately 12.5 km.", "12.5"),
    ("$45", "45"),
    ("It costs $1,234.50 in total.", "1234.5"),
    ("1,234.5", "1,234.5"),
    ("45%", "45"),
    ("3/4", "3/4"),
    ("0.75", "3/4"),
    ("x = 4. Therefore the total is 12.", "12"),
    ("3500 m", "3500"),
    ("There are 3 r's in strawberry.", "3"),
    ("1e3", "1000"),
    ("2.3333333", "2.3333333334"),  # within rel 1e-6... of a long decimal
]

NUMERIC_WRONG = [
    ("", "85"),
    ("I am not sure.", "85"),
    ("eighty-five", "85"),  # number words are not read
    ("84", "85"),
    ("85.5", "85"),
    ("What is 47 + 38? The answer is 84.", "85"),  # the restated 85 must not count
    ("The answer is 84, not 85.", "85"),
    ("12 - 5", "-5"),  # subtraction, not a negative number
    ("35", "-35"),
    ("3/4", "0.75"),  # a fraction is read only when the reference is one
    ("12.5", "125"),
    ("1,234", "1.234"),
    ("2.33", "2.3333333334"),
    ("The answer is 5. That is 5 km = 5000 m.", "5000"),
]


@pytest.mark.parametrize("output, answer", NUMERIC_RIGHT)
def test_numeric_right(output, answer):
    assert score("numeric", output, answer), output


@pytest.mark.parametrize("output, answer", NUMERIC_WRONG)
def test_numeric_wrong(output, answer):
    assert not score("numeric", output, answer), output


def test_numeric_reference_must_be_a_number():
    with pytest.raises(IpwError, match="not a number"):
        score("numeric", "12", "twelve")


def test_extract_number_precedence():
    assert extract_number("Answer: 7. Restating: 3 + 4 = 7, and 10 is bigger.") == 7
    assert extract_number("no digits here") is None
    assert extract_number("12 - 7 = 5 and 5 * 2 = 10") == 10


# ---------------------------------------------------------------------------------------- contains

CONTAINS = [
    ("It is Paris, France.", "paris", True),
    ("PARIS!", "Paris", True),
    ("The city of New   York.", "new york", True),
    ("I believe the answer is 3.5 km", "3.5", True),
    ("Parisian food", "Paris", False),
    ("13", "3", False),
    ("3.55", "3.5", False),
    ("London", "Paris", False),
    ("", "Paris", False),
]


@pytest.mark.parametrize("output, answer, expected", CONTAINS)
def test_contains(output, answer, expected):
    assert score("contains", output, answer) is expected


# ------------------------------------------------------------------------------------------- regex

REGEX = [
    ("The answer is 42", r"\b42\b", True),
    ("THE ANSWER IS PARIS", r"answer is paris", True),
    ("Paris", r"^(paris|lutetia)$", True),
    ("GARDEN", r"^\W*(?-i:GARDEN)\W*$", True),
    ("garden", r"^\W*(?-i:GARDEN)\W*$", False),
    ("The answer is 420", r"\b42\b", False),
    ("", r"\w+", False),
]


@pytest.mark.parametrize("output, pattern, expected", REGEX)
def test_regex(output, pattern, expected):
    assert score("regex", output, pattern) is expected


def test_regex_invalid_pattern_is_a_user_error():
    with pytest.raises(IpwError, match="invalid pattern"):
        score("regex", "x", "(unclosed")


# ------------------------------------------------------------------------------------------ common


def test_registry_and_unknown_scorer():
    assert set(SCORERS) == {"mcq", "exact", "numeric", "contains", "regex"}
    with pytest.raises(IpwError, match="unknown scorer 'fuzzy'.*judge"):
        score("fuzzy", "x", "x")


def test_judge_is_known_but_unscored_without_a_judge():
    """``judge`` items are graded only by an LLM judge against a reference backend's answer: scored
    here (no judge at hand) they are None, unscored, never False; and ``judge`` has no function."""
    assert "judge" in KNOWN_SCORERS and "judge" not in SCORERS
    assert set(KNOWN_SCORERS) == set(SCORERS) | {"judge"}
    for output in ("A lighthouse keeper climbs the stair.", "", None):
        assert score("judge", output, "") is None  # type: ignore[arg-type]
    assert score("judge", "anything", "a reference text") is None
    check_answer("judge", "")  # an empty reference is fine


def test_none_output_scores_wrong():
    assert score("exact", None, "x") is False  # type: ignore[arg-type]


def test_normalize():
    assert normalize("  The  **Answer**: 1,234.5!  ") == "the answer 1,234.5"
    assert normalize("Don\u2019t -5 well-known") == "don't -5 well-known"
