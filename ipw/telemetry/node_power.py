"""Whole-node power from the baseboard management controller (BMC): Redfish or IPMI DCMI, scope ``node``.

A GPU server draws more at the wall than its GPUs and CPU packages: fans, memory, NICs, PSU losses.
The BMC measures the node (Kepler, TokenPowerBench and MLPerf Power read it there).  This sensor is
opened only where the user points ipw at a BMC (:func:`node_config`):

    IPW_NODE_POWER=https://bmc.example        Redfish (http:// for a plain-HTTP service, e.g. an emulator)
    IPW_NODE_POWER=ipmi://bmc.example         IPMI DCMI over the LAN (ipmitool -I lanplus)
    IPW_NODE_POWER=ipmi://                    IPMI DCMI in-band, through this machine's /dev/ipmi0
    IPW_BMC_USER, IPW_BMC_PASSWORD            the credentials: from the environment only
    IPW_BMC_VERIFY=0 | /path/ca.pem           TLS: skip verification (self-signed BMCs) or trust this CA
    IPW_BMC_CHASSIS=ID                        which Redfish chassis (default: the first top-level one with power)
    IPW_BMC_PERIOD_S=1                        how often to read (s)

Credentials never reach the run folder: a URL with ``user:password@`` is refused, the password is
registered with :mod:`ipw.sanitize` (scrubbed from every message; its variable is not passed to engine
workers or servers), and the manifest records the URL alone.  A BMC that refuses the credentials, or
a Redfish service without power data, is an IpwError (one line, exit 2) before any run folder exists
(:func:`check_configured`, called by ``ipw run`` while it checks its inputs).

**Redfish** (DMTF DSP0268; read with plain HTTP GETs from the standard library: ipw needs a handful of
properties by path with basic authentication, which is less code than adapting a client library's
object model, and it adds no dependency; ``sushy``, OpenStack's client, pulls in pbr, stevedore and
requests, and its coverage of ``EnvironmentMetrics`` and ``PowerSubsystem`` was not evaluated here).
Per chassis, in order of preference:

- power: ``EnvironmentMetrics.PowerWatts.Reading`` (the chassis' consumption), else the legacy
  ``Power.PowerControl[0].PowerConsumedWatts`` (consumed: input power), else the sum of the power
  supplies' input watts (``PowerSubsystem/PowerSupplies/*/Metrics`` ``InputPowerWatts``, legacy
  ``PowerSupplies[].PowerInputWatts``), else their output watts (``OutputPowerWatts`` /
  ``PowerOutputWatts``: labelled ``output``: PSU conversion losses are then not counted, as in Kepler);
- the cumulative counter: ``EnvironmentMetrics.EnergyJoules.Reading`` or ``EnergykWh.Reading`` (the
  OCP server profile mandates ``EnergykWh``).

Windows are attributed like every polled sensor (:mod:`ipw.telemetry.polled`): the power readings
integrated and scaled by the counter over a long span where both exist (``redfish.power``, with its
calibration ratio: the counter sets the energy, the readings only its shape in time), the counter
alone (``redfish.counter``), or the readings alone (``uncalibrated``).

**IPMI DCMI** ``Get Power Reading`` through ``ipmitool dcmi power reading`` (a subprocess: ipmitool is
what every BMC vendor documents and tests; the password goes through ``IPMI_PASSWORD`` / ``-E``, never on
the command line).  The instantaneous reading is used; DCMI does not say whether it is input or output
power (it is the "platform" power: usually measured at the PSU input), so the reading says ``not stated``.

**Update period.**  A BMC refreshes its readings every second or more, whatever the poll.  The
sensor watches how often the reading actually changes (the median time between changes, once it has
seen three) and uses that as the update period: windows shorter than it are flagged ``short window``
with an uncertainty of one update at the window's power, and each reading's note says the period (or
that it was not yet observed).  ``ipw doctor`` shows it.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import ssl
import subprocess
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ipw.errors import IpwError
from ipw.sanitize import one_line
from ipw.telemetry.base import EnergyReading, SensorInfo
from ipw.telemetry.polled import Channel, Platform, Poll, PolledSensor

ENV_URL = "IPW_NODE_POWER"
ENV_USER = "IPW_BMC_USER"
ENV_PASSWORD = "IPW_BMC_PASSWORD"
ENV_VERIFY = "IPW_BMC_VERIFY"
ENV_CHASSIS = "IPW_BMC_CHASSIS"
ENV_PERIOD = "IPW_BMC_PERIOD_S"
#: default poll period (s): a BMC's readings refresh every second or more, and each read costs it work
DEFAULT_PERIOD_S = 1.0
#: one HTTP request or ipmitool call may take this long (s)
TIMEOUT_S = 5.0
#: the whole discovery of a Redfish service (every GET of it) may take this long (s)
DISCOVER_S = 30.0
#: the update period is the median time between changes of the reading, once this many were seen
MIN_CHANGES = 3
#: the update period is observed over this much recent history (s)
OBSERVE_S = 300.0
#: counter vs power x time: a BMC's sensors are coarser than a GPU's (a kWh counter's last digit)
TOLERANCE = 0.15
#: the most a BMC's power reading may be (W): a whole rack (an NVL72's is about 120 kW) stays below it
MAX_NODE_W = 250_000.0
#: the most its energy counter may read (J): MAX_NODE_W for 100 years is 7.9e14 J
MAX_COUNTER_J = 1e15
#: ``IPW_NODE_POWER`` in a message: how to set it
USAGE = (f"{ENV_URL}=https://BMC (Redfish), ipmi://BMC (IPMI DCMI over the LAN) or ipmi:// (in-band), "
         f"credentials in {ENV_USER} / {ENV_PASSWORD}")


@dataclass(frozen=True)
class NodeConfig:
    """Where the BMC is, from the environment (:func:`node_config`)."""

    kind: str  # "redfish" | "ipmi"
    url: str  # without credentials: what the manifest records
    user: str = field(default="", repr=False)
    password: str = field(default="", repr=False)
    verify: bool | str = True  # False, True or a CA bundle's path
    chassis: str | None = None
    period_s: float = DEFAULT_PERIOD_S


def node_config(env: dict[str, str] | None = None) -> NodeConfig | None:
    """The BMC named by ``IPW_NODE_POWER`` (None when unset); IpwError for a malformed setting."""
    from ipw import sanitize

    env = dict(os.environ) if env is None else env
    raw = env.get(ENV_URL, "").strip()
    if not raw:
        return None
    parts = urllib.parse.urlsplit(raw)
    if parts.username is not None or parts.password is not None:
        raise IpwError(f"{ENV_URL}: put no credentials in the URL; set {ENV_USER} and {ENV_PASSWORD} instead")
    if parts.scheme not in ("http", "https", "ipmi", "redfish"):
        raise IpwError(f"{ENV_URL}={sanitize.redact_url(raw)}: unknown scheme; use {USAGE}")
    if parts.scheme in ("http", "https", "redfish") and not parts.hostname:
        raise IpwError(f"{ENV_URL}={sanitize.redact_url(raw)}: no host; use {USAGE}")
    try:
        period = float(env.get(ENV_PERIOD, DEFAULT_PERIOD_S))
    except ValueError:
        raise IpwError(f"{ENV_PERIOD}={env[ENV_PERIOD]!r}: not a number of seconds") from None
    if not 0.01 <= period <= 60:
        raise IpwError(f"{ENV_PERIOD}={period:g}: must be between 0.01 and 60 s")
    verify_raw = env.get(ENV_VERIFY, "1").strip()
    verify: bool | str = True
    if verify_raw.lower() in ("0", "false", "no"):
        verify = False
    elif verify_raw.lower() not in ("1", "true", "yes", ""):
        if not os.path.isfile(verify_raw):
            raise IpwError(f"{ENV_VERIFY}={verify_raw}: no such CA bundle file (or 0 to skip verification)")
        verify = verify_raw
    user, password = env.get(ENV_USER, ""), env.get(ENV_PASSWORD, "")
    if password:
        sanitize.register(password)
        sanitize.register_env(ENV_PASSWORD)
    if parts.scheme == "ipmi":
        kind, url = "ipmi", f"ipmi://{parts.netloc}"
        if parts.netloc and (not user or not password):
            raise IpwError(f"{ENV_URL}={url}: set {ENV_USER} and {ENV_PASSWORD} (the BMC's IPMI account; "
                           "ipmi:// without a host reads this machine's BMC in-band, without them)")
    else:
        scheme = "https" if parts.scheme == "redfish" else parts.scheme
        kind, url = "redfish", f"{scheme}://{parts.netloc}"
        if not user or not password:
            raise IpwError(f"{ENV_URL}={url}: set {ENV_USER} and {ENV_PASSWORD} (the BMC's Redfish account)")
    return NodeConfig(kind, url, user, password, verify, env.get(ENV_CHASSIS) or None, period)


# --------------------------------------------------------------------------------------------------
# Redfish


class RedfishClient:
    """GETs of one Redfish service with basic authentication (one connection per request: a BMC closes
    idle ones)."""

    def __init__(self, config: NodeConfig) -> None:
        self.base = config.url.rstrip("/")
        token = base64.b64encode(f"{config.user}:{config.password}".encode()).decode()
        self._headers = {"Authorization": f"Basic {token}", "Accept": "application/json",
                         "OData-Version": "4.0"}
        self._context: ssl.SSLContext | None = None
        self.until: float | None = None  # while set (monotonic s): every GET ends by then (discover's deadline)
        if self.base.startswith("https://"):
            if config.verify is False:
                self._context = ssl._create_unverified_context()  # asked for: IPW_BMC_VERIFY=0
            elif isinstance(config.verify, str):
                self._context = ssl.create_default_context(cafile=config.verify)
            else:
                self._context = ssl.create_default_context()

    def get(self, path: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
        """The JSON object at ``path`` (``/redfish/v1/...``), within ``timeout_s`` in all; IpwError in one
        line otherwise.  A redirect is followed on this service only: the credentials never leave it."""
        from ipw import outside

        # a link the BMC gave: a path on this service (never another address), that a request line can carry
        if not path.startswith("/") or any(not 0x21 <= ord(ch) <= 0x7E for ch in path):
            raise IpwError(f"Redfish {self.base}: a link that is not a path on this service "
                           f"({one_line(path)[:200]})")
        late = IpwError(f"Redfish {self.base}: the BMC's answers took over {DISCOVER_S:g} s together before its "
                        f"power data was found (at {one_line(path)[:200]})")
        if self.until is not None:
            timeout_s = min(timeout_s, self.until - time.monotonic())
            if timeout_s <= 0:
                raise late
        try:
            body = outside.get(self.base + path, self._headers, timeout_s=timeout_s, limit=4 << 20,
                               context=self._context)
        except outside.OutsideError as exc:
            if self.until is not None and time.monotonic() >= self.until:
                raise late from None
            if exc.status in (401, 403):
                raise IpwError(f"Redfish {self.base}: the BMC refused the credentials (HTTP {exc.status} on "
                               f"{one_line(path)[:200]}); check {ENV_USER} / {ENV_PASSWORD}") from None
            if exc.status is not None:
                raise IpwError(f"Redfish {self.base}: {exc} on {one_line(path)[:200]}") from None
            hint = (f"; a self-signed BMC certificate: set {ENV_VERIFY}=/path/to/its-ca.pem (or 0 to skip "
                    "verification)") if isinstance(exc.cause, ssl.SSLCertVerificationError) else ""
            raise IpwError(f"Redfish {self.base}: cannot reach the BMC ({exc}){hint}") from None
        try:
            data = json.loads(body)
        except ValueError:
            raise IpwError(f"Redfish {self.base}: {one_line(path)[:200]} is not JSON (not a Redfish service?)") from None
        if not isinstance(data, dict):
            raise IpwError(f"Redfish {self.base}: {one_line(path)[:200]} is not a JSON object (not a Redfish service?)")
        return data


#: the most characters kept of a chassis' Id or type (the BMC's text: the manifest records it)
MAX_ID_CHARS = 64


def _link(obj: dict[str, Any], key: str) -> str | None:
    v = obj.get(key)
    return v.get("@odata.id") if isinstance(v, dict) and isinstance(v.get("@odata.id"), str) else None


def _excerpt(obj: dict[str, Any], key: str) -> float | None:
    """``obj[key].Reading`` (a SensorExcerpt) as a number, else None."""
    v = obj.get(key)
    r = v.get("Reading") if isinstance(v, dict) else None
    return float(r) if isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) else None


def _number(obj: Any, key: str) -> float | None:
    v = obj.get(key) if isinstance(obj, dict) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


@dataclass
class RedfishChassis:
    """What one chassis offers (:func:`discover`)."""

    id: str
    path: str
    chassis_type: str = ""
    top_level: bool = True
    env_metrics: str | None = None  # EnvironmentMetrics URI
    power: str | None = None  # legacy Power URI
    psu_metrics: list[str] = field(default_factory=list)  # PowerSubsystem/PowerSupplies/*/Metrics URIs
    power_field: str | None = None  # the property read for power
    power_kind: str = ""  # "input" | "output"
    counter_field: str | None = None  # EnergyJoules | EnergykWh
    psu_input_w: float | None = None  # at discovery: the supplies' input and output, for doctor
    psu_output_w: float | None = None
    first_w: float | None = None
    first_counter_j: float | None = None


def _psus_legacy(power: dict[str, Any]) -> tuple[float | None, float | None]:
    supplies = [p for p in power.get("PowerSupplies") or [] if isinstance(p, dict)]
    ins = [w for w in (_number(p, "PowerInputWatts") for p in supplies) if w is not None]
    outs = [w for w in (_number(p, "PowerOutputWatts") or _number(p, "LastPowerOutputWatts") for p in supplies)
            if w is not None]
    return (sum(ins) if ins else None), (sum(outs) if outs else None)


def _chassis(client: RedfishClient, path: str) -> RedfishChassis:
    doc = client.get(path)
    links = doc.get("Links") if isinstance(doc.get("Links"), dict) else {}
    ch = RedfishChassis(id=str(doc.get("Id", path.rsplit("/", 1)[-1]))[:MAX_ID_CHARS], path=path,
                        chassis_type=str(doc.get("ChassisType", ""))[:MAX_ID_CHARS],
                        top_level=not (links or {}).get("ContainedBy"),
                        env_metrics=_link(doc, "EnvironmentMetrics"), power=_link(doc, "Power"))
    if ch.env_metrics:
        env = client.get(ch.env_metrics)
        for key in ("EnergyJoules", "EnergykWh"):
            if _excerpt(env, key) is not None:
                ch.counter_field = key
                ch.first_counter_j = _excerpt(env, key) * (3.6e6 if key == "EnergykWh" else 1.0)  # type: ignore[operator]
                break
        if _excerpt(env, "PowerWatts") is not None:
            ch.power_field, ch.power_kind, ch.first_w = "EnvironmentMetrics.PowerWatts", "input", _excerpt(env, "PowerWatts")
    subsystem = _link(doc, "PowerSubsystem")
    if subsystem:
        supplies_uri = _link(client.get(subsystem), "PowerSupplies")
        if supplies_uri:
            for member in client.get(supplies_uri).get("Members") or []:
                uri = member.get("@odata.id") if isinstance(member, dict) else None
                if isinstance(uri, str):
                    metrics = _link(client.get(uri), "Metrics")
                    if metrics:
                        ch.psu_metrics.append(metrics)
        ins, outs = [], []
        for uri in ch.psu_metrics:
            m = client.get(uri)
            ins.append(_excerpt(m, "InputPowerWatts"))
            outs.append(_excerpt(m, "OutputPowerWatts"))
        if ins and all(w is not None for w in ins):
            ch.psu_input_w = sum(ins)  # type: ignore[arg-type]
        if outs and all(w is not None for w in outs):
            ch.psu_output_w = sum(outs)  # type: ignore[arg-type]
    if ch.power:
        legacy = client.get(ch.power)
        controls = [c for c in legacy.get("PowerControl") or [] if isinstance(c, dict)]
        if ch.power_field is None and controls and _number(controls[0], "PowerConsumedWatts") is not None:
            ch.power_field, ch.power_kind = "Power.PowerControl[0].PowerConsumedWatts", "input"
            ch.first_w = _number(controls[0], "PowerConsumedWatts")
        ins_l, outs_l = _psus_legacy(legacy)
        ch.psu_input_w = ch.psu_input_w if ch.psu_input_w is not None else ins_l
        ch.psu_output_w = ch.psu_output_w if ch.psu_output_w is not None else outs_l
    if ch.power_field is None and ch.psu_input_w is not None:
        ch.power_field, ch.power_kind, ch.first_w = "PowerSupplies input watts (sum)", "input", ch.psu_input_w
    if ch.power_field is None and ch.psu_output_w is not None:
        ch.power_field, ch.power_kind, ch.first_w = "PowerSupplies output watts (sum)", "output", ch.psu_output_w
    return ch


def discover(client: RedfishClient, chassis_id: str | None = None) -> tuple[RedfishChassis, list[RedfishChassis]]:
    """The chassis to read (``chassis_id``, else the first top-level one with power data, else the first
    with any) and every chassis seen; IpwError when none has power data, or when the BMC's answers took
    over DISCOVER_S together (a BMC that lists thousands of chassis or supplies, each answered slowly)."""
    client.until = time.monotonic() + DISCOVER_S
    try:
        return _discover(client, chassis_id)
    finally:
        client.until = None


def _discover(client: RedfishClient, chassis_id: str | None) -> tuple[RedfishChassis, list[RedfishChassis]]:
    root = client.get("/redfish/v1/")
    collection = _link(root, "Chassis")
    if collection is None:
        raise IpwError(f"Redfish {client.base}: the service root lists no Chassis (not a Redfish service with "
                       "power data)")
    members = [m.get("@odata.id") for m in client.get(collection).get("Members") or [] if isinstance(m, dict)]
    seen = [_chassis(client, uri) for uri in members if isinstance(uri, str)]
    if chassis_id is not None:
        picked = [c for c in seen if c.id == chassis_id]
        if not picked:
            raise IpwError(f"Redfish {client.base}: no chassis {chassis_id} ({ENV_CHASSIS}); it has "
                           f"{', '.join(c.id for c in seen) or 'none'}")
        usable = [c for c in picked if c.power_field or c.counter_field]
    else:
        usable = sorted((c for c in seen if c.power_field or c.counter_field), key=lambda c: not c.top_level)
    if not usable:
        where = ", ".join(c.id for c in seen) or "no chassis"
        raise IpwError(f"Redfish {client.base}: no power data ({where}: no EnvironmentMetrics PowerWatts or "
                       "EnergykWh/EnergyJoules, no Power PowerControl, no power supply watts)")
    c = usable[0]
    for field_name, value, high, unit in ((c.power_field, c.first_w, MAX_NODE_W, "W"),
                                          (c.counter_field, c.first_counter_j, MAX_COUNTER_J, "J")):
        why = impossible(value, high, unit)
        if why:
            raise IpwError(f"Redfish {client.base}: chassis {one_line(c.id)} {field_name} {why}")
    return c, seen


def impossible(value: float | None, high: float, unit: str) -> str | None:
    """Why a BMC's reading cannot be a node's (below 0, above ``high``), or None: such a reading is never
    recorded as measured."""
    if value is None or 0 <= value <= high:
        return None
    return f"reads {value:g} {unit}: not a possible reading (0 to {high:g} {unit})"


def possible(p: Poll, where: str) -> Poll:
    """``p`` without a reading :func:`impossible` refuses, which it names in its errors instead (the window is
    then unavailable where no other reading covers it, with that note)."""
    for values, high, unit in ((p.power_w, MAX_NODE_W, "W"), (p.counter_j, MAX_COUNTER_J, "J")):
        why = impossible(values.get("node"), high, unit)
        if why:
            del values["node"]
            p.errors["node"] = f"{where} {why}; not used"
    return p


class RedfishPlatform(Platform):
    """The node's power (and counter) of one Redfish chassis."""

    name = "redfish"

    def __init__(self, config: NodeConfig, client: RedfishClient | None = None) -> None:
        self.config = config
        self.client = client or RedfishClient(config)
        self.chassis, self.seen = discover(self.client, config.chassis)
        self.period_s = config.period_s
        self.counter_step_s = config.period_s
        self.update_period_s: float | None = None
        self.frozen_after_s = None

    @property
    def channels(self) -> list[Channel]:  # type: ignore[override]
        c = self.chassis
        kind = c.power_kind or "not stated"
        return [Channel("node", "node", "redfish", has_counter=c.counter_field is not None,
                        has_power=c.power_field is not None, tolerance=TOLERANCE,
                        power_average_s=self.update_period_s or 0.0,
                        counter_resolution_j=3600.0 if c.counter_field == "EnergykWh" else 1.0,
                        note=f"chassis {c.id} {c.power_field or c.counter_field} ({kind} power)")]

    def read(self) -> Poll:
        p = Poll()
        c = self.chassis
        timeout = max(1.0, min(TIMEOUT_S, 2 * self.period_s))
        try:
            if c.env_metrics and (c.counter_field or (c.power_field or "").startswith("EnvironmentMetrics")):
                env = self.client.get(c.env_metrics, timeout)
                if c.counter_field:
                    v = _excerpt(env, c.counter_field)
                    if v is not None:
                        p.counter_j["node"] = v * (3.6e6 if c.counter_field == "EnergykWh" else 1.0)
                if c.power_field == "EnvironmentMetrics.PowerWatts":
                    w = _excerpt(env, "PowerWatts")
                    if w is not None:
                        p.power_w["node"] = w
            if c.power_field and c.power_field.startswith("Power.PowerControl"):
                w = _number((self.client.get(c.power, timeout).get("PowerControl") or [{}])[0], "PowerConsumedWatts")  # type: ignore[arg-type]
                if w is not None:
                    p.power_w["node"] = w
            elif c.power_field and c.power_field.startswith("PowerSupplies"):
                key = "Input" if c.power_kind == "input" else "Output"
                if c.psu_metrics:
                    ws = [_excerpt(self.client.get(u, timeout), f"{key}PowerWatts") for u in c.psu_metrics]
                    if all(w is not None for w in ws):
                        p.power_w["node"] = float(sum(ws))  # type: ignore[arg-type]
                else:
                    ins, outs = _psus_legacy(self.client.get(c.power, timeout))  # type: ignore[arg-type]
                    w = ins if key == "Input" else outs
                    if w is not None:
                        p.power_w["node"] = w
        except IpwError as exc:
            p.errors["node"] = exc.message
        return possible(p, f"Redfish {self.client.base}: chassis {one_line(c.id)}")

    def describe(self) -> str:
        c = self.chassis
        parts = [f"{self.config.url} chassis {c.id}" + (f" ({c.chassis_type})" if c.chassis_type else ""),
                 f"power {c.power_field or 'none'}" + (f" = {c.first_w:g} W ({c.power_kind} power)" if c.first_w is not None else ""),
                 f"counter {c.counter_field or 'none'}" + (f" = {c.first_counter_j:.6g} J" if c.first_counter_j is not None else "")]
        if c.psu_input_w is not None or c.psu_output_w is not None:
            parts.append("power supplies: input " + ("-" if c.psu_input_w is None else f"{c.psu_input_w:g} W")
                         + ", output " + ("-" if c.psu_output_w is None else f"{c.psu_output_w:g} W"))
        parts.append(f"read every {self.period_s:g} s")
        return "; ".join(parts)

    def params(self) -> dict[str, Any]:
        c = self.chassis
        return {"url": self.config.url, "chassis": c.id, "chassis_type": c.chassis_type,
                "power_field": c.power_field, "power_kind": c.power_kind or "not stated",
                "counter_field": c.counter_field, "psu_input_w": c.psu_input_w, "psu_output_w": c.psu_output_w,
                "chassis_seen": [x.id for x in self.seen], "update_period_s": self.update_period_s}


