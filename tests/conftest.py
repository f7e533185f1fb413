import importlib
import json
import sys
from contextlib import contextmanager
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


WORDS = ["apple", "river", "house", "green", "table", "music", "light", "stone", "cloud", "bread", "chair", "water"]


def mixed_accuracy_jsonl(tmp_path: Path) -> Path:
    """Queries SmolLM2-135M answers right often (copying a word) and some it gets wrong (arithmetic), so
    that an accuracy compared across runs is neither 0 nor 1; categories interleaved."""
    rows = [{"id": f"copy-{i}", "prompt": f"Repeat this word exactly: {w}", "answer": w, "scorer": "contains",
             "category": "copy"} for i, w in enumerate(WORDS)]
    rows += [{"id": f"add-{a}-{b}", "prompt": f"What is {a} + {b}? Answer with just the number.", "answer": str(a + b),
              "scorer": "numeric", "category": "arithmetic"} for a, b in ((17, 25), (38, 46), (123, 389), (7, 8))]
    rows = [rows[i] for i in (0, 12, 1, 2, 13, 3, 4, 14, 5, 6, 15, 7, 8, 9, 10, 11)]  # mixed order
    path = tmp_path / "easy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def smol_config(path: Path, dataset: Path, *, limit: int, max_tokens: int, out_dir: Path, top: str = "") -> Path:
    """A run config of SmolLM2-135M in-process (one thread, no warm-up, no idle baseline)."""
    path.write_text(f'''dataset = "{dataset}"
limit = {limit}
warmup = 0
idle_s = 0
out_dir = "{out_dir}"
{top}
[generation]
max_tokens = {max_tokens}
[[backends]]
name = "smol"
kind = "llama-cpp"
model = "smollm2-135m"
n_threads = 1
''')
    return path


def only_run(folder: Path) -> Path:
    """The one run folder written under ``folder``."""
    (run_dir,) = [p for p in folder.iterdir() if p.is_dir()]
    return run_dir


@pytest.fixture
def scripted(request):
    """The test module's ``ScriptedJudge`` (a ``scripted.ScriptedBackend``) as backend kind "scripted"."""
    from ipw.backends.base import register_backend, unregister_backend

    register_backend("scripted", request.module.ScriptedJudge, replace=True)
    yield
    unregister_backend("scripted")


@contextmanager
def bench_module(name: str):
    """A bench/ script imported as a module, ``name`` its path under bench/ without ``.py``: ``"index"``,
    ``"scale/compare_scale"``.  While it is used, bench/ (its ``_shared``) and the script's own folder (its
    siblings) are on sys.path, as they are when the script runs."""
    bench = Path(__file__).resolve().parents[1] / "bench"
    folder, _, module = name.rpartition("/")
    paths = list(dict.fromkeys([str(bench), str(bench / folder)]))
    sys.path[:0] = paths
    try:
        yield importlib.import_module(module)
    finally:
        for path in paths:
            sys.path.remove(path)
