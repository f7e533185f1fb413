"""The grid's carbon intensity (gCO2e per kWh) a run's energy is priced at (issue 45, item 1).

A run carries an intensity only when it is asked to, from one of three sources, and the manifest records
its value, source, zone and date (``manifest.carbon``, :meth:`CarbonIntensity.to_dict`):

- ``--carbon-intensity G``: a number the user gives (source ``given``);
- ``--grid-region ZONE``: an offline table shipped in the package, CodeCarbon's data (MIT license;
  ``ipw/data/CARBON-DATA.md``): a country by its ISO 3166 code (``DE`` or ``DEU``: the country's yearly
  energy mix, ``carbon-global-energy-mix.json``) or a cloud region (``gcp:europe-west3``:
  ``carbon-cloud-impact.csv``); an unknown zone is an IpwError (one line, exit 2) before any folder;
- ``--grid-region ZONE --grid-live``: Electricity Maps' latest intensity for the zone, the key read from
  ``ELECTRICITYMAPS_API_KEY`` (the address from ``IPW_ELECTRICITYMAPS_URL``, default the public API: the
  tests point it at a local stub).  A feed that cannot be reached gives one note, and the run carries no
  intensity: none is made up, and no table value stands in for it.

There is no default: a run without an intensity shows no carbon (``ipw compare --carbon-intensity`` or
``--grid-region`` prices old runs, labelled as such).
"""

from __future__ import annotations

import csv
import json
import os
import time
import urllib.parse
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ipw.errors import IpwError
from ipw.limits import MAX_G_PER_KWH, check_range
from ipw.inputs.resources import resource_path

J_PER_KWH = 3.6e6
CODECARBON = "CodeCarbon 3.3.2"
MIX_FILE = "carbon-global-energy-mix.json"
CLOUD_FILE = "carbon-cloud-impact.csv"
ISO_FILE = "iso3166-alpha2-to-alpha3.json"
FEED_KEY_ENV = "ELECTRICITYMAPS_API_KEY"
FEED_URL_ENV = "IPW_ELECTRICITYMAPS_URL"
FEED_URL = "https://api.electricitymap.org/v3"
FEED_TIMEOUT_S = 10.0  # the whole request (a feed that trickles is cut there)
#: the most characters kept of a text a feed or a manifest gives (a zone, a date, an emission factor type)
MAX_TEXT_CHARS = 200


def bounded(value: Any) -> str:
    """A text from outside (a feed's field, a manifest's) as it is stored: at most MAX_TEXT_CHARS characters
    ("" for none); shown through :func:`ipw.sanitize.one_line` like every such text."""
    return str(value)[:MAX_TEXT_CHARS] if value else ""


@dataclass(frozen=True)
class CarbonIntensity:
    g_per_kwh: float
    source: str  # given | a table (named with its origin) | electricitymaps
    zone: str  # the region asked for ("" when given as a number)
    date: str  # what the value describes: the table's year, the feed's hour, or the day it was given
    detail: str = ""  # e.g. the country's name, the feed's emission factor type

    def to_dict(self) -> dict[str, Any]:
        return {"g_per_kwh": self.g_per_kwh, "source": self.source, "zone": self.zone, "date": self.date,
                "detail": self.detail}

    @classmethod
    def from_dict(cls, data: Any) -> "CarbonIntensity | None":
        """A manifest's ``carbon``, or None where the run carries none (absent, or a feed that failed)."""
        if not isinstance(data, dict) or not isinstance(data.get("g_per_kwh"), (int, float)):
            return None
        return cls(float(data["g_per_kwh"]), bounded(data.get("source")), bounded(data.get("zone")),
                   bounded(data.get("date")), bounded(data.get("detail")))

    def label(self) -> str:
        """One line: value, zone, source, date."""
        where = f"{self.zone}, " if self.zone else ""
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.g_per_kwh:g} gCO2e/kWh ({where}{self.source}{detail}, {self.date})"


def check_intensity(value: float, where: str) -> float:
    """A carbon intensity in gCO2e/kWh: finite, 0..MAX_G_PER_KWH, else an IpwError at ``where``."""
    check_range(value, where, low=0.0, high=MAX_G_PER_KWH)
    return float(value)


@lru_cache(maxsize=1)
def _mix() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(resource_path("data", MIX_FILE).read_text(encoding="utf-8"))
    return data


@lru_cache(maxsize=1)
def _alpha3() -> dict[str, str]:
    data: dict[str, str] = json.loads(resource_path("data", ISO_FILE).read_text(encoding="utf-8"))
    return data


@lru_cache(maxsize=1)
def _cloud() -> dict[str, dict[str, str]]:
    text = resource_path("data", CLOUD_FILE).read_text(encoding="utf-8-sig")
    return {f"{row['provider']}:{row['region']}".lower(): row for row in csv.DictReader(text.splitlines())}


def check_zone(region: str) -> str:
    """A ``--grid-region`` as given, stripped; an IpwError when nothing is left: an empty zone is never read
    as no region."""
    zone = region.strip()
    if not zone:
        raise IpwError(f"--grid-region {region!r}: empty; give a zone (an ISO 3166 country code such as DE, a cloud "
                       "region such as gcp:europe-west3) or leave the option out")
    return zone


