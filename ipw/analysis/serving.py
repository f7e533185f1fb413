"""Serving under load: the levels of a concurrency sweep side by side, and the energy-optimal level
under a latency deadline. Pure functions over ``ipw.analysis.load``'s backends (one per level, see
``load.level_label``) and the metric table's estimates; the numbers themselves are metrics of
``ipw.analysis.metrics`` (J/query, J/output token, output tokens/s, latency and TTFT quantiles,
accuracy), never computed again here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from ipw.analysis.load import BackendInfo
from ipw.errors import ParameterError

# the serving table's metrics (keys of ipw.analysis.metrics), in its column order
SERVING_METRICS = ("energy_per_query_j", "j_per_output_token", "output_tokens_per_s", "latency_p50_s",
                   "latency_p95_s", "ttft_p50_s", "ttft_p95_s", "accuracy")
# --deadline METRIC -> the metric it bounds
DEADLINE_METRICS = {"p50_latency": "latency_p50_s", "p95_latency": "latency_p95_s", "p50_ttft": "ttft_p50_s",
                    "p95_ttft": "ttft_p95_s"}
DEADLINE_FORMS = (f"METRIC=VALUE with METRIC one of {', '.join(DEADLINE_METRICS)} and VALUE a time like 2s or 500ms, "
                  "e.g. --deadline p95_latency=2s")
_SECONDS = {"s": 1.0, "ms": 1e-3}


@dataclass(frozen=True)
class Deadline:
    metric: str  # as given: p50_latency | p95_latency | p50_ttft | p95_ttft
    limit_s: float

    @property
    def key(self) -> str:
        """The metric table's key of the bounded metric."""
        return DEADLINE_METRICS[self.metric]

    @property
    def text(self) -> str:
        return f"{self.metric.replace('_', ' ')} ≤ {self.limit_s:g} s"


def parse_deadline(text: str) -> Deadline:
    """``METRIC=VALUE`` (``p95_latency=2s``, ``p50_ttft=500ms``); a ParameterError names the accepted forms."""
    m = re.fullmatch(r"\s*([a-z0-9_]+)\s*=\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(ms|s)\s*", text)
    if not m or m.group(1) not in DEADLINE_METRICS:
        raise ParameterError(("deadline",), f" {text!r}: expected {DEADLINE_FORMS}")
    limit = float(m.group(2)) * _SECONDS[m.group(3)]
    if not (math.isfinite(limit) and limit > 0):
        raise ParameterError(("deadline",), f" {text!r}: the time must be above 0 ({DEADLINE_FORMS})")
    return Deadline(m.group(1), limit)


def shown(backends: Sequence[BackendInfo]) -> bool:
    """Whether the serving table says anything: some backend ran above one request at a time (a backend
    at several levels has one above 1)."""
    return any(b.concurrency > 1 for b in backends)


def by_backend(backends: Sequence[BackendInfo]) -> dict[tuple[str, str], list[BackendInfo]]:
    """Each backend (run_id, name) with its levels, in ascending concurrency."""
    out: dict[tuple[str, str], list[BackendInfo]] = {}
    for b in backends:
        out.setdefault((b.run_id, b.backend), []).append(b)
    return {k: sorted(v, key=lambda b: b.concurrency) for k, v in out.items()}


def serving_level(levels: Sequence[BackendInfo]) -> BackendInfo:
    """The level a server would run at: the highest concurrency measured."""
    return max(levels, key=lambda b: b.concurrency)


@dataclass(frozen=True)
class LevelPick:
    """One backend's energy-optimal level under a deadline."""

    run_id: str
    backend: str
    levels: tuple[str, ...]  # its levels' labels, ascending concurrency
    meeting: tuple[str, ...]  # the levels whose deadline metric is within the limit
    chosen: str | None  # the meeting level with the lowest J/query (None: no level meets the deadline)
    concurrency: int | None
    energy_per_query_j: float | None
    value_s: float | None  # the chosen level's deadline metric


def pick_levels(backends: Sequence[BackendInfo], point: Mapping[str, Mapping[str, float]],
                deadline: Deadline) -> tuple[LevelPick, ...]:
    """Per backend: among its levels whose ``deadline`` metric (point value) is within the limit, the one
    with the lowest J/query (a level without energy ranks last). ``point``: label -> metric -> value."""
    out = []
    for (run_id, name), levels in by_backend(backends).items():
        meeting = [b for b in levels if point[b.label][deadline.key] <= deadline.limit_s]  # NaN never meets
        best = min(meeting, key=lambda b: _energy_rank(point[b.label]["energy_per_query_j"]), default=None)
        out.append(LevelPick(
            run_id, name, tuple(b.label for b in levels), tuple(b.label for b in meeting),
            None if best is None else best.label, None if best is None else best.concurrency,
            None if best is None else _finite(point[best.label]["energy_per_query_j"]),
            None if best is None else _finite(point[best.label][deadline.key])))
    return tuple(out)


def _energy_rank(x: float) -> float:
    return x if math.isfinite(x) else math.inf


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None
