"""Run-level energy audit (issue 27): does the sum of the per-query energies, plus the idle between the
queries, add up to what the device's own energy counter says over the same span?

The IPW project added one after a buffer silently capped long queries (HazyResearch/intelligence-per-watt#39):
a per-query number can be wrong in a way no per-query check sees, but the whole run cannot hide it from
the counter.  Here, per measured GPU:

- ``counter_j``: the counter's energy from the first query's start to the last one's end (its reads placed
  on the update grid when found; the two ends interpolated, to within ``counter_sd_j``);
- ``queries_j``: the sum of the GPU's per-query readings (``energy_parts``);
- ``idle_between_j``: the energy of the gaps between queries (no query running: the part of the span outside
  every query's window), from the same samples as the queries;
- ``difference_j`` = counter − (queries + idle between); it should be 0 within ``uncertainty_j``, the ±90%
  half-width of the difference: the queries' and gaps' stated intervals (independent parts in quadrature,
  shared ones added up; ``ipw.analysis.stats.measurement_sd``) and the counter's ends.

The target (issue 43): the difference within ``CONSERVATION_TARGET`` (±0.3%) of the counter; a line that
misses it says so (``within_target``), beside whether it agrees within its stated uncertainty.

``audit`` is pure; ``run_audit`` gathers its inputs from a finished backend's NVML sensor and its records
(``ipw.running.runner``, once per backend, after its last query).  A backend that ran more than one concurrency
level is audited per level (each level's span, its queries and the idle between them; its line says "at
16 in flight"): one level's miss is not hidden in the total.  The proxy (``ipw serve``) audits each of its
sessions at its stop (``backends[].sessions[].energy_audit``, its lines "in session 2").  The manifest keeps
every field; ``ipw run`` and ``ipw serve`` print one line when a GPU's difference exceeds its uncertainty or
misses the target (``audit_lines``, ``flagged_lines``); ``ipw doctor --self-test`` shows the same audit over
its own windows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from ipw.telemetry.uncertainty import Z90, measurement_sd

#: Conservation's target: the counter's energy over a span and the queries' plus the idle between them
#: differ by at most this share of the counter (issue 43), at every concurrency level and in every session.
CONSERVATION_TARGET = 0.003


@dataclass(frozen=True)
class EnergyAudit:
    component: str
    start_s: float  # the span: first query start .. last query end (monotonic s)
    end_s: float
    queries: int  # queries with this component's energy
    missing: int  # queries without it (unavailable readings): their energy is in the difference
    queries_j: float
    idle_between_j: float | None
    counter_j: float | None
    difference_j: float | None
    uncertainty_j: float | None  # ±90% of the difference
    note: str = ""
    concurrency: int | None = None  # the level audited, when a backend ran more than one
    scope: str = ""  # what the line names beside the component: "at 16 in flight", "in session 2"

    @property
    def agrees(self) -> bool | None:
        """Whether the difference lies within its uncertainty (None: nothing to compare)."""
        if self.difference_j is None or self.uncertainty_j is None:
            return None
        return abs(self.difference_j) <= self.uncertainty_j

    @property
    def within_target(self) -> bool | None:
        """Whether the difference is within ``CONSERVATION_TARGET`` of the counter (None: nothing to compare)."""
        if self.difference_j is None or not self.counter_j:
            return None
        return abs(self.difference_j / self.counter_j) <= CONSERVATION_TARGET

    def line(self) -> str:
        """One line for a person: the balance, whether it holds within its uncertainty, and a miss of the
        ±0.3% target."""
        who = f"{self.component} {self.scope}" if self.scope else self.component
        if self.difference_j is None or self.counter_j is None:
            return f"energy audit {who}: not checked ({self.note or 'no counter over the span'})"
        rel = self.difference_j / self.counter_j if self.counter_j else float("nan")
        verdict = "agrees" if self.agrees else "DISAGREES"
        miss = f", misses ±{CONSERVATION_TARGET:.1%}" if self.within_target is False else ""
        return (f"energy audit {who}: counter {self.counter_j:.1f} J over {self.end_s - self.start_s:.1f} s vs "
                f"{self.queries} queries {self.queries_j:.1f} J + idle between {self.idle_between_j or 0.0:.1f} J: "
                f"difference {self.difference_j:+.1f} J ({rel:+.2%}{miss}), {verdict} within ±{self.uncertainty_j:.1f} J (90%)"
                + (f"; {self.note}" if self.note else ""))


def gaps(windows: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``[min start, max end]`` outside every window (windows may overlap), in time order."""
    out: list[tuple[float, float]] = []
    reach = None
    for a, b in sorted(windows):
        if reach is not None and a > reach:
            out.append((reach, a))
        reach = b if reach is None else max(reach, b)
    return out


