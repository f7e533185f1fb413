"""Write the slices of H200 evidence that the tests replay (issue 57: the raw files left main's tree).

The raw run folders, counter traces and tarballs are on the ``evidence`` branch (commit cf65f0b, the last
main commit that held them); this script reads them from there with ``git show`` and keeps only what the
tests use: the power samples and counter reads of each run (``kind``, ``t_s``, ``power_w``, ``energy_j``),
the runs' query spans (``start_s``, ``end_s``), and the back-to-back counter (``t_before_s``, ``t_after_s``,
``energy_mj`` of GPU 0) over the runs' span and a margin, each column as pandas read it (so the replays
compute on the same floats)::

    .venv/bin/python tests/data/make_evidence_slices.py [REF]    # REF: evidence (default)

Each slice is one compressed .npz; a table's columns are stored as ``<table>__<column>``
(tests/evidence_slices.py reads them back as DataFrames).
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd

DATA = Path(__file__).resolve().parent
EVIDENCE = "bench/evidence"
#: counter reads kept before the first and after the last power sample of the runs (s): the replays read the
#: counter inside the runs' spans; the margin keeps the reads that bracket their edges
MARGIN_S = 2.0


def raw(ref: str, path: str) -> bytes:
    return subprocess.run(["git", "show", f"{ref}:{EVIDENCE}/{path}"], cwd=DATA, check=True, capture_output=True).stdout


def power_table(data: bytes) -> pd.DataFrame:
    p = pd.read_parquet(io.BytesIO(data))
    p = p[p["kind"].isin(["sample", "counter"])]
    return p[["kind", "t_s", "power_w", "energy_j"]].reset_index(drop=True)


def counter_table(data: bytes, gzipped: bool, power: list[pd.DataFrame]) -> pd.DataFrame:
    c = pd.read_csv(io.BytesIO(data), compression="gzip" if gzipped else None)
    c = c[c["gpu"] == 0]
    lo = min(float(p["t_s"].min()) for p in power) - MARGIN_S
    hi = max(float(p["t_s"].max()) for p in power) + MARGIN_S
    c = c[(c["t_after_s"] >= lo) & (c["t_before_s"] <= hi)]
    return c[["t_before_s", "t_after_s", "energy_mj"]].reset_index(drop=True)


def save(name: str, tables: dict[str, pd.DataFrame]) -> None:
    arrays = {f"{t}__{col}": df[col].to_numpy() for t, df in tables.items() for col in df.columns}
    arrays = {k: (v.astype(str) if v.dtype == object else v) for k, v in arrays.items()}
    np.savez_compressed(DATA / name, **arrays)
    print(f"{name}: {(DATA / name).stat().st_size} bytes, {len(tables)} tables")


def untar(data: bytes) -> dict[str, bytes]:
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tf:
        for m in tf.getmembers():
            f = tf.extractfile(m)
            if f is not None:
                out[m.name] = f.read()
    return out


def main(ref: str) -> None:
    # tests/telemetry/test_uncertainty.py: the sampler's counter reads of two 2026-12-01 H200 runs on the update grid
    gpu = "telemetry/gpu/h200-2026-12-01"
    runs = ("20261201-053743-d827", "20261201-053807-923e")
    tables = {}
    for run in runs:
        tables[f"{run}-power"] = power_table(raw(ref, f"{gpu}/runs/{run}/power.parquet"))
        tables[f"{run}-records"] = pd.read_parquet(io.BytesIO(raw(ref, f"{gpu}/runs/{run}/records.parquet")))[["end_s"]]
    tables["counter"] = counter_table(raw(ref, f"{gpu}/counter.csv"), False, [tables[f"{r}-power"] for r in runs])
    save("h200-2026-12-01-grid.npz", tables)

    # tests/telemetry/test_uncertainty.py: the vLLM in-process run of 2026-12-04
    folder = "serving/vllm-h200-2026-12-04"
    files = untar(raw(ref, f"{folder}/vllm-rest.tar.xz"))
    name = next(n for n in files if n.startswith("./inproc/") and n.endswith("/power.parquet"))
    power = power_table(files[name])
    save(
        "vllm-h200-2026-12-04-inproc.npz",
        {"power": power, "counter": counter_table(raw(ref, f"{folder}/counter-rest.csv.gz"), True, [power])},
    )

    # tests/telemetry/test_energy_audit.py: the three fresh 2026-12-01 H200 runs (session 5) and their counter
    gpu = "telemetry/gpu/h200-2026-12-01-s5"
    s5_runs = ("20261201-214947-e2a7", "20261201-215011-bee2", "20261201-215035-750e")
    tables = {}
    for run in s5_runs:
        tables[f"{run}-power"] = power_table(raw(ref, f"{gpu}/runs/{run}/power.parquet"))
        r = pd.read_parquet(io.BytesIO(raw(ref, f"{gpu}/runs/{run}/records.parquet")))
        tables[f"{run}-records"] = r[["start_s", "end_s"]]
    tables["counter"] = counter_table(raw(ref, f"{gpu}/counter.csv.gz"), True, [tables[f"{r}-power"] for r in s5_runs])
    save("h200-2026-12-01-s5-runs.npz", tables)

    # tests/telemetry/test_energy_audit.py: the five fake-engine runs of bench/telemetry/audit_h200.sh (2026-12-02)
    files = untar(raw(ref, "telemetry/gpu/h200-2026-12-02-s8/audit-runs.tgz"))
    tables = {}
    for n in sorted(files):
        if n.startswith("./runs-main/") and n.endswith("/power.parquet"):
            run = n.split("/")[2]
            tables[f"{run}-power"] = power_table(files[n])
            r = pd.read_json(io.BytesIO(files[n.replace("power.parquet", "records.jsonl")]), lines=True)
            tables[f"{run}-records"] = r[["start_s", "end_s"]]
    save("h200-2026-12-02-s8-audit-runs.npz", tables)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "evidence")
