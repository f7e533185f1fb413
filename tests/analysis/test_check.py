"""ipw check on real llama.cpp runs, and its parsing, exit codes and CI formats."""

import json
import shutil
from pathlib import Path

import pytest

from ipw.analysis.check import parse_threshold
from ipw.errors import IpwError


WORDS = ["apple", "river", "house", "green", "table", "music", "light", "stone", "cloud", "bread", "chair", "water",
         "paper", "horse", "smile", "ocean", "train", "plant", "sugar", "glass"]


LIMIT = 12  # queries per run of the compared stories


def _run(run_cli, tmp_path: Path, name: str, *, max_tokens: int, dataset: str = "ipw-core", limit: int = LIMIT,
         temperature: float = 0.0, shard: str | None = None) -> Path:
    config = tmp_path / f"{name}.toml"
    config.write_text(f'''dataset = "{dataset}"
limit = {limit}
warmup = 1
idle_s = 0
[generation]
max_tokens = {max_tokens}
temperature = {temperature}
top_k = 0
[[backends]]
name = "smol"
kind = "llama-cpp"
model = "smollm2-135m"
n_threads = 1
''')
    out = tmp_path / (name if shard is None else f"{name}-shard{shard.split('/')[0]}")
    code, _, err = run_cli("run", config, "--out", out, *(["--shard", shard] if shard else []))
    assert code == 0, err
    (run_dir,) = list(out.iterdir())
    return run_dir


TURNS = 4


def _interleaved(run_cli, tmp_path: Path, runs: dict[str, dict]) -> dict[str, Path]:
    """Runs whose energies are compared, made in turns: a quarter of each (``--shard K/4``), then the next
    quarter of each, in the reverse order, and so on; then each run's quarters merged (``ipw merge``).

    Made one after the other, a neighbour that loads the machine during one run and not the other
    moves their ratio: on a shared 2-core machine this test once saw a 20% change where there was
    none, or none where there was one (issue 30). In turns, such a neighbour weighs on every run alike."""
    shards: dict[str, list[Path]] = {name: [] for name in runs}
    for k in range(1, TURNS + 1):
        order = list(runs) if k % 2 else list(reversed(runs))
        for name in order:
            shards[name].append(_run(run_cli, tmp_path, name, shard=f"{k}/{TURNS}", **runs[name]))
    merged = {}
    for name, parts in shards.items():
        out = tmp_path / f"{name}-merged"
        code, _, err = run_cli("merge", *parts, "--out", out)
        assert code == 0, err
        (merged[name],) = list(out.iterdir())
    return merged


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ipw.cli import main

    tmp = tmp_path_factory.mktemp("check")
    easy = tmp / "easy.jsonl"  # copy tasks the 135M model gets right nearly always
    stories = tmp / "stories.jsonl"  # open-ended prompts: every answer runs to max_tokens
    stories.write_text("".join(json.dumps({"id": f"story-{i}", "prompt": f"Write a long story about a {w}.",
                                           "answer": w, "scorer": "contains"}) + "\n" for i, w in enumerate(WORDS)))
    easy.write_text("".join(json.dumps({"id": f"copy-{i}", "prompt": f"Repeat this word exactly: {w}", "answer": w,
                                        "scorer": "contains"}) + "\n" for i, w in enumerate(WORDS)))

    def cli(*args):
        return main([str(a) for a in args]), "", ""

    return {
        # in each turn the baseline's quarter sits next to the two it is compared with most closely (same,
        # bit_longer), in the reverse order in the next turn: a neighbour's load in one turn weighs on them alike
        **_interleaved(cli, tmp, {
            "same": dict(max_tokens=12, dataset=stories),
            "base": dict(max_tokens=12, dataset=stories),
            "bit_longer": dict(max_tokens=20, dataset=stories),  # 8 more tokens: about +20%
            "longer": dict(max_tokens=36, dataset=stories),  # longer answers: a real energy increase
        }),
        "easy": _run(cli, tmp, "easy", max_tokens=16, dataset=easy, limit=0),
        # sampling at temperature 5 from the whole vocabulary: the same model answers at random
        "hot": _run(cli, tmp, "hot", max_tokens=16, dataset=easy, limit=0, temperature=5.0),
        "other": _run(cli, tmp, "other", max_tokens=12, dataset=stories, limit=11),  # a different query set
    }


pytestmark = pytest.mark.llama


def test_identical_configs_pass(runs, run_cli, tmp_path):
    md, junit = tmp_path / "v.md", tmp_path / "v.xml"
    code, out, err = run_cli("check", runs["base"], runs["same"], "--markdown", md, "--junit", junit, "--github")
    assert code == 0, out + err
    assert "PASS" in md.read_text()
    assert md.read_text().count(f"(0 of {LIMIT} queries differ)") == 3  # the work gate: prompt and output tokens, errors
    assert 'failures="0"' in junit.read_text()
    assert "::error" not in out