def audit(component: str, windows: Sequence[tuple[float, float]], energy_j: Sequence[float | None],
          energy_sd_j: Sequence[tuple[float, float]], idle_between_j: float | None,
          idle_sd_j: tuple[float, float], counter_j: float | None, counter_sd_j: float,
          no_counter_why: str = "") -> EnergyAudit:
    """The balance of one component over its queries (pure).  ``energy_sd_j`` and ``idle_sd_j`` are
    (independent, shared) 1-sd errors per query and of the gaps together; ``counter_sd_j`` the counter's
    own 1 sd over the span."""
    if not windows:
        return EnergyAudit(component, math.nan, math.nan, 0, 0, 0.0, None, None, None, None, "no queries")
    start, end = min(a for a, _ in windows), max(b for _, b in windows)
    known = [(e, sd) for e, sd in zip(energy_j, energy_sd_j) if e is not None and math.isfinite(e)]
    queries_j = float(sum(e for e, _ in known))
    missing = len(windows) - len(known)
    var = sum(sd[0] ** 2 for _, sd in known) + idle_sd_j[0] ** 2 + counter_sd_j ** 2
    shared = sum(sd[1] for _, sd in known) + idle_sd_j[1]
    unc = Z90 * math.sqrt(var + shared ** 2)
    notes = [f"{missing} queries without {component} energy"] if missing else []
    diff = None
    if counter_j is not None and idle_between_j is not None:
        diff = counter_j - queries_j - idle_between_j
    elif counter_j is None:
        notes.append("no counter over the span" + (f" ({no_counter_why})" if no_counter_why else ""))
    else:
        notes.append("idle between queries unknown")
    return EnergyAudit(component, float(start), float(end), len(known), missing, queries_j, idle_between_j,
                       counter_j, diff, unc, "; ".join(notes))


def _part_sd(part: dict[str, Any]) -> tuple[float, float]:
    return measurement_sd([part])


def levels(records: Sequence[dict[str, Any]]) -> list[tuple[int | None, list[dict[str, Any]]]]:
    """``records`` by concurrency level (their ``concurrency``; None where a record does not say), in the
    order the levels first ran."""
    groups: dict[int | None, list[dict[str, Any]]] = {}
    for r in sorted(records, key=lambda r: float(r["start_s"])):
        c = r.get("concurrency")
        groups.setdefault(None if c is None else int(c), []).append(r)
    return list(groups.items())


def run_audit(sensors: Sequence[Any], records: Sequence[dict[str, Any]], scope: str = "") -> list[EnergyAudit]:
    """The audit of every GPU an NVML sensor measured, over ``records`` (dicts with start_s, end_s and
    energy_parts, as records.jsonl holds them): one per GPU, or one per GPU and concurrency level when the
    records have more than one (``levels``).  Sensors without a counter are skipped.  ``scope``: what the
    lines name beside the GPU (the proxy's "in session 2")."""
    out = []
    from ipw.telemetry.nvml import NvmlSensor

    nvml = [s for s in sensors if isinstance(s, NvmlSensor)]  # the NVML sampler: a counter beside the samples
    if not nvml or not records:
        return []
    end_all = max(float(r["end_s"]) for r in records)
    for sensor in nvml:
        _counter_past(sensor.sampler, end_all)
    groups = levels(records)
    for level, group in groups:
        named = "" if len(groups) < 2 else f"at {level} in flight" if level is not None else "at no level recorded"
        where = " ".join(x for x in (scope, named) if x)
        out += [replace(a, concurrency=level, scope=where) for a in _audit_records(nvml, group)]
    return out


