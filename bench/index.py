"""Write bench/README.md, the index of the benchmark scripts, from their own docstrings.

    .venv/bin/python bench/index.py > bench/README.md

The scripts live in one folder per question, the five questions that group bench/evidence/ too
(``QUESTIONS`` below); only this index and the shared helpers (``_shared.py``) stay at the top of bench/.
The README has a section per folder, headed by its question.  For each script (``*.py``: the module
docstring; ``*.sh``: the comment block at its top):

- the question it answers: the first paragraph;
- how to run it: the indented command lines that name the script (and their continuation lines);
- where its figures go: the paragraph that starts with ``Output:``.

The scripts another change is editing at the moment carry no ``Output:`` paragraph yet: theirs is in
``OUTPUT`` below, taken from their docstrings.  tests/project/test_bench_index.py checks that the committed
README is this script's output, that every script of every folder is in it, and that no script sits at the
top of bench/ or in a folder without a question.

Output: bench/README.md (stdout).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# where the figures go, for scripts whose docstring has no ``Output:`` paragraph (yet)
OUTPUT = {
    "telemetry/attribution.py":
        "``--out`` (attribution.json, attribution.md, attribution_raw.npz); the committed runs in "
        "bench/evidence/telemetry/h200-attribution/ and bench/evidence/telemetry/gpu/; the figures "
        'are in docs/ENERGY.md, "Results on an NVIDIA H200".',
    "telemetry/loads.py":
        "``DIR/loads.npz``, ``DIR/loads.json``, ``DIR/counter.csv.gz``; the committed recordings in "
        "bench/evidence/telemetry/h200-loads/; read by bench/telemetry/uncertainty_fit.py.",
    "telemetry/uncertainty_fit.py":
        "printed, and ``--json``; the committed fit in "
        "bench/evidence/telemetry/h200-attribution/uncertainty_fit.md (.json); the figures are in "
        'docs/ENERGY.md, "How far to trust a reading (issue 27)".',
    "serving/serving_validate.py":
        "Markdown on stdout, everything in ``--json``; the committed sessions in "
        'bench/evidence/serving/; the figures are in docs/SERVING.md, "Validation on the H200" '
        "sections.",
    "serving/serving_h200.sh":
        "OUT/serving.tgz, OUT/serving.md, OUT/serve.tgz, OUT/serve.md; the committed sessions in "
        'bench/evidence/serving/h200-*/; the figures are in docs/SERVING.md, "Validation on the H200" '
        'sections, and docs/PERFORMANCE.md, "ipw serve: what the measuring proxy costs a client".',
    "serving/vllm_h200.sh":
        "OUT/vllm-PART.md, OUT/vllm-PART.tar.xz and the counter; the committed session in "
        'bench/evidence/serving/vllm-h200-2026-12-04/; the figures are in docs/GPU.md, "`ipw run` with '
        'vLLM on the H200 (issue 41, 2026-12-04)", and docs/SERVING.md, "vLLM against llama-server on '
        'the H200".',
}

# the folders of scripts, one per question (the same five as bench/evidence/'s), in the README's order
QUESTIONS = {
    "telemetry": "does ipw read a GPU's energy right?",
    "serving": "what a request costs when requests overlap, and what the measuring proxy costs",
    "overhead": "what ipw adds to a query's time (and to starting a command)",
    "scale": "a million queries, and more than one GPU",
    "gate": "how often `ipw check` (or a test that compares measurements) is wrong",
    "peers": "ipw against Zeus, CodeCarbon and AIPerf on the same GPU work",
}

# the other folders of bench/
FOLDERS = {
    "evidence": "the raw evidence behind the figures in docs/ (run folders, counter traces, logs, tarballs), kept "
                "apart from the prose and grouped by the question it answers; bench/evidence/README.md has a line "
                "per folder: what it holds, the page that cites it, the script that made it.",
    "results": "not committed: the default ``--out`` of bench/telemetry/attribution.py and bench/scale/multigpu.py.",
}

COMMAND = re.compile(r"^(\S+=\S+\s+)*(nice -n \d+ )?(\.venv/bin/python|python3?|bash|git archive|export |W=)")


def doc_of(path: Path) -> str:
    """A script's own description: the module docstring, or a shell script's comment block at its top."""
    if path.suffix == ".py":
        return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=True) or ""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#!"):
            continue
        if not line.startswith("#"):
            break
        lines.append(line[2:] if line.startswith("# ") else line[1:])
    return "\n".join(lines)


def paragraphs(doc: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", doc.strip()) if p.strip()]


def indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def entry(path: Path, name: str = "") -> dict:
    """A script's question, commands and output; ``name``: its path under bench/ (``gate/gate_rates.py``), which
    its commands name as ``bench/NAME`` (default: the file's name, a script at the top of bench/)."""
    name = name or path.name
    doc = doc_of(path)
    paras = paragraphs(doc)
    question = " ".join(line.strip() for line in paras[0].splitlines()) if paras else ""
    run: list[str] = []
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        text = line.strip()
        if indent(line) >= 2 and COMMAND.match(text) and (f"bench/{name}" in text or text.startswith(("git archive", "W="))):
            block, base = [line], indent(line)
            i += 1
            while i < len(lines) and lines[i].strip() and (indent(lines[i]) > base or block[-1].rstrip().endswith("\\")):
                block.append(lines[i])
                i += 1
            run.extend(block)
            continue
        i += 1
    base = min((indent(line) for line in run), default=0)
    run = [line[base:].rstrip() for line in run]
    output = next((" ".join(line.strip() for line in p.splitlines())[len("Output:"):].strip()
                   for p in paras if p.startswith("Output:")), OUTPUT.get(name, ""))
    return {"name": name, "question": question, "run": run, "output": output}


def scripts(folder: Path = HERE) -> list[Path]:
    """The scripts directly in ``folder`` (not in its subfolders)."""
    return sorted([*folder.glob("*.py"), *folder.glob("*.sh")], key=lambda p: (p.name.startswith("_"), p.name))


def questions(folder: Path = HERE) -> list[str]:
    """The folders of bench/ that hold scripts: QUESTIONS' order, then any folder QUESTIONS lacks (a test fails)."""
    names = [p.name for p in folder.iterdir() if p.is_dir() and scripts(p)]
    return sorted(names, key=lambda n: (list(QUESTIONS).index(n) if n in QUESTIONS else len(QUESTIONS), n))


def folders(folder: Path = HERE) -> list[str]:
    """The other folders of bench/ (evidence, results)."""
    return sorted(p.name for p in folder.iterdir()
                  if p.is_dir() and not p.name.startswith((".", "__")) and p.name not in questions(folder))


def all_scripts(folder: Path = HERE) -> list[tuple[Path, str]]:
    """Every script with its path under bench/: the question folders' scripts, then the top level's."""
    return [*((p, f"{q}/{p.name}") for q in questions(folder) for p in scripts(folder / q)),
            *((p, p.name) for p in scripts(folder))]


def render(folder: Path = HERE) -> str:
    out = ["# bench/: the benchmarks and studies behind the figures in docs/", "",
           "Generated by `.venv/bin/python bench/index.py > bench/README.md` from each script's own docstring",
           "(the first paragraph: the question; the indented command lines: how to run it; `Output:`: where its",
           "figures go). Do not edit by hand: edit the script's docstring and run the command again",
           "(tests/project/test_bench_index.py checks that this file is up to date).", "",
           "The scripts are in one folder per question, the same five questions that group `bench/evidence/`.",
           "They share one helper module, `bench/_shared.py` (rewriting a docs section, the machine line, child",
           "processes), which stays at the top of bench/ with this index; a script puts bench/ on its import path",
           "to import it. The CI gate's baseline is not here: it is `.ci/baseline-default`.", ""]
    groups = [(f"{q}/: {QUESTIONS.get(q, '')}", [(p, f"{q}/{p.name}") for p in scripts(folder / q)])
              for q in questions(folder)]
    groups.append(("The top of bench/: the index and the shared helpers", [(p, p.name) for p in scripts(folder)]))
    out += [f"- [{title}](#{anchor(title)})" for title, _ in groups]
    for title, items in groups:
        entries = [entry(p, name) for p, name in items]
        out += ["", f"## {title}", "", "| script | question |", "|---|---|"]
        out += [f"| [`{e['name']}`](#{anchor(e['name'])}) | {e['question'].replace('|', '/')} |" for e in entries]
        for e in entries:
            out += ["", f"### {e['name']}", "", e["question"], ""]
            if e["run"]:
                out += ["Run:", "", "```", *e["run"], "```", ""]
            out += [f"Output: {e['output'] or 'none'}"]
    names = folders(folder)
    if names:
        out += ["", "## Folders", ""]
        for n in names:
            out.append(f"- `{n}/`: {FOLDERS.get(n, '')}")
            if n == "evidence":  # its groups, with the folders each holds
                out += [f"  - `{n}/{g.name}/`: {', '.join(sorted(p.name for p in g.iterdir() if p.is_dir()))}"
                        for g in sorted((folder / n).iterdir()) if g.is_dir()]
    return "\n".join(out) + "\n"


def anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9_ -]", "", name.lower()).replace(" ", "-")


if __name__ == "__main__":
    sys.stdout.write(render())
