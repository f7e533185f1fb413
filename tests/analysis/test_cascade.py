"""The cascade (issue 44, item 3): answer locally, escalate to the cloud when the local answer's mean
log-probability is low; scored out of sample (ipw/analysis/cascade.py), shown by ``ipw compare``, and the
``mean_logprob`` every local llama.cpp answer asked for it carries (in process and through llama-server)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from runfolders import create, record

from ipw.analysis import render
from ipw.analysis.cascade import Queries, choose_threshold, evaluate
from ipw.analysis.compare import compare
from ipw.backends.openai_wire import token_logprobs
from ipw.results import QueryRecord, load_run, record_keys


def _queries(informative: bool, n: int = 400, seed: int = 1) -> Queries:
    """A local backend right on ~60% of the queries, a cloud right on ~90%; the local energy a tenth of the
    cloud's. ``informative``: the local answer is right exactly when its confidence is high (plus noise)."""
    rng = np.random.default_rng(seed)
    logprob = rng.normal(-1.0, 0.5, n)
    right = (logprob + rng.normal(0, 0.15, n) > -1.2) if informative else rng.random(n) < 0.6
    return Queries("small", "big", logprob, right.astype(float), (rng.random(n) < 0.9).astype(float),
                   rng.uniform(1, 2, n), rng.uniform(8, 12, n), rng.uniform(0.1, 0.2, n), rng.uniform(1, 2, n))


def _pick(c, loss):
    return next(p for p in c.picks if p.max_accuracy_loss == loss)


def test_an_informative_confidence_saves_energy_at_a_small_loss_out_of_sample():
    c = evaluate(_queries(True), n_boot=500)
    assert c.auc.value > 0.9 and c.auc.lo > 0.85
    assert c.cloud_accuracy - c.local_accuracy > 0.2  # a real gap to keep
    one = _pick(c, 0.01).outcome
    assert one.energy_saved_fraction.value > 0.3  # most queries kept local, each a tenth of the cloud's energy
    assert 0.4 < one.local_share.value < 0.9
    assert one.accuracy_loss.value < 0.04 and one.accuracy_loss.lo < 0.01  # out of sample: near the target
    assert all(t is not None and math.isfinite(t) for t in _pick(c, 0.01).thresholds)
    # the energy is the local attempt for every query plus the cloud's for the escalated ones
    assert c.curve[-1].outcome.local_share.value == 0 and c.curve[-1].outcome.energy_saved_fraction.value < 0


def test_a_random_confidence_shows_no_false_saving():
    c = evaluate(_queries(False), n_boot=500)
    assert 0.35 < c.auc.value < 0.65 and c.auc.lo < 0.5 < c.auc.hi
    for loss in (0.0, 0.01):
        p = _pick(c, loss)
        assert p.outcome.local_share.value <= 0.05  # (almost) every query to the cloud
        assert p.outcome.energy_saved_fraction.value <= 0.01
        assert p.outcome.accuracy_loss.value <= 0.02


def test_answers_without_a_confidence_are_always_escalated():
    q = _queries(True, n=60)
    logprob = q.logprob.copy()
    logprob[:5] = np.nan  # errors
    q = Queries(q.local, q.cloud, logprob, *[getattr(q, f) for f in (
        "local_correct", "cloud_correct", "local_energy_j", "cloud_energy_j", "local_latency_s", "cloud_latency_s")])
    t = choose_threshold(q, 1.0)  # any loss allowed: keep as many local answers as save energy
    assert t is not None and math.isfinite(t) and t <= np.nanmin(logprob)
    c = evaluate(q, n_boot=200)
    assert c.n_without_logprob == 5
    assert c.curve[0].outcome.local_share.value == pytest.approx(55 / 60)


def test_too_few_queries_give_the_curve_and_the_auc_only():
    c = evaluate(_queries(True, n=12), n_boot=100)
    assert c.picks == () and c.curve and any("fewer than the 20" in n for n in c.notes)


