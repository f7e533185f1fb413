"""The trained router (issue 44; ipw/analysis/router/, ipw route, ipw compare --router): recovered out of sample
where local correctness depends on a word of the prompt, no false saving where it is random, the router file's
round trip, and bad input (exit 2, one line, nothing written)."""

import json

import numpy as np
import pytest

from ipw.analysis.router.data import route_data
from ipw.analysis.router.evaluate import score_router
from ipw.analysis.router.file import load_router, train
from ipw.analysis.router.model import Featurizer, sklearn_modules
from ipw.errors import IpwError
from ipw.cli import main
from runfolders import create, record

WORDS = ["apple", "river", "stone", "cloud", "green", "music", "table", "light", "paper", "bread", "horse", "glass"]


def write_routing_run(out, run_id, n=120, *, rule="word", seed=1, categories=None, local_role="local",
                      cloud_role="cloud", cloud_correct=None, mid=False):
    """A run of a local and a cloud backend over ``n`` prompts: the local backend is correct exactly when the
    prompt holds the word "easy" (``rule="word"``), or at random (``rule="random"``); the cloud always is
    (or ``cloud_correct``). Local energy 1 J, cloud 10 J."""
    rng = np.random.default_rng(seed)
    folder = create(out, run_id, {"command": ["test"], "config": {},
                                  "dataset": {"name": "fixture", "n_queries": n, "fingerprint": "sha256:route"}})
    t = 0.0
    prompts, local_ok = [], []
    for i in range(n):
        words = list(rng.choice(WORDS, size=6))
        easy = i % 3 == 0
        if easy:
            words.insert(int(rng.integers(0, 6)), "easy")
        elif mid and i % 3 == 1:
            words.insert(int(rng.integers(0, 6)), "medium")
        prompts.append(f"Question {i}: " + " ".join(words) + "?")
        local_ok.append(easy if rule == "word" else bool(rng.random() < 0.5))
    backends = [("small", local_role, 1.0), ("big", cloud_role, 10.0)] + ([("mid", "local", 3.0)] if mid else [])
    for name, role, energy in backends:
        for i, prompt in enumerate(prompts):
            ok = (local_ok[i] if name == "small" else "medium" in prompt or "easy" in prompt if name == "mid"
                  else True if cloud_correct is None else cloud_correct[i])
            folder.append(record(run_id=run_id, backend=name, model=name, role=role, query_id=f"q{i}",
                                 category=(categories[i] if categories else ""), prompt=prompt,
                                 output="a" if ok else "b", correct=float(ok), energy_j=energy,
                                 latency_s=0.5 if name == "small" else 2.0, start_s=t, end_s=t + 1,
                                 hardware_id="hw-test", node="node-1"))
            t += 1.01
    folder.finish("complete")
    return folder.path


def trained(tmp_path):
    """A run whose local correctness a word decides, and a router trained on it (``ipw route train``)."""
    run = write_routing_run(tmp_path, "word")
    router = tmp_path / "router.json"
    assert main(["route", "train", str(run), "--out", str(router), "--no-score"]) == 0
    return run, router


def test_word_rule_is_recovered_out_of_sample(tmp_path):
    run = write_routing_run(tmp_path, "word")
    data = route_data([run])
    assert data.local == ("small",) and data.cloud == "big"
    scores = score_router(data, Featurizer(), n_boot=200)
    s = scores.kfold
    assert s.auc["small"] > 0.9, s.auc
    op = s.operating_point
    # the easy third goes local, with no loss and real savings
    assert 0.25 < op.local_share.value < 0.45
    assert op.accuracy_loss.value < 0.03
    assert op.energy_saved_fraction is not None and op.energy_saved_fraction.value > 0.2
    assert op.energy_saved_fraction.lo > 0.1
    # APGR: a random router gets 0.5; a perfect one here 2/3 (the local backend solves a third)
    assert s.apgr > 0.6 and s.local_share_at_80 is not None and s.local_share_at_80 > 0.25


