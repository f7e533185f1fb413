"""Managed local servers, for real: ipw starts `python -m llama_cpp.server` with the bundled SmolLM2
model, queries it through the `openai` backend, measures it, and stops it (also when it is killed
mid-run, on Ctrl-C and when it fails to start)."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pandas as pd
import psutil
import pytest

from ipw.errors import IpwError
from processes import children, gone

pytestmark = pytest.mark.llama


def server_config(path: Path, dataset: Path, **options) -> Path:
    opts = "".join(f"{k} = {json.dumps(v)}\n" for k, v in options.items())
    path.write_text(
        f'dataset = "{dataset}"\nout_dir = "{path.parent / "res"}"\nwarmup = 1\nidle_s = 1.0\n'
        '[generation]\nmax_tokens = 16\n'
        '[[backends]]\nname = "smollm2-server"\nkind = "openai"\nmodel = "smollm2-135m"\nrole = "cloud"\n'
        'server = "llama-cpp"\nn_threads = 2\nn_ctx = 1024\nserver_timeout_s = 300.0\ntimeout_s = 120.0\n'
        f'max_retries = 1\nretry_backoff_s = 0.1\n{opts}')
    return path


def llama_servers() -> list[psutil.Process]:
    return children(lambda p: "llama_cpp.server" in " ".join(p.cmdline()))


def test_managed_llama_server_end_to_end(small_jsonl, tmp_path, run_cli):
    cfg = server_config(tmp_path / "s.toml", small_jsonl, concurrency=2)
    out = tmp_path / "res"
    code, stdout, err = run_cli("run", cfg, "--out", out)
    assert code == 0, err
    (run_dir,) = list(out.iterdir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    info = manifest["backends"][0]
    server = info["server"]
    assert server["kind"] == "llama-cpp" and "--n_threads" in server["command"]
    assert server["command"][server["command"].index("--host") + 1] == "127.0.0.1"
    assert info["remote"] is False and info["base_url"] == f"http://127.0.0.1:{server['port']}/v1"
    assert info["request_params"]["repeat_penalty"] == 1.0 and info["request_params"]["top_k"] == 40
    assert gone(server["pid"]), "the server is stopped at the end"
    log = run_dir / "server-smollm2-server.log"
    assert log.exists() and "Uvicorn running" in log.read_text()
    frame = pd.read_parquet(run_dir / "records.parquet")
    assert list(frame["query_id"]) == ["a1", "a2", "m1", "s1"]
    assert frame["error"].isna().all(), frame["error"].tolist()
    assert (frame["completion_tokens"] > 0).all() and (frame["completion_tokens"] <= 16).all()
    # streamed without usage: prompt tokens counted with the GGUF's tokenizer (exactness: the test below)
    assert (frame["prompt_tokens"] > 5).all() and "GGUF's tokenizer" in info["usage_source"]
    assert (frame["ttft_s"] > 0).all() and (frame["latency_s"] >= frame["ttft_s"]).all()
    # the server's own process tree is measured (CPU model here: no RAPL, no GPU on these machines)
    assert set(frame["energy_source"]) == {"model.cpu"} and set(frame["energy_quality"]) == {"estimated"}
    assert (frame["energy_j"] > 0).all()
    assert frame["output"].str.len().gt(0).all()
    assert not llama_servers()


def test_server_killed_mid_run_stops_the_backend(small_jsonl, tmp_path):
    """A managed server that dies is not asked again query after query (each retried): the backend stops at
    the first request that fails, with one line, and the run ends failed with the records before it
    (tests/backends/test_engine_failures.py: llama-server, concurrency 4, --resume)."""
    from ipw.inputs.config import load_config
    from ipw.running.runner import execute
    from runfolders import start_run

    config = load_config(str(server_config(tmp_path / "s.toml", small_jsonl)))
    folder, queries = start_run(config, command=["test"])
    records, notices = [], []

    def progress(record):
        records.append(record)
        if len(records) == 1:  # kill the server while the second query runs
            (server,) = llama_servers()
            threading.Timer(0.05, os.kill, (server.pid, signal.SIGKILL)).start()

    assert execute(folder, config, queries, progress, notice=notices.append) == "failed"
    manifest = json.loads((folder.path / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["backends"][0]["server"]["exited"] == "SIGKILL (signal 9)"
    (line,) = notices
    assert line.startswith("backend 'smollm2-server': the llama.cpp server (llama_cpp.server) exited mid-run "
                           "(SIGKILL (signal 9)"), line
    frame = pd.read_parquet(folder.path / "records.parquet")
    assert 1 <= len(frame) < 4 and frame["error"].isna().all(), frame["error"].tolist()
    assert not llama_servers()


def test_ctrl_c_stops_the_server(small_jsonl, tmp_path):
    from ipw.inputs.config import load_config
    from ipw.running.runner import execute
    from runfolders import start_run

    config = load_config(str(server_config(tmp_path / "s.toml", small_jsonl)))
    folder, queries = start_run(config, command=["test"])
    pids = []

    def progress(record):
        pids.extend(p.pid for p in llama_servers())
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute(folder, config, queries, progress)
    assert len(pids) == 1 and gone(pids[0])
    assert json.loads((folder.path / "manifest.json").read_text())["status"] == "interrupted"


def test_server_that_cannot_start_fails_cleanly(tmp_path):
    from ipw.backends.servers import start_server

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file" * 100)
    with pytest.raises(IpwError, match=r"exited while starting \(exit code 1\): "):
        start_server("llama-cpp", bad, tmp_path / "server.log", n_threads=1, alias="x", timeout_s=120)
    assert (tmp_path / "server.log").read_text()
    assert not llama_servers()


def test_prompt_tokens_counted_as_the_server_counts_them(tmp_path):
    """llama.cpp's server sends no usage while streaming; ipw counts prompt tokens with the GGUF's own
    tokenizer and chat template. The count must equal the server's own, which it reports when not
    streaming, for the chat and the completions API."""
    import http.client

    from ipw.backends.base import few_shot_prompt
    from ipw.backends.llama_cpp import PromptTokenCounter
    from ipw.backends.servers import start_server
    from ipw.inputs.models import resolve_model

    path, _ = resolve_model("smollm2-135m")
    counter = PromptTokenCounter(path, "t")
    server = start_server("llama-cpp", path, tmp_path / "s.log", n_threads=1, n_ctx=1024, alias="m", timeout_s=300)
    try:
        for question in ("What is 2 + 3?", "Which planet is known as the Red Planet?\nA. Venus\nB. Mars"):
            messages = [{"role": "user", "content": question}]
            for route, body, mine in (
                ("chat/completions", {"messages": messages}, counter.count(messages=messages)),
                ("completions", {"prompt": few_shot_prompt(question)}, counter.count(prompt=few_shot_prompt(question))),
            ):
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
                conn.request("POST", f"/v1/{route}", json.dumps({"model": "m", "max_tokens": 1, **body}),
                             {"Content-Type": "application/json"})
                usage = json.loads(conn.getresponse().read())["usage"]
                conn.close()
                assert mine == usage["prompt_tokens"] > 5, (route, question, mine, usage)
    finally:
        server.stop()
        counter.close()  # its tokenizer worker


def test_stop_ends_the_process_group_a_killed_server_leaves(tmp_path):
    """A server whose front end is killed outright leaves its worker behind, re-parented (a vLLM engine core
    did, holding 28 GiB of GPU memory on the H200): ``stop`` ends every process of the server's group, not only
    the front end's children of the moment."""
    import subprocess
    import sys

    from ipw.backends.servers import ManagedServer, free_port

    port = free_port()
    worker_pid = tmp_path / "worker.pid"
    script = (
        "import http.server, subprocess, sys\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(worker_pid)!r}, 'w').write(str(w.pid))\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a):\n"
        "        pass\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    server = ManagedServer([sys.executable, "-c", script], port, tmp_path / "server.log")
    server.start(timeout_s=60)
    try:
        worker = psutil.Process(int(worker_pid.read_text()))
        os.kill(server.pid, signal.SIGKILL)  # the front end dies; its worker is re-parented and lives on
        server.proc.wait(10)
        assert worker.is_running() and worker.ppid() != server.pid
        assert server.stop(grace_s=5) == -signal.SIGKILL
        assert gone(worker.pid), "the worker the killed server left is ended with its group"
    finally:
        subprocess.run(["kill", "-9", worker_pid.read_text()], capture_output=True)
