"""Issue 57, item 5: the tree a newcomer clones stays small.

Main's tree holds the code, the pages and, in bench/evidence/, each folder's README and summaries; the bulky
raw files of a measurement (tarballs, Parquet, HTML reports, counter traces, run records) go to the branch
``evidence`` (bench/evidence/README.md), and a test replays a slice of them under tests/data/.  Budgets:

- no tracked file over 1 MB;
- the tracked files, all together, at most 12 MB (11.0 MB when this was written);
- each evidence folder (bench/evidence/<question>/<folder>/; under telemetry/gpu/, one per device session) at
  most 500 kB, except the two recordings that bench/telemetry/uncertainty_fit.py and tests/telemetry/test_uncertainty.py
  replay whole (``EVIDENCE_BUDGETS``);
- no tarball, Parquet file or HTML report in bench/evidence/.

The sizes are the working tree's files that git tracks (``git ls-files``), as ``du -b`` counts them.
"""

from __future__ import annotations

import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EVIDENCE = "bench/evidence/"
MAX_FILE_BYTES = 1_000_000
MAX_TRACKED_BYTES = 12_000_000
MAX_EVIDENCE_FOLDER_BYTES = 500_000
#: folders over the default budget, each with why: the fit's recordings (counter traces and the sampler's
#: signals), which tests/telemetry/test_uncertainty.py replays in full (its coverage checks count every window)
EVIDENCE_BUDGETS = {
    "telemetry/h200-attribution": 1_200_000,  # 1.12 MB when this was written
    "telemetry/h200-loads": 3_200_000,  # 3.15 MB
}
#: folders of folders: each of their sub-folders is one evidence folder
EVIDENCE_GROUPS = ("telemetry/gpu",)
RAW_SUFFIXES = (".tgz", ".tar.gz", ".tar.xz", ".tar.bz2", ".zip", ".parquet", ".html")


@pytest.fixture(scope="module")
def tracked() -> dict[str, int]:
    """{path: bytes} of every tracked file present in the working tree."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    sizes = {}
    for name in out.decode("utf-8", "surrogateescape").split("\0"):
        path = ROOT / name
        if name and path.is_file() and not path.is_symlink():
            sizes[name] = path.stat().st_size
    if not sizes:
        pytest.skip("not a git checkout")
    return sizes


def evidence_folder(path: str) -> str | None:
    """The evidence folder a file of bench/evidence/ belongs to (``serving/h200-2026-12-04``), or None."""
    parts = path.removeprefix(EVIDENCE).split("/")
    depth = 3 if "/".join(parts[:2]) in EVIDENCE_GROUPS else 2
    return "/".join(parts[:depth]) if len(parts) > depth else None


def test_no_tracked_file_over_1_mb(tracked):
    big = {p: n for p, n in tracked.items() if n > MAX_FILE_BYTES}
    assert not big, f"tracked files over {MAX_FILE_BYTES} bytes (raw evidence goes to the branch `evidence`): {big}"


def test_tracked_files_fit_12_mb(tracked):
    total = sum(tracked.values())
    largest = sorted(tracked.items(), key=lambda x: -x[1])[:10]
    assert total <= MAX_TRACKED_BYTES, f"{total} bytes tracked; the largest: {largest}"


def test_every_evidence_folder_within_its_budget(tracked):
    sizes: dict[str, int] = defaultdict(int)
    for path, n in tracked.items():
        folder = evidence_folder(path) if path.startswith(EVIDENCE) else None
        if folder is not None:
            sizes[folder] += n
    assert len(sizes) > 20 and set(EVIDENCE_BUDGETS) <= set(sizes)
    over = {f: n for f, n in sizes.items() if n > EVIDENCE_BUDGETS.get(f, MAX_EVIDENCE_FOLDER_BYTES)}
    assert not over, f"evidence folders over their budget (move their raw files to the branch `evidence`): {over}"


def test_no_raw_archives_or_reports_in_evidence(tracked):
    raw = sorted(p for p in tracked if p.startswith(EVIDENCE) and p.endswith(RAW_SUFFIXES))
    assert not raw, f"raw files belong on the branch `evidence` (bench/evidence/README.md): {raw}"


def test_evidence_folder_of_a_path():
    assert evidence_folder("bench/evidence/serving/h200-2026-12-04/README.md") == "serving/h200-2026-12-04"
    assert evidence_folder("bench/evidence/telemetry/gpu/h200-2026-12-01/runs/x/manifest.json") == (
        "telemetry/gpu/h200-2026-12-01"
    )
    assert evidence_folder("bench/evidence/README.md") is None
