"""Energy of requests that overlap (DESIGN.md §3, docs/SERVING.md): a span of time cut into sensor
windows at every request's start and end, and each window's energy split among the requests in
flight in it, by the work each did there (``estimator.slice_weights``).

Two users, one split:

- ``ipw run`` (:class:`Segments` with a known number of requests): a level's span; each record is
  split once every request it overlapped has finished (``split_share``), with all their token times
  and server timings;
- ``ipw serve`` (:class:`Meter`, open-ended): a response needs its energy when it ends, so each window
  is split once, when the first of its requests ends, with what is known of the others then (their
  token times so far; a peer's prefill timings only once the peer has ended).  Every window is split
  exactly once, so the parts and the unattributed windows still add up to the measured total.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, cast

import numpy as np

from ipw.backends.base import Completion
from ipw.telemetry.base import EnergyReading, Quality, worst_quality
from ipw.telemetry.estimator import Request, by_time, slice_weights, split_method
from ipw.telemetry.window import Closed, Window, resolve

#: one window of a span: its start and end (monotonic s), its sensors' result, the requests in flight
Slice = tuple[float, float, Closed, frozenset[int]]


class Segments:
    """A span cut into sensor windows at every request's start and end (``Window.cut``), so that the
    windows tile the span: the energy of the whole span is the sum of theirs.  Windows with a request
    in flight are kept (``closed``) until the caller has split them; those with none are the span's
    unattributed energy (``idle``).

    ``requests``: how many requests the span holds (``ipw run``'s level: the span ends when the last
    one does), or None for an open-ended span (``ipw serve``), which ends with :meth:`finish`.
    """

    def __init__(self, window: Window, requests: int | None) -> None:
        self.window = window
        self.remaining = requests  # requests not yet ended
        self.lock = threading.Lock()
        self.active: set[int] = set()
        self.tokens: Any = None
        self.opened_s = 0.0
        self.closed: list[Slice] = []
        self.idle: list[Closed] = []  # windows with no request in flight
        self.started_s = self.ended_s = 0.0

    def start(self) -> None:
        self.started_s = self.opened_s = time.monotonic()
        self.tokens = self.window.begin(self.started_s)

    def event(self, add: int | None = None, remove: int | None = None,
              then: Callable[[float], None] | None = None) -> float:
        """A request starts (``add``) or ends (``remove``): cut the window there.  When the span's last
        request ends, the span ends with it (not when its records are built).  ``then(now)`` runs under
        the same lock, so that nothing sees the cut before the caller's own bookkeeping of it."""
        with self.lock:
            if self.tokens is None:  # the span has ended
                now = time.monotonic()
                if then is not None:
                    then(now)
                return now
            if remove is not None and self.remaining is not None:
                self.remaining -= 1
            last = self.remaining == 0
            now = time.monotonic()  # the cut's edge: the sensors' and the slices' (records') time alike
            if last:
                closed, self.tokens = self.window.end(self.tokens, now), None
            else:
                closed, self.tokens = self.window.cut(self.tokens, now)
            if self.active:
                self.closed.append((self.opened_s, now, closed, frozenset(self.active)))
            else:
                self.idle.append(closed)
            self.opened_s = now
            if last:
                self.ended_s = now
            if add is not None:
                self.active.add(add)
            self.active.discard(remove)
            if then is not None:
                then(now)
            return now

    def finish(self) -> None:
        """End the span if no request did (an interrupted level, or ``ipw serve`` stopping)."""
        with self.lock:
            if self.tokens is None:
                return
            self.ended_s = time.monotonic()
            closed, self.tokens = self.window.end(self.tokens, self.ended_s), None
            (self.closed.append((self.opened_s, self.ended_s, closed, frozenset(self.active))) if self.active
             else self.idle.append(closed))

    def of(self, job: int) -> list[Slice]:
        with self.lock:
            return [seg for seg in self.closed if job in seg[3]]

    def take_idle(self) -> list[Closed]:
        with self.lock:
            idle, self.idle = self.idle, []
        return idle

    def release(self, done_through: int, tally: "Tally") -> set[int]:
        """Forget the windows of requests up to ``done_through`` (recorded, in job order), adding their
        energy to ``tally``, so that a long run holds only the windows of requests in flight; returns the
        jobs those still involve.  Readings are waited for outside the lock: requests cut windows under it."""
        with self.lock:
            gone = [seg[2] for seg in self.closed if max(seg[3]) <= done_through]
            self.closed = [seg for seg in self.closed if max(seg[3]) > done_through]
            needed = set().union(*(seg[3] for seg in self.closed))
        for closed in gone:
            tally.add(closed.readings(), "span_j")
        for closed in self.take_idle():
            tally.add(closed.readings(), "unattributed_j")
        return needed


