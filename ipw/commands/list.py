"""``ipw list``: backend kinds, bundled models and datasets, and this machine's sensors."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from ipw.commands.output import stdout


def list_command() -> int:
    from ipw.backends.base import backend_kinds
    from ipw.inputs.datasets import BUNDLED, DATASETS_DIR
    from ipw.inputs.models import BUNDLED_MODELS, model_available
    from ipw.telemetry.probe import describe_sensors

    console = stdout()
    t = Table(title="backend kinds")
    t.add_column("kind")
    for kind in backend_kinds():
        t.add_row(kind)
    console.print(t)
    t = Table(title="bundled models (--backend llama-cpp:NAME)")
    for col in ("name", "package", "mode", "installed", "description"):
        t.add_column(col)
    for m in BUNDLED_MODELS.values():
        t.add_row(m.name, m.package, m.mode, "yes" if model_available(m.name) else "no", m.description)
    console.print(t)
    t = Table(title="bundled datasets (--dataset NAME)")
    for col in ("name", "file", "queries"):
        t.add_column(col)
    for name, (file, subset) in BUNDLED.items():
        path = DATASETS_DIR / (subset or file)
        count = sum(1 for line in path.read_text().splitlines() if line.strip()) if path.exists() else 0
        t.add_row(name, file + (f" (ids in {subset})" if subset else ""), str(count))
    console.print(t)
    t = Table(title="sensors on this machine (probed in this order)")
    for col in ("sensor", "available", "source", "quality", "scope", "detail"):
        t.add_column(col)
    for info in describe_sensors():
        t.add_row(info.name, "yes" if info.available else "no", info.source, info.quality, info.scope,
                  Text(info.detail))  # plain text: "pip install 'ipw[amd]'" is not rich markup
    console.print(t)
    return 0
