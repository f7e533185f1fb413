"""Hostile router files and ``ipw route`` outputs (issue 55, round 5): a router file is validated whole when it
is loaded (one loader for ``ipw route score``, ``ipw compare --router`` and ``ipw serve --route``); ``ipw route
train --out`` replaces the old file atomically or not at all; runs without prompt text train nothing; a
negative ``--seed`` is a usage error; ``ipw check`` on 0 J warns nothing before its one line."""

import json
import os
import resource
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ipw.analysis.router.file import load_router
from ipw.cli import main
from ipw.errors import IpwError
from runfolders import create, record
from test_router import write_routing_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run whose local correctness a word decides, and the router ``ipw route train`` made of it."""
    tmp = tmp_path_factory.mktemp("trained")
    run = write_routing_run(tmp, "word")
    router = tmp / "router.json"
    assert main(["route", "train", str(run), "--out", str(router), "--no-score"]) == 0
    return run, router


def _err(capsys):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def _ipw(*args, limits=(), timeout=300):
    """``ipw`` in a process of its own, under ``limits`` ((resource, bytes) pairs): (exit code, stderr)."""
    def preexec():
        for which, value in limits:
            resource.setrlimit(which, (value, value))

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OPENBLAS_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "ipw.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec, env=env)
    return proc.returncode, proc.stderr


# --- case 1: ipw route train --out ------------------------------------------------------------------------

def test_route_train_replaces_the_router_atomically_or_not_at_all(tmp_path, trained):
    """Under a file size limit (a full disk reads the same) the old router stays whole, no temporary file
    is left, and the refusal is one line (the old code truncated it first: invalid JSON)."""
    run, router = trained
    out = tmp_path / "router.json"
    old = router.read_bytes()
    out.write_bytes(old)
    code, err = _ipw("route", "train", run, "--out", out, "--no-score",
                     limits=[(resource.RLIMIT_FSIZE, len(old) // 4)])
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(out) in err and "cannot write" in err, err
    assert out.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["router.json"]
    # without the limit the file is replaced, whole
    assert main(["route", "train", str(run), "--out", str(out), "--no-score", "--threshold", "0.4"]) == 0
    assert load_router(out).threshold == 0.4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["router.json"]


def test_route_train_refuses_an_out_it_cannot_replace(tmp_path, trained, capsys):
    """A symbolic link (renaming over it replaces the link, not its target), a FIFO or a device (/dev/full), a
    folder no file can be made in (/proc): one line naming --out, exit 2, before any training."""
    run, router = trained
    target = tmp_path / "target.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    capsys.readouterr()
    for out, word in ((link, "symbolic link"), (Path("/dev/full"), "not a regular file"),
                      (Path("/proc/self/router.json"), "cannot make a file")):
        assert main(["route", "train", str(run), "--out", str(out), "--no-score"]) == 2, out
        err = _err(capsys)
        assert err.startswith(f"error: --out {out}: ") and word in err, err
    assert target.read_text() == "{}" and link.is_symlink()
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    code, err = _ipw("route", "train", run, "--out", fifo, "--no-score", timeout=120)  # it blocked on the FIFO
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not a regular file" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.json", "link.json", "target.json"]


# --- case 2: a router file validated whole when it is loaded ----------------------------------------------

def _set(path):
    """A change to a router document at ``path`` (keys and indices), or its removal (``value`` DELETE)."""
    def change(doc, value):
        *head, last = path
        for k in head:
            doc = doc[k]
        if value is DELETE:
            del doc[last]
        else:
            doc[last] = value
    return change


DELETE = object()
NAN, INF = float("nan"), float("inf")

HOSTILE = [  # (path in the document, value, the field the one line names)
    (("features", "n_features"), 0, "features.n_features"),
    (("features", "n_features"), 2 ** 40, "features.n_features"),
    (("features", "n_features"), "262144", "features.n_features"),
    (("features", "n_features"), True, "features.n_features"),
    (("features", "ngram_range"), [1, 100000], "features.ngram_range"),
    (("features", "ngram_range"), [2, 1], "features.ngram_range"),
    (("features", "ngram_range"), [1], "features.ngram_range"),
    (("features", "norm"), "l1", "features.norm"),
    (("features", "categories"), "abc", "features.categories"),
    (("features", "categories"), [1, 2], "features.categories"),
    (("features",), [], "features"),
    (("classifiers", "small", "intercept"), NAN, "classifiers.small.intercept"),
    (("classifiers", "small", "intercept"), INF, "classifiers.small.intercept"),
    (("classifiers", "small", "value", 0), INF, "classifiers.small.value"),
    (("classifiers", "small", "value", 0), NAN, "classifiers.small.value"),
    (("classifiers", "small", "value", 0), 1e300, "classifiers.small.value"),
    (("classifiers", "small", "value", 0), "1", "classifiers.small.value"),
    (("classifiers", "small", "index", 0), 10 ** 30, "classifiers.small.index"),
    (("classifiers", "small", "index", 0), -1, "classifiers.small.index"),
    (("classifiers", "small", "index", 0), 1.5, "classifiers.small.index"),
    (("classifiers", "small", "index", 1), 0, "classifiers.small.index"),  # not increasing: a duplicate
    (("classifiers", "small", "value"), [], "classifiers.small.value"),  # not as many as the indices
    (("classifiers", "small", "index"), DELETE, "classifiers.small.index"),
    (("classifiers", "small"), [], "classifiers.small"),
    (("classifiers", "other"), {"intercept": 0.0, "index": [], "value": []}, "classifiers.other"),
    (("classifiers",), {}, "classifiers.small"),
    (("threshold",), NAN, "threshold"),
    (("threshold",), "0.5", "threshold"),
    (("local",), [], "local"),
    (("local",), "small", "local"),
    (("local",), ["small", "small"], "local"),
    (("cloud",), None, "cloud"),
    (("cloud",), "small", "cloud"),
    (("training", "C"), -1.0, "training.C"),
    (("training", "min_queries"), -1, "training.min_queries"),
    (("training", "min_queries"), 2.5, "training.min_queries"),
    (("training", "label"), "oracle", "training.label"),
    (("trained_on",), "runs", "trained_on"),
    (("scores",), json.loads("[" * 40 + "]" * 40), "scores"),  # past MAX_DEPTH
    (("extra",), 1, "extra"),
]


@pytest.mark.parametrize("path, value, field", HOSTILE, ids=[f"{'.'.join(map(str, p))}={str(v)[:20]}"
                                                            for p, v, _ in HOSTILE])
def test_a_hostile_router_file_is_refused_naming_its_field(tmp_path, trained, path, value, field):
    _, router = trained
    doc = json.loads(router.read_text())
    _set(path)(doc, value)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(IpwError) as exc:
        load_router(bad)
    text = exc.value.message
    assert text.startswith(f"{bad}: field '{field}': ") and "\n" not in text, text


def test_a_router_file_that_breaks_the_reader_is_one_line(tmp_path, trained, capsys):
    """Nesting past the JSON reader's recursion, an integer of 5,000 digits, a file over the size a router
    has (/dev/zero: read until memory ran out), not UTF-8: one line, exit 2."""
    run, router = trained
    text = router.read_text()
    cases = {"deep.json": text.replace('"scores": {}', '"scores": ' + "[" * 100_000 + "]" * 100_000),
             "digits.json": text.replace('"threshold": 0.5', '"threshold": ' + "1" * 5000),
             "latin1.json": text.replace('"cloud": "big"', '"cloud": "b\xe9g"')}
    assert all(v != text for v in cases.values())
    for name, body in cases.items():
        (tmp_path / name).write_bytes(body.encode("latin-1"))
    capsys.readouterr()
    for name in cases:
        assert main(["route", "score", str(run), "--router", str(tmp_path / name)]) == 2, name
        assert name in _err(capsys)
    # in a process of its own, 2 GiB of address space: the old reader ended in a MemoryError
    code, err = _ipw("route", "score", run, "--router", "/dev/zero", limits=[(resource.RLIMIT_AS, 2 ** 31)])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "/dev/zero" in err and "MiB" in err, err


def test_n_features_0_is_refused_by_route_score_and_serve(tmp_path, trained, capsys):
    """n_features 0 killed ``ipw route score`` with SIGFPE (exit 136, no message) and ``ipw serve --route``
    with a ZeroDivisionError and a failed folder: one line, exit 2, no folder, from the one loader."""
    run, router = trained
    doc = json.loads(router.read_text())
    doc["features"]["n_features"] = 0
    doc["classifiers"]["small"].update(index=[], value=[])
    bad = tmp_path / "nf0.json"
    bad.write_text(json.dumps(doc))
    code, err = _ipw("route", "score", run, "--router", bad)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "features.n_features" in err, (code, err)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["serve", "--port", "0", "--out", str(out), "--route", str(bad), "--local",
                 "http://127.0.0.1:9/v1", "--cloud", "http://127.0.0.1:10/v1"]) == 2
    assert "features.n_features" in _err(capsys)
    assert not out.exists()


# --- case 3: the names in a router file --------------------------------------------------------------------

@pytest.mark.parametrize("field, name", [("cloud", "big\r\nX-Injected: 1"), ("cloud", "big\n::error file=x::y"),
                                         ("cloud", "big\u202e"), ("cloud", " "), ("cloud", "b" * 65),
                                         ("local", "sm\x1ball")])
def test_names_in_a_router_file_are_checked_as_backend_names(tmp_path, trained, capsys, field, name):
    """A cloud name with CR LF put a header into every cloud-routed answer of ``ipw serve --route`` and a
    forged ``::error`` line into its summary: names are checked as ``--name`` and a config's are."""
    run, router = trained
    doc = json.loads(router.read_text())
    if field == "local":
        doc["local"] = [name]
        doc["classifiers"] = {name: doc["classifiers"]["small"]}
    else:
        doc["cloud"] = name
    bad = tmp_path / "names.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(IpwError) as exc:
        load_router(bad)
    text = exc.value.message
    assert text.startswith(f"{bad}: field '{field}") and "\n" not in text and "\r" not in text, text
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["serve", "--port", "0", "--out", str(out), "--route", str(bad), "--local",
                 "http://127.0.0.1:9/v1", "--cloud", "http://127.0.0.1:10/v1"]) == 2
    assert f"field '{field}" in _err(capsys)
    assert not out.exists()