class Tally:
    """Per-component sums of a span: its energy (``span_j``), the part no request was in flight for
    (``unattributed_j``) and the requests' parts (``parts_j``); None once a window lacks it."""

    def __init__(self) -> None:
        self.sums: dict[str, dict[str, float | None]] = {}
        self.lock = threading.Lock()

    def add(self, readings: list[EnergyReading], key: str) -> None:
        with self.lock:
            for r in readings:
                row = self.sums.setdefault(r.component, {"span_j": 0.0, "unattributed_j": 0.0, "parts_j": 0.0})
                so_far = row[key]
                row[key] = None if r.energy_j is None or so_far is None else so_far + r.energy_j
                if key == "unattributed_j":  # idle windows are part of the span too
                    row["span_j"] = None if r.energy_j is None or row["span_j"] is None else row["span_j"] + r.energy_j

    def summary(self) -> dict[str, dict[str, float | None]]:
        with self.lock:
            return {c: {k: (None if v is None else round(v, 6)) for k, v in row.items()} for c, row in self.sums.items()}


def request_of(completion: Completion | None, start: float, end: float) -> Request:
    """A request of the concurrent split: its window, token times and, where the server timed it, its
    prefill, placed so that it ends when the first token arrived."""
    if completion is None:
        return Request(start, end)
    timings = completion.server_timings
    prefill = None
    if timings is not None and completion.first_token_s is not None:  # prompt_n 0: all of it was cached
        prefill = (completion.first_token_s - timings.prompt_ms / 1000.0, completion.first_token_s)
    return Request(start, end, completion.token_times_s, prefill,
                   timings.prompt_n if prefill and timings is not None else 0)


@dataclass(frozen=True)
class Share:
    """One request's part of the energy measured while it ran."""

    readings: list[EnergyReading]
    busy_s: float  # its share of the time (for the idle part of net energy)
    method: str  # "" when no other request overlapped it; else estimator.split_method
    uncertainty_j: dict[str, float]  # per component: |share by work - share by time|


def assemble(parts: list[tuple[float, float, list[EnergyReading], float, float]], method: str, peers: int) -> Share:
    """A request's :class:`Share` from its windows, each ``(start, end, readings, weight by work, weight
    by time)``: the windows tile its own window, the weights are its part of each (``slice_weights``)."""
    if not parts:
        return Share([], 0.0, "", {})
    busy_s = sum(w_time * (hi - lo) for lo, hi, _, _, w_time in parts)
    by_component: dict[str, list[tuple[EnergyReading, float, float]]] = {}
    for _, _, readings, w_work, w_time in parts:
        for r in readings:
            by_component.setdefault(r.component, []).append((r, w_work, w_time))
    readings = []  # a list[EnergyReading], as in the loop above
    uncertainty: dict[str, float] = {}
    for component, rs in by_component.items():
        known = [(r.energy_j, w_work, w_time) for r, w_work, w_time in rs if r.energy_j is not None]
        missing = len(rs) != len(parts) or len(known) != len(rs)
        share: float | None = None
        if not missing:
            share = sum(w * e for e, w, _ in known)
            uncertainty[component] = abs(share - sum(w * e for e, _, w in known))
        first = rs[0][0]
        readings.append(EnergyReading(
            component=component, energy_j=share, source=first.source, scope=first.scope,
            quality="unavailable" if missing else cast(Quality, worst_quality([r.quality for r, _, _ in rs])),
            duration_s=float(parts[-1][1] - parts[0][0]),
            note=f"share of {len(parts)} window(s) split among {peers} overlapping request(s)"
            + (f" by {method}" if method else ""),
        ))
    return Share(readings, busy_s, method, uncertainty)


def split_share(job: int, segs: list[Slice], requests: dict[int, Request]) -> Share:
    """``ipw run``: this request's share of each component's energy over its windows (which tile its own
    window), split among the requests active in each, all of which have ended (``requests``: by job)."""
    if not segs:
        return Share([], 0.0, "", {})
    peers = sorted(set().union(*(seg[3] for seg in segs)))
    reqs = [requests[j] for j in peers]
    me = peers.index(job)
    lo = np.array([seg[0] for seg in segs])
    hi = np.array([seg[1] for seg in segs])
    w_work = slice_weights(lo, hi, reqs)[0][me]
    w_time = slice_weights(lo, hi, by_time(reqs))[0][me]
    method = split_method(requests[job]) if len(peers) > 1 else ""
    return assemble([(seg[0], seg[1], seg[2].readings(), float(w_work[k]), float(w_time[k]))
                     for k, seg in enumerate(segs)], method, len(peers))


