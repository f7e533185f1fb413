"""How the energy measured while requests overlap is split among them (docs/SERVING.md, "How the energy
of overlapping requests is split").  Pure functions over a schedule of :class:`Request` and the energies
of the slices that tile a span; the meter (``ipw.metering.meter``) feeds them.

Two splits, one vocabulary of work (a request's prompt tokens over its prefill, its output tokens when they
arrived: :func:`token_work`):

- ``priced`` (the default): an **accounting period** (a stretch of busy slices, cut where no request is
  in flight or once ``PERIOD_S`` long) is split among its requests in proportion to their **priced
  work**, ``prefill_weight x prefill tokens + output tokens``, with the prefill weight fitted from the
  span's own slices (:class:`PriceFit`).  Identical work in one period gets an identical share, whichever
  scheduling wave it ran in; a request alone in its period gets all of it;
- ``local``: each slice is split by the work each request did in it (:func:`slice_weights`): where in
  time the energy was spent, but a request decoding in a wave's tail, with few co-decoders, pays most of
  the GPU's static power.  Kept as a labelled alternative (``--split local``).

Both conserve: the parts of a period (or a slice) add up to its energy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class Request:
    """One request of a concurrent schedule: its window, the times its output tokens arrived, and, where
    the server reported it, when it processed the prompt (``prefill_s``: start, end) and how many prompt
    tokens that was (``prefill_tokens``: those its prompt cache did not already hold).  ``output_tokens``:
    how many output tokens it produced where the server counted more than it sent times for (a plain JSON
    answer has one time, its end); 0: one per token time.  ``prompt_tokens``: its whole prompt (cached
    tokens included; 0: unknown), which the priced split prices, so that a request whose prompt happened to
    be in its slot's cache costs what an identical one costs.  ``prefill_timed``: False where ``prefill_s`` was not
    timed by the server but placed from the request's start to its first streamed token (queueing included)."""

    start_s: float
    end_s: float
    token_times_s: tuple[float, ...] = ()
    prefill_s: tuple[float, float] | None = None
    prefill_tokens: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    prefill_timed: bool = True


#: The splits a run or a proxy can use (``split`` in a config, ``--split``): see the module's docstring.
SPLITS = ("priced", "local")

#: How overlapping requests' energy was split (a record's ``split_method``):
#: - ``priced``: by priced work over an accounting period: its whole prompt, placed over the prefill as the
#:   server or engine timed it (llama-server's ``timings``, vLLM's request metrics in process), and its
#:   output tokens;
#: - ``priced_ttft``: the same, its prompt placed from the request's start to its first streamed token (a
#:   server that streams but does not time its requests, such as vLLM's OpenAI server: queueing included);
#: - ``priced_decode``: by priced work of output tokens only (no prompt token count: a prefill is not priced);
#: - ``work``: the time-local split by the tokens each request put through the model in each slice, its
#:   prompt tokens spread over its prefill as the server timed it;
#: - ``work_ttft``: the same, its prompt tokens spread from its start to its first streamed token;
#: - ``decode_tokens``: the time-local split by output tokens only (no server timings: a prefill is
#:   charged to the requests decoding beside it);
#: - ``time``: by active time (no token times at all, e.g. a server that does not stream), either split.
SPLIT_METHODS = ("priced", "priced_ttft", "priced_decode", "work", "work_ttft", "decode_tokens", "time")


def split_method(request: Request, split: str = "local") -> str:
    """The weighting ``split`` (``priced`` or ``local``) gives this request: the best its data allows."""
    ttft = "" if request.prefill_timed else "_ttft"
    if split == "priced":
        if request.token_times_s:
            if request.prefill_s is not None:
                return "priced" + ttft
            return "priced_ttft" if request.prompt_tokens > 0 else "priced_decode"
        return "time"
    if request.prefill_s is not None:
        return "work" + ttft
    return "decode_tokens" if request.token_times_s else "time"


@dataclass(frozen=True)
class ConcurrencySplit:
    """Per-request energies; ``sum(per_request_j) + unattributed_j == total_j``."""

    per_request_j: tuple[float, ...]
    unattributed_j: float  # energy of slices in which no request was active
    total_j: float

    @property
    def attributed_j(self) -> float:
        return self.total_j - self.unattributed_j


