"""Generation settings are declared once (``GenerationSettings``): the config's [generation] table takes
every field of it, and a config's ``seed`` reaches the backends, as ``--seed`` does (issue 20)."""

import dataclasses
import json

from openai_stub import Stub, stub_config

from ipw.backends.base import GenerationSettings
from ipw.inputs.config import _GENERATION, parse_config


def test_generation_table_is_the_dataclass():
    assert set(_GENERATION) == {f.name for f in dataclasses.fields(GenerationSettings)}
    assert _GENERATION["seed"] is int and _GENERATION["stop"] is list


def _config(top: str = "", generation: str = "") -> str:
    return (f'dataset = "ipw-core"\n{top}\n[generation]\n{generation}\n'
            '[[backends]]\nname = "a"\nkind = "openai"\nmodel = "m"\nbase_url = "http://127.0.0.1:9/v1"\n')


def test_config_seed_seeds_sampling_and_decoding():
    config = parse_config(_config("seed = 7"), "x.toml")
    assert (config.seed, config.generation.seed) == (7, 7)
    config = parse_config(_config("seed = 7", "seed = 3"), "x.toml")  # [generation] seed: the decoder's own
    assert (config.seed, config.generation.seed) == (7, 3)
    assert parse_config(_config(), "x.toml").generation.seed == 0


def test_config_seed_reaches_the_backend(tmp_path, run_cli):
    stub = Stub()
    try:
        data = tmp_path / "two.jsonl"
        data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Say {i}", "answer": "42"}) + "\n"
                                for i in range(2)))
        cfg = stub_config(tmp_path / "run.toml", data, stub.base_url, out_dir=tmp_path / "res", extra="seed = 7")
        code, out, err = run_cli("run", cfg)
        assert code == 0, out + err
        assert [b.get("seed") for b in stub.bodies] == [7, 7]
        (run,) = (tmp_path / "res").iterdir()
        manifest = json.loads((run / "manifest.json").read_text())
        assert manifest["config"]["seed"] == 7 and manifest["config"]["generation"]["seed"] == 7
    finally:
        stub.close()