def test_a_cloud_name_that_prints_like_a_local_one_is_refused(tmp_path, trained):
    _, router = trained
    doc = json.loads(router.read_text())
    doc["cloud"] = "smаll"  # a Cyrillic а: prints as the local backend's name
    bad = tmp_path / "alike.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(IpwError, match="field 'cloud': .* prints like"):
        load_router(bad)


# --- case 4: runs without the prompts' text ---------------------------------------------------------------

def _serve_like_run(out, run_id, prompt_of, n=40):
    """A run of a local and a cloud backend whose records keep ``prompt_of(i)`` as each query's prompt (what
    ``ipw serve`` keeps without --log-prompts: a sha256 digest; a run that kept none: None)."""
    folder = create(out, run_id, {"command": ["test"], "config": {},
                                  "dataset": {"name": "fixture", "n_queries": n, "fingerprint": "sha256:route"}})
    t = 0.0
    for name, role, energy in (("small", "local", 1.0), ("big", "cloud", 10.0)):
        for i in range(n):
            ok = name == "big" or i % 3 == 0
            folder.append(record(run_id=run_id, backend=name, model=name, role=role, query_id=f"q{i}",
                                 prompt=prompt_of(i), output="a" if ok else "b", correct=float(ok),
                                 energy_j=energy, start_s=t, end_s=t + 1))
            t += 1.01
    folder.finish("complete")
    return folder.path


