"""ipw report: fixture run folders written with ipw.results; the HTML and Markdown are checked as text
here, and rendered in headless Chromium in tests/analysis/test_report_browser.py."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jinja2")
pytest.importorskip("matplotlib")

from ipw.analysis import report, report_data, report_plots
from runfolders import create, record

XSS_OUTPUT = "<script>window.__xss=1</script>"
XSS_IMG = "<img src=x onerror=\"window.__xss_img=1\">"
XSS_PROMPT = "What is </pre><b>bold</b> & \"quoted\"? <script>window.__xss_prompt=1</script>"
CATEGORIES = ["arithmetic", "science", "strings", "money $^$"]  # a "$" that matplotlib must not parse


def _manifest(run_id: str, backends: list[dict], n: int, quality: str) -> dict:
    source = {"measured": "nvml.counter", "estimated": "model.cpu"}[quality]
    return {
        "command": ["ipw", "run", "--fixture"], "config": {"source": "fixture.toml", "repeats": 1, "warmup": 0,
                                                          "idle_s": 5.0, "generation": {"max_tokens": 48}},
        "dataset": {"name": "fixture", "n_queries": n, "fingerprint": "sha256:fixture"},
        "hardware": {"cpu_model": "Test CPU <b>9000</b>", "cpu_logical_cores": 8, "memory_gib": 64.0,
                     "gpus": [{"name": "Test GPU", "memory_gib": 80.0}] if quality == "measured" else [],
                     "nvidia_driver": "555.1" if quality == "measured" else None},
        "software": {"ipw": "0.1.0", "python": "3.11.7", "packages": {"numpy": "2.0", "vllm": None}},
        "started_at": "2026-01-01T00:00:00",
        "backends": [{
            "name": b["name"], "kind": "llama-cpp", "model": b["name"], "role": b["role"], "load_s": 0.5,
            "engine": "llama-cpp-python", "engine_version": "0.3.36", "mode": "chat",
            "sensors": [{"name": "nvml" if quality == "measured" else "cpu_model", "available": True,
                         "source": source, "quality": quality, "scope": "gpu" if quality == "measured" else
                         "cpu_package", "components": ["c0"], "detail": "fixture sensor"}],
            "idle_baseline": {"power_w": {"c0": 12.5}, "spread_w": {"c0": 0.4}, "duration_s": 5.0},
            **({"sampler_overhead": {"nvml": {"cpu_s": 0.2, "wall_s": 20.0, "cpu_fraction_of_one_core": 0.01}}}
               if quality == "measured" else {}),
        } for b in backends],
    }


def write_run(out: Path, run_id: str, backends: list[dict], n: int, *, quality: str, power: bool,
              xss_backend: str | None = None, seed: int = 0, finish: bool = True) -> Path:
    """A run folder with ``n`` queries per backend. ``backends``: name, role, skill, joules per token."""
    rng = np.random.default_rng(seed)
    folder = create(out, run_id, _manifest(run_id, backends, n, quality))
    t = 100.0
    for b in backends:
        for i in range(n):
            tokens = int(rng.integers(5, 60))
            duration = 0.05 + tokens * 0.01
            energy = b["j_per_token"] * tokens * float(rng.lognormal(0, 0.1))
            correct = float(rng.random() < b["skill"])
            output = "42" if correct else "41"
            prompt = f"Question {i}: what is 6 x 7?"
            if b["name"] == xss_backend and i == 0:
                output, correct, energy = f"{XSS_OUTPUT} and {XSS_IMG}", 0.0, 1000.0  # the costliest, and wrong
                prompt = XSS_PROMPT
            error = "timeout after 120 s" if (b["name"] == xss_backend and i == 1) else None
            if error:
                energy = 800.0  # the second costliest
            folder.append(record(
                run_id=run_id, backend=b["name"], model=b["name"], role=b["role"], query_id=f"q{i:03d}",
                category=CATEGORIES[i % len(CATEGORIES)], prompt=prompt, answer="42", output=output,
                correct=0.0 if error else correct, error=error, error_category="timeout" if error else None,
                prompt_tokens=12, completion_tokens=tokens, ttft_s=0.02, latency_s=duration, start_s=t,
                end_s=t + duration, energy_j=energy, energy_quality=quality,
                energy_source="nvml.counter" if quality == "measured" else "model.cpu",
                energy_scope="gpu" if quality == "measured" else "cpu_package", net_energy_j=energy * 0.5))
            t += duration + 0.01
        if power:
            ts = np.arange(100.0 - 1.0, t + 1.0, 0.02)
            folder.add_power(b["name"], {"t_s": ts, "device": np.full(ts.size, "gpu0", dtype=object),
                                         "power_w": 150 + 100 * np.sin(ts), "kind": np.full(ts.size, "sample",
                                                                                          dtype=object),
                                         "energy_j": np.full(ts.size, np.nan)})
    if finish:
        folder.finish("complete")
    return folder.path


def fixture_runs(out: Path, n: int = 40) -> list[Path]:
    """Run A (measured, with power.parquet): a cloud and a local backend; run B (estimated, no
    power.parquet): a small local backend whose costliest, wrong answer is an XSS payload."""
    a = write_run(out, "run-a", [{"name": "cloud-xl", "role": "cloud", "skill": 0.9, "j_per_token": 5.0},
                                 {"name": "local-mid", "role": "local", "skill": 0.7, "j_per_token": 1.0}],
                  n, quality="measured", power=True, seed=1)
    b = write_run(out, "run-b", [{"name": "local-small", "role": "local", "skill": 0.5, "j_per_token": 0.3}],
                  n, quality="estimated", power=False, xss_backend="local-small", seed=2)
    return [a, b]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    runs = fixture_runs(out / "runs")
    html, md = out / "report.html", out / "summary.md"
    ctx = report.write(runs, html, md)
    return ctx, html.read_text(encoding="utf-8"), md.read_text(encoding="utf-8")


def test_every_plot_is_made_and_inlined(built):
    ctx, html, _ = built
    keys = {f["key"] for f in ctx["figures"]}
    assert keys == {"pareto", "ipj", "energy_tokens", "power_run-a", "power_run-b", "coverage", "savings",
                    "categories"}
    srcs = re.findall(r'<img src="([^"]*)"', html)
    assert len(srcs) == len(keys)
    assert all(s.startswith("data:image/png;base64,") for s in srcs)


def test_self_contained_and_no_script(built):
    _, html, _ = built
    assert "<script" not in html.lower().replace("&lt;script", "")  # only escaped payloads
    for attr in re.findall(r'(?:src|href)="([^"]*)"', html):
        assert attr.startswith("data:"), attr
    assert "url(" not in html and "@import" not in html and "http://" not in html and "https://" not in html
    assert "default-src 'none'" in html


def test_dataset_and_model_text_is_escaped(built):
    _, html, _ = built
    assert "&lt;script&gt;window.__xss=1&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=" in html
    assert "&lt;/pre&gt;&lt;b&gt;bold&lt;/b&gt; &amp; &#34;quoted&#34;?" in html
    assert "Test CPU &lt;b&gt;9000&lt;/b&gt;" in html  # manifest text too
    assert "<b>bold</b>" not in html and "<img src=x" not in html


def test_content_what_ran_and_tables(built):
    ctx, html, _ = built
    for text in ("Test GPU", "nvml.counter", "model.cpu", "12.5 ± 0.4 W", "1.00% of one core", "fixture.toml",
                 "sha256:fixture", "oracle energy saved", "coverage within a power envelope", "router curve",
                 "The costliest answers", "Wrong or failed answers", "timeout after 120 s"):
        assert text in html, text
    compare_table = ctx["tables"][0]
    assert compare_table["headers"] == ["metric", "cloud-xl", "local-mid", "local-small"]
    rows = {row[0]["text"]: row for row in compare_table["rows"]}
    assert [c["est"] for c in rows["J/query"][1:]] == [False, False, True]  # only the estimated backend
    assert not any(c["est"] for c in rows["accuracy"])
    assert "[" in rows["J/query"][1]["text"]  # the CI from ipw.compare
    # the costliest answer is the payload, marked estimated
    top = ctx["costliest"]["rows"][0]
    assert top["label"] == "local-small" and top["est"] and XSS_OUTPUT in top["output"]
    assert ctx["wrong"]["note"].startswith("showing the 20 costliest of")


def test_estimated_is_marked_in_every_energy_plot(built):
    ctx, html, _ = built
    marked = {f["key"] for f in ctx["figures"] if f["estimated"]}
    # run-a's power plot is a measured power.parquet trace; everything that shows local-small is marked
    assert marked == {"pareto", "ipj", "energy_tokens", "power_run-b", "coverage", "savings", "categories"}
    assert html.count('class="tag">estimated energy</span>') == len(marked)
    assert "Estimated energy." in html


def test_numbers_come_from_compare(built, tmp_path):
    from ipw.analysis.compare import compare
    from ipw.analysis.render import tables, to_dict

    ctx, _, md = built
    d = to_dict(compare([r["path"] for r in ctx["runs"]]))
    assert [b["metrics"] for b in ctx["backends"]] == [b["metrics"] for b in d["backends"]]
    assert ctx["routing"] == d["routing"]
    first = tables(compare([r["path"] for r in ctx["runs"]]))[0]
    assert [[c["text"] for c in row] for row in ctx["tables"][0]["rows"]] == first[2]


def test_markdown_summary(built):
    _, _, md = built
    assert md.startswith("## ipw report: run-a, run-b")
    assert "| J/query |" in md and "*(estimated)*" in md
    assert "routing (oracle" in md and "oracle energy saved" in md
    assert "Test CPU &lt;b&gt;9000&lt;/b&gt;" in md  # inline HTML is shown as text (GitHub would render it)
    assert len(md) < 20_000  # fits a PR comment / job summary


def test_markdown_escapes_pipes(tmp_path):
    assert report._md_cell("a|b\n<c>") == "a\\|b &lt;c&gt;"


def test_pareto_frontier():
    pts = [(1.0, 0.5), (2.0, 0.4), (3.0, 0.8), (3.0, 0.9), (5.0, 0.9), (0.5, 0.2)]
    assert report_plots.pareto_frontier(pts) == [5, 0, 3]


def test_caps_and_downsampling(tmp_path, monkeypatch):
    monkeypatch.setattr(report_plots, "MAX_POINTS", 50)
    monkeypatch.setattr(report_plots, "MAX_WINDOWS", 30)
    monkeypatch.setattr(report_plots, "MAX_BOUNDARIES", 20)
    monkeypatch.setattr(report_data, "MAX_ROWS", 5)
    runs = fixture_runs(tmp_path / "runs", n=120)
    ctx = report.build(runs)
    figs = {f["key"]: f for f in ctx["figures"]}
    assert "50 of 120 records" in figs["energy_tokens"]["caption"]
    assert "boundaries not drawn one by one" in figs["power_run-b"]["caption"]
    assert "binned into 30 steps" in figs["power_run-b"]["caption"]
    assert len(ctx["costliest"]["rows"]) == 5 and "showing the 5 costliest of 360" in ctx["costliest"]["note"]


def test_cli(run_cli, tmp_path):
    runs = fixture_runs(tmp_path / "runs", n=12)
    out, md = tmp_path / "r" / "out.html", tmp_path / "s.md"
    code, _, err = run_cli("report", *runs, "--out", out, "--markdown", md, "--reference", "cloud-xl")
    assert code == 0, err
    assert out.exists() and md.exists() and "out.html" in md.read_text()
    assert str(out) in err


def test_cli_errors(run_cli, tmp_path):
    code, _, err = run_cli("report", tmp_path / "nope", "--out", tmp_path / "x.html")
    assert code == 2 and "not a run folder" in err
    runs = fixture_runs(tmp_path / "runs", n=12)
    code, _, err = run_cli("report", *runs, "--reference", "nobody", "--out", tmp_path / "x.html")
    assert code == 2 and "nobody" in err


def test_manifest_without_optional_fields(tmp_path):
    """A bare run (no hardware, sensors or idle baseline in the manifest, one backend) still renders."""
    folder = create(tmp_path, "bare", {"command": ["x"], "config": {}})
    for i in range(3):
        folder.append(record(run_id="bare", query_id=str(i), prompt_tokens=1, completion_tokens=2, ttft_s=None,
                             latency_s=0.1, start_s=i, end_s=i + 0.1, energy_j=None))
    folder.finish("complete")
    ctx = report.write([folder.path], tmp_path / "bare.html")
    assert ctx["routing"] is None and "routing plots need" in (tmp_path / "bare.html").read_text()
    assert {f["key"] for f in ctx["figures"]} <= {"categories"}
    json.dumps(ctx["tables"])  # plain data


def test_unfinished_run_from_its_log(tmp_path):
    """A run still running (records.jsonl only, no records.parquet) is reported from its log."""
    path = write_run(tmp_path, "live", [{"name": "local-small", "role": "local", "skill": 0.5, "j_per_token": 0.3}],
                     8, quality="estimated", power=False, xss_backend="local-small", finish=False)
    assert not (path / "records.parquet").exists()
    ctx = report.write([path], tmp_path / "live.html")
    assert XSS_OUTPUT in ctx["costliest"]["rows"][0]["output"]
    assert ctx["wrong"]["rows"][1]["error"] == "timeout after 120 s"
    assert "&lt;script&gt;window.__xss=1" in (tmp_path / "live.html").read_text()


def test_missing_dependency_is_a_usage_error(monkeypatch, run_cli, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import fails
    code, _, err = run_cli("report", tmp_path, "--out", tmp_path / "x.html")
    assert code == 2 and "matplotlib is missing" in err and "report extra" in err


def test_energy_tokens_fit_is_compares(tmp_path, monkeypatch):
    """The report's energy-against-tokens lines are compare's fit (per query, errored queries left out), as its
    caption says, not a fit of its own over the records."""
    from ipw.analysis.compare import compare

    runs = fixture_runs(tmp_path / "runs")
    seen = {}
    draw = report_plots.plot_energy_tokens
    monkeypatch.setattr(report_plots, "plot_energy_tokens",
                        lambda p, frame, fits: (seen.update(fits), draw(p, frame, fits)))
    ctx = report.build(runs)
    expected = {label: fits["energy"] for label, fits in compare(runs).models.items()}
    assert repr(seen) == repr(expected)  # (repr: a fit that cannot be made is NaN, and NaN != NaN)
    assert set(seen) == {"cloud-xl", "local-mid", "local-small"}
    caption = {f["key"]: f for f in ctx["figures"]}["energy_tokens"]["caption"]
    assert "the same least-squares fit ipw compare reports" in caption