# --------------------------------------------------------------------------------------------------
# IPMI DCMI

_DCMI_LINE = re.compile(r"^\s*(?P<key>[A-Za-z][A-Za-z /]*?)\s*:\s*(?P<value>.*?)\s*$")


def parse_dcmi(text: str) -> dict[str, Any]:
    """``ipmitool dcmi power reading``'s output: the instantaneous, minimum, maximum and average watts,
    the sampling period (s) and the state; IpwError where there is no instantaneous reading."""
    out: dict[str, Any] = {}
    for line in text.splitlines():
        m = _DCMI_LINE.match(line)
        if not m:
            continue
        key, value = m["key"].lower(), m["value"]
        number = re.match(r"^(\d+(?:\.\d+)?)", value)
        if key.startswith("instantaneous power reading") and number:
            out["instant_w"] = float(number[1])
        elif key.startswith("minimum during sampling period") and number:
            out["min_w"] = float(number[1])
        elif key.startswith("maximum during sampling period") and number:
            out["max_w"] = float(number[1])
        elif key.startswith("average power reading over sample period") and number:
            out["average_w"] = float(number[1])
        elif key.startswith("sampling period") and number:
            out["sampling_period_s"] = float(number[1])
        elif key.startswith("power reading state is"):
            out["state"] = value
    if "instant_w" not in out:
        raise IpwError("IPMI DCMI: no power reading in ipmitool's answer (the BMC may not support DCMI power "
                       "readings): " + " ".join(text.split())[:200])
    return out


