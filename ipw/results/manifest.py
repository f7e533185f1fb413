"""manifest.json: ``RunManifest`` (typed) and ``read_manifest`` (checked, one-line errors)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ipw.errors import IpwError
from ipw.results.entry import BackendEntry
from ipw.results.schema import SCHEMA_VERSION, STATUSES
from ipw.results.files import own_file



@dataclass(frozen=True)
class RunManifest:
    """manifest.json, typed (docs/ARCHITECTURE.md, 'The files of a run folder'): written only by :class:`RunFolder`, read by
    :meth:`RunManifest.read` (``read_manifest`` checked). A field that is None is absent from the file;
    the nested tables (config, dataset, hardware, backends, ...) are the JSON objects as written."""

    run_id: str
    status: str = "running"
    schema_version: int = SCHEMA_VERSION
    ipw_version: str | None = None
    command: list[str] | None = None
    config: dict[str, Any] | None = None  # RunConfig.to_dict()
    dataset: dict[str, Any] | None = None  # name, n_queries, fingerprint
    shard: dict[str, Any] | None = None  # index, count, dataset (the full set) of a --shard run
    hardware: dict[str, Any] | None = None
    hardware_by_id: dict[str, Any] | None = None  # every machine whose records the run holds
    software: dict[str, Any] | None = None
    started_at: str | None = None
    backends: list[dict[str, Any]] | None = None  # each backend's entry as written (``entries()``: typed)
    finished_at: str | None = None
    reason: str | None = None  # why a run failed or was interrupted
    resumed_at: list[str] | None = None
    ray: dict[str, Any] | None = None  # the Ray tasks of a --ray run
    merged_from: list[dict[str, Any]] | None = None  # the shards of an ipw merge run
    merged_at: str | None = None
    rescored_from: dict[str, Any] | None = None
    rescored_at: str | None = None
    judge: dict[str, Any] | None = None  # the judge of ipw rescore --scorer judge
    # what records.parquet was built from: the count and sha256 of records.jsonl when it was written
    # (readers trust the Parquet file only while the log still matches; see trusted_parquet)
    records: dict[str, Any] | None = None
    # the grid's carbon intensity the run carries (ipw.carbon: g_per_kwh, source, zone, date); g_per_kwh None:
    # asked for, but the live feed gave none (its error says why)
    carbon: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys this ipw does not know, kept as they were

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunManifest":
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in data.items() if k in known},
                   extra={k: v for k, v in data.items() if k not in known})

    @classmethod
    def read(cls, run_dir: str | Path, require: tuple[str, ...] = ()) -> "RunManifest":
        """The checked manifest of a run folder (``read_manifest``: one-line errors)."""
        return cls.from_dict(read_manifest(run_dir, require))

    @classmethod
    def read_unfinished(cls, run_dir: str | Path) -> "RunManifest":
        """The manifest of a run folder that ``--resume`` can continue: with its config and dataset
        fingerprint, not complete (else an IpwError)."""
        manifest = cls.read(run_dir, require=("config", "dataset.fingerprint"))
        if manifest.status == "complete":
            raise IpwError(f"{run_dir}: the run is already complete; nothing to resume")
        return manifest

    def entries(self) -> list[BackendEntry]:
        """The backends' entries, typed (``BackendEntry.read``: an IpwError names a field of the wrong type)."""
        return [BackendEntry.read(b, f"{self.run_id}: manifest.json") for b in self.backends or []]

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**{k: v for k, v in out.items() if v is not None}, **self.extra}


def manifest_file(run_dir: str | Path) -> Path:
    """A run folder's manifest as a file (an artifact to upload, say), never a link to one elsewhere."""
    return own_file(Path(run_dir) / "manifest.json")


def manifest_field(run_dir: str | Path, name: str) -> str:
    """Where an error about a manifest's field points: ``RUN_DIR/manifest.json: field 'NAME'``."""
    return f"{Path(run_dir) / 'manifest.json'}: field '{name}'"


def read_manifest(run_dir: str | Path, require: tuple[str, ...] = ()) -> dict[str, Any]:
    """A run folder's manifest.json, checked: a JSON object of a schema this ipw reads, with a known
    ``status``; ``require`` names further fields that must be there (``dataset.fingerprint``)."""
    path = Path(run_dir)
    file = own_file(path / "manifest.json")
    try:
        text = file.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        raise IpwError(f"{path}: not a run folder (no manifest.json)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise IpwError(f"{file}: cannot read it ({type(exc).__name__})") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise IpwError(f"{file}:{exc.lineno}: invalid JSON ({exc.msg}); the manifest is damaged") from None
    except RecursionError:
        raise IpwError(f"{file}: invalid JSON (nested too deeply); the manifest is damaged") from None
    if not isinstance(manifest, dict):
        raise IpwError(f"{file}: expected a JSON object, got {type(manifest).__name__}; the manifest is damaged")
    version = manifest.get("schema_version", SCHEMA_VERSION)
    if isinstance(version, bool) or not isinstance(version, int):
        raise IpwError(f"{file}: field 'schema_version': expected an integer, got {version!r}")
    if version > SCHEMA_VERSION:
        raise IpwError(f"{file}: field 'schema_version': {version} was written by a newer ipw (this one reads up to "
                       f"{SCHEMA_VERSION}); upgrade ipw")
    status = manifest.get("status")
    if status not in STATUSES:
        raise IpwError(f"{file}: field 'status': expected one of {', '.join(STATUSES)}, got {status!r}")
    for key in ("config", "dataset"):
        if key in manifest and not isinstance(manifest[key], dict):
            raise IpwError(f"{file}: field '{key}': expected an object, got {type(manifest[key]).__name__}")
    for field_path in require:
        value: Any = manifest
        for part in field_path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            raise IpwError(f"{file}: field '{field_path}': missing")
    return manifest
