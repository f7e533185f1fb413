"""llama.cpp (llama-cpp-python), in a worker process (``ipw.backends.worker``).

``LlamaCppBackend`` is what the run holds: it checks the model file here and runs ``LlamaCppEngine``
in a worker, which imports ``llama_cpp`` first (before numpy; never pandas or pyarrow).

Generation runs token by token through ``Llama.generate`` so that every token is counted and
timestamped exactly (llama.cpp sends no usage while streaming).  Instruction models are prompted
through the chat template stored in the GGUF; base models get a few-shot completion prompt.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from ipw.backends.base import (FEW_SHOT_STOP, BackendSpec, Completion, GenerationSettings,
                               few_shot_prompt)
from ipw.backends.worker import WorkerBackend
from ipw.errors import IpwError, missing_extra
from ipw.inputs.models import resolve_model

OPTIONS = {"n_threads": int, "n_ctx": int, "n_gpu_layers": int, "chat_template": str, "prefix_cache": bool,
           "python": str, "logprobs": bool}


def _import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise missing_extra("llama-cpp-python", "llama") from None
    return llama_cpp


_PROBED: dict[str, dict[str, Any]] = {}  # interpreter -> its llama.cpp build (probe_engine)


class LlamaCppBackend(WorkerBackend):
    """The run's handle on a llama.cpp engine in a worker process."""

    ENGINE = "ipw.backends.llama_cpp:LlamaCppEngine"
    OPTIONS = OPTIONS
    LABEL = "llama.cpp"

    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        self.model_path, default_mode = resolve_model(spec.model)  # a missing file fails before the run
        self.mode = spec.mode or default_mode or "chat"

    def preflight(self) -> dict[str, Any]:
        """The engine build, checked once per interpreter in a worker (``probe_engine``)."""
        python = self.python()
        if python not in _PROBED:
            _PROBED[python] = probe_engine(python)
        return _PROBED[python]

    def engine_spec(self) -> BackendSpec:
        """The worker gets the file and mode resolved here (its interpreter may lack the model packages)."""
        return dataclasses.replace(self.spec, model=str(self.model_path), mode=self.mode)