def lookup(region: str) -> CarbonIntensity:
    """``region``'s intensity from the offline tables: a country (ISO 3166 alpha-2 or alpha-3 code) or a
    cloud region ``PROVIDER:REGION``; an IpwError for a zone the tables do not have."""
    zone = check_zone(region)
    if ":" in zone:
        row = _cloud().get(zone.lower())
        if row is None:
            providers = sorted({k.split(":")[0] for k in _cloud()})
            raise IpwError(f"--grid-region {region!r}: no such cloud region in the offline table ({CODECARBON}'s "
                           f"cloud/impact.csv has {len(_cloud())} regions of {', '.join(providers)}, e.g. "
                           f"gcp:europe-west3); give a country code (DE) or --carbon-intensity G")
        return CarbonIntensity(float(row["impact"]), f"{CODECARBON} cloud/impact.csv", zone.lower(),
                               "as published by the provider", f"{row['country_name']}, {row['city']}; {row['source']}")
    code = zone.upper()
    code3 = _alpha3().get(code, code) if len(code) == 2 else code
    entry = _mix().get(code3)
    if entry is None or not isinstance(entry.get("carbon_intensity"), (int, float)):
        raise IpwError(f"--grid-region {region!r}: unknown region (give an ISO 3166 country code such as DE or FR, "
                       f"one of the {len(_mix())} in {CODECARBON}'s global_energy_mix.json, or a cloud region "
                       "such as gcp:europe-west3)")
    return CarbonIntensity(float(entry["carbon_intensity"]), f"{CODECARBON} global_energy_mix.json", code,
                           f"year {entry.get('year')}", f"{entry.get('country_name') or code3}; Our World in Data / Ember")


def feed_key() -> str:
    """Electricity Maps' key from the environment (registered as a secret); an IpwError when it is unset or
    holds a character an HTTP header cannot carry (the value never shown)."""
    from ipw.sanitize import read_key

    if not os.environ.get(FEED_KEY_ENV, "").strip():
        raise IpwError(f"--grid-live: set {FEED_KEY_ENV} to an Electricity Maps API key (or drop --grid-live for "
                       "the offline table)")
    # checked as every API key is: a CR LF in it would be printed in http.client's error, and sent as a header
    return read_key(FEED_KEY_ENV, "", where=f"--grid-live: the environment variable {FEED_KEY_ENV}")


def feed_url() -> str:
    """Electricity Maps' API address (``IPW_ELECTRICITYMAPS_URL``: a stub's in the tests)."""
    return (os.environ.get(FEED_URL_ENV) or FEED_URL).rstrip("/")


class FeedUnavailable(Exception):
    """The live feed could not give an intensity (unreachable, refused, an answer without one)."""


def live(zone: str, key: str, *, timeout_s: float = FEED_TIMEOUT_S) -> CarbonIntensity:
    """Electricity Maps' latest carbon intensity of ``zone``; FeedUnavailable when there is none to be had."""
    from ipw import outside

    base = feed_url()
    url = f"{base}/carbon-intensity/latest?{urllib.parse.urlencode({'zone': zone})}"
    try:
        body = json.loads(outside.get(url, {"auth-token": key, "Accept": "application/json"}, timeout_s=timeout_s,
                                      limit=1 << 20))
    except outside.OutsideError as exc:
        raise FeedUnavailable(f"{base} answered {exc}" if exc.status is not None and exc.status not in outside.REDIRECTS
                              else f"{base} could not be reached ({exc})") from None
    except ValueError:
        raise FeedUnavailable(f"{base} answered with no JSON") from None
    value = body.get("carbonIntensity") if isinstance(body, dict) else None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= MAX_G_PER_KWH:
        raise FeedUnavailable(f"{base} gave no usable carbonIntensity for zone {zone!r}")
    factor = bounded(body.get("emissionFactorType"))
    detail = ", ".join(x for x in (f"{factor} emission factors" if factor else "",
                                   "estimated by Electricity Maps" if body.get("isEstimated") else "") if x)
    return CarbonIntensity(float(value), "electricitymaps (live)", bounded(body.get("zone")) or bounded(zone),
                           bounded(body.get("datetime")) or time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), detail)


def check_request(carbon_intensity: float | None, grid_region: str | None, grid_live: bool) -> None:
    """The carbon options of a run, checked before anything runs (one line, exit 2): one source at most, a
    sane number, a zone the offline table knows (without --grid-live), a feed key (with it)."""
    if carbon_intensity is not None and grid_region is not None:
        raise IpwError("--carbon-intensity and --grid-region: give one of them")
    if grid_region is not None:
        check_zone(grid_region)
    if grid_live and not grid_region:
        raise IpwError("--grid-live: needs --grid-region ZONE (an Electricity Maps zone such as DE or US-CAL-CISO)")
    if carbon_intensity is not None:
        check_intensity(carbon_intensity, "--carbon-intensity")
    elif grid_region and grid_live:
        feed_key()
        if not feed_url().startswith(("http://", "https://")):
            raise IpwError(f"{FEED_URL_ENV}={feed_url()!r}: must be an http:// or https:// address")
    elif grid_region:
        lookup(grid_region)


def resolve(carbon_intensity: float | None, grid_region: str | None, grid_live: bool = False,
            ) -> tuple[dict[str, Any] | None, str | None]:
    """What the manifest records as ``carbon`` and a note to print: (None, None) when no intensity was asked
    for; a feed that fails gives ``{"g_per_kwh": None, ...}`` with the reason, and the note."""
    check_request(carbon_intensity, grid_region, grid_live)
    if carbon_intensity is not None:
        return CarbonIntensity(float(carbon_intensity), "given (--carbon-intensity)", "",
                               time.strftime("%Y-%m-%d", time.gmtime())).to_dict(), None
    if not grid_region:
        return None, None
    if not grid_live:
        return lookup(grid_region).to_dict(), None
    try:
        return live(grid_region, feed_key()).to_dict(), None
    except FeedUnavailable as exc:
        from ipw.sanitize import one_line

        why = one_line(str(exc))
        return ({"g_per_kwh": None, "source": "electricitymaps (live)", "zone": grid_region, "error": why},
                f"carbon: the grid feed is unavailable ({why}); this run carries no carbon intensity")
