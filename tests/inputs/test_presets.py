"""Dataset presets: public benchmark layouts from JSONL, CSV, Parquet and save_to_disk folders."""

import json
from pathlib import Path

import pandas as pd
import pytest

from ipw.backends.base import register_backend, unregister_backend
from ipw.inputs.datasets import load_queries
from ipw.errors import IpwError
from ipw.inputs.presets import PRESETS, last_boxed
from scripted import ScriptedBackend

DATA = Path(__file__).parents[1] / "data" / "presets"

# fixture -> (preset, number of queries, first query's (id, answer, category, scorer, number of choices))
FIXTURES = {
    "gsm8k.jsonl": ("gsm8k", 5, ("gsm8k-0", "7", "gsm8k", "numeric", None)),
    "gsm8k_hf": ("gsm8k", 5, ("gsm8k-0", "7", "gsm8k", "numeric", None)),
    "mmlu.jsonl": ("mmlu", 6, ("mmlu-0", "B", "biology", "mcq", 4)),
    "mmlu.csv": ("mmlu", 6, ("mmlu-0", "B", "biology", "mcq", 4)),
    "mmlu.parquet": ("mmlu", 6, ("mmlu-0", "B", "biology", "mcq", 4)),
    "mmlu_pro.jsonl": ("mmlu-pro", 4, ("101", "C", "physics", "mcq", 10)),
    "mmlu_pro.parquet": ("mmlu-pro", 4, ("101", "C", "physics", "mcq", 10)),
    "mmlu_pro_hf": ("mmlu-pro", 4, ("101", "C", "physics", "mcq", 10)),
    "arc.jsonl": ("arc", 4, ("ARC-T-001", "B", "arc", "mcq", 4)),
    "arc.csv": ("arc", 2, ("ARC-T-001", "B", "arc", "mcq", 4)),
    "arc.parquet": ("arc", 4, ("ARC-T-001", "B", "arc", "mcq", 4)),
    "math.jsonl": ("math", 5, ("math-0", r"\frac{1}{2}", "Prealgebra", "exact", None)),
    "problem_answer.csv": ("problem-answer", 3, ("pa/1", "42", "arithmetic", "numeric", None)),
    "problem_answer.jsonl": ("problem-answer", 3, ("pa/1", "42", "arithmetic", "numeric", None)),
}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_each_preset_loads_its_fixture(name, capsys):
    preset, n, (qid, answer, category, scorer, n_choices) = FIXTURES[name]
    explicit = load_queries(str(DATA / name), preset=preset)
    assert len(explicit) == n
    q = explicit[0]
    assert (q.id, q.answer, q.category, q.scorer) == (qid, answer, category, scorer)
    assert (len(q.choices) if q.choices else None) == n_choices
    capsys.readouterr()
    detected = load_queries(str(DATA / name))
    assert detected == explicit
    assert f"detected dataset preset '{preset}'" in capsys.readouterr().err  # says what it detected


def test_same_rows_in_every_container():
    """JSONL, CSV, Parquet and save_to_disk folders of the same rows give the same queries."""
    assert load_queries(str(DATA / "mmlu.jsonl")) == load_queries(str(DATA / "mmlu.csv")) \
        == load_queries(str(DATA / "mmlu.parquet"))
    assert load_queries(str(DATA / "mmlu_pro.jsonl")) == load_queries(str(DATA / "mmlu_pro.parquet")) \
        == load_queries(str(DATA / "mmlu_pro_hf"))
    assert load_queries(str(DATA / "arc.jsonl")) == load_queries(str(DATA / "arc.parquet"))
    assert load_queries(str(DATA / "gsm8k.jsonl")) == load_queries(str(DATA / "gsm8k_hf"))


def test_converted_fields():
    gsm = load_queries(str(DATA / "gsm8k.jsonl"))
    assert [q.answer for q in gsm] == ["7", "48", "31", "29", "1,250"]  # the text after the last ####
    assert gsm[0].prompt.startswith("A baker makes 12 muffins") and "The answer is" in gsm[0].prompt
    assert "<<" not in gsm[0].prompt and gsm[0].choices is None
    mmlu = load_queries(str(DATA / "mmlu.jsonl"))
    assert [q.answer for q in mmlu] == ["B", "C", "A", "D", "B", "C"]  # index 0.. -> letter
    assert mmlu[0].choices == ("Oxygen", "Carbon dioxide", "Nitrogen", "Helium")
    assert "(B) Carbon dioxide" in mmlu[0].render()
    arc = load_queries(str(DATA / "arc.jsonl"))
    assert [q.answer for q in arc] == ["B", "B", "C", "C"]  # numeric labels 1-4: answerKey "3" is the 3rd option
    assert arc[2].choices == ("the Moon", "a mirror", "the Sun", "a window")
    pro = load_queries(str(DATA / "mmlu_pro.jsonl"))
    assert [q.answer for q in pro] == ["C", "D", "D", "E"] and len(pro[1].choices) == 8
    math = load_queries(str(DATA / "math.jsonl"))
    assert [q.answer for q in math] == [r"\frac{1}{2}", "7", "5", r"2\sqrt{3}", r"\{-3, 3\}"]
    assert [q.scorer for q in math] == ["exact", "numeric", "numeric", "exact", "exact"]
    pa = load_queries(str(DATA / "problem_answer.csv"))
    assert [(q.id, q.answer, q.scorer) for q in pa] == [("pa/1", "42", "numeric"), ("pa/2", "Oslo", "exact"),
                                                        ("pa/3", "3/4", "numeric")]


