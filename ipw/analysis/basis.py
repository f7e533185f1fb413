"""Which joules are compared (``--energy-basis``) and what carbon they are priced at (issue 45, items 1, 2).

- ``chip``: the energy ipw measures or estimates at the chip (GPU, CPU package, DRAM: the records' ``energy_j``);
- ``facility``: chip energy x the backend's PUE (its config's ``pue``, 1.0 unless set, with ``pue_source``):
  the datacenter's cooling and power conversion, which a laptop does not pay and a hosted API does;
- ``node``: the whole machine's energy from its BMC (records' readings of scope ``node``,
  ``ipw.telemetry.node_power``); a backend whose records have none has no energy on this basis (said so).

The basis changes the per-query energy once, here, before any metric: J/query, IPJ, IPW, the phases, the
routing's savings and the carbon all follow it.  Carbon: each backend's run carries an intensity (its
manifest's ``carbon``) or none; ``--carbon-intensity`` / ``--grid-region`` re-price every run, labelled.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from ipw.analysis.load import BackendInfo, PerQuery, RunInfo
from ipw.carbon import CarbonIntensity, lookup
from ipw.errors import ParameterError
from ipw.limits import MAX_G_PER_KWH, MAX_PUE, out_of_range

BASES = ("chip", "facility", "node")
ROLES = ("local", "cloud")
BASIS_TEXT = {"chip": "chip (measured or estimated at the chip)",
              "facility": "facility (chip x each backend's PUE)",
              "node": "node (the whole machine, from its BMC)"}
API_SOURCE = "estimate.api"  # a remote API's estimate (ipw.telemetry.api_estimate)


def check_basis(basis: str) -> str:
    if basis not in BASES:
        raise ParameterError(("energy_basis",), f" {basis!r}: must be one of {', '.join(BASES)}")
    return basis


def parse_pue(text: str) -> tuple[str, float]:
    """``NAME=PUE`` (an item of ``pue``): a backend or a role (local, cloud) and its PUE (1-5)."""
    name, eq, value = text.partition("=")
    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not eq or not name:
        raise ParameterError(("pue",), f" {text!r}: expected NAME=PUE (a backend or a role, local or cloud), e.g. "
                             "cloud=1.2")
    if problem := out_of_range(x, low=1.0, high=MAX_PUE):
        raise ParameterError(("pue",), f" {text!r}: {problem}")
    return name, x


def with_pue(infos: Sequence[BackendInfo], given: Sequence[tuple[str, float]], resolve: Any) -> tuple[BackendInfo, ...]:
    """``infos`` with the PUEs of ``--pue`` (a role's first, then a backend's: the more specific wins);
    ``resolve(name)``: the labels a backend name means (an IpwError for none)."""
    pue = {i.label: (i.pue, i.pue_source) for i in infos}
    for name, x in sorted(given, key=lambda g: g[0] not in ROLES):
        labels = [i.label for i in infos if i.role == name] if name in ROLES else resolve(name)
        for label in labels:
            pue[label] = (x, f"--pue {name}={x:g}")
    return tuple(dataclasses.replace(i, pue=pue[i.label][0], pue_source=pue[i.label][1]) for i in infos)


def available(pq: PerQuery, infos: Sequence[BackendInfo]) -> tuple[str, ...]:
    """The bases worth showing side by side: chip always; facility where a backend's PUE is not 1; node where
    a record has a node reading."""
    out = ["chip"]
    if any(i.pue != 1.0 for i in infos):
        out.append("facility")
    if pq.node_energy_j is not None and not np.isnan(pq.node_energy_j).all():
        out.append("node")
    return tuple(out)


def under_basis(pq: PerQuery, infos: Sequence[BackendInfo], basis: str) -> tuple[PerQuery, list[str]]:
    """``pq`` with its energies on ``basis`` and notes that say what that took."""
    check_basis(basis)
    if basis == "chip":
        return pq, []
    notes: list[str] = []
    if basis == "facility":
        k = np.array([i.pue for i in infos], dtype=float)[:, None]

        def scaled(x: np.ndarray | None) -> np.ndarray | None:
            return None if x is None else x * k

        stated = ", ".join(f"{i.label} {i.pue:g} ({i.pue_source or 'source not stated'})" for i in infos)
        notes.append(f"energy basis facility: chip energy x PUE ({stated})")
        api = [i.label for i in infos if API_SOURCE in i.energy_sources and i.pue != 1.0]
        if api:
            notes.append(f"{', '.join(api)}: a remote API's estimate, whose published figures already include the "
                         "datacenter's overhead in part (the bundled ipw/data/api-energy.toml says includes_facility = "
                         "partly; the manifest's sensor params say it for the table used): its PUE may count some of it "
                         "twice")
        return dataclasses.replace(pq, energy_j=pq.energy_j * k, prefill_energy_j=scaled(pq.prefill_energy_j),
                                   decode_energy_j=scaled(pq.decode_energy_j), energy_sd_j=scaled(pq.energy_sd_j),
                                   shared_sd_j=None if pq.shared_sd_j is None else
                                   {key: x * k for key, x in pq.shared_sd_j.items()}), notes
    node = pq.node_energy_j if pq.node_energy_j is not None else np.full(pq.energy_j.shape, np.nan)
    missing = [i.label for j, i in enumerate(infos) if np.isnan(node[j]).all()]
    if missing:
        notes.append(f"energy basis node: unavailable for {', '.join(missing)} (no node reading in its records: "
                     "IPW_NODE_POWER names the BMC, docs/PLATFORMS.md)")
    notes.append("energy basis node: the whole machine's energy from its BMC over each query's window; phases and "
                 "measurement errors are the chip's only, so not shown on this basis")
    return dataclasses.replace(pq, energy_j=node, prefill_energy_j=None, decode_energy_j=None, energy_sd_j=None,
                               shared_sd_j=None), notes


def values_under(v: dict[str, Any], info: BackendInfo, basis: str, carbon: Any = None,
                 ) -> tuple[dict[str, Any], list[str]]:
    """One backend's per-query values (``ipw.analysis.load``'s ``_Part.values``: ``ipw check``) on ``basis``,
    with its run's carbon intensity (manifest ``carbon``) as ``carbon_g_per_kwh``; and notes."""
    check_basis(basis)
    out, notes = dict(v), []
    if basis == "facility" and info.pue != 1.0:
        for k in ("energy_j", "prefill_energy_j", "decode_energy_j", "energy_sd_j"):
            out[k] = None if v.get(k) is None else v[k] * info.pue
        if v.get("shared_sd_j") is not None:
            out["shared_sd_j"] = {key: x * info.pue for key, x in v["shared_sd_j"].items()}
        notes.append(f"{info.label}: energy basis facility: chip energy x PUE {info.pue:g} "
                     f"({info.pue_source or 'source not stated'})")
    elif basis == "node":
        node = v.get("node_energy_j")
        out["energy_j"] = node if node is not None else np.full(np.shape(v["energy_j"]), np.nan)
        out.update(prefill_energy_j=None, decode_energy_j=None, energy_sd_j=None, shared_sd_j=None)
        if node is None or np.isnan(node).all():
            notes.append(f"{info.label}: energy basis node: unavailable (no node reading in its records)")
    intensity = CarbonIntensity.from_dict(carbon)
    if intensity is not None:
        out["carbon_g_per_kwh"] = np.full(np.shape(v["energy_j"]), intensity.g_per_kwh)
    return out, notes