def split_concurrent(
    slices_t_s: np.ndarray, slice_energy_j: np.ndarray, requests: Sequence[Request | tuple[Any, ...]],
    split: str = "local", prefill_weight: float = 1.0,
) -> ConcurrencySplit:
    """Split a span's energy over the requests active in it.

    ``slices_t_s`` are the ``n + 1`` slice edges, ``slice_energy_j`` the ``n`` slice energies.  A request
    is active in a slice when its window overlaps it for a positive time.

    - ``local``: each slice by the work each active request did there (:func:`token_work`); a prompt token
      and an output token weigh the same.  When no active request did work in a slice, the slice is split
      by active time;
    - ``priced``: the busy slices as one accounting period, by priced work (:func:`priced_weights`).

    Slices with no active request are ``unattributed_j``.  The parts and the unattributed remainder sum
    to the total (asserted)."""
    edges = np.asarray(slices_t_s, dtype=np.float64)
    energy = np.asarray(slice_energy_j, dtype=np.float64)
    if edges.ndim != 1 or edges.size != energy.size + 1 or np.any(np.diff(edges) < 0):
        raise ValueError("slices_t_s must be n + 1 non-decreasing edges for n slice energies")
    if np.any(energy < 0) or not np.all(np.isfinite(energy)):
        raise ValueError("slice energies must be finite and non-negative")
    reqs = [r if isinstance(r, Request) else Request(float(r[0]), float(r[1]), tuple(r[2])) for r in requests]
    weights, has_active = slice_weights(edges[:-1], edges[1:], reqs)
    busy = np.where(has_active, energy, 0.0)
    if split == "priced" and reqs:
        parts = priced_weights(edges[:-1], edges[1:], reqs, prefill_weight) * float(busy.sum())
    else:
        parts = (weights * busy).sum(axis=1) if reqs else np.zeros(0)
    unattributed = float(energy[~has_active].sum())
    total = float(energy.sum())
    attributed = total - unattributed
    assert math.isclose(float(parts.sum()), attributed, rel_tol=1e-9, abs_tol=1e-9), (
        f"concurrency split lost energy: parts {parts.sum()} J vs attributed {attributed} J"
    )
    return ConcurrencySplit(tuple(float(x) for x in parts), unattributed, total)


