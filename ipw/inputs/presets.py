"""Schema presets: the public layouts of popular benchmarks, turned into ipw's interchange rows.

A preset maps one source row (a dict read from JSONL, CSV, Parquet or a Hugging Face
``save_to_disk`` folder) to an interchange row (``id``, ``prompt``, ``answer``, ``choices``,
``category``, ``scorer``), which :mod:`ipw.inputs.datasets` then validates as usual.  Columns a preset does
not use are ignored.  Nothing is downloaded: users point at files they have.

| preset | columns used | answer | scorer |
|---|---|---|---|
| ``mmlu`` | question, choices (list), answer (index 0.. or letter), subject | letter | mcq |
| ``mmlu-pro`` | question, options (list), answer (letter) or answer_index, category, question_id | letter | mcq |
| ``arc`` | question, choices ({label: [...], text: [...]}), answerKey, id | letter of answerKey's position | mcq |
| ``gsm8k`` | question, answer (worked solution ending ``#### N``) | text after the last ``####`` | numeric |
| ``math`` | problem, solution (containing ``\\boxed{...}``), type or subject, unique_id | last boxed content | numeric / exact |
| ``problem-answer`` | problem, answer, subject, unique_id | answer | numeric / exact |
| ``ipw`` | the interchange format itself | | |

``numeric / exact``: ``numeric`` when the answer is a plain number (``12``, ``-3.5``, ``1,234``,
``3/4``), else ``exact``.  Free-form presets (gsm8k, math, problem-answer) append
:data:`ANSWER_SUFFIX` to the question so the final answer can be found.  Rows without an id column get
``<preset>-<row index from 0>``.  CSV cells that hold lists or the ARC choices table are JSON.
"""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

from ipw.errors import IpwError, where

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
ANSWER_SUFFIX = 'End your reply with "The answer is: " followed by the final answer.'
SPLIT_ORDER = ("test", "validation", "train")
_NUMBER = re.compile(r"^[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+|\d+\s*/\s*\d+)$")

Row = dict[str, Any]
Loc = Callable[[str], str]  # field -> "file:line: field 'x'"


