"""llama.cpp's own batching server (``server = "llama-server"``), for real: ipw starts the binary that
``.ci/setup`` builds (the llama.cpp vendored in llama-cpp-python, in the wheel's own build tree, this CPU's flags) with the
bundled SmolLM2 and ``--parallel`` slots, sends concurrent requests through the ``openai`` backend,
reads the server's own per-request ``timings``, and stops it.

The tests that need the binary are skipped, saying so, when it has not been built; the rest (finding
the binary, the command line) run everywhere.
"""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path

import psutil
import pytest

from ipw.backends.base import BackendSpec, GenerationSettings, create_backend
from ipw.errors import IpwError
from processes import children, gone


def _binary() -> str | None:
    from ipw.backends.servers import find_llama_server

    try:
        return find_llama_server()
    except IpwError:
        return None


BINARY = _binary()
needs_binary = pytest.mark.skipif(
    BINARY is None, reason="llama-server is not built: run `bash .ci/setup` (or set IPW_LLAMA_SERVER)")

SETTINGS = GenerationSettings(max_tokens=12)
QUESTIONS = ("Write a short poem about the sea.", "Explain what a CPU does, in two sentences.",
             "List three colors of the rainbow.", "Describe a cat to someone who has never seen one.")


def backend_for(tmp_path: Path, **options):
    opts = {"server": "llama-server", "n_threads": 2, "n_ctx": 512, "server_timeout_s": 300.0, "timeout_s": 300.0,
            "max_retries": 0, **options}
    backend = create_backend(BackendSpec("smol-batch", "openai", "smollm2-135m", role="cloud", options=opts))
    backend.attach(tmp_path)
    backend.load()
    return backend


def llama_servers() -> list[psutil.Process]:
    return children(lambda p: Path(p.cmdline()[0]).name == "llama-server")


def ask_together(backend, prompts) -> list:
    """Send ``prompts`` at once, one thread each; returns their Completions (or exceptions) in order."""
    results: list = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def ask(i: int) -> None:
        barrier.wait()
        try:
            results[i] = backend.generate(prompts[i], SETTINGS)
        except Exception as exc:  # reported by the test
            results[i] = exc

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return results


@pytest.mark.llama
@needs_binary
def test_four_concurrent_chats_are_batched(tmp_path):
    backend = backend_for(tmp_path, concurrency=[1, 4])
    pid = backend.server.pid
    try:
        server = backend.describe()["server"]
        cmd = server["command"]
        assert cmd[0] == BINARY and cmd[cmd.index("--host") + 1] == "127.0.0.1"
        assert cmd[cmd.index("--parallel") + 1] == "4"  # the highest concurrency level
        assert cmd[cmd.index("-c") + 1] == "2048"  # n_ctx per slot times the slots
        assert cmd[cmd.index("-ngl") + 1] == "0" and cmd[cmd.index("-t") + 1] == cmd[cmd.index("-tb") + 1] == "2"
        assert {"--cont-batching", "--no-cache-prompt", "--no-webui"} <= set(cmd)
        assert server["engine"] == "llama.cpp-server" and server["parallel"] == 4
        assert "commit" in (server["engine_version"] or ""), server["engine_version"]
        assert server["model_file"].endswith(".gguf") and server["model_bytes"] > 50_000_000
        # healthy means loaded: every route answers now, and the server split its context into 4 slots
        conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=30)
        conn.request("GET", "/v1/models")
        response = conn.getresponse()
        assert response.status == 200 and json.loads(response.read())["data"][0]["id"] == backend.model_name
        conn.close()
        log = Path(server["log"]).read_text()
        assert "n_slots = 4" in log and "n_ctx_slot = 512" in log, log[-2000:]

        backend.concurrency = 4
        results = ask_together(backend, QUESTIONS)
    finally:
        backend.close()
    assert gone(pid) and not llama_servers(), "stop() leaves no llama-server behind"
    errors = [r for r in results if not hasattr(r, "server_timings")]
    assert not errors, errors
    # all four windows intersect, and they were served together, not one after another: every request
    # had its first token before any request finished (a server that answers one request at a time
    # would give the last one its first token only after the first one ended)
    assert max(c.start_s for c in results) < min(c.end_s for c in results)
    assert max(c.first_token_s for c in results) < min(c.end_s for c in results), \
        [(c.start_s, c.first_token_s, c.end_s) for c in results]
    for c in results:
        t = c.server_timings
        assert t is not None and t.prompt_n > 0 and t.prompt_ms > 0 and t.predicted_ms > 0
        # usage comes in the stream; no prompt cache: the server processed the whole prompt
        assert t.prompt_n == c.prompt_tokens
        assert t.predicted_n == c.completion_tokens and 0 < c.completion_tokens <= SETTINGS.max_tokens
        assert c.text


@pytest.mark.llama
@needs_binary
def test_completions_api_streams_usage_and_timings(tmp_path):
    backend = backend_for(tmp_path, api="completions", concurrency=2)
    try:
        assert backend.server.health_path == "/health"
        (a, b) = ask_together(backend, ("What is 2 + 3? Answer with just the number.",
                                        "What is the capital of France?"))
        info = backend.describe()
    finally:
        backend.close()
    assert info["server"]["parallel"] == 2 and info["concurrency_levels"] == [2]
    for c in (a, b):
        assert not isinstance(c, Exception), c
        assert c.server_timings.prompt_n == c.prompt_tokens > 20  # the few-shot prompt
        assert c.server_timings.predicted_n == c.completion_tokens > 0
    assert "5" in a.text, a.text
    assert not llama_servers()