class IpmiPlatform(Platform):
    """The node's power from DCMI Get Power Reading, through ``ipmitool``."""

    name = "ipmi_dcmi"

    def __init__(self, config: NodeConfig, run: Callable[..., "subprocess.CompletedProcess[str]"] = subprocess.run) -> None:
        self.config = config
        self._run = run
        exe = shutil.which("ipmitool")
        if exe is None:
            raise IpwError(f"{ENV_URL}={config.url}: ipmitool is not installed (apt install ipmitool / dnf install "
                           "ipmitool)")
        host = urllib.parse.urlsplit(config.url).netloc
        self.argv = [exe] + (["-I", "lanplus", "-H", host, "-U", config.user, "-E"] if host else []) \
            + ["dcmi", "power", "reading"]
        self._env = {**os.environ, "IPMI_PASSWORD": config.password} if host else None
        self.period_s = config.period_s
        self.counter_step_s = config.period_s
        self.update_period_s: float | None = None
        self.frozen_after_s = None
        self.first = self._reading()

    @property
    def channels(self) -> list[Channel]:  # type: ignore[override]
        return [Channel("node", "node", "ipmi_dcmi", has_counter=False, has_power=True, tolerance=TOLERANCE,
                        power_average_s=self.update_period_s or 0.0,
                        note="DCMI instantaneous power (platform power; input or output not stated by DCMI)")]

    def _reading(self, timeout_s: float = 2 * TIMEOUT_S) -> dict[str, Any]:
        try:
            done = self._run(self.argv, capture_output=True, text=True, timeout=timeout_s, env=self._env)
        except subprocess.TimeoutExpired:
            raise IpwError(f"IPMI DCMI {self.config.url}: ipmitool did not answer in {timeout_s:g} s") from None
        if done.returncode != 0:
            detail = " ".join((done.stderr or done.stdout or "").split())[:200]
            refused = re.search(r"(?i)unauthori|password|authenticat|RAKP|session", detail)
            raise IpwError(f"IPMI DCMI {self.config.url}: " + ("the BMC refused the credentials" if refused else
                                                               f"ipmitool exited {done.returncode}")
                           + (f" ({detail})" if detail else "")
                           + (f"; check {ENV_USER} / {ENV_PASSWORD}" if refused else ""))
        return parse_dcmi(done.stdout)

    def read(self) -> Poll:
        p = Poll()
        try:
            p.power_w["node"] = self._reading(max(1.0, min(2 * TIMEOUT_S, 2 * self.period_s)))["instant_w"]
        except IpwError as exc:
            p.errors["node"] = exc.message
        return possible(p, f"IPMI DCMI {self.config.url}: the power reading")

    def describe(self) -> str:
        f = self.first
        return (f"{self.config.url or 'ipmi://'} DCMI power reading = {f['instant_w']:g} W (input or output not "
                f"stated by DCMI); state {f.get('state', '?')}; BMC's sampling period "
                f"{f.get('sampling_period_s', '?')} s; read every {self.period_s:g} s")

    def params(self) -> dict[str, Any]:
        return {"url": self.config.url, "power_kind": "not stated", "in_band": not urllib.parse.urlsplit(self.config.url).netloc,
                "dcmi_sampling_period_s": self.first.get("sampling_period_s"), "dcmi_state": self.first.get("state"),
                "update_period_s": self.update_period_s}


