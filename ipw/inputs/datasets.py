"""Queries and query sets: the bundled set and users' own files (JSONL, CSV, Parquet).

Interchange format (one JSON object per line): ``id``, ``prompt``, ``answer`` and optional
``choices`` (option texts, lettered A, B, C... in order), ``category``, ``scorer``.  ``answer`` may be
empty or missing only for scorer ``judge`` (graded by an LLM judge against a reference backend's
answer; see :mod:`ipw.grading.scoring`).
"""

from __future__ import annotations

import csv
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ipw.errors import IpwError, where
from ipw.inputs.resources import resource_path

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

DATASETS_DIR = resource_path("data")  # ships in the package (ipw/data, written by datasets/generate.py)
# short name -> (file, optional file of the ids to keep)
BUNDLED = {
    "ipw-core": ("ipw-core.jsonl", None),
    "ipw-core-default": ("ipw-core.jsonl", "ipw-core-default.txt"),
    "ipw-long": ("ipw-long.jsonl", None),  # 30 prompts with long answers (essays, counting, lists): docs/GPU.md
}
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
REQUIRED = ("id", "prompt", "answer")
OPTIONAL = ("choices", "category", "scorer")
MAX_LINE_BYTES = 1_000_000
MAX_FILE_BYTES = 2 * 1024**3  # a dataset file larger than this is refused before it is read
MAX_QUERIES = 1_000_000  # rows read before a file is refused as too large a query set


@dataclass(frozen=True)
class Query:
    id: str
    prompt: str
    answer: str
    choices: tuple[str, ...] | None = None
    category: str = "default"
    scorer: str = "exact"

    def render(self) -> str:
        """The text sent to the model: the prompt, then the lettered options for multiple choice."""
        if not self.choices:
            return self.prompt
        options = "\n".join(f"({LETTERS[i]}) {c}" for i, c in enumerate(self.choices))
        return f"{self.prompt}\n{options}\nAnswer with the letter of the correct option."


def resolve_dataset(name_or_path: str) -> Path:
    """A bundled set's short name, or a path to a user's file."""
    if name_or_path in BUNDLED:
        return DATASETS_DIR / BUNDLED[name_or_path][0]
    path = Path(name_or_path)
    if not path.exists():
        known = ", ".join(sorted(BUNDLED))
        raise IpwError(f"{path}: dataset not found (bundled sets: {known})")
    if not path.is_dir():
        _check_regular_file(path)
    return path


def _check_regular_file(path: Path) -> None:
    """A dataset is a regular file of bounded size: a device (``/dev/zero``), a pipe (``/dev/stdin``) or a
    socket is refused before anything is read from it."""
    import stat

    try:
        info = path.stat()
    except OSError as exc:
        raise IpwError(f"{path}: cannot read the dataset ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = ("a character device" if stat.S_ISCHR(info.st_mode) else "a pipe" if stat.S_ISFIFO(info.st_mode)
                else "a socket" if stat.S_ISSOCK(info.st_mode) else "not a file")
        raise IpwError(f"{path}: not a regular file ({kind}); save the queries to a .jsonl, .csv or .parquet "
                       "file and pass that")
    if info.st_size > MAX_FILE_BYTES:
        raise IpwError(f"{path}: {info.st_size} bytes, more than the {MAX_FILE_BYTES} a dataset file may hold")


