"""Bad input gives one line naming file, line and field, exit code 2, no traceback, and no run folder."""

import json
import os
from pathlib import Path

import pytest

from ipw.errors import IpwError

GOOD = {"id": "q1", "prompt": "What is 1 + 1?", "answer": "2", "scorer": "numeric"}


def _jsonl(tmp_path: Path, *lines: str | dict) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
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
    path = _jsonl(tmp_path, *[GOOD if line == "GOOD" else line for line in lines])
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
    "unknown top table": ('dataset = "ipw-core"\n' + BACKEND + '\n[genration]\nmax_tokens = 8\n',
                          "run.toml:7: field 'genration': unknown table"),
    "unknown dotted table": ('dataset = "ipw-core"\n\n[ extra . sub ]  # a comment\nx = 1\n' + BACKEND,
                             "run.toml:3: field 'extra': unknown table"),
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


# a bound of ipw.options, at parse time: a run option out of bounds is refused before the config (here a file
# that does not exist) is even read; the same bound in a config names file, line and field
PARSE_TIME_CASES = {
    "repeats": (("run", "/no/such.toml", "--repeats", "0"), "--repeats: must be >= 1, got 0"),
    "sample": (("run", "/no/such.toml", "--sample", "-2"), "--sample: must be >= 0, got -2"),
    "idle_s": (("run", "/no/such.toml", "--idle-s", "1e6"), "--idle-s: must be a finite number >= 0 and <= 86400"),
    "router_accuracy": (("compare", "/no/such/run", "--router-accuracy", "1.5"),
                        "--router-accuracy: must be a finite number >= 0 and <= 1, got 1.5"),
    "router_accuracy of report": (("report", "/no/such/run", "--router-accuracy", "-0.1"),
                                  "--router-accuracy: must be a finite number >= 0 and <= 1, got -0.1"),
}


@pytest.mark.parametrize("case", sorted(PARSE_TIME_CASES))
def test_an_option_out_of_bounds_is_refused_as_it_is_parsed(case, run_cli):
    args, expected = PARSE_TIME_CASES[case]
    code, out, err = run_cli(*args)
    assert code == 2 and expected in err, err
    assert "not found" not in err and "Traceback" not in err + out


def test_a_config_field_has_its_options_bounds(tmp_path, run_cli):
    for text, expected in (('dataset = "ipw-core"\nsample = -1\n', ":2: field 'sample': must be >= 0, got -1"),
                           ('dataset = "ipw-core"\n\nrepeats = 0\n', ":3: field 'repeats': must be >= 1, got 0"),
                           ('idle_s = 1e9\ndataset = "ipw-core"\n', ":1: field 'idle_s': must be a finite number")):
        path = _config(tmp_path, text + BACKEND)
        code, _, err = run_cli("run", path, "--out", tmp_path / "res")
        assert code == 2 and f"{path}{expected}" in err, err
    assert not (tmp_path / "res").exists()


def test_the_run_options_are_declared_once():
    """cli.run's options, config.py's top-level fields and apply_overrides all come from ipw.options."""
    import typer.main

    from ipw import cli
    from ipw.inputs import config
    from ipw.options import RUN_OPTIONS

    command = typer.main.get_command(cli.app).commands["run"]
    flags = {flag for param in command.params for flag in param.opts}
    assert all(set(o.flags) <= flags for o in RUN_OPTIONS)
    assert {o.key for o in RUN_OPTIONS if o.key} <= set(config._TOP)
    base = config.load_config(None)
    changed = config.apply_overrides(base, {"limit": 3, "out": Path("x"), "category": ["a"], "idle_s": 1.5})
    assert (changed.limit, changed.out_dir, changed.categories, changed.idle_s) == (3, "x", ("a",), 1.5)
    with pytest.raises(IpwError, match="--warmup: must be >= 0"):  # an API caller gets the same bound
        config.apply_overrides(base, {"warmup": -1})


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


# -- round 2 (issue 19): every input below is caught before anything loads -------------------------
# A table of inputs -> the message fragment, exit code 2, one line on stderr, no traceback, no run folder.
# Each case gives (dataset lines or file, config text or None, extra CLI options, environment).

