"""``ipw run --ray``: on a local Ray cluster (a head and two worker nodes, started here) with the real
llama.cpp engine; a sharded run covers exactly the unsharded run's queries, tasks sharing a machine
do not double count energy, and a killed worker or a lost node is recovered."""

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from ipw.backends.base import BackendSpec
from ipw.errors import IpwError
from conftest import mixed_accuracy_jsonl, only_run, smol_config

KEY = ["backend", "query_id", "repeat"]


# -- pure: what a task asks for, how many shards, which sensors ------------------------------------------


def test_task_resources():
    from ipw.running.ray_runner import task_resources

    def res(kind="llama-cpp", **options):
        return task_resources(BackendSpec("b", kind, "m", options=options))

    assert res() == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert res(n_threads=4) == {"num_cpus": 4.0, "num_gpus": 0.0}
    assert res(n_gpu_layers=-1, n_threads=8) == {"num_cpus": 1.0, "num_gpus": 1.0}, "offloads: one GPU"
    assert res(n_gpu_layers=0) == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert res("vllm") == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert res("openai", server="vllm")["num_gpus"] == 1.0
    assert res("openai", server="llama-cpp", n_threads=2) == {"num_cpus": 2.0, "num_gpus": 0.0}
    assert res("vllm", ray_num_gpus=0, ray_num_cpus=2) == {"num_cpus": 2.0, "num_gpus": 0.0}, "the config wins"


def test_default_shards():
    from ipw.inputs.config import parse_config
    from ipw.running.ray_runner import default_shards

    config = parse_config('dataset = "d"\n[[backends]]\nname = "a"\nkind = "llama-cpp"\nmodel = "m"\nn_threads = 2\n'
                          '[[backends]]\nname = "g"\nkind = "llama-cpp"\nmodel = "m"\nn_gpu_layers = -1\n', "c.toml")
    assert default_shards(config, {"CPU": 8.0, "GPU": 2.0}, 100) == 4, "the backend that fits most often"
    assert default_shards(config, {"CPU": 8.0, "GPU": 2.0}, 3) == 3, "at most one per query"
    with pytest.raises(IpwError, match="backend g asks Ray for 1 CPU.* and 1 GPU.*cluster has 8 CPU.* and 0 GPU"):
        default_shards(config, {"CPU": 8.0}, 100)


def test_config_ray_resources_validated():
    from ipw.inputs.config import parse_config

    config = parse_config('dataset = "d"\n[[backends]]\nname = "a"\nkind = "llama-cpp"\nmodel = "m"\n'
                          'ray_num_gpus = 0.5\n', "c.toml")
    assert config.backends[0].options["ray_num_gpus"] == 0.5
    with pytest.raises(IpwError, match="c.toml:6: field 'backends\\[0\\].ray_num_cpus': must be >= 0"):
        parse_config('dataset = "d"\n[[backends]]\nname = "a"\nkind = "llama-cpp"\nmodel = "m"\nray_num_cpus = -1\n',
                     "c.toml")


@pytest.mark.ray
def test_shared_node_probe_never_uses_rapl_nor_unassigned_gpus(monkeypatch):
    """Package-wide RAPL (and GPUs the task was not given) would charge a task its neighbours' energy."""
    ray = pytest.importorskip("ray")
    from ipw.running import ray_runner
    from ipw.telemetry import probe
    from ipw.telemetry.cpu_model import CpuModelSensor

    calls = []
    monkeypatch.setattr(probe.RaplSensor, "probe", classmethod(lambda cls, root: calls.append("rapl") or object()))
    monkeypatch.setattr(probe.NvmlSensor, "probe", classmethod(lambda cls, indices: calls.append(indices)))
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])

    class Backend:
        remote = False

        def pids(self):
            return [os.getpid()]

    sensors = ray_runner.shared_node_probe(Backend())
    assert [type(s) for s in sensors] == [CpuModelSensor] and calls == []
    for s in sensors:
        s.close()
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [1])  # Ray gave it GPU 1 and set CUDA_VISIBLE_DEVICES=1
    sensors = ray_runner.shared_node_probe(Backend())
    assert calls == [None], "NVML probed once, on CUDA_VISIBLE_DEVICES (the task's GPUs); RAPL never"
    for s in sensors:
        s.close()


