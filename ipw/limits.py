"""The limits ipw holds a value to wherever it comes from (a flag, a config field, a run folder, a library
call): a number's range, a PUE, a carbon intensity, a backend name.

Shared by every layer: the option table (``ipw.options``), the config, ``ipw.carbon`` and the analysis check
their values here, so that no lower layer imports the CLI's option table for a bound (issue 57).
"""

from __future__ import annotations

import math

from ipw.errors import IpwError

MAX_G_PER_KWH = 2000.0  # the dirtiest grids are ~1,000 gCO2e/kWh: more is a typo (ipw.carbon)
MAX_PUE = 5.0  # a datacenter's PUE: the Uptime Institute's surveys average ~1.56, the worst sites ~2.5-3; more is a typo


def out_of_range(value: float, *, low: float | None = None, high: float | None = None, low_open: bool = False,
                 high_open: bool = False, whole: bool = False) -> str | None:
    """What is wrong with ``value`` (``must be a finite number >= 1 and <= 5, got 7``), or None when it is
    finite and ``low <= value <= high`` (``low < value`` when ``low_open``, ``value < high`` when
    ``high_open``); ``whole``: the text speaks of a count, not of a finite number."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if ok:
        return None
    bounds = " and ".join(b for b in ((f"> {low:g}" if low_open else f">= {low:g}") if low is not None else "",
                                      (f"< {high:g}" if high_open else f"<= {high:g}") if high is not None
                                      else "") if b)
    return f"must be {'' if whole else 'a finite number '}{bounds}, got {value!r}"


def check_range(value: float, loc: str, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False, whole: bool = False) -> None:
    """``value`` within its bounds (``out_of_range``), else an IpwError at ``loc``."""
    problem = out_of_range(value, low=low, high=high, low_open=low_open, high_open=high_open, whole=whole)
    if problem:
        raise IpwError(f"{loc}: {problem}")


MAX_NAME_CHARS = 64
# letters of other scripts that print like Latin ones (after casefolding): two backend names that differ
# only in these print alike in every table
_LOOKALIKE = str.maketrans({
    "а": "a", "в": "b", "е": "e", "к": "k", "м": "m", "н": "h", "о": "o", "р": "p", "с": "c", "т": "t", "у": "y",
    "х": "x", "і": "i", "ј": "j", "ѕ": "s", "ԁ": "d", "ӏ": "l", "ɡ": "g", "α": "a", "β": "b", "ε": "e", "ζ": "z",
    "η": "n", "ι": "i", "κ": "k", "μ": "m", "ν": "v", "ο": "o", "ρ": "p", "τ": "t", "υ": "u", "χ": "x",
})


def check_name(name: str, loc: str) -> str:
    """A backend name as every output shows it: NFC-normalised, at most MAX_NAME_CHARS characters, no
    control, format (bidi override, zero-width) or surrogate character."""
    import unicodedata

    name = unicodedata.normalize("NFC", name)
    if not name.strip():
        raise IpwError(f"{loc}: must not be blank")
    if len(name) > MAX_NAME_CHARS:
        raise IpwError(f"{loc}: {len(name)} characters; a name has at most {MAX_NAME_CHARS}")
    for i, ch in enumerate(name):
        if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp"):
            raise IpwError(f"{loc}: holds {ascii(ch)[1:-1]} at character {i + 1}; a name is printable text")
    return name


def name_skeleton(name: str) -> str:
    """What a name looks like: compatibility-normalised, casefolded, other scripts' look-alikes as Latin."""
    import unicodedata

    return unicodedata.normalize("NFKC", name).casefold().translate(_LOOKALIKE)