def test_last_boxed():
    assert last_boxed(r"so $\boxed{\frac{1}{2}}$") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{1} then \boxed{ {a}{b{c}} }") == "{a}{b{c}}"
    assert last_boxed(r"\fbox{x+1}") == "x+1"
    assert last_boxed(r"\boxed 5$") == "5"
    assert last_boxed(r"\boxed{2} and \boxed{3") == "2"  # an unbalanced last one: the one before
    assert last_boxed("no box") is None


def test_split_of_a_dataset_dict(capsys):
    assert len(load_queries(str(DATA / "gsm8k_hf"))) == 5
    assert "using split 'test' (splits: train, test)" in capsys.readouterr().err
    train = load_queries(str(DATA / "gsm8k_hf"), split="train")
    assert [q.answer for q in train] == ["15", "12"]
    assert load_queries(str(DATA / "gsm8k_hf" / "train")) == train  # a split's own folder
    with pytest.raises(IpwError, match="no split 'dev'"):
        load_queries(str(DATA / "gsm8k_hf"), split="dev")
    with pytest.raises(IpwError, match="--split applies to a Hugging Face"):
        load_queries(str(DATA / "gsm8k.jsonl"), split="test")


def test_interchange_format_is_unchanged(small_jsonl, capsys):
    queries = load_queries(str(small_jsonl))
    assert [q.id for q in queries] == ["a1", "a2", "m1", "s1"]
    assert "detected" not in capsys.readouterr().err
    assert load_queries(str(small_jsonl), preset="ipw") == queries
    assert load_queries("ipw-core-default", categories=("science",))  # bundled sets select too


def test_category_filter_and_seeded_sample():
    path = str(DATA / "mmlu.jsonl")
    bio = load_queries(path, categories=("biology",))
    assert [q.id for q in bio] == ["mmlu-0", "mmlu-2", "mmlu-4"]
    assert load_queries(path, categories=("BIOLOGY", "chemistry")) == load_queries(path)
    with pytest.raises(IpwError, match=r"--category 'physics': no such category .*available: biology, chemistry"):
        load_queries(path, categories=("physics",))
    a = load_queries(path, sample=3, seed=1)
    assert len(a) == 3 and a == load_queries(path, sample=3, seed=1)  # deterministic
    ids = [q.id for q in load_queries(path)]
    assert [q.id for q in a] == sorted((q.id for q in a), key=ids.index)  # file order kept
    draws = {tuple(q.id for q in load_queries(path, sample=3, seed=s)) for s in range(8)}
    assert len(draws) > 1  # the seed matters
    assert load_queries(path, sample=100) == load_queries(path)
    both = load_queries(path, categories=("chemistry",), sample=2, seed=5)
    assert len(both) == 2 and {q.category for q in both} == {"chemistry"}