def test_missing_ray_names_the_extra(run_cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    code, out, err = run_cli("run", "--ray", "auto")
    assert code == 2 and "pip install 'ipw[ray]'" in err and "Traceback" not in err


def test_an_address_where_no_cluster_answers_fails_at_once(run_cli, tmp_path, monkeypatch):
    """``--ray 127.0.0.1:1`` (nothing listens) hung: Ray retries a silent address for ~14 minutes.  Now one line,
    exit 2, no run folder, within seconds; an address where something else listens gets one try of Ray's (~40 s),
    not twenty."""
    ray = pytest.importorskip("ray")
    from ipw.running import ray_runner

    config = _config(tmp_path)
    t0 = time.monotonic()
    code, _, err = run_cli("run", config, "--ray", "127.0.0.1:1", "--out", tmp_path / "out")
    assert code == 2 and time.monotonic() - t0 < 15, err
    assert "--ray 127.0.0.1:1: cannot connect to a Ray cluster (nothing answers at" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    code, _, err = run_cli("run", config, "--ray", "ray://127.0.0.1:1", "--out", tmp_path / "out")
    assert code == 2 and "nothing answers at 127.0.0.1:1" in err, err

    seen = {}

    def init(**kwargs):
        seen.update({k: os.environ.get(k) for k in ray_runner.RAY_CONNECT_ENV})
        raise ConnectionError("Failed to connect to Ray cluster")

    monkeypatch.setattr(ray_runner, "_listening", lambda host, port: True)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("RAY_gcs_server_port_wait_time_s", raising=False)
    code, _, err = run_cli("run", config, "--ray", "127.0.0.1:6379", "--out", tmp_path / "out")
    assert code == 2 and "Failed to connect to Ray cluster" in err
    assert seen == {"RAY_gcs_server_port_wait_time_s": "1"} and "RAY_gcs_server_port_wait_time_s" not in os.environ


# -- a local cluster and real runs --------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    # node death is noticed after ~2 s instead of Ray's default ~30 s (the lost-node test)
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                           "health_check_initial_delay_ms": 0}})
    for _ in range(2):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    c.shutdown()


def _config(tmp_path: Path, limit: int = 10, max_tokens: int = 12) -> Path:
    return smol_config(tmp_path / "ray.toml", mixed_accuracy_jsonl(tmp_path), limit=limit, max_tokens=max_tokens,
                       out_dir=tmp_path / "unused")


def _records(run_dir: Path) -> pd.DataFrame:
    return pd.read_parquet(run_dir / "records.parquet").set_index(KEY).sort_index()


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    from ipw.cli import main

    tmp = tmp_path_factory.mktemp("unsharded")
    assert main(["run", str(_config(tmp)), "--out", str(tmp / "out")]) == 0
    return only_run(tmp / "out")


def _same_as_unsharded(run_dir: Path, unsharded: Path) -> pd.DataFrame:
    a, b = _records(unsharded), _records(run_dir)
    assert list(a.index) == list(b.index) and b.index.is_unique, "exactly the unsharded run's queries, each once"
    assert (a["output"] == b["output"]).all(), "greedy decoding: the same answers"
    assert 0 < a["correct"].mean() < 1, "an accuracy that can differ"
    assert a["correct"].mean() == b["correct"].mean()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["dataset"]["fingerprint"] == json.loads((unsharded / "manifest.json").read_text())["dataset"]["fingerprint"]
    assert (b["node"].str.startswith("node-")).all()
    assert set(b["hardware_id"]) <= set(manifest["hardware_by_id"]), "every record's machine is in the manifest"
    return b


@pytest.mark.ray
@pytest.mark.llama
def test_ray_run_covers_the_unsharded_queries(cluster, unsharded, tmp_path, run_cli):
    code, _, err = run_cli("run", _config(tmp_path), "--ray", cluster.address, "--out", tmp_path / "out")
    assert code == 0, err
    run_dir = only_run(tmp_path / "out")
    _same_as_unsharded(run_dir, unsharded)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["ray"]["shards"] == 2, "as many shards as the cluster runs at once (2 nodes x 1 CPU)"
    assert [(t["shard"], t["attempts"], t["errors"]) for t in manifest["ray"]["tasks"]] == [(1, 1, []), (2, 1, [])]
    assert [s["shard"] for s in manifest["backends"][0]["shards"]] in ([1, 2], [2, 1])
    sensors = {s["name"] for s in manifest["backends"][0]["sensors"]}
    assert sensors == {"cpu_model"}, "under Ray the CPU part is the per-process CPU model"
    code, _, err = run_cli("compare", unsharded, run_dir, "--format", "json")
    assert code == 0, err
    code, _, err = run_cli("check", unsharded, run_dir, "--fail-if", "accuracy:-2pp")
    assert code == 0, err