def _audit_records(sensors: Sequence[Any], records: Sequence[dict[str, Any]]) -> list[EnergyAudit]:
    """``run_audit`` over one group of records: their span, their queries and the gaps between them."""
    out = []
    windows = [(float(r["start_s"]), float(r["end_s"])) for r in records]
    parts = [json.loads(r["energy_parts"]) if isinstance(r.get("energy_parts"), str) else (r.get("energy_parts") or [])
             for r in records]
    for sensor in sensors:
        sampler = sensor.sampler
        start_s, end_s = min(a for a, _ in windows), max(b for _, b in windows)
        between = gaps(windows)
        gap_est = sensor.energy_windows(between) if between else {}
        for component in sampler.components():
            mine = [next((p for p in ps if p.get("component") == component), None) for ps in parts]
            # a record's window is its sensors' window: the runner takes its start and end from the window's
            # edges (``Window.begin(t_s)``), so the readings, the span and the gaps share one time line
            energy = [None if p is None else p.get("energy_j") for p in mine]
            sds = [(0.0, 0.0) if p is None else _part_sd(p) for p in mine]
            ests = gap_est.get(component, [])
            idle = None
            idle_sd = (0.0, 0.0)
            if not between:
                idle = 0.0
            elif ests and all(e.energy_j is not None for e in ests):
                idle = float(sum(e.energy_j or 0.0 for e in ests))  # (none is None)
                per = [measurement_sd([{"energy_j": e.energy_j, "uncertainty_j": e.uncertainty_j, "source": e.source,
                                        "quality": e.quality, "calibration_sd_j": e.calibration_sd_j}]) for e in ests]
                idle_sd = (math.sqrt(sum(a * a for a, _ in per)), sum(b for _, b in per))
            counter_j, counter_sd = counter_over(sampler, component, start_s, end_s)
            why = "" if counter_j is not None else reads_around(sampler, component, start_s, end_s)
            out.append(audit(component, windows, energy, sds, idle, idle_sd, counter_j, counter_sd, why))
    return out


def audit_dicts(sensors: Sequence[Any], records: Sequence[dict[str, Any]], since_s: float,
                scope: str = "") -> list[dict[str, Any]]:
    """``run_audit`` over the records that started at or after ``since_s`` (this session's: a resumed run's
    earlier records predate the counter this sampler read), as the manifest keeps it: each field, whether
    it ``agrees`` within its uncertainty and is ``within_target`` (±0.3%), and its ``line``.  Never raises:
    a failure is one entry with ``error``."""
    try:
        mine = [r for r in records if r.get("start_s") is not None and float(r["start_s"]) >= since_s]
        return [{**a.__dict__, "agrees": a.agrees, "within_target": a.within_target, "line": a.line()}
                for a in run_audit(sensors, mine, scope)]
    except Exception as exc:  # the audit never costs a run
        return [{"error": f"{type(exc).__name__}: {exc}"}]


def flagged_lines(name: str, audits: Sequence[dict[str, Any]] | None) -> list[str]:
    """``"name: line"`` for each of ``audits`` (``audit_dicts``' entries, of a backend or a proxy session)
    that disagrees beyond its stated uncertainty or misses the ±0.3% target, and one line for an audit that
    could not run; nothing when all agree within the target."""
    out = []
    for a in audits or []:
        if "error" in a:
            out.append(f"energy audit {name}: could not run ({a['error']})")
        elif a.get("agrees") is False or a.get("within_target") is False:
            out.append(f"{name}: {a.get('line')}")
    return out


def audit_lines(manifest: Any) -> list[str]:
    """What ``ipw run`` prints at its end (``flagged_lines``) over a run's manifest: each backend's audit
    (``backends[].energy_audit``) and each proxy session's (``backends[].sessions[].energy_audit``)."""
    out = []
    for b in manifest.entries():
        out += flagged_lines(b.name, b.energy_audit)
        for s in b.sessions or ():
            out += flagged_lines(b.name, s.get("energy_audit"))
    return out


