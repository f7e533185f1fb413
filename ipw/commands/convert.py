"""``ipw convert``: GGUF -> Hugging Face folder (``ipw.inputs.convert``)."""

from __future__ import annotations

from ipw.options import ConvertOptions


def convert_command(model, out_dir, options: ConvertOptions) -> int:
    """GGUF -> Hugging Face folder (``ipw.inputs.convert``); the folder's path goes to stdout."""
    from ipw.inputs.convert import convert_gguf

    print(convert_gguf(model, out_dir, force=options.force))
    return 0
