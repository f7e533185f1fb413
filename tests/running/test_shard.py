"""Sharding without Ray: ``--shard K/N`` and ``ipw merge`` (pure checks, then real llama.cpp runs)."""

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest

import runfolders
from ipw.errors import IpwError
from ipw.results import RunManifest
from ipw.running.shard import Shard, combine_backend_infos, parse_shard, shard_items
from conftest import mixed_accuracy_jsonl, only_run, smol_config


# -- the assignment ----------------------------------------------------------------------------


def test_parse_shard():
    assert parse_shard("1/4") == Shard(1, 4)
    assert parse_shard(" 4 / 4 ") == Shard(4, 4)
    for bad, words in (("3/2", "between 1 and N"), ("0/2", "between 1 and N"), ("1/0", "between 1 and N"),
                       ("x", "expected K/N"), ("1/2/3", "expected K/N"), ("-1/2", "expected K/N"), ("", "expected K/N")):
        with pytest.raises(IpwError, match=words):
            parse_shard(bad)


@pytest.mark.parametrize("n_items,count", [(1, 1), (3, 3), (7, 3), (12, 4), (100, 7)])
def test_shards_partition_the_set(n_items, count):
    items = [f"q{i}" for i in range(n_items)]
    parts = [shard_items(items, Shard(k, count)) for k in range(1, count + 1)]
    assert sorted(sum(parts, [])) == sorted(items), "every item in exactly one shard"
    assert max(map(len, parts)) - min(map(len, parts)) <= 1, "balanced"
    for k, part in enumerate(parts, start=1):  # round-robin, deterministic
        assert part == [items[i] for i in range(n_items) if i % count == k - 1]


@pytest.mark.parametrize("n_items,shard", [(0, Shard(1, 1)), (1, Shard(2, 3)), (4, Shard(5, 5))])
def test_an_empty_shard_is_an_error(n_items, shard):
    """An empty shard would make an empty run marked complete (issue 19)."""
    with pytest.raises(IpwError, match=f"--shard {shard.text}: shard {shard.index} of {shard.count} is empty"):
        shard_items([f"q{i}" for i in range(n_items)], shard)


def test_combine_backend_infos_keeps_every_shard():
    a = {"name": "smol", "sensors": [{"name": "cpu_model"}], "shard": 1, "node": "node-a", "hardware_id": "hw-a"}
    b = {"name": "smol", "sensors": [{"name": "cpu_model"}], "shard": 2, "node": "node-b", "hardware_id": "hw-b"}
    combined = combine_backend_infos([a, b])
    assert combined["name"] == "smol" and "node" not in combined
    assert [s["node"] for s in combined["shards"]] == ["node-a", "node-b"]
    assert combine_backend_infos([combined])["shards"] == combined["shards"], "combining again is stable"


# -- command-line errors: exit 2, one line, no traceback ------------------------------------------


@pytest.mark.parametrize("args,words", [
    (["--shard", "3/2"], "K must be between 1 and N"),
    (["--shard", "x"], "expected K/N"),
    (["--shard", "1/2", "--ray", "local"], "choose one"),
    (["--shards", "2"], "only with --ray"),
])
def test_run_shard_options_bad_input(run_cli, args, words):
    code, out, err = run_cli("run", *args)
    assert code == 2
    assert words in err and "Traceback" not in err + out
    assert len(err.strip().splitlines()) == 1


# -- ipw merge refuses what is not one complete split -----------------------------------------------


CONFIG = {"dataset": "x.jsonl", "limit": 0, "repeats": 1, "out_dir": "res", "source": "a.toml",
          "generation": {"max_tokens": 8}, "backends": [{"name": "smol", "kind": "llama-cpp", "model": "m"}]}