def test_random_correctness_shows_no_false_saving(tmp_path):
    run = write_routing_run(tmp_path, "random", rule="random", seed=3)
    data = route_data([run])
    scores = score_router(data, Featurizer(), n_boot=200, max_accuracy_loss=0.01)
    s = scores.kfold
    assert 0.3 < s.auc["small"] < 0.7, s.auc
    # accuracy loss grows with the local share: the points that route more lose more
    pts = sorted(s.curve, key=lambda p: p.local_share.value)
    shares = np.array([p.local_share.value for p in pts])
    losses = np.array([p.accuracy_loss.value for p in pts])
    assert np.corrcoef(shares, losses)[0, 1] > 0.9
    assert losses[-1] > 0.3  # all local: ~half wrong
    # within 1% accuracy loss, (almost) nothing goes local
    assert s.operating_point.local_share.value <= 0.05, s.operating_point


def test_cli_train_round_trip_and_score(tmp_path, capsys):
    run = write_routing_run(tmp_path, "word")
    out = tmp_path / "router.json"
    assert main(["route", "train", str(run), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "ipw-router" and doc["format_version"] == 1
    assert doc["trained_on"]["runs"][0]["run_id"] == "word"
    assert doc["trained_on"]["hardware"] == ["hw-test", "node-1"]
    assert {b["role"] for b in doc["trained_on"]["backends"]} == {"local", "cloud"}
    assert doc["scores"]["kfold"]["auc"]["small"] > 0.9
    loaded = load_router(out)
    data = route_data([run])
    trained = train(data)
    for prompt in data.prompts[:40] + ("an easy one", "nothing here"):
        assert loaded.route(prompt) == trained.route(prompt)
        a, b = loaded.probabilities(prompt), trained.probabilities(prompt)
        assert abs(a["small"] - b["small"]) < 1e-9
        # the fast path (one prompt, no stacked matrix) gives what HashingVectorizer's matrix gives
        x = trained.featurizer.transform([prompt], [None])
        assert abs(trained.models[0].proba(x)[0] - b["small"]) < 1e-12
    assert loaded.route("Question 999: easy apple river") == "small"
    assert loaded.route("Question 999: apple river stone") == "big"
    capsys.readouterr()
    assert main(["route", "score", str(run), "--router", str(out), "--max-accuracy-loss", "1%",
                 "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)["trained_router"]["kfold"]
    assert got["operating_point"]["accuracy_loss"]["value"] <= 0.01
    assert got["operating_point"]["energy_saved_fraction"]["value"] > 0.2
    assert got["operating_point"]["cost_saved_fraction"] is None  # no prices given
    assert main(["route", "score", str(run), "--format", "json", "--usd-per-kwh", "0.3", "--api-price", "big=1,2"]) == 0
    got = json.loads(capsys.readouterr().out)["trained_router"]["kfold"]
    assert got["operating_point"]["cost_saved_fraction"]["value"] > 0.2


def test_held_out_category(tmp_path):
    # every third query is easy (i % 3 == 0): categories by (i // 3) % 3, so each holds easy and hard ones
    cats = [["alpha", "beta", "gamma"][(i // 3) % 3] for i in range(120)]
    run = write_routing_run(tmp_path, "cats", categories=cats)
    data = route_data([run])
    scores = score_router(data, Featurizer(("alpha", "beta", "gamma")), n_boot=100)
    ho = scores.held_out_category
    assert ho is not None and [c["category"] for c in ho.by_category] == ["alpha", "beta", "gamma"]
    assert ho.auc["small"] > 0.9  # the word carries over to an unseen category


def _err(capsys):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_bad_input(tmp_path, capsys):
    run, out = trained(tmp_path)
    capsys.readouterr()
    bad = tmp_path / "bad"
    bad.mkdir()
    # another format version
    doc = json.loads(out.read_text())
    (bad / "v2.json").write_text(json.dumps({**doc, "format_version": 2}))
    assert main(["route", "score", str(run), "--router", str(bad / "v2.json")]) == 2
    assert "v2.json" in _err(capsys)
    # features the runs cannot supply: an unknown feature, a category the runs lack
    feats = {**doc["features"], "features": ["ngrams", "embedding"]}
    (bad / "feat.json").write_text(json.dumps({**doc, "features": feats}))
    assert main(["route", "score", str(run), "--router", str(bad / "feat.json")]) == 2
    assert "embedding" in _err(capsys)
    feats = {**doc["features"], "categories": ["x", "y"], "features": ["ngrams", "log_length", "category"]}
    (bad / "cat.json").write_text(json.dumps({**doc, "features": feats}))
    assert main(["route", "score", str(run), "--router", str(bad / "cat.json")]) == 2
    assert "category" in _err(capsys)
    # missing, corrupt
    assert main(["route", "score", str(run), "--router", str(bad / "none.json")]) == 2
    assert "none.json" in _err(capsys)
    (bad / "corrupt.json").write_text('{"format": "ipw-rou')
    assert main(["route", "score", str(run), "--router", str(bad / "corrupt.json")]) == 2
    assert "corrupt.json" in _err(capsys)
    # thresholds outside [0, 1]
    for args in (["route", "train", str(run), "--out", str(bad / "t.json"), "--threshold", "1.5"],
                 ["route", "score", str(run), "--router-threshold", "-0.1"],
                 ["route", "score", str(run), "--max-accuracy-loss", "150%"]):
        assert main(args) == 2
        e = _err(capsys)
        assert "--threshold" in e or "--router-threshold" in e or "--max-accuracy-loss" in e
    # no cloud reference; too few queries; one class only
    nocloud = write_routing_run(tmp_path / "nc", "nocloud", cloud_role="local")
    assert main(["route", "train", str(nocloud), "--out", str(bad / "nc.json")]) == 2
    assert "cloud" in _err(capsys)
    few = write_routing_run(tmp_path / "few", "few", n=12)
    assert main(["route", "train", str(few), "--out", str(bad / "few.json")]) == 2
    assert "--min-queries" in _err(capsys)
    one = write_routing_run(tmp_path / "one", "one", rule="random", seed=5)
    assert main(["route", "train", str(one), "--out", str(bad / "one.json"), "--local", "big", "--cloud",
                 "small"]) == 2  # 'big' is always right: one class
    assert "one class" in _err(capsys)
    written = sorted(p.name for p in bad.iterdir())
    assert written == ["cat.json", "corrupt.json", "feat.json", "v2.json"]


def test_missing_sklearn_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("sklearn"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(IpwError, match=r"ipw\[route\]"):
        sklearn_modules()


def test_compare_shows_the_router_beside_the_oracle(tmp_path, capsys):
    run, out = trained(tmp_path)
    capsys.readouterr()
    assert main(["compare", str(run), "--router", str(out), "--n-boot", "100"]) == 0
    text = capsys.readouterr().out
    assert "oracle (knows each answer: upper bound)" in text and "α-router" in text
    assert "out-of-fold" in text and "APGR" in text
    assert main(["compare", str(run), "--router", str(out), "--n-boot", "100", "--format", "json",
                 "--max-accuracy-loss", "1%"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["routing"]["oracle"] and doc["trained_router"]["kfold"]["auc"]["small"] > 0.9
    assert doc["trained_router"]["kfold"]["operating_point"]["accuracy_loss"]["value"] <= 0.01
    assert main(["compare", str(run), "--router", str(out), "--format", "markdown", "--n-boot", "100"]) == 0
    assert "**trained router**" in capsys.readouterr().out
    assert main(["compare", str(run), "--router", str(out), "--n-boot", "100", "--format", "json",
                 "--usd-per-kwh", "0.3", "--api-price", "big=1,2"]) == 0
    op = json.loads(capsys.readouterr().out)["trained_router"]["kfold"]["operating_point"]
    assert op["cost_saved_fraction"]["value"] > 0.2  # priced as compare prices the oracle
    # on compare's energy basis: the cloud's joules doubled by --pue cloud=2 (facility) save more per local query
    saved = {}
    for basis in ("chip", "facility"):
        assert main(["compare", str(run), "--router", str(out), "--n-boot", "100", "--format", "json",
                     "--router-threshold", "0.5", "--energy-basis", basis, "--pue", "cloud=2"]) == 0
        doc = json.loads(capsys.readouterr().out)["trained_router"]["kfold"]["operating_point"]
        saved[basis] = doc["energy_saved_fraction"]["value"]
    assert saved["facility"] > saved["chip"] > 0, saved
    # bad router input: exit 2, one line, before any work
    assert main(["compare", str(run), "--router", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in _err(capsys)
    assert main(["compare", str(run), "--router", str(out), "--router-threshold", "2"]) == 2
    assert "--router-threshold" in _err(capsys)
    assert main(["compare", str(run), "--router-threshold", "0.5"]) == 2
    assert "--router" in _err(capsys)


@pytest.mark.llama
def test_embedded_default_run_train_compare(tmp_path, run_cli):
    """From a fresh clone: ipw run (the embedded default: SmolLM2 local in process, Gemma behind llama-server as
    the cloud), ipw route train, ipw compare --router. The default's 24 queries are few (SmolLM2 solves ~3): the
    router trains, but its out-of-fold AUC on them is noise; the test checks the pipeline, not the router."""
    out = tmp_path / "res"
    code, _, err = run_cli("run", "--idle-s", "0", "--warmup", "0", "--out", out)
    assert code == 0, err
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    router = tmp_path / "router.json"
    code, stdout, err = run_cli("route", "train", run, "--out", router)
    assert code == 0, ("the embedded default's 24 queries should train a router (both classes: SmolLM2 answers a "
                       f"few of them); got: {err}")
    doc = json.loads(router.read_text())
    assert doc["local"] == ["smollm2-135m"] and doc["cloud"] == "gemma3-270m-server"
    assert doc["trained_on"]["n_queries"] == 24 and doc["trained_on"]["hardware"]
    assert load_router(router).route("What is 2 + 3?") in ("smollm2-135m", "gemma3-270m-server")
    code, stdout, err = run_cli("compare", run, "--router", router, "--n-boot", "200")
    assert code == 0, err
    for text in ("oracle (knows each answer: upper bound)", "α-router", "trained router", "out-of-fold", "AUC"):
        assert text in stdout, text


def test_report_shows_the_router(tmp_path, capsys):
    pytest.importorskip("jinja2")
    run, out = trained(tmp_path)
    html, md = tmp_path / "rep" / "report.html", tmp_path / "rep" / "summary.md"
    assert main(["report", str(run), "--router", str(out), "--out", str(html), "--markdown", str(md)]) == 0
    text = html.read_text()
    assert "trained router, deployable, scored out of fold" in text and "out-of-fold curve" in text
    assert "upper bound" in text
    assert "trained router" in md.read_text()
    capsys.readouterr()
    assert main(["report", str(run), "--router", str(tmp_path / "nope.json"), "--out", str(tmp_path / "x.html")]) == 2
    assert "nope.json" in _err(capsys)
    assert not (tmp_path / "x.html").exists()


def _post(url, body):
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", u.path + "/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    assert resp.status == 200, text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return next(e["usage"]["energy"] for e in events if e.get("usage", {}).get("energy"))


def test_serve_routes_between_two_upstreams(tmp_path):
    """ipw serve --route: a request goes where the router says (a prompt it cannot score: the cloud); the answer
    and the record say which route; the session line counts both and the energy saved (estimated, labeled)."""
    import os

    from openai_stub import Stub

    from ipw.serve import ServeOptions, start

    run, router = trained(tmp_path)
    local, cloud = Stub(), Stub()
    opts = ServeOptions(upstream=local.base_url, name="small", port=0, idle_s=0.2, route=str(router),
                        cloud_upstream=cloud.base_url, cloud_name="big")
    proxy = start(opts, tmp_path / "out", upstream_pids=[os.getpid()], command=["test"])
    try:
        easy = _post(proxy.url, {"prompt": "Question 1: easy apple river stone?", "stream": True, "max_tokens": 4})
        hard = _post(proxy.url, {"prompt": "Question 2: apple river stone music?", "stream": True, "max_tokens": 4})
        odd = _post(proxy.url, {"prompt": [1, 2, 3], "stream": True, "max_tokens": 4})  # token ids: not scorable
    finally:
        line = proxy.stop()
        local.close()
        cloud.close()
    assert easy["route"] == {"to": "local", "backend": "small"}
    assert hard["route"] == {"to": "cloud", "backend": "big"}
    assert odd["route"] == {"to": "cloud", "backend": "big"}
    assert [b["prompt"] for b in local.bodies] == ["Question 1: easy apple river stone?"]
    assert len(cloud.bodies) == 2
    folder = proxy.session.folder.path
    records = [json.loads(x) for x in (folder / "records.jsonl").read_text().splitlines()]
    assert sorted((x["backend"], x["role"]) for x in records) == [("big", "cloud"), ("big", "cloud"),
                                                                   ("small", "local")]
    routing = line["routing"]
    assert routing["local"]["requests"] == 1 and routing["cloud"]["requests"] == 2
    assert routing["unscored_to_cloud"] == 1
    assert routing["routing_ms_per_request"] < 1.0  # hashed features: well under a millisecond
    saved = routing["saved_vs_cloud_only"]
    assert saved is not None and saved["basis"].startswith("estimated")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["backends"][0]["route"]["cloud_name"] == "big"


def test_serve_route_bad_input(tmp_path, capsys):
    run, router = trained(tmp_path)
    capsys.readouterr()
    out = tmp_path / "out"
    for args, word in ((["--route", str(tmp_path / "no.json"), "--local", "http://127.0.0.1:9/v1", "--cloud",
                         "http://127.0.0.1:10/v1"], "no.json"),
                       (["--route", str(router), "--local", "http://127.0.0.1:9/v1"], "--cloud"),
                       (["--route", str(router), "--local", "http://127.0.0.1:9/v1", "--cloud", "http://127.0.0.1:10/v1",
                         "--upstream", "http://127.0.0.1:11/v1"], "--upstream")):
        assert main(["serve", "--port", "0", "--out", str(out), *args]) == 2
        assert word in _err(capsys)
    assert not out.exists()


@pytest.mark.llama
def test_serve_routes_between_two_real_llama_servers(tmp_path):
    """ipw serve --route in front of two real llama.cpp servers (SmolLM2 as local, Gemma as cloud): each request
    goes where the router says, and the folder holds both routes' records with their energy."""
    import os

    from ipw.backends.base import BackendSpec, create_backend
    from ipw.backends.servers import find_llama_server
    from ipw.errors import IpwError
    from ipw.serve import ServeOptions, start

    try:
        find_llama_server()
    except IpwError:
        pytest.skip("llama-server is not built: run `bash .ci/setup`")
    run, router = trained(tmp_path)
    servers = []
    try:
        for name, model in (("smol", "smollm2-135m"), ("gemma", "gemma3-270m")):
            b = create_backend(BackendSpec(name, "openai", model, options={
                "server": "llama-server", "n_threads": 1, "n_ctx": 256, "concurrency": 2, "server_timeout_s": 300.0}))
            b.attach(tmp_path / name)
            b.load()
            servers.append(b)
        pids = [p for b in servers for p in b.pids()]
        opts = ServeOptions(upstream=servers[0].base_url, name="small", port=0, idle_s=0.3, route=str(router),
                            cloud_upstream=servers[1].base_url, cloud_name="big")
        proxy = start(opts, tmp_path / "out", upstream_pids=pids or [os.getpid()], command=["test"])
        try:
            routes = [_post(proxy.url, {"prompt": p, "stream": True, "max_tokens": 8, "temperature": 0})["route"]["to"]
                      for p in ("Question 1: easy apple river?", "Question 2: apple river stone?",
                                "Question 3: stone easy music?", "Question 4: music table light?")]
        finally:
            line = proxy.stop()
    finally:
        for b in servers:
            b.close()
    assert routes == ["local", "cloud", "local", "cloud"]
    records = [json.loads(x) for x in (proxy.session.folder.path / "records.jsonl").read_text().splitlines()]
    by = {}
    for x in records:
        by.setdefault((x["backend"], x["role"]), []).append(x)
    assert set(by) == {("small", "local"), ("big", "cloud")}
    for rows in by.values():
        assert all(x["error"] is None and x["energy_j"] and x["energy_j"] > 0 for x in rows), rows
    assert line["routing"]["local"]["requests"] == 2 and line["routing"]["cloud"]["requests"] == 2
    assert line["routing"]["saved_vs_cloud_only"] is not None


def test_several_local_backends_cheapest_first(tmp_path):
    """Two local backends: 'small' (1 J) answers the easy prompts, 'mid' (3 J) the easy and the medium ones; a
    query goes to the cheapest one predicted to answer."""
    run = write_routing_run(tmp_path, "mid", mid=True)
    data = route_data([run])
    assert data.local == ("small", "mid") and data.cloud == "big"
    router = train(data)
    assert router.route("Question 500: easy apple river") == "small"
    assert router.route("Question 500: medium apple river") == "mid"
    assert router.route("Question 500: apple river stone") == "big"
    s = score_router(data, Featurizer(), n_boot=100, max_accuracy_loss=0.02).kfold
    assert min(s.auc.values()) > 0.9
    # two thirds can go local with no loss (the ideal); within 2 points the router keeps most of that
    assert s.operating_point.local_share.value > 0.5 and s.operating_point.accuracy_loss.value <= 0.02