def _jsonl_text(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


FOUR = _jsonl_text(*({"id": f"q{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1), "scorer": "numeric"}
                     for i in range(4)))
STUB_BACKEND = '[[backends]]\nname = "api"\nkind = "openai"\nmodel = "m"\nbase_url = "http://127.0.0.1:9/v1"\n'


def _cfg(top: str = "", gen: str = "", backend: str = "") -> str:
    return f'dataset = "DATA"\nwarmup = 0\n{top}\n[generation]\nmax_tokens = 4\n{gen}\n{STUB_BACKEND}{backend}'


ROUND2_CASES = {
    # datasets
    "nested json": (("data.jsonl", "[" * 100_000 + "]" * 100_000 + "\n"), None, [], {}, ":1: invalid JSON (nested too deeply)"),
    "ragged csv row": (("data.csv", "id,prompt,answer\nq1,p,a\nq2,p,a,extra\n"), None, [], {},
                       "data.csv:3: 4 fields, but the header has 3"),
    "short csv row": (("data.csv", "id,prompt,answer\nq1,p\n"), None, [], {}, "data.csv:2: 2 fields, but the header has 3"),
    "escape in field name": (("data.csv", "id,prompt,answer,\x1b[31mred\nq1,p,a,x\n"), None, [], {},
                             "field '\\x1b[31mred': unknown field"),
    "numeric answer not a number": ((_jsonl_text({**GOOD, "answer": "ten"}),), None, [], {},
                                    ":1: field 'answer': scorer 'numeric': reference answer 'ten' is not a number"),
    "numeric answer NaN": ((_jsonl_text({**GOOD, "answer": "NaN"}),), None, [], {}, ":1: field 'answer': scorer 'numeric'"),
    "numeric answer 1e309": (('{"id": "q", "prompt": "p", "answer": 1e309, "scorer": "numeric"}\n',), None, [], {},
                             ":1: field 'answer': scorer 'numeric': reference answer 'inf' is not a number"),
    "invalid regex answer": ((_jsonl_text({**GOOD, "id": "r", "answer": "(unclosed", "scorer": "regex"}),), None, [], {},
                             ":1: field 'answer': scorer 'regex': invalid pattern '(unclosed'"),
    "prompt of spaces": ((_jsonl_text({**GOOD, "prompt": "   "}),), None, [], {}, ":1: field 'prompt': required field is blank"),
    "answer of spaces": ((_jsonl_text({**GOOD, "answer": " \t "}),), None, [], {}, ":1: field 'answer': required field is blank"),
    "duplicate json key": (('{"id": "q", "prompt": "p", "answer": "1", "answer": "2"}\n',), None, [], {},
                           ":1: invalid JSON (duplicate key 'answer')"),
    "NaN literal": (('{"id": "q", "prompt": "p", "answer": NaN}\n',), None, [], {}, ":1: invalid JSON (NaN is not a JSON number)"),
    "Infinity literal": (('{"id": "q", "prompt": "p", "answer": -Infinity}\n',), None, [], {},
                         ":1: invalid JSON (-Infinity is not a JSON number)"),
    # models and environment
    "gguf that is not gguf": ((FOUR,), _cfg().replace(STUB_BACKEND, '[[backends]]\nname = "l"\nkind = "llama-cpp"\n'
                                                       'model = "FAKE_GGUF"\n'), [], {}, "not a GGUF file"),
    "api_key_env not set": ((FOUR,), _cfg(backend='api_key_env = "IPW_NO_SUCH_VARIABLE"\n'), [], {},
                            "the environment variable IPW_NO_SUCH_VARIABLE (api_key_env) is not set"),
    "api key empty": ((FOUR,), _cfg(backend='api_key_env = "IPW_EMPTY_KEY"\n'), [], {"IPW_EMPTY_KEY": "  \r\n"},
                      "IPW_EMPTY_KEY (api_key_env) is empty"),
    # generation settings and idle seconds
    "idle_s 1e309 (inf)": ((FOUR,), _cfg(top="idle_s = 1e309"), [], {}, "field 'idle_s': must be a finite number"),
    "idle_s nan": ((FOUR,), _cfg(top="idle_s = nan"), [], {}, "field 'idle_s': must be a finite number"),
    "idle_s too long": ((FOUR,), _cfg(top="idle_s = 1e7"), [], {}, "field 'idle_s': must be a finite number >= 0 and <= 86400"),
    "--idle-s inf": ((FOUR,), None, ["--idle-s", "inf"], {}, "--idle-s: must be a finite number"),
    "--idle-s -3": ((FOUR,), None, ["--idle-s", "-3"], {}, "--idle-s: must be a finite number >= 0"),
    "temperature -1": ((FOUR,), _cfg(gen="temperature = -1"), [], {}, ":6: field 'generation.temperature': must be"),
    "top_p 5": ((FOUR,), _cfg(gen="top_p = 5"), [], {}, "field 'generation.top_p': must be a finite number > 0 and <= 1"),
    "top_k -7": ((FOUR,), _cfg(gen="top_k = -7"), [], {}, "field 'generation.top_k': must be a finite number >= 0"),
    "repeat_penalty inf": ((FOUR,), _cfg(gen="repeat_penalty = inf"), [], {}, "field 'generation.repeat_penalty': must be"),
    "stop not strings": ((FOUR,), _cfg(gen="stop = [1, 2]"), [], {}, "field 'generation.stop': item 0 must be a non-empty string"),
    "n_threads -4": ((FOUR,), _cfg(backend="n_threads = -4\n"), [], {}, "field 'backends[0].n_threads': must be >= 1"),
    "timeout nan": ((FOUR,), _cfg(backend="timeout_s = nan\n"), [], {}, "field 'backends[0].timeout_s': must be a finite"),
    # shards
    "empty shard": ((FOUR,), None, ["--shard", "5/5"], {}, "--shard 5/5: shard 5 of 5 is empty: the query set has only 4"),
}


@pytest.mark.parametrize("case", list(ROUND2_CASES))
def test_bad_input_round2(case, tmp_path, run_cli, monkeypatch):
    data, config, options, env, expected = ROUND2_CASES[case]
    name, text = data if len(data) == 2 else ("data.jsonl", data[0])
    dataset = tmp_path / name
    dataset.write_text(text, encoding="utf-8")
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"<html>not a model</html>" * 10)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("IPW_NO_SUCH_VARIABLE", raising=False)
    args = ["run", "--dataset", dataset] if config is None else ["run", tmp_path / "run.toml"]
    if config is not None:
        (tmp_path / "run.toml").write_text(config.replace("DATA", str(dataset)).replace("FAKE_GGUF", str(fake)))
    code, out, err = run_cli(*args, *options, "--out", tmp_path / "res")
    assert code == 2, err
    assert expected in err, err
    assert err.count("\n") == 1 and "Traceback" not in out + err
    assert "\x1b" not in err  # a field name's escape sequence is shown escaped, never sent to the terminal
    assert not (tmp_path / "res").exists()


def test_csv_with_a_byte_order_mark_loads(tmp_path):
    """Excel saves CSV with a BOM: it is not part of the first column's name."""
    from ipw.inputs.datasets import load_queries

    path = tmp_path / "excel.csv"
    path.write_bytes("id,prompt,answer\nq1,What is 1 + 1?,2\n".encode("utf-8-sig"))
    (query,) = load_queries(str(path))
    assert (query.id, query.answer) == ("q1", "2")


# -- run folders: one reader, read whole or one line naming the file ---------------------------------

from openai_stub import Stub, stub_config  # noqa: E402


@pytest.fixture(scope="module")
def stub_run(tmp_path_factory):
    """A complete run of 6 queries through the stub endpoint (no model)."""
    from ipw.cli import main

    tmp = tmp_path_factory.mktemp("stubrun")
    stub = Stub()
    try:
        data = tmp / "six.jsonl"
        data.write_text(_jsonl_text(*({"id": f"q{i}", "prompt": f"Say {i}", "answer": "42"} for i in range(6))))
        cfg = stub_config(tmp / "run.toml", data, stub.base_url, out_dir=tmp / "res")
        assert main(["run", str(cfg)]) == 0
        (run_dir,) = (tmp / "res").iterdir()
        yield run_dir, stub
    finally:
        stub.close()


def _copy(run_dir: Path, dest: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run_dir, dest))