def _query_from_row(row: object, path: Path, line: int, default_scorer: str) -> Query:
    from ipw.grading.scoring import JUDGE, KNOWN_SCORERS

    if not isinstance(row, dict):
        raise IpwError(f"{where(path, line)}: expected a JSON object, got {type(row).__name__}")
    # a judge-scored item (open-ended, graded against a reference backend's answer) may have no answer
    judged = (row.get("scorer") or (None if row.get("choices") else default_scorer)) == JUDGE
    for key in (k for k in REQUIRED if not (judged and k == "answer")):
        if key not in row or row[key] is None or row[key] == "":
            raise IpwError(f"{where(path, line, key)}: required field is missing")
        if isinstance(row[key], str) and not row[key].strip():
            raise IpwError(f"{where(path, line, key)}: required field is blank (only whitespace)")
    for key, value in row.items():
        for text in value if isinstance(value, list) else [value]:
            _check_text(text, path, line, key)
    unknown = sorted(set(row) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise IpwError(f"{where(path, line, unknown[0])}: unknown field (allowed: {', '.join(REQUIRED + OPTIONAL)})")
    for key in ("id", "prompt", "answer"):
        value = row.get(key, "")
        if key == "answer" and value is None:
            continue  # judge-scored: absent
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise IpwError(f"{where(path, line, key)}: expected a string, got {type(value).__name__}")
    choices = row.get("choices")
    if choices is not None and choices != "":
        if isinstance(choices, str):  # CSV cells hold JSON lists
            try:
                choices = json.loads(choices)
            except json.JSONDecodeError:
                raise IpwError(f"{where(path, line, 'choices')}: expected a JSON list of strings") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise IpwError(f"{where(path, line, 'choices')}: expected a non-empty list of strings")
        if len(choices) > len(LETTERS):
            raise IpwError(f"{where(path, line, 'choices')}: at most {len(LETTERS)} options")
        choices = tuple(choices)
    else:
        choices = None
    scorer = row.get("scorer") or ("mcq" if choices else default_scorer)
    if not isinstance(scorer, str) or scorer not in KNOWN_SCORERS:
        raise IpwError(f"{where(path, line, 'scorer')}: unknown scorer {scorer!r} "
                       f"(known: {', '.join(sorted(KNOWN_SCORERS))})")
    answer = "" if row.get("answer") is None else str(row["answer"]).strip()
    if scorer == "mcq":
        if not choices:
            raise IpwError(f"{where(path, line, 'choices')}: scorer 'mcq' needs a list of choices")
        letter = answer.upper()
        if len(letter) != 1 or letter not in LETTERS[: len(choices)]:
            raise IpwError(f"{where(path, line, 'answer')}: for 'mcq' the answer must be a letter A-{LETTERS[len(choices) - 1]}")
        answer = letter
    else:
        from ipw.grading.scoring import check_answer

        try:
            check_answer(scorer, answer)  # a numeric answer is a number, a regex compiles
        except IpwError as exc:
            raise IpwError(f"{where(path, line, 'answer')}: {exc.message}") from None
    category = row.get("category") or "default"
    if not isinstance(category, str):
        raise IpwError(f"{where(path, line, 'category')}: expected a string")
    return Query(str(row["id"]), str(row["prompt"]), answer, choices, category, scorer)


def bounded_lines(fh, path: Path, limit: int = MAX_LINE_BYTES):
    """The lines of an open file, each read with at most ``limit`` + 1 bytes (or characters): a line
    longer than ``limit`` is an error as soon as that much of it has been read, never after the whole
    line is in memory (``/dev/zero``, a file without newlines)."""
    line_no = 0
    while True:
        raw = fh.readline(limit + 1)
        if not raw:
            return
        line_no += 1
        if len(raw) > limit:
            raise IpwError(f"{where(path, line_no)}: line is longer than {limit} bytes")
        yield raw


def _check_text(value: object, path: Path, line: int, key: str) -> None:
    """Text that can be sent and stored: a lone surrogate (JSON ``"\\ud800"``) is not."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise IpwError(f"{where(path, line, key)}: a lone surrogate {ascii(value[exc.start])[1:-1]} at "
                           f"character {exc.start + 1}; not text (fix the file's escapes)") from None


def _rows_jsonl(path: Path):
    with path.open("rb") as fh:
        for line_no, raw in enumerate(bounded_lines(fh, path), start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise IpwError(f"{where(path, line_no)}: not valid UTF-8 (byte {exc.start})") from None
            if not text.strip():
                continue
            try:
                yield line_no, json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
            except json.JSONDecodeError as exc:
                raise IpwError(f"{where(path, line_no)}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            except _StrictJsonError as exc:
                raise IpwError(f"{where(path, line_no)}: invalid JSON ({exc})") from None
            except RecursionError:
                raise IpwError(f"{where(path, line_no)}: invalid JSON (nested too deeply)") from None


class _StrictJsonError(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _StrictJsonError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> None:
    raise _StrictJsonError(f"{name} is not a JSON number")


def _rows_csv(path: Path):
    try:
        # utf-8-sig: a byte-order mark (Excel writes one) is not part of the first column's name
        with path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(bounded_lines(fh, path))
            for row in reader:
                line = reader.line_num  # the row's last physical line (a quoted cell may span lines)
                if None in row:
                    header = len(reader.fieldnames or ())  # read with the first row
                    raise IpwError(f"{where(path, line)}: {header + len(row[None])} fields, but the "
                                   f"header has {header}")
                if None in row.values():
                    have = sum(v is not None for v in row.values())
                    header = len(reader.fieldnames or ())
                    raise IpwError(f"{where(path, line)}: {have} fields, but the header has {header}")
                yield line, {k: v for k, v in row.items() if v != ""}
    except UnicodeDecodeError as exc:
        raise IpwError(f"{path}: not valid UTF-8 (byte {exc.start})") from None
    except csv.Error as exc:
        raise IpwError(f"{path}: invalid CSV ({exc})") from None


def _rows_parquet(path: Path):
    import pandas as pd

    try:
        frame = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises many types for a broken file
        raise IpwError(f"{path}: cannot read Parquet ({exc})") from None
    for i, row in enumerate(frame.to_dict(orient="records"), start=1):
        clean = {}
        for key, value in row.items():
            if value is None or (isinstance(value, float) and value != value):
                continue
            clean[key] = list(value) if hasattr(value, "tolist") and not isinstance(value, str) else value
        yield i, clean


def load_queries(
    name_or_path: str, default_scorer: str = "exact", *, preset: str | None = None, split: str | None = None,
    categories: tuple[str, ...] = (), sample: int = 0, seed: int = 0,
) -> list[Query]:
    """Load and validate a query set; raises :class:`IpwError` naming file, line and field.

    ``preset``: a schema preset of :mod:`ipw.inputs.presets` (``mmlu``, ``gsm8k``, ...), or None to detect one
    by the columns (said in a log line; the interchange format needs none).  A folder is read as a
    Hugging Face ``save_to_disk`` folder (``split`` picks a split of a DatasetDict).  ``categories``
    and ``sample`` (seeded by ``seed``) select queries, see :func:`ipw.inputs.presets.select`.
    """
    from ipw.inputs import presets

    path = resolve_dataset(name_or_path)
    if path.is_dir():
        rows = presets.read_hf_folder(path, split)
    else:
        if split is not None:
            raise IpwError(f"{path}: --split applies to a Hugging Face save_to_disk folder, not to a file")
        suffix = path.suffix.lower()
        readers = {".jsonl": _rows_jsonl, ".json": _rows_jsonl, ".csv": _rows_csv, ".parquet": _rows_parquet}
        if suffix not in readers:
            raise IpwError(f"{path}: unsupported file type {suffix!r} (use .jsonl, .csv, .parquet or a "
                           "save_to_disk folder)")
        try:
            rows = []
            for line_no, row in readers[suffix](path):
                if len(rows) >= MAX_QUERIES:
                    raise IpwError(f"{where(path, line_no)}: more than {MAX_QUERIES} queries; split the set")
                rows.append((path, line_no, row))
        except PermissionError:
            raise IpwError(f"{path}: permission denied") from None
    rows = presets.convert_rows(rows, preset, path)
    queries: list[Query] = []
    seen: dict[str, int] = {}
    for file, line_no, row in rows:
        query = _query_from_row(row, file, line_no, default_scorer)
        if query.id in seen:
            raise IpwError(f"{where(file, line_no, 'id')}: duplicate id {query.id!r} (first on line {seen[query.id]})")
        seen[query.id] = line_no
        queries.append(query)
    if not queries:
        raise IpwError(f"{path}: the dataset is empty")
    subset = BUNDLED.get(name_or_path, (None, None))[1]
    if subset:
        keep = (DATASETS_DIR / subset).read_text().split()
        queries = [q for q in queries if q.id in set(keep)]
    return presets.select(queries, tuple(categories), sample, seed)


def fingerprint(queries: list[Query]) -> str:
    """A hash of the queries' content (order-independent), used to refuse comparing different sets."""
    digest = hashlib.sha256()
    for q in sorted(queries, key=lambda q: q.id):
        digest.update(json.dumps([q.id, q.prompt, q.answer, q.choices, q.category, q.scorer]).encode())
    return "sha256:" + digest.hexdigest()[:16]


@dataclass(frozen=True)
class QuerySet:
    """A run's queries as loaded: from ``name`` (its ``source`` file; None: a folder or a run folder's copy),
    with their manifest entry (``entry``).  The fingerprint is computed once, when first asked for, unless
    it is ``known`` (a run folder's checked copy of its queries)."""

    name: str
    queries: list[Query]
    source: Path | None = None
    known: str = ""

    @functools.cached_property
    def fingerprint(self) -> str:
        return self.known or fingerprint(self.queries)

    def __len__(self) -> int:
        return len(self.queries)

    def ids(self) -> pa.Array:
        """The queries' ids, in order, for ``--resume``'s filter (``results.DoneKeys.left``)."""
        import pyarrow as pa

        return pa.array([q.id for q in self.queries], pa.string())

    def take(self, rows: np.ndarray) -> list[Query]:
        return [self.queries[i] for i in rows.tolist()]

    def entry(self) -> dict[str, object]:
        """The manifest's ``dataset`` entry."""
        return {"name": self.name, "n_queries": len(self.queries), "fingerprint": self.fingerprint,
                "categories": sorted({q.category for q in self.queries})}


def load_query_set(name_or_path: str, *, limit: int = 0, **options: Any) -> QuerySet:
    """A run's query set: ``load_queries`` with the config's options (``RunConfig.dataset_options``), cut to
    the first ``limit`` queries (0: all)."""
    queries = load_queries(name_or_path, **options)
    path = resolve_dataset(name_or_path)
    return QuerySet(name_or_path, queries[:limit] if limit else queries, path if path.is_file() else None)
