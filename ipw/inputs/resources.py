"""Files shipped inside the ipw package, found with ``importlib.resources`` (never via the source tree).

``ipw/data/``: the bundled query set (``ipw-core.jsonl``, ``ipw-core-default.txt``; written by
``datasets/generate.py``) and the API energy table (``api-energy.toml``); ``ipw/default.toml``,
``ipw/judge_prompts/``, ``ipw/templates/``.  pip installs them as plain files, so each is a real path.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def resource_path(*parts: str) -> Path:
    """The path of a file or folder shipped in the ``ipw`` package, e.g. ``resource_path("data", "x")``."""
    return Path(str(files("ipw").joinpath(*parts)))