class LlamaCppEngine:
    """The engine itself: runs in the worker process only."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.model_path, default_mode = resolve_model(spec.model)
        self.mode = spec.mode or default_mode or "chat"
        self._llm: Any = None
        self._formatter: Any = None
        self._is_eog: Any = None  # token -> bool, once loaded
        self._piece: Any = None  # token -> its bytes, once loaded
        self._logprob: Any = None  # token -> its log-probability under the last logits, once loaded
        self.gpu_offload = False  # set by load

    def load(self) -> None:
        llama_cpp = self._llama_cpp = _import_llama_cpp()
        opts = self.spec.options
        n_gpu_layers = opts.get("n_gpu_layers", -1 if llama_cpp.llama_supports_gpu_offload() else 0)
        n_threads = opts.get("n_threads", os.cpu_count() or 1)
        try:
            self._llm = llama_cpp.Llama(
                model_path=str(self.model_path),
                n_ctx=opts.get("n_ctx", 4096),
                n_threads=n_threads,
                n_threads_batch=n_threads,  # prefill too: llama-cpp-python defaults it to every core
                n_gpu_layers=n_gpu_layers,
                verbose=False,
            )
        except ValueError as exc:  # llama-cpp-python raises ValueError for an unloadable file
            raise IpwError(f"backend {self.spec.name!r}: cannot load {self.model_path}: {exc}") from None
        self.gpu_offload = bool(n_gpu_layers) and llama_cpp.llama_supports_gpu_offload()
        # Per token, whether it ends the generation and its bytes: each a call into llama.cpp through ctypes
        # (6 and 23 us here, 1-2% of a token's time on a GPU), the same answer for a token every time, so
        # asked once per distinct token of the run.
        llm, vocab = self._llm, self._llm._model.vocab
        self._is_eog = functools.cache(lambda token: bool(llama_cpp.llama_vocab_is_eog(vocab, token)))
        self._piece = functools.cache(lambda token: llm.detokenize([token]))
        if self.mode == "chat":
            self._formatter = chat_formatter(self._llm, opts.get("chat_template"), self.spec.name, self.model_path)
        if opts.get("logprobs", False):
            self._logprob = token_logprob(llm)

    def _prompt(self, prompt: str) -> tuple[str, tuple[str, ...]]:
        if self.mode == "chat":
            formatted = self._formatter(messages=[{"role": "user", "content": prompt}])
            return formatted.prompt, tuple(s for s in formatted.stop if s)
        return few_shot_prompt(prompt), FEW_SHOT_STOP

    def generate(self, prompt: str, settings: GenerationSettings) -> Completion:
        # the query starts here: its chat template, tokenizing and the context's reset are the engine's
        # work (a bare loop does them too), so TTFT and latency include them
        start = time.monotonic()
        llm = self._llm
        text_prompt, stops = self._prompt(prompt)
        stops = tuple(s for s in stops + settings.stop if s)
        tokens = llm.tokenize(text_prompt.encode("utf-8"), add_bos=True, special=True)
        bos = llm.token_bos()
        if len(tokens) >= 2 and tokens[0] == tokens[1] == bos:  # the template already wrote BOS
            tokens = tokens[1:]
        if len(tokens) + settings.max_tokens > llm.n_ctx():
            raise IpwError(f"prompt of {len(tokens)} tokens does not fit the context ({llm.n_ctx()}); raise n_ctx")
        if not self.spec.options.get("prefix_cache", False):
            llm.reset()  # every query from a clean context: no KV reuse from the previous prompt
        llm.set_seed(settings.seed)
        greedy = settings.temperature <= 0
        is_eog, piece_of = self._is_eog, self._piece
        # Per token only O(1) work (at 600 tokens/s on a GPU, re-decoding the whole answer after every
        # token cost 15% of the decode speed): the new token's bytes are appended and only the tail that
        # can hold a stop string is searched; the text is decoded once at the end.
        stop_bytes = [s.encode("utf-8") for s in stops]
        reach = max((len(b) for b in stop_bytes), default=0)
        tail = b""
        times: list[float] = []
        out: list[int] = []
        logprob, logprobs = self._logprob, []
        finish = "length"
        for token in llm.generate(
            tokens,
            temp=0.0 if greedy else settings.temperature,
            top_k=1 if greedy else settings.top_k,
            top_p=1.0 if greedy else settings.top_p,
            min_p=0.0,
            repeat_penalty=settings.repeat_penalty,
            reset=True,
        ):
            now = time.monotonic()
            if is_eog(token):
                finish = "stop"
                break
            out.append(token)
            times.append(now)
            if logprob is not None:
                logprobs.append(logprob(token))
            if stop_bytes:
                piece = piece_of(token)
                tail = (tail + piece)[-(reach + len(piece)):]
                if any(b in tail for b in stop_bytes):
                    finish = "stop"
                    break
            if len(out) >= settings.max_tokens:
                break
        text = llm.detokenize(out).decode("utf-8", errors="ignore")
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
        end = time.monotonic()
        return Completion(
            text=text.strip(),
            prompt_tokens=len(tokens),
            completion_tokens=len(out),
            start_s=start,
            first_token_s=times[0] if times else None,
            end_s=end,
            token_times_s=tuple(times),
            finish_reason=finish,
            mean_logprob=sum(logprobs) / len(logprobs) if logprobs else None,
        )

    def describe(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {
            "engine": "llama-cpp-python",
            "engine_version": version("llama-cpp-python"),
            **engine_build(),
            "model_file": str(self.model_path),
            "model_bytes": self.model_path.stat().st_size,
            "mode": self.mode,
            "gpu_offload": self.gpu_offload,
            "n_threads": self.spec.options.get("n_threads", os.cpu_count()),
            "prefix_cache": self.spec.options.get("prefix_cache", False),
            "logprobs": self._logprob is not None,  # each answer's mean_logprob (token_logprob)
        }

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None


def token_logprob(llm: Any) -> Any:
    """A function of the token just sampled: its natural-log probability under the logits it was sampled
    from (the context's last row; llama.cpp keeps it until the next token is evaluated), from the raw
    logits as llama-server reports it, so before temperature and top-k: ``x[token] - logsumexp(x)``.

    Per token one pass over the vocabulary (max, exp, sum) into one reused buffer, nothing else, but the exp
    of every logit is not free: on the 2-core VM 0.4 ms a token for SmolLM2's 49k-token vocabulary and
    1.2-2 ms for Gemma 3's 262k, which slowed decoding by 1.0% (SmolLM2, 1 thread), 2.5% (2 threads),
    2.3% and 5.5% (Gemma 3).  So it is asked for (``logprobs = true``), not done by default."""
    import numpy as np

    n_vocab, ctx = llm.n_vocab(), llm._ctx
    buf = np.empty(n_vocab, np.float32)

    def logprob(token: int) -> float:
        x = np.ctypeslib.as_array(ctx.get_logits_ith(-1), shape=(n_vocab,))
        top = x.max()
        np.subtract(x, top, out=buf)
        np.exp(buf, out=buf)
        return float(x[token] - top) - math.log(float(buf.sum(dtype=np.float64)))

    return logprob


def chat_formatter(llm: Any, template: str | None, backend: str, model_path: Path) -> Any:
    """The chat template (given, else the GGUF's) as llama-cpp-python renders it, with the model's own
    BOS and EOS texts: what the in-process backend uses and what llama.cpp's server applies."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = template or llm.metadata.get("tokenizer.chat_template")
    if not template:
        raise IpwError(f"backend {backend!r}: {model_path.name} has no chat template; "
                       "set mode = \"completion\" for a base model or give chat_template")
    eos, bos = llm.token_eos(), llm.token_bos()
    return Jinja2ChatFormatter(template=template,
                               eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
                               bos_token=llm._model.token_get_text(bos) if bos != -1 else "")


def engine_build() -> dict[str, Any]:
    """What the loaded llama.cpp build runs on this machine (worker side): the CPU variant, i.e. the
    instruction sets it was compiled for (``llama_print_system_info``), and whether it can offload to
    a GPU.  ``ipw doctor`` and every run's manifest record it."""
    from ipw.backends.llama_build import compiled_features

    llama_cpp = _import_llama_cpp()
    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
    return {"cpu_variant": "+".join(f.lower() for f in compiled_features(info)) or "baseline",
            "system_info": info, "gpu_offload_supported": bool(llama_cpp.llama_supports_gpu_offload())}


class EngineProbe:
    """Worker side of ``probe_engine``: imports llama_cpp (nothing else) and reports its build."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec

    def load(self) -> None:
        _import_llama_cpp()

    def describe(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {"engine_version": version("llama-cpp-python"), **engine_build(),
                "modules": list(sys.modules)}  # in import order: for the tests of what a worker loads

    def close(self) -> None:
        pass


def probe_engine(python: str | None = None) -> dict[str, Any]:
    """Start a worker that imports llama.cpp and reports its build, before a model loads: a build that
    cannot run on this CPU is refused here in one line, not with SIGILL mid-run."""
    from ipw.backends.llama_build import missing_features
    from ipw.telemetry.cpu_isa import cpu_flags

    probe = LlamaCppProbe(BackendSpec(name="engine-check", kind="llama-cpp", model="", options=(
        {"python": python} if python else {})))
    try:
        probe._start()  # once: no restarts for a check
        info = probe.describe()
    finally:
        probe.close()
    missing = missing_features(info["system_info"], cpu_flags())
    if missing:
        raise IpwError(f"the llama-cpp-python build ({info['cpu_variant']}) uses {', '.join(missing)}, which this "
                       "CPU lacks; rebuild it for this machine: bash .ci/setup")
    return info


class LlamaCppProbe(WorkerBackend):
    ENGINE = "ipw.backends.llama_cpp:EngineProbe"
    LABEL = "llama.cpp"


class TokenCounterEngine:
    """Worker side of ``PromptTokenCounter``: the GGUF's vocabulary alone (``vocab_only``, no weights)."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self._formatter: Any = None

    def load(self) -> None:
        llama_cpp = _import_llama_cpp()
        self._llm = llama_cpp.Llama(model_path=self.spec.model, vocab_only=True, verbose=False)

    def count(self, messages: list[dict[str, str]] | None = None, prompt: str | None = None) -> int:
        if messages is not None:
            if self._formatter is None:
                self._formatter = chat_formatter(self._llm, self.spec.options.get("chat_template"), self.spec.name,
                                                 Path(self.spec.model))
            text = self._formatter(messages=messages).prompt
            return len(self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))
        return len(self._llm.tokenize((prompt or "").encode("utf-8"), add_bos=True, special=True))

    def describe(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self._llm.close()


class PromptTokenCounter(WorkerBackend):
    """Prompt tokens of a request to a llama.cpp server (``python -m llama_cpp.server``), which sends no
    usage while streaming: the GGUF's vocabulary tokenizes the prompt as the server does (in a worker
    process): the chat API through the model's chat template (no extra BOS: the template writes it),
    the completions API as raw text with BOS."""

    ENGINE = "ipw.backends.llama_cpp:TokenCounterEngine"
    LABEL = "llama.cpp tokenizer"

    def __init__(self, model_path: Path, backend: str, chat_template: str | None = None) -> None:
        super().__init__(BackendSpec(name=f"{backend}-tokenizer", kind="llama-cpp", model=str(model_path),
                                     options={"chat_template": chat_template} if chat_template else {}))
        self.load()

    def count(self, *, messages: list[dict[str, str]] | None = None, prompt: str | None = None) -> int:
        return int(self.invoke("count", messages=messages, prompt=prompt))