def test_token_logprobs_of_the_chat_and_completions_apis():
    assert token_logprobs({"content": [{"token": "a", "logprob": -0.5}, {"logprob": -1.5}]}) == [-0.5, -1.5]
    assert token_logprobs({"tokens": ["a", "b"], "token_logprobs": [-0.25, 1e-9]}) == [-0.25, 0.0]
    assert token_logprobs(None) == [] and token_logprobs({"content": None}) == []
    assert token_logprobs({"content": [{"logprob": "x"}, {"logprob": float("nan")}, {"logprob": 3.0}, 7]}) == []


def _run_with_logprobs(tmp_path, informative=True, n=40, with_field=True):
    rng = np.random.default_rng(3)
    folder = create(tmp_path, "run")
    for i in range(n):
        lp = float(rng.normal(-1, 0.5))
        right = lp > -1.0 if informative else rng.random() < 0.5
        folder.append(record(backend="small", role="local", query_id=f"q{i}", correct=float(right), energy_j=1.0,
                             mean_logprob=lp if with_field else None))
        folder.append(record(backend="big", role="cloud", query_id=f"q{i}", correct=1.0, energy_j=10.0,
                             latency_s=2.0))
    folder.finish("complete")
    return folder.path


def test_compare_shows_the_cascade_when_records_carry_mean_logprob(tmp_path):
    c = compare([_run_with_logprobs(tmp_path)], n_boot=200)
    (x,) = c.cascade
    assert (x.local, x.cloud, x.n_queries) == ("small", "big", 40) and x.auc.value > 0.9
    keys = [t.key for t in render.tables(c)]
    assert {"cascade", "cascade_picks", "cascade_curve"} <= set(keys)
    assert keys.index("cascade") > keys.index("routing")
    doc = json.loads(render.to_json(c))
    assert doc["cascade"][0]["local"] == "small" and len(doc["cascade"][0]["picks"]) == 3
    assert "cascade: local first" in render.to_markdown(c)
    assert any(row.startswith("cascade,small,") for row in render.to_csv(c).splitlines())
    table = [t for t in render.tables(c) if t.key == "cascade_picks"][0]
    energy = table.headers.index("energy saved")
    assert all(row[energy] for row in table.est)  # estimated energy is marked


def test_the_report_shows_the_cascade(tmp_path, run_cli):
    run = _run_with_logprobs(tmp_path)
    code, _, err = run_cli("report", run, "--out", tmp_path / "r.html", "--markdown", tmp_path / "r.md")
    assert code == 0, err
    html = (tmp_path / "r.html").read_text()
    assert "cascade: local first" in html and "cascade (out of sample" in html and "cascade curve" in html
    assert "### cascade (out of sample" in (tmp_path / "r.md").read_text()  # the picks in the short summary


def test_no_cascade_without_mean_logprob(tmp_path):
    c = compare([_run_with_logprobs(tmp_path, with_field=False)], n_boot=200)
    assert c.cascade == () and not [t for t in render.tables(c) if t.key.startswith("cascade")]
    assert json.loads(render.to_json(c))["cascade"] == []


def test_records_written_before_the_field_still_load(tmp_path):
    """A records.jsonl whose lines have no mean_logprob (an older run): its keys are read by the fast path,
    the rows load (the field None), and compare runs without a cascade."""
    folder = create(tmp_path, "old")
    for i in range(3):
        for b, role in (("small", "local"), ("big", "cloud")):
            folder.append(record(backend=b, role=role, query_id=f"q{i}"))
    log = folder.path / "records.jsonl"
    lines = []
    for line in log.read_text().splitlines():
        row = json.loads(line)
        del row["mean_logprob"]
        lines.append(json.dumps(row, ensure_ascii=False))
    log.write_text("".join(x + "\n" for x in lines))
    assert "mean_logprob" not in log.read_text()
    assert len(record_keys(log)) == 6  # the tail the fast path reads is unchanged
    _, frame = load_run(folder.path)
    assert frame["mean_logprob"].isna().all()
    assert QueryRecord.from_row(frame.iloc[0].to_dict()).mean_logprob is None
    folder.finish("complete")
    _, frame = load_run(folder.path)
    assert frame["mean_logprob"].isna().all()
    assert compare([folder.path], n_boot=50).cascade == ()