@pytest.mark.llama
@needs_binary
def test_server_that_cannot_start_fails_cleanly(tmp_path):
    from ipw.backends.servers import start_server

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file" * 100)
    with pytest.raises(IpwError, match=r"exited while starting \(exit code 1\): "):
        start_server("llama-server", bad, tmp_path / "server.log", n_threads=1, alias="x", timeout_s=120, parallel=2)
    assert (tmp_path / "server.log").read_text()
    assert not llama_servers()


@pytest.mark.llama
@needs_binary
def test_ipw_run_with_a_managed_llama_server(small_jsonl, tmp_path, run_cli):
    import pandas as pd

    cfg = tmp_path / "s.toml"
    cfg.write_text(f'dataset = "{small_jsonl}"\nout_dir = "{tmp_path / "res"}"\nwarmup = 0\nidle_s = 0\n'
                   '[generation]\nmax_tokens = 8\n'
                   '[[backends]]\nname = "smol-srv"\nkind = "openai"\nmodel = "smollm2-135m"\nrole = "cloud"\n'
                   'server = "llama-server"\nn_threads = 2\nn_ctx = 512\nconcurrency = 2\nserver_timeout_s = 300.0\n')
    code, _, err = run_cli("run", cfg, "--out", tmp_path / "res")
    assert code == 0, err
    (run_dir,) = list((tmp_path / "res").iterdir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    server = manifest["backends"][0]["server"]
    assert server["kind"] == "llama-server" and server["engine"] == "llama.cpp-server" and server["parallel"] == 2
    assert gone(server["pid"]) and not llama_servers()
    assert (run_dir / "server-smol-srv.log").exists()
    frame = pd.read_parquet(run_dir / "records.parquet")
    assert frame["error"].isna().all(), frame["error"].tolist()
    assert (frame["prompt_tokens"] > 5).all() and (frame["completion_tokens"] > 0).all()  # usage, streamed


# -- without the binary ---------------------------------------------------------------------------


def test_missing_binary_says_to_run_setup(tmp_path, monkeypatch):
    from ipw.backends import servers

    monkeypatch.delenv("IPW_LLAMA_SERVER", raising=False)
    monkeypatch.setattr(servers.sys, "prefix", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(IpwError, match=r"llama-server not found.*bash \.ci/setup"):
        servers.find_llama_server()
    monkeypatch.setenv("IPW_LLAMA_SERVER", str(tmp_path / "nope"))
    with pytest.raises(IpwError, match=r"IPW_LLAMA_SERVER=.*nope is not an executable file.*bash \.ci/setup"):
        servers.find_llama_server()
    # the order: $IPW_LLAMA_SERVER, then the environment's bin/, then PATH
    fake = tmp_path / "bin" / "llama-server"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.delenv("IPW_LLAMA_SERVER")
    assert servers.find_llama_server() == str(fake)
    other = tmp_path / "other"
    other.mkdir()
    (other / "llama-server").write_text("#!/bin/sh\n")
    (other / "llama-server").chmod(0o755)
    monkeypatch.setenv("IPW_LLAMA_SERVER", str(other / "llama-server"))
    assert servers.find_llama_server() == str(other / "llama-server")
    monkeypatch.delenv("IPW_LLAMA_SERVER")
    fake.unlink()
    monkeypatch.setenv("PATH", str(other))
    assert servers.find_llama_server() == str(other / "llama-server")


def test_missing_binary_fails_before_the_run_folder(tmp_path, monkeypatch, run_cli):
    """The embedded default needs llama-server: without it `ipw run` stops at once (exit 2), naming the
    fix for a checkout and for a plain pip install, and writes no run folder."""
    from ipw.backends import servers

    monkeypatch.delenv("IPW_LLAMA_SERVER", raising=False)
    monkeypatch.setattr(servers.sys, "prefix", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    code, _, err = run_cli("run", "--out", tmp_path / "res")
    assert code == 2 and "llama-server not found" in err and "IPW_LLAMA_SERVER" in " ".join(err.split())
    assert not (tmp_path / "res").exists() or not any((tmp_path / "res").iterdir())


def test_llama_server_command():
    from ipw.backends.servers import llama_server_command

    cmd = llama_server_command("/x/llama-server", Path("/m/model.gguf"), 8123, n_threads=3, n_ctx=1024, parallel=16,
                               n_gpu_layers="all", alias="smol")
    assert cmd[:5] == ["/x/llama-server", "-m", "/m/model.gguf", "--alias", "smol"]
    flags = dict(zip(cmd[5::], cmd[6::]))
    assert flags["--port"] == "8123" and flags["-t"] == flags["-tb"] == "3"
    assert flags["--parallel"] == "16" and flags["-c"] == str(1024 * 16) and flags["-ngl"] == "all"
    assert flags["--cache-ram"] == "0" and flags["--fit"] == "off"
