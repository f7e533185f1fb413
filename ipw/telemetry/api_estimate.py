"""Estimated energy of queries to a remote LLM API, from a cited coefficient table.

A remote endpoint's machines cannot be measured from here, so each query's energy is estimated from
published figures (``ipw/data/api-energy.toml``: per query and per output token, each with low,
central and high values, and the sources with dates).  Every reading is labeled quality
``estimated``, source ``estimate.api``, scope ``datacenter_estimate``; it is only used for endpoints
that are not on this machine, and never added to a measured total (see ``total_energy``).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ipw.errors import IpwError
from ipw.inputs.resources import resource_path
from ipw.telemetry.base import EnergyReading, SensorInfo

DEFAULT_TABLE = resource_path("data", "api-energy.toml")  # shipped in the package
WH_TO_J = 3600.0
METHODS = ("per_output_token", "per_query")
#: whether a table's figures already include the datacenter's overhead (cooling, power conversion: PUE), so
#: that ``--energy-basis facility`` does not count it twice (ipw.analysis.basis)
FACILITY = ("yes", "no", "partly", "not stated")


@dataclass(frozen=True)
class Range:
    low: float
    central: float
    high: float


@dataclass(frozen=True)
class ApiEnergyEstimate:
    method: str
    per_query_wh: Range
    per_output_token_wh: Range
    sources: tuple[dict[str, Any], ...]
    table: str
    includes_facility: str = "not stated"  # one of FACILITY: do the figures include the datacenter's overhead?

    @classmethod
    def load(cls, path: str | Path | None = None) -> "ApiEnergyEstimate":
        target = Path(path) if path else DEFAULT_TABLE
        try:
            raw = tomllib.loads(target.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise IpwError(f"{target}: API energy table not found; give energy_table = \"PATH\" "
                           "(the bundled table is ipw/data/api-energy.toml)") from None
        except tomllib.TOMLDecodeError as exc:
            raise IpwError(f"{target}: invalid TOML: {exc}") from None

        def rng(key: str) -> Range:
            table: Any = raw.get(key)  # None: indexing it raises the TypeError below
            try:
                values = Range(float(table["low"]), float(table["central"]), float(table["high"]))
            except (TypeError, KeyError, ValueError):
                raise IpwError(f"{target}: field '{key}': needs numbers low, central, high") from None
            if not 0 <= values.low <= values.central <= values.high:
                raise IpwError(f"{target}: field '{key}': needs 0 <= low <= central <= high")
            return values

        method = raw.get("method", "per_output_token")
        if method not in METHODS:
            raise IpwError(f"{target}: field 'method': must be one of {', '.join(METHODS)}")
        sources = tuple(raw.get("sources", ()))
        if not sources:
            raise IpwError(f"{target}: field 'sources': every coefficient needs a cited source")
        facility = raw.get("includes_facility", "not stated")
        if facility not in FACILITY:
            raise IpwError(f"{target}: field 'includes_facility': must be one of {', '.join(FACILITY)}")
        return cls(method, rng("per_query_wh"), rng("per_output_token_wh"), sources, str(target), facility)

    def range_j(self, completion_tokens: int, ok: bool) -> Range:
        """Low, central and high joules of one query (0 for a failed query)."""
        if not ok:
            return Range(0.0, 0.0, 0.0)
        if self.method == "per_query":
            r, n = self.per_query_wh, 1
        else:
            r, n = self.per_output_token_wh, completion_tokens
        return Range(r.low * n * WH_TO_J, r.central * n * WH_TO_J, r.high * n * WH_TO_J)

    def reading(self, completion_tokens: int, ok: bool, duration_s: float) -> EnergyReading:
        r = self.range_j(completion_tokens, ok)
        basis = "failed query: not charged" if not ok else (
            f"{completion_tokens} output tokens × {self.per_output_token_wh.central} Wh/token"
            if self.method == "per_output_token" else f"{self.per_query_wh.central} Wh/query")
        return EnergyReading(
            component="remote-api", energy_j=r.central, source="estimate.api", quality="estimated",
            scope="datacenter_estimate", duration_s=duration_s,
            note=f"{basis}; range {r.low:.3g}-{r.high:.3g} J; datacenter overhead included: "
                 f"{self.includes_facility} ({self.table})",
        )

    def info(self) -> SensorInfo:
        return SensorInfo(
            name="api_estimate", available=True, source="estimate.api", quality="estimated",
            scope="datacenter_estimate", components=("remote-api",),
            detail=f"remote endpoint: energy estimated {self.method.replace('_', ' ')} from published "
                   f"figures ({', '.join(str(s.get('key', '?')) for s in self.sources)}), not measured; "
                   f"datacenter overhead (PUE) included: {self.includes_facility}",
            params={"table": self.table, "method": self.method,
                    "per_query_wh": vars(self.per_query_wh),
                    "per_output_token_wh": vars(self.per_output_token_wh),
                    "includes_facility": self.includes_facility,
                    "sources": list(self.sources)},
        )