def _manifest(run: Path, **changes) -> None:
    m = json.loads((run / "manifest.json").read_text())
    m.update(changes)
    (run / "manifest.json").write_text(json.dumps(m))


def _parquet(run: Path, change) -> None:
    import pandas as pd

    frame = pd.read_parquet(run / "records.parquet")
    change(frame).to_parquet(run / "records.parquet", index=False)


def _torn_middle(run: Path) -> None:
    lines = (run / "records.jsonl").read_text().splitlines(keepends=True)
    lines[2] = lines[2][:40] + "\n"  # a record cut short, with records after it
    (run / "records.jsonl").write_text("".join(lines))
    (run / "records.parquet").unlink()
    _manifest(run, status="interrupted")


FOLDER_DAMAGE = {
    "corrupt manifest": (lambda r: (r / "manifest.json").write_text('{"run_id": "x", '), "manifest.json:1: invalid JSON"),
    "manifest is []": (lambda r: (r / "manifest.json").write_text("[]"), "manifest.json: expected a JSON object, got list"),
    "newer manifest": (lambda r: _manifest(r, schema_version=99), "field 'schema_version': 99 was written by a newer ipw"),
    "unknown status": (lambda r: _manifest(r, status="exploded"), "field 'status': expected one of running, complete"),
    "truncated parquet": (lambda r: (r / "records.parquet").write_bytes((r / "records.parquet").read_bytes()[:300]),
                          "records.parquet: cannot read Parquet"),
    "string correct": (lambda r: _parquet(r, lambda f: f.assign(correct=f["correct"].map(lambda x: "yes"))),
                       "records.parquet: column 'correct': expected numbers, got"),
    "no correct column": (lambda r: _parquet(r, lambda f: f.drop(columns=["correct"])),
                          "records.parquet: column 'correct' is missing"),
    "no energy_j column": (lambda r: _parquet(r, lambda f: f.drop(columns=["energy_j"])),
                           "records.parquet: column 'energy_j' is missing"),
    "torn line in the middle": (_torn_middle, "records.jsonl:3: torn or corrupt record"),
    "string correct in the log": (lambda r: ((r / "records.parquet").unlink(), (r / "records.jsonl").write_text(
        (r / "records.jsonl").read_text().replace('"correct": 1.0', '"correct": "yes"').replace('"correct": 0.0', '"correct": "no"')),
        _manifest(r, status="interrupted")), "records.jsonl: column 'correct': expected numbers, got str"),
}


