"""Engines in worker processes (ipw/backends/worker.py), with the real llama.cpp engine: what a worker
loads, a worker killed with SIGSEGV, SIGKILL and SIGILL at random moments (nothing lost or duplicated,
correct error records), the restart budget, and a run that always ends with a status."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from ipw.backends.base import BackendSpec, GenerationSettings, QueryError
from ipw.backends.llama_cpp import LlamaCppBackend, probe_engine
from ipw.backends.worker import MAX_RESTARTS, EngineStopped, exit_text
from ipw.errors import IpwError
from conftest import WORDS, only_run

pytestmark = pytest.mark.llama
IPW = [sys.executable, "-m", "ipw.cli"]


def _spec(name: str = "smol", **options) -> BackendSpec:
    return BackendSpec(name=name, kind="llama-cpp", model="smollm2-135m", options={"n_threads": 1, **options})


def _words_jsonl(tmp_path: Path, n: int) -> Path:
    rows = [{"id": f"w{i}", "prompt": f"Repeat this word exactly: {WORDS[i % len(WORDS)]}",
             "answer": WORDS[i % len(WORDS)], "scorer": "contains", "category": "copy"} for i in range(n)]
    path = tmp_path / "words.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path: Path, dataset: Path, names: tuple[str, ...] = ("smol",), max_tokens: int = 12) -> Path:
    backends = "".join(f'[[backends]]\nname = "{n}"\nkind = "llama-cpp"\nmodel = "smollm2-135m"\nn_threads = 1\n'
                       for n in names)
    path = tmp_path / "run.toml"
    path.write_text(f'dataset = "{dataset}"\nwarmup = 0\nidle_s = 0\nout_dir = "{tmp_path / "out"}"\n'
                    f"[generation]\nmax_tokens = {max_tokens}\n{backends}")
    return path


def _workers(root: int | None = None, exclude: frozenset[int] = frozenset()) -> list[psutil.Process]:
    """Live llama.cpp worker processes under ``root`` (default: this test process), less ``exclude``
    (workers that other tests of this process may have left)."""
    out = []
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for proc in children:
        try:
            if "ipw.backends.worker" in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            continue
    return [p for p in out if p.pid not in exclude]


def test_worker_loads_the_engine_first_and_no_analysis_stack():
    info = probe_engine()
    modules = info["modules"]
    assert "llama_cpp.llama_cpp" in modules  # the module that loads libllama through ctypes
    first_numpy = min(i for i, m in enumerate(modules) if m == "numpy" or m.startswith("numpy."))
    assert modules.index("llama_cpp.llama_cpp") < first_numpy
    assert not [m for m in modules if m.split(".")[0] in ("pandas", "pyarrow", "ipw.telemetry", "rich")]
    assert info["cpu_variant"] and "system_info" in info


def test_generate_in_a_worker_maps_and_clock():
    backend = LlamaCppBackend(_spec())
    backend.load()
    try:
        (pid,) = backend.pids()
        assert pid != os.getpid()
        before = time.monotonic()
        completion = backend.generate("Repeat this word exactly: apple", GenerationSettings(max_tokens=8))
        after = time.monotonic()
        # token timestamps come back on the shared monotonic clock
        assert before <= completion.start_s <= completion.first_token_s <= completion.end_s <= after
        assert list(completion.token_times_s) == sorted(completion.token_times_s)
        assert completion.completion_tokens == len(completion.token_times_s) > 0
        worker_maps = Path(f"/proc/{pid}/maps").read_text()
        own_maps = Path("/proc/self/maps").read_text()
        assert "libllama" in worker_maps and "libggml" in worker_maps
        assert "libllama" not in own_maps and "libggml" not in own_maps
        assert backend.describe()["cpu_variant"]
    finally:
        backend.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL, signal.SIGILL])
def test_a_killed_worker_fails_the_query_in_flight_then_restarts(sig):
    backend = LlamaCppBackend(_spec())
    backend.load()
    try:
        (pid,) = backend.pids()
        threading.Timer(0.15, os.kill, (pid, sig)).start()  # while the long answer is being generated
        with pytest.raises(QueryError) as err:
            backend.generate("Write a long story about a river and a stone.", GenerationSettings(max_tokens=400))
        assert err.value.category == "engine_crash"
        assert signal.Signals(sig).name in str(err.value)
        backend.recover()
        assert backend.restarts == 1 and backend.pids() != [pid]
        assert backend.generate("Repeat this word exactly: apple", GenerationSettings(max_tokens=8)).text
    finally:
        backend.close()


def test_restart_budget_then_engine_stopped():
    backend = LlamaCppBackend(_spec())
    backend.load()
    try:
        for i in range(MAX_RESTARTS + 1):
            os.kill(backend.pids()[0], signal.SIGKILL)
            with pytest.raises(QueryError):
                backend.generate("Repeat this word exactly: apple", GenerationSettings(max_tokens=8))
            if i < MAX_RESTARTS:
                backend.recover()
        with pytest.raises(EngineStopped, match=r"stopped: its llama.cpp worker died 4 times.*SIGKILL"):
            backend.recover()
    finally:
        backend.close()


def test_exit_text():
    assert exit_text(-11) == "SIGSEGV (signal 11)"
    assert exit_text(3) == "exit code 3"


def _killer(stop: threading.Event, rng: random.Random, signals: list[signal.Signals], killed: list,
            before: frozenset[int]) -> None:
    """Kill the worker of the run with each signal in turn, each at a random moment of its life."""
    for sig in signals:
        pid = None
        while not stop.is_set() and pid is None:
            found = [p.pid for p in _workers(exclude=before) if p.pid not in {k[0] for k in killed}]
            pid = found[0] if found else None
            time.sleep(0.01)
        if stop.is_set():
            return
        time.sleep(rng.uniform(0.0, 1.2))  # at load, between queries, or mid-answer
        try:
            os.kill(pid, sig)
            killed.append((pid, sig))
        except ProcessLookupError:
            pass


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines() if line.strip()]


def test_random_kills_lose_and_duplicate_nothing(tmp_path):
    from ipw.inputs.config import load_config
    from ipw.running.runner import execute
    from runfolders import start_run

    config = load_config(str(_config(tmp_path, _words_jsonl(tmp_path, 20))))
    folder, queries = start_run(config)
    rng = random.Random(int(os.environ.get("IPW_TEST_SEED", "7")))
    stop, killed = threading.Event(), []
    signals = [signal.SIGSEGV, signal.SIGKILL, signal.SIGILL]
    before = frozenset(p.pid for p in _workers())
    killer = threading.Thread(target=_killer, args=(stop, rng, signals, killed, before), daemon=True)
    killer.start()
    try:
        status = execute(folder, config, queries, lambda record: None)
    finally:
        stop.set()
        killer.join(timeout=10)
    records = _records(folder.path)
    keys = [(r["backend"], r["query_id"], r["repeat"]) for r in records]
    assert len(keys) == len(set(keys))  # nothing duplicated
    assert len(killed) == 3, killed  # every kill happened (the run takes longer than the kills)
    assert status == "complete" and set(keys) == {("smol", q.id, 0) for q in queries}  # nothing lost
    crashes = [r for r in records if r["error_category"] == "engine_crash"]
    assert len(crashes) <= 3  # a kill at load or between queries costs no query
    for r in crashes:
        assert r["correct"] == 0 and r["output"] == "" and any(s.name in r["error"] for _, s in killed)
    assert all(r["error"] is None for r in records if r["error_category"] != "engine_crash")
    manifest = json.loads((folder.path / "manifest.json").read_text())
    assert manifest["status"] == "complete" and (folder.path / "records.parquet").exists()
    (backend,) = manifest["backends"]
    assert backend["worker"]["restarts"] == 3
    assert [c.split(" ")[0] for c in backend["worker"]["crashes"]] == [s.name for _, s in killed]


def test_a_backend_that_keeps_crashing_stops_and_the_others_go_on(tmp_path):
    """The first backend's worker is killed at every start: after MAX_RESTARTS it stops with one line,
    the second backend runs every query, the run ends failed with records.parquet, and --resume
    (with a healthy engine) completes it."""
    config_path = _config(tmp_path, _words_jsonl(tmp_path, 4), names=("crashy", "steady"))
    proc = subprocess.Popen(IPW + ["run", str(config_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    killed: set[int] = set()
    deadline = time.monotonic() + 120
    while proc.poll() is None and not list((tmp_path / "out").glob("*/manifest.json")):
        time.sleep(0.005)  # the engine check before the run (a worker too) is over once the folder exists
    while proc.poll() is None and time.monotonic() < deadline and len(killed) < MAX_RESTARTS + 1:
        for worker in _workers(proc.pid):
            if worker.pid not in killed:
                killed.add(worker.pid)
                os.kill(worker.pid, signal.SIGSEGV)
        time.sleep(0.005)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "backend stopped:" in err and "'crashy' stopped" in err and "SIGSEGV" in err
    assert "Traceback" not in err
    run_dir = only_run(tmp_path / "out")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "crashy" in manifest["reason"]
    assert (run_dir / "records.parquet").exists()
    steady = [r for r in _records(run_dir) if r["backend"] == "steady"]
    assert len(steady) == 4 and all(r["error"] is None for r in steady)
    resumed = subprocess.run(IPW + ["run", "--resume", str(run_dir)], capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    records = _records(run_dir)
    keys = [(r["backend"], r["query_id"]) for r in records]
    assert len(keys) == len(set(keys)) and {b for b, _ in keys} == {"crashy", "steady"}
    assert sum(1 for b, _ in keys if b == "crashy") == 4
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "complete"


def test_ipw_process_maps_no_engine_while_running(tmp_path):
    """While `ipw run` runs, its own memory maps hold no libllama/libggml, and its worker's do."""
    proc = subprocess.Popen(IPW + ["run", str(_config(tmp_path, _words_jsonl(tmp_path, 12)))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    seen_worker = False
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and not seen_worker:
            try:
                children = psutil.Process(proc.pid).children()
            except psutil.NoSuchProcess:
                break
            for child in children:
                try:
                    worker_maps = Path(f"/proc/{child.pid}/maps").read_text()
                    own_maps = Path(f"/proc/{proc.pid}/maps").read_text()
                except OSError:
                    continue
                if "libllama" in worker_maps:
                    assert "libllama" not in own_maps and "libggml" not in own_maps
                    assert "libggml" in worker_maps
                    seen_worker = True
            time.sleep(0.05)
    finally:
        _, err = proc.communicate(timeout=120)
    assert seen_worker and proc.returncode == 0, err


def _foreign_cpuinfo(tmp_path: Path) -> Path:
    """A CPU like this one without the highest instruction set the engine build uses."""
    from ipw.backends.llama_build import SYSTEM_INFO_FLAGS, compiled_features
    from ipw.telemetry.cpu_isa import cpu_flags

    info = probe_engine()
    drop = SYSTEM_INFO_FLAGS[compiled_features(info["system_info"])[-1]]
    path = tmp_path / "cpuinfo"
    path.write_text("model name\t: Foreign CPU\nflags\t\t: " + " ".join(sorted(cpu_flags() - {drop})) + "\n")
    return path


def test_a_build_this_cpu_cannot_run_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("IPW_CPUINFO", str(_foreign_cpuinfo(tmp_path)))
    with pytest.raises(IpwError, match="which this CPU lacks; rebuild it for this machine: bash .ci/setup"):
        probe_engine()
    env = {**os.environ, "IPW_CPUINFO": str(tmp_path / "cpuinfo")}
    result = subprocess.run(IPW + ["run", str(_config(tmp_path, _words_jsonl(tmp_path, 2)))], capture_output=True,
                            text=True, env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and "which this CPU lacks" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()  # refused before the run folder


def test_no_engine_outlives_a_killed_ipw(tmp_path):
    """SIGKILL of `ipw run` (nothing of ipw runs any more): its worker leaves by itself within seconds."""
    proc = subprocess.Popen(IPW + ["run", str(_config(tmp_path, _words_jsonl(tmp_path, 40)))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    deadline, worker = time.monotonic() + 120, None
    while worker is None and time.monotonic() < deadline and proc.poll() is None:
        if list((tmp_path / "out").glob("*/records.jsonl")) and _lines_of(tmp_path) > 0:
            worker = next(iter(psutil.Process(proc.pid).children()), None)
        time.sleep(0.02)
    assert worker is not None
    proc.kill()
    proc.wait()
    try:
        worker.wait(timeout=10)  # psutil waits for a process that is not our child too
    except psutil.TimeoutExpired:
        worker.kill()
        pytest.fail("the worker outlived ipw")


def _lines_of(tmp_path: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in (tmp_path / "out").glob("*/records.jsonl"))


def test_nvml_measures_a_gpu_offloaded_worker(tmp_path, monkeypatch):
    """The GPU sensor with an engine whose PID tree is not ipw's own: NVML attributes by device and
    window, so the worker's records carry the GPU energy of their windows (a mocked pynvml, autospec'd,
    at a constant 300 W on the real clock), and the CPU model still measures the worker's tree."""
    from nvml_fakes import RealClock, make_fake, real_offset_ns, synthetic

    from ipw.inputs.config import load_config
    from ipw.running.runner import execute
    from runfolders import start_run

    sig, _ = synthetic(duration_s=600, idle_w=300.0, load_w=300.0, load=(0.0, 0.0), offset_ns=real_offset_ns(),
                       t0_s=time.monotonic() - 10)
    make_fake(monkeypatch, [sig], RealClock())
    cfg = _config(tmp_path, _words_jsonl(tmp_path, 4))
    # an idle baseline first, as a real run has: the counter then calibrates the samples over seconds
    cfg.write_text(cfg.read_text().replace("idle_s = 0", "idle_s = 3") + "n_gpu_layers = -1\n")
    config = load_config(str(cfg))
    folder, queries = start_run(config)
    assert execute(folder, config, queries, lambda record: None) == "complete"
    records = _records(folder.path)
    assert len(records) == 4
    for r in records:
        parts = {p["component"]: p for p in json.loads(r["energy_parts"])}
        assert parts["gpu0"]["source"].startswith("nvml") and parts["gpu0"]["quality"] == "measured_interpolated"
        assert parts["cpu-process"]["energy_j"] > 0  # the worker's CPU time, estimated, kept apart
        assert r["energy_source"].startswith("nvml") and r["energy_quality"] == "measured_interpolated"
        assert r["energy_j"] / (r["end_s"] - r["start_s"]) == pytest.approx(300.0, rel=0.1), parts
    (backend,) = json.loads((folder.path / "manifest.json").read_text())["backends"]
    assert backend["worker"]["python"] == sys.executable and "nvml" in backend["sampler_overhead"]


def test_a_worker_gets_no_secrets(monkeypatch):
    """An engine needs no API key: the worker's environment has none of ipw's secrets."""
    from ipw.backends.worker import worker_env

    monkeypatch.setenv("OPENAI_API_KEY", "sk-SENTINEL-123")
    monkeypatch.setenv("IPW_MODEL_CACHE", "/tmp/models")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    env = worker_env(sys.executable)
    assert "OPENAI_API_KEY" not in env and "SENTINEL" not in " ".join(env.values())
    assert env["IPW_MODEL_CACHE"] == "/tmp/models" and env["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_worker_started_beside_another_ipw_runs_this_one(tmp_path, monkeypatch):
    """ipw run from a folder that holds another ``ipw`` package (a second checkout): the worker imports
    this ipw, not that one (``python -m`` puts the current folder first on the path)."""
    from ipw.backends import llama_cpp

    decoy = tmp_path / "ipw"
    (decoy / "backends").mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise SystemExit(17)\n")
    (decoy / "backends" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(llama_cpp, "_PROBED", {})
    info = probe_engine()
    assert "llama_cpp.llama_cpp" in info["modules"] and info["cpu_variant"]
