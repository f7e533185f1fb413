"""The ``judge`` scorer: a configured backend (any kind) grades answers with a versioned prompt.

Grading methods:

``reference``
    One call: the judge sees the question, the reference answer and the answer to grade, and replies
    CORRECT or INCORRECT (:func:`parse_reference_verdict` reads the reply).
``pairwise``
    Two calls, the answer and the reference in both orders (A/B, then B/A); the judge replies A, B or
    TIE (:func:`parse_pairwise_verdict`).  The answer counts correct only when both orders agree that
    it is at least as good as the reference (its own letter or TIE both times): a judge that favors
    one position cannot make it correct.
``vs-backend:NAME``
    Coverage as the paper defines it (Intelligence per Watt, arXiv 2511.07885): the same two-order
    comparison, but the reference is backend NAME's answer to the same query (the cloud model), and the
    question is which answer serves the asker better, not which is right.  A win or a tie in both orders
    *covers* the query (``win_tie`` = 1 in the record); the dataset score (``correct``) is kept apart.
    Open-ended items (scorer ``judge``, no reference answer) are measurable only this way.

Prompts are files in ``ipw/judge_prompts/`` named ``<method>-v<N>.txt`` with ``{{placeholders}}``;
the version (file stem) and its sha256 go into the run folder.  An unreadable reply counts incorrect
and is recorded as ``unparsed``.  The judge's tokens, energy (measured like any query: a window of
this machine's sensors around each call, or an API estimate for a remote endpoint) and cost are
recorded in ``judge.jsonl``, never added to the judged backend's records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ipw.backends.base import BackendSpec, GenerationSettings, create_backend
from ipw.errors import IpwError
from ipw.grading.spec import PLACEHOLDERS, JudgeSpec, check_grading
from ipw.inputs.resources import resource_path

PROMPTS_DIR = resource_path("judge_prompts")


def judge_from_cli(text: str, configured: tuple[BackendSpec, ...] = (), grading: str = "reference") -> JudgeSpec:
    """``--judge``: a backend name of the run's config, or ``KIND:MODEL``."""
    from ipw.backends.base import backend_kinds

    by_name = {b.name: b for b in configured}
    if text in by_name:
        backend = by_name[text]
    elif ":" in text:
        kind, model = text.split(":", 1)
        if kind not in backend_kinds():
            raise IpwError(f"--judge {text}: unknown backend kind {kind!r} (known: {', '.join(backend_kinds())})")
        backend = BackendSpec(name=f"judge:{kind}:{Path(model).stem}", kind=kind, model=model)
    else:
        raise IpwError(f"--judge {text}: give KIND:MODEL (e.g. llama-cpp:smollm2-135m) or a backend name of the "
                       f"run's config ({', '.join(by_name) or 'none'})")
    return JudgeSpec(backend=backend, grading=check_grading(grading, "--grading"))


@dataclass(frozen=True)
class JudgePrompt:
    version: str
    text: str
    sha256: str


def load_prompt(ref: str, method: str) -> JudgePrompt:
    """A versioned prompt of ``ipw/judge_prompts`` (or a .txt file); checks its placeholders."""
    path = Path(ref) if ref.endswith(".txt") else PROMPTS_DIR / f"{ref}.txt"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROMPTS_DIR.glob("*.txt")))
        what = "is not a .txt file" if Path(ref).is_file() else "not found"
        raise IpwError(f"judge prompt {ref!r} {what} (versions: {known}; or a .txt path)")
    try:
        if path.stat().st_size > 1_000_000:
            raise IpwError(f"{path}: a judge prompt of more than 1,000,000 bytes")
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise IpwError(f"{path}: a judge prompt is UTF-8 text; byte {exc.start} is not") from None
    except OSError as exc:
        raise IpwError(f"{path}: cannot read the judge prompt ({exc.strerror})") from None
    used = set(re.findall(r"\{\{(\w+)\}\}", text))
    if used != set(PLACEHOLDERS[method]):
        raise IpwError(f"{path}: a {method} prompt needs the placeholders "
                       f"{', '.join('{{' + p + '}}' for p in PLACEHOLDERS[method])} (found: {', '.join(sorted(used))})")
    return JudgePrompt(path.stem, text, "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16])


def render(template: str, **values: str) -> str:
    """Fill ``{{name}}`` placeholders in one pass (a value's own braces are never expanded)."""
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], template)


