"""An API key never leaves ipw, not even in part: a sentinel key is driven through every error path
against a local stub (401, a 500 that echoes the headers at every offset around the cut of its
message, a bad stream chunk, an error chunk, a key with a CR), then the run folders, stdout and
stderr are searched for every 8-character window of it."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from ipw.backends.base import BackendSpec, GenerationSettings, QueryError, create_backend
from ipw.errors import IpwError
from openai_stub import Stub, stub_config

SENTINEL = "sk-Zq8vW3kP0xY7tR2mN5bC9dF4gH6jL1aS"  # shares no 8 characters with any other text here
ENV = "IPW_TEST_KEY"


def windows(secret: str = SENTINEL, n: int = 8) -> set[str]:
    return {secret[i : i + n] for i in range(len(secret) - n + 1)}


def assert_no_leak(where: str, text: str) -> None:
    found = [w for w in windows() if w in text]
    assert not found, f"{where} holds part of the key: {found[:3]}"


def assert_folder_clean(folder: Path) -> None:
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert files
    for p in files:
        assert_no_leak(str(p), p.read_bytes().decode("utf-8", errors="replace"))


@pytest.fixture
def stub():
    s = Stub()
    yield s
    s.close()


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    def make(n: int) -> Path:
        path = tmp_path / f"q{n}.jsonl"
        path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Say {i}", "answer": "42"}) + "\n"
                                for i in range(n)))
        return path

    return make


def test_every_error_path_keeps_the_key_out(stub, dataset, tmp_path, monkeypatch, run_cli):
    # a key read from a CRLF file: stripped and used, never quoted by http.client
    monkeypatch.setenv(ENV, SENTINEL + "\r\n")
    stub.required_key = SENTINEL
    # 500s whose body echoes every header after 0..N filler characters: the key crosses the 300-character
    # cut of the error message at every position; then a bad chunk and an error chunk that echo it too
    # ("you sent Authorization: Bearer " is 31 characters: the key crosses the cut for fillers 234..269)
    offsets = list(range(0, 40, 13)) + list(range(228, 275, 2))
    stub.modes = [f"500:{k}" for k in offsets] + ["badchunk", "errchunk"]
    data = dataset(len(stub.modes) + 2)
    base = stub.base_url + "?api_key=Kx9-Hidden-Q7&mode=fast"  # sent with every request, redacted when stored
    cfg = stub_config(tmp_path / "run.toml", data, base, out_dir=tmp_path / "res",
                      backend_extra=f'api_key_env = "{ENV}"\n')
    code, out, err = run_cli("run", cfg)
    assert code == 0, err
    assert set(stub.auth_seen) == {f"Bearer {SENTINEL}"}  # the key was sent, stripped
    (run_dir,) = (tmp_path / "res").iterdir()
    assert_folder_clean(run_dir)
    assert_no_leak("stdout", out)
    assert_no_leak("stderr", err)
    manifest = (run_dir / "manifest.json").read_text()
    assert "Kx9-Hidden-Q7" not in manifest
    assert "api_key=***" in manifest and "mode=fast" in manifest
    assert set(stub.paths) == {"/v1/chat/completions?api_key=Kx9-Hidden-Q7&mode=fast"}
    import pandas as pd

    frame = pd.read_parquet(run_dir / "records.parquet")
    assert list(frame["error_category"][: len(offsets)]) == ["http_5xx"] * len(offsets)
    assert list(frame["error_category"][len(offsets):len(offsets) + 2]) == ["malformed_stream"] * 2
    assert frame["error"][:4].str.contains("you sent Authorization: Bearer ***", regex=False).all()

    # rejected by the endpoint (401): exit 2 before the run folder exists (round 2 left a failed folder)
    stub.required_key = "another-key-entirely"
    code, out, err = run_cli("run", cfg, "--out", tmp_path / "res401")
    assert code == 2 and "HTTP 401" in err, err
    assert_no_leak("stdout", out)
    assert_no_leak("stderr", err)
    assert not (tmp_path / "res401").exists()


def test_a_key_with_a_control_character_stops_before_anything(stub, dataset, tmp_path, monkeypatch, run_cli):
    monkeypatch.setenv(ENV, SENTINEL[:10] + "\r" + SENTINEL[10:])
    cfg = stub_config(tmp_path / "run.toml", dataset(2), stub.base_url, out_dir=tmp_path / "res",
                      backend_extra=f'api_key_env = "{ENV}"\n')
    code, out, err = run_cli("run", cfg)
    assert code == 2, err
    assert f"{ENV} (api_key_env) holds a control character at position 11" in err
    assert_no_leak("stdout + stderr", out + err)
    assert not (tmp_path / "res").exists() and not stub.auth_seen


def test_500_echoing_the_key_at_every_offset(stub, monkeypatch):
    """Scrubbed before the message is cut at 300 characters: no offset leaves a piece of the key."""
    monkeypatch.setenv(ENV, SENTINEL)
    backend = create_backend(BackendSpec("s", "openai", "stub", options={
        "base_url": stub.base_url, "api_key_env": ENV, "max_retries": 0}))
    offsets = range(0, 340)
    stub.modes = [f"500:{k}" for k in offsets]
    for k in offsets:
        with pytest.raises(QueryError) as info:
            backend.generate("q", GenerationSettings(max_tokens=2))
        assert_no_leak(f"offset {k}", str(info.value))
    stub.modes = ["badchunk", "errchunk"]
    for _ in range(2):
        with pytest.raises(QueryError) as info:
            backend.generate("q", GenerationSettings(max_tokens=2))
        assert "***" in str(info.value)
        assert_no_leak("chunk", str(info.value))


def test_key_checks(monkeypatch):
    from ipw.sanitize import read_key

    monkeypatch.setenv(ENV, "  " + SENTINEL + "\r\n")
    assert read_key(ENV, "b") == SENTINEL
    for bad, kind in ((SENTINEL[:5] + "\n" + SENTINEL[5:], "a control character"),
                      (SENTINEL[:5] + " " + SENTINEL[5:], "a space"),
                      (SENTINEL[:5] + "é" + SENTINEL[5:], "a non-ASCII character"),
                      ("   ", None)):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(IpwError) as info:
            read_key(ENV, "b")
        assert (kind or "is empty") in info.value.message
        assert_no_leak("message", info.value.message)
    monkeypatch.delenv(ENV)
    with pytest.raises(IpwError, match="is not set"):
        read_key(ENV, "b")


def test_unexpected_error_is_one_scrubbed_line_and_debug_shows_the_traceback(monkeypatch, run_cli):
    from ipw.commands import list as commands
    from ipw.sanitize import register

    register(SENTINEL)

    def boom(*args, **kwargs):
        raise ValueError(f"Invalid header value b'Bearer {SENTINEL}\\r'")

    monkeypatch.setattr(commands, "list_command", boom)
    code, out, err = run_cli("list")
    assert code == 3
    assert err.count("\n") == 1 and "unexpected ValueError" in err and "--debug" in err
    assert "Traceback" not in err and "locals" not in err
    assert_no_leak("stderr", out + err)
    code, out, err = run_cli("list", "--debug")
    assert code == 3 and "Traceback (most recent call last)" in err and "boom" in err
    assert_no_leak("stderr --debug", out + err)


def test_redact_url():
    from ipw.sanitize import redact_url, redact_urls

    assert redact_url("https://u:p@h.example:8443/v1?api_key=abc&x=1&token=t#f") == \
        "https://***@h.example:8443/v1?api_key=***&x=1&token=***#f"
    assert redact_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1"
    assert redact_urls("failed: http://a:b@h/v1?sig=zz now") == "failed: http://***@h/v1?sig=*** now"


def test_managed_server_environment_has_no_secrets(monkeypatch):
    from ipw.backends.servers import server_env, vllm_env

    for name in ("OPENAI_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "MY_PASSWORD", "GITHUB_TOKEN", ENV):
        monkeypatch.setenv(name, SENTINEL)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    for env in (server_env(), vllm_env()):
        assert_no_leak("server env", json.dumps(env))
        assert env["PATH"] and env["CUDA_VISIBLE_DEVICES"] == "0" and env["TOKENIZERS_PARALLELISM"] == "false"


def test_github_annotations_and_markdown_are_escaped():
    from ipw.analysis.check import CheckResult, Verdict, github_annotations, markdown
    from ipw.sanitize import md_text

    name = "evil\n::error title=forged::owned, really%0A [x](javascript:alert(1))"
    v = Verdict(name, "accuracy", "accuracy:-2pp", 0.5, 0.3, -20.0, -30.0, -10.0, 0.001, "regression", 10)
    text = github_annotations(CheckResult((v,), 0.01, False, ()))
    assert text.count("\n") == 0 and text.startswith("::error title=")  # one line: no forged second command
    title, message = text[len("::error title="):].split("::", 1)
    assert ":" not in title and "," not in title and "\n" not in message
    assert "%250A" in text  # a literal %0A is not turned into a newline by GitHub
    md = markdown(CheckResult((v,), 0.01, False, (name,)))
    assert not re.search(r"(?<!\\)\]\(", md) and "\\[x\\](javascript:" in md  # no link can start
    assert md_text("[x](javascript:alert(1)) <img src=x>") == "\\[x\\](javascript:alert(1)) &lt;img src=x&gt;"


# -- round 3 (issue 30): the key by value, wherever it turns up ------------------------------------------

def _backend(stub, env: str = ENV):
    return create_backend(BackendSpec("s", "openai", "stub", options={
        "base_url": stub.base_url, "api_key_env": env, "max_retries": 0}))


def test_a_500_that_puts_the_key_at_the_64_kib_boundary(stub, monkeypatch):
    """65,524 spaces, then the key: the 64 KiB read cuts it, the strip moved the fragment to the front and the
    records stored ``sk-SENTINEL1``. Every offset across the boundary: no 8 characters of it survive."""
    from ipw.backends.openai_http import MAX_ERROR_BYTES

    monkeypatch.setenv(ENV, SENTINEL)
    backend = _backend(stub)
    prefix = len("you sent Authorization: Bearer ")
    offsets = range(MAX_ERROR_BYTES - prefix - len(SENTINEL) - 2, MAX_ERROR_BYTES - prefix + 2)
    stub.modes = [f"500s:{k}" for k in offsets]
    for k in offsets:
        with pytest.raises(QueryError) as info:
            backend.generate("q", GenerationSettings(max_tokens=2))
        assert_no_leak(f"offset {k}", str(info.value))
        fragment = SENTINEL[: max(0, MAX_ERROR_BYTES - prefix - k)]
        assert len(fragment) < 4 or fragment not in str(info.value), (k, str(info.value)[:80])


def test_a_masked_key_in_an_error_is_scrubbed(stub, dataset, tmp_path, monkeypatch, run_cli):
    """An OpenAI-style 401 body ("Incorrect API key provided: sk-Zq8v****...L1aS") quotes a masked key: the run
    stores none of it (before: an 8-character window, and exit 0)."""
    from ipw.sanitize import scrub

    monkeypatch.setenv(ENV, SENTINEL)
    masked = [SENTINEL[:7] + "****", SENTINEL[:8] + "*" * 20 + SENTINEL[-4:], "*" * 4 + SENTINEL[-8:],
              SENTINEL[:3] + "..." + SENTINEL[-4:] + "x"]
    _backend(stub)  # registers the key
    for text in masked[:3]:
        assert scrub(f"Incorrect API key provided: {text}.") == "Incorrect API key provided: ***.", text
    stub.modes = [f"401text:Incorrect API key provided: {m}" for m in masked[:3]]
    cfg = stub_config(tmp_path / "run.toml", dataset(4), stub.base_url, out_dir=tmp_path / "res",
                      backend_extra=f'api_key_env = "{ENV}"\n')
    code, out, err = run_cli("run", cfg)
    (run_dir,) = (tmp_path / "res").iterdir()
    for p in [p for p in run_dir.rglob("*") if p.is_file()] + ["out"]:
        text = out + err if p == "out" else p.read_bytes().decode("utf-8", "replace")
        for m in masked[:3]:
            assert m not in text and m.strip("*")[:8] not in text, (p, m)


def test_a_custom_api_key_env_never_reaches_a_worker(monkeypatch, tmp_path):
    """``api_key_env = "IPW_CLOUD_CRED"``: an IPW_ variable (workers get those) whose name says nothing
    secret; before, the llama.cpp worker inherited it. Now no worker or server gets it, by name nor value."""
    from ipw.backends.servers import server_env
    from ipw.backends.worker import worker_env
    from ipw.inputs.config import parse_config

    monkeypatch.setenv("IPW_CLOUD_CRED", SENTINEL)
    monkeypatch.setenv("IPW_SHOWS_THE_SAME_VALUE", "x" + SENTINEL)
    monkeypatch.setenv("IPW_PLAIN_SETTING", "1")
    parse_config('dataset = "d"\n[[backends]]\nname = "c"\nkind = "openai"\nmodel = "m"\n'
                 'base_url = "http://127.0.0.1:9/v1"\napi_key_env = "IPW_CLOUD_CRED"\n', "run.toml")
    env = worker_env(sys.executable)
    assert "IPW_CLOUD_CRED" not in env and "IPW_PLAIN_SETTING" in env
    from ipw.sanitize import read_key

    read_key("IPW_CLOUD_CRED", "c")  # the value registered: a variable holding it is dropped too
    env = worker_env(sys.executable)
    assert "IPW_SHOWS_THE_SAME_VALUE" not in env
    assert_no_leak("worker env", json.dumps(env))
    assert_no_leak("server env", json.dumps(server_env()))


def test_a_base_url_with_a_user_name_is_refused(stub, dataset, tmp_path, run_cli):
    base = stub.base_url.replace("http://", "http://alice:pa55-Wd3xQ@")
    cfg = stub_config(tmp_path / "run.toml", dataset(2), base, out_dir=tmp_path / "res")
    code, out, err = run_cli("run", cfg)
    assert code == 2 and "base_url holds a user name or password" in err and "api_key_env" in err, err
    assert "pa55-Wd3xQ" not in err + out and "alice" not in err + out
    assert not (tmp_path / "res").exists() and not stub.bodies
