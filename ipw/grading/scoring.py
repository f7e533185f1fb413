"""Deterministic scorers: does a model's free-form output match the reference answer?

Every scorer has the signature ``scorer(output, answer, choices) -> bool`` and is registered in
:data:`SCORERS`; :func:`score` looks one up by name (and returns None, unscored, for ``judge``). They never call a model and never raise for an
odd output (an empty or garbled output simply scores wrong); a broken *reference* (a ``numeric``
answer that is not a number, an invalid ``regex``) raises :class:`IpwError`, since the dataset needs
fixing.

Scorers and what they accept (precedence is part of the contract, so it is spelled out):

``mcq``
    ``answer`` is a letter (A, B, C, ...) of ``choices``. The chosen letter is looked for in tiers;
    the first tier that finds something decides, and a tier that finds contradicting letters makes
    the output wrong:

    1. answer markers, first occurrence wins: "the answer is (B)", "Answer: D", "correct option is
       C", "I'd go with B", "(B) is correct". "The answer is B or C" is ambiguous (wrong).
    2. a letter leading the output: "B", "b)", "(C)", "**C**", "D. Paris", "A: ...". A bare leading
       "A" followed by more words ("A good question...") is read as an article, not as choice A.
    3. explicitly formatted letters anywhere ("(B)", "[B]", "**B**", "B)"): exactly one distinct
       letter decides; several distinct ones (e.g. the options restated) make the output wrong.
    4. option text: exactly one option's text occurs (case-insensitive, word-bounded; an option whose
       text is part of another matched option's text is ignored), e.g. "I think it is Paris".
    5. a standalone capital letter (option texts masked out, so "Vitamin C" is not choice C; "A"/"I"
       followed by an ordinary word are read as article/pronoun): exactly one distinct letter decides.

    Negated mentions ("not (A)") are skipped in tiers 3 and 5. Limitations: option texts mentioned
    while being rejected ("not London but Paris") make tier 4 ambiguous; letters spelled out
    ("option bee") are not understood.

``exact``
    Normalized equality (:func:`normalize`: Unicode NFKC, case-folded, punctuation and symbols
    removed except inside numbers such as ``3.5``/``1,234``/``2024-03-05`` and inside words such as
    ``don't``, whitespace runs collapsed; markdown ``*``/backticks dropped; a leading "the answer
    is", "answer:", "final answer:" removed). Correct when any of these equals the normalized answer:
    the whole output, its first non-empty line, the first clause of that line (up to ``, ; : ! ? .``
    followed by a space, e.g. "Yes, because ..."), or the rest of the line after the last
    "answer is"/"answer:" marker (and that rest's first clause).

``numeric``
    The reference is a number ("12.5", "-3", "1,234", "3/4"); the output's number is picked by
    precedence: (1) the content of the last ``\\boxed{...}``; (2) the number right after the *last*
    "answer is" / "answer:" / "answer =" / "####" that is directly followed by a number (fillers
    such as "approximately", "$", "**" allowed), so numbers of a restated question never win over a
    clear answer; (3) the number right after the last "=" / "equals" / "is equal to", unless a later
    sentence holds another number; (4) the final number in the output. Signs (``-``, ``+``,
    Unicode minus; a ``-`` between two numbers is subtraction, not a sign), decimals, thousands
    separators, a leading currency sign and a trailing unit or ``%`` are handled; ``1e3`` is read
    as 1000. ``a/b`` is read as a fraction only when the reference is a fraction. Tolerance:
    ``math.isclose`` with rel 1e-6, abs 1e-9. Limitations: number words ("twelve") are not read, and
    "45%" is 45, not 0.45.

``contains``
    The normalized answer occurs in the normalized output, bounded by non-word characters
    ("Paris" is in "It is Paris, France" but "3" is not in "13").

``regex``
    ``answer`` is a Python regular expression searched (``re.IGNORECASE``) anywhere in the raw
    output; scoped flags such as ``(?-i:...)`` may be used for a case-sensitive part.

``judge``
    Not a deterministic scorer: the item (e.g. ipw-core's open-ended ``chat`` prompts) is graded only
    by an LLM judge that compares the answer with a reference backend's answer to the same query
    (:mod:`ipw.grading.judge`, grading ``vs-backend:NAME``). ``answer`` may be empty. Without a judge at hand
    :func:`score` returns None: the record is *unscored*, never wrong. It is a known scorer name
    (:data:`KNOWN_SCORERS`) but has no function in :data:`SCORERS`.
"""