#: The counter is read once more this long after the last query ends (its next update, 100 ms on the
#: H200, then falls inside the reads: the span's end is between two of them).  When that read and the
#: samples up to it do not come within ``COUNTER_PAST_ATTEMPT_S``, or do not show a change of the counter
#: past the end, it is read again ``COUNTER_PAST_S`` later, for at most ``COUNTER_PAST_TIMEOUT_S``.
COUNTER_PAST_S = 0.15
COUNTER_PAST_ATTEMPT_S = 0.5
COUNTER_PAST_TIMEOUT_S = 2.0
#: The reads looked at for that: those of the last seconds before the end (a run's whole history would
#: cost more the longer it ran; the counter is read at least every 2 s).
COUNTER_PAST_LOOKBACK_S = 10.0


def _counter_past(sampler: Any, end_s: float, timeout_s: float = COUNTER_PAST_TIMEOUT_S) -> None:
    """Have a threaded sampler read the counter past ``end_s`` (it reads it only every 0.25-0.6 s
    otherwise) and poll its samples up to that read, until every GPU whose counter it reads shows a change
    past the end (``_past_the_end``), at most ``timeout_s``.  One read ``COUNTER_PAST_S`` after the end was
    not always enough: on the H200 (2026-12-02) 2 of 3 runs still said "no counter over the span".  A
    sampler that has stopped, or an unthreaded one (tests drive it), is left alone."""
    import time

    if sampler._thread is None or not sampler.alive:
        return
    clock = sampler._clock
    waiting = [c for c in sampler.components()
               if sampler.arrays(c, end_s - COUNTER_PAST_LOOKBACK_S)["counter_t_s"].size]  # its counter works
    deadline = time.monotonic() + timeout_s
    target = end_s + COUNTER_PAST_S
    while waiting and time.monotonic() < deadline and sampler.alive:
        now = clock() / 1e9
        if now < target:
            time.sleep(target - now)
        target = max(target, clock() / 1e9)
        sampler.mark(target, counter=True)
        attempt_end = min(deadline, time.monotonic() + COUNTER_PAST_ATTEMPT_S)
        while time.monotonic() < attempt_end and not (  # the read, and the samples up to it
                any(sampler.arrays(c, target)["counter_t_s"].size for c in waiting)
                and sampler.settled_until() >= target):
            time.sleep(0.02)
        waiting = [c for c in waiting if not _past_the_end(sampler, c, end_s)]
        target = clock() / 1e9 + COUNTER_PAST_S


def _past_the_end(sampler: Any, component: str, end_s: float) -> bool:
    """Whether a change of the counter is known to lie past ``end_s`` and the samples reach it: a read at
    least one update (``COUNTER_STEP_S``) after the end shows more than the last read before it (the
    value it shows was reached at an update after the end), and the samples go as far as that change
    placed half a step before the read (``hold_counter_reads``; the span's check allows 1% less)."""
    from ipw.telemetry.nvml_estimate import COUNTER_STEP_S

    a = sampler.arrays(component, end_s - COUNTER_PAST_LOOKBACK_S)
    ct, cj, st = a["counter_t_s"], a["counter_j"], a["samples_t_s"]
    before = cj[ct <= end_s]
    if not before.size or not st.size:
        return False
    past = ct[(ct >= end_s + COUNTER_STEP_S) & (cj > before[-1])]
    return bool(past.size) and float(st[-1]) - sampler.sample_shift_s >= float(past[0]) - COUNTER_STEP_S / 2


def reads_around(sampler: Any, component: str, start_s: float, end_s: float) -> str:
    """Why the counter does not enclose a span, in a few words: the sampler's first and last counter
    read and its last sample, relative to the span's start and end."""
    a = sampler.arrays(component)
    ct, st = a["counter_t_s"], a["samples_t_s"]
    if ct.size < 2:
        return f"{ct.size} counter reads"
    last_sample = f"{st[-1] - end_s:+.2f} s" if st.size else "none"
    return (f"counter reads from {ct[0] - start_s:+.2f} s of its start to {ct[-1] - end_s:+.2f} s of its end, "
            f"samples to {last_sample}")