@pytest.mark.parametrize("command", ["compare", "report", "check", "rescore"])
@pytest.mark.parametrize("damage", list(FOLDER_DAMAGE))
def test_damaged_run_folder_is_one_line(damage, command, stub_run, tmp_path, run_cli):
    run_dir, _ = stub_run
    broken = _copy(run_dir, tmp_path / "broken")
    harm, expected = FOLDER_DAMAGE[damage]
    harm(broken)
    args = {"compare": ["compare", broken], "report": ["report", broken, "--out", tmp_path / "r.html"],
            "check": ["check", run_dir, broken], "rescore": ["rescore", broken, "--out", tmp_path / "new"]}[command]
    code, out, err = run_cli(*args)
    assert code == 2, out + err
    assert expected in err and str(broken) in err, err
    assert err.count("\n") == 1 and "Traceback" not in out + err
    assert not (tmp_path / "new").exists() and not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("damage", ["corrupt manifest", "manifest is []", "newer manifest", "unknown status",
                                    "torn line in the middle", "no config"])
def test_resume_of_a_damaged_run_is_one_line(damage, stub_run, tmp_path, run_cli):
    run_dir, _ = stub_run
    broken = _copy(run_dir, tmp_path / "broken")
    _manifest(broken, status="interrupted")
    if damage == "no config":
        m = json.loads((broken / "manifest.json").read_text())
        del m["config"]
        (broken / "manifest.json").write_text(json.dumps(m))
        expected = "field 'config': missing"
    else:
        harm, expected = FOLDER_DAMAGE[damage]
        harm(broken)
    before = {p.name: p.read_bytes() for p in broken.iterdir()}
    code, out, err = run_cli("run", "--resume", broken)
    assert code == 2, out + err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in out + err, err
    assert {p.name: p.read_bytes() for p in broken.iterdir()} == before  # nothing changed


def test_a_config_that_is_not_a_run_config_is_one_line(stub_run, tmp_path, run_cli):
    run_dir, _ = stub_run
    broken = _copy(run_dir, tmp_path / "broken")
    _manifest(broken, status="interrupted", config={"dataset": "x", "backends": [{"nme": "typo"}]})
    code, _, err = run_cli("run", "--resume", broken)
    assert code == 2 and "manifest.json: field 'config': not a run config" in err, err