from __future__ import annotations

import math
import re
import unicodedata
from fractions import Fraction
from functools import lru_cache
from typing import Callable

from ipw.errors import IpwError

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

Scorer = Callable[[str, str, "tuple[str, ...] | None"], bool]

# --------------------------------------------------------------------------------------------
# normalization (shared by exact, contains and mcq's option-text tier)

_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2212": "-",
                         "\u2013": "-", "\u2014": "-", "\u00a0": " "})


def _is_punct(ch: str) -> bool:
    return unicodedata.category(ch)[0] in ("P", "S")


def normalize(text: str) -> str:
    """Case-fold, drop punctuation/symbols (except inside numbers and words), collapse whitespace."""
    t = unicodedata.normalize("NFKC", str(text)).translate(_QUOTES).casefold()
    out: list[str] = []
    n = len(t)
    for i, ch in enumerate(t):
        if not _is_punct(ch):
            out.append(ch)
            continue
        prev = t[i - 1] if i > 0 else ""
        nxt = t[i + 1] if i + 1 < n else ""
        if prev.isdigit() and nxt.isdigit():  # 3.5, 1,234, 3/4, 2024-03-05, 12:30
            out.append(ch)
        elif ch in "'-" and prev.isalpha() and nxt.isalpha():  # don't, well-known
            out.append(ch)
        elif ch in "-+" and nxt.isdigit() and not prev.isalnum():  # a sign: -5
            out.append(ch)
        else:
            out.append(" ")
    return " ".join("".join(out).split())


_MARKDOWN = re.compile(r"[*`#]+")
_PREFIX = re.compile(
    r"^\s*(?:(?:the\s+)?(?:final\s+|correct\s+|short\s+)?answer(?:\s+is\b|\s*[:=\-])\s*:?|final\s*:)\s*",
    re.IGNORECASE,
)


def _strip_prefix(text: str) -> str:
    return _PREFIX.sub("", _MARKDOWN.sub("", text), count=1)


# --------------------------------------------------------------------------------------------
# exact

_CLAUSE_END = re.compile(r"[,;:!?.](?=\s|$)|\s-+\s")
_ANSWER_REST = re.compile(r"\banswer(?:\s+is\b|\s*[:=])\s*:?\s*(?P<rest>[^\n]*)", re.IGNORECASE)


def _first_clause(text: str) -> str:
    m = _CLAUSE_END.search(text)
    return text[: m.start()] if m else text


def _exact_candidates(output: str) -> list[str]:
    text = _MARKDOWN.sub("", unicodedata.normalize("NFKC", output).translate(_QUOTES))
    cands = [_strip_prefix(text)]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if lines:
        first = _strip_prefix(lines[0])
        cands += [first, _first_clause(first.strip())]
    rests = [m.group("rest") for m in _ANSWER_REST.finditer(text)]
    if rests:
        cands += [rests[-1], _first_clause(rests[-1].strip())]
    return cands


def exact(output: str, answer: str, choices: tuple[str, ...] | None = None) -> bool:
    """The (normalized) output, its first line or first clause equals the (normalized) answer."""
    target = normalize(answer)
    if not target:  # an answer made only of punctuation: compare literally
        return bool(answer.strip()) and output.strip() == answer.strip()
    return any(normalize(c) == target for c in _exact_candidates(output))


# --------------------------------------------------------------------------------------------
# contains


def contains(output: str, answer: str, choices: tuple[str, ...] | None = None) -> bool:
    """The normalized answer occurs, word-bounded, in the normalized output."""
    target = normalize(answer)
    if not target:
        return bool(answer.strip()) and answer.strip() in output
    return re.search(r"(?<!\w)" + re.escape(target) + r"(?!\w)", normalize(output)) is not None


