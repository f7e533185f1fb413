"""Inputs: what a run is given, checked before anything runs: its config (``config``), query sets (``datasets``,
and the public layouts of popular benchmarks, ``presets``), the bundled models (``models``; a GGUF converted for
engines that cannot read one, ``convert``) and the files shipped in the package (``resources``)."""