@dataclass
class _Live:
    """What is known of a request in flight."""

    start: float
    times: list[float] = field(default_factory=list)  # its output tokens so far
    prefill: tuple[float, float] | None = None
    prompt_tokens: int = 0

    def request(self, now: float) -> Request:
        """The request as known now (in flight until at least ``now``)."""
        return Request(self.start, max(now, self.start), tuple(self.times), self.prefill, self.prompt_tokens)


#: how long the meter's thread waits at most for the windows of an ended request to become final (NVML:
#: until its sampler has read past their ends; the CPU model: its read after the end)
READY_WAIT_S = 10.0


@dataclass
class _Pending:
    """An ended request, until its share is taken: what the meter's thread has made of it."""

    ended_s: float
    windows: list[Slice] | None = None  # its windows (fixed once it has ended), found by the meter's thread
    share: Share | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Meter:
    """``ipw serve``'s open-ended span: requests start and end at any time, and each gets its share
    when it ends (``end``, then ``share``), without waiting for the requests it overlapped.

    A window is split once, when the first of its requests has ended: a request still in flight then counts
    with its token times so far (they are exactly its work in that window: a token is timed under the
    lock that cuts windows) and with its prefill once the server has reported it (``prefill``:
    llama-server does with the first token when asked for ``timings_per_token``).  A peer whose prefill
    is not known yet (still prefilling, or a server that reports timings only at the end) has its
    prefill charged to the requests decoding beside it, as ``decode_tokens`` does.  The weights of each
    window are kept until every request in it has taken its part: the parts of all requests and the
    windows with none in flight add up to the span's measured energy (``tally``).

    The shares are made on one thread of the meter's own (``open`` starts it), not on the requests'
    threads: the requests that ended by the time their windows are final are settled in one batch (one
    ``resolve``, one ``slice_weights`` over the windows not split yet), and a request waits for its own
    share only, never for a lock held while another request's windows are split."""

    def __init__(self, window: Window) -> None:
        self.segments = Segments(window, None)
        self.tally = Tally()
        self._live: dict[int, _Live] = {}  # requests in flight
        self._ended: dict[int, Request] = {}  # ended jobs whose windows other requests still share
        self._windows: dict[int, tuple[float, float]] = {}  # ended jobs not yet shared: their start and end
        self._weights: dict[int, dict[int, tuple[float, float]]] = {}  # id(window) -> job -> (work, time)
        self._taken: dict[int, set[int]] = {}  # id(window) -> jobs that took their part
        self._pending: dict[int, _Pending] = {}  # ended jobs whose share is not taken yet
        self._wake = threading.Condition()  # guards _pending and _stopping; wakes the meter's thread
        self._stopping = self._stopped = False
        self._thread: threading.Thread | None = None
        self._settle_lock = threading.Lock()  # the meter's thread's, or (once it stopped) a late request's
        self._next = 0
        self.in_flight_peak = 0
        #: wall seconds the meter's thread spent making sensor readings final and splitting windows, in
        #: how many batches
        self.cost = {"shares": 0, "batches": 0, "readings_s": 0.0, "split_s": 0.0}

    def open(self) -> None:
        self.segments.start()
        self._thread = threading.Thread(target=self._run, name="ipw-meter", daemon=True)
        self._thread.start()

    def start(self) -> int:
        """A request starts now: its job number."""
        with self.segments.lock:
            job, self._next = self._next, self._next + 1

        def opened(now: float) -> None:  # under the lock that cut the window
            self._live[job] = _Live(now)
            self.in_flight_peak = max(self.in_flight_peak, len(self._live))

        self.segments.event(add=job, then=opened)
        return job

    def token(self, job: int) -> None:
        """An output token of ``job`` arrived now (timed under the lock that cuts windows)."""
        with self.segments.lock:
            self._live[job].times.append(time.monotonic())

    def prefill(self, job: int, prompt_ms: float, prompt_tokens: int) -> None:
        """The server reported ``job``'s prefill (its prompt tokens, and how long they took): it ended
        when the first token arrived."""
        with self.segments.lock:
            live = self._live[job]
            if live.times and live.prefill is None:
                live.prefill = (live.times[0] - prompt_ms / 1000.0, live.times[0])
                live.prompt_tokens = prompt_tokens

    def started_s(self, job: int) -> float:
        with self.segments.lock:
            return self._live[job].start

    def token_times(self, job: int) -> tuple[float, ...]:
        with self.segments.lock:
            return tuple(self._live[job].times)

    def end(self, job: int, completion: Completion | None) -> tuple[float, float]:
        """``job`` ended now (its window is cut here): its start and end.  The meter's thread makes its
        share (``share`` waits for it)."""
        def ended(now: float) -> None:  # under the lock that cut the window
            live = self._live.pop(job)
            self._ended[job] = request_of(completion, live.start, now) if completion is not None else live.request(now)
            self._windows[job] = (live.start, now)

        self.segments.event(remove=job, then=ended)
        with self.segments.lock:
            window = self._windows[job]
        with self._wake:
            self._pending[job] = _Pending(ended_s=window[1])
            self._wake.notify()
        return window

    def share(self, job: int) -> Share:
        """The energy of an ended ``job``: its part of every window it was in flight for.  The meter's
        thread makes it, once the sensors have covered the job's end, in one batch with the other jobs
        ended by then (``_settle``); this waits for it."""
        with self._wake:
            pending = self._pending[job]
            alone = (self._thread is None or self._stopped) and not pending.done.is_set()
        if alone:  # no meter thread: never opened, or the request ended after it stopped (past the grace period)
            with self._settle_lock:
                pending.share = self._settle({job: self.segments.of(job)})[job]
                pending.done.set()
        pending.done.wait()
        with self._wake:
            del self._pending[job]
        if pending.error is not None:
            raise pending.error
        assert pending.share is not None
        return pending.share

    def _run(self) -> None:
        """The meter's thread: the ended jobs whose windows are ready (or that waited ``READY_WAIT_S``),
        settled together; until ``close`` and every ended job settled."""
        while True:
            with self._wake:
                while not self._stopping and not any(p.share is None and p.error is None for p in self._pending.values()):
                    self._wake.wait()
                due = {j: p for j, p in self._pending.items() if p.share is None and p.error is None}
                if not due and self._stopping:
                    self._stopped = True  # a job that ends from now on is settled by its own thread
                    return
            for job, p in due.items():
                if p.windows is None:  # a job's windows are fixed once it ended
                    p.windows = self.segments.of(job)
            now = time.monotonic()
            batch = []
            oldest: list[Slice] = []  # the windows of the oldest job that are not ready, and until when
            deadline = now
            # oldest end first: the sensors cover time in order, so once a job's windows are not ready,
            # a job that ended later is not either (asking each of 64 jobs every ms would hold the lock)
            for j, p in sorted(due.items(), key=lambda item: item[1].ended_s):
                windows = cast(list[Slice], p.windows)
                if not (now - p.ended_s > READY_WAIT_S or all(seg[2].ready() for seg in windows)):
                    oldest, deadline = windows, p.ended_s + READY_WAIT_S
                    break
                batch.append(j)
            if not batch:  # until the sensors have read past the oldest job's end: the CPU model's read after
                # it wakes this thread (an event); NVML's sampler is asked every ms (``Deferred.wait``)
                all(seg[2].wait(max(0.0, deadline - time.monotonic())) for seg in oldest)
                continue
            try:
                with self._settle_lock:
                    shares = self._settle({j: cast(list[Slice], due[j].windows) for j in sorted(batch)})
            except BaseException as exc:  # the waiting requests get the error, not a hang
                for j in batch:
                    due[j].error = exc
                    due[j].done.set()
                continue
            for j in batch:
                due[j].share = shares[j]
                due[j].done.set()

    def _settle(self, batch: dict[int, list[Slice]]) -> dict[int, Share]:
        """The shares of ended jobs (``batch``: each one's windows): every window of the span that is ready
        made final at once, the windows not split yet split in one go, each job's parts taken."""
        t0 = time.perf_counter()
        self._resolve()
        segs = list({id(seg[2]): seg for mine in batch.values() for seg in mine}.values())
        readings = {id(seg[2]): seg[2].readings() for seg in segs}  # outside every lock
        t1 = time.perf_counter()
        new = sorted((seg for seg in segs if id(seg[2]) not in self._weights), key=lambda seg: seg[0])
        if new:
            self._split(new)
            for seg in new:
                self.tally.add(readings[id(seg[2])], "span_j")
        shares = {}
        for job, mine in batch.items():
            parts = []
            peers: set[int] = set()
            for lo, hi, closed, active in mine:
                key = id(closed)
                w_work, w_time = self._weights[key][job]
                parts.append((lo, hi, readings[key], w_work, w_time))
                peers |= active
                self._taken[key].add(job)
            shares[job] = assemble(parts, split_method(self._ended[job]) if len(peers) > 1 else "", len(peers))
            self.tally.add(shares[job].readings, "parts_j")
        done = [seg for seg in segs if self._taken[id(seg[2])] >= seg[3]]
        for seg in done:
            del self._weights[id(seg[2])], self._taken[id(seg[2])]
        gone = {id(seg[2]) for seg in done}
        with self.segments.lock:
            for job in batch:
                del self._windows[job]
            if gone:
                self.segments.closed = [seg for seg in self.segments.closed if id(seg[2]) not in gone]
            still = set().union(*(seg[3] for seg in self.segments.closed))
            for j in [j for j in self._ended if j not in still and j not in self._windows]:
                del self._ended[j]
        self._drain_idle(wait=False)
        # what the meter costs (the session line's meter_cost): its thread's time, not the requests'
        self.cost["shares"] += len(batch)
        self.cost["batches"] += 1
        self.cost["readings_s"] += t1 - t0
        self.cost["split_s"] += time.perf_counter() - t1
        return shares

    def _resolve(self) -> None:
        """Every window of the span that is ready, made final in one go (``window.resolve``): under load
        a window ends every few ms, and one estimate each would cost more than the proxy may."""
        with self.segments.lock:
            pending = [seg[2] for seg in self.segments.closed] + list(self.segments.idle)
        resolve(pending)

    def _split(self, segs: list[Slice]) -> None:
        """Weigh the requests of windows not split yet, all in one go (``slice_weights``: a request is in a
        window exactly when it was in flight then, so one call over their union gives each window's own)."""
        for seg in segs:
            self._taken[id(seg[2])] = set()
            if len(seg[3]) == 1:  # one request in flight: all of the window is its own, by work and by time alike
                self._weights[id(seg[2])] = {j: (1.0, 1.0) for j in seg[3]}  # (what slice_weights gives it)
        segs = [seg for seg in segs if len(seg[3]) > 1]
        if not segs:
            return
        jobs = sorted(set().union(*(seg[3] for seg in segs)))
        now = max(seg[1] for seg in segs)
        with self.segments.lock:
            reqs = [self._ended[j] if j in self._ended else self._live[j].request(now) for j in jobs]
        lo, hi = np.array([seg[0] for seg in segs]), np.array([seg[1] for seg in segs])
        w_work = slice_weights(lo, hi, reqs)[0]
        w_time = slice_weights(lo, hi, by_time(reqs))[0]
        row = {j: i for i, j in enumerate(jobs)}
        for k, seg in enumerate(segs):
            members = sorted(seg[3])
            work, by_t = w_work[[row[j] for j in members], k], w_time[[row[j] for j in members], k]
            if not (abs(work.sum() - 1.0) < 1e-9 and abs(by_t.sum() - 1.0) < 1e-9):  # a window's own requests only
                one = [reqs[row[j]] for j in members]
                work = slice_weights(lo[k:k + 1], hi[k:k + 1], one)[0][:, 0]
                by_t = slice_weights(lo[k:k + 1], hi[k:k + 1], by_time(one))[0][:, 0]
                if not by_t.sum() > 0:  # a window of no length: equal parts, so that its energy is not lost
                    work = by_t = np.full(len(members), 1.0 / len(members))
            self._weights[id(seg[2])] = {j: (float(work[i]), float(by_t[i])) for i, j in enumerate(members)}

    def _drain_idle(self, wait: bool) -> None:
        """Add the windows with no request in flight to the unattributed energy (those whose readings are
        final, or all of them with ``wait``)."""
        idle = self.segments.take_idle()
        later = [c for c in idle if not (wait or c.ready())]
        for closed in idle:
            if wait or closed.ready():
                self.tally.add(closed.readings(), "unattributed_j")
        if later:
            with self.segments.lock:
                self.segments.idle[:0] = later

    def in_flight(self) -> int:
        with self.segments.lock:
            return len(self._live)

    def close(self) -> dict[str, dict[str, float | None]]:
        """End the span (after the last request has finished) and return the conservation tally; the
        meter's thread stops once it has settled every ended request."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=2 * READY_WAIT_S)
        self.segments.finish()
        self._drain_idle(wait=True)
        for _lo, _hi, closed, _active in self.segments.closed:  # requests that never finished (should be none)
            self.tally.add(closed.readings(), "span_j")
        return self.tally.summary()
