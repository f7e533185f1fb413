"""Run folders: ``results/<run_id>/`` with manifest.json, records.jsonl, records.parquet, power.parquet.

``records.jsonl`` is appended and flushed per query, so a crash loses at most the query in flight.
This is the only module that turns records into pandas frames.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ipw.errors import IpwError

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class QueryRecord:
    run_id: str
    backend: str
    model: str
    role: str
    query_id: str
    category: str
    repeat: int
    scorer: str
    prompt: str
    answer: str
    output: str
    correct: float  # 0..1; an error counts 0
    error: str | None  # None when the query succeeded
    error_category: str | None
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    latency_s: float
    start_s: float  # monotonic seconds of the window
    end_s: float
    energy_j: float | None  # gross energy on the record's basis (see energy_quality)
    energy_quality: str  # measured | measured_interpolated | estimated | unavailable
    energy_source: str
    energy_scope: str
    best_effort_energy_j: float | None  # every available part, measured and estimated, summed
    net_energy_j: float | None  # energy_j minus idle power x duration
    energy_parts: str = "[]"  # JSON list of per-component readings
    # prefill (window start -> first token) and decode (first token -> end): the same readings as
    # energy_j cut at the first token, so they sum to it; None without a first token (ipw/phases.py)
    prefill_energy_j: float | None = None
    decode_energy_j: float | None = None
    prefill_uncertainty_j: float | None = None  # ± energy that may belong to the other phase
    phase_quality: str = ""  # worst quality of the split: measured_interpolated | estimated
    prefill_unresolved: bool | None = None  # the prefill is shorter than the sensor resolves
    phase_note: str = ""
    # the machine that measured the record (ipw.telemetry.hardware.NodeIdentity): a hash of its host name,
    # and the key of its hardware fingerprint in the manifest's ``hardware_by_id``; "" in older runs
    node: str = ""
    hardware_id: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)


RECORD_COLUMNS = [f.name for f in dataclasses.fields(QueryRecord)]


def new_run_id(now: dt.datetime | None = None) -> str:
    now = now or dt.datetime.now()
    return f"{now:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def _atomic_write_parquet(frame, path: Path) -> None:
    """Write to a temporary file, then rename: a crash never leaves a truncated Parquet file."""
    tmp = path.with_suffix(".parquet.tmp")
    frame.to_parquet(tmp, index=False)
    os.replace(tmp, path)


def _atomic_write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


@dataclass
class RunFolder:
    """Writes one run folder. The manifest is rewritten atomically as the run progresses."""

    path: Path
    manifest: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, out_dir: str | Path, run_id: str, manifest: dict[str, Any]) -> "RunFolder":
        path = Path(out_dir) / run_id
        try:
            path.mkdir(parents=True, exist_ok=False)
        except OSError as exc:
            raise IpwError(f"{path}: cannot create the run folder ({exc.strerror})") from None
        folder = cls(path, {"schema_version": SCHEMA_VERSION, "run_id": run_id, **manifest, "status": "running"})
        folder.write_manifest()
        (path / "records.jsonl").touch()
        return folder

    @classmethod
    def reopen(cls, run_dir: str | Path) -> "RunFolder":
        """Reopen an unfinished run folder for ``--resume``: repair a torn last line of the log."""
        path = Path(run_dir)
        manifest_path = path / "manifest.json"
        if not manifest_path.exists():
            raise IpwError(f"{path}: not a run folder (no manifest.json)")
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if manifest.get("status") == "complete":
            raise IpwError(f"{path}: the run is already complete; nothing to resume")
        log = path / "records.jsonl"
        data = log.read_bytes() if log.exists() else b""
        if data and not data.endswith(b"\n"):  # the query in flight when the process died
            log.write_bytes(data[: data.rfind(b"\n") + 1])
        return cls(path, manifest)

    def done_keys(self) -> set[tuple[str, str, int]]:
        """(backend, query_id, repeat) of every record already written."""
        frame = load_records_jsonl(self.path / "records.jsonl")
        return set(zip(frame["backend"], frame["query_id"], frame["repeat"].astype(int)))

    def write_manifest(self, **updates: Any) -> None:
        self.manifest.update(updates)
        _atomic_write_json(self.path / "manifest.json", self.manifest)

    def append(self, record: QueryRecord) -> None:
        with open(self.path / "records.jsonl", "a", encoding="utf-8") as fh:
            fh.write(record.to_json() + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def add_power(self, backend: str, columns: dict[str, Any]) -> None:
        """Append a backend's raw telemetry (t_s, device, power_w, kind, energy_j) to power.parquet."""
        import pandas as pd

        frame = pd.DataFrame(columns)
        if frame.empty:
            return
        frame.insert(0, "backend", backend)
        path = self.path / "power.parquet"
        if path.exists():
            frame = pd.concat([pd.read_parquet(path), frame], ignore_index=True)
        _atomic_write_parquet(frame, path)

    def finish(self, status: str, **updates: Any) -> None:
        frame = load_records_jsonl(self.path / "records.jsonl")
        _atomic_write_parquet(frame, self.path / "records.parquet")
        self.write_manifest(status=status, finished_at=dt.datetime.now().isoformat(timespec="seconds"), **updates)


def load_records_jsonl(path: Path):
    import pandas as pd

    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a torn last line from a crash: everything before it is intact
    return pd.DataFrame(rows, columns=RECORD_COLUMNS)


def load_run(run_dir: str | Path, columns: list[str] | None = None, categorical: tuple[str, ...] | list[str] = ()):
    """Manifest and records of a run folder (parquet when complete, else the JSONL log).

    ``columns`` reads only those record columns (default: all); one missing from the file is all null.
    ``categorical`` columns come back as pandas categoricals (fast for low-cardinality strings).
    """
    path = Path(run_dir)
    manifest_path = path / "manifest.json"
    if not manifest_path.exists():
        raise IpwError(f"{path}: not a run folder (no manifest.json)")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    parquet = path / "records.parquet"
    if parquet.exists():
        import pandas as pd

        if columns is None:
            return manifest, pd.read_parquet(parquet)
        import pyarrow.parquet as pq

        present = set(pq.read_schema(parquet).names)
        frame = pd.read_parquet(parquet, columns=[c for c in columns if c in present],
                                read_dictionary=[c for c in categorical if c in present])
        return manifest, frame.assign(**{c: None for c in columns if c not in present})[columns]
    frame = load_records_jsonl(path / "records.jsonl")
    if columns is not None:
        frame = frame[columns]
    return manifest, frame.astype({c: "category" for c in categorical if c in frame.columns})
