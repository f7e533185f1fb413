"""What an engine's exit and its log say, in the one line a user sees: the signal's likely meaning
(``SIGNAL_HINTS``, ``exit_text``) and the root cause a log names (``root_cause``, ``out_of_memory``), for the
engines in worker processes (``ipw.backends.worker``) and the servers ipw manages (``ipw.backends.servers``).
Standard library only: the worker process imports it."""

from __future__ import annotations

import itertools
import os
import re
import signal
from pathlib import Path

# What a signal most likely means for an engine, in the one line the user sees.
SIGNAL_HINTS = {
    "SIGILL": "illegal instruction: this engine build uses CPU instructions this machine lacks "
              "(rebuild it here: bash .ci/setup)",
    "SIGKILL": "killed, often by the kernel's out-of-memory killer",
    "SIGSEGV": "segmentation fault in the engine",
    "SIGABRT": "the engine aborted",
    "SIGBUS": "bus error in the engine",
}


def exit_text(returncode: int | None) -> str:
    """``SIGSEGV (signal 11)`` or ``exit code 1``."""
    if returncode is None:
        return "no exit status"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"{name} (signal {-returncode})"
    return f"exit code {returncode}"


# -- the root cause of an engine's failure, from its log ----------------------------------------------

_EXCEPTION = r"(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*)?(?:Error|Exception)"
#: A Python exception's last line (``ValueError: ...``, ``torch.OutOfMemoryError: ...``), at the start of a
#: line or after a logger's prefix (vLLM's ``(EngineCore pid=N) ERROR date [file:line] ``).
_PY_ERROR = re.compile(rf"^\s*(?P<prefix>(?:.*?\] )?)(?P<exc>{_EXCEPTION}): (?P<msg>\S.*)")
#: A logger's prefix of a line that is no error (a warning may quote one: "can cause `OSError: ...`").
_NOT_ERROR_LEVEL = re.compile(r"\b(?:WARNING|WARN|INFO|DEBUG)\b")
#: A wrapper that points elsewhere for the cause (vLLM V1's front end, its executor), and the same in a message.
_WRAPPER = re.compile(r"root cause above|stack trace \(?above\)?|check the stack trace", re.IGNORECASE)
WRAPPER_IN_MESSAGE = re.compile(rf"(?<![\w.]){_EXCEPTION}: .*?(?i:{_WRAPPER.pattern}).*$")
#: llama.cpp's error lines: ``llama_model_load: error loading model: ...``, ``error: ...``, a failed allocation.
_NATIVE_ERROR = re.compile(r"\berror\b[\w ]{0,30}: \S|failed to initialize|insufficient memory|out of memory|"
                           r"failed to allocate", re.IGNORECASE)
#: llama.cpp's line prefix: elapsed time and level (``0.12.913.841 E ``).
_NATIVE_PREFIX = re.compile(r"^\s*\d+(?:\.\d+){3} (?P<level>[A-Z]) +")
#: An engine out of memory: CUDA's, the CPU's, or no room for vLLM's KV cache.
_OUT_OF_MEMORY = re.compile(r"out of memory|OutOfMemory|insufficient memory|failed to allocate|cudaMalloc failed|"
                            r"No available memory|KV cache is needed|less than requested memory|"
                            r"Free memory on device|unable to allocate", re.IGNORECASE)
ROOT_CAUSE_CHARS = 400


def root_cause(log_text: str) -> str | None:
    """The line of an engine's log that names why it failed, shortened: the last Python exception
    (``SomeError: message``) that is not a wrapper pointing at "the root cause above" (vLLM V1's
    ``Engine core initialization failed``: the engine core's own error is in the log before it), else
    llama.cpp's last ``error ...:`` or failed-allocation line; an out-of-memory line first, in either kind.
    A wrapper is returned only when the log holds nothing else; None when it holds no error at all.  An
    exception's indented lines after it are part of its message (pydantic's ``ValidationError: 1 validation
    error for ModelConfig`` names the field and the value's error on the next lines)."""
    python: list[str] = []
    native: list[str] = []
    wrappers: list[str] = []
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        match = _PY_ERROR.match(line)
        if match and not _NOT_ERROR_LEVEL.search(match["prefix"]):
            parts = [f"{match['exc']}: {match['msg'].strip()}"]
            for more in itertools.islice(lines, i + 1, i + 4):  # pydantic's detail lines
                if match["prefix"] or not more[:1].isspace() or more.strip().startswith(("File ", "For further")):
                    break
                parts.append(more.strip())
            text = ": ".join(parts)
            (wrappers if _WRAPPER.search(text) else python).append(text)
        elif _NATIVE_ERROR.search(line) and not _NOT_ERROR_LEVEL.search(line):
            prefix = _NATIVE_PREFIX.match(line)
            if prefix is None or prefix["level"] not in "DIW":  # llama.cpp's debug, info, warning
                native.append(line[prefix.end() if prefix else 0:].strip())
    for found in (python, native, wrappers):
        if found:
            memory = [text for text in found if _OUT_OF_MEMORY.search(text)]
            text = (memory or found)[-1]
            return text if len(text) <= ROOT_CAUSE_CHARS else text[:ROOT_CAUSE_CHARS - 1] + "…"
    return None


def out_of_memory(text: str) -> bool:
    """Whether an engine's error line says it ran out of memory (GPU or CPU, weights or KV cache)."""
    return bool(_OUT_OF_MEMORY.search(text))


def read_log(path: Path, offset: int = 0, limit: int = 256 * 1024) -> str:
    """What a log holds from ``offset`` (where this process's part of it began), its last ``limit`` bytes."""
    try:
        with open(path, "rb") as fh:
            end = fh.seek(0, os.SEEK_END)
            fh.seek(max(offset, end - limit, 0))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
