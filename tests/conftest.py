import json
from pathlib import Path

import pytest

from ipw.cli import main


@pytest.fixture
def run_cli(capsys):
    """Run ``ipw`` in-process; returns (exit code, stdout, stderr)."""

    def _run(*args: str):
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err

    return _run


@pytest.fixture
def small_jsonl(tmp_path: Path) -> Path:
    rows = [
        {"id": "a1", "prompt": "What is 2 + 3? Answer with just the number.", "answer": "5",
         "category": "arithmetic", "scorer": "numeric"},
        {"id": "a2", "prompt": "What is 10 - 4? Answer with just the number.", "answer": "6",
         "category": "arithmetic", "scorer": "numeric"},
        {"id": "m1", "prompt": "Which planet is known as the Red Planet?", "answer": "B",
         "choices": ["Venus", "Mars", "Jupiter", "Saturn"], "category": "science"},
        {"id": "s1", "prompt": "Write the word 'dog' in uppercase. Answer with just the word.", "answer": "DOG",
         "category": "strings", "scorer": "exact"},
    ]
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