# --------------------------------------------------------------------------------------------------
# the sensor


def change_period_s(t_s: np.ndarray, v: np.ndarray) -> float | None:
    """The median time between changes of ``v`` (s), once it changed ``MIN_CHANGES`` times; else None."""
    if t_s.size < 2:
        return None
    changed = t_s[1:][np.diff(v) != 0]
    if changed.size < MIN_CHANGES:
        return None
    return float(np.median(np.diff(changed)))


class NodePowerSensor(PolledSensor):
    """A :class:`PolledSensor` of the node's BMC whose update period is observed as it polls: the
    windows shorter than it are flagged short, and every reading says the period (or that it is not yet
    known)."""

    def __init__(self, platform: Platform, **kwargs: Any) -> None:
        kwargs.setdefault("startup_check_s", 0.0)  # a BMC counter moves too slowly for a 0.6 s check
        super().__init__(platform, **kwargs)
        self.name = "node_power"

    def update_period_s(self) -> float | None:
        """How often the BMC's reading changes, as observed so far (None: not yet)."""
        platform = self.platform
        return platform.update_period_s if isinstance(platform, (RedfishPlatform, IpmiPlatform)) else None

    def poll(self) -> None:
        super().poll()
        comp = "node"
        series = self._power.get(comp) if any(c.has_power for c in self.platform.channels) else self._counter.get(comp)
        if series is None:
            return
        with self._lock:
            t, v = series.arrays(series.t[-1] - OBSERVE_S if series.t else None)
        period = change_period_s(t, v)
        if period is not None:
            self.platform.update_period_s = round(period, 3)  # type: ignore[attr-defined]
            self.platform.counter_step_s = max(self.platform.period_s, period)

    def readings(self, start_s: float, end_s: float) -> list[EnergyReading]:
        from dataclasses import replace

        period = self.update_period_s()
        extra = (f"reading updates every {period:g} s (observed)" if period is not None else
                 f"update period not observed yet (fewer than {MIN_CHANGES} changes of the reading): windows "
                 "shorter than the BMC's refresh are not resolved")
        return [replace(r, note="; ".join(p for p in (r.note, extra) if p)) for r in super().readings(start_s, end_s)]

    def info(self) -> SensorInfo:
        from dataclasses import replace

        info = super().info()
        period = self.update_period_s()
        detail = info.detail + ("; reading updates every " + (f"{period:g} s (observed)" if period is not None
                                                             else "? s (not observed yet)"))
        return replace(info, detail=detail)