# --------------------------------------------------------------------------------------------
# verdicts

_STRIP = re.compile(r"[\s*_`#.!:\"'\[\]()]+")
_NEGATIVE = re.compile(r"\b(?:incorrect|wrong|false|no|(?:is\s+)?not\s+(?:correct|right)|isn't\s+(?:correct|right))\b",
                       re.IGNORECASE)
_POSITIVE = re.compile(r"\b(?:correct|right|true|yes)\b", re.IGNORECASE)
_MARKER = re.compile(r"\b(?:verdict|grade|judg(?:e)?ment|answer)\s*(?:is)?\s*[:=]?\s*\**\s*", re.IGNORECASE)
_TIE = re.compile(r"\b(?:tie|tied|same|equal|equally|equivalent|both)\b", re.IGNORECASE)
_LETTER_AB = re.compile(r"(?<![A-Za-z])[AB](?![A-Za-z])")
# the instruction's list of options, echoed back by a weak judge: not a verdict
_ECHO = re.compile(r"\b(?:in)?correct\s*(?:,|/|or)\s*(?:in)?correct\b|\bA\s*,\s*B\s*,?\s*(?:or\s+)?TIE\b",
                   re.IGNORECASE)


def parse_reference_verdict(text: str) -> bool | None:
    """CORRECT -> True, INCORRECT -> False, None when the reply says neither.  A reply that is just the
    verdict word decides; else the word after a "Verdict:" marker; else the first verdict word.  An
    echoed option list ("CORRECT or INCORRECT") is not a verdict."""
    text = _ECHO.sub(" ", text or "")
    bare = _STRIP.sub(" ", text).strip().casefold()
    if bare in ("correct", "right", "yes", "true"):
        return True
    if bare in ("incorrect", "wrong", "no", "false", "not correct"):
        return False
    for m in _MARKER.finditer(text):
        rest = text[m.end():]
        neg, pos = _NEGATIVE.match(rest), _POSITIVE.match(rest)
        if neg or pos:
            return not neg
    hits = [(m.start(), False) for m in _NEGATIVE.finditer(text)] + [(m.start(), True) for m in _POSITIVE.finditer(text)]
    return min(hits)[1] if hits else None


def parse_pairwise_verdict(text: str) -> str | None:
    """"A", "B" or "tie"; None when the reply names none, or several (both letters, a letter and a
    tie, an echoed "A, B or TIE")."""
    from ipw.grading.scoring import extract_choice

    text = _ECHO.sub(" ", text or "")
    bare = _STRIP.sub(" ", text).strip().upper()
    if bare in ("A", "B"):
        return bare
    if bare in ("TIE", "SAME", "EQUAL", "BOTH"):
        return "tie"
    if _TIE.search(text):
        return None if _LETTER_AB.search(text) else "tie"
    return extract_choice(text, None, "AB")


# --------------------------------------------------------------------------------------------
# grading


@dataclass(frozen=True)
class JudgeCall:
    """One request to the judge: its reply and bookkeeping (never the judged backend's)."""

    output: str
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    energy_j: float | None
    energy_quality: str
    energy_source: str
    error: str | None = None


@dataclass(frozen=True)
class Verdict:
    correct: bool
    verdicts: tuple[str, ...]  # reference: correct|incorrect|unparsed; pairwise per order: response|reference|tie|unparsed
    calls: tuple[JudgeCall, ...]