@pytest.mark.parametrize("kind", ["digest", "null", "some"])
def test_route_train_refuses_runs_without_prompt_text(tmp_path, capsys, kind):
    import hashlib

    def prompt_of(i):
        if kind == "null" or kind == "some" and i % 2:
            return None
        text = f"Question {i}: {'easy' if i % 3 == 0 else 'hard'} one"
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest() if kind == "digest" else text

    run = _serve_like_run(tmp_path, kind, prompt_of)
    out = tmp_path / "router.json"
    capsys.readouterr()
    assert main(["route", "train", str(run), "--out", str(out), "--no-score"]) == 2
    err = _err(capsys)
    n = 20 if kind == "some" else 40
    assert f"{n} of 40 queries" in err and "--log-prompts" in err, err
    assert not out.exists()


# --- case 5: --seed -1 --------------------------------------------------------------------------------------

def test_a_negative_seed_is_a_usage_error(tmp_path, trained, capsys):
    run, _ = trained
    capsys.readouterr()
    for args in (["compare", str(run)], ["route", "score", str(run)],
                 ["route", "train", str(run), "--out", str(tmp_path / "r.json")]):
        assert main([*args, "--seed", "-1"]) == 2, args
        assert "--seed" in _err(capsys)
    assert not (tmp_path / "r.json").exists()


# --- case 6: ipw check on 0 J ---------------------------------------------------------------------------

def _estimated_run(out, run_id, energy_j, n=20):
    """A run whose every record has ``energy_j``, estimated with a stated error (a shared one: the model's)."""
    folder = create(out, run_id, {"command": ["test"], "config": {},
                                  "dataset": {"name": "fixture", "n_queries": n, "fingerprint": "sha256:x"}})
    for i in range(n):
        part = {"component": "cpu-process", "energy_j": energy_j, "source": "model.cpu", "quality": "estimated",
                "scope": "cpu_package", "duration_s": 0.05, "note": "", "uncertainty_j": 0.5}
        folder.append(record(run_id=run_id, query_id=f"q{i}", energy_j=energy_j, energy_parts=json.dumps([part]),
                             start_s=i * 0.06, end_s=i * 0.06 + 0.05))
    folder.finish("complete")
    return folder.path


def test_check_on_0_j_warns_nothing(tmp_path, run_cli):
    """A baseline of 0 J whose records state an error: two numpy warnings came before check's one line; a
    candidate of 0 J: the warning, and a note of a ±inf% shared error."""
    zero, two = _estimated_run(tmp_path / "z", "zero", 0.0), _estimated_run(tmp_path / "t", "two", 2.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for base, cand in ((zero, two), (zero, zero)):
            code, out, err = run_cli("check", base, cand)
            assert code == 2 and err.count("\n") == 1, err
            assert "the baseline has 0 J on every query, no energy to compare" in err
        code, out, err = run_cli("check", two, zero)
        assert code == 0, out + err
        assert "±inf" not in out
    assert not [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
