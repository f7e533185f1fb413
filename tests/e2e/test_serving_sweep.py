"""`ipw run --concurrency 1,4` against the real batching llama.cpp server (llama-server, built by
.ci/setup): each level is measured on its own, requests at level 4 overlap, and the energy measured while
they overlap is split among them by the server's own timings and conserved (docs/ARCHITECTURE.md, 'Energy method';
docs/SERVING.md)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from ipw.errors import IpwError

pytestmark = pytest.mark.llama


def _server_binary() -> str:
    from ipw.backends.servers import find_llama_server

    try:
        return find_llama_server()
    except IpwError as exc:
        pytest.skip(f"llama-server is not built here ({exc}); bash .ci/setup builds it")


def test_sweep_against_llama_server_overlaps_and_conserves(tmp_path, run_cli):
    _server_binary()
    rows = [{"id": f"q{i}", "prompt": f"What is {i} + {i}? Answer with just the number.", "answer": str(2 * i),
             "scorer": "numeric", "category": "arithmetic"} for i in range(8)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "s.toml"
    cfg.write_text(
        f'dataset = "{data}"\nout_dir = "{tmp_path / "res"}"\nwarmup = 1\nidle_s = 0.5\n'
        '[generation]\nmax_tokens = 24\n'
        '[[backends]]\nname = "smol-batching"\nkind = "openai"\nmodel = "smollm2-135m"\nrole = "cloud"\n'
        'server = "llama-server"\nn_threads = 2\nn_ctx = 1024\ntimeout_s = 120.0\n')
    code, _, err = run_cli("run", cfg, "--concurrency", "1,4")
    assert code == 0, err
    (run_dir,) = list((tmp_path / "res").iterdir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    (info,) = manifest["backends"]
    assert info["server"]["kind"] == "llama-server" and info["server"]["parallel"] == 4
    frame = pd.read_parquet(run_dir / "records.parquet")
    assert sorted(frame.groupby("concurrency").size().items()) == [(1, 8), (4, 8)]
    assert frame["error"].isna().all(), frame["error"].dropna().tolist()

    levels = {line["concurrency"]: line for line in info["levels"]}
    assert sorted(levels) == [1, 4]
    for c, line in levels.items():
        recs = frame[frame["concurrency"] == c].sort_values("start_s")
        # each level has its own idle baseline, measured before it, and its own span
        assert line["idle_baseline"]["duration_s"] == 0.5
        assert line["start_s"] <= recs["start_s"].min() and recs["end_s"].max() <= line["end_s"]
        starts, ends = recs["start_s"].to_numpy(), recs["end_s"].to_numpy()
        overlapping = [(i, j) for i in range(8) for j in range(i + 1, 8) if starts[j] < ends[i] and starts[i] < ends[j]]
        if c == 1:
            assert not overlapping and set(recs["split_method"]) == {""}
        else:  # requests overlap: their windows intersect, and up to 4 are in flight
            assert len(overlapping) >= 4
            assert max(sum((s <= t) & (t < e) for s, e in zip(starts, ends)) for t in starts) >= 2
            # overlapping requests were split by priced work, their prompts timed by llama-server's timings
            assert set(recs["split_method"]) <= {"priced", ""} and "priced" in set(recs["split_method"])
            assert recs.loc[recs["split_method"] == "priced", "split_uncertainty_j"].notna().all()
        # conserved, per component: the requests' parts plus the unattributed windows are the span's energy
        for component, tally in line["energy"].items():
            assert tally["span_j"] > 0
            assert tally["parts_j"] + tally["unattributed_j"] == pytest.approx(tally["span_j"], rel=1e-6, abs=1e-6)
            parts = sum(p["energy_j"] for parts in recs["energy_parts"] for p in json.loads(parts)
                        if p["component"] == component)
            assert parts == pytest.approx(tally["parts_j"], rel=1e-6, abs=1e-6)
