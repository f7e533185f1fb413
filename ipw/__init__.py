"""ipw: measure the intelligence efficiency (correct answers per joule) of LLM inference.

The Python API (README "Python API"): ``ipw.measure`` (the energy of a block of code), ``ipw.Monitor``
(sensors opened once for many such blocks) and ``ipw.load_run`` (a run folder's manifest and records).
``import ipw`` stays light: they are imported from ``ipw.api`` on first use, and pandas, numpy and the
sensors only when they run.
"""

__version__ = "0.1.0"

_LAZY = {"measure": "ipw.api", "Monitor": "ipw.api", "Measurement": "ipw.api", "load_run": "ipw.api", "Run": "ipw.api"}
__all__ = ["__version__", "measure", "Monitor", "Measurement", "load_run", "Run"]  # the names of _LAZY


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ipw' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