def grade_reference(call: Callable[[str], JudgeCall], template: str, question: str, reference: str,
                    response: str) -> Verdict:
    c = call(render(template, question=question, reference=reference, response=response))
    got = None if c.error else parse_reference_verdict(c.output)
    label = "error" if c.error else {True: "correct", False: "incorrect", None: "unparsed"}[got]
    return Verdict(got is True, (label,), (c,))


def grade_pairwise(call: Callable[[str], JudgeCall], template: str, question: str, reference: str,
                   response: str) -> Verdict:
    """Both orders; correct only when the response wins or ties in both."""
    labels, calls = [], []
    for response_is in ("A", "B"):
        a, b = (response, reference) if response_is == "A" else (reference, response)
        c = call(render(template, question=question, answer_a=a, answer_b=b))
        got = None if c.error else parse_pairwise_verdict(c.output)
        labels.append("error" if c.error else "unparsed" if got is None else "tie" if got == "tie"
                      else "response" if got == response_is else "reference")
        calls.append(c)
    return Verdict(all(x in ("response", "tie") for x in labels), tuple(labels), tuple(calls))


class Judge:
    """A loaded judge backend with its sensors; ``grade`` measures each call in its own window."""

    def __init__(self, spec: JudgeSpec, probe: Callable[[Any], list] | None = None) -> None:
        self.spec = spec
        self.prompt = load_prompt(spec.prompt_ref, spec.method)
        self.settings = GenerationSettings(max_tokens=spec.max_tokens, temperature=0.0)
        self._probe = probe
        self.backend: Any = create_backend(spec.backend)  # resolves the model: a missing one fails here
        self.sensors: list = []
        self.load_s = 0.0

    def __enter__(self) -> "Judge":
        from ipw.telemetry.probe import default_probe
        from ipw.metering.window import Window

        t0 = time.monotonic()
        self.backend.load()
        self.load_s = time.monotonic() - t0
        self.sensors = (self._probe or default_probe)(self.backend)
        self.window = Window(self.sensors)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sensor in self.sensors:
            sensor.close()
        self.backend.close()

    def call(self, prompt: str) -> JudgeCall:
        from ipw.metering.call import open_call

        call = open_call(self.window)  # the window's edges are the call's start and end
        completion, error = None, None
        try:
            completion = self.backend.generate(prompt, self.settings)
        except IpwError:
            raise
        except Exception as exc:  # a failed judge call grades incorrect, recorded as an error
            error = f"{type(exc).__name__}: {exc}"
        measured = call.close()
        total = measured.energy(estimate=self.backend.energy_estimate, ok=completion is not None,
                                completion_tokens=completion.completion_tokens if completion is not None else 0).total
        return JudgeCall(
            output=completion.text if completion else "",
            prompt_tokens=completion.prompt_tokens if completion else 0,
            completion_tokens=completion.completion_tokens if completion else 0,
            latency_s=measured.duration_s, energy_j=total.energy_j, energy_quality=total.quality,
            energy_source=total.source, error=error,
        )

    def grade(self, question: str, reference: str, response: str) -> Verdict:
        fn = grade_reference if self.spec.method == "reference" else grade_pairwise
        return fn(self.call, self.prompt.text, question, reference, response)

    def cost_usd(self, prompt_tokens: int, completion_tokens: int) -> float | None:
        if self.spec.usd_per_mtok_in is None and self.spec.usd_per_mtok_out is None:
            return None
        return (prompt_tokens * (self.spec.usd_per_mtok_in or 0.0)
                + completion_tokens * (self.spec.usd_per_mtok_out or 0.0)) / 1e6

    def describe(self) -> dict[str, Any]:
        """What the manifest records about the judge."""
        return {
            **dataclasses.asdict(self.spec), "prompt_version": self.prompt.version,
            "prompt_sha256": self.prompt.sha256, "load_s": round(self.load_s, 3),
            "engine": self.backend.describe(),
            "sensors": [dataclasses.asdict(s.info()) for s in self.sensors],
        }