def intensities(runs: Sequence[RunInfo], infos: Sequence[BackendInfo], carbon_intensity: float | None = None,
                grid_region: str | None = None) -> tuple[dict[str, CarbonIntensity | None], list[str]]:
    """Each backend's carbon intensity: its run's (manifest ``carbon``), or the one given to re-price every run
    (``--carbon-intensity`` / ``--grid-region``, offline table); notes that say where each comes from."""
    if carbon_intensity is not None and grid_region is not None:
        raise ParameterError(("carbon_intensity", "grid_region"), ": give one of them")
    given = None
    if carbon_intensity is not None:
        if problem := out_of_range(carbon_intensity, low=0.0, high=MAX_G_PER_KWH):  # as ipw.carbon.check_intensity
            raise ParameterError(("carbon_intensity",), f": {problem}")
        given = CarbonIntensity(float(carbon_intensity), "given (--carbon-intensity)", "", "re-priced now")
    elif grid_region is not None:  # '' too: lookup refuses it
        given = lookup(grid_region)
    by_run = {r.run_id: r for r in runs}
    out: dict[str, CarbonIntensity | None] = {}
    notes = []
    for run in runs:
        recorded = CarbonIntensity.from_dict(run.carbon)
        error = (run.carbon or {}).get("error") if isinstance(run.carbon, dict) else None
        if given is not None:
            had = recorded.label() if recorded else "none"
            notes.append(f"carbon: run {run.run_id} re-priced at {given.label()} (it recorded: {had})")
        elif recorded is not None:
            notes.append(f"carbon: run {run.run_id} at {recorded.label()}")
        elif error:
            notes.append(f"carbon: run {run.run_id} carries no carbon intensity (its grid feed: {error})")
    for i in infos:
        out[i.label] = given if given is not None else CarbonIntensity.from_dict(by_run[i.run_id].carbon)
    return out, notes


def carbon_rows(carbon: dict[str, CarbonIntensity | None]) -> np.ndarray | None:
    """The intensity per backend (NaN: none), or None when no backend has one."""
    if all(c is None for c in carbon.values()):
        return None
    return np.array([np.nan if c is None else c.g_per_kwh for c in carbon.values()])
