"""The package ipw/results/ is the only one that names a run folder's files (issue 31): every other module reads
and writes them through ``RunFolder`` methods and the package's readers (``load_run``, ``read_judge``,
``read_power``, ``read_log``, ``read_record_fields``, ...).  A grep, like tests/backends/test_capabilities.py's."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ipw"
FILES = ("manifest.json", "records.jsonl", "records.parquet", "power.parquet", "judge.jsonl", "queries.parquet",
         "records.dropped.jsonl", "ipw.lock", "pending.jsonl")
# a file's name as a string of its own ("records.jsonl", 'power.parquet'), or the package's constant for it
NAMED = re.compile(r"""["'](%s)["']|\b(QUERIES_FILE|JUDGE_FILE|POWER_FILE|LOCK_FILE|PENDING_FILE)\b"""
                   % "|".join(re.escape(f) for f in FILES))

#: Modules that still name a run-folder file, and why.  Shrink it; never grow it.  (Empty since issue 31's
#: one pass of ipw run: the runner and commands/run.py go through RunFolder.keep_queries, records_of,
#: read_kept_queries, repair_log and the typed manifest.)
NOT_YET: set[str] = set()


def offenders() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if NAMED.search(line):
                out.setdefault(rel, []).append(f"{rel}:{number}: {line.strip()}")
    return out


def test_only_results_names_run_folder_files():
    found = offenders()
    assert any(k.startswith("ipw/results/") for k in found)  # the pattern finds the owner's own names
    outside = {k: v for k, v in found.items() if not k.startswith("ipw/results/") and k not in NOT_YET}
    assert not outside, "open run-folder files through ipw/results/ (RunFolder, load_run, read_*):\n" + "\n".join(
        line for lines in outside.values() for line in lines)


def test_the_pattern_catches_a_path_built_by_name():
    assert NAMED.search('frame = read_parquet(Path(run) / "records.parquet")')
    assert NAMED.search("shutil.copy2(src / 'power.parquet', dst)")
    assert NAMED.search("folder.path / JUDGE_FILE")
    assert not NAMED.search('help="drop the damaged lines of the run\'s records.jsonl (torn ...)"')
