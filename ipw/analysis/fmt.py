"""How numbers are shown, in one place: a metric's value, its interval and its change, as ``ipw run``'s
table, ``compare``'s tables, ``check``'s verdicts and the report print them. A metric declares its
``Format`` in the metric table (``ipw.analysis.metrics``); everything else that prints a number of the
analysis (routing shares, counts, fits) takes one of the formats below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ipw.analysis.stats import Estimate

NA = "n/a"


@dataclass(frozen=True)
class Format:
    """How a metric's values are shown: a share as a percentage with ``digits`` decimals (0.625 -> "62.5%";
    its changes in percentage points), any other number with ``digits`` significant digits."""

    percent: bool = False
    digits: int = 3  # significant digits; of a percentage, decimals

    @property
    def change_unit(self) -> str:
        """The unit of a change between two values: "pp" (percentage points) for a share, else "%"."""
        return "pp" if self.percent else "%"


NUMBER = Format()
PERCENT = Format(percent=True, digits=1)
COUNT = Format(digits=12)  # records, queries, tokens: whole numbers, every digit


def value(x: Any, f: Format = NUMBER, sign: bool = False) -> str:
    """One value ("n/a" when unknown); ``sign``: always with its sign (a difference)."""
    if x is None:
        return NA
    try:
        x = float(x)
    except (TypeError, ValueError):  # a manifest's free text where a number was expected
        return str(x)
    if not math.isfinite(x):
        return NA
    plus = "+" if sign else ""
    return f"{x:{plus}.{f.digits}{'%' if f.percent else 'g'}}"


def estimate(e: Estimate | None, f: Format = NUMBER, sign: bool = False) -> str:
    """A value with its interval, "0.123 [0.111, 0.135]" (an ``Estimate``; without an interval the value alone)."""
    if e is None or not math.isfinite(e.value):
        return NA
    text = value(e.value, f, sign)
    return f"{text} [{value(e.lo, f, sign)}, {value(e.hi, f, sign)}]" if math.isfinite(e.lo) else text


def change(x: float | None, unit: str, sign: bool = True) -> str:
    """A change in a threshold's unit (% or pp), two decimals: "+1.23%", "-0.50pp" (from 0: "+inf%")."""
    if x is None or math.isnan(x):
        return NA
    return f"{x:{'+' if sign else ''}.2f}{unit}"


def change_interval(x: float, lo: float, hi: float, unit: str) -> str:
    """A change with its interval: "+1.23% [+0.40, +2.10]"."""
    return f"{change(x, unit)} [{change(lo, '')}, {change(hi, '')}]"