def test_torn_line_is_repaired_by_dropping_that_line_only(stub_run, tmp_path, run_cli):
    run_dir, _ = stub_run
    broken = _copy(run_dir, tmp_path / "broken")
    _torn_middle(broken)
    torn = (broken / "records.jsonl").read_text().splitlines()[2]
    code, _, err = run_cli("compare", broken)
    assert code == 2 and "records.jsonl:3: torn or corrupt record" in err and "--repair" in err, err
    code, _, err = run_cli("run", "--resume", broken, "--repair")
    assert code == 0, err
    assert "dropped line(s) 3" in err
    assert (broken / "records.dropped.jsonl").read_text() == torn + "\n"
    import pandas as pd

    frame = pd.read_parquet(broken / "records.parquet")
    assert sorted(frame["query_id"]) == [f"q{i}" for i in range(6)]  # 5 kept, the torn one ran again
    assert json.loads((broken / "manifest.json").read_text())["status"] == "complete"


def test_torn_last_line_is_the_query_in_flight(stub_run, tmp_path, run_cli):
    """Only a torn *last* line (no newline: a crash mid-write) is left out, and resume runs it again."""
    run_dir, _ = stub_run
    broken = _copy(run_dir, tmp_path / "broken")
    text = (broken / "records.jsonl").read_text()
    (broken / "records.jsonl").write_text(text[: len(text) - 30])  # the last record cut, no newline
    (broken / "records.parquet").unlink()
    _manifest(broken, status="interrupted")
    code, out, err = run_cli("compare", broken, "--common-queries")
    assert code == 0, err
    code, _, err = run_cli("run", "--resume", broken)
    assert code == 0 and "resuming (5 records kept)" in err, err


def test_merge_reads_with_the_same_reader(stub_run, tmp_path, run_cli):
    run_dir, _ = stub_run
    broken = _copy(run_dir, tmp_path / "broken")
    harm, expected = FOLDER_DAMAGE["corrupt manifest"]
    harm(broken)
    code, _, err = run_cli("merge", broken, "--out", tmp_path / "merged")
    assert code == 2 and expected in err and not (tmp_path / "merged").exists(), err


def test_repair_needs_resume(run_cli):
    code, _, err = run_cli("run", "--repair")
    assert code == 2 and "--repair: only with --resume" in err


@pytest.mark.parametrize("target", ["missing-dir/v.xml", "."])
def test_check_junit_to_an_unwritable_path(target, stub_run, tmp_path, run_cli):
    run_dir, _ = stub_run
    code, out, err = run_cli("check", run_dir, run_dir, "--junit", tmp_path / target)
    assert code == 2 and "--junit" in err and err.count("\n") == 1 and "Traceback" not in out + err, err


def test_check_on_runs_without_energy_is_not_a_pass(stub_run, tmp_path, run_cli):
    """Records without energy cannot be gated: exit 2, not a pass on no data."""
    run_dir, _ = stub_run
    empty = _copy(run_dir, tmp_path / "no-energy")
    _parquet(empty, lambda f: f.assign(energy_j=None))
    code, out, err = run_cli("check", empty, empty)
    assert code == 2 and "no query has energy_j in both runs" in err and "Traceback" not in out + err, err


def test_damaged_power_trace_is_one_line(stub_run, tmp_path, run_cli):
    run_dir, _ = stub_run
    broken = _copy(run_dir, tmp_path / "broken")
    (broken / "power.parquet").write_bytes(b"PAR1 truncated")
    code, out, err = run_cli("report", broken, "--out", tmp_path / "r.html")
    assert code == 2 and "power.parquet: cannot read Parquet" in err and "Traceback" not in out + err, err


def test_merge_refuses_a_shard_with_a_torn_line_in_the_middle(tmp_path, run_cli):
    stub = Stub()
    try:
        data = tmp_path / "six.jsonl"
        data.write_text(_jsonl_text(*({"id": f"q{i}", "prompt": f"Say {i}", "answer": "42"} for i in range(6))))
        cfg = stub_config(tmp_path / "run.toml", data, stub.base_url, out_dir=tmp_path / "shards")
        code, _, err = run_cli("run", cfg, "--shard", "1/1")
        assert code == 0, err
    finally:
        stub.close()
    (shard,) = (tmp_path / "shards").iterdir()
    lines = (shard / "records.jsonl").read_text().splitlines(keepends=True)
    lines[1] = lines[1][:25] + "\n"
    (shard / "records.jsonl").write_text("".join(lines))
    code, out, err = run_cli("merge", shard, "--out", tmp_path / "merged")
    assert code == 2 and "records.jsonl:2: torn or corrupt record" in err and "Traceback" not in out + err, err
    assert not (tmp_path / "merged").exists()


