"""The backend interface, the completion every backend returns, and the backend registry.

Built-in backends register exactly as an extension would (``register_backend``); tests register fakes
through the same registry.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ipw.errors import IpwError


@dataclass(frozen=True)
class GenerationSettings:
    max_tokens: int = 48
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 40
    repeat_penalty: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServerTimings:
    """A server's own account of one request (llama-server's ``timings``): the prompt tokens it processed
    (what its prompt cache did not already hold) and how long that took, and the tokens it generated and
    how long that took.  The concurrent split places the prefill with them (``ipw.telemetry.estimator``)."""

    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float


@dataclass(frozen=True)
class Completion:
    """One answer, with the timing of its tokens (monotonic seconds)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    start_s: float
    first_token_s: float | None
    end_s: float
    token_times_s: tuple[float, ...] = ()
    finish_reason: str = ""
    server_timings: ServerTimings | None = None  # where the server reports them (llama-server)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class BackendSpec:
    """A backend as configured: which engine, which model, and its options."""

    name: str
    kind: str
    model: str
    role: str = "local"  # local | cloud
    mode: str | None = None  # chat | completion; None = the model's default
    options: dict[str, Any] = field(default_factory=dict)


class QueryError(Exception):
    """A query that failed for a known reason; ``category`` becomes the record's ``error_category``
    (e.g. timeout, http_429, http_5xx, connection, malformed_stream, empty_answer)."""

    def __init__(self, message: str, category: str) -> None:
        super().__init__(message)
        self.category = category


class Backend(Protocol):
    """Optional members the runner uses when present: ``concurrency`` (int, requests in flight;
    default 1), ``attach(run_dir)`` (called before ``load``, e.g. to put a server log in the run
    folder), ``remote`` (bool: the endpoint is not on this machine, so local sensors do not see it)
    and ``energy_estimate`` (an ``ipw.telemetry.api_estimate.ApiEnergyEstimate`` for remote ones)."""

    spec: BackendSpec

    def load(self) -> None:
        """Load weights / start the engine (not measured as query energy)."""

    def generate(self, prompt: str, settings: GenerationSettings) -> Completion: ...

    def pids(self) -> list[int]:
        """Processes whose CPU time is inference work (for the CPU energy model)."""

    def describe(self) -> dict[str, Any]:
        """Model file, engine version, device: goes into the manifest."""

    def close(self) -> None: ...


BackendFactory = Callable[[BackendSpec], Backend]
_REGISTRY: dict[str, BackendFactory | str] = {}


def register_backend(kind: str, factory: BackendFactory | str, *, replace: bool = False) -> None:
    """Register a backend kind; ``factory`` may be ``"module:attr"`` so the import stays lazy."""
    if kind in _REGISTRY and not replace:
        raise ValueError(f"backend kind {kind!r} is already registered")
    _REGISTRY[kind] = factory


def backend_kinds() -> list[str]:
    return sorted(_REGISTRY)


def _resolve(kind: str) -> BackendFactory:
    factory = _REGISTRY[kind]
    if isinstance(factory, str):
        module, attr = factory.split(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory


def backend_options(kind: str) -> dict[str, type]:
    """Engine-specific config keys a backend kind accepts, with their types (its ``OPTIONS``)."""
    return dict(getattr(_resolve(kind), "OPTIONS", {}))


def unregister_backend(kind: str) -> None:
    _REGISTRY.pop(kind, None)


def create_backend(spec: BackendSpec) -> Backend:
    factory = _REGISTRY.get(spec.kind)
    if factory is None:
        raise IpwError(f"backend {spec.name!r}: unknown kind {spec.kind!r} (known: {', '.join(backend_kinds())})")
    return _resolve(spec.kind)(spec)


# Few-shot framing for base (non-instruction) models such as Gemma-3-270M: they continue text, so
# the query is shown as the next item of a short list of solved examples, and generation stops at
# the end of the answer line.
FEW_SHOT_EXAMPLES = (
    ("What is 7 + 5? Answer with just the number.", "12"),
    ("What is the capital of Italy?\n(A) Madrid\n(B) Rome\n(C) Paris\n(D) Berlin\n"
     "Answer with the letter of the correct option.", "B"),
    ("Write the word 'cat' in uppercase. Answer with just the word.", "CAT"),
)
FEW_SHOT_STOP = ("\n\n", "\nQuestion:", "Question:")


def few_shot_prompt(prompt: str) -> str:
    shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in FEW_SHOT_EXAMPLES)
    return f"{shots}Question: {prompt}\nAnswer:"


register_backend("llama-cpp", "ipw.backends.llama_cpp:LlamaCppBackend")
register_backend("openai", "ipw.backends.openai_http:OpenAIBackend")
register_backend("vllm", "ipw.backends.vllm:VllmBackend")