def _cpu_busy_s() -> float:
    """CPU seconds the whole machine spent busy, summed over its CPUs (guest time is already in user)."""
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def _tree_cpu_s() -> dict[int, float]:
    """CPU seconds of each process of this test's tree (the cluster's processes and the run's), by pid:
    unlike the machine's, untouched by whatever else the machine runs."""
    times = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        times[proc.pid] = t.user + t.system
    return times


@pytest.mark.ray
@pytest.mark.llama
def test_tasks_sharing_a_machine_do_not_double_count(cluster, tmp_path, run_cli):
    """Both worker nodes are this machine: two tasks run at once on one CPU package.  Each record is
    charged the CPU time of its own process only, so the records' CPU seconds, summed, stay within
    what the whole machine spent while any query ran (a package-wide sensor would charge both tasks
    everything: about twice that); and they hold a fair part of what this test's own processes spent
    (the tasks' work is charged: the machine's other load, which varies, is left out of that bound)."""
    samples: list[tuple[float, float, dict[int, float]]] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((time.monotonic(), _cpu_busy_s(), _tree_cpu_s()))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        code, _, err = run_cli("run", _config(tmp_path, limit=12, max_tokens=24), "--ray", cluster.address,
                               "--out", tmp_path / "out")
    finally:
        stop.set()
        sampler.join()
    assert code == 0, err
    frame = pd.read_parquet(only_run(tmp_path / "out") / "records.parquet")
    cpu_s = [float(re.match(r"([0-9.]+) CPU s", json.loads(p)[0]["note"]).group(1)) for p in frame["energy_parts"]]
    windows = sorted(zip(frame["start_s"], frame["end_s"]))
    overlapping = sum(max(0.0, min(a1, b1) - max(a0, b0)) for i, (a0, a1) in enumerate(windows)
                      for (b0, b1) in windows[i + 1:])
    union = []
    for start, end in windows:
        if union and start <= union[-1][1]:
            union[-1][1] = max(union[-1][1], end)
        else:
            union.append([start, end])
    busy_in_windows = tree_in_windows = 0.0
    for (t0, c0, p0), (t1, c1, p1) in zip(samples, samples[1:]):
        mid = (t0 + t1) / 2
        if any(s <= mid <= e for s, e in union):
            busy_in_windows += c1 - c0
            tree_in_windows += sum(max(0.0, p1[pid] - p0[pid]) for pid in p1.keys() & p0.keys())
    span = sum(e - s for s, e in union)
    print(f"records: {sum(cpu_s):.2f} CPU s over {len(cpu_s)} queries; machine: {busy_in_windows:.2f} CPU s busy in "
          f"{span:.2f} s of query windows, this test's processes {tree_in_windows:.2f}; windows overlapped "
          f"{overlapping:.2f} s")
    assert overlapping > 0.25 * span, "the two tasks really ran at the same time"
    assert sum(cpu_s) <= 1.1 * busy_in_windows + 0.2, "no CPU second is charged twice"
    assert sum(cpu_s) >= 0.3 * tree_in_windows, "and the tasks' own work is charged"


def _task_worker() -> psutil.Process | None:
    """The worker process (started by this test's cluster) running one of the run's tasks."""
    for proc in psutil.Process().children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
            if "ray::ipw smol shard" in title or "ray::shard_task" in title:
                return proc
        except psutil.Error:
            continue
    return None


def _when_records(out: Path, n: int, action, timeout_s: float = 120.0) -> threading.Thread:
    """Run ``action`` once the run folder under ``out`` holds ``n`` records (in a thread)."""

    def watch():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            logs = list(out.glob("*/records.jsonl"))
            if logs and len(logs[0].read_text().splitlines()) >= n:
                action()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.ray