def _write(tmp_path: Path, name: str, rows: list[dict]) -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_bad_rows_name_file_line_and_field(tmp_path):
    cases = [
        ("gsm8k", [{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "no marker"}],
         r":2: field 'answer': no final answer after '####'"),
        ("mmlu", [{"question": "q", "choices": ["a", "b"], "answer": 2}], r":1: field 'answer': option index 2 out of range"),
        ("mmlu", [{"question": "q", "choices": "not a list", "answer": 0}], r":1: field 'choices': expected a non-empty list"),
        ("arc", [{"question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "E"}],
         r":1: field 'answerKey': 'E' is not one of the labels"),
        ("math", [{"problem": "p", "solution": "no box here"}], r":1: field 'solution': no \\boxed"),
        ("mmlu-pro", [{"question": "q", "options": ["a", "b"], "answer": "Z"}], r":1: field 'answer': expected an option"),
    ]
    for preset, rows, message in cases:
        path = _write(tmp_path, f"{preset}.jsonl", rows)
        with pytest.raises(IpwError, match=message):
            load_queries(path, preset=preset)
        with pytest.raises(IpwError, match=message):
            load_queries(path)  # detected, same error


def test_mmlu_pro_answer_index_and_explicit_preset_errors(tmp_path):
    path = _write(tmp_path, "pro.jsonl", [{"question": "q", "options": ["a", "b", "c"], "answer_index": 2}])
    assert load_queries(path)[0].answer == "C"
    with pytest.raises(IpwError, match=r"pro.jsonl:1: field 'problem': preset 'math' needs columns problem, solution"):
        load_queries(path, preset="math")
    with pytest.raises(IpwError, match="unknown preset"):
        load_queries(path, preset="nope")
    with pytest.raises(IpwError, match="not a Hugging Face save_to_disk folder"):
        load_queries(str(tmp_path))


def test_cli_errors_exit_2(tmp_path, run_cli):
    bad = _write(tmp_path, "bad.jsonl", [{"question": "q", "answer": "no marker"}])
    code, _, err = run_cli("run", "--dataset", bad, "--dataset-preset", "gsm8k", "--backend", "llama-cpp:smollm2-135m")
    assert code == 2 and "bad.jsonl:1: field 'answer': no final answer after '####'" in err
    code, _, err = run_cli("run", "--dataset", bad, "--dataset-preset", "gsm9k")
    assert code == 2 and "unknown preset" in err
    code, _, err = run_cli("run", "--dataset", str(DATA / "mmlu.jsonl"), "--category", "poetry")
    assert code == 2 and "--category 'poetry'" in err
    code, _, err = run_cli("run", "--dataset", str(DATA / "mmlu.jsonl"), "--sample", "-1")
    assert code == 2 and "--sample" in err


def test_config_keys(tmp_path):
    from ipw.inputs.config import RunConfig, load_config

    path = tmp_path / "run.toml"
    path.write_text(f'''dataset = "{DATA / 'gsm8k_hf'}"
dataset_preset = "gsm8k"
split = "train"
categories = ["gsm8k"]
sample = 1
seed = 3
[[backends]]
name = "smol"
kind = "llama-cpp"
model = "smollm2-135m"
''')
    config = load_config(str(path))
    assert (config.dataset_preset, config.split, config.categories, config.sample) == ("gsm8k", "train", ("gsm8k",), 1)
    assert RunConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config  # what --resume rebuilds
    assert len(load_queries(config.dataset, **config.dataset_options())) == 1
    path.write_text(path.read_text().replace('"gsm8k"\nsplit', '"gsm9k"\nsplit'))
    with pytest.raises(IpwError, match=r"run.toml:2: field 'dataset_preset': unknown preset"):
        load_config(str(path))


# --------------------------------------------------------------------------------------------
# scoring a run: every preset end to end through the runner, with a backend that knows the answers


class Oracle(ScriptedBackend):
    """A backend that answers from a table (rendered prompt -> output); unknown prompts get "?"."""

    ANSWERS: dict[str, str] = {}

    def reply(self, prompt):
        return self.ANSWERS.get(prompt, "?")

    def tokens(self, prompt, text):
        return len(prompt.split()), len(text.split())


@pytest.fixture
def oracle():
    register_backend("oracle", Oracle, replace=True)
    yield Oracle
    unregister_backend("oracle")


def _run(dataset: str, out: Path, **options):
    from ipw.inputs.config import apply_overrides, load_config
    from ipw.running.runner import execute
    from runfolders import start_run

    config = apply_overrides(load_config(None), {"dataset": dataset, "backend": ["oracle:table"], "out": str(out),
                                                 "warmup": 0, "idle_s": 0, **options})
    folder, queries = start_run(config, command=["test"])
    execute(folder, config, queries, lambda r: None, probe=lambda b: [])
    return folder.path


@pytest.mark.parametrize("name", ["gsm8k.jsonl", "mmlu.csv", "mmlu_pro_hf", "arc.parquet", "math.jsonl",
                                  "problem_answer.jsonl"])
def test_each_preset_scores_a_run(name, oracle, tmp_path):
    preset = FIXTURES[name][0]
    queries = load_queries(str(DATA / name), preset=preset)
    # right answers in the form a model gives them, except the last query's
    oracle.ANSWERS = {q.render(): (f"The answer is ({q.answer})." if q.choices else f"The answer is: {q.answer}")
                      for q in queries[:-1]}
    run_dir = _run(str(DATA / name), tmp_path, dataset_preset=preset)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["config"]["dataset_preset"] == preset
    frame = pd.read_parquet(run_dir / "records.parquet")
    assert list(frame["query_id"]) == [q.id for q in queries]
    assert list(frame["scorer"]) == [q.scorer for q in queries]
    assert list(frame["correct"]) == [1.0] * (len(queries) - 1) + [0.0]


def test_a_run_with_category_and_sample_resumes_the_same_queries(oracle, tmp_path):
    from runfolders import resume_run

    from ipw.commands.run import load_resumed

    run_dir = _run(str(DATA / "mmlu.parquet"), tmp_path, category=["chemistry"], sample=2, seed=4)
    frame = pd.read_parquet(run_dir / "records.parquet")
    expected = [q.id for q in load_queries(str(DATA / "mmlu.parquet"), categories=("chemistry",), sample=2, seed=4)]
    assert list(frame["query_id"]) == expected
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["status"] = "interrupted"
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    _, query_set = load_resumed(str(run_dir))
    assert [q.id for q in query_set.queries] == expected  # the same selection
    _, config, queries, done = resume_run(str(run_dir))  # so the fingerprint check passes
    assert queries == [] and len(done) == 2  # both done: nothing left to run


def test_every_preset_is_covered():
    assert {p for p, _, _ in FIXTURES.values()} == set(PRESETS) - {"ipw"}
