"""The energy of requests that overlap (docs/SERVING.md): one span of time cut into sensor windows
(slices) at every request's start and end, grouped into accounting periods, and each period's energy
split among its requests (``ipw.metering.split``).

One :class:`Meter` serves both users:

- ``ipw run`` at a concurrency level (``requests``: the level's count; its span ends with its last
  request).  Token times and server timings come with each request's completion, so a period is split
  once every request in it has ended;
- ``ipw serve`` (open-ended; ``live_tokens``): the proxy times each output token as it passes (``token``)
  and, from llama-server, each prefill at the first token (``prefill``), so a period is split as soon as
  the sensors cover its end and every request in it has reported its prefill.

A period ends where no request is in flight, or at the first request event once ``period_s`` long, for
either split (the ``local`` split's shares are its slices', and the period gives the priced alternative that
a record's ``split_uncertainty_j`` measures the distance to).  Periods are split in time order on the meter's own
thread, and a request's share is final once the period that holds its end is split (``share`` waits for
it; ``on_share`` calls back).  Every slice belongs to exactly one period or to the unattributed energy
(no request in flight), so the parts and the unattributed energy add up to the span's measured energy
(``Tally``).

At a request's end, before its periods are split, ``provisional`` gives an estimate of its energy at once,
from the sensors' latest power integrated between request events (``Provisional``; the method's docstring).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, cast

import numpy as np

from ipw.backends.base import Completion
from ipw.metering.split import (PERIOD_S, PriceFit, Pricing, Request, fit_bins, local_shares, priced_shares,
                                split_method, token_work)
from ipw.metering.window import Closed, Window, resolve
from ipw.telemetry.base import CONTAINING_SCOPES, EnergyReading, PowerEstimate, Quality, worst_quality
from ipw.telemetry.uncertainty import Z90

#: one slice of a span: its start and end (monotonic s), its sensors' result, the requests in flight in it
Slice = tuple[float, float, Closed, frozenset[int]]

#: the interpreter's switch interval while requests are measured (CPython's default is 5 ms): a thread woken
#: by an answer, or by a streamed token, waits up to this long for the lock held by another thread (the NVML
#: sampler, the snapshots, the meter's split, the record writer); ``ipw run`` and ``ipw serve`` set it;
#: bench/overhead/harness_breakdown.py, docs/PERFORMANCE.md
SWITCH_INTERVAL_S = 0.0005
#: how long the meter's thread waits at most for a period's sensors to become final (NVML: until its sampler
#: has read past the period's end; the CPU model: its read after the end)
READY_WAIT_S = 10.0
#: a plain answer's output tokens are spread over its decode time at this many times at most (``request_of``)
SPREAD_TIMES = 1024
#: the provisional ±90% band: from the last this many settled requests, once there are at least CAL_MIN
CAL_N = 200
CAL_MIN = 20
#: the band before that (relative)
PROVISIONAL_REL_DEFAULT = 0.5
#: the phases of a burst a provisional band is learnt for (``_phase``)
PHASES = 4


class Tally:
    """Per-component sums of a span: its energy (``span_j``), the part no request was in flight for
    (``unattributed_j``) and the requests' parts (``parts_j``); None once a slice lacks it."""

    def __init__(self) -> None:
        self.sums: dict[str, dict[str, float | None]] = {}
        self.lock = threading.Lock()

    def add(self, readings: list[EnergyReading], key: str) -> None:
        with self.lock:
            for r in readings:
                row = self.sums.setdefault(r.component, {"span_j": 0.0, "unattributed_j": 0.0, "parts_j": 0.0})
                so_far = row[key]
                row[key] = None if r.energy_j is None or so_far is None else so_far + r.energy_j
                if key == "unattributed_j":  # idle slices are part of the span too
                    row["span_j"] = None if r.energy_j is None or row["span_j"] is None else row["span_j"] + r.energy_j

    def summary(self) -> dict[str, dict[str, float | None]]:
        with self.lock:
            return {c: {k: (None if v is None else round(v, 6)) for k, v in row.items()} for c, row in self.sums.items()}