# --------------------------------------------------------------------------------------------
# regex


@lru_cache(maxsize=1024)
def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        raise IpwError(f"scorer 'regex': invalid pattern {pattern!r} ({exc})") from None


def regex(output: str, answer: str, choices: tuple[str, ...] | None = None) -> bool:
    """``answer`` is a regular expression found (case-insensitively) in the output."""
    return _compile(answer).search(output) is not None


# --------------------------------------------------------------------------------------------
# numeric

_NUM_CORE = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_NUM_BODY = (
    r"(?<![\w.])(?P<sign>[-+])?[$\u20ac\u00a3\u00a5]?(?P<num>" + _NUM_CORE + r")"
    r"(?:[eE](?P<exp>[-+]?\d{1,3})(?![\w]))?"
)
_FRAC_TAIL = r"(?:\s*/\s*(?P<den>\d+)(?![\d.]))?"
_NUM = re.compile(_NUM_BODY)
_NUM_FRAC = re.compile(_NUM_BODY + _FRAC_TAIL)
_FRACTION_ANSWER = re.compile(r"^\s*[-+]?\s*\d+\s*/\s*\d+\s*$")

_FILLER = (
    r"(?:[\s:=~(\[`'\"]|approximately|approx\.?|about|around|roughly|exactly|"
    r"equal\s+to|equals|just|simply|therefore|thus|a\s+total\s+of)*"
)
_ANSWER_MARK = r"(?:\banswer(?:\s+(?:is|would\s+be|should\s+be|will\s+be|comes\s+to)\b|\s*[:=])|####)"
_EQUALS_MARK = r"(?:=|\bequals\b|\bis\s+equal\s+to\b)"
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")
_SENTENCE_BREAK = re.compile(r"[.!?](?=\s|$)|\n")


@lru_cache(maxsize=2)
def _marked_patterns(fractions: bool) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """A marker, fillers, then a number: for "answer is" and for "=" (see the module doc)."""
    body = _NUM_BODY + (_FRAC_TAIL if fractions else "")
    return (re.compile(_ANSWER_MARK + _FILLER + body, re.IGNORECASE),
            re.compile(_EQUALS_MARK + _FILLER + body, re.IGNORECASE))


def _value(m: re.Match[str]) -> Fraction:
    val = Fraction(m.group("num").replace(",", ""))
    if m.group("exp"):
        val *= Fraction(10) ** int(m.group("exp"))
    den = m.groupdict().get("den")
    if den:
        if int(den) == 0:
            raise ZeroDivisionError
        val /= int(den)
    if m.group("sign") and m.group("sign").strip() == "-":
        val = -val
    return val


def _clean(text: str) -> str:
    return unicodedata.normalize("NFKC", text).translate(_QUOTES).replace("*", " ")


def extract_number(output: str, fractions: bool = False) -> Fraction | None:
    """The number an output gives as its answer, by the precedence described in the module doc."""
    text = _clean(output)
    pat = _NUM_FRAC if fractions else _NUM
    boxed = _BOXED.findall(text)
    if boxed:
        m = pat.search(boxed[-1])
        if m:
            return _safe_value(m)
    answer_pat, equals_pat = _marked_patterns(fractions)
    hits = list(answer_pat.finditer(text))
    if hits:
        return _safe_value(hits[-1])
    all_nums = list(pat.finditer(text))
    if not all_nums:
        return None
    eq_hits = list(equals_pat.finditer(text))
    if eq_hits:
        last_eq = eq_hits[-1]
        brk = _SENTENCE_BREAK.search(text, last_eq.end())
        later = brk is not None and any(n.start() >= brk.end() for n in all_nums)
        if not later:
            return _safe_value(last_eq)
    return _safe_value(all_nums[-1])


def _safe_value(m: re.Match[str]) -> Fraction | None:
    try:
        return _value(m)
    except (ZeroDivisionError, ValueError, OverflowError):
        return None


def _reference_number(answer: str) -> tuple[Fraction, bool]:
    text = _clean(str(answer)).strip()
    is_fraction = bool(_FRACTION_ANSWER.match(text))
    pat = _NUM_FRAC if is_fraction else _NUM
    m = pat.search(text)
    val = _safe_value(m) if m else None
    if val is None:
        raise IpwError(f"scorer 'numeric': reference answer {answer!r} is not a number")
    return val, is_fraction


