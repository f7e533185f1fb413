"""Read back a slice that tests/data/make_evidence_slices.py wrote: ``{table: DataFrame}``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "data"


def tables(name: str) -> dict:
    """The slice ``tests/data/<name>``'s tables (``<table>__<column>`` arrays) as pandas DataFrames."""
    import pandas as pd

    with np.load(DATA / name) as z:
        columns: dict[str, dict[str, np.ndarray]] = {}
        for key in z.files:
            table, column = key.split("__", 1)
            columns.setdefault(table, {})[column] = z[key]
    return {table: pd.DataFrame(cols) for table, cols in columns.items()}