# -- round 3 (issue 30): bounded reads, hostile text, names -----------------------------------------
# The same table shape as round 2: (dataset: (text,) or (file name, text or a Path to link to), config text
# or None, extra CLI options, environment, expected message fragment[, other files]); every case exits 2
# with one line, no traceback and no run folder. "TMP" in a config (or in the expected fragment) is the
# test's folder, where the other files are written. A dataset of None: the options are the whole command.
# What needs a server, several processes or a measure of time and memory has a test of its own below and
# in tests/results/test_run_folder_integrity.py and tests/e2e/test_secrets.py.

def _gguf(version: int, tensors: int, entries: int) -> bytes:
    import struct

    return (b"GGUF" + struct.pack("<IQQ", version, tensors, entries)).ljust(1024, b"\0")


def _with_model(name: str) -> str:
    return _cfg().replace(STUB_BACKEND, f'[[backends]]\nname = "l"\nkind = "llama-cpp"\nmodel = "TMP/{name}"\n')


def _with_judge(prompt: str) -> str:
    return _cfg() + f'[judge]\nkind = "openai"\nmodel = "m"\nbase_url = "http://127.0.0.1:9/v1"\nprompt = "TMP/{prompt}"\n'


ROUND3_CASES = {
    # datasets
    "lone surrogate in a prompt": (('{"id": "q", "prompt": "bad \\ud800 text", "answer": "1"}\n',), None, [], {},
                                   "data.jsonl:1: field 'prompt': a lone surrogate \\ud800 at character 5"),
    "lone surrogate in choices": (('{"id": "q", "prompt": "p", "choices": ["a", "\\udfff"], "answer": "A"}\n',), None,
                                  [], {}, ":1: field 'choices': a lone surrogate \\udfff"),
    "dataset on stdin": ((FOUR,), None, [], {}, "not a regular file"),
    "dataset a symlink to /dev/zero": (("zero.jsonl", Path("/dev/zero")), None, [], {},
                                       "zero.jsonl: not a regular file (a character device)"),
    "a dataset line without a newline, over 1 MB": (("x" * 1_000_100,), None, [], {},
                                                    "data.jsonl:1: line is longer than 1000000 bytes"),
    "a newline in the dataset's file name": (("two\nlines.jsonl", "{not json\n"), None, [], {},
                                             "two\\nlines.jsonl:1: invalid JSON"),
    # names
    "300-character backend name": ((FOUR,), _cfg().replace('name = "api"', 'name = "' + "n" * 300 + '"'), [], {},
                                   ":8: field 'backends[0].name': 300 characters; a name has at most 64"),
    "right-to-left override in a name": ((FOUR,), _cfg().replace('name = "api"', 'name = "api\\u202eevil"'), [], {},
                                         "field 'backends[0].name': holds \\u202e at character 4"),
    "newline in a name": ((FOUR,), _cfg().replace('name = "api"', 'name = "a\\n::error::forged"'), [], {},
                          "field 'backends[0].name': holds \\n at character 2"),
    "Cyrillic look-alike name": ((FOUR,), _cfg(backend=STUB_BACKEND.replace('"api"', '"\u0430pi"')), [], {},
                                 "field 'backends[1].name': '\\u0430pi' prints like the backend name 'api'"),
    "café in two Unicode forms": ((FOUR,), _cfg().replace('"api"', '"caf\u00e9"') + STUB_BACKEND.replace(
        '"api"', '"cafe\u0301"'), [], {}, "field 'backends[1].name': duplicate backend name 'café'"),
    # config files
    "backend without a kind": ((FOUR,), _cfg(backend='[[backends]]\nname = "k"\nmodel = "m"\n'), [], {},
                               ":12: field 'backends[1].kind': required (known kinds:"),
    "config with a byte-order mark, then a bad key": ((FOUR,), "\ufeff" + _cfg(top="repets = 2"), [], {},
                                                      "run.toml:3: field 'repets': unknown key"),
    "unknown dotted key": ((FOUR,), _cfg(top="generation.max_tokn = 4").replace("[generation]\nmax_tokens = 4\n", ""),
                           [], {}, "run.toml:3: field 'generation.max_tokn': unknown key"),
    "unknown key of an inline table": ((FOUR,), _cfg(top='backends = [\n  { name = "a", kind = "openai", model = "m", '
                                                     'n_thread = 2 },\n]').replace(STUB_BACKEND, ""), [], {},
                                       "run.toml:4: field 'backends[0].n_thread': unknown key"),
    "user name and password in base_url": ((FOUR,), _cfg().replace("http://127.0.0.1", "http://alice:pa55-Wd3xQ@127.0.0.1"),
                                           [], {}, "base_url holds a user name or password"),
    # files a config names
    "judge prompt not UTF-8": ((FOUR,), _with_judge("judge.txt"), [], {},
                               "judge.txt: a judge prompt is UTF-8 text; byte 19 is not", {"judge.txt": b"Grade {{response}} \xff\xfe"}),
    "judge prompt not a .txt file": ((FOUR,), _with_judge("judge.bin"), [], {}, "judge prompt 'TMP/judge.bin' is not a .txt file",
                                     {"judge.bin": b"\x00\x01binary"}),
    "GGUF header claims 2**60 tensors": ((FOUR,), _with_model("model.gguf"), [], {},
                                         "its GGUF header claims 1152921504606846976 tensors, more than a 1024-byte file can hold",
                                         {"model.gguf": _gguf(3, 2**60, 5)}),
    "GGUF header claims 10**7 metadata entries": ((FOUR,), _with_model("model.gguf"), [], {},
                                                  "claims 10000000 metadata entries", {"model.gguf": _gguf(3, 10, 10**7)}),
    "GGUF version 99": ((FOUR,), _with_model("model.gguf"), [], {}, "GGUF version 99 (known: 1, 2, 3)",
                        {"model.gguf": _gguf(99, 1, 1)}),
    # ipw doctor
    "doctor --seconds -5": (None, None, ["doctor", "--self-test", "--seconds", "-5"], {},
                            "--seconds: must be a finite number > 0 and <= 3600, got -5.0"),
    "doctor --json to a path that cannot be written": (None, None, ["doctor", "--self-test", "--json", "/proc/x/n.json"],
                                                       {}, "--json /proc/x/n.json: cannot write there"),
    "doctor --json without --self-test": (None, None, ["doctor", "--json", "numbers.json"], {},
                                          "--json: only with --self-test"),
}


