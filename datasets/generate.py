#!/usr/bin/env python3
"""Generate the bundled query set ``ipw-core`` deterministically (stdlib only).

    python datasets/generate.py                 # writes ipw/data/ipw-core.jsonl and ipw-core-default.txt
    python datasets/generate.py --check         # regenerates in memory and fails if the files differ
    python datasets/generate.py --seed 7 --out /tmp/x.jsonl

Every answer of a generated category is computed by code; the multiple-choice items of
``general_knowledge`` and ``science`` were written by hand for this project (facts checked twice) and
only their option order is drawn. Each category draws from its own ``random.Random`` derived from the
seed, so editing one category does not reshuffle the others. ``ipw-core-default.txt`` lists the 24
query ids of the small default run: a seeded, stratified pick of 3-4 per category mixing easy and
hard items (``long_context`` and ``chat``, added later, are not in it). The ``chat`` prompts were
written by hand for this project and have no reference answer (scorer ``judge``).
"""

from __future__ import annotations

import argparse
import calendar
import datetime as dt
import itertools
import json
import random
import sys
from fractions import Fraction
from pathlib import Path

DEFAULT_SEED = 20261129
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "ipw" / "data" / "ipw-core.jsonl"  # shipped in the package
DEFAULT_SUBSET_SIZE = 24

JUST_NUMBER = "Answer with just the number."
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")


class Item:
    """One query plus its difficulty (used only to stratify the default subset; not written out)."""

    def __init__(self, prompt: str, answer: str, scorer: str, difficulty: str, choices: list[str] | None = None):
        self.prompt, self.answer, self.scorer, self.difficulty, self.choices = prompt, answer, scorer, difficulty, choices