def request_of(completion: Completion | None, start: float, end: float) -> Request:
    """A request of the split: its window, token times, output token count and its prefill: placed so that it
    ends when the first token arrived, as long as the server (or engine) timed it, else, for a streamed answer
    with a prompt token count, from its start to its first token (``prefill_timed`` False).  A plain answer
    (one time, or none, for all its tokens) with the server's timings: its output tokens spread over the
    server's decode time before its end, its prefill before them."""
    if completion is None:
        return Request(start, end)
    timings = completion.server_timings
    times, first = completion.token_times_s, completion.first_token_s
    if (timings is not None and len(times) <= 1 and completion.completion_tokens > 1 and timings.predicted_ms > 0):
        first = max(start, end - timings.predicted_ms / 1000.0)  # at most SPREAD_TIMES times: each counts for more
        times = tuple(np.linspace(first, end, min(completion.completion_tokens, SPREAD_TIMES)).tolist())
    prompt = completion.prompt_tokens
    if timings is not None and first is not None:  # prompt_n 0: all of it was cached
        return Request(start, end, times, (max(start, first - timings.prompt_ms / 1000.0), first), timings.prompt_n,
                       completion.completion_tokens, prompt)
    if first is not None and prompt > 0 and len(times) > 1 and start <= first <= end:
        return Request(start, end, times, (start, first), prompt, completion.completion_tokens, prompt,
                       prefill_timed=False)
    return Request(start, end, times, None, 0, completion.completion_tokens, prompt)


@dataclass(frozen=True)
class Share:
    """One request's part of the energy measured while it ran."""

    readings: list[EnergyReading]
    busy_s: float  # its share of the busy time (for the idle part of net energy)
    method: str  # "" when it shared no period with another request; else split.split_method
    uncertainty_j: dict[str, float]  # per component: |its share by this split - by the other split|


@dataclass(frozen=True)
class Provisional:
    """A request's energy at its end, before its periods are split: per component, and the relative ±90%
    half-width within which its settled value is expected (``source``: ``alone``, ``work`` or ``time``, as
    ``Meter.provisional`` says; ``none`` with no readings where no power is known)."""

    readings: list[EnergyReading]
    rel_90: float
    source: str


@dataclass
class _Live:
    """What is known of a request in flight."""

    start: float
    times: list[float] = field(default_factory=list)  # its output tokens so far
    prefill: tuple[float, float] | None = None
    prompt_tokens: int = 0
    each_j: dict[str, float] = field(default_factory=dict)  # the meter's ``_each_j`` at its start
    peak: int = 1  # the most requests in flight while it ran (itself included)

    def request(self, now: float) -> Request:
        """The request as known now (in flight until at least ``now``)."""
        return Request(self.start, max(now, self.start), tuple(self.times), self.prefill, self.prompt_tokens)


@dataclass
class _Period:
    slices: list[Slice] = field(default_factory=list)
    members: set[int] = field(default_factory=set)
    closed_s: float = 0.0  # when it stopped taking slices (0: still open)


class _Account:
    """A request's parts so far, period by period: per component ``[chosen split, other split, measurement
    variance (independent, sd^2), calibration sd as the sensors stated it (None once one stated none),
    qualities, source, scope, missing, shared sd]``: the shared sd (a calibration's or a model's, the same
    error in every slice it scales) adds linearly across slices and periods, the independent variance in
    quadrature."""

    def __init__(self) -> None:
        self.parts: dict[str, list[Any]] = {}
        self.busy_s = 0.0
        self.shared = False
        self.periods = 0
        self.last_period: _Period | None = None  # the period that holds its end, once it ended
        self.ended = False
        self.share: Share | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.callbacks: list[Callable[[Share | None, BaseException | None], object]] = []
        self.provisional_j: float | None = None  # the raw provisional total, for the band's calibration
        self.source = ""  # the provisional value's
        self.phase = 0  # where its end fell in a burst (``_phase``): its band is learnt per phase
        self.each_j: dict[str, float] = {}  # its equal part of the power while it was in flight
        self.request: Request | None = None  # once it ended
        self.estimated_rel = 0.0  # the widest band a sensor stated for the power it estimated while this was in flight

    def add(self, reading: EnergyReading, chosen: float | None, other: float | None, var: float | None,
            cal: float | None, shared: float) -> None:
        row = self.parts.setdefault(reading.component,
                                    [0.0, 0.0, 0.0, 0.0, [], reading.source, reading.scope, False, 0.0])
        if chosen is None or other is None:
            row[7] = True
        else:
            row[0] += chosen
            row[1] += other
        row[2] = None if var is None or row[2] is None else row[2] + var
        row[3] = None if cal is None or row[3] is None else row[3] + cal
        row[4].append(reading.quality)
        row[8] += shared


