"""Extract the small replay slice in tests/data from the raw H200 NVML recordings.

    python tests/data/make_h200_slice.py [path/to/nvml-traces-h200-2026-11-29]

Reads ``../shared/nvml-traces-h200-2026-11-29`` (relative to the repository root) by default and
writes ``tests/data/h200_trace.npz``, ``tests/data/h200_qtrace.npz`` and ``tests/data/h200_marks.json``.
What is kept (see tests/data/README.md):

- every driver power sample (``samp_ts_us``, ``samp_mW``; the recordings already hold each sample once);
- the energy-counter reads on both sides of every change of value, plus the first and last read:
  the counter's change points (knots) computed from this slice equal those of the full series
  (checked below);
- instant-power points: the first fast poll showing each new ``p_inst_mW`` value;
- (monotonic ns, wall µs) pairs: the fast poll nearest each sample-buffer poll, as a live sampler
  would record them;
- the marks from probe_meta.json / query_meta.json, and sha256 of every source file.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from ipw.telemetry.integrals import counter_change_points  # noqa: E402

DEFAULT_SRC = ROOT.parent / "shared" / "nvml-traces-h200-2026-11-29"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def counter_read_s(t_mono_ns: np.ndarray, call_ns: np.ndarray) -> np.ndarray:
    """A counter read is placed at the middle of its (3-4 ms) call."""
    return (t_mono_ns + call_ns / 2.0) / 1e9


def extract(src: Path, prefix: str) -> dict[str, np.ndarray]:
    fast = np.load(src / f"{prefix}_fast.npz")
    energy = np.load(src / f"{prefix}_energy.npz")

    # driver samples: unique, increasing (assert rather than assume)
    ts, mw = fast["samp_ts_us"], fast["samp_mW"]
    uniq, idx = np.unique(ts, return_index=True)
    ts, mw = uniq, mw[idx]

    # counter: reads on both sides of each change, plus the first and last read
    e = energy["e_mJ"]
    changed = np.flatnonzero(np.diff(e) != 0) + 1
    keep = np.unique(np.concatenate(([0, e.size - 1], changed - 1, changed)))
    t_full = counter_read_s(energy["t_mono_ns"], energy["call_ns"])
    t_keep = counter_read_s(energy["t_mono_ns"][keep], energy["call_ns"][keep])
    k_full = counter_change_points(t_full, e / 1e3)
    k_keep = counter_change_points(t_keep, e[keep] / 1e3)
    assert all(np.array_equal(a, b) for a, b in zip(k_full, k_keep)), "decimation changed the counter knots"

    # instant power: first fast poll showing each new value
    p_inst = fast["p_inst_mW"]
    inst_idx = np.concatenate(([0], np.flatnonzero(np.diff(p_inst) != 0) + 1))

    # clock pairs: the fast poll nearest each sample-buffer poll
    t_fast = fast["t_mono_ns"]
    calls = fast["samp_calls"][:, 0]
    j = np.clip(np.searchsorted(t_fast, calls), 0, t_fast.size - 1)
    j = np.unique(j)

    print(f"{prefix}: {ts.size} samples, {changed.size} counter changes ({keep.size} of {e.size} reads kept), "
          f"{inst_idx.size} instant points, {j.size} clock pairs")
    return {
        "samp_ts_us": ts.astype(np.int64),
        "samp_mW": mw.astype(np.int64),
        "energy_t_mono_ns": energy["t_mono_ns"][keep].astype(np.int64),
        "energy_call_ns": energy["call_ns"][keep].astype(np.int64),
        "energy_mJ": e[keep].astype(np.int64),
        "energy_reads_total": np.array(e.size, dtype=np.int64),
        "inst_t_mono_ns": t_fast[inst_idx].astype(np.int64),
        "inst_mW": p_inst[inst_idx].astype(np.int64),
        "pair_t_mono_ns": t_fast[j].astype(np.int64),
        "pair_t_wall_us": fast["t_wall_us"][j].astype(np.int64),
    }


def main(src: Path) -> None:
    for prefix in ("trace", "qtrace"):
        arrays = extract(src, prefix)
        np.savez_compressed(HERE / f"h200_{prefix}.npz", **arrays)

    probe = json.loads((src / "probe_meta.json").read_text())
    query = json.loads((src / "query_meta.json").read_text())
    marks = {
        "source": "nvml-traces-h200-2026-11-29 (NVIDIA H200, driver 580.159.04, in a VM)",
        "sha256": {p.name: sha256(p) for p in sorted(src.iterdir()) if p.is_file()},
        "trace": {
            "marks": probe["load"]["marks"],
            "t_matmul_s": probe["load"].get("t_matmul_s"),
            "mono_minus_wall_ns_at_end": probe.get("mono_minus_wall_ns_at_end"),
        },
        "qtrace": {
            "classes": query["classes"],
            "model_params_B": query.get("model_params_B"),
            "marks": query["marks"],
        },
    }
    (HERE / "h200_marks.json").write_text(json.dumps(marks, indent=1) + "\n")
    for p in sorted(HERE.glob("h200_*")):
        print(f"{p.name}: {p.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_SRC)