def _fake_shard(root: Path, index: int, count: int, qids: list[str], *, status="complete", config=None,
                full_fingerprint="sha256:full", n_full=None, name=None, shard=True) -> Path:
    name = name or f"shard{index}of{count}"
    folder = runfolders.create(root, name, {
        "config": config or CONFIG,
        "dataset": {"name": "x", "n_queries": len(qids), "fingerprint": f"sha256:{name}"},
        "shard": {"index": index, "count": count,
                  "dataset": {"name": "x", "n_queries": n_full if n_full is not None else 4,
                              "fingerprint": full_fingerprint}} if shard else None,
        "hardware": {"cpu_model": "cpu"}, "hardware_by_id": {f"hw-{index}": {"cpu_model": "cpu"}}, "backends": []})
    for q in qids:
        folder.append(runfolders.record(run_id=name, backend="smol", query_id=q))
    folder.finish(status)
    return folder.path


@pytest.mark.parametrize("case,words", [
    ("missing", "missing shard(s) 2/2"),
    ("twice", "shard 1/2 given twice"),
    ("interrupted", "is interrupted; finish it first"),
    ("config", "config differs"),
    ("split", "of another split"),
    ("dataset", "full query set differs"),
    ("duplicate", "duplicate record: backend smol, query q0"),
    ("not_shard", "not a shard run"),
    ("count", "the shards hold 3 queries"),
])
def test_merge_refuses(tmp_path, run_cli, case, words):
    one = _fake_shard(tmp_path, 1, 2, ["q0", "q2"])
    two = {
        "missing": None,
        "twice": lambda: _fake_shard(tmp_path, 1, 2, ["q0", "q2"], name="again"),
        "interrupted": lambda: _fake_shard(tmp_path, 2, 2, ["q1"], status="interrupted"),
        "config": lambda: _fake_shard(tmp_path, 2, 2, ["q1", "q3"], config={**CONFIG, "repeats": 2}),
        "split": lambda: _fake_shard(tmp_path, 2, 3, ["q1"]),
        "dataset": lambda: _fake_shard(tmp_path, 2, 2, ["q1", "q3"], full_fingerprint="sha256:other"),
        "duplicate": lambda: _fake_shard(tmp_path, 2, 2, ["q1", "q0"]),
        "not_shard": lambda: _not_a_shard(tmp_path),
        "count": lambda: _fake_shard(tmp_path, 2, 2, ["q1"]),
    }[case]
    paths = [one] + ([two()] if two else [])
    code, out, err = run_cli("merge", *paths, "--out", tmp_path / "merged")
    assert code == 2, err
    assert words in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "merged").exists(), "nothing is written when the shards are refused"


def _not_a_shard(root: Path) -> Path:
    return _fake_shard(root, 2, 2, ["q1", "q3"], shard=False)


def test_merge_out_of_order_and_config_out_dir_ignored(tmp_path):
    from ipw.commands.merge import merge_runs

    two = _fake_shard(tmp_path, 2, 2, ["q1", "q3"], config={**CONFIG, "out_dir": "elsewhere", "source": "b.toml"})
    one = _fake_shard(tmp_path, 1, 2, ["q0", "q2"])
    folder = merge_runs([two, one], tmp_path / "merged", command=["test"])
    manifest = json.loads((folder.path / "manifest.json").read_text())
    assert manifest["status"] == "complete" and "shard" not in manifest
    assert manifest["dataset"]["fingerprint"] == "sha256:full" and manifest["dataset"]["n_queries"] == 4
    assert sorted(manifest["hardware_by_id"]) == ["hw-1", "hw-2"], "every shard's machine is kept"
    assert [s["shard"] for s in manifest["merged_from"]] == [1, 2]
    frame = pd.read_parquet(folder.path / "records.parquet")
    assert sorted(frame["query_id"]) == ["q0", "q1", "q2", "q3"]
    assert set(frame["run_id"]) == {manifest["run_id"]}