@pytest.mark.parametrize("case", list(ROUND3_CASES))
def test_bad_input_round3(case, tmp_path, run_cli, monkeypatch):
    data, config, options, env, expected, *files = ROUND3_CASES[case]
    for name, content in (files[0] if files else {}).items():
        (tmp_path / name).write_bytes(content)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if data is None:  # a command of its own (ipw doctor)
        args = []
    else:
        name, text = data if len(data) == 2 else ("data.jsonl", data[0])
        dataset = tmp_path / name
        if isinstance(text, Path):
            dataset.symlink_to(text)
        else:
            dataset.write_text(text, encoding="utf-8")
        if case == "dataset on stdin":
            read, write = os.pipe()  # what /dev/stdin is under a pipe: a FIFO
            os.close(write)
            dataset = Path(f"/proc/self/fd/{read}")
        args = ["run", "--dataset", dataset] if config is None else ["run", tmp_path / "run.toml"]
        if config is not None:
            config = config.replace("DATA", str(dataset)).replace("TMP", str(tmp_path))
            (tmp_path / "run.toml").write_text(config, encoding="utf-8")
        options = [*options, "--out", tmp_path / "res"]
    code, out, err = run_cli(*args, *options)
    assert code == 2, err
    assert expected.replace("TMP", str(tmp_path)) in err, err
    assert err.count("\n") == 1 and "Traceback" not in out + err
    assert "pa55-Wd3xQ" not in out + err  # a password in a URL is never echoed
    assert not (tmp_path / "res").exists()


def _ipw_subprocess(*args, timeout: float):
    """``ipw`` in a process of its own: (exit code, stderr, CPU seconds of the child, peak RSS of the child
    in MiB). CPU seconds, not wall seconds: what the process did, however long a loaded machine kept it
    waiting (issue 30: these tests must hold with a CPU hog on every core)."""
    import resource
    import subprocess
    import sys

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "ipw.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    peak = after.ru_maxrss  # KiB on Linux; the largest child so far
    return proc.returncode, proc.stderr, cpu_s, peak / 1024 if peak > before.ru_maxrss else None


