"""Bad input gives one line naming file, line and field, exit code 2, no traceback, and no run folder."""

import json
from pathlib import Path

import pytest

GOOD = {"id": "q1", "prompt": "What is 1 + 1?", "answer": "2", "scorer": "numeric"}


def _jsonl(tmp_path: Path, *lines: str | dict) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


DATASET_CASES = {
    "bad json line": (["GOOD", "{not json"], ":2: invalid JSON"),
    "missing answer": (["GOOD", {"id": "q2", "prompt": "x"}], ":2: field 'answer': required"),
    "missing prompt": ([{"id": "q2", "answer": "x"}], ":1: field 'prompt': required"),
    "wrong type": ([{"id": "q2", "prompt": ["a"], "answer": "x"}], ":1: field 'prompt': expected a string"),
    "duplicate id": (["GOOD", "GOOD"], ":2: field 'id': duplicate id 'q1'"),
    "unknown scorer": ([{**GOOD, "scorer": "fuzzy"}], ":1: field 'scorer': unknown scorer 'fuzzy'"),
    "mcq without choices": ([{**GOOD, "scorer": "mcq"}], ":1: field 'choices': scorer 'mcq' needs"),
    "mcq answer not a letter": ([{"id": "q", "prompt": "p", "choices": ["a", "b"], "answer": "C"}], ":1: field 'answer'"),
    "choices not a list": ([{**GOOD, "choices": "abc"}], ":1: field 'choices'"),
    "unknown field": ([{**GOOD, "anwser": "2"}], ":1: field 'anwser': unknown field"),
    "not an object": (["[1, 2]"], ":1: expected a JSON object"),
}


@pytest.mark.parametrize("case", sorted(DATASET_CASES))
def test_bad_dataset(case, tmp_path, run_cli):
    lines, expected = DATASET_CASES[case]
    path = _jsonl(tmp_path, *[GOOD if l == "GOOD" else l for l in lines])
    code, out, err = run_cli("run", "--dataset", path, "--out", tmp_path / "res")
    assert code == 2
    assert expected in err, err
    assert str(path) in err
    assert "Traceback" not in err + out
    assert not (tmp_path / "res").exists()


def test_empty_file(tmp_path, run_cli):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    code, _, err = run_cli("run", "--dataset", path)
    assert code == 2 and "the dataset is empty" in err


def test_non_utf8(tmp_path, run_cli):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"id": "\xff\xfe"}\n')
    code, _, err = run_cli("run", "--dataset", path)
    assert code == 2 and ":2: not valid UTF-8" in err


def test_missing_dataset_and_negative_limit(tmp_path, run_cli):
    code, _, err = run_cli("run", "--dataset", tmp_path / "nope.jsonl")
    assert code == 2 and "dataset not found" in err
    code, _, err = run_cli("run", "--limit", "-1")
    assert code == 2 and "--limit: must be >= 0" in err


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


BACKEND = '[[backends]]\nname = "s"\nkind = "llama-cpp"\nmodel = "smollm2-135m"\n'
CONFIG_CASES = {
    "unknown top key": ('dataset = "ipw-core"\nrepets = 2\n' + BACKEND, ":2: field 'repets': unknown key"),
    "unknown backend key": ('dataset = "ipw-core"\n' + BACKEND + 'n_thread = 2\n', ":6: field 'backends[0].n_thread': unknown key"),
    "unknown backend kind": ('dataset = "ipw-core"\n[[backends]]\nname = "s"\nkind = "llamacpp"\nmodel = "x"\n',
                             ":4: field 'backends[0].kind': unknown backend kind 'llamacpp'"),
    "wrong type": ('dataset = "ipw-core"\nrepeats = "two"\n' + BACKEND, ":2: field 'repeats': expected int"),
    "bad toml": ('dataset = \n', "invalid TOML"),
    "bad role": ('dataset = "ipw-core"\n' + BACKEND + 'role = "edge"\n', "field 'backends[0].role': must be one of"),
    "no backends": ('dataset = "ipw-core"\n', "field 'backends': at least one"),
    "missing model file": ('dataset = "ipw-core"\n[[backends]]\nname = "s"\nkind = "llama-cpp"\nmodel = "/no/such.gguf"\n',
                           "model file /no/such.gguf not found"),
    "negative limit": ('dataset = "ipw-core"\nlimit = -3\n' + BACKEND, ":2: field 'limit': must be >= 0"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config(case, tmp_path, run_cli):
    text, expected = CONFIG_CASES[case]
    path = _config(tmp_path, text)
    code, out, err = run_cli("run", path, "--out", tmp_path / "res")
    assert code == 2, err
    assert expected in err, err
    assert "Traceback" not in err + out
    assert not (tmp_path / "res").exists()


def test_missing_config_file(tmp_path, run_cli):
    code, _, err = run_cli("run", tmp_path / "none.toml")
    assert code == 2 and "config file not found" in err


def test_unknown_backend_option(run_cli):
    code, _, err = run_cli("run", "--backend", "nosuch")
    assert code == 2 and "--backend nosuch: no backend of that name" in err
    code, _, err = run_cli("run", "--backend", "vllm2:x")
    assert code == 2 and "unknown backend kind 'vllm2'" in err


def test_enormous_line(tmp_path, run_cli):
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "id": "q2", "prompt": "x" * 2_000_000}) + "\n")
    code, _, err = run_cli("run", "--dataset", path, "--out", tmp_path / "res")
    assert code == 2 and ":2: line is longer than" in err
    assert not (tmp_path / "res").exists()


def test_unreadable_dataset_path(tmp_path, run_cli, monkeypatch):
    path = tmp_path / "locked.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    real_open = Path.open

    def deny(self, *args, **kwargs):  # root ignores file modes, so deny the read itself
        if self == path:
            raise PermissionError(13, "Permission denied")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", deny)
    code, _, err = run_cli("run", "--dataset", path, "--out", tmp_path / "res")
    assert code == 2 and "permission denied" in err and str(path) in err


def test_unsupported_file_type(tmp_path, run_cli):
    path = tmp_path / "data.txt"
    path.write_text("hello\n")
    code, _, err = run_cli("run", "--dataset", path)
    assert code == 2 and "unsupported file type" in err