def fmt(value: Fraction | int) -> str:
    """A number as the shortest exact decimal string ("3500", "2.25", "-35"); must terminate."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den != 1:
        raise ValueError(f"{value} has no finite decimal form")
    sign = "-" if value < 0 else ""
    value = abs(value)
    whole, frac = divmod(value.numerator, value.denominator)
    digits = ""
    rem = Fraction(frac, value.denominator)
    while rem:
        rem *= 10
        d = int(rem)
        digits += str(d)
        rem -= d
    return f"{sign}{whole}.{digits}"


def date_text(d: dt.date) -> str:
    return f"{MONTHS[d.month - 1]} {d.day}, {d.year}"


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


# --------------------------------------------------------------------------------------------
# arithmetic (numeric)


def gen_arithmetic(rng: random.Random) -> list[Item]:
    items: list[Item] = []

    def add(expr: str, value: int | Fraction, difficulty: str) -> None:
        items.append(Item(f"What is {expr}? {JUST_NUMBER}", fmt(value), "numeric", difficulty))

    r = rng.randint
    for _ in range(24):  # easy: 2-digit addition
        a, b = r(10, 99), r(10, 99)
        add(f"{a} + {b}", a + b, "easy")
    for _ in range(8):  # easy: 2-digit subtraction, positive result
        a, b = r(30, 99), r(10, 29)
        add(f"{a} - {b}", a - b, "easy")
    for _ in range(8):  # medium: negative result
        a, b = r(10, 49), r(50, 99)
        add(f"{a} - {b}", a - b, "medium")
    for _ in range(10):  # medium: 2-digit by 1-digit
        a, b = r(12, 99), r(3, 9)
        add(f"{a} * {b}", a * b, "medium")
    for _ in range(6):  # hard: 2-digit by 2-digit
        a, b = r(12, 99), r(12, 99)
        add(f"{a} * {b}", a * b, "hard")
    for _ in range(6):  # hard: parentheses then multiply and subtract
        a, b, c, d = r(11, 49), r(11, 49), r(3, 9), r(10, 99)
        add(f"({a} + {b}) * {c} - {d}", (a + b) * c - d, "hard")
    for _ in range(6):  # hard: two products
        a, b, c, d = r(6, 19), r(6, 19), r(6, 19), r(6, 19)
        add(f"{a} * {b} + {c} * {d}", a * b + c * d, "hard")
    for _ in range(6):  # hard: precedence without parentheses, can go negative
        a, b, c, d = r(10, 60), r(3, 9), r(4, 9), r(50, 150)
        add(f"{a} + {b} * {c} - {d}", a + b * c - d, "hard")
    for _ in range(6):  # hard: exact division inside an expression
        q, b, c = r(4, 25), r(3, 12), r(5, 40)
        add(f"{q * b} / {b} + {c}", Fraction(q * b, b) + c, "hard")
    for _ in range(6):  # hard: percentages with exact results
        pct = rng.choice((5, 10, 15, 20, 25, 30, 40, 60, 75))
        base = 20 * r(2, 30)
        items.append(Item(f"What is {pct}% of {base}? {JUST_NUMBER}", fmt(Fraction(pct * base, 100)), "numeric", "hard"))
    return items


# --------------------------------------------------------------------------------------------
# unit conversion (numeric)


def gen_units(rng: random.Random) -> list[Item]:
    items: list[Item] = []
    r = rng.randint

    def q(text: str, value: Fraction | int, difficulty: str) -> None:
        items.append(Item(f"{text} {JUST_NUMBER}", fmt(value), "numeric", difficulty))

    for _ in range(6):
        km = Fraction(r(2, 40), 4)  # quarter kilometres
        q(f"How many meters are in {fmt(km)} kilometers?", km * 1000, "easy" if km.denominator == 1 else "medium")
    for _ in range(6):
        m = 50 * r(3, 160)
        q(f"How many kilometers are {m} meters?", Fraction(m, 1000), "medium")
    for _ in range(6):
        h = Fraction(r(2, 24), 2)
        q(f"How many minutes are in {fmt(h)} hours?", h * 60, "easy" if h.denominator == 1 else "medium")
    for _ in range(6):
        minutes = 15 * r(3, 40)
        q(f"How many hours are {minutes} minutes?", Fraction(minutes, 60), "medium")
    for _ in range(6):
        kg = Fraction(r(1, 60), 4)
        q(f"How many grams are in {fmt(kg)} kilograms?", kg * 1000, "easy" if kg.denominator == 1 else "medium")
    for _ in range(5):
        g = 25 * r(4, 300)
        q(f"How many kilograms are {g} grams?", Fraction(g, 1000), "medium")
    for _ in range(8):  # exact: multiples of 5 degrees Celsius give whole Fahrenheit values
        c = 5 * r(-8, 20)
        q(f"Convert {c} degrees Celsius to degrees Fahrenheit.", Fraction(c * 9, 5) + 32, "hard")
    for _ in range(4):
        h, m = r(1, 9), r(1, 59)
        q(f"How many minutes are in {h} hours and {m} minutes?", h * 60 + m, "medium")
    for _ in range(4):
        days = r(2, 14)
        q(f"How many hours are in {days} days?", days * 24, "easy")
    for _ in range(3):
        km, m = Fraction(r(2, 12), 2), 50 * r(1, 19)
        q(f"How many meters is {fmt(km)} kilometers plus {m} meters?", km * 1000 + m, "hard")
    for _ in range(3):
        mins = Fraction(r(3, 30), 2)
        q(f"How many seconds are in {fmt(mins)} minutes?", mins * 60, "medium")
    for _ in range(3):
        liters = Fraction(r(1, 30), 4)
        q(f"How many milliliters are in {fmt(liters)} liters?", liters * 1000, "medium")
    return items


# --------------------------------------------------------------------------------------------
# dates (exact and numeric)


def random_date(rng: random.Random, lo: int = 1990, hi: int = 2035) -> dt.date:
    start = dt.date(lo, 1, 1).toordinal()
    end = dt.date(hi, 12, 31).toordinal()
    return dt.date.fromordinal(rng.randint(start, end))


def gen_dates(rng: random.Random) -> list[Item]:
    items: list[Item] = []
    for _ in range(10):  # easy: weekday arithmetic
        day, k = rng.randrange(7), rng.randint(1, 20)
        items.append(Item(
            f"If today is {DAYS[day]}, what day of the week will it be in {k} days? Answer with just the day name.",
            DAYS[(day + k) % 7], "exact", "easy" if k < 7 else "medium"))
    for _ in range(14):  # hard: day of the week of a calendar date
        d = random_date(rng)
        verb = "was" if d < dt.date(2026, 1, 1) else "will be"
        items.append(Item(f"What day of the week {verb} {date_text(d)}? Answer with just the day name.",
                          DAYS[d.weekday()], "exact", "hard"))
    for _ in range(14):  # days between two dates
        d1 = random_date(rng, 2000, 2030)
        d2 = d1 + dt.timedelta(days=rng.randint(3, 200))
        items.append(Item(f"How many days after {date_text(d1)} is {date_text(d2)}? {JUST_NUMBER}",
                          str((d2 - d1).days), "numeric", "medium" if d1.month == d2.month else "hard"))
    for _ in range(12):  # adding days
        d1 = random_date(rng, 2000, 2030)
        k = rng.randint(2, 90)
        d2 = d1 + dt.timedelta(days=k)
        items.append(Item(f"What date is {k} days after {date_text(d1)}? Answer in the format YYYY-MM-DD.",
                          d2.isoformat(), "exact", "medium" if k < 15 else "hard"))
    years = rng.sample([y for y in range(1800, 2101)], 40)
    # make sure the century rule is exercised: two centuries, one of them a leap year
    picked = [1900, 2000] + [y for y in years if y % 100][:4]
    for y in picked:
        items.append(Item(f"Is {y} a leap year in the Gregorian calendar? Answer yes or no.",
                          "yes" if calendar.isleap(y) else "no", "exact", "hard" if y % 100 == 0 else "medium"))
    for _ in range(4):
        y, m = rng.randint(1990, 2035), rng.randint(1, 12)
        items.append(Item(f"How many days are in {MONTHS[m - 1]} {y}? {JUST_NUMBER}",
                          str(calendar.monthrange(y, m)[1]), "numeric", "medium"))
    return items


# --------------------------------------------------------------------------------------------
# strings (exact and numeric)

WORDS = (
    "apple", "banana", "cherry", "garden", "planet", "orange", "window", "pencil", "rocket", "silver",
    "bridge", "castle", "dragon", "forest", "guitar", "harbor", "island", "jungle", "kitten", "ladder",
    "marble", "napkin", "oyster", "pepper", "rabbit", "saddle", "tunnel", "velvet", "walrus", "yellow",
    "zebra", "mirror", "butter", "coffee", "letter", "bottle", "summer", "winter", "puzzle", "balloon",
    "strawberry", "elephant", "education", "mountain", "notebook", "umbrella", "library", "tomato",
    "blossom", "cabbage", "dolphin", "address", "success", "committee", "bookkeeper", "mississippi",
    "banana", "assessment", "parallel", "occurrence",
)
VOWELS = "aeiou"


def gen_strings(rng: random.Random) -> list[Item]:
    items: list[Item] = []
    words = sorted(set(WORDS))
    for w in rng.sample(words, 12):
        items.append(Item(f"Write the word '{w}' backwards, letter by letter in reverse order. "
                          "Answer with just the reversed word.", w[::-1], "exact", "medium" if len(w) <= 6 else "hard"))
    for w in rng.sample(words, 12):
        letter = rng.choice(sorted(set(w)))
        items.append(Item(f"How many times does the letter '{letter}' appear in the word '{w}'? {JUST_NUMBER}",
                          str(w.count(letter)), "numeric", "easy" if w.count(letter) == 1 else "hard"))
    for w in rng.sample(words, 10):
        k = rng.randint(1, len(w))
        items.append(Item(f"What is the {ordinal(k)} letter of the word '{w}'? Answer with just the letter.",
                          w[k - 1], "exact", "easy" if k <= 2 else "medium"))
    for _ in range(10):
        trio = rng.sample(words, 3)
        ordered = sorted(trio)
        hard = len({t[0] for t in trio}) < 3
        items.append(Item(f"Sort these words in alphabetical order: {', '.join(trio)}. "
                          "Answer with the three words separated by commas.",
                          ", ".join(ordered), "exact", "hard" if hard else "medium"))
    for w in rng.sample(words, 8):
        items.append(Item(f"How many letters are in the word '{w}'? {JUST_NUMBER}", str(len(w)), "numeric",
                          "easy" if len(w) <= 6 else "medium"))
    for w in rng.sample(words, 8):
        n = sum(ch in VOWELS for ch in w)
        items.append(Item(f"How many vowels (a, e, i, o, u) are in the word '{w}'? {JUST_NUMBER}", str(n),
                          "numeric", "hard"))
    return items


# --------------------------------------------------------------------------------------------
# logic (exact and numeric)

NAMES = ("Ann", "Bob", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jill", "Kofi", "Lena", "Milo",
         "Nora", "Omar", "Pia")
RELATIONS = (("taller", "shorter", "tallest", "shortest"), ("older", "younger", "oldest", "youngest"),
             ("faster", "slower", "fastest", "slowest"), ("heavier", "lighter", "heaviest", "lightest"))
NONSENSE = ("wugs", "blickets", "daxes", "florps", "zorbs", "glimps", "tuvs", "mibs", "quolls", "snerps",
            "vexes", "drabs")


def gen_ordering(rng: random.Random, count: int) -> list[Item]:
    items = []
    for i in range(count):
        n = (3, 3, 4, 4, 5)[i % 5]
        people = rng.sample(NAMES, n)  # people[0] has the most of the quality
        more, less, most, least = rng.choice(RELATIONS)
        facts = []
        for a, b in zip(people, people[1:]):
            facts.append(f"{a} is {more} than {b}." if rng.random() < 0.6 else f"{b} is {less} than {a}.")
        rng.shuffle(facts)
        kind = rng.choice(("most", "least", "second") if n >= 4 else ("most", "least"))
        if kind == "most":
            question, answer = f"Who is the {most}?", people[0]
        elif kind == "least":
            question, answer = f"Who is the {least}?", people[-1]
        else:
            question, answer = f"Who is the second {most}?", people[1]
        difficulty = "easy" if n == 3 else ("medium" if kind != "second" and n == 4 else "hard")
        items.append(Item(f"{' '.join(facts)} {question} Answer with just the name.", answer, "exact", difficulty))
    return items


# Syllogisms are checked by brute force over all models of three predicates: a model is the set of
# non-empty regions of the Venn diagram (2^8 models). A conclusion follows when it holds in every
# model where the premises hold. Items are kept only when the verdict is the same with and without
# existential import (every term non-empty), so "some" conclusions are not a matter of convention.

QUANTIFIERS = ("all", "no", "some", "some_not")


def holds(model: frozenset[int], quant: str, x: int, y: int) -> bool:
    regions_x = [r for r in model if r >> x & 1]
    if quant == "all":
        return all(r >> y & 1 for r in regions_x)
    if quant == "no":
        return not any(r >> y & 1 for r in regions_x)
    if quant == "some":
        return any(r >> y & 1 for r in regions_x)
    return any(not r >> y & 1 for r in regions_x)  # some_not


MODELS = [frozenset(r for r in range(8) if mask >> r & 1) for mask in range(256)]


def follows(premises: list[tuple[str, int, int]], conclusion: tuple[str, int, int], existential: bool) -> bool:
    for model in MODELS:
        if existential and not all(any(r >> t & 1 for r in model) for t in range(3)):
            continue
        if all(holds(model, *p) for p in premises) and not holds(model, *conclusion):
            return False
    return True


def sentence(quant: str, x: str, y: str) -> str:
    return {"all": f"All {x} are {y}", "no": f"No {x} are {y}", "some": f"Some {x} are {y}",
            "some_not": f"Some {x} are not {y}"}[quant]


def question(quant: str, x: str, y: str) -> str:
    return {"all": f"all {x} are {y}", "no": f"no {x} are {y}", "some": f"some {x} are {y}",
            "some_not": f"some {x} are not {y}"}[quant]


def gen_syllogisms(rng: random.Random, count: int) -> list[Item]:
    items: list[Item] = []
    want = {"yes": count // 2, "no": count - count // 2}
    seen = set()
    while sum(want.values()):
        terms = rng.sample(NONSENSE, 3)  # indices 0 (A), 1 (B), 2 (C)
        q1, q2 = rng.choice(QUANTIFIERS[:3]), rng.choice(QUANTIFIERS[:3])
        p1 = (q1, 0, 1) if rng.random() < 0.7 else (q1, 1, 0)
        p2 = (q2, 1, 2) if rng.random() < 0.7 else (q2, 2, 1)
        conclusion = (rng.choice(QUANTIFIERS), 0, 2)
        key = (p1, p2, conclusion)
        verdicts = {follows([p1, p2], conclusion, e) for e in (False, True)}
        if len(verdicts) != 1 or key in seen:
            continue
        answer = "yes" if verdicts.pop() else "no"
        if not want[answer]:
            continue
        seen.add(key)
        want[answer] -= 1
        prem = [sentence(p[0], terms[p[1]], terms[p[2]]) for p in (p1, p2)]
        concl = question(conclusion[0], terms[0], terms[2])
        difficulty = "medium" if (q1, q2, conclusion[0]) == ("all", "all", "all") else "hard"
        items.append(Item(f"Premise 1: {prem[0]}. Premise 2: {prem[1]}. Based only on these premises, "
                          f"must it be true that {concl}? Answer yes or no.", answer, "exact", difficulty))
    return items


def gen_logic(rng: random.Random) -> list[Item]:
    items = gen_ordering(rng, 20) + gen_syllogisms(rng, 14)
    for i in range(12):  # parity
        a, b = rng.randint(11, 999), rng.randint(11, 999)
        if i % 2:
            expr, value, difficulty = f"the product of {a} and {b}", a * b, "hard"
        else:
            expr, value, difficulty = f"{a} + {b}", a + b, "medium"
        items.append(Item(f"Is {expr} odd or even? Answer with one word: odd or even.",
                          "even" if value % 2 == 0 else "odd", "exact", difficulty))
    for i in range(14):  # decimal comparison; the longer decimal is often the smaller number
        whole = rng.randint(0, 9)
        a = Fraction(rng.randint(1, 9), 10)
        b = a - Fraction(rng.randint(1, 9), 100) if i % 2 else a + Fraction(rng.randint(1, 9), 100)
        if b <= 0 or b >= 1:
            b = a + Fraction(5, 100)
        x, y = whole + a, whole + b
        if rng.random() < 0.5:
            x, y = y, x
        items.append(Item(f"Which number is larger: {fmt(x)} or {fmt(y)}? {JUST_NUMBER}", fmt(max(x, y)),
                          "numeric", "hard" if max(x, y) == whole + a else "medium"))
    return items


# --------------------------------------------------------------------------------------------
# handwritten multiple choice: (question, correct option, three wrong options, difficulty)

GENERAL_KNOWLEDGE = [
    ("What is the capital of France?", "Paris", ["Lyon", "Marseille", "Nice"], "easy"),
    ("What is the capital of Japan?", "Tokyo", ["Osaka", "Kyoto", "Hiroshima"], "easy"),
    ("What is the capital of Australia?", "Canberra", ["Sydney", "Melbourne", "Perth"], "hard"),
    ("What is the capital of Canada?", "Ottawa", ["Toronto", "Vancouver", "Montreal"], "hard"),
    ("What is the capital of Italy?", "Rome", ["Milan", "Naples", "Venice"], "easy"),
    ("What is the capital of Germany?", "Berlin", ["Munich", "Hamburg", "Frankfurt"], "easy"),
    ("What is the capital of Spain?", "Madrid", ["Barcelona", "Seville", "Valencia"], "easy"),
    ("What is the capital of Egypt?", "Cairo", ["Alexandria", "Luxor", "Aswan"], "easy"),
    ("What is the capital of Brazil?", "Brasilia", ["Rio de Janeiro", "Sao Paulo", "Salvador"], "hard"),
    ("What is the capital of Kenya?", "Nairobi", ["Mombasa", "Kisumu", "Nakuru"], "medium"),
    ("What is the capital of Turkey?", "Ankara", ["Istanbul", "Izmir", "Antalya"], "hard"),
    ("What is the capital of South Korea?", "Seoul", ["Busan", "Incheon", "Daegu"], "easy"),
    ("What is the capital of Argentina?", "Buenos Aires", ["Cordoba", "Rosario", "Mendoza"], "medium"),
    ("What is the capital of Russia?", "Moscow", ["Saint Petersburg", "Novosibirsk", "Kazan"], "easy"),
    ("What is the capital of India?", "New Delhi", ["Mumbai", "Kolkata", "Chennai"], "medium"),
    ("What is the capital of Norway?", "Oslo", ["Bergen", "Trondheim", "Stavanger"], "medium"),
    ("What is the capital of New Zealand?", "Wellington", ["Auckland", "Christchurch", "Hamilton"], "hard"),
    ("What is the capital of Morocco?", "Rabat", ["Casablanca", "Marrakesh", "Fez"], "hard"),
    ("What is the capital of Vietnam?", "Hanoi", ["Ho Chi Minh City", "Da Nang", "Hue"], "hard"),
    ("What is the capital of Greece?", "Athens", ["Sparta", "Thessaloniki", "Corinth"], "easy"),
    ("What is the capital of Portugal?", "Lisbon", ["Porto", "Braga", "Coimbra"], "medium"),
    ("What is the capital of Ireland?", "Dublin", ["Cork", "Galway", "Limerick"], "medium"),
    ("What is the capital of Thailand?", "Bangkok", ["Chiang Mai", "Phuket", "Pattaya"], "medium"),
    ("Which is the largest planet in our solar system?", "Jupiter", ["Saturn", "Neptune", "Earth"], "easy"),
    ("Which planet is closest to the Sun?", "Mercury", ["Venus", "Mars", "Earth"], "easy"),
    ("Which planet is known as the Red Planet?", "Mars", ["Venus", "Jupiter", "Mercury"], "easy"),
    ("How many planets are in our solar system, as defined by the International Astronomical Union since 2006?",
     "8", ["7", "9", "10"], "medium"),
    ("Which planet is famous for its large, bright ring system?", "Saturn", ["Mars", "Mercury", "Venus"], "easy"),
    ("What is the largest ocean on Earth?", "Pacific Ocean", ["Atlantic Ocean", "Indian Ocean", "Arctic Ocean"], "easy"),
    ("What is the longest river in South America?", "Amazon", ["Parana", "Orinoco", "Magdalena"], "medium"),
    ("On which continent is the Sahara Desert?", "Africa", ["Asia", "Australia", "South America"], "easy"),
    ("What is the highest mountain on Earth, measured above sea level?", "Mount Everest",
     ["K2", "Kangchenjunga", "Mont Blanc"], "easy"),
    ("Which is the largest country in the world by area?", "Russia", ["Canada", "China", "United States"], "medium"),
    ("On which continent is Brazil?", "South America", ["Africa", "Europe", "Asia"], "easy"),
    ("Which ocean does a direct flight from London to New York cross?", "Atlantic Ocean",
     ["Pacific Ocean", "Indian Ocean", "Southern Ocean"], "medium"),
    ("Which is the smallest continent by area?", "Australia", ["Europe", "Antarctica", "South America"], "hard"),
    ("In which year did World War II end?", "1945", ["1939", "1918", "1950"], "medium"),
    ("Who was the first President of the United States?", "George Washington",
     ["Thomas Jefferson", "Abraham Lincoln", "John Adams"], "easy"),
    ("In which year did humans first land on the Moon?", "1969", ["1959", "1972", "1965"], "medium"),
    ("Who was the first person to walk on the Moon?", "Neil Armstrong",
     ["Buzz Aldrin", "Yuri Gagarin", "John Glenn"], "easy"),
    ("Who was the first human to travel into space?", "Yuri Gagarin",
     ["Neil Armstrong", "Alan Shepard", "John Glenn"], "medium"),
    ("In which year did World War I begin?", "1914", ["1912", "1918", "1939"], "medium"),
    ("In which year did the Berlin Wall fall?", "1989", ["1979", "1991", "1961"], "hard"),
    ("Which ancient civilization built the great pyramids of Giza?", "The ancient Egyptians",
     ["The Romans", "The Aztecs", "The Vikings"], "easy"),
    ("Who wrote the play 'Romeo and Juliet'?", "William Shakespeare",
     ["Charles Dickens", "Jane Austen", "Mark Twain"], "easy"),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci", ["Michelangelo", "Raphael", "Vincent van Gogh"], "easy"),
    ("In which year was the United States Declaration of Independence adopted?", "1776",
     ["1789", "1812", "1492"], "medium"),
    ("In which year did Christopher Columbus first reach the Americas?", "1492", ["1607", "1588", "1776"], "medium"),
    ("In which year did the Titanic sink?", "1912", ["1905", "1921", "1898"], "hard"),
    ("Who developed the theory of relativity?", "Albert Einstein",
     ["Isaac Newton", "Niels Bohr", "Galileo Galilei"], "easy"),
    ("Who wrote the novel 'Pride and Prejudice'?", "Jane Austen",
     ["Charlotte Bronte", "Emily Dickinson", "Virginia Woolf"], "medium"),
    ("Which composer wrote the 'Moonlight Sonata'?", "Ludwig van Beethoven",
     ["Wolfgang Amadeus Mozart", "Johann Sebastian Bach", "Frederic Chopin"], "hard"),
    ("How many days are there in a leap year?", "366", ["365", "364", "360"], "easy"),
    ("How many sides does a hexagon have?", "6", ["5", "7", "8"], "easy"),
    ("What is the official currency of Japan?", "Yen", ["Won", "Yuan", "Ringgit"], "medium"),
    ("What is the official currency of the United Kingdom?", "Pound sterling", ["Euro", "Dollar", "Franc"], "easy"),
    ("What is the main language spoken in Brazil?", "Portuguese", ["Spanish", "French", "English"], "medium"),
    ("What is the main language spoken in Mexico?", "Spanish", ["Portuguese", "English", "French"], "easy"),
    ("How many players does each team have on the field in a standard soccer (association football) match?",
     "11", ["9", "10", "12"], "medium"),
    ("How many squares are on a standard chessboard?", "64", ["32", "81", "100"], "medium"),
    ("How many years apart are consecutive Summer Olympic Games normally held?", "4", ["2", "3", "5"], "easy"),
    ("Which color do you get by mixing blue and yellow paint?", "Green", ["Purple", "Orange", "Brown"], "easy"),
    ("Which musical instrument has 88 keys in its standard modern form?", "Piano",
     ["Violin", "Flute", "Trumpet"], "easy"),
    ("In which city is the Colosseum?", "Rome", ["Athens", "Paris", "Istanbul"], "easy"),
    ("In which country are kangaroos native?", "Australia", ["South Africa", "Brazil", "India"], "easy"),
    ("Which country gave the Statue of Liberty to the United States?", "France",
     ["United Kingdom", "Spain", "Italy"], "medium"),
    ("Which country is often called the 'Land of the Rising Sun'?", "Japan",
     ["China", "Thailand", "South Korea"], "medium"),
    ("In which country is the Great Wall?", "China", ["India", "Japan", "Egypt"], "easy"),
    ("How many years are in a century?", "100", ["10", "50", "1000"], "easy"),
]

SCIENCE = [
    ("What is the chemical symbol for gold?", "Au", ["Ag", "Gd", "Go"], "medium"),
    ("What is the chemical symbol for sodium?", "Na", ["So", "Sn", "Sd"], "hard"),
    ("What is the chemical symbol for iron?", "Fe", ["Ir", "In", "Fr"], "medium"),
    ("What is the chemical symbol for silver?", "Ag", ["Au", "Si", "Sv"], "medium"),
    ("What is the chemical symbol for lead?", "Pb", ["Le", "Ld", "Pl"], "hard"),
    ("Which element has the chemical symbol K?", "Potassium", ["Krypton", "Calcium", "Phosphorus"], "hard"),
    ("What is the chemical formula for water?", "H2O", ["CO2", "O2", "NaCl"], "easy"),
    ("What is the chemical formula for carbon dioxide?", "CO2", ["CO", "CH4", "C2O"], "easy"),
    ("Which gas do plants take in from the air for photosynthesis?", "Carbon dioxide",
     ["Oxygen", "Nitrogen", "Helium"], "easy"),
    ("Which gas do plants release as a product of photosynthesis?", "Oxygen",
     ["Carbon dioxide", "Methane", "Nitrogen"], "easy"),
    ("Which gas makes up most of Earth's atmosphere?", "Nitrogen", ["Oxygen", "Carbon dioxide", "Argon"], "hard"),
    ("Which gas is the main component of natural gas?", "Methane", ["Propane", "Butane", "Hydrogen"], "medium"),
    ("What is the boiling point of pure water at sea level?", "100 degrees Celsius",
     ["90 degrees Celsius", "80 degrees Celsius", "212 degrees Celsius"], "easy"),
    ("What is the freezing point of pure water at sea level, in Fahrenheit?", "32 degrees Fahrenheit",
     ["0 degrees Fahrenheit", "100 degrees Fahrenheit", "212 degrees Fahrenheit"], "medium"),
    ("What is the freezing point of pure water at sea level, in Celsius?", "0 degrees Celsius",
     ["10 degrees Celsius", "4 degrees Celsius", "32 degrees Celsius"], "easy"),
    ("Approximately what temperature is absolute zero?", "-273 degrees Celsius",
     ["-100 degrees Celsius", "0 degrees Celsius", "-459 degrees Celsius"], "hard"),
    ("What is the atomic number of hydrogen?", "1", ["2", "0", "8"], "easy"),
    ("What is the atomic number of carbon?", "6", ["12", "8", "4"], "hard"),
    ("Which element has atomic number 8?", "Oxygen", ["Carbon", "Nitrogen", "Neon"], "medium"),
    ("Which subatomic particle has a negative electric charge?", "Electron", ["Proton", "Neutron", "Nucleus"], "easy"),
    ("Which subatomic particle has no electric charge?", "Neutron", ["Proton", "Electron", "Alpha particle"], "medium"),
    ("What is the small, dense center of an atom called?", "Nucleus", ["Electron cloud", "Orbital", "Molecule"], "easy"),
    ("In a neutral atom, the number of electrons equals the number of what?", "Protons",
     ["Neutrons", "Molecules", "Isotopes"], "medium"),
    ("What is the pH of pure water at 25 degrees Celsius?", "7", ["0", "1", "14"], "medium"),
    ("Which of these is a noble gas?", "Helium", ["Hydrogen", "Nitrogen", "Oxygen"], "medium"),
    ("What is the chemical name of common table salt?", "Sodium chloride",
     ["Potassium chloride", "Sodium carbonate", "Calcium chloride"], "medium"),
    ("What is the hardest naturally occurring mineral?", "Diamond", ["Quartz", "Topaz", "Granite"], "easy"),
    ("What is the SI unit of force?", "Newton", ["Joule", "Watt", "Pascal"], "medium"),
    ("What is the SI unit of energy?", "Joule", ["Newton", "Watt", "Volt"], "medium"),
    ("What is the SI unit of power?", "Watt", ["Joule", "Ampere", "Ohm"], "medium"),
    ("What is the SI unit of electric current?", "Ampere", ["Volt", "Ohm", "Coulomb"], "hard"),
    ("What is the unit of electrical resistance?", "Ohm", ["Volt", "Ampere", "Farad"], "medium"),
    ("What is the SI unit of frequency?", "Hertz", ["Decibel", "Tesla", "Lumen"], "medium"),
    ("Approximately how fast does light travel in a vacuum?", "300,000 kilometers per second",
     ["300 kilometers per second", "30,000 kilometers per second", "3,000,000 kilometers per second"], "hard"),
    ("Approximately what is the acceleration due to gravity at Earth's surface?", "9.8 meters per second squared",
     ["1.6 meters per second squared", "3.7 meters per second squared", "98 meters per second squared"], "hard"),
    ("Which scientist formulated the three laws of motion?", "Isaac Newton",
     ["Albert Einstein", "Galileo Galilei", "Johannes Kepler"], "easy"),
    ("Newton's first law of motion is also known as the law of what?", "Inertia",
     ["Acceleration", "Gravitation", "Reflection"], "medium"),
    ("According to Ohm's law, voltage equals current multiplied by what?", "Resistance",
     ["Power", "Charge", "Frequency"], "medium"),
    ("Which force keeps the planets in orbit around the Sun?", "Gravity",
     ["Magnetism", "Friction", "Air resistance"], "easy"),
    ("Through which of these can sound NOT travel?", "A vacuum", ["Water", "Air", "Steel"], "medium"),
    ("In which of these materials does sound travel fastest?", "Steel", ["Air", "Water", "Helium gas"], "hard"),
    ("Which color of visible light has the longest wavelength?", "Red", ["Violet", "Blue", "Green"], "hard"),
    ("What kind of lens corrects nearsightedness (myopia)?", "A concave (diverging) lens",
     ["A convex (converging) lens", "A flat pane of glass", "A prism"], "hard"),
    ("How does the density of ice compare with that of liquid water?", "Ice is less dense",
     ["Ice is more dense", "They have the same density", "Ice has no density"], "medium"),
    ("What does DNA stand for?", "Deoxyribonucleic acid",
     ["Diribonucleic acid", "Deoxyribonitric acid", "Dinucleotide amino acid"], "medium"),
    ("Which organelle produces most of a cell's ATP and is called the powerhouse of the cell?", "Mitochondrion",
     ["Nucleus", "Ribosome", "Golgi apparatus"], "easy"),
    ("Where is most of the DNA stored in a eukaryotic cell?", "In the nucleus",
     ["In the cell membrane", "In the ribosomes", "In the vacuole"], "medium"),
    ("Which organelle is found in plant cells but not in animal cells?", "Chloroplast",
     ["Mitochondrion", "Nucleus", "Ribosome"], "medium"),
    ("Which organ pumps blood through the human body?", "Heart", ["Liver", "Lungs", "Kidneys"], "easy"),
    ("What is the largest organ of the human body?", "Skin", ["Liver", "Brain", "Heart"], "hard"),
    ("How many chambers does the human heart have?", "4", ["2", "3", "5"], "medium"),
    ("Which blood cells carry oxygen around the body?", "Red blood cells",
     ["White blood cells", "Platelets", "Nerve cells"], "easy"),
    ("Which organ produces insulin in the human body?", "Pancreas", ["Liver", "Kidney", "Stomach"], "medium"),
    ("How many bones are in the typical adult human body?", "206", ["186", "226", "300"], "hard"),
    ("How many pairs of chromosomes do humans typically have?", "23", ["21", "46", "32"], "hard"),
    ("What is the largest mammal on Earth?", "Blue whale", ["African elephant", "Giraffe", "Hippopotamus"], "easy"),
    ("What is the process by which plants use light to make food?", "Photosynthesis",
     ["Respiration", "Fermentation", "Digestion"], "easy"),
    ("Which pigment makes plants green?", "Chlorophyll", ["Hemoglobin", "Melanin", "Keratin"], "easy"),
    ("Which part of a plant absorbs most of its water from the soil?", "Roots", ["Leaves", "Flowers", "Seeds"], "easy"),
    ("To which group of animals do whales belong?", "Mammals", ["Fish", "Reptiles", "Amphibians"], "medium"),
    ("To which group of animals do frogs belong?", "Amphibians", ["Reptiles", "Mammals", "Fish"], "medium"),
    ("What kind of animal is a penguin?", "Bird", ["Mammal", "Fish", "Reptile"], "medium"),
    ("How many legs does a spider have?", "8", ["6", "10", "4"], "easy"),
    ("How many legs does an insect have?", "6", ["8", "4", "10"], "medium"),
    ("Which planet has the highest average surface temperature?", "Venus", ["Mercury", "Mars", "Jupiter"], "hard"),
    ("What kind of object is the Sun?", "A star", ["A planet", "A comet", "A galaxy"], "easy"),
    ("Which star is closest to Earth?", "The Sun", ["Proxima Centauri", "Sirius", "Polaris"], "hard"),
    ("What causes the seasons on Earth?", "The tilt of Earth's axis",
     ["Changes in Earth's distance from the Sun", "The phases of the Moon", "Sunspots"], "hard"),
    ("About how long does Earth take to orbit the Sun once?", "About 365 days",
     ["About 30 days", "About 24 hours", "About 10 years"], "easy"),
    ("About how long does Earth take to rotate once on its axis?", "About 24 hours",
     ["About 1 hour", "About 7 days", "About 365 days"], "easy"),
    ("What is Earth's only natural satellite?", "The Moon", ["Phobos", "Titan", "Europa"], "easy"),
]


def gen_mcq(rng: random.Random, bank: list[tuple[str, str, list[str], str]]) -> list[Item]:
    items = []
    n = len(bank)
    # correct letters cycle A-D in a shuffled order, so every letter is correct about equally often
    positions = [i % 4 for i in range(n)]
    rng.shuffle(positions)
    for (question, correct, wrong, difficulty), pos in zip(bank, positions):
        others = list(wrong)
        rng.shuffle(others)
        choices = others[:pos] + [correct] + others[pos:]
        items.append(Item(question, "ABCD"[pos], "mcq", difficulty, choices))
    return items


# --------------------------------------------------------------------------------------------
# long context (exact and numeric): a long generated register with one fact to find or a count to
# make, and a short answer, so that reading the prompt (prefill) costs more than writing the answer

LOCKER_OWNERS = NAMES + ("Quinn", "Rosa", "Sami", "Tara", "Uma", "Vik", "Wren", "Yusuf", "Zoe", "Abel", "Bea",
                         "Cyrus", "Dina", "Emil")
LOCKER_THINGS = ("umbrella", "helmet", "backpack", "toolbox", "camera", "notebook", "lantern", "scarf", "kettle",
                 "radio", "blanket", "compass")
LOCKER_COLORS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple")


def article(word: str) -> str:
    return f"{'an' if word[0] in VOWELS else 'a'} {word}"


def gen_long_context(rng: random.Random) -> list[Item]:
    """24 registers of 36-72 lockers (about 1,000-2,000 tokens each); ask for an owner, a door code, or
    how many lockers hold an item of one color."""
    items = []
    for i in range(24):
        rows = [(number, rng.choice(LOCKER_OWNERS), rng.choice(LOCKER_COLORS), rng.choice(LOCKER_THINGS),
                 rng.randint(1000, 9999)) for number in rng.sample(range(100, 1000), rng.randint(36, 72))]
        register = "\n".join(f"Locker {n}: assigned to {owner}, holds {article(color)} {thing}, door code {code}."
                             for n, owner, color, thing, code in rows)
        number, owner, _, _, code = rng.choice(rows)
        kind = ("owner", "code", "count")[i % 3]
        if kind == "owner":
            question, answer, scorer = f"Who is locker {number} assigned to? Answer with just the name.", owner, "exact"
        elif kind == "code":
            question, answer, scorer = f"What is the door code of locker {number}? {JUST_NUMBER}", str(code), "numeric"
        else:
            color = rng.choice(LOCKER_COLORS)
            question = f"How many lockers hold {article(color)} item? {JUST_NUMBER}"
            answer, scorer = str(sum(row[2] == color for row in rows)), "numeric"
        items.append(Item(f"Here is the register of the lockers in a building:\n{register}\n\n{question}",
                          answer, scorer, "hard"))
    return items


# --------------------------------------------------------------------------------------------
# chat (judge): open-ended prompts written by hand for this project: advice, explanation and short
# creative tasks with no single right answer. Each asks for a reply short enough for the default
# 48-token cap (one or two sentences, a few lines, a short list). They have no reference answer
# ("answer": ""): scorer ``judge`` compares a backend's reply with a reference backend's reply to
# the same prompt (``--grading vs-backend:NAME``); without a judge they are unscored, never wrong.
# (kind, prompt); the kind only documents the mix and is not written out.

CHAT = [
    # advice
    ("advice", "Give two tips for keeping houseplants alive in winter, one sentence each."),
    ("advice", "In one or two sentences, what should someone do the night before a job interview?"),
    ("advice", "Suggest two simple ways to drink more water during the day. Keep it brief."),
    ("advice", "In two sentences, how can a beginner start running without getting hurt?"),
    ("advice", "Give three quick ideas for a rainy Saturday afternoon with kids, as a short list."),
    ("advice", "In one or two sentences, how should I tell a friend that I cannot come to their party?"),
    ("advice", "What is one good habit for keeping a desk tidy? Answer in one sentence."),
    ("advice", "Give two tips for sleeping better on a hot summer night, one sentence each."),
    ("advice", "In two sentences, how can I remember the names of people I meet at a party?"),
    ("advice", "Suggest a cheap, healthy lunch someone could pack for work. One or two sentences."),
    ("advice", "In one or two sentences, what is a good way to start learning a new language?"),
    ("advice", "Give two short tips for writing a clear email to a busy colleague."),
    ("advice", "How can someone feel less nervous before speaking in public? Answer in two sentences."),
    ("advice", "Suggest two ways to save a little money on groceries each week. Keep it short."),
    ("advice", "In one or two sentences, what should I pack for a day hike in the hills?"),
    ("advice", "Give one tip for helping a new cat settle into a home, in a sentence or two."),
    # explanation
    ("explain", "Explain to a 10-year-old why the sky is blue, in three short sentences."),
    ("explain", "In one or two sentences, why do we have leap years?"),
    ("explain", "Explain in two sentences why bread goes stale."),
    ("explain", "In one or two simple sentences, what does a thermostat do?"),
    ("explain", "Explain to a child in two sentences why we need to sleep."),
    ("explain", "In one or two sentences, why does ice float on water?"),
    ("explain", "Explain briefly, in two sentences, how a rainbow forms."),
    ("explain", "In one or two sentences, what is the difference between weather and climate?"),
    ("explain", "Explain in two sentences why onions make people cry when they cut them."),
    ("explain", "In one or two sentences, what does it mean to recycle something?"),
    ("explain", "Explain to a beginner in two sentences what a password manager is for."),
    ("explain", "In one or two sentences, why do leaves change color in autumn?"),
    ("explain", "Explain in two simple sentences how a bicycle stays upright while moving."),
    ("explain", "In one or two sentences, why is it a good idea to wash your hands before eating?"),
    ("explain", "Explain in two sentences what an echo is."),
    ("explain", "In one or two sentences, why do cats purr?"),
    # short creative tasks
    ("creative", "Write a four-line poem about a lighthouse keeper."),
    ("creative", "Write a two-sentence story about a lost umbrella that finds its way home."),
    ("creative", "Invent a name and a one-sentence description for a new ice cream flavor."),
    ("creative", "Write a haiku about the first snow of the year."),
    ("creative", "Describe a busy train station in two vivid sentences."),
    ("creative", "Write a friendly one-sentence note to a neighbor thanking them for watering your plants."),
    ("creative", "Give a short, cheerful slogan for a neighborhood bakery."),
    ("creative", "Write a four-line poem about a cup of morning tea."),
    ("creative", "In two sentences, describe a dragon who is afraid of the dark."),
    ("creative", "Write a one-sentence opening line for a mystery story set on a ship."),
    ("creative", "Invent a name for a friendly robot and describe what it does in one sentence."),
    ("creative", "Write a two-line rhyme about a cat who loves boxes."),
    ("creative", "Describe the smell of a forest after rain in one or two sentences."),
    ("creative", "Write a short toast, two sentences long, for a friend's birthday."),
    ("creative", "Write a three-line poem about a city at night."),
    ("creative", "Give three possible names for a small boat, as a short list."),
]


def gen_chat(rng: random.Random) -> list[Item]:
    """The handwritten open-ended prompts, in the order written (``rng`` is unused: nothing is drawn)."""
    return [Item(prompt, "", "judge", kind) for kind, prompt in CHAT]


# --------------------------------------------------------------------------------------------

#: Not in the default subset (its ids stay as they were before these categories were added; ``chat``
#: also because judging each answer costs time on a 2-core machine).
NOT_IN_DEFAULT = ("long_context", "chat")

CATEGORIES = (  # name, id prefix, generator; the order is the order in the file
    ("arithmetic", "arith", gen_arithmetic),
    ("unit_conversion", "units", gen_units),
    ("dates", "dates", gen_dates),
    ("strings", "str", gen_strings),
    ("logic", "logic", gen_logic),
    ("general_knowledge", "gk", lambda rng: gen_mcq(rng, GENERAL_KNOWLEDGE)),
    ("science", "sci", lambda rng: gen_mcq(rng, SCIENCE)),
    ("long_context", "long", gen_long_context),
    ("chat", "chat", gen_chat),
)


def build(seed: int = DEFAULT_SEED) -> tuple[list[dict], list[str]]:
    """The rows of the set and the ids of the default subset."""
    rows: list[dict] = []
    by_category: dict[str, list[tuple[str, str]]] = {}
    for k, (category, prefix, gen) in enumerate(CATEGORIES):
        rng = random.Random(seed * 100 + k)
        seen_prompts: set[str] = set()
        number = 0
        for item in gen(rng):
            if item.prompt in seen_prompts:  # a repeated random draw: keep the first
                continue
            seen_prompts.add(item.prompt)
            number += 1
            qid = f"{prefix}-{number:04d}"
            row = {"id": qid, "prompt": item.prompt, "answer": item.answer}
            if item.choices:
                row["choices"] = item.choices
            row["category"] = category
            row["scorer"] = item.scorer
            rows.append(row)
            by_category.setdefault(category, []).append((qid, item.difficulty))
    return rows, default_subset({c: v for c, v in by_category.items() if c not in NOT_IN_DEFAULT}, seed)


def default_subset(by_category: dict[str, list[tuple[str, str]]], seed: int,
                   size: int = DEFAULT_SUBSET_SIZE) -> list[str]:
    """A stratified pick: size // n per category, the rest to seeded categories; easy and hard mixed."""
    rng = random.Random(seed * 100 + 99)
    cats = sorted(by_category)
    per = {c: size // len(cats) for c in cats}
    for c in rng.sample(cats, size % len(cats)):
        per[c] += 1
    picked: list[str] = []
    for c in cats:
        pools = {d: [qid for qid, diff in by_category[c] if diff == d] for d in ("easy", "medium", "hard")}
        order = [d for d in ("easy", "hard", "medium", "hard", "easy") if pools[d]]
        for d in itertools.islice(itertools.cycle(order), per[c]):
            choice = rng.choice([q for q in pools[d] if q not in picked])
            picked.append(choice)
    return picked


def render(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def subset_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.stem + "-default.txt")


def main(out_path: str | Path = DEFAULT_OUT, seed: int = DEFAULT_SEED) -> Path:
    """Write the set to ``out_path`` and its default subset beside it; returns ``out_path``."""
    out_path = Path(out_path)
    rows, subset = build(seed)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(render(rows))
    subset_path(out_path).write_bytes(("\n".join(subset) + "\n").encode("utf-8"))
    return out_path


def check(out_path: Path, seed: int) -> bool:
    """True when the files on disk are exactly what this generator produces now."""
    rows, subset = build(seed)
    same = out_path.exists() and out_path.read_bytes() == render(rows)
    sub = subset_path(out_path)
    return same and sub.exists() and sub.read_bytes() == ("\n".join(subset) + "\n").encode("utf-8")


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output .jsonl (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="verify the files are up to date; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        if check(args.out, args.seed):
            print(f"{args.out}: up to date")
            return 0
        print(f"{args.out}: differs from the generator output; run: python datasets/generate.py", file=sys.stderr)
        return 1
    path = main(args.out, args.seed)
    rows, subset = build(args.seed)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["category"]] = counts.get(r["category"], 0) + 1
    print(f"wrote {path} ({len(rows)} queries: "
          + ", ".join(f"{c} {n}" for c, n in counts.items()) + f") and {subset_path(path).name} ({len(subset)} ids)")
    # regenerating must give the same bytes
    if not check(path, args.seed):
        print("generator is not deterministic", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