def test_dev_zero_as_a_dataset_exits_2_at_once(tmp_path):
    """A symlink to /dev/zero named .jsonl: refused before a byte is read (exit 2 within 5 s, no memory
    growth); before, it read until 24 GB of memory were gone."""
    link = tmp_path / "zero.jsonl"
    link.symlink_to("/dev/zero")
    code, err, cpu_s, peak_mib = _ipw_subprocess("run", "--dataset", link, "--out", tmp_path / "res", timeout=120)
    assert code == 2 and "zero.jsonl: not a regular file (a character device)" in err, err
    assert cpu_s < 5.0  # interpreter start-up included (~1 CPU s); the read itself is refused at once
    assert peak_mib is None or peak_mib < 400, peak_mib
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_file_without_newlines_is_read_only_to_the_line_limit(suffix, tmp_path):
    """A 1.5 GB (sparse) file of zero bytes and no newline: the reader stops at the 1 MB line limit."""
    path = tmp_path / f"zeros{suffix}"
    with open(path, "wb") as fh:
        fh.truncate(1_500_000_000)
    code, err, cpu_s, peak_mib = _ipw_subprocess("run", "--dataset", path, "--out", tmp_path / "res", timeout=300)
    assert code == 2 and ":1: line is longer than 1000000 bytes" in err, err
    assert peak_mib is None or peak_mib < 400, peak_mib
    assert not (tmp_path / "res").exists()


def test_config_validation_is_linear(tmp_path):
    """10,000 backends, the last one wrong: the error names its line at once (it took 42 s, quadratic)."""
    import time

    from ipw.inputs.config import parse_config

    text = 'dataset = "d"\n' + "".join(f'[[backends]]\nname = "b{i}"\nkind = "openai"\nmodel = "m"\n'
                                       f'base_url = "http://127.0.0.1:9/v1"\n' for i in range(10_000))
    text += "timeout_s = \"soon\"\n"
    t0 = time.process_time()  # CPU time: a loaded machine's waits are not the parser's work
    with pytest.raises(IpwError) as info:
        parse_config(text, "big.toml")
    assert time.process_time() - t0 < 5.0  # ~1 CPU s here; quadratic took 42 s
    assert info.value.message.startswith(f"big.toml:{2 + 5 * 10_000}: field 'backends[9999].timeout_s': expected float")


HOSTILE_NAMES = ["=HYPERLINK(\"http://x\",\"click\")", "b\n::error file=x::forged", "api\u202eevil", "@SUM(A1)"]


@pytest.mark.parametrize("fmt", ["table", "csv", "markdown", "json"])
def test_hostile_backend_names_in_a_run_folder_stay_text(fmt, tmp_path, run_cli):
    """Names from a run folder (written by hand or by an older ipw; a config refuses them now): in every
    output no line starts a GitHub workflow command, no CSV cell is a formula, no bidi control is raw."""
    import csv
    import io

    from runfolders import write_run

    run = write_run(tmp_path, "r1", {name: {"correct": [1, 0], "energy": [1.0, 2.0]} for name in HOSTILE_NAMES})
    code, out, err = run_cli("compare", run, "--format", fmt)
    assert code == 0, err
    assert not [line for line in out.splitlines() if line.lstrip().startswith("::")], out
    assert "\u202e" not in out and "\\u202e" in out.replace("\\\\", "\\")
    if fmt == "csv":
        cells = [cell for row in csv.reader(io.StringIO(out)) for cell in row]
        assert not [c for c in cells if c[:1] in ("=", "+", "@") or (c[:1] == "-" and not c[1:2].isdigit())], cells
        assert "'=HYPERLINK(\"http://x\",\"click\")" in cells


def test_hostile_names_in_the_html_report_are_shown_escaped(tmp_path, run_cli):
    from runfolders import write_run

    run = write_run(tmp_path, "r1", {name: {"correct": [1, 0], "energy": [1.0, 2.0]} for name in HOSTILE_NAMES})
    code, _, err = run_cli("report", run, "--out", tmp_path / "r.html", "--markdown", tmp_path / "r.md")
    assert code == 0, err
    for page in ("r.html", "r.md"):
        text = (tmp_path / page).read_text()
        assert "\u202e" not in text and "api\\u202eevil" in text, page