def test_check_machines_of_sharded_runs():
    from ipw.analysis.check import comparability, machines

    a, b = {"cpu_model": "A", "cpu_logical_cores": 2}, {"cpu_model": "B", "cpu_logical_cores": 2}
    single = RunManifest("single", status="complete", dataset={"fingerprint": "f"}, hardware=a, hardware_by_id={"hw-a": a})
    merged = RunManifest("merged", status="complete", dataset={"fingerprint": "f"}, hardware=b, hardware_by_id={"hw-a": a},
                         merged_from=[])
    assert machines(merged) == [a], "a merged run is the machines that measured it, not the first shard's header"
    assert comparability(single, merged, False) == []
    two = dataclasses.replace(merged, hardware_by_id={"hw-a": a, "hw-b": b})
    assert "hardware differs" in comparability(single, two, False)[0]
    assert comparability(single, two, True) == []


# -- real runs: a sharded run is the unsharded run, split --------------------------------------------


def _config(tmp_path: Path, limit: int = 9) -> Path:
    return smol_config(tmp_path / "shard.toml", mixed_accuracy_jsonl(tmp_path), limit=limit, max_tokens=8,
                       out_dir=tmp_path / "unused")


@pytest.mark.llama
def test_shards_merged_equal_the_unsharded_run(tmp_path, run_cli):
    config = _config(tmp_path)
    code, _, err = run_cli("run", config, "--out", tmp_path / "full")
    assert code == 0, err
    full = only_run(tmp_path / "full")
    shards = []
    for k in (1, 2, 3):
        code, _, err = run_cli("run", config, "--shard", f"{k}/3", "--out", tmp_path / f"s{k}")
        assert code == 0, err
        shards.append(only_run(tmp_path / f"s{k}"))
        manifest = json.loads((shards[-1] / "manifest.json").read_text())
        assert manifest["shard"]["index"] == k and manifest["dataset"]["n_queries"] == 3
    code, out, err = run_cli("merge", *reversed(shards), "--out", tmp_path / "merged")
    assert code == 0, err
    merged = Path(out.strip())
    assert merged.parent == tmp_path / "merged"

    a = pd.read_parquet(full / "records.parquet").set_index(["backend", "query_id", "repeat"]).sort_index()
    b = pd.read_parquet(merged / "records.parquet").set_index(["backend", "query_id", "repeat"]).sort_index()
    assert list(a.index) == list(b.index) and b.index.is_unique, "exactly the same queries, each once"
    assert (a["output"] == b["output"]).all(), "greedy decoding: the same answers"
    assert 0 < a["correct"].mean() < 1, "an accuracy that can differ"
    assert a["correct"].mean() == b["correct"].mean()
    assert (b["node"] != "").all() and (b["hardware_id"] != "").all()
    mf, mm = (json.loads((p / "manifest.json").read_text()) for p in (full, merged))
    assert mm["dataset"]["fingerprint"] == mf["dataset"]["fingerprint"]
    assert set(b["hardware_id"]) <= set(mm["hardware_by_id"])
    assert len(mm["backends"]) == 1 and len(mm["backends"][0]["shards"]) == 3

    code, out, err = run_cli("compare", full, merged, "--format", "json")
    assert code == 0, err
    assert json.loads(out)["queries"]["common_queries"] is False
    code, _, err = run_cli("check", full, merged, "--fail-if", "accuracy:-2pp")
    assert code == 0, err
    code, _, err = run_cli("report", merged, "--out", tmp_path / "r.html")
    assert code == 0, err


@pytest.mark.llama
def test_resume_a_shard(tmp_path, run_cli):
    config = _config(tmp_path, limit=6)
    code, _, err = run_cli("run", config, "--shard", "2/2", "--out", tmp_path / "s")
    assert code == 0, err
    run_dir = only_run(tmp_path / "s")
    # make it look interrupted after its first query
    lines = (run_dir / "records.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "records.jsonl").write_text(lines[0])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (run_dir / "manifest.json").write_text(json.dumps({**manifest, "status": "interrupted"}))

    code, out, err = run_cli("run", "--resume", run_dir, "--shard", "1/2")
    assert code == 2 and "is shard 2/2" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli("run", "--resume", run_dir, "--shard", "2/2")
    assert code == 0, err
    frame = pd.read_parquet(run_dir / "records.parquet")
    assert list(frame["query_id"]) == [json.loads(line)["query_id"] for line in lines], "only the missing ran"
