"""What a judge's grading is, as data: the judge a config or ``--judge`` names (:class:`JudgeSpec`), the
check of a grading name, and what a two-order verdict means (:func:`orders_agree`).

Pure data and validation, below both the config that reads a ``[judge]`` table and the judge that runs
one (``ipw/grading/judge.py``), and below the analysis that tabulates verdicts: none of them imports another
for these (issue 57).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ipw.backends.base import BackendSpec
from ipw.errors import IpwError

GRADINGS = ("reference", "pairwise", "vs-backend:NAME")
VS_BACKEND = "vs-backend:"
PLACEHOLDERS = {"reference": ("question", "reference", "response"), "pairwise": ("question", "answer_a", "answer_b"),
                "vs-backend": ("question", "answer_a", "answer_b")}


@dataclass(frozen=True)
class JudgeSpec:
    """A judge as configured: the ``[judge]`` table of a config, or ``--judge KIND:MODEL``."""

    backend: BackendSpec
    grading: str = "reference"  # reference | pairwise | vs-backend:NAME
    prompt: str = ""  # a version in ipw/judge_prompts ("reference-v1") or a .txt path; "" = <method>-v1
    max_tokens: int = 16
    usd_per_mtok_in: float | None = None  # price of the judge's tokens, USD per million (cost = tokens x price)
    usd_per_mtok_out: float | None = None

    @property
    def method(self) -> str:
        return grading_method(self.grading)

    @property
    def vs_backend(self) -> str | None:
        """The reference backend of ``vs-backend:NAME`` grading, else None."""
        return self.grading[len(VS_BACKEND):] if self.method == "vs-backend" else None

    @property
    def prompt_ref(self) -> str:
        return self.prompt or f"{self.method}-v1"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JudgeSpec":
        return cls(**{**data, "backend": BackendSpec(**data["backend"])})


def grading_method(grading: str) -> str:
    """reference | pairwise | vs-backend: the grading without its backend name (the prompt's kind)."""
    return "vs-backend" if grading.startswith(VS_BACKEND) else grading


def check_grading(grading: str, loc: str) -> str:
    named = grading_method(grading) != "vs-backend" or grading[len(VS_BACKEND):].strip()
    if grading_method(grading) not in PLACEHOLDERS or not named:
        raise IpwError(f"{loc}: unknown grading {grading!r} (known: {', '.join(GRADINGS)})")
    return grading


def orders_agree(verdicts: tuple[str, ...] | list[str]) -> bool | None:
    """Whether a two-order verdict says the same in both orders (both response, both reference or both
    tie); None when it is not a two-order verdict that parsed (not judged, unparsed, an error)."""
    if len(verdicts) != 2 or not set(verdicts) <= {"response", "reference", "tie"}:
        return None
    return verdicts[0] == verdicts[1]