@pytest.mark.llama
def test_killed_worker_is_recovered(cluster, unsharded, tmp_path, run_cli):
    killed = []

    def kill():
        proc = _task_worker()
        if proc is not None:
            killed.append(" ".join(proc.cmdline()).strip())
            os.kill(proc.pid, signal.SIGKILL)

    watcher = _when_records(tmp_path / "out", 2, kill)
    code, _, err = run_cli("run", _config(tmp_path), "--ray", cluster.address, "--out", tmp_path / "out")
    watcher.join()
    assert code == 0, err
    assert killed, "a worker was killed mid-run"
    run_dir = only_run(tmp_path / "out")
    _same_as_unsharded(run_dir, unsharded)
    tasks = json.loads((run_dir / "manifest.json").read_text())["ray"]["tasks"]
    retried = [t for t in tasks if t["attempts"] == 2]
    assert len(retried) == 1 and retried[0]["errors"], tasks
    print("killed", killed[0], "->", retried[0]["errors"])


@pytest.mark.ray
@pytest.mark.llama
def test_lost_node_is_recovered(cluster, unsharded, tmp_path, run_cli):
    lost = []

    def remove_node():
        proc = _task_worker()
        if proc is None:
            return
        raylets = {n.all_processes["raylet"][0].process.pid: n for n in cluster.worker_nodes}
        node = next((raylets[p.pid] for p in proc.parents() if p.pid in raylets), None)
        if node is not None:
            lost.append(node)
            cluster.remove_node(node, allow_graceful=False)

    watcher = _when_records(tmp_path / "out", 2, remove_node)
    t0 = time.monotonic()
    try:
        code, _, err = run_cli("run", _config(tmp_path), "--ray", cluster.address, "--out", tmp_path / "out")
    finally:
        watcher.join()
        if lost:  # give the module's cluster its node back
            cluster.add_node(num_cpus=1)
    assert code == 0, err
    assert lost, "a node was removed mid-run"
    run_dir = only_run(tmp_path / "out")
    _same_as_unsharded(run_dir, unsharded)
    tasks = json.loads((run_dir / "manifest.json").read_text())["ray"]["tasks"]
    assert sorted(t["attempts"] for t in tasks) == [1, 2], tasks
    print(f"run with a lost node: {time.monotonic() - t0:.1f} s; errors: {[t['errors'] for t in tasks]}")


@pytest.mark.ray
@pytest.mark.llama
def test_resume_a_ray_run(cluster, unsharded, tmp_path, run_cli):
    """An interrupted Ray run resumes on Ray and runs only the missing keys."""
    code, _, err = run_cli("run", _config(tmp_path), "--ray", cluster.address, "--out", tmp_path / "out")
    assert code == 0, err
    run_dir = only_run(tmp_path / "out")
    lines = (run_dir / "records.jsonl").read_text().splitlines(keepends=True)
    kept = lines[:3]
    (run_dir / "records.jsonl").write_text("".join(kept))
    (run_dir / "records.parquet").unlink()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (run_dir / "manifest.json").write_text(json.dumps({**manifest, "status": "interrupted"}))
    code, _, err = run_cli("run", "--resume", run_dir, "--ray", cluster.address)
    assert code == 0, err
    frame = _same_as_unsharded(run_dir, unsharded)
    after = (run_dir / "records.jsonl").read_text().splitlines(keepends=True)
    assert after[:3] == kept and len(after) == len(frame), "the kept records stay; only the missing ran"


@pytest.mark.ray
@pytest.mark.llama
def test_failing_task_is_retried_then_reported(cluster, tmp_path, run_cli):
    """A task that raises (here: a model file llama.cpp cannot load) is submitted again; after 3
    attempts the run stops (status failed) with the reason in one line, and the manifest lists every error."""
    import struct

    bad = tmp_path / "broken.gguf"  # a header ipw accepts (version 3, no tensors), a model llama.cpp cannot load
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0) + b"\0" * 64)
    config = tmp_path / "bad.toml"
    config.write_text(f'''dataset = "ipw-core"
limit = 2
warmup = 0
idle_s = 0
[[backends]]
name = "broken"
kind = "llama-cpp"
model = "{bad}"
n_threads = 1
''')
    code, out, err = run_cli("run", config, "--ray", cluster.address, "--shards", "1", "--out", tmp_path / "out")
    assert code == 2 and "backend broken shard 1/1 failed 3 times" in err and "--resume" in err, err
    assert "Traceback" not in err + out
    manifest = json.loads((only_run(tmp_path / "out") / "manifest.json").read_text())
    assert manifest["status"] == "failed"
    (task,) = manifest["ray"]["tasks"]
    assert task["attempts"] == 3 and len(task["errors"]) == 3, task