def numeric_match(output: str, answer: str, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """The output's answer number equals the reference within the tolerances."""
    ref, is_fraction = _reference_number(answer)
    got = extract_number(output, fractions=is_fraction)
    if got is None:
        return False
    if got == ref:
        return True
    try:
        return math.isclose(float(got), float(ref), rel_tol=rel_tol, abs_tol=abs_tol)
    except OverflowError:
        return False


def numeric(output: str, answer: str, choices: tuple[str, ...] | None = None) -> bool:
    return numeric_match(output, answer)


# --------------------------------------------------------------------------------------------
# mcq

_AMBIGUOUS = "?"  # sentinel: a tier found contradicting letters
_WL = r"[(\[{\"'`*]*"  # opening wrappers
_LET = r"(?P<wrap>[(\[])?\s*(?P<letter>[A-Za-z])(?![A-Za-z0-9'])(?P<close>\s*[)\]])?"
_OPT_WORD = r"(?:(?:option|choice|letter)\s+)?"
_T1 = [
    re.compile(
        r"\banswer(?:\s+(?:is|would\s+be|should\s+be|must\s+be|will\s+be)\b|\s*[:=\-])\s*:?\s*" + _OPT_WORD + _WL + _LET,
        re.IGNORECASE,
    ),
    re.compile(
        r"\b(?:correct|right|best)\s+(?:option|choice|letter|answer)(?:\s+(?:is|would\s+be|should\s+be|must\s+be)\b|\s*[:=])?\s*:?\s*"
        + _OPT_WORD + _WL + _LET,
        re.IGNORECASE,
    ),
    re.compile(r"\b(?:choose|pick|select|go\s+with)\s+" + _OPT_WORD + _WL + _LET, re.IGNORECASE),
    re.compile(
        r"(?<![A-Za-z0-9])" + _OPT_WORD + _WL + _LET + r"\s+is\s+(?:the\s+)?(?:correct|right|best|answer)\b",
        re.IGNORECASE,
    ),
]
_LEADING = re.compile(
    r"^\s*(?:\*\*|\*|#+\s*)?" + _OPT_WORD + r"(?P<wrap>[(\[])?\s*(?P<letter>[A-Za-z])(?![A-Za-z0-9'])"
    r"(?P<close>\s*(?:[)\]]|\.(?!\d)|:|\*\*|\s-\s))?",
    re.IGNORECASE,
)
_LISTED = re.compile(r"^[ \t*#]*(?:[(\[]\s*([A-Za-z])\s*[)\]]|([A-Z])(?:[)\]:]|\.(?!\d)))", re.MULTILINE)
_FORMATTED = re.compile(
    r"\(\s*(?P<a>[A-Za-z])\s*\)|\[(?P<b>[A-Za-z])\]|\*\*(?P<c>[A-Z])\*\*|(?<![\w(\[*])(?P<d>[A-Z])\)"
)
_BARE = re.compile(r"(?<![A-Za-z0-9'\u00b0\-+])(?P<letter>[A-Z])(?![A-Za-z0-9'+])")
_NEGATED = re.compile(r"\b(?:not|isn't|never|rather\s+than|instead\s+of)\s+(?:option\s+|choice\s+)?[(\[*]*$", re.IGNORECASE)
_CONNECTORS = {
    "or", "and", "is", "was", "would", "should", "could", "might", "must", "seems", "because", "since",
    "as", "with", "for", "which", "it", "then", "looks", "appears", "sounds", "fits", "so", "but",
}
_AMBIG_TAIL = re.compile(
    r"\s*[*)\]]*\s*(?:(?:or|/)\s*" + _OPT_WORD + r"[(\[*]*\s*(?P<x>[A-Z])(?![A-Za-z0-9])"
    r"|(?:,\s*and|,\s*or|,|and|&)\s*" + _OPT_WORD + r"[(\[*]*\s*(?P<y>[A-Z])(?![A-Za-z0-9])\s*[)\]*]*\s*(?:[.,;!?]|$|or\b|and\b))",
)


def _valid_letters(answer: str, choices: tuple[str, ...] | None) -> str:
    if choices:
        return LETTERS[: len(choices)]
    a = answer.strip().upper()
    k = LETTERS.index(a) + 1 if len(a) == 1 and a in LETTERS else 0
    return LETTERS[: max(4, k)]


def _read_letter(text: str, m: re.Match[str], valid: str, require_clear: bool) -> str | None:
    """Validate a matched letter: in range, and not an article/pronoun or a stray lowercase word."""
    raw = m.group("letter")
    letter = raw.upper()
    if letter not in valid:
        return None
    wrapped = bool(m.groupdict().get("wrap")) or bool(m.groupdict().get("close"))
    if wrapped:
        return letter
    rest = text[m.end("letter"):]
    if raw.islower():
        # "answer: b" / "answer is b." but not "the answer is a city"
        return letter if re.match(r"[ \t.!)\]*]*(?:\n|$)", rest) else None
    if require_clear and letter in "AI":
        nxt = re.match(r"[ \t]+([a-z]+)", rest)
        if nxt and nxt.group(1) not in _CONNECTORS:
            return None
    return letter


def _tier_markers(text: str, valid: str) -> str | None:
    found: list[tuple[int, str, int]] = []
    for pat in _T1:
        for m in pat.finditer(text):
            letter = _read_letter(text, m, valid, require_clear=True)
            if letter:
                end = m.end("close") if m.group("close") else m.end("letter")
                found.append((m.start("letter"), letter, end))
                break  # first valid occurrence of this pattern
    if not found:
        return None
    found.sort()
    pos, letter, end = found[0]
    tail = _AMBIG_TAIL.match(text, end)
    if tail:
        other = tail.group("x") or tail.group("y")
        if other in valid and other != letter:
            return _AMBIGUOUS
    return letter


def _tier_leading(text: str, valid: str, choices: tuple[str, ...] | None) -> str | None:
    m = _LEADING.match(text)
    if not m:
        return None
    raw = m.group("letter")
    letter = raw.upper()
    if letter not in valid:
        return None
    listed = {(a or b).upper() for a, b in _LISTED.findall(text)} & set(valid)
    if len(listed) > 1:
        return _AMBIGUOUS  # the output lists several options line by line
    first_line = _tier_formatted(text.lstrip().split("\n", 1)[0], valid)
    if first_line not in (None, letter):
        return _AMBIGUOUS  # "(A) could be right, but (B) ..."
    if m.group("wrap") or m.group("close"):
        return letter
    rest = text[m.end("letter"):]
    line_rest = rest.split("\n", 1)[0]
    if not line_rest.strip(" \t*.!"):
        return letter  # the letter is the whole first line
    if choices:  # "B Paris": the letter followed by its own option text
        opt = normalize(choices[LETTERS.index(letter)])
        if opt and normalize(line_rest).startswith(opt):
            return letter
    return None


def _negated(text: str, pos: int) -> bool:
    return _NEGATED.search(text[max(0, pos - 30):pos]) is not None


def _tier_formatted(text: str, valid: str) -> str | None:
    letters = set()
    for m in _FORMATTED.finditer(text):
        raw = next(g for g in m.groups() if g)
        if raw.upper() in valid and not _negated(text, m.start()):
            letters.add(raw.upper())
    if len(letters) == 1:
        return letters.pop()
    return _AMBIGUOUS if letters else None


def _option_spans(text: str, choices: tuple[str, ...]) -> tuple[set[int], list[tuple[int, int]]]:
    """Indices of options whose text occurs in the output, and the raw spans where they occur."""
    norm_out = normalize(text)
    matched: dict[int, str] = {}
    for i, choice in enumerate(choices):
        opt = normalize(choice)
        if opt and re.search(r"(?<!\w)" + re.escape(opt) + r"(?!\w)", norm_out):
            matched[i] = opt
    keep = {i for i, o in matched.items() if not any(j != i and o != p and o in p for j, p in matched.items())}
    spans: list[tuple[int, int]] = []
    for choice in choices:
        words = choice.split()
        if not words:
            continue
        pat = r"\W+".join(re.escape(w.strip(".,;:!?\"'()")) for w in words if w.strip(".,;:!?\"'()"))
        if not pat:
            continue
        for m in re.finditer(r"(?<!\w)" + pat + r"(?!\w)", text, re.IGNORECASE):
            spans.append(m.span())
    return keep, spans


def _tier_bare(text: str, valid: str) -> str | None:
    letters = set()
    for m in _BARE.finditer(text):
        letter = _read_letter(text, m, valid, require_clear=True) if m.group("letter") in valid else None
        if letter and not _negated(text, m.start()):
            letters.add(letter)
    return letters.pop() if len(letters) == 1 else None


def extract_choice(output: str, choices: tuple[str, ...] | None = None, valid: str = "ABCD") -> str | None:
    """The letter a free-form output chose, or None when it chose none or several (see module doc)."""
    if choices:
        valid = LETTERS[: len(choices)]
    text = unicodedata.normalize("NFKC", output or "").translate(_QUOTES)
    if not text.strip():
        return None
    for tier in (lambda: _tier_markers(text, valid), lambda: _tier_leading(text, valid, choices),
                 lambda: _tier_formatted(text, valid)):
        got = tier()
        if got == _AMBIGUOUS:
            return None
        if got:
            return got
    masked = text
    if choices:
        keep, spans = _option_spans(text, choices)
        if len(keep) == 1:
            return LETTERS[keep.pop()]
        chars = list(text)
        for a, b in spans:
            chars[a:b] = " " * (b - a)
        masked = "".join(chars)
    return _tier_bare(masked, valid)


def mcq(output: str, answer: str, choices: tuple[str, ...] | None = None) -> bool:
    """The letter chosen in the output is the reference letter."""
    choices = tuple(choices) if choices else None
    got = extract_choice(output, choices, _valid_letters(answer, choices))
    return got is not None and got == answer.strip().upper()


# --------------------------------------------------------------------------------------------

SCORERS: dict[str, Callable[[str, str, tuple[str, ...] | None], bool]] = {
    "mcq": mcq,
    "exact": exact,
    "numeric": numeric,
    "contains": contains,
    "regex": regex,
}

#: Graded only by an LLM judge against a reference backend's answer (no function, no reference answer).
JUDGE = "judge"
#: Every scorer name a query may carry: the deterministic ones, then ``judge``.
KNOWN_SCORERS: tuple[str, ...] = (*SCORERS, JUDGE)


def check_answer(scorer: str, answer: str) -> None:
    """Raise :class:`IpwError` when ``scorer`` could never score against the reference ``answer`` (a
    ``numeric`` answer that is not a number, a ``regex`` that does not compile), so that a dataset fails
    when it loads, not when the query is scored."""
    if scorer == "numeric":
        _reference_number(answer)
    elif scorer == "regex":
        _compile(answer)


def score(scorer: str, output: str, answer: str, choices: tuple[str, ...] | None = None) -> bool | None:
    """Score one output with the named scorer; raises :class:`IpwError` for an unknown name.

    None for ``judge``: only an LLM judge grades such an item, so without one it is unscored (never
    False). The deterministic scorers always return a bool."""
    if scorer == JUDGE:
        return None
    fn = SCORERS.get(scorer)
    if fn is None:
        raise IpwError(f"unknown scorer {scorer!r} (known: {', '.join(sorted(KNOWN_SCORERS))})")
    if output is None:
        return False
    return bool(fn(str(output), str(answer), tuple(choices) if choices else None))


def record_score(scorer: str, output: str | None, answer: str, choices: tuple[str, ...] | None,
                 failed: bool) -> float | None:
    """A record's ``correct`` against the dataset's answer: None for an item only a judge can score
    (failed or not: it has no answer to be wrong against; a failure still counts as an error), 0.0 for
    a failed query, else the scorer's verdict as 0.0 or 1.0."""
    if scorer == JUDGE:
        return None
    if failed:
        return 0.0
    return float(bool(score(scorer, output or "", answer, choices)))
