"""One entry of a manifest's ``backends`` (``BackendEntry``): what one backend was and how it was measured,
built in one place for ``ipw run`` (``runner``, each Ray shard) and ``ipw serve``, and read back typed.

The file keeps the flat layout of every earlier ipw (what the backend says of itself, ``describe()``: its
engine, version, mode, model file, server, upstream..., side by side with the fields below), plus
``entry_version``; an entry without one was written before the field existed and reads as version 1."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from ipw.errors import IpwError

ENTRY_VERSION = 1
#: the typed fields that are lists of objects in the file (a session of ipw serve, a level of a sweep, ...)
_LISTS = ("sensors", "levels", "sessions", "shards", "energy_audit")


@dataclass(frozen=True)
class BackendEntry:
    """A backend of a run.  ``details``: what the backend says of itself (``describe()``) and, for ``ipw
    serve``, its upstream; optional fields are None where the run did not get that far (a backend that
    stopped while it loaded has no sensors) or where the backend has none (no levels without a sweep)."""

    name: str
    kind: str
    model: str
    role: str
    load_s: float | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    sampler_overhead: Mapping[str, Any] | None = None
    sensors: tuple[Mapping[str, Any], ...] | None = None
    idle_baseline: Mapping[str, Any] | None = None
    levels: tuple[Mapping[str, Any], ...] | None = None  # one per concurrency level of a sweep
    sessions: tuple[Mapping[str, Any], ...] | None = None  # ipw serve: one per session of the folder
    shards: tuple[Mapping[str, Any], ...] | None = None  # a backend run as several shards: each one's entry
    stopped: str | None = None  # why it stopped before its last query
    energy_audit: tuple[Mapping[str, Any], ...] | None = None
    entry_version: int = ENTRY_VERSION

    def to_json(self) -> dict[str, Any]:
        """The entry as the manifest holds it: flat, without the fields that are None."""
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "model": self.model, "role": self.role}
        if self.load_s is not None:
            out["load_s"] = self.load_s
        out.update(self.details)
        for name in ("sampler_overhead", "sensors", "idle_baseline", "levels", "sessions", "shards", "stopped",
                     "energy_audit"):
            value = getattr(self, name)
            if value is not None:
                out[name] = [dict(v) for v in value] if name in _LISTS else value
        out["entry_version"] = self.entry_version
        return out

    @classmethod
    def read(cls, data: Any, where: str = "manifest.json") -> "BackendEntry":
        """An entry as a manifest holds it; an IpwError naming ``where`` and the field when a field has another
        type than its writer gives it."""
        if not isinstance(data, Mapping):
            raise IpwError(f"{where}: field 'backends': an entry is not an object ({type(data).__name__})")
        name = data.get("name")
        if not isinstance(name, str):
            raise IpwError(f"{where}: field 'backends': an entry without a name")
        at = f"{where}: backend {name!r}"

        def typed(key: str, kinds: tuple[type, ...], default: Any = None) -> Any:
            value = data.get(key, default)
            if value is not None and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds):
                raise IpwError(f"{at}: field {key!r}: expected {' or '.join(k.__name__ for k in kinds)}, got "
                               f"{type(value).__name__}")
            return value

        def objects(key: str) -> tuple[Mapping[str, Any], ...] | None:
            value = typed(key, (list,))
            if value is None:
                return None
            if not all(isinstance(v, Mapping) for v in value):
                raise IpwError(f"{at}: field {key!r}: expected a list of objects")
            return tuple(value)

        version = typed("entry_version", (int,), 1)
        if version > ENTRY_VERSION:
            raise IpwError(f"{at}: field 'entry_version': {version} was written by a newer ipw (this one reads up to "
                           f"{ENTRY_VERSION}); upgrade ipw")
        load_s = typed("load_s", (int, float))
        known = {f.name for f in dataclasses.fields(cls)} - {"details"}
        return cls(name=name, kind=typed("kind", (str,), ""), model=typed("model", (str,), ""),
                   role=typed("role", (str,), ""), load_s=None if load_s is None else float(load_s),
                   details={k: v for k, v in data.items() if k not in known},
                   sampler_overhead=typed("sampler_overhead", (dict,)), sensors=objects("sensors"),
                   idle_baseline=typed("idle_baseline", (dict,)), levels=objects("levels"),
                   sessions=objects("sessions"), shards=objects("shards"), stopped=typed("stopped", (str,)),
                   energy_audit=objects("energy_audit"), entry_version=version)