def token_work(lo_s: np.ndarray, hi_s: np.ndarray, requests: Sequence[Request], whole_prompt: bool = False
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each request's work in each slice ``[lo_s[k], hi_s[k])`` (the last one closed): ``(prefill, decode,
    active_s)``, three ``(requests, slices)`` arrays: its prompt tokens spread evenly over its prefill as the
    server timed it (an instant prefill: all in the slice that holds that instant), its output tokens that
    arrived there (inside its own window; each token time counts ``output_tokens / len(token_times_s)``
    where the server counted more), and the seconds it was in flight there.  The slices are in time order
    and do not overlap, but need not touch (a token between two slices is in none).  ``whole_prompt`` (the
    priced split): the prefill counts the request's whole prompt where it is known (``prompt_tokens``), placed
    from its start to its first token where the server did not time it."""
    lo, hi = np.asarray(lo_s, dtype=np.float64), np.asarray(hi_s, dtype=np.float64)
    n_s, n_r = lo.size, len(requests)
    active_s = np.zeros((n_r, n_s))
    prefill = np.zeros((n_r, n_s))
    decode = np.zeros((n_r, n_s))
    for k, r in enumerate(requests):
        if r.end_s < r.start_s:
            raise ValueError(f"request {k} ends before it starts")
        active_s[k] = np.clip(np.minimum(hi, r.end_s) - np.maximum(lo, r.start_s), 0.0, None)
        tt = np.asarray(r.token_times_s, dtype=np.float64)
        if tt.size and n_s:
            each = r.output_tokens / tt.size if r.output_tokens > tt.size else 1.0
            tt = tt[(tt >= r.start_s) & (tt <= r.end_s)]
            j = np.searchsorted(lo, tt, side="right") - 1
            ok = j >= 0
            j = np.clip(j, 0, n_s - 1)
            ok &= (tt < hi[j]) | ((tt == hi[j]) & (j == n_s - 1))
            np.add.at(decode[k], j[ok], each)
        span, count = r.prefill_s, r.prefill_tokens
        if whole_prompt and r.prompt_tokens > 0:
            count = max(count, r.prompt_tokens)
            if span is None and r.token_times_s:
                span = (r.start_s, min(r.token_times_s))
        if span is not None and count > 0:
            p0, p1 = max(span[0], r.start_s), min(span[1], r.end_s)
            if p1 > p0:  # the prompt tokens, spread evenly over the prefill
                prefill[k] += count * np.clip(np.minimum(hi, p1) - np.maximum(lo, p0), 0.0, None) / (p1 - p0)
            elif n_s:  # an instant prefill: all of it in the slice that holds that instant
                at = np.nonzero((p1 >= lo) & (p1 < hi))[0]
                if at.size:
                    prefill[k, at[0]] += count
                elif p1 == hi[-1]:
                    prefill[k, n_s - 1] += count
    inactive = active_s <= 0
    prefill[inactive] = 0.0
    decode[inactive] = 0.0
    return prefill, decode, active_s


def slice_weights(lo_s: np.ndarray, hi_s: np.ndarray, requests: Sequence[Request]) -> tuple[np.ndarray, np.ndarray]:
    """The ``local`` split of the slices ``[lo_s[k], hi_s[k]]`` (:func:`local_shares` of their
    :func:`token_work`) and the mask of the slices in which some request is active."""
    prefill, decode, active_s = token_work(lo_s, hi_s, requests)
    return local_shares(prefill, decode, active_s), active_s.sum(axis=0) > 0


def local_shares(prefill: np.ndarray, decode: np.ndarray, active_s: np.ndarray) -> np.ndarray:
    """The ``local`` split, from :func:`token_work`'s arrays: each request's share of each slice, by its work
    there (a prompt token and an output token weigh the same), by active time in a slice in which no request
    did work: a ``(requests, slices)`` array whose columns sum to 1 where some request is active."""
    work = prefill + decode
    work_sum = work.sum(axis=0)
    act_sum = active_s.sum(axis=0)
    return np.where(work_sum > 0, work / np.where(work_sum > 0, work_sum, 1.0),
                    active_s / np.where(act_sum > 0, act_sum, 1.0))


def priced_weights(lo_s: np.ndarray, hi_s: np.ndarray, requests: Sequence[Request], prefill_weight: float
                   ) -> np.ndarray:
    """The ``priced`` split of one accounting period, the slices ``[lo_s[k], hi_s[k]]`` (:func:`priced_shares`
    of their :func:`token_work`, whole prompts)."""
    return priced_shares(*token_work(lo_s, hi_s, requests, whole_prompt=True), prefill_weight)


def priced_shares(prefill: np.ndarray, decode: np.ndarray, active_s: np.ndarray, prefill_weight: float) -> np.ndarray:
    """The ``priced`` split, from :func:`token_work`'s arrays: each request's share of the period's energy,
    ``prefill_weight x its prefill tokens + its output tokens`` over the sum of everyone's (by active time when
    no request did work; equal parts when no request was active for any time); sums to 1."""
    work: np.ndarray = (prefill_weight * prefill + decode).sum(axis=1)
    if work.sum() > 0:
        return work / float(work.sum())
    active = active_s.sum(axis=1)
    return active / active.sum() if active.sum() > 0 else np.full(len(work), 1.0 / max(1, len(work)))


def by_time(requests: Sequence[Request]) -> list[Request]:
    """The same requests with no token or prefill data: a split then goes by active time alone."""
    return [Request(r.start_s, r.end_s) for r in requests]


# --------------------------------------------------------------------------------------------------
# prices


#: An accounting period ends where no request is in flight, or at the first request event once it is this
#: long.  ``ipw serve``: long enough to hold many scheduling waves (a wave of 64 requests of a small model on
#: the H200 lasts ~0.1-0.4 s), short enough that an answer's energy settles within seconds.
PERIOD_S = 5.0
#: ``ipw run``'s levels: a level is one steady load, so its period is longer, and a sweep level of a few hundred
#: requests is one period (with 5 s periods, the requests that ended in a level's drain, with few beside them,
#: paid its static power: on the H200 at 64 in flight, requests of equal tokens up to 51% apart).  A long
#: level's memory is bounded by one period's requests.
RUN_PERIOD_S = 30.0
#: The fit of prices puts consecutive slices together into bins at least this long (NVML's samples are 20 ms
#: apart: a bin of a few ms is mostly interpolation).
FIT_BIN_S = 0.1
#: Bins, and bins with prefill work, the fit needs before its prefill weight is used.
FIT_MIN_BINS = 8
FIT_MIN_PREFILL_BINS = 3
#: The prefill weight before (or without) a fit: a prompt token weighs as an output token, as in the local split.
DEFAULT_PREFILL_WEIGHT = 1.0


@dataclass(frozen=True)
class Pricing:
    """What a prompt token weighs against an output token in the ``priced`` split, and the fit behind it:
    ``energy of a bin = prefill_j x its prompt tokens + decode_j x its output tokens``, both >= 0, least squares
    over the span's busy bins.  The energy is the whole of it, static power included: a token's price is what
    it costs at the rate the server gets through such tokens, the seconds of static power it holds the server
    for with it, so that a class of requests is charged about what it costs when it runs alone (its marginal
    energy: docs/SERVING.md)."""

    prefill_weight: float
    fitted: bool  # False: too few bins (or no prefill among them): DEFAULT_PREFILL_WEIGHT
    bins: int
    prefill_j: float | None = None  # J per prompt token, its share of the static power included
    decode_j: float | None = None  # J per output token, likewise


class PriceFit:
    """Running least-squares sums over the bins of a span (``add``), and the prices they give (``pricing``)."""

    def __init__(self) -> None:
        self.xtx = np.zeros((2, 2))
        self.xty = np.zeros(2)
        self.yty = 0.0
        self.bins = self.prefill_bins = 0

    def add(self, seconds: np.ndarray, prefill: np.ndarray, decode: np.ndarray, energy_j: np.ndarray) -> None:
        x = np.column_stack([prefill, decode]).astype(np.float64)
        y = np.asarray(energy_j, dtype=np.float64)
        keep = np.isfinite(y) & np.isfinite(x).all(axis=1) & (np.asarray(seconds) > 0)
        x, y = x[keep], y[keep]
        self.xtx += x.T @ x
        self.xty += x.T @ y
        self.yty += float(y @ y)
        self.bins += int(y.size)
        self.prefill_bins += int((x[:, 0] > 0).sum())

    def pricing(self) -> Pricing:
        if self.bins < FIT_MIN_BINS or self.prefill_bins < FIT_MIN_PREFILL_BINS:
            return Pricing(DEFAULT_PREFILL_WEIGHT, False, self.bins)
        best: tuple[float, np.ndarray] | None = None
        for keep in ((0, 1), (0,), (1,)):  # non-negative least squares over two unknowns: the best feasible subset
            idx = list(keep)
            coef = np.zeros(2)
            coef[idx] = np.linalg.lstsq(self.xtx[np.ix_(idx, idx)], self.xty[idx], rcond=None)[0]
            if (coef < 0).any():
                continue
            sse = self.yty - 2 * coef @ self.xty + coef @ self.xtx @ coef
            if best is None or sse < best[0] - 1e-12 * max(1.0, abs(self.yty)):
                best = (float(sse), coef)
        if best is None or not best[1][1] > 0:  # no price of an output token: nothing to weigh a prompt token by
            return Pricing(DEFAULT_PREFILL_WEIGHT, False, self.bins)
        prefill_j, decode_j = (float(c) for c in best[1])
        return Pricing(min(1.0, prefill_j / decode_j), True, self.bins, prefill_j, decode_j)


def fit_bins(lo_s: np.ndarray, hi_s: np.ndarray, prefill: np.ndarray, decode: np.ndarray, energy_j: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Consecutive slices put together into bins of at least ``FIT_BIN_S`` (the last bin takes the rest):
    each bin's seconds, prompt tokens, output tokens and energy (``prefill``/``decode``: per slice, summed
    over requests)."""
    dur = np.asarray(hi_s, dtype=np.float64) - np.asarray(lo_s, dtype=np.float64)
    edges = [0]
    acc = 0.0
    for k, d in enumerate(dur):
        acc += d
        if acc >= FIT_BIN_S:
            edges.append(k + 1)
            acc = 0.0
    if edges[-1] != dur.size:
        if len(edges) > 1:
            edges[-1] = dur.size  # a short tail joins the last bin
        else:
            edges.append(dur.size)
    starts = np.array(edges[:-1])
    if not starts.size:
        empty = np.zeros(0)
        return empty, empty, empty, empty
    return (np.add.reduceat(dur, starts), np.add.reduceat(prefill, starts), np.add.reduceat(decode, starts),
            np.add.reduceat(np.asarray(energy_j, dtype=np.float64), starts))