def note(message: str) -> None:
    """A one-line log on stderr (what was detected or chosen)."""
    print(f"note: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# value helpers: every error names file, line and field


def _plain(value: Any) -> Any:
    """numpy arrays/scalars (from pandas) -> Python lists/scalars, recursively."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, str):
        return _plain(value.tolist())
    return value


def _decoded(value: Any) -> Any:
    """A CSV cell holding a JSON list or table is decoded; anything else is returned as is."""
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return _plain(value)


def _text(row: Row, key: str, loc: Loc) -> str:
    value = row.get(key)
    if value is None or value == "":
        raise IpwError(f"{loc(key)}: required field is missing")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise IpwError(f"{loc(key)}: expected a string, got {type(value).__name__}")
    return str(value).strip()


def _str_list(row: Row, key: str, loc: Loc) -> list[str]:
    value = _decoded(row.get(key))
    if value is None or value == "":
        raise IpwError(f"{loc(key)}: required field is missing")
    if not isinstance(value, list) or not value or not all(isinstance(v, (str, int, float)) for v in value):
        raise IpwError(f"{loc(key)}: expected a non-empty list of strings")
    if len(value) > len(LETTERS):
        raise IpwError(f"{loc(key)}: at most {len(LETTERS)} options")
    return [str(v) for v in value]


def _letter(value: Any, n: int, key: str, loc: Loc) -> str:
    """An answer given as an option index (0-based int or digit string) or a letter."""
    value = _plain(value)
    if isinstance(value, bool) or value is None or value == "":
        raise IpwError(f"{loc(key)}: required field is missing")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, int):
        if not 0 <= value < n:
            raise IpwError(f"{loc(key)}: option index {value} out of range 0-{n - 1}")
        return LETTERS[value]
    if isinstance(value, str) and len(value.strip()) == 1 and value.strip().upper() in LETTERS[:n]:
        return value.strip().upper()
    raise IpwError(f"{loc(key)}: expected an option index 0-{n - 1} or a letter A-{LETTERS[n - 1]}, got {value!r}")


def _id(row: Row, keys: tuple[str, ...], preset: str, index: int) -> str:
    for key in keys:
        value = _plain(row.get(key))
        if value is not None and value != "" and not isinstance(value, (list, dict)):
            return str(value)
    return f"{preset}-{index}"


def _category(row: Row, keys: tuple[str, ...], default: str) -> str:
    for key in keys:
        value = row.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return default


def _free_form(answer: str) -> str:
    return "numeric" if _NUMBER.match(answer.strip()) else "exact"


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces included."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*", text)]
    for start in reversed(starts):
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, len(text)):
                if text[i] == "{":
                    depth += 1
                elif text[i] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[start + 1:i].strip()
            continue  # unbalanced: try an earlier one
        m = re.match(r"[^\s$]+", text[start:])  # "\boxed 5"
        if m:
            return m.group(0)
    return None


# --------------------------------------------------------------------------------------------
# presets


def _mmlu(row: Row, index: int, loc: Loc) -> Row:
    choices = _str_list(row, "choices", loc)
    return {"id": _id(row, ("id",), "mmlu", index), "prompt": _text(row, "question", loc), "choices": choices,
            "answer": _letter(row.get("answer"), len(choices), "answer", loc),
            "category": _category(row, ("subject", "category"), "mmlu"), "scorer": "mcq"}


def _mmlu_pro(row: Row, index: int, loc: Loc) -> Row:
    choices = _str_list(row, "options", loc)
    key = "answer" if row.get("answer") not in (None, "") else "answer_index"
    return {"id": _id(row, ("question_id", "id"), "mmlu-pro", index), "prompt": _text(row, "question", loc),
            "choices": choices, "answer": _letter(row.get(key), len(choices), key, loc),
            "category": _category(row, ("category", "subject"), "mmlu-pro"), "scorer": "mcq"}


def _arc(row: Row, index: int, loc: Loc) -> Row:
    table = _decoded(row.get("choices"))
    if not isinstance(table, dict) or not isinstance(table.get("text"), list) or not isinstance(table.get("label"), list):
        raise IpwError(f"{loc('choices')}: expected a table {{\"label\": [...], \"text\": [...]}}")
    texts, labels = [str(t) for t in table["text"]], [str(x).strip() for x in table["label"]]
    if not texts or len(texts) != len(labels) or len(texts) > len(LETTERS):
        raise IpwError(f"{loc('choices')}: 'label' and 'text' must be non-empty lists of the same length")
    key = _text(row, "answerKey", loc)
    if key not in labels:
        raise IpwError(f"{loc('answerKey')}: {key!r} is not one of the labels {labels}")
    return {"id": _id(row, ("id",), "arc", index), "prompt": _text(row, "question", loc), "choices": texts,
            "answer": LETTERS[labels.index(key)], "category": _category(row, ("category", "subject"), "arc"),
            "scorer": "mcq"}


def _gsm8k(row: Row, index: int, loc: Loc) -> Row:
    solution = _text(row, "answer", loc)
    if "####" not in solution:
        raise IpwError(f"{loc('answer')}: no final answer after '####'")
    answer = solution.rsplit("####", 1)[1].strip()
    if not answer:
        raise IpwError(f"{loc('answer')}: nothing after '####'")
    return {"id": _id(row, ("id",), "gsm8k", index), "prompt": f"{_text(row, 'question', loc)}\n{ANSWER_SUFFIX}",
            "answer": answer, "category": _category(row, ("category",), "gsm8k"), "scorer": _free_form(answer)}


def _math(row: Row, index: int, loc: Loc) -> Row:
    answer = last_boxed(_text(row, "solution", loc))
    if not answer:
        raise IpwError(f"{loc('solution')}: no \\boxed{{...}} answer")
    return {"id": _id(row, ("unique_id", "id"), "math", index), "prompt": f"{_text(row, 'problem', loc)}\n{ANSWER_SUFFIX}",
            "answer": answer, "category": _category(row, ("type", "subject", "category"), "math"),
            "scorer": _free_form(answer)}


def _problem_answer(row: Row, index: int, loc: Loc) -> Row:
    answer = _text(row, "answer", loc)
    return {"id": _id(row, ("unique_id", "id"), "problem", index),
            "prompt": f"{_text(row, 'problem', loc)}\n{ANSWER_SUFFIX}", "answer": answer,
            "category": _category(row, ("subject", "type", "category"), "default"), "scorer": _free_form(answer)}


@dataclass(frozen=True)
class Preset:
    name: str
    columns: frozenset[str]  # columns that must all be present (and identify the layout)
    convert: Callable[[Row, int, Loc], Row] | None  # None: the interchange format itself
    description: str


# Detection tries these in order (most specific first); the first whose columns are all present wins.
PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("ipw", frozenset({"prompt", "answer"}), None, "ipw interchange format: id, prompt, answer[, choices, ...]"),
    Preset("mmlu-pro", frozenset({"question", "options"}), _mmlu_pro, "MMLU-Pro: question, options, answer letter"),
    Preset("arc", frozenset({"question", "choices", "answerKey"}), _arc, "ARC: question, choices{label,text}, answerKey"),
    Preset("mmlu", frozenset({"question", "choices", "answer"}), _mmlu, "MMLU: question, choices, answer index"),
    Preset("gsm8k", frozenset({"question", "answer"}), _gsm8k, "GSM8K: question, answer ending '#### N'"),
    Preset("problem-answer", frozenset({"problem", "answer"}), _problem_answer, "problem, answer[, subject]"),
    Preset("math", frozenset({"problem", "solution"}), _math, "MATH: problem, solution with \\boxed{answer}"),
)}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise IpwError(f"--dataset-preset {name!r}: unknown preset (known: {', '.join(PRESETS)})")
    return PRESETS[name]


def detect(columns: set[str]) -> Preset | None:
    """The first preset whose columns are all present; None when none matches."""
    if "prompt" in columns:  # the interchange format (errors are reported by its own validation)
        return PRESETS["ipw"]
    return next((p for p in PRESETS.values() if p.columns <= columns), None)


def convert_rows(rows: list[tuple[Path, int, Any]], preset: str | None, source: Path) -> list[tuple[Path, int, Any]]:
    """Source rows -> interchange rows, by the named preset or the one detected from the columns
    (said in a log line).  With no match the rows pass unchanged (interchange validation reports)."""
    columns = set().union(*(r.keys() for _, _, r in rows if isinstance(r, dict)))
    if preset is None:
        chosen = detect(columns)
        if chosen is None or chosen.convert is None:
            return rows
        note(f"{source}: detected dataset preset '{chosen.name}' ({chosen.description}) from columns "
             f"{', '.join(sorted(chosen.columns))}; --dataset-preset overrides")
    else:
        chosen = get_preset(preset)
        missing = sorted(chosen.columns - columns)
        if missing and rows:
            raise IpwError(f"{where(rows[0][0], rows[0][1], missing[0])}: preset '{chosen.name}' needs columns "
                           f"{', '.join(sorted(chosen.columns))} (found: {', '.join(sorted(columns)) or 'none'})")
        if chosen.convert is None:
            return rows
    out = []
    for index, (path, line, row) in enumerate(rows):
        if isinstance(row, dict):
            row = chosen.convert(row, index, partial(where, path, line))
        out.append((path, line, row))
    return out


# --------------------------------------------------------------------------------------------
# Hugging Face save_to_disk folders


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IpwError(f"{path}: cannot read ({exc.__class__.__name__}: {exc})") from None


def _read_arrow(path: Path):
    import pyarrow as pa

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise IpwError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        return pa.ipc.open_stream(pa.BufferReader(data)).read_all()  # what save_to_disk writes
    except pa.ArrowInvalid:
        try:
            return pa.ipc.open_file(pa.BufferReader(data)).read_all()
        except pa.ArrowInvalid as exc:
            raise IpwError(f"{path}: not an Arrow IPC stream or file ({exc})") from None


def read_hf_folder(folder: Path, split: str | None = None) -> list[tuple[Path, int, Row]]:
    """Rows of a ``Dataset.save_to_disk`` folder (state.json + *.arrow), or of one split of a
    ``DatasetDict`` folder (dataset_dict.json + one folder per split; default test, validation,
    train).  Row numbers in errors count from 1 within each .arrow file; nulls count as absent."""
    dict_file = folder / "dataset_dict.json"
    if dict_file.exists():
        splits = _read_json(dict_file).get("splits") or sorted(p.name for p in folder.iterdir() if p.is_dir())
        if split is None:
            split = next((s for s in SPLIT_ORDER if s in splits), splits[0] if splits else None)
            note(f"{folder}: using split '{split}' (splits: {', '.join(splits)}); --split chooses another")
        if split is None or split not in splits:
            raise IpwError(f"{folder}: no split {split!r} (splits: {', '.join(splits) or 'none'})")
        folder = folder / split
    state_file = folder / "state.json"
    if not state_file.exists():
        raise IpwError(f"{folder}: is a folder but not a Hugging Face save_to_disk folder (no state.json or "
                       "dataset_dict.json); give a .jsonl, .csv or .parquet file")
    state = _read_json(state_file)
    if split is not None and state.get("_split") not in (None, split) and not dict_file.exists():
        raise IpwError(f"{folder}: holds split {state.get('_split')!r}, not {split!r}")
    names = [f["filename"] for f in state.get("_data_files", [])] or sorted(p.name for p in folder.glob("*.arrow"))
    if not names:
        raise IpwError(f"{state_file}: field '_data_files': no .arrow files listed")
    rows: list[tuple[Path, int, Row]] = []
    for name in names:
        path = folder / name
        for i, row in enumerate(_read_arrow(path).to_pylist(), start=1):
            rows.append((path, i, {k: v for k, v in row.items() if v is not None}))
    return rows


# --------------------------------------------------------------------------------------------
# selection


def select(queries: list, categories: tuple[str, ...] = (), sample: int = 0, seed: int = 0) -> list:
    """Keep the given categories (case-insensitive; an unknown one is an error), then a seeded random
    sample of ``sample`` queries (0 = all), kept in file order."""
    if categories:
        available = sorted({q.category for q in queries})
        by_fold = {c.casefold(): c for c in available}
        unknown = [c for c in categories if c.casefold() not in by_fold]
        if unknown:
            shown = ", ".join(available[:30]) + (", ..." if len(available) > 30 else "")
            raise IpwError(f"--category {unknown[0]!r}: no such category in the dataset (available: {shown})")
        wanted = {c.casefold() for c in categories}
        queries = [q for q in queries if q.category.casefold() in wanted]
    if sample < 0:
        raise IpwError(f"--sample: must be >= 0, got {sample}")
    if sample and sample < len(queries):
        keep = sorted(random.Random(seed).sample(range(len(queries)), sample))
        queries = [queries[i] for i in keep]
    return queries