def counter_span_j(counter_t_s: np.ndarray, counter_j: np.ndarray, samples_t_s: np.ndarray, samples_w: np.ndarray,
                   start_s: float, end_s: float, *, sample_shift_s: float = 0.0,
                   first_knot: tuple[float, float] | None = None) -> float | None:
    """The counter's energy over ``[start_s, end_s]`` (pure): its exact increment between the last change
    at or before ``start_s`` and the first at or after ``end_s``, less the samples' share (scaled to that
    increment) of the parts outside the span.  Linear interpolation between changes 0.5 s apart instead
    put the span 0.4% low on the H200 (a run ends, and begins, at a change of load: idle after the last
    query).  None when the changes do not enclose the span, the counter went backwards inside, or the
    samples do not cover it.  ``first_knot``: (time, value) of the first read, placed where its value
    was reached (a change point needs a read before it: a run that starts right after the sampler has
    only one read before its first query)."""
    from ipw.telemetry.integrals import MAX_SAMPLE_GAP_S, PowerIntegral, counter_change_points

    kt, kj = counter_change_points(counter_t_s, counter_j)
    if first_knot is not None and (kt.size == 0 or first_knot[0] < kt[0]):
        kt, kj = np.concatenate(([first_knot[0]], kt)), np.concatenate(([first_knot[1]], kj))
    if kt.size < 2 or kt[0] > start_s or kt[-1] < end_s:
        return None
    a = int(np.searchsorted(kt, start_s, side="right") - 1)
    b = int(np.searchsorted(kt, end_s, side="left"))
    if np.any(np.diff(kj[a:b + 1]) < 0):
        return None
    si = PowerIntegral(np.asarray(samples_t_s, dtype=np.float64) - sample_shift_s, samples_w, MAX_SAMPLE_GAP_S)
    (s_a, s_lo, s_hi, s_b), cov = si.at(np.array([kt[a], start_s, end_s, kt[b]]))
    if si.empty or cov[3] - cov[0] < 0.99 * (kt[b] - kt[a]) or s_b <= s_a:
        return None
    inc = float(kj[b] - kj[a])
    r = inc / (s_b - s_a)
    return float(inc - r * (s_lo - s_a) - r * (s_b - s_hi))


def counter_over(sampler: Any, component: str, start_s: float, end_s: float) -> tuple[float | None, float]:
    """The counter's energy over ``[start_s, end_s]`` from an NVML sampler's reads (placed on the update
    grid when found, else held; ``counter_span_j``), and its 1 sd: each end's placement in time at the
    power there.  The first read counts as a knot too: on the grid at its update, held half a step
    before it (as ``hold_counter_reads`` places every change)."""
    from ipw.telemetry.energy_counter import COUNTER_TIME_SD_GRID_S, COUNTER_TIME_SD_HELD_S, grid_counter_reads
    from ipw.telemetry.nvml_estimate import COUNTER_STEP_S, hold_counter_reads

    a = sampler.arrays(component)
    ct, cj, st, sw = a["counter_t_s"], a["counter_j"], a["samples_t_s"], a["samples_w"]
    if ct.size < 2:
        return None, 0.0
    grid = grid_counter_reads(ct, cj, st, sw, sample_shift_s=sampler.sample_shift_s)
    t, j = (grid.t_s, grid.j) if grid is not None else hold_counter_reads(ct, cj)
    first = (float(t[0]), float(j[0])) if grid is not None else (float(ct[0]) - COUNTER_STEP_S / 2, float(cj[0]))
    energy = counter_span_j(t, j, st, sw, start_s, end_s, sample_shift_s=sampler.sample_shift_s, first_knot=first)
    if energy is None:
        return None, 0.0
    tsd = COUNTER_TIME_SD_GRID_S if grid is not None else COUNTER_TIME_SD_HELD_S
    p = np.interp([start_s, end_s], st, sw) if st.size else np.zeros(2)
    return float(energy), float(tsd * math.hypot(*p))
