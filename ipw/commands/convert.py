"""``ipw convert``: GGUF -> Hugging Face folder (``ipw.convert``)."""

from __future__ import annotations


def convert_command(model, out_dir, *, force) -> int:
    """GGUF -> Hugging Face folder (``ipw.convert``); the folder's path goes to stdout."""
    from ipw.convert import convert_gguf

    print(convert_gguf(model, out_dir, force=force))
    return 0