def test_longer_answers_fail_on_energy(runs, run_cli, tmp_path):
    md = tmp_path / "v.md"
    code, out, err = run_cli("check", runs["base"], runs["longer"], "--github", "--markdown", md,
                             "--junit", tmp_path / "v.xml")
    assert code == 1, out + err
    assert "::error title=ipw check regression%3A smol energy_per_query::smol: energy_per_query changed" in out
    assert "regression" in md.read_text()
    assert "<failure" in (tmp_path / "v.xml").read_text()


def test_twenty_percent_more_energy_fails(runs, run_cli, tmp_path):
    """A real, modest increase (answers 12 -> 20 tokens, prefill unchanged) is caught by the default thresholds, while the
    identical configuration's run-to-run jitter (test_identical_configs_pass) is not."""
    from ipw.results import load_run

    e = {k: load_run(runs[k])[1]["energy_j"].mean() for k in ("base", "same", "bit_longer")}
    assert 1.10 < e["bit_longer"] / e["base"] < 1.45, e  # the change is a real one of about 20%
    assert abs(e["same"] / e["base"] - 1) < 0.10, e  # jitter (1-4% here) stays far below the change
    md = tmp_path / "v.md"
    code, out, err = run_cli("check", runs["base"], runs["bit_longer"], "--markdown", md)
    assert code == 1, out + err
    row = next(line for line in md.read_text().splitlines() if "energy_per_query" in line)
    assert "regression" in row
    # the work gate sees the cause exactly, whatever the machine's load: 8 more tokens on every story
    tokens = next(line for line in md.read_text().splitlines() if "| output_tokens |" in line)
    cells = [c.strip() for c in tokens.strip("|").split("|")]
    assert int(cells[4]) - int(cells[3]) == 8 * LIMIT and "regression" in tokens, tokens
    assert f"{LIMIT} of {LIMIT} queries differ" in tokens


def test_accuracy_drop_fails(runs, run_cli):
    code, out, _ = run_cli("check", runs["easy"], runs["hot"], "--fail-if", "accuracy:-2pp")
    assert code == 1, out
    assert "regression" in out


def test_mismatched_datasets_exit_2(runs, run_cli):
    code, _, err = run_cli("check", runs["base"], runs["other"])
    assert code == 2 and "dataset fingerprints differ" in err


def _other_hardware(manifest: dict, key: str, value: str) -> None:
    """The run as if made on another machine: its fingerprint changed wherever the manifest keeps one (a
    merged run, as these are, keeps every shard's machine in hardware_by_id)."""
    for hardware in [manifest["hardware"], *(manifest.get("hardware_by_id") or {}).values()]:
        hardware[key] = value


def test_hardware_mismatch_exit_2_unless_allowed(runs, run_cli, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(runs["same"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    _other_hardware(manifest, "cpu_model", "Other CPU")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli("check", runs["base"], copy)
    assert code == 2 and "hardware differs" in err
    code, _, _ = run_cli("check", runs["base"], copy, "--allow-hardware-mismatch")
    assert code == 0


def test_same_cpu_name_other_instruction_sets_is_a_mismatch(runs, run_cli, tmp_path):
    """Two "AMD EPYC" VMs, one with AVX-512 and one with AVX2 only, are ~3x apart in J/query."""
    copy = tmp_path / "avx2"
    shutil.copytree(runs["same"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    assert manifest["hardware"]["cpu_isa"]  # recorded by every run
    _other_hardware(manifest, "cpu_isa", "x86_64+sse42+avx+avx2+bmi2+fma+f16c")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli("check", runs["base"], copy)
    if json.loads((runs["base"] / "manifest.json").read_text())["hardware"]["cpu_isa"] != manifest["hardware"]["cpu_isa"]:
        assert code == 2 and "hardware differs" in err and "cpu_isa" in err


def test_interrupted_run_is_not_comparable(runs, run_cli, tmp_path):
    copy = tmp_path / "cut"
    shutil.copytree(runs["same"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["status"] = "interrupted"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli("check", runs["base"], copy)
    assert code == 2 and "candidate run is interrupted" in err and "--resume" in err


@pytest.mark.parametrize("text", ["energy:+5%", "accuracy:-2%", "energy_per_query:5", "x"])
def test_bad_thresholds(text):
    with pytest.raises(IpwError):
        parse_threshold(text)


def test_threshold_parsing():
    t = parse_threshold("j_per_token:+10%")
    assert (t.metric, t.limit, t.unit) == ("j_per_token", 10.0, "%")
    assert parse_threshold("accuracy:-2pp").limit == -2.0