def test_the_field_goes_through_the_log_and_parquet(tmp_path):
    folder = create(tmp_path, "new")
    folder.append(record(query_id="q0", mean_logprob=-0.75))
    assert len(record_keys(folder.path / "records.jsonl")) == 1  # the fast path's frame still matches
    folder.finish("complete")
    _, frame = load_run(folder.path)
    assert frame["mean_logprob"].tolist() == [-0.75]
    assert list(pd.read_parquet(folder.path / "records.parquet").columns)[-4:] == [
        "mean_logprob", "concurrency", "split_method", "split_uncertainty_j"]


# --- real llama.cpp ------------------------------------------------------------------------------------

def _logprobs_ok(frame):
    lp = frame["mean_logprob"]
    return bool(lp.notna().all() and (lp <= 0).all() and np.isfinite(lp.to_numpy(float)).all())


@pytest.mark.llama
def test_ipw_run_in_process_records_mean_logprob(small_jsonl, tmp_path, run_cli):
    config = tmp_path / "cascade.toml"
    config.write_text(f'dataset = "{small_jsonl}"\nwarmup = 0\nidle_s = 0.0\n[generation]\nmax_tokens = 12\n'
                      '[[backends]]\nname = "smol"\nkind = "llama-cpp"\nmodel = "smollm2-135m"\nrole = "local"\n'
                      'n_threads = 1\nlogprobs = true\n')
    out = tmp_path / "res"
    code, _, err = run_cli("run", config, "--limit", "3", "--out", out)
    assert code == 0, err
    (run,) = out.iterdir()
    manifest, frame = load_run(run)
    assert len(frame) == 3 and _logprobs_ok(frame)
    assert manifest.backends[0]["logprobs"] is True


@pytest.mark.llama
def test_managed_llama_server_gives_mean_logprob_when_asked(tmp_path):
    from test_llama_server import BINARY, SETTINGS, backend_for

    if BINARY is None:
        pytest.skip("llama-server is not built: run `bash .ci/setup`")
    for api in ("chat", "completions"):
        backend = backend_for(tmp_path / api, logprobs=True, api=api)
        try:
            answer = backend.generate("What is 2 + 3? Answer with just the number.", SETTINGS)
            assert answer.mean_logprob is not None and -50 < answer.mean_logprob <= 0, api
            assert backend.sent_params["logprobs"] in (True, 1)
        finally:
            backend.close()
    backend = backend_for(tmp_path / "plain")
    try:
        assert backend.generate("What is 2 + 3?", SETTINGS).mean_logprob is None
        assert "logprobs" not in backend.sent_params
    finally:
        backend.close()


@pytest.mark.llama
def test_in_process_mean_logprob_agrees_with_llama_servers(tmp_path):
    """The in-process log-sum-exp over the logits gives what llama-server reports for the same greedy answer
    (SmolLM2, chat template): to 1e-3 (measured: within 1e-4)."""
    from test_llama_server import BINARY, SETTINGS, backend_for

    from ipw.backends.base import BackendSpec, create_backend

    if BINARY is None:
        pytest.skip("llama-server is not built: run `bash .ci/setup`")
    local = create_backend(BackendSpec("smol", "llama-cpp", "smollm2-135m", options={"logprobs": True, "n_threads": 1}))
    local.load()
    server = backend_for(tmp_path, logprobs=True)
    try:
        for prompt in ("What is 2 + 3? Answer with just the number.", "Name three colors."):
            a, b = local.generate(prompt, SETTINGS), server.generate(prompt, SETTINGS)
            assert a.text == b.text
            assert a.mean_logprob == pytest.approx(b.mean_logprob, abs=1e-3)
    finally:
        local.close()
        server.close()