def _phase(in_flight: int, peak: int) -> int:
    """Where a request's end fell in a burst: 0 while most of the requests that ran beside it still run, up to
    ``PHASES - 1`` among the last of them (``in_flight`` at its end, itself included, of ``peak``)."""
    return min(PHASES - 1, int(PHASES * (1.0 - in_flight / max(1, peak))))


def _containing(window: Window) -> set[str]:
    """The components of the window's sensors whose scope contains the others' (the node's BMC,
    ``telemetry.base.CONTAINING_SCOPES``): a total, settled or provisional, never sums them."""
    out: set[str] = set()
    for sensor in window.sensors:
        try:
            info = sensor.info()
        except Exception:  # a sensor that cannot describe itself is not a node sensor
            continue
        if info.scope in CONTAINING_SCOPES:
            out.update(info.components)
    return out


class Meter:
    """A span of requests that start and end at any time; each gets its share of the energy measured
    while it ran (the module's docstring says how).

    ``split``: ``priced`` or ``local`` (``ipw.metering.split``); ``requests``: how many requests the span
    holds (it ends with the last), or None (open-ended: ``close`` ends it); ``live_tokens``: output tokens
    are timed as they arrive (``token``), so a request in flight counts with its tokens so far;
    ``expect_prefill``: the server reports each prefill at the first token (``prefill``), so a period waits
    for that of every request in flight; ``idle_w``: idle power per component (provisional values before
    any period was split)."""

    def __init__(self, window: Window, *, split: str = "priced", requests: int | None = None,
                 live_tokens: bool = False, expect_prefill: bool = False, period_s: float | None = None,
                 idle_w: dict[str, float] | None = None) -> None:
        self.window, self.split = window, split
        self.period_s = PERIOD_S if period_s is None else period_s
        self.live_tokens, self.expect_prefill = live_tokens, expect_prefill
        self.idle_w = dict(idle_w or {})
        self.remaining = requests
        self.lock = threading.Lock()  # guards the span's state; request threads cut slices under it
        self._wake = threading.Condition(self.lock)
        self.tokens: Any = None
        self.opened_s = self.started_s = self.ended_s = 0.0
        self.active: set[int] = set()
        self._live: dict[int, _Live] = {}
        self._ended: dict[int, Request] = {}  # ended jobs whose last period is not split yet
        self._accounts: dict[int, _Account] = {}
        self._open: _Period | None = None
        self._periods: collections.deque[_Period] = collections.deque()  # closed, not split yet, in time order
        self._idle: list[Closed] = []  # slices with no request in flight, until their readings are final
        self.tally = Tally()
        self.fit = PriceFit()
        self._pricing = self.fit.pricing()  # as of the last period split
        # provisional values (``live_tokens``): the power at the last cut (the sensors' latest; else that of the
        # last period split, or the idle power), and its integral over time divided by the requests in flight
        self._power: dict[str, float] = {}
        self._recent_w: dict[str, float] = dict(self.idle_w)
        self._period_power = False  # ``_recent_w`` is the power of a period split (not the idle power)
        self._each_j: dict[str, float] = {}
        self._measured: set[str] = set()  # the components a settled total sums (measured ones, where there are)
        self._containing: set[str] = _containing(window)  # of a scope that contains the others (node): in no total
        # (provisional, settled) of the last CAL_N requests of each provisional source, and of each source and phase
        self._ratios: dict[str | tuple[str, int], collections.deque[tuple[float, float]]] = {}
        # [period, requests, provisional J, settled J] of the last whole periods of each source, CAL_N requests or more
        self._by_period: dict[str, collections.deque[list[Any]]] = {}
        self._stopping = self._stopped = False
        self._thread: threading.Thread | None = None
        self._next = 0
        self.in_flight_peak = 0
        #: wall seconds the meter's thread spent making sensor readings final and splitting periods
        self.cost = {"shares": 0, "periods": 0, "readings_s": 0.0, "split_s": 0.0}

    # -- the span, cut at every request event (request threads) -----------------------------------

    def open(self, thread: bool = True) -> None:
        """Start the span and the meter's thread; without ``thread``, the caller splits the periods
        (``split_due``; ``share`` and ``close`` split what is left)."""
        self.started_s = self.opened_s = time.monotonic()
        self.tokens = self.window.begin(self.started_s)
        if thread:
            self._thread = threading.Thread(target=self._run, name="ipw-meter", daemon=True)
            self._thread.start()

    def _cut(self, now: float, last: bool = False) -> None:
        """Close the slice that ends ``now`` (under the lock) and put it in the open period, or with the
        unattributed energy when no request was in flight."""
        tokens = self.tokens
        if last:
            closed, self.tokens = self.window.end(tokens, now), None
            self.ended_s = now
        else:
            closed, self.tokens = self.window.cut(tokens, now)
        if self.live_tokens:  # for provisional values: the power between request events, by trapezoids
            live = self.window.power_w()
            power = live or self._recent_w
            dt = now - self.opened_s
            spent = {c: (self._power.get(c, w) + w) / 2 * dt for c, w in power.items()}
            if not live and not self._period_power:  # no power known yet: what the sensors' reads tell of the slice
                power = dict(power)
                for c, estimate in self._estimated(tokens).items():
                    power[c], spent[c] = estimate.power_w, estimate.power_w * dt
                    for job in self.active:
                        account = self._accounts[job]
                        account.estimated_rel = max(account.estimated_rel, estimate.rel_90)
            self._power = power
        if self.active:
            if self._open is None:
                self._open = _Period()
            self._open.slices.append((self.opened_s, now, closed, frozenset(self.active)))
            self._open.members |= self.active
            if self.live_tokens:
                for c, j in spent.items():
                    self._each_j[c] = self._each_j.get(c, 0.0) + j / len(self.active)
        else:
            self._idle.append(closed)
        self.opened_s = now

    def _estimated(self, tokens: list[Any]) -> dict[str, PowerEstimate]:
        """The mean power of the slice ``tokens`` (not cut yet, or just cut) by the sensors that can tell it from
        their reads (``SensorBase.window_power_w``: the CPU model)."""
        out: dict[str, PowerEstimate] = {}
        for sensor, token in zip(self.window.sensors, tokens):
            out.update(sensor.window_power_w(token) or {})
        return out

    def _close_period(self, now: float) -> None:
        if self._open is not None:
            self._open.closed_s = now
            self._periods.append(self._open)
            self._open = None
            self._wake.notify_all()

    def start(self, job: int | None = None) -> int:
        """A request starts now: its job number (``job``, or the next one)."""
        with self.lock:
            if job is None:
                job, self._next = self._next, self._next + 1
            now = time.monotonic()
            if self.tokens is not None:
                self._cut(now)
                if self._open is not None and now - self._open.slices[0][0] >= self.period_s:
                    self._close_period(now)
            self.active.add(job)
            if self._open is None and self.tokens is not None:  # its tokens count in the period they arrive in
                self._open = _Period()
            self._live[job] = _Live(now, each_j=dict(self._each_j))
            self._accounts[job] = _Account()
            for other in self._live.values():
                other.peak = max(other.peak, len(self._live))
            self.in_flight_peak = max(self.in_flight_peak, len(self._live))
        return job

    def token(self, job: int) -> None:
        """An output token of ``job`` arrived now (timed under the lock that cuts slices)."""
        with self.lock:
            self._live[job].times.append(time.monotonic())

    def prefill(self, job: int, prompt_ms: float, prompt_tokens: int) -> None:
        """The server reported ``job``'s prefill (its prompt tokens, and how long they took): it ended
        when the first token arrived."""
        with self.lock:
            live = self._live[job]
            if live.times and live.prefill is None:
                live.prefill = (live.times[0] - prompt_ms / 1000.0, live.times[0])
                live.prompt_tokens = prompt_tokens
                if self._periods:  # a closed period may have waited for it
                    self._wake.notify_all()

    def started_s_of(self, job: int) -> float:
        with self.lock:
            return self._live[job].start

    def token_times(self, job: int) -> tuple[float, ...]:
        with self.lock:
            return tuple(self._live[job].times)

    def end(self, job: int, completion: Completion | None) -> tuple[float, float]:
        """``job`` ended now (its slice is cut here): its start and end.  Its share is made on the meter's
        thread (``share`` waits for it, ``on_share`` calls back)."""
        with self.lock:
            now = time.monotonic()
            account = self._accounts[job]
            account.phase = _phase(len(self._live), self._live[job].peak)
            live = self._live.pop(job)
            if self.tokens is not None:
                if self.remaining is not None:
                    self.remaining -= 1
                self._cut(now, last=self.remaining == 0)
                account.last_period = self._open
            self.active.discard(job)
            if self.live_tokens:
                account.each_j = {c: j - live.each_j.get(c, 0.0) for c, j in self._each_j.items()}
            self._ended[job] = request_of(completion, live.start, now) if completion is not None else live.request(now)
            account.request = self._ended[job]
            account.ended = True
            if self._open is not None and (not self.active or now - self._open.slices[0][0] >= self.period_s):
                self._close_period(now)
            late = account.last_period is None
            if late:  # the span had ended: nothing of it was measured
                self._finish(job, Share([], 0.0, "", {}), None)
            if self._periods:  # a closed period may have waited for it (closing one notifies too)
                self._wake.notify_all()
        if late:
            for fn in account.callbacks:
                fn(account.share, None)
            account.callbacks.clear()
        return live.start, now

    def in_flight(self) -> int:
        with self.lock:
            return len(self._live)

    # -- shares --------------------------------------------------------------------------------

    def share(self, job: int, timeout_s: float | None = None) -> Share:
        """The energy of an ended ``job`` once the period that holds its end is split (waits for it)."""
        with self.lock:
            account = self._accounts[job]
            alone = (self._thread is None or self._stopped) and not account.done.is_set()
        if alone:  # no meter thread (never opened, or stopped): split what is left here
            self._settle_all()
        account.done.wait(timeout_s)
        if account.error is not None:
            raise account.error
        if account.share is None:
            raise TimeoutError(f"the energy of request {job} was not settled within {timeout_s} s")
        with self.lock:
            self._accounts.pop(job, None)
        return account.share

    def on_share(self, job: int, fn: Callable[[Share | None, BaseException | None], object]) -> None:
        """Call ``fn(share, error)`` once ``job``'s share is final (now, if it is; else on the meter's thread)."""
        with self.lock:
            account = self._accounts[job]
            if not account.done.is_set():
                account.callbacks.append(fn)
                return
            self._accounts.pop(job, None)
        fn(account.share, account.error)

    def provisional(self, job: int) -> Provisional:
        """An ended ``job``'s energy now, before all its periods are split (``ipw serve``: ``live_tokens``).
        The energy while it ran is known so far from the sensors' latest power between request events
        (``SensorBase.current_power_w``; a sensor with none: the power of the last period split, or the idle
        power before any).

        - ``alone``: a request that shared no period with another: the energy while it ran;
        - ``time``: a request that shared its time, streamed or plain: its equal part, among the requests in
          flight, of the energy while it was in flight. These parts add up to the energy while requests were in
          flight, as the settled shares do, so their sum over a load holds, though in a burst the first to end
          settle at ~1.35x their part and the last at ~0.65x (docs/SERVING.md).

        Each source is corrected by the ratio of settled to provisional energy over its last whole periods (at
        least ``CAL_N`` requests): what the sensors' latest power misses of their samples. Whole periods, as a
        ratio over the last requests settled would follow the last burst's phases (it biased the sums by 2-5%).
        The ±90% band is how far the last ``CAL_N`` settled requests of the same source and phase (``_phase``:
        where in a burst a request ended) fell from their corrected provisional values
        (``PROVISIONAL_REL_DEFAULT`` until ``CAL_MIN``; with fewer of its phase, those of its source)."""
        with self.lock:
            account = self._accounts[job]
            request = account.request
            if request is None or not self.live_tokens or not account.each_j:
                return Provisional([], PROVISIONAL_REL_DEFAULT, "none")
            keep = self._measured or set(account.each_j) - self._containing  # what a settled total sums (the measured ones)
            unsplit = [p for p in [*self._periods, *([self._open] if self._open is not None else [])]
                       if job in p.members]
            alone = not account.shared and all(p.members == {job} for p in unsplit)
            source = "alone" if alone else "time"
            values = {c: j for c, j in account.each_j.items() if c in keep}
            raw = sum(values.values())
            if raw <= 0:  # no power known at all (the CPU model before any period was split)
                return Provisional([], PROVISIONAL_REL_DEFAULT, "none")
            account.provisional_j, account.source = raw, source
            if account.share is not None:  # settled already (a sensor that is final at once)
                self._calibrate(account)
            ratios = list(self._ratios.get((source, account.phase), ()))
            if len(ratios) < CAL_MIN:
                ratios = list(self._ratios.get(source, ()))
            whole = [p[1:] for p in self._by_period.get(source, ())]
        factor, rel = 1.0, max(PROVISIONAL_REL_DEFAULT, account.estimated_rel)  # a sensor's estimate: its band
        if len(ratios) >= CAL_MIN:
            _, prov_j, settled_j = np.array(whole, dtype=float).sum(axis=0)
            factor = float(settled_j / prov_j)
            prov, settled = np.array(ratios).T
            rel = float(np.quantile(np.abs(settled / (prov * factor) - 1.0), 0.9))
        duration = request.end_s - request.start_s
        readings = [EnergyReading(component=c, energy_j=v * factor, source="provisional", quality="estimated",
                                  scope="system_estimate", duration_s=duration,
                                  note=f"provisional ({source}): settled later in the run folder",
                                  uncertainty_j=v * factor * rel) for c, v in values.items()]
        return Provisional(readings, rel, source)

    def pricing(self) -> Pricing:
        with self.lock:
            return self._pricing

    def _finish(self, job: int, share: Share | None, error: BaseException | None) -> None:
        """``job``'s share is final (under the lock): wake its waiter, run its callbacks outside the lock."""
        account = self._accounts[job]
        account.share, account.error = share, error
        self._calibrate(account)
        self._ended.pop(job, None)
        account.done.set()

    def _calibrate(self, account: _Account) -> None:
        """A settled request that had a provisional value: their ratio, for the next bands (under the lock)."""
        if account.share is not None and account.provisional_j is not None:
            settled = sum(r.energy_j for r in account.share.readings if r.energy_j is not None)
            if account.provisional_j > 0 and settled > 0:
                for key in (account.source, (account.source, account.phase)):
                    self._ratios.setdefault(key, collections.deque(maxlen=CAL_N)).append(
                        (account.provisional_j, settled))
                periods = self._by_period.setdefault(account.source, collections.deque())
                if not periods or periods[-1][0] is not account.last_period:
                    periods.append([account.last_period, 0, 0.0, 0.0])
                periods[-1][1:] = [periods[-1][1] + 1, periods[-1][2] + account.provisional_j, periods[-1][3] + settled]
                while len(periods) > 1 and sum(p[1] for p in periods) - periods[0][1] >= CAL_N:
                    periods.popleft()

    # -- the meter's thread ------------------------------------------------------------------------

    def _known(self, period: _Period) -> bool:
        """Whether the work of every request in ``period`` is known up to its end (under the lock)."""
        for j in period.members:
            if j in self._ended:
                continue
            live = self._live.get(j)
            if live is None or not self.live_tokens or (self.expect_prefill and live.prefill is None):
                return False
        return True

    def _run(self) -> None:
        while True:
            with self._wake:
                while True:
                    period = self._periods[0] if self._periods else None
                    if period is not None and (self._known(period) or self._stopping):
                        break
                    if period is None and self._stopping:
                        self._stopped = True
                        return
                    self._wake.wait(0.05 if period is not None else None)
            deadline = period.closed_s + READY_WAIT_S
            if not all(s[2].ready() for s in period.slices):
                all(s[2].wait(max(0.0, deadline - time.monotonic())) for s in period.slices)
                if not all(s[2].ready() for s in period.slices) and time.monotonic() < deadline and not self._stopping:
                    continue
            self.split_period(period)

    def _settle_all(self) -> None:
        """Split every closed period now, with what is known (no meter thread)."""
        while True:
            with self.lock:
                if not self._periods:
                    return
                period = self._periods[0]
            self.split_period(period)

    def split_due(self, now_s: float, delay_s: float) -> None:
        """Split, in the caller's thread, every closed period that ended at least ``delay_s`` before ``now_s`` and
        whose requests' work is known, oldest first: for a meter opened without its thread (``open(thread=False)``).
        bench/serving/provisional_replay.py replays a recorded session so, on a simulated clock: a period is split
        once its sensors' readings would be final (``delay_s`` after its end), as the meter's thread splits it on
        a live one."""
        while True:
            with self.lock:
                period = self._periods[0] if self._periods else None
                if period is None or period.closed_s + delay_s > now_s or not self._known(period):
                    return
            self.split_period(period)

    def split_period(self, period: _Period) -> None:
        """Split one period (the oldest closed one) among its requests, make the shares of the requests that
        ended in it final, and add what is ready of the idle slices to the unattributed energy.  The meter's
        thread calls it once per period (one batch of shares); bench/serving/serve_timeline.py times each
        call, as a step of a request's way through ``ipw serve``."""
        t0 = time.perf_counter()
        with self.lock:
            idle = list(self._idle)
        resolve([s[2] for s in period.slices] + idle)
        readings = [s[2].readings() for s in period.slices]  # outside every lock
        t1 = time.perf_counter()
        finished: list[tuple[_Account, Share | None, BaseException | None]] = []
        with self.lock:
            assert self._periods and self._periods[0] is period
            self._periods.popleft()
            jobs = sorted(period.members)
            try:
                self._split(period, jobs, readings)
            except Exception as exc:  # the waiting requests get the error, not a hang
                for j in jobs:
                    account = self._accounts.get(j)
                    if account is not None and account.ended and account.last_period is period:
                        self._finish(j, None, exc)
                        finished.append((account, None, exc))
            else:
                for j in jobs:
                    account = self._accounts.get(j)
                    if account is not None and account.ended and account.last_period is period:
                        made = self._share_of(j, account)
                        self._finish(j, made, None)
                        finished.append((account, made, None))
            for r in readings:
                self.tally.add(r, "span_j")
            for _, part, _ in finished:
                if part is not None:
                    self.tally.add(part.readings, "parts_j")
            self._drain_idle(wait=False)
            self.cost["periods"] += 1
            self.cost["shares"] += len(finished)
            self.cost["readings_s"] += t1 - t0
            self.cost["split_s"] += time.perf_counter() - t1
        for account, share, error in finished:  # outside the lock: a callback may build and write a record
            for fn in account.callbacks:
                fn(share, error)
            account.callbacks.clear()

    def _split(self, period: _Period, jobs: list[int], readings: list[list[EnergyReading]]) -> None:
        """Each request's part of ``period``, added to its account (under the lock)."""
        end = period.slices[-1][1]
        reqs = [self._ended[j] if j in self._ended else self._live[j].request(end) for j in jobs]
        lo = np.array([s[0] for s in period.slices])
        hi = np.array([s[1] for s in period.slices])
        dur = hi - lo
        prefill, decode, active = token_work(lo, hi, reqs)  # the local split's: the prompt tokens computed
        whole = (token_work(lo, hi, reqs, whole_prompt=True)[0]  # the priced split's: whole prompts
                 if any(r.prompt_tokens > r.prefill_tokens for r in reqs) else prefill)
        components = list(dict.fromkeys(r.component for rs in readings for r in rs))
        by_comp = {c: [next((r for r in rs if r.component == c), None) for rs in readings] for c in components}
        energy = {c: np.array([np.nan if r is None or r.energy_j is None else r.energy_j for r in rs])
                  for c, rs in by_comp.items()}
        total = np.sum(list(energy.values()), axis=0) if energy else np.full(len(readings), np.nan)
        if np.isfinite(total).all() and total.size:
            self.fit.add(*fit_bins(lo, hi, prefill.sum(axis=0), decode.sum(axis=0), total))  # the work done
        self._pricing = pricing = self.fit.pricing()
        w_priced = priced_shares(whole, decode, active, pricing.prefill_weight)
        w_local = local_shares(prefill, decode, active)
        act_sum = active.sum(axis=0)
        for k in np.flatnonzero(act_sum <= 0):  # a slice of no length: equal parts, so that its energy is not lost
            members = [i for i, j in enumerate(jobs) if j in period.slices[k][3]]
            w_local[members, k] = 1.0 / len(members)
        busy_time = dur.sum()
        busy_local = (w_local * dur).sum(axis=1) if self.split == "local" else None
        if busy_time > 0:
            self._recent_w = {c: float(np.nansum(e)) / busy_time for c, e in energy.items()}
            self._period_power = True
        self._measured = {c for c, rs in by_comp.items()
                          if any(r is not None and r.quality in ("measured", "measured_interpolated")
                                 and r.scope not in CONTAINING_SCOPES for r in rs)}
        self._containing |= {c for c, rs in by_comp.items()  # the node's BMC: never in a total
                             if any(r is not None and r.scope in CONTAINING_SCOPES for r in rs)}
        priced = self.split == "priced"
        # per component, every request at once: its share by each split, and its sensors' error under the split
        # used, weighted by its part: each slice's stated shared part (``calibration_sd_j``: a calibration ratio's,
        # the CPU model's coefficient's; the same error in every slice) linearly, the rest of its error as
        # independent (1 sd squared)
        w = np.repeat(w_priced[:, None], len(period.slices), axis=1) if priced else w_local
        per: dict[str, tuple[EnergyReading, np.ndarray | None, np.ndarray | None, np.ndarray | None, np.ndarray | None,
                             np.ndarray]] = {}
        for c in components:
            e, rs = energy[c], by_comp[c]
            first = next(r for r in rs if r is not None)
            missing = bool(np.isnan(e).any())
            unc = [None if r is None else r.uncertainty_j for r in rs]
            cal = [None if r is None else r.calibration_sd_j for r in rs]
            sd = np.array([0.0 if u is None else u / Z90 for u in unc])
            common = np.minimum(np.array([0.0 if x is None else x for x in cal]), sd)
            per[c] = (first,
                      None if missing else w_priced * float(e.sum()),
                      None if missing else w_local @ e,
                      None if any(u is None for u in unc) else (w ** 2) @ (sd ** 2 - common ** 2),
                      None if any(x is None for x in cal) else w @ np.array(cal, dtype=np.float64),
                      w @ common)
        for i, j in enumerate(jobs):
            account = self._accounts.get(j)
            if account is None:
                continue
            account.periods += 1
            account.shared |= len(jobs) > 1
            account.busy_s += float(w_priced[i] * busy_time) if priced else float(cast(np.ndarray, busy_local)[i])
            for first, p_all, l_all, var_all, cal_all, common_all in per.values():
                p_share = None if p_all is None else float(p_all[i])
                l_share = None if l_all is None else float(l_all[i])
                var = None if var_all is None else float(var_all[i])
                cal_sd = None if cal_all is None else float(cal_all[i])
                account.add(first, p_share if priced else l_share, l_share if priced else p_share, var, cal_sd,
                            float(common_all[i]))

    def _share_of(self, job: int, account: _Account) -> Share:
        request = self._ended[job]
        readings, uncertainty = [], {}
        for c, (chosen, other, var, cal, qualities, source, scope, missing, common) in account.parts.items():
            uncertainty[c] = 0.0 if missing else abs(chosen - other)
            readings.append(EnergyReading(
                component=c, energy_j=None if missing else chosen, source=source, scope=scope,
                quality="unavailable" if missing else cast(Quality, worst_quality(qualities)),
                duration_s=request.end_s - request.start_s,
                note=(f"share of {account.periods} accounting period(s)"
                      + (f" split among overlapping requests ({self.split})" if account.shared else " (alone)")),
                uncertainty_j=None if var is None or missing else math.sqrt(var + common ** 2) * Z90,
                calibration_sd_j=None if cal is None or missing else cal,
            ))
        method = split_method(request, self.split) if account.shared else ""
        return Share(readings, account.busy_s, method, uncertainty)

    def _drain_idle(self, wait: bool) -> None:
        """Add the slices with no request in flight to the unattributed energy (those whose readings are
        final, or all of them with ``wait``; under the lock)."""
        later = []
        for closed in self._idle:
            if wait or closed.ready():
                self.tally.add(closed.readings(), "unattributed_j")
            else:
                later.append(closed)
        self._idle = later

    def close(self) -> dict[str, dict[str, float | None]]:
        """End the span (after the last request has finished), split what is left and return the
        conservation tally; the meter's thread stops once every closed period is split."""
        with self.lock:
            if self.tokens is not None:
                self.ended_s = time.monotonic()
                self._cut(self.ended_s, last=True)
            self._close_period(self.ended_s)
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=2 * READY_WAIT_S)
        self._settle_all()
        with self.lock:
            self._drain_idle(wait=True)
        return self.tally.summary()
