"""Shards of a query set: which queries shard K of N runs (``ipw run --shard K/N`` and ``--ray``).

The assignment is pure and deterministic: the query at index ``i`` of the full query set (dataset
order, after ``--category``/``--sample``/``--limit``) belongs to shard ``i % N + 1``.  Round-robin
rather than contiguous blocks: bundled and user sets are often sorted by category or length, and
interleaving gives every shard the same mix.
"""

from __future__ import annotations

import dataclasses

import re
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

from ipw.errors import IpwError

T = TypeVar("T")


@dataclass(frozen=True)
class Shard:
    index: int  # 1..count
    count: int

    @property
    def text(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """``K/N`` with 1 <= K <= N, e.g. ``--shard $SLURM_ARRAY_TASK_ID/4`` for ``--array=1-4``."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not m:
        raise IpwError(f"--shard {text!r}: expected K/N, e.g. 1/4 (shard K of N, K from 1 to N)")
    index, count = int(m.group(1)), int(m.group(2))
    if count < 1 or not 1 <= index <= count:
        raise IpwError(f"--shard {text}: K must be between 1 and N (got K={index}, N={count})")
    return Shard(index, count)


def shard_items(items: Sequence[T], shard: Shard) -> list[T]:
    """The items of ``shard``: every ``count``-th item, starting at ``index - 1``.  A shard without
    items is an error (an empty run would be marked complete)."""
    part = list(items[shard.index - 1 :: shard.count])
    if not part:
        raise IpwError(f"--shard {shard.text}: shard {shard.index} of {shard.count} is empty: the query set has "
                       f"only {len(items)} queries (give N <= {max(len(items), 1)})")
    return part


def combine_backend_infos(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """One manifest ``backends`` entry for a backend that ran as several shards: the first shard's
    entry (what ``ipw report`` shows) with every shard's own entry (sensors, idle baseline, load
    time, node) under ``shards``."""
    from ipw.results import BackendEntry

    flat = [s for info in infos for s in (info.get("shards") or [info])]
    head = BackendEntry.read(flat[0], "a shard's entry")
    details = {k: v for k, v in head.details.items() if k not in ("shard", "node", "hardware_id")}
    return dataclasses.replace(head, details=details, shards=tuple(flat)).to_json()