def open_node_sensor(config: NodeConfig, **kwargs: Any) -> NodePowerSensor:
    """The node sensor of ``config``; IpwError (one line) when the BMC cannot be read."""
    platform: Platform = RedfishPlatform(config) if config.kind == "redfish" else IpmiPlatform(config)
    return NodePowerSensor(platform, **kwargs)


def probe(**kwargs: Any) -> NodePowerSensor | None:
    """The node sensor where ``IPW_NODE_POWER`` is set, else None; IpwError when it is set and the BMC
    refuses, answers without power data or cannot be reached."""
    config = node_config()
    return None if config is None else open_node_sensor(config, **kwargs)


def check_configured() -> NodeConfig | None:
    """For ``ipw run`` before any folder exists: the configured BMC answers with power data (one read),
    else IpwError.  None where none is configured."""
    config = node_config()
    if config is None:
        return None
    if config.kind == "redfish":
        discover(RedfishClient(config), config.chassis)
    else:
        IpmiPlatform(config)
    return config


def doctor_rows() -> list[list[str]]:
    """``ipw doctor``'s node-power table: what was found (never raises)."""
    try:
        config = node_config()
    except IpwError as exc:
        return [["configuration", exc.message]]
    if config is None:
        return [["configuration", f"not configured: set {USAGE}"]]
    rows = [["BMC", f"{config.url} ({'Redfish' if config.kind == 'redfish' else 'IPMI DCMI'})"]]
    try:
        sensor = open_node_sensor(config, threaded=False)
    except IpwError as exc:
        return rows + [["error", exc.message]]
    except Exception as exc:  # doctor reports, never crashes
        return rows + [["error", f"{type(exc).__name__}: {exc}"]]
    try:
        deadline = time.monotonic() + max(3.0, 6 * config.period_s)
        while time.monotonic() < deadline and sensor.update_period_s() is None:
            time.sleep(config.period_s)
            sensor.poll()
        params = sensor.info().params
        if config.kind == "redfish":
            rows += [["chassis", f"{params['chassis']} ({params['chassis_type'] or 'type not stated'}); seen: "
                                 f"{', '.join(params['chassis_seen'])}"],
                     ["power", f"{params['power_field'] or 'none'}: {params['power_kind']} power"],
                     ["power supplies", f"input {_w(params['psu_input_w'])}, output {_w(params['psu_output_w'])}"],
                     ["energy counter", params["counter_field"] or "none (the power readings are integrated)"]]
        else:
            rows += [["power", "DCMI instantaneous power reading: input or output not stated by DCMI"],
                     ["DCMI", f"state {params['dcmi_state']}, sampling period {params['dcmi_sampling_period_s']} s"]]
        latest = sensor._power["node"].v[-1:] if sensor._power["node"].v else []
        rows += [["latest reading", _w(latest[0] if latest else None)],
                 ["update period", f"{params['update_period_s']:g} s (observed)" if params["update_period_s"] is not None
                  else f"not observed in {max(3.0, 6 * config.period_s):g} s (the reading did not change "
                       f"{MIN_CHANGES} times)"]]
    finally:
        sensor.close()
    return rows


def _w(x: float | None) -> str:
    return "-" if x is None else f"{x:g} W"
