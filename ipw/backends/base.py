"""The backend interface, the completion every backend returns, and the backend registry.

Built-in backends register exactly as an extension would (``register_backend``); tests register fakes
through the same registry.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

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
    how long that took.  The concurrent split places the prefill with them (``ipw.metering.split``)."""

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
    # the mean log-probability (natural log) of the output tokens, where the engine gives them (llama.cpp
    # in process; a server asked with ``logprobs = true``): the local answer's confidence, which a cascade
    # escalates on (ipw/analysis/cascade.py); None where the engine gave none
    mean_logprob: float | None = None

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


class BackendBase:
    """What every backend is: the runner calls these members and nothing else, and never asks whether a
    backend has one.  The contract is in docs/ARCHITECTURE.md ("The contract of a backend").

    Required: ``generate``.  Everything else has a default that does nothing:

    - ``preflight()``: cheap checks before the run folder exists (an engine build this CPU cannot run);
    - ``attach(run_dir)``: called before ``load`` (e.g. a managed server's log goes into the run folder);
    - ``load()``: weights, engine start (not measured as query energy);
    - ``recover()``: after a query failed with ``engine_crash``, outside any window (a new worker);
    - ``pids()``: the processes whose CPU time is inference work (the CPU model's tree); none by default;
    - ``describe()``: what the manifest records about the engine; ``close()``.

    Declared capabilities (class or instance attributes):

    - ``concurrency``: requests in flight (the runner sets it to the level it measures); 1;
    - ``levels``: the concurrency levels of a sweep, e.g. ``(1, 4, 16)``; ``()`` means ``(concurrency,)``;
    - ``remote``: the endpoint is not on this machine, so local sensors do not see it; False;
    - ``energy_estimate``: an ``ipw.telemetry.api_estimate.ApiEnergyEstimate`` for a remote endpoint; None;
    - ``OPTIONS``: the engine-specific config keys the kind accepts, with their types.
    """

    spec: BackendSpec
    OPTIONS: ClassVar[dict[str, Any]] = {}
    concurrency: int = 1
    levels: tuple[int, ...] = ()
    remote: bool = False
    energy_estimate: Any = None

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec

    def preflight(self) -> Any:
        """Checks that fail in one line before the run folder exists; returns nothing of use by default."""
        return None

    def attach(self, run_dir: str | Path) -> None:
        """Called before ``load`` with the run folder."""

    def load(self) -> None:
        """Load weights / start the engine (not measured as query energy)."""

    def generate(self, prompt: str, settings: GenerationSettings) -> Completion:
        raise NotImplementedError(f"{type(self).__name__}.generate")

    def recover(self) -> None:
        """After an ``engine_crash`` error: make the engine usable again (or raise EngineStopped)."""

    def pids(self) -> list[int]:
        """Processes whose CPU time is inference work (for the CPU energy model)."""
        return []

    def describe(self) -> dict[str, Any]:
        """Model file, engine version, device: goes into the manifest."""
        return {}

    def close(self) -> None:
        """Stop the engine; called once, also after a failed ``load``."""


#: The type the runner holds; kept as a name for the code and the docs that say ``Backend``.
Backend = BackendBase

#: The members a backend class defines itself (a class outside the hierarchy must define all of them).
REQUIRED_MEMBERS = ("generate",)
_DUCK_MEMBERS = ("load", "generate", "pids", "describe", "close")

BackendFactory = Callable[[BackendSpec], BackendBase]
_REGISTRY: dict[str, BackendFactory | str] = {}


