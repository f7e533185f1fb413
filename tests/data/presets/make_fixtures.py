"""Writes the binary fixtures here from the JSONL fixtures (all written for ipw's tests):

- ``mmlu.parquet``, ``mmlu_pro.parquet``, ``arc.parquet`` (ARC's ``choices`` as a struct column);
- ``mmlu_pro_hf/``: a Hugging Face ``Dataset.save_to_disk`` folder (``data-00000-of-00001.arrow`` as
  an Arrow IPC stream, ``dataset_info.json``, ``state.json``);
- ``gsm8k_hf/``: a ``DatasetDict.save_to_disk`` folder (``dataset_dict.json``, ``train/``, ``test/``).

Only pyarrow is used (the ``datasets`` library is not needed).  Run: python tests/data/presets/make_fixtures.py
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (HERE / name).read_text(encoding="utf-8").splitlines() if line.strip()]


def _features(schema: pa.Schema) -> dict:
    def one(t: pa.DataType) -> dict:
        if pa.types.is_list(t):
            return {"feature": one(t.value_type), "_type": "Sequence"}
        if pa.types.is_struct(t):
            return {f.name: one(f.type) for f in t}
        return {"dtype": {"large_string": "large_string"}.get(str(t), str(t)), "_type": "Value"}

    return {f.name: one(f.type) for f in schema}


def save_to_disk(table: pa.Table, folder: Path, split: str) -> None:
    """The layout ``datasets.Dataset.save_to_disk`` writes for a small dataset (one shard)."""
    folder.mkdir(parents=True, exist_ok=True)
    info = {"citation": "", "description": "ipw test fixture", "features": _features(table.schema),
            "homepage": "", "license": ""}
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": info["features"]}})})
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n")
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": f"ipw-fixture-{split}",
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": split}
    (folder / "state.json").write_text(json.dumps(state, indent=2) + "\n")


def main() -> None:
    for name in ("mmlu", "mmlu_pro", "arc"):
        pq.write_table(pa.Table.from_pylist(rows(f"{name}.jsonl")), HERE / f"{name}.parquet")
    save_to_disk(pa.Table.from_pylist(rows("mmlu_pro.jsonl")), HERE / "mmlu_pro_hf", "test")
    gsm = HERE / "gsm8k_hf"
    save_to_disk(pa.Table.from_pylist(rows("gsm8k_train.jsonl")), gsm / "train", "train")
    save_to_disk(pa.Table.from_pylist(rows("gsm8k.jsonl")), gsm / "test", "test")
    (gsm / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}) + "\n")


if __name__ == "__main__":
    main()
