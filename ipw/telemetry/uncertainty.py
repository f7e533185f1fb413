"""What a reading's ``uncertainty_j`` means for a sum of readings (issue 27), defined once for the
bootstrap (``ipw.analysis.stats``) and the run-level audit (``ipw.telemetry.audit``).

A reading's ``uncertainty_j`` is a ±90% half-width of its energy.  Its error is split into a part that is
independent from window to window (where the edges fall, how the load varied) and a part that every
reading of one source shares (one calibration ratio, one per-core power model), because a sum over many
windows shrinks the first (in quadrature) and not the second (linearly).  The shared part is kept by its
source (``measurement_by_source``), so that the bootstrap draws it once for every reading made through that
source, and a ratio of two sums made through it (a saving, a change) does not depend on it.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

from ipw.telemetry.base import CONTAINING_SCOPES
from ipw.telemetry.base import Z90 as Z90  # where it was defined first: importers keep it
from ipw.telemetry.cpu_model import MODEL_UNCERTAINTY_REL
from ipw.telemetry.error_model import DEFAULT_ERROR_MODEL
from ipw.telemetry.estimator import UNCALIBRATED_REL_SD

#: Share of an NVML sampled reading's energy whose error is shared by every window of a run (1 sd): the
#: calibration ratio's floor (``ipw.telemetry.error_model.ErrorModel.calibration_floor``).
NVML_SHARED_REL = DEFAULT_ERROR_MODEL.calibration_floor


def measurement_90(energy_j: float | None, energy_parts: str | Sequence[dict[str, Any]] | None) -> float | None:
    """The ±90% (J) of a record's energy that its readings state (independent and shared parts together), or
    None where the record has no energy or no reading states its error (``ipw serve``'s answers, its spans)."""
    parts = json.loads(energy_parts) if isinstance(energy_parts, str) else (energy_parts or [])
    if energy_j is None or not any(p.get("uncertainty_j") is not None for p in parts):
        return None
    independent, shared = measurement_sd(parts)
    return round(float(Z90 * (independent ** 2 + shared ** 2) ** 0.5), 6)


def measurement_sd(energy_parts: str | Sequence[dict[str, Any]] | None) -> tuple[float, float]:
    """``(independent, shared)`` 1-sd error (J) of a record's total energy from its readings
    (``energy_parts``: the JSON a record stores, or the list of reading dicts): :func:`measurement_by_source`
    with its shared parts added up."""
    independent, shared = measurement_by_source(energy_parts)
    return independent, sum(shared.values())


#: Where a reading's shared error comes from (``measurement_by_source``): ``MACHINE``, the machine's (one
#: device's bias, one per-core power model: every backend and run on that machine shares it), or
#: ``SESSION``, one sensor session's (a calibration ratio formed over that session's own span: the sensors
#: are opened per backend, ``ipw.running.runner``, so a backend's concurrency levels share it and nothing else does).
MACHINE, SESSION = "machine", "session"
CPU_MODEL_SOURCE = "model.cpu"
#: The CPU model's shared error, 1 sd relative, at least: its coefficient's band (``MODEL_UNCERTAINTY_REL``,
#: ±90%), the same factor for every joule it estimates on the machine, even where a reading states less (a
#: share of a period in a record written before the split added the model's part linearly, ``calibration_sd_j``).
CPU_MODEL_SHARED_REL = MODEL_UNCERTAINTY_REL / Z90


def measurement_by_source(energy_parts: str | Sequence[dict[str, Any]] | None,
                          ) -> tuple[float, dict[tuple[str, str], float]]:
    """``(independent, {(scope, source): shared})``: the 1-sd error (J) of a record's total energy from its
    readings, the shared part by where it comes from (``scope`` ``MACHINE`` or ``SESSION``; ``source`` the
    reading's ``source:component``, or ``model.cpu`` for the CPU model, whose one coefficient serves every
    process of the machine).  Readings with the same key have the same error, whichever backend or query.

    A reading's ``uncertainty_j`` (±90%) is ``Z90`` sd.  Estimated readings (``quality`` estimated: the CPU
    model, an API estimate) are shared whole: their error is the model's, the same for every query.  The CPU
    model's is the machine's (one W/core for every process on it: the ratio of two backends' joules does not
    depend on it), at least ``CPU_MODEL_SHARED_REL`` of the energy even where a reading states less (a share
    of a period in an older record, whose split added the model's part in quadrature); an API estimate's (a
    table per remote model) is its session's.  A
    reading that states its calibration's part (``calibration_sd_j``: NVML's sampled power) shares that
    part with its session: the ratio's error over a short calibration span (sparse counter reads early in a
    run: ~4% over 1 s) is the same for every window it scales, and counted as independent it shrank in a
    run's sum (the energy audit then saw a disagreement that the readings' own intervals explain).  Older
    power readings that no counter calibrated (the note says ``uncalibrated``: a platform without a
    counter, a counter distrusted) share ``UNCALIBRATED_REL_SD`` of their energy: the device's own bias,
    the machine's; NVML sampled readings that state no calibration part share ``NVML_SHARED_REL`` (the
    calibration) with their session; the rest of each is independent.  Other readings are independent.
    Independent parts add in quadrature, shared ones linearly.  Readings without ``uncertainty_j`` (records
    made before it was stated) add nothing: (0, {}); nor do readings of a scope that the total leaves out
    (the node's BMC)."""
    if not energy_parts:
        return 0.0, {}
    parts = json.loads(energy_parts) if isinstance(energy_parts, str) else energy_parts
    var = 0.0
    shared: dict[tuple[str, str], float] = {}
    for p in parts:
        u, e = p.get("uncertainty_j"), p.get("energy_j")
        if u is None or e is None or not math.isfinite(u) or p.get("scope") in CONTAINING_SCOPES:
            continue  # a node reading is not in the total (telemetry.base.CONTAINING_SCOPES): nor its error
        sd = abs(u) / Z90
        source = str(p.get("source", ""))
        device = f"{source}:{p.get('component', '')}"
        uncalibrated = "uncalibrated" in str(p.get("note", ""))
        if p.get("quality") == "estimated" and source == CPU_MODEL_SOURCE:
            key, s = (MACHINE, CPU_MODEL_SOURCE), max(sd, CPU_MODEL_SHARED_REL * abs(e))
        elif p.get("quality") == "estimated":
            key, s = (SESSION, device), sd
        elif p.get("calibration_sd_j") is not None and math.isfinite(p["calibration_sd_j"]):
            key, s = (SESSION, device), min(sd, abs(p["calibration_sd_j"]))
        elif uncalibrated or source.startswith("nvml.samples"):
            rel = UNCALIBRATED_REL_SD if uncalibrated else NVML_SHARED_REL
            key, s = (MACHINE if uncalibrated else SESSION, device), min(sd, rel * abs(e))
        else:
            var += sd * sd
            continue
        shared[key] = shared.get(key, 0.0) + s
        var += max(sd * sd - s * s, 0.0)
    return math.sqrt(var), shared