def _checked(kind: str, factory: Any) -> BackendFactory:
    """A factory that makes ``BackendBase`` instances, or a clear error.

    A ``BackendBase`` subclass must override ``generate``.  A class outside the hierarchy (a test double,
    an older extension) must define ``load``, ``generate``, ``pids``, ``describe`` and ``close``; it is
    registered as a subclass of itself and ``BackendBase``, so it gets every default and declared
    capability and the runner treats it exactly like a built-in one.  Any other callable is checked on
    what it returns (``create_backend``)."""
    if isinstance(factory, type):
        if issubclass(factory, BackendBase):
            missing = [m for m in REQUIRED_MEMBERS if vars(BackendBase)[m] is _member(factory, m)]
        else:
            missing = [m for m in _DUCK_MEMBERS if _member(factory, m) is None]
        if missing:
            raise TypeError(f"backend kind {kind!r}: {factory.__module__}.{factory.__qualname__} does not define "
                            f"{', '.join(missing)} (see ipw.backends.base.BackendBase)")
        if not issubclass(factory, BackendBase):
            factory = type(factory.__name__, (factory, BackendBase),
                           {"__module__": factory.__module__, "__qualname__": factory.__qualname__,
                            "__doc__": factory.__doc__})
        return factory
    if not callable(factory):
        raise TypeError(f"backend kind {kind!r}: the factory must be a BackendBase subclass, a callable or "
                        f"\"module:attr\", got {factory!r}")
    return factory


def _member(cls: type, name: str) -> Any:
    """``name`` as the class's MRO defines it (None where no class does), read without calling
    descriptors."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return None


def register_backend(kind: str, factory: BackendFactory | type | str, *, replace: bool = False) -> None:
    """Register a backend kind; ``factory`` may be ``"module:attr"`` so the import stays lazy (it is
    checked when first resolved).  Raises TypeError for a class that does not meet the contract."""
    if kind in _REGISTRY and not replace:
        raise ValueError(f"backend kind {kind!r} is already registered")
    _REGISTRY[kind] = factory if isinstance(factory, str) else _checked(kind, factory)


def backend_kinds() -> list[str]:
    return sorted(_REGISTRY)


def _resolve(kind: str) -> BackendFactory:
    factory = _REGISTRY[kind]
    if isinstance(factory, str):
        module, attr = factory.split(":")
        factory = _REGISTRY[kind] = _checked(kind, vars(importlib.import_module(module))[attr])
    return factory


def backend_options(kind: str) -> dict[str, type]:
    """Engine-specific config keys a backend kind accepts, with their types (its ``OPTIONS``)."""
    factory = _resolve(kind)
    # a class factory is a BackendBase subclass (_checked makes one of a class outside the hierarchy)
    return dict(factory.OPTIONS) if isinstance(factory, type) and issubclass(factory, BackendBase) else {}


def unregister_backend(kind: str) -> None:
    _REGISTRY.pop(kind, None)


def create_backend(spec: BackendSpec) -> Backend:
    factory = _REGISTRY.get(spec.kind)
    if factory is None:
        raise IpwError(f"backend {spec.name!r}: unknown kind {spec.kind!r} (known: {', '.join(backend_kinds())})")
    backend = _resolve(spec.kind)(spec)
    if not isinstance(backend, BackendBase):
        raise TypeError(f"backend kind {spec.kind!r}: its factory returned a {type(backend).__name__}, "
                        "not a BackendBase (see ipw.backends.base.BackendBase)")
    return backend


def levels_of(backend: Backend) -> tuple[int, ...]:
    """The concurrency levels a backend is measured at: its ``levels`` (a sweep, e.g. (1, 4, 16)), else
    its ``concurrency`` (an in-process engine: 1; a batching one: its batch size)."""
    return tuple(backend.levels) or (int(backend.concurrency),)


def check_backends(specs: tuple[BackendSpec, ...]) -> dict[str, tuple[int, ...]]:
    """Every backend of a run made and preflighted, before its run folder exists (constructing one resolves
    its model file, so a missing one fails here; ``preflight``, e.g. an engine build this CPU cannot run,
    is one line; no model loads); returns each one's concurrency levels (``levels_of``), by name."""
    levels = {}
    for spec in specs:
        backend = create_backend(spec)
        backend.preflight()
        levels[spec.name] = levels_of(backend)
    return levels


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
